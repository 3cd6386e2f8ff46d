"""Listen to a :class:`CanSpec`'s bus for a while and show each signal's last value, for
``edge-agent read``.

A bus has nothing to ask: a signal is read by hearing a frame that carries it. Every
frame heard within the listen is decoded through the source's own DBC selection, and each
signal keeps the last frame that carried it (a multiplexed signal is in only some of its
message's frames). A signal no frame carried is a failed reading, like a register that
did not answer; so is every signal when the bus cannot be opened.
"""

import asyncio
import threading
import time
from collections.abc import Callable

import can

from drivers.can.dbc import FrameDecoder
from drivers.can.reader import BusFactory, open_bus
from drivers.errors import CanBusError
from drivers.readout import ErrorKind, Reading
from drivers.sample import Sample
from drivers.specs import CanSpec

#: Longest single ``recv`` wait, so a cancelled listen ends promptly.
_RECV_S = 0.1


async def listen_can(
    spec: CanSpec, seconds: float, *, bus_factory: BusFactory | None = None
) -> list[Reading]:
    """One :class:`Reading` per selected DBC signal after listening ``seconds``.

    Runs the blocking python-can reads in a thread. Raises
    :class:`drivers.errors.DriverConfigError` for a DBC, signal list or interface that
    cannot be used at all.
    """
    decoder = FrameDecoder.from_file(spec.dbc, signals=spec.signals, prefix=spec.prefix)
    stop = threading.Event()
    try:
        return await asyncio.to_thread(_listen, spec, decoder, seconds, bus_factory, stop)
    finally:
        stop.set()


def _listen(
    spec: CanSpec,
    decoder: FrameDecoder,
    seconds: float,
    bus_factory: Callable[[], can.BusABC] | None,
    stop: threading.Event,
) -> list[Reading]:
    selection = decoder.selection()
    where = {name: f"0x{key[0]:X} {msg.name}" for key, msg, _, name in selection}
    try:
        bus = open_bus(spec, bus_factory)
    except CanBusError as exc:
        return [_failed(spec, name, where[name], str(exc), "connection") for *_, name in selection]
    wanted = {key for key, *_ in selection}
    last: dict[str, can.Message] = {}  # emitted name -> last frame carrying it
    bad: dict[tuple[int, bool], int] = {}  # frames that did not decode: their length
    broken = ""
    deadline = time.monotonic() + seconds
    try:
        while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
            msg = bus.recv(min(left, _RECV_S))
            if msg is None or msg.is_error_frame or msg.is_remote_frame:
                continue
            key = (msg.arbitration_id, bool(msg.is_extended_id))
            if key not in wanted:
                continue
            carried: list[Sample] = []
            if not decoder.decode(msg.arbitration_id, msg.is_extended_id, msg.data, 0, carried):
                bad[key] = len(msg.data)
            for sample in carried:
                last[sample.signal] = msg
    except (can.CanError, OSError) as exc:
        broken = f"bus failed while listening: {exc}"
    finally:
        bus.shutdown()
    readings = []
    for key, message, signal, name in selection:
        msg = last.get(name)
        if msg is None:
            kind: ErrorKind = "no_frame"
            why = f"no frame 0x{key[0]:X} ({message.name}) carrying it in {seconds:g} s"
            if key in bad:
                kind = "decode"
                why = (
                    f"frame 0x{key[0]:X} ({message.name}) did not decode: {bad[key]} bytes, "
                    f"the DBC says {message.length}"
                )
            elif broken:
                kind, why = "connection", broken
            readings.append(_failed(spec, name, where[name], why, kind))
            continue
        data = bytes(msg.data)
        # With decode_choices=False cantools gives numbers only (its type says more).
        raw = message.decode_simple(data, decode_choices=False, scaling=False)[signal]
        value = message.decode_simple(data, decode_choices=False)[signal]
        assert isinstance(raw, int | float)
        assert isinstance(value, int | float)
        sig = message.get_signal_by_name(signal)
        readings.append(
            Reading(
                source=spec.name,
                signal=name,
                where=where[name],
                type="can",
                raw=tuple(data),
                decoded=raw,
                value=float(value),
                unit=sig.unit or "",
            )
        )
    return readings


def _failed(spec: CanSpec, name: str, where: str, why: str, kind: ErrorKind) -> Reading:
    return Reading(
        source=spec.name,
        signal=name,
        where=where,
        type="can",
        error=why,
        error_kind=kind,
    )
