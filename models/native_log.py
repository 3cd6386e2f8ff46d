"""Keep the TFLite runtime's own INFO chatter out of our stderr.

The C++ runtime writes ``INFO: Created TensorFlow Lite XNNPACK delegate for CPU.`` straight
to file descriptor 2 when an interpreter gets its delegate: Python's logging never sees it,
and neither LiteRT 2.3 nor ``tflite_runtime`` honours ``TF_CPP_MIN_LOG_LEVEL`` for it.
:func:`runtime_stderr_to_log` points fd 2 at a temporary file while interpreters are made,
then writes back everything except the runtime's ``INFO:`` lines, which go to this module's
logger at DEBUG. The runtime's warnings and errors still reach stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
#: How the runtime's minimal logger starts an INFO line. Python's logging lines here start
#: with a time (the CLIs' format) or ``INFO:name:`` (logging's default), never this.
_CHATTER = b"INFO: "


@contextlib.contextmanager
def runtime_stderr_to_log() -> Iterator[None]:
    """Run the body with the runtime's INFO lines on fd 2 turned into DEBUG log records.

    fd 2 belongs to the whole process: what another thread writes to stderr meanwhile is held
    and written out right after (late by the time an interpreter takes to build), never lost.
    One redirection at a time (a lock); fd 2 is restored whatever happens inside.
    """
    with _LOCK:
        try:
            saved = os.dup(2)
        except OSError:  # no stderr at all: nothing to keep clean
            yield
            return
        try:
            with tempfile.TemporaryFile() as held:
                _flush()
                os.dup2(held.fileno(), 2)
                try:
                    yield
                finally:
                    _flush()
                    os.dup2(saved, 2)
                    held.seek(0)
                    _replay(held.read())
        finally:
            os.close(saved)


def _flush() -> None:
    if sys.stderr is not None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()


def _replay(data: bytes) -> None:
    keep: list[bytes] = []
    for line in data.splitlines(keepends=True):
        if line.startswith(_CHATTER):
            log.debug("runtime: %s", line.decode("utf-8", "replace").rstrip())
        else:
            keep.append(line)
    out = b"".join(keep)
    while out:
        try:
            n = os.write(2, out)
        except OSError:
            return
        out = out[n:]


__all__ = ["runtime_stderr_to_log"]
