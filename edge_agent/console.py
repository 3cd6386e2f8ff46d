"""Rich consoles for the command-line tools (``edge-agent``, ``fleet``, the demo).

On a terminal rich fits the output to its width. Into a pipe or a file there is no width
to fit, and rich's default of 80 columns broke summaries and table rows mid-phrase: there a
console neither wraps text nor narrows tables.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

#: The width a console lays tables out in when not on a terminal: wider than any line ours
#: print, so nothing is broken (a table still takes only the width its cells need).
UNWRAPPED_WIDTH = 10_000


def make_console(*, stderr: bool = False, **options: Any) -> Console:
    """A :class:`~rich.console.Console` on stdout (or stderr) that wraps only on a terminal.

    ``options`` go to ``Console`` as they are (``highlight=False``, ``file=...``). Whether
    the stream is a terminal is decided here, once, as rich itself decides it.
    """
    console = Console(stderr=stderr, **options)
    if not console.is_terminal:
        console.width = UNWRAPPED_WIDTH
        console.soft_wrap = True
    return console


__all__ = ["UNWRAPPED_WIDTH", "make_console"]
