"""Live CAN bus reader: python-can bus -> DBC decode -> :class:`SampleBuffer`.

One thread per source reads the bus, stamps each frame with its arrival time, decodes it and
hands the samples to the buffer in batches; a batch is at most :data:`FLUSH_INTERVAL_S` old
or :data:`MAX_BATCH` samples, so a sample reaches perception within a couple of
milliseconds.

**Stamps.** SocketCAN and ``udp_multicast`` (and python-can's ``virtual`` bus) stamp every
frame on the wall clock as it arrives (the kernel's receive time, ``SO_TIMESTAMPNS``); the
reader keeps that stamp. A bus whose stamps are not on the wall clock (a USB adapter's own
counter, say) is stamped with ``time.time_ns()`` the moment ``recv`` returns instead, before
decoding, so decode time never skews a stamp. A stamp is taken as the bus's when it lies at
most :data:`BUS_STAMP_MAX_AGE_NS` before ``time.time_ns()`` and not after it.

**Bursts.** With the bus's own stamps the thread need not be awake when a frame arrives:
it sleeps out the batch's interval and then takes every frame that queued in the socket
meanwhile; while frames keep coming it does not wait in ``recv`` at all. So it wakes ~500
times a second instead of once per frame (8,000 at a saturated bus) and contends for the
GIL that much less with the event loop (``bench.can_ingest``: 29 ms of CPU per 1,000
frames instead of 52, a bare ``recv()`` loop 31-34). A batch that fills up
(:data:`MAX_BATCH`) means frames are queued behind it: the next one is read without the
pause. An interval with no frame sends the thread back to waiting in ``recv``. A bus
stamped on arrival is read frame by frame, the batch flushed when it is
:data:`FLUSH_INTERVAL_S` old.
"""

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import can

from drivers.backoff import backoff_delay
from drivers.buffer import SampleBuffer
from drivers.can._thread import run_in_thread
from drivers.can.dbc import FrameDecoder
from drivers.errors import CanBusError, CanError, DriverConfigError
from drivers.sample import Sample
from drivers.specs import CanSpec

log = logging.getLogger(__name__)

#: Oldest a pending batch may get before it is handed to the buffer. Perception's grid is
#: 10 ms; 2 ms keeps hand-off latency well inside one step at ~500 loop wake-ups/s.
FLUSH_INTERVAL_S: Final = 0.002
#: Samples per hand-off at most, bounding the time the buffer's lock is held.
MAX_BATCH: Final = 512
#: Oldest a bus's own stamp may be to be kept (see the module docstring): a frame the
#: reader takes that late was held up in the process, and a stamp this far off is not on
#: the wall clock.
BUS_STAMP_MAX_AGE_NS: Final = 2_000_000_000
#: Receive buffer asked of the kernel for a bus that is a socket (SocketCAN,
#: udp_multicast): ~1,000 frames, over 100 ms of a saturated bus, so a reader held up by a
#: stall of the process loses no frame (the default, ~200 KiB, holds 30-40 ms of it). The
#: kernel caps it at ``net.core.rmem_max``.
RECEIVE_BUFFER_BYTES: Final = 1 << 20
#: Longest single ``recv`` wait, whatever ``recv_timeout_ms`` says, so cancellation (which
#: the thread sees only between ``recv`` calls) completes well within a second.
MAX_RECV_TIMEOUT_S: Final = 0.25

BusFactory = Callable[[], can.BusABC]


def open_bus(spec: CanSpec, factory: BusFactory | None = None) -> can.BusABC:
    """Open ``spec``'s bus (``can.Bus(interface, channel, bitrate, **options)``, or
    ``factory()``) with python-can's errors turned into ours.

    Raises :class:`DriverConfigError` for what retrying cannot fix (a missing driver, bad
    options) and :class:`CanBusError` for what it may (no such interface yet, bus error).
    """
    try:
        if factory is not None:
            return factory()
        kwargs: dict[str, Any] = dict(spec.options)
        if spec.bitrate is not None:
            kwargs["bitrate"] = spec.bitrate
        return can.Bus(interface=spec.interface, channel=spec.channel, **kwargs)
    except can.CanInterfaceNotImplementedError as exc:
        # A driver library or optional dependency is missing: retrying cannot help.
        raise DriverConfigError(
            f"can source {spec.name!r}: interface {spec.interface!r} is not available: {exc}"
        ) from exc
    except (TypeError, ValueError) as exc:
        raise DriverConfigError(
            f"can source {spec.name!r}: bad bus options {dict(spec.options)!r} "
            f"for {spec.interface!r}: {exc}"
        ) from exc
    except (can.CanError, OSError) as exc:
        raise CanBusError(f"cannot open {spec.interface} {spec.channel}: {exc}") from exc


