"""Load a DBC and decode CAN frames into :class:`~drivers.sample.Sample` values.

cantools reads the DBC; a plain message's selected signals are then decoded by shifts and
masks compiled at load time (cantools' bit positions and scaling), anything else by
cantools with ``decode_choices=False``: an enum signal yields its raw number, every value
is a ``float``. Around that, what a bus needs at 8,000 frames/s: one dict hit per frame on
``(frame_id, is_extended)``, names and filters resolved once, and counters (never
exceptions) for frames the DBC does not know or cannot decode.
"""

import difflib
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, MutableSequence
from pathlib import Path
from typing import Final, NamedTuple

import cantools
import cantools.database
import cantools.errors
from cantools.database.can import Database as CanDatabase
from cantools.database.can import Message as DbcMessage

from drivers.errors import DriverConfigError
from drivers.sample import Sample, new_sample

log = logging.getLogger(__name__)

#: Distinct unknown ids tracked one by one. A misconfigured DBC on a busy bus (or a bus
#: carrying J1939 with its many source addresses) could otherwise grow the table forever;
#: beyond this only the total is counted.
MAX_TRACKED_UNKNOWN_IDS: Final = 256

#: How many known names a "no such signal" error lists before it elides the rest.
_MAX_LISTED_NAMES: Final = 40

#: What cantools raises for a frame it cannot decode. ``DecodeError`` covers the wrong
#: length, a multiplexer value the DBC does not define and bitstruct failures; ``ValueError``
#: and ``IndexError`` are what a malformed payload can still raise from the codec layer.
_DECODE_ERRORS: Final = (cantools.database.DecodeError, ValueError, IndexError)

FrameKey = tuple[int, bool]


def load_dbc(path: Path) -> CanDatabase:
    """Parse ``path`` as a DBC (cantools strict mode: overlapping signals are an error).

    Raises :class:`DriverConfigError` naming the file and what is wrong with it.
    """
    try:
        db = cantools.database.load_file(path, database_format="dbc", strict=True)
    except FileNotFoundError:
        raise DriverConfigError(f"DBC {path}: no such file") from None
    except OSError as exc:
        raise DriverConfigError(f"DBC {path}: cannot read: {exc.strerror or exc}") from exc
    except (cantools.errors.Error, UnicodeError, ValueError) as exc:
        raise DriverConfigError(f"DBC {path}: not a valid DBC: {exc}") from exc
    if not isinstance(db, CanDatabase):
        raise DriverConfigError(f"DBC {path}: not a CAN database")
    if not db.messages:
        raise DriverConfigError(f"DBC {path}: defines no messages")
    return db


def signal_names(db: CanDatabase) -> dict[tuple[str, str], str]:
    """``(message name, signal name) -> emitted name`` (without prefix) for every signal.

    Signal names: the bare DBC name when it is unique in the DBC, else ``MESSAGE.SIGNAL``;
    ``prefix`` is prepended as is (``prefix="can0."`` gives ``can0.RPM``).
    """
    counts = Counter(sig.name for msg in db.messages for sig in msg.signals)
    return {
        (msg.name, sig.name): sig.name if counts[sig.name] == 1 else f"{msg.name}.{sig.name}"
        for msg in db.messages
        for sig in msg.signals
    }


