"""CAN captures read line by line: candump ``-l`` logs and Vector ``.asc`` files.

A real capture has torn last lines, comments and the odd garbled record. A malformed line
raises :class:`MalformedLine` with a short reason (``timestamp``, ``id``, ``data``, ...); the
:class:`CaptureReader` either stops there (``strict``) or counts it per reason and reads on,
so one bad line never costs the rest of the file.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final, TextIO

import can

from drivers.errors import ReplayError

#: Lines starting with these are comments, skipped without counting.
_COMMENTS: Final = ("#", "//", ";")
#: Data lengths a CAN FD frame may have.
_FD_LENGTHS: Final = frozenset((*range(9), 12, 16, 20, 24, 32, 48, 64))
_HEX: Final = re.compile(r"[0-9A-Fa-f]*")
_CAN_ERR_FLAG: Final = 0x20000000
_CANFD_BRS: Final = 0x01
_CANFD_ESI: Final = 0x02


class MalformedLine(ValueError):
    """A line that is not a CAN record. ``reason`` is a short name for counting."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _hex_bytes(text: str, what: str) -> bytes:
    if len(text) % 2:
        raise MalformedLine("odd_hex_digits", f"{what} {text!r} has an odd number of hex digits")
    if not _HEX.fullmatch(text):
        raise MalformedLine("data", f"{what} {text!r} is not hex")
    return bytes.fromhex(text)


def parse_candump_line(line: str) -> can.Message | None:
    """The frame on one ``candump -l`` line, ``None`` for a blank line or a comment.

    The format is ``(SECONDS) IFACE FRAME [R|T]`` where FRAME is ``ID#DATA`` (classic),
    ``ID#R[DLC]`` (remote) or ``ID##F DATA`` (CAN FD, F the flags nibble); ``ID`` has 3 hex
    digits (11-bit) or 8 (29-bit, or an error frame with the error flag set).

    candump lines are parsed here (:func:`parse_candump_line`), strictly: python-can's reader
    pads a data field with an odd number of hex digits (``700#D02341AF870`` became 6 bytes ending
    ``0x00``) and lets a 3-digit id past 0x7FF through. ``.asc`` lines go through python-can's
    ``ASCReader``, which keeps the header's state (number base, start time) across lines.
    """
    text = line.strip()
    if not text or text.startswith(_COMMENTS):
        return None
    fields = text.split()
    is_rx = True
    if len(fields) == 4 and fields[3] in ("R", "T", "r", "t"):
        is_rx = fields.pop().upper() == "R"
    stamp = fields[0]
    if not (stamp.startswith("(") and stamp.endswith(")")):
        raise MalformedLine("timestamp", f"no '(seconds)' at the start of {text[:60]!r}")
    if len(fields) != 3:
        raise MalformedLine("format", f"expected '(seconds) iface id#data', got {text[:60]!r}")
    _, channel, frame = fields
    try:
        timestamp = float(stamp[1:-1])
    except ValueError:
        raise MalformedLine("timestamp", f"{stamp[:40]!r} is not a number") from None
    if not math.isfinite(timestamp):
        raise MalformedLine("timestamp", f"{stamp[:40]!r} is not a finite number")
    id_text, sep, data = frame.partition("#")
    if not sep:
        raise MalformedLine("format", f"no '#' between id and data in {frame[:40]!r}")
    if len(id_text) not in (3, 8) or not _HEX.fullmatch(id_text):
        raise MalformedLine("id", f"{id_text[:20]!r} is not a 3- or 8-digit hex id")
    can_id = int(id_text, 16)
    extended = len(id_text) == 8
    if can_id & _CAN_ERR_FLAG:
        return can.Message(timestamp=timestamp, is_error_frame=True, channel=channel)
    if (not extended and can_id > 0x7FF) or can_id > 0x1FFFFFFF:
        raise MalformedLine("id", f"{id_text!r} is out of range for a {len(id_text)}-digit id")
    common: dict[str, Any] = {
        "timestamp": timestamp,
        "arbitration_id": can_id,
        "is_extended_id": extended,
        "is_rx": is_rx,
        "channel": channel,
    }
    if data[:1] in ("R", "r"):
        dlc_text = data[1:]
        if dlc_text and not (len(dlc_text) == 1 and dlc_text in "012345678"):
            raise MalformedLine("data", f"remote frame length {dlc_text!r} is not 0-8")
        return can.Message(
            **common,
            is_remote_frame=True,
            dlc=int(dlc_text or 0),
        )
    if data.startswith("#"):
        flags = data[1:2]
        if not flags or flags not in "0123456789ABCDEFabcdef":
            raise MalformedLine("data", f"CAN FD flags {flags!r} are not one hex digit")
        payload = _hex_bytes(data[2:], "data")
        if len(payload) not in _FD_LENGTHS:
            raise MalformedLine("length", f"{len(payload)} bytes is not a CAN FD length")
        fd_flags = int(flags, 16)
        return can.Message(
            **common,
            is_fd=True,
            bitrate_switch=bool(fd_flags & _CANFD_BRS),
            error_state_indicator=bool(fd_flags & _CANFD_ESI),
            data=payload,
        )
    payload = _hex_bytes(data, "data")
    if len(payload) > 8:
        raise MalformedLine("length", f"{len(payload)} bytes in a classic CAN frame (max 8)")
    return can.Message(**common, data=payload)