def widen_receive_buffer(bus: can.BusABC, size: int = RECEIVE_BUFFER_BYTES) -> int | None:
    """Ask for a ``size`` byte receive buffer on ``bus``'s socket if it has a smaller one;
    the size the kernel then reports, or None for a bus that is not a socket."""
    try:
        fd = bus.fileno()
    except (NotImplementedError, OSError):
        return None
    if not isinstance(fd, int) or fd < 0:
        return None
    try:
        # A duplicate of the descriptor: the options belong to the socket both name, and
        # closing the duplicate leaves the bus's own open.
        with socket.socket(fileno=os.dup(fd)) as sock:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < size:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    except OSError as exc:
        log.info("cannot size the receive buffer of %s: %s", bus.channel_info, exc)
        return None


class CanSource:
    """Reads one CAN interface and emits the DBC signals of :class:`CanSpec`.

    ``bus_factory`` replaces ``can.Bus(interface=..., channel=..., bitrate=...,
    **options)``; it is called again for every reconnect, so a test can hand in a bus that
    vanishes and comes back. ``rng`` seeds the backoff jitter.

    Raises :class:`DriverConfigError` at construction for an unusable DBC, an unknown
    signal name or an unknown interface.

    Faults: ``can.CanError`` or ``OSError`` from opening or reading the bus (bus error,
    bus-off reported by the driver, a USB adapter unplugged, ``can0`` taken down) close the
    bus, are counted in ``bus_errors``, and the bus is reopened after a jittered backoff
    between ``backoff_min_ms`` and ``backoff_max_ms``; the source keeps running. Only a
    configuration the bus can never accept (unknown interface, bad options) ends ``run()``,
    with :class:`DriverConfigError`; any other exception is a bug and ends it with
    :class:`CanError`. Error frames are counted, not acted on: a controller that goes bus-off
    is restarted by the kernel (``restart-ms``), not by reopening a socket.
    """

    def __init__(
        self,
        spec: CanSpec,
        *,
        bus_factory: BusFactory | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if bus_factory is None and spec.interface not in can.interfaces.VALID_INTERFACES:
            raise DriverConfigError(
                f"can source {spec.name!r}: unknown interface {spec.interface!r}; "
                f"expected one of {', '.join(sorted(can.interfaces.VALID_INTERFACES))}"
            )
        if spec.backoff_min_ms <= 0 or spec.backoff_max_ms < spec.backoff_min_ms:
            raise DriverConfigError(
                f"can source {spec.name!r}: need 0 < backoff_min_ms <= backoff_max_ms, "
                f"got {spec.backoff_min_ms} and {spec.backoff_max_ms}"
            )
        if spec.recv_timeout_ms <= 0:
            raise DriverConfigError(
                f"can source {spec.name!r}: recv_timeout_ms must be > 0, got {spec.recv_timeout_ms}"
            )
        self.name = spec.name
        self.spec = spec
        self._decoder = FrameDecoder.from_file(spec.dbc, signals=spec.signals, prefix=spec.prefix)
        self._bus_factory = bus_factory
        self._rng = rng if rng is not None else random.Random()
        self._recv_timeout_s = min(spec.recv_timeout_ms / 1000.0, MAX_RECV_TIMEOUT_S)
        self._running = False
        self.state = "idle"
        self.error_frames = 0
        self.remote_frames = 0
        self.bus_errors = 0
        self.reconnects = 0
        self.last_error = ""

    @property
    def signals(self) -> tuple[str, ...]:
        """Every sample name this source can emit (after filtering and prefix)."""
        return self._decoder.signals

    @property
    def unknown_ids(self) -> dict[tuple[int, bool], int]:
        """Frames seen per ``(frame_id, is_extended)`` the DBC does not define."""
        return self._decoder.unknown_ids

    def stats(self) -> Mapping[str, int | float | str]:
        """Counters since construction.

        ``frames`` counts every data frame received (error and remote frames are counted
        apart); ``bus_errors`` counts failed opens and failed reads; ``reconnects`` counts
        successful re-opens after a failure. ``state`` is ``idle``, ``connecting``,
        ``open``, ``backoff`` or ``stopped``; ``up`` is 1 only while ``open``.
        ``last_error`` is the latest bus fault (kept after the bus is back).
        """
        out: dict[str, int | float | str] = dict(self._decoder.stats())
        out.update(
            up=int(self.state == "open"),
            error_frames=self.error_frames,
            remote_frames=self.remote_frames,
            bus_errors=self.bus_errors,
            reconnects=self.reconnects,
            state=self.state,
            last_error=self.last_error,
        )
        return out

    async def run(self, sink: SampleBuffer) -> None:
        """Read the bus into ``sink`` until cancelled; reconnects on its own.

        Cancellation stops the reader thread and closes the bus within about
        ``min(recv_timeout_ms, 250 ms)``.
        """
        if self._running:
            raise RuntimeError(f"can source {self.name!r} is already running")
        self._running = True
        try:
            await run_in_thread(
                f"can-reader-{self.name}",
                lambda stop: self._read_forever(sink, stop),
                lambda exc: CanError(f"can source {self.name!r}: reader failed: {exc!r}"),
            )
        finally:
            self._running = False

    # -- reader thread ---------------------------------------------------------------

    def _connect(self) -> can.BusABC:
        bus = open_bus(self.spec, self._bus_factory)
        widen_receive_buffer(bus)
        return bus

    def _read_forever(self, sink: SampleBuffer, stop: threading.Event) -> None:
        attempt = 0
        opened_before = False
        try:
            while not stop.is_set():
                self.state = "connecting"
                try:
                    bus = self._connect()
                except CanBusError as exc:
                    self._fault(exc, attempt)
                else:
                    if opened_before:
                        self.reconnects += 1
                        log.info("can source %r: bus reopened", self.name)
                    opened_before = True
                    frames_before = self._decoder.frames
                    self.state = "open"
                    try:
                        self._pump(bus, sink, stop)
                    except (can.CanError, OSError) as exc:
                        if self._decoder.frames > frames_before:
                            attempt = 0  # the bus worked before it failed: retry soon
                        self._fault(exc, attempt)
                    finally:
                        self._close(bus)
                if stop.is_set():
                    break
                delay = backoff_delay(
                    attempt,
                    base_s=self.spec.backoff_min_ms / 1000.0,
                    max_s=self.spec.backoff_max_ms / 1000.0,
                    rng=self._rng,
                )
                attempt += 1
                self.state = "backoff"
                stop.wait(delay)
        finally:
            self.state = "stopped"

    def _fault(self, exc: BaseException, attempt: int) -> None:
        self.bus_errors += 1
        self.last_error = str(exc) or type(exc).__name__
        # First failure of a streak at WARNING; the backoff already bounds the rate.
        level = logging.WARNING if attempt == 0 else logging.INFO
        log.log(level, "can source %r: bus failed (attempt %d): %s", self.name, attempt + 1, exc)

    def _close(self, bus: can.BusABC) -> None:
        try:
            bus.shutdown()
        except (can.CanError, OSError) as exc:
            log.info("can source %r: error closing bus: %s", self.name, exc)

    def _pump(self, bus: can.BusABC, sink: SampleBuffer, stop: threading.Event) -> None:
        """Receive, stamp, decode and batch until ``stop``; bus faults propagate."""
        recv = bus.recv
        poll = self._recv_timeout_s
        # flowing: the last batch had frames with the bus's own stamps, so the next is read
        # after sleeping out the interval, not by waiting in recv for its first frame (one
        # wake-up per batch, not two). full: that batch filled up: frames are still queued,
        # so no sleep until caught up.
        flowing = full = False
        batch: list[Sample] = []
        try:
            while not stop.is_set():
                if flowing and not full:
                    time.sleep(FLUSH_INTERVAL_S)
                msg = recv(0.0 if flowing else poll)
                if msg is None:
                    flowing = full = False
                    continue
                if self._take(msg, batch):
                    if not flowing:
                        time.sleep(FLUSH_INTERVAL_S)  # the first of a burst: let the rest queue
                    full = self._read_into(recv, batch)
                    flowing = True
                else:
                    flowing = full = False
                    # Stamped on arrival: read frame by frame until the batch is due.
                    self._read_into(recv, batch, until=time.monotonic() + FLUSH_INTERVAL_S)
                sink.put_many(batch)
                batch = []
        finally:
            if batch:
                sink.put_many(batch)

    def _read_into(
        self,
        recv: Callable[[float], can.Message | None],
        batch: list[Sample],
        until: float | None = None,
    ) -> bool:
        """Take the frames already queued (``until`` None) or those that arrive before
        ``until`` (monotonic) into ``batch``; True if the batch filled first."""
        take = self._take
        timeout = 0.0
        while len(batch) < MAX_BATCH:
            if until is not None:
                timeout = until - time.monotonic()
                if timeout <= 0.0:
                    return False
            msg = recv(timeout)
            if msg is None:
                return False
            take(msg, batch)
        return True

    def _take(self, msg: can.Message, batch: list[Sample]) -> bool:
        """Decode ``msg`` into ``batch``; True if it kept the bus's own stamp."""
        now_ns = time.time_ns()
        if msg.is_error_frame:
            self.error_frames += 1
            return False
        if msg.is_remote_frame:
            self.remote_frames += 1
            return False
        t_ns = int(msg.timestamp * 1e9)
        own = now_ns - BUS_STAMP_MAX_AGE_NS <= t_ns <= now_ns
        self._decoder.decode(
            msg.arbitration_id, msg.is_extended_id, msg.data, t_ns if own else now_ns, batch
        )
        return own