def _select(
    names: Mapping[tuple[str, str], str], wanted: Iterable[str], source: object
) -> set[tuple[str, str]]:
    """Resolve the user's signal list against the DBC.

    A wanted name may be the emitted name or ``MESSAGE.SIGNAL`` even when the bare name is
    unique, so a config stays valid when a later DBC revision adds a same-named signal.
    """
    by_name: dict[str, tuple[str, str]] = {}
    for key, name in names.items():
        by_name[name] = key
        by_name[f"{key[0]}.{key[1]}"] = key
    selected: set[tuple[str, str]] = set()
    for name in wanted:
        found = by_name.get(name)
        if found is not None:
            selected.add(found)
            continue
        ambiguous = sorted(f"{m}.{s}" for m, s in names if s == name)
        if ambiguous:
            raise DriverConfigError(
                f"DBC {source}: signal {name!r} is in several messages; "
                f"name one of {', '.join(ambiguous)}"
            )
        known = sorted(set(names.values()))
        close = difflib.get_close_matches(name, known, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        listed = ", ".join(known[:_MAX_LISTED_NAMES])
        if len(known) > _MAX_LISTED_NAMES:
            listed += f", ... ({len(known) - _MAX_LISTED_NAMES} more)"
        raise DriverConfigError(f"DBC {source}: no signal {name!r}{hint}; known signals: {listed}")
    return selected


#: One selected signal as shifts and masks: (emitted name, big-endian?, shift, mask, sign
#: bit or 0 when unsigned, scale, offset).
_FastSignal = tuple[str, bool, int, int, int, float, float]


def _compile(message: DbcMessage, names: Mapping[str, str]) -> tuple[_FastSignal, ...] | None:
    """The selected signals of ``message`` as shift-and-mask steps, or None when one of
    them needs cantools (a multiplexed message, an IEEE float signal).

    The bit positions are cantools' (``cantools.database.utils.start_bit``): an Intel
    signal's ``start`` is its least significant bit counted from byte 0 upwards; a Motorola
    signal's is its most significant bit in the DBC's sawtooth numbering. Values are
    ``raw * scale + offset`` with the conversion's own scale and offset, as cantools
    computes them (tests/test_can_dbc.py checks both give the same floats).
    """
    if message.is_multiplexed() or message.is_container:
        return None
    bits = 8 * message.length
    steps: list[_FastSignal] = []
    for sig in message.signals:
        name = names.get(sig.name)
        if name is None:
            continue
        conv = sig.conversion
        if sig.is_float or not hasattr(conv, "scale") or not hasattr(conv, "offset"):
            return None
        mask = (1 << sig.length) - 1
        sign = 1 << (sig.length - 1) if sig.is_signed else 0
        if sig.byte_order == "big_endian":
            msb = 8 * (sig.start // 8) + (7 - sig.start % 8)
            shift = bits - msb - sig.length
            if shift < 0:
                return None
            steps.append((name, True, shift, mask, sign, conv.scale, conv.offset))
        else:
            if sig.start + sig.length > bits:
                return None
            steps.append((name, False, sig.start, mask, sign, conv.scale, conv.offset))
    return tuple(steps)


class _Plan:
    """What to do with one frame id: the cantools message and the signals to emit."""

    __slots__ = ("big", "decode", "fast", "length", "little", "message", "names")

    def __init__(self, message: DbcMessage, names: dict[str, str]) -> None:
        self.message = message
        self.decode = message.decode_simple
        #: cantools signal name -> emitted sample name; only selected signals are keys.
        self.names = names
        #: The compiled steps for a frame of exactly ``length`` bytes (None: cantools).
        self.fast = _compile(message, names) if names else None
        self.length = message.length
        self.little = any(not step[1] for step in self.fast or ())
        self.big = any(step[1] for step in self.fast or ())


class FrameDecoder:
    """Turns ``(frame_id, is_extended, data)`` into samples, counting what it cannot use.

    Not thread-safe: one reader thread owns an instance. Other threads may read the
    counters (plain ints) at any time for :meth:`stats`.

    A frame whose id is not in the DBC is counted in ``unknown_frames`` (and per id in
    :attr:`unknown_ids`, up to :data:`MAX_TRACKED_UNKNOWN_IDS` ids). A frame cantools cannot
    decode (wrong length, undefined multiplexer value) is counted in ``decode_errors`` and
    logged once per id. A known frame none of whose signals are selected is counted in
    ``filtered_frames`` and not decoded at all.

    A frame of a plain message (no multiplexer, no IEEE float signal) of the DBC's length
    is decoded by the shift-and-mask steps :func:`_compile` made at load time, only for the
    selected signals; anything else goes through cantools, which also reports what is wrong
    with a frame it cannot decode.
    """

    def __init__(
        self,
        db: CanDatabase,
        *,
        signals: Iterable[str] = (),
        prefix: str = "",
        source: object = "<dbc>",
    ) -> None:
        """``source`` names the DBC in errors and logs (usually its path)."""
        self.source = source
        names = signal_names(db)
        wanted = tuple(signals)
        selected = _select(names, wanted, source) if wanted else set(names)
        self._plans: dict[FrameKey, _Plan] = {}
        for msg in db.messages:
            key = (msg.frame_id, bool(msg.is_extended_frame))
            if key in self._plans:
                # cantools accepts this; a bus cannot tell the two apart, so say which wins.
                log.warning(
                    "DBC %s: %s and %s share frame id 0x%X; using %s",
                    source,
                    self._plans[key].message.name,
                    msg.name,
                    msg.frame_id,
                    msg.name,
                )
            emitted = {
                sig.name: prefix + names[(msg.name, sig.name)]
                for sig in msg.signals
                if (msg.name, sig.name) in selected
            }
            self._plans[key] = _Plan(msg, emitted)
        self.signals: tuple[str, ...] = tuple(
            sorted(n for plan in self._plans.values() for n in plan.names.values())
        )
        self.frames = 0
        self.decoded_frames = 0
        self.samples = 0
        self.unknown_frames = 0
        self.filtered_frames = 0
        self.decode_errors = 0
        self._unknown_ids: dict[FrameKey, int] = {}
        self._decode_failed_ids: set[FrameKey] = set()

    @classmethod
    def from_file(
        cls, path: Path, *, signals: Iterable[str] = (), prefix: str = ""
    ) -> "FrameDecoder":
        """Load the DBC at ``path``; every problem is a :class:`DriverConfigError`."""
        return cls(load_dbc(path), signals=signals, prefix=prefix, source=path)

    def message_for(self, frame_id: int, is_extended: bool) -> DbcMessage | None:
        """The DBC message for a frame id, or ``None`` if the DBC does not define it."""
        plan = self._plans.get((frame_id, is_extended))
        return None if plan is None else plan.message

    def decode(
        self,
        frame_id: int,
        is_extended: bool,
        data: bytes | bytearray,
        t_ns: int,
        out: MutableSequence[Sample],
    ) -> int:
        """Append the frame's selected signals to ``out``, all stamped ``t_ns``.

        Returns the number of samples appended (0 for an unknown, filtered or undecodable
        frame). Appending to a caller's list lets a reader batch many frames into one
        :meth:`~drivers.buffer.SampleBuffer.put_many` without an allocation per frame.
        """
        self.frames += 1
        key = (frame_id, is_extended)
        plan = self._plans.get(key)
        if plan is None:
            self._count_unknown(key)
            return 0
        names = plan.names
        if not names:
            self.filtered_frames += 1
            return 0
        fast = plan.fast
        if fast is not None and len(data) == plan.length:
            lo = int.from_bytes(data, "little") if plan.little else 0
            hi = int.from_bytes(data, "big") if plan.big else 0
            for emitted, big, shift, mask, sign, scale, offset in fast:
                raw = ((hi if big else lo) >> shift) & mask
                if raw & sign:
                    raw -= sign << 1
                out.append(new_sample(Sample, (emitted, float(raw * scale + offset), t_ns)))
            self.decoded_frames += 1
            self.samples += len(fast)
            return len(fast)
        try:
            # bytearray (python-can's Message.data) works as is: cantools only slices it
            # and bitstruct reads the buffer; copying to bytes would cost ~10 %.
            decoded = plan.decode(data, False)  # type: ignore[arg-type]
        except _DECODE_ERRORS as exc:
            self._count_decode_error(key, plan, len(data), exc)
            return 0
        n = 0
        for sig, value in decoded.items():
            name = names.get(sig)
            if name is not None:
                # Only int/float arrive here with decode_choices=False. float() rounds a
                # raw integer wider than 53 bits (a 64-bit ns clock: to ~256 ns).
                out.append(new_sample(Sample, (name, float(value), t_ns)))  # type: ignore[arg-type]
                n += 1
        self.decoded_frames += 1
        self.samples += n
        return n

    def selection(self) -> list[tuple[FrameKey, DbcMessage, str, str]]:
        """``(frame key, DBC message, DBC signal name, emitted name)`` per selected signal,
        in emitted-name order: what a one-off reader (``edge-agent read``) listens for."""
        rows = [
            (key, plan.message, sig, name)
            for key, plan in self._plans.items()
            for sig, name in plan.names.items()
        ]
        return sorted(rows, key=lambda r: r[3])

    @property
    def unknown_ids(self) -> dict[FrameKey, int]:
        """Frames seen per unknown ``(frame_id, is_extended)`` (a copy; bounded)."""
        return dict(self._unknown_ids)

    def stats(self) -> dict[str, int]:
        """Counters for a source's ``stats()``."""
        return {
            "frames": self.frames,
            "decoded_frames": self.decoded_frames,
            "samples": self.samples,
            "unknown_frames": self.unknown_frames,
            "unknown_ids": len(self._unknown_ids),
            "filtered_frames": self.filtered_frames,
            "decode_errors": self.decode_errors,
        }

    def _count_unknown(self, key: FrameKey) -> None:
        self.unknown_frames += 1
        ids = self._unknown_ids
        seen = ids.get(key)
        if seen is not None:
            ids[key] = seen + 1
        elif len(ids) < MAX_TRACKED_UNKNOWN_IDS:
            ids[key] = 1
            # Unknown ids are normal on a real bus (27 of 35 on the Subaru capture): debug.
            log.debug("DBC %s: no message for frame id %s", self.source, _fmt_id(key))

    def _count_decode_error(self, key: FrameKey, plan: _Plan, length: int, exc: Exception) -> None:
        self.decode_errors += 1
        if key not in self._decode_failed_ids:
            self._decode_failed_ids.add(key)
            log.warning(
                "DBC %s: cannot decode frame %s (%s, %d bytes; DBC says %d): %s "
                "(logged once per id; see decode_errors)",
                self.source,
                _fmt_id(key),
                plan.message.name,
                length,
                plan.message.length,
                exc,
            )


class SignalTiming(NamedTuple):
    """How a DBC delivers one selected signal: what the input contract needs to know.

    ``cycle_ms`` is the message's ``GenMsgCycleTime`` (None when the DBC gives none, or 0);
    ``scale`` its resolution; ``minimum``/``maximum`` its range (None when the DBC leaves it
    open); ``multiplexed``: sent only on some frames of the message (one mux page).
    """

    name: str
    message: str
    cycle_ms: float | None
    scale: float
    minimum: float | None
    maximum: float | None
    multiplexed: bool


def signal_timings(
    path: Path, *, signals: Iterable[str] = (), prefix: str = ""
) -> list[SignalTiming]:
    """:class:`SignalTiming` of every signal a source with this DBC and selection emits.
    Raises :class:`DriverConfigError` as :meth:`FrameDecoder.from_file` does."""
    out = []
    for _key, msg, sig, name in FrameDecoder.from_file(
        path, signals=signals, prefix=prefix
    ).selection():
        s = msg.get_signal_by_name(sig)
        cycle = msg.cycle_time
        out.append(
            SignalTiming(
                name=name,
                message=msg.name,
                cycle_ms=float(cycle) if cycle else None,
                scale=float(s.scale),
                minimum=None if s.minimum is None else float(s.minimum),
                maximum=None if s.maximum is None else float(s.maximum),
                multiplexed=s.multiplexer_ids is not None,
            )
        )
    return out


def _fmt_id(key: FrameKey) -> str:
    frame_id, extended = key
    return f"0x{frame_id:08X} (extended)" if extended else f"0x{frame_id:03X}"
