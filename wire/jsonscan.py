"""What msgspec does not check in a JSON document: repeated keys, depth, NUL in free text.

msgspec keeps the last of two equal keys (``{"seq": 1025, "seq": 3}`` decodes as seq 3),
decodes a free-form value (``Any``) to any depth until Python's recursion limit stops it,
and applies no pattern inside one. :func:`scan` walks the document's tokens once and names
the first such problem and its JSON path. It is pure Python (tens of microseconds for a
1 KB message), so :func:`wire.messages.decode` runs it only when a cheap test says it may
find something: see there.

The document must already be valid JSON (msgspec parsed it, or failed only for depth).
"""

from __future__ import annotations

import json
import re

_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:,]')
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_QUOTE, _OPEN_OBJ, _OPEN_ARR, _CLOSE_OBJ, _CLOSE_ARR, _COMMA = b'"{[}],'


class _Frame:
    """One open object or array: the keys seen so far, and where in it the scan is."""

    __slots__ = ("expect_key", "index", "is_object", "key", "keys")

    def __init__(self, is_object: bool) -> None:
        self.is_object = is_object
        self.keys: set[str] = set()
        self.key = ""
        self.index = 0
        self.expect_key = is_object


def printable(text: str) -> str:
    """``text`` with NUL and the other control characters escaped (``\\u0000``): a reason
    or path that quotes input must never carry them into a store or a log line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in text)


def _text(token: bytes) -> str:
    if b"\\" not in token:
        return token[1:-1].decode("utf-8", "replace")
    value: str = json.loads(token)
    return value


def _step(frame: _Frame) -> str:
    if not frame.is_object:
        return f"[{frame.index}]"
    if _PLAIN_KEY.match(frame.key):
        return f".{frame.key}"
    return f"[{printable(json.dumps(frame.key, ensure_ascii=False))}]"


def _path(stack: list[_Frame]) -> str:
    """msgspec's notation: ``$.detail.a[2]``; a key that is not an identifier in brackets."""
    return "$" + "".join(_step(f) for f in stack)


def scan(payload: bytes, *, max_depth: int) -> tuple[str, str] | None:
    """``(reason, where)`` of the first repeated key, container nested deeper than
    ``max_depth`` (the top-level value is depth 1) or string holding NUL; ``None`` if none.

    Keys compare as decoded text, so ``"a"`` and ``"\\u0061"`` are the same key.
    """
    stack: list[_Frame] = []
    for match in _TOKEN.finditer(payload):
        token = match.group()
        c = token[0]
        if c == _QUOTE:
            text = _text(token)
            frame = stack[-1] if stack else None
            if frame is not None and frame.expect_key:
                frame.key, frame.expect_key = text, False
                if text in frame.keys:
                    shown = printable(json.dumps(text, ensure_ascii=False))
                    return f"duplicate key {shown}", _path(stack)
                frame.keys.add(text)
                if "\x00" in text:
                    return "a key holds a NUL character (\\u0000)", _path(stack)
            elif "\x00" in text:
                return "text holds a NUL character (\\u0000)", _path(stack)
        elif c in (_OPEN_OBJ, _OPEN_ARR):
            if len(stack) >= max_depth:
                return f"nested deeper than {max_depth} levels", _path(stack)
            stack.append(_Frame(c == _OPEN_OBJ))
        elif c in (_CLOSE_OBJ, _CLOSE_ARR):
            if stack:
                stack.pop()
        elif c == _COMMA and stack:
            frame = stack[-1]
            if frame.is_object:
                frame.expect_key = True
            else:
                frame.index += 1
    return None