class _Lines:
    """The file's lines, numbered, with room to push one back (see ``_read_asc``)."""

    def __init__(self, file: TextIO) -> None:
        self._file = file
        self._pushed: list[str] = []
        self.number = 0
        self.current = ""

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        if self._pushed:
            return self._pushed.pop()
        self.current = next(self._file)
        self.number += 1
        return self.current

    def push(self, line: str) -> None:
        self._pushed.append(line)

    def close(self) -> None:
        """python-can's reader closes its file at the end; the owner of the file does."""


class CaptureReader:
    """Frames of one pass over a capture, with malformed lines counted per reason.

    ``strict`` raises :class:`ReplayError` at the first malformed line (naming it); otherwise
    the line is skipped, counted in :attr:`malformed` and, for the first few, kept in
    :attr:`examples` as ``(line number, reason)`` for the log.
    """

    EXAMPLES: Final = 5

    def __init__(self, path: Path, *, strict: bool = False) -> None:
        suffix = path.suffix.lower()
        if suffix not in (".log", ".asc"):
            raise ReplayError(
                f"capture {path}: unknown format {path.suffix!r}; "
                f"expected .log (candump -l) or .asc (Vector ASCII)"
            )
        if not path.is_file():
            raise ReplayError(f"capture {path}: no such file")
        self.path = path
        self.strict = strict
        self.malformed: Counter[str] = Counter()
        self.examples: list[tuple[int, str]] = []

    def __iter__(self) -> Iterator[can.Message]:
        try:
            with self.path.open(encoding="utf-8", errors="replace", newline=None) as file:
                lines = _Lines(file)
                if self.path.suffix.lower() == ".log":
                    yield from self._read_candump(lines)
                else:
                    yield from self._read_asc(lines)
        except OSError as exc:
            raise ReplayError(f"capture {self.path}: cannot read: {exc.strerror or exc}") from exc

    def _bad(self, number: int, exc: Exception) -> None:
        reason = exc.reason if isinstance(exc, MalformedLine) else "format"
        if self.strict:
            raise ReplayError(f"capture {self.path}: line {number}: malformed: {exc}") from exc
        self.malformed[reason] += 1
        if len(self.examples) < self.EXAMPLES:
            self.examples.append((number, str(exc)))

    def _read_candump(self, lines: _Lines) -> Iterator[can.Message]:
        for line in lines:
            try:
                msg = parse_candump_line(line)
            except MalformedLine as exc:
                self._bad(lines.number, exc)
                continue
            if msg is not None:
                yield msg

    def _read_asc(self, lines: _Lines) -> Iterator[can.Message]:
        # python-can's reader is a generator over the file; an error ends it. It keeps the
        # header's state on the reader, so after a bad line a new generator goes on from the
        # next line. Its header scan would swallow that line: an empty line pushed back first
        # ends the scan without losing anything.
        reader = can.ASCReader(lines)  # type: ignore[arg-type]
        first = True
        while True:
            if not first:
                lines.push("")
            first = False
            try:
                yield from reader
                return
            except (ValueError, IndexError, KeyError, TypeError) as exc:
                self._bad(lines.number, exc)
