"""The plant on real field buses: a Modbus TCP server and a CAN frame generator.

:class:`PlantSimulator` is what tests and the demo start; :func:`serve` is what
``edge-agent simulate`` runs. Both put one :class:`~drivers.sim.plant.MotorPlant` on a
pymodbus TCP server and a python-can bus, one task ticking every 10 ms (what each carries
and when: :class:`PlantSimulator`). Plant time is ``start_at_s + (now - start) * speed``;
bus rates stay in wall-clock time.
"""

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import can
import cantools
from cantools.database.can import Database as CanDatabase
from cantools.database.errors import Error as CantoolsError
from pymodbus.datastore import (
    ModbusDeviceContext,
    ModbusSequentialDataBlock,
    ModbusServerContext,
)
from pymodbus.server import ModbusTcpServer

from drivers.errors import CanBusError, DriverConfigError, DriverError, ModbusConnectionError
from drivers.sim.listen import check_bindable
from drivers.sim.plant import SIGNALS, STATE_SIGNALS, Anomaly, MotorPlant, step_index
from drivers.sim.registers import SIM_REGISTERS, register_writes, table_sizes
from drivers.specs import RegisterFunction

logger = logging.getLogger(__name__)

#: The example DBC shipped with the package; its signal names are the plant's names.
MOTOR_DRIVE_DBC = Path(__file__).with_name("motor_drive.dbc")

CanOptionValue = str | int | float | bool

# Function code pymodbus maps to each table (1/2/3/4 -> c/d/h/i in ModbusDeviceContext).
_FUNCTION_CODE: dict[RegisterFunction, int] = {
    "coil": 1,
    "discrete_input": 2,
    "holding": 3,
    "input": 4,
}
_KNOWN_SIGNALS = frozenset(SIGNALS) | frozenset(STATE_SIGNALS)
_PLANT_SIGNALS = frozenset(SIGNALS)
_VIRTUAL_RX_DRAIN = 256
_ERROR_LOG_EVERY = 1000


@dataclass(frozen=True, slots=True)
class SimOptions:
    """Everything the simulator needs, as the CLI collects it.

    ``modbus_port = None`` disables the Modbus server (0 = any free port);
    ``can_interface = None`` disables CAN. ``can_options`` go to ``can.Bus`` as is.
    ``status_interval_s`` is how often :func:`serve` logs a status line. Raises
    :class:`DriverConfigError` for impossible values.
    """

    seed: int = 0
    anomalies: tuple[Anomaly, ...] = ()
    modbus_host: str = "127.0.0.1"
    modbus_port: int | None = 5020
    can_interface: str | None = "virtual"
    can_channel: str = "edgefleet-sim"
    can_bitrate: int | None = None
    can_options: Mapping[str, CanOptionValue] = field(default_factory=dict)
    dbc: Path = MOTOR_DRIVE_DBC
    speed: float = 1.0
    start_at_s: float = 0.0
    update_period_s: float = 0.01
    status_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise DriverConfigError(f"simulator speed {self.speed!r} must be > 0")
        if not (math.isfinite(self.start_at_s) and self.start_at_s >= 0):
            raise DriverConfigError(f"simulator start_at_s {self.start_at_s!r} must be >= 0")
        if not 0.001 <= self.update_period_s <= 1.0:
            raise DriverConfigError(
                f"simulator update_period_s {self.update_period_s!r} must be in [0.001, 1]"
            )
        if not (math.isfinite(self.status_interval_s) and self.status_interval_s > 0):
            raise DriverConfigError(
                f"simulator status_interval_s {self.status_interval_s!r} must be > 0"
            )
        if self.modbus_port is not None and not 0 <= self.modbus_port <= 65535:
            raise DriverConfigError(f"simulator modbus_port {self.modbus_port!r} not in 0-65535")
        if self.modbus_port is None and self.can_interface is None:
            raise DriverConfigError("simulator has neither Modbus nor CAN enabled")


@dataclass(frozen=True, slots=True)
class SimStats:
    """A snapshot of the simulator's counters.

    ``ticks`` counts plant evaluations, ``late_ticks`` the ticks skipped because the loop was
    late, ``modbus_updates`` datastore refreshes. ``frames_suppressed`` counts frames not
    sent because a signal they carry was in a dropout. ``plant_t_s``/``plant_step`` are those
    of the last tick (the values the registers hold now).
    """

    ticks: int
    late_ticks: int
    modbus_updates: int
    frames_sent: int
    frames_suppressed: int
    can_errors: int
    frames_by_message: Mapping[str, int]
    suppressed_by_message: Mapping[str, int]
    plant_t_s: float
    plant_step: int


@dataclass(slots=True)
class _FramePlan:
    """One DBC message on its schedule."""

    message: Any  # cantools.database.can.Message
    period_ticks: int
    mux: str | None
    pages: list[tuple[int | None, list[Any]]]  # (mux value, signals sent on that page)
    last_bucket: int = -1
    sent: int = 0
    suppressed: int = 0


class PlantSimulator:
    """A :class:`MotorPlant` served on Modbus TCP and CAN; use as ``async with``.

    ::

        async with PlantSimulator(seed=7, modbus_port=0, can_channel="t1") as sim:
            port = sim.modbus_port
            ...

    Keyword arguments are the fields of :class:`SimOptions` (defaults differ only in
    ``modbus_port = 0``, a free port). Start-up raises :class:`DriverConfigError` for a bad
    option, DBC or CAN interface name, :class:`ModbusConnectionError` when the port cannot be
    bound and :class:`CanBusError` when the CAN channel cannot be opened. Leaving the block,
    or cancellation, stops the update task, closes the server and shuts the bus down.

    The plant goes on:

    * a pymodbus TCP server (unit 1, the map in :mod:`drivers.sim.registers`) whose datastore is
      rewritten from the plant every ``update_period_s`` (10 ms);
    * a python-can bus (any interface by name; ``virtual`` in tests) carrying the messages of a
      DBC (:data:`MOTOR_DRIVE_DBC` by default) at each message's ``GenMsgCycleTime``, encoded
      with cantools.

    Plant time is ``start_at_s + (now - start) * speed``; bus rates stay in wall-clock time, so
    ``speed = 10`` shows ten plant seconds per second at unchanged frame rates.

    One task does all the work: each tick (default 10 ms) evaluates the plant once, writes the
    registers, and sends the frames that are due. A late tick is skipped rather than replayed, so
    a busy gateway sees fewer frames, never a burst. A frame is not sent while any plant signal it
    carries is in a ``dropout``; the registers of a dropped signal keep their last value.

    Interface notes: python-can's ``virtual`` bus only connects buses in the same process. To
    feed an agent in another process use ``socketcan`` on a ``vcan`` device, or
    ``udp_multicast`` with a multicast group as the channel (e.g. ``239.74.163.2``).
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        anomalies: Sequence[Anomaly] = (),
        modbus_host: str = "127.0.0.1",
        modbus_port: int | None = 0,
        can_interface: str | None = "virtual",
        can_channel: str = "edgefleet-sim",
        can_bitrate: int | None = None,
        can_options: Mapping[str, CanOptionValue] | None = None,
        dbc: Path = MOTOR_DRIVE_DBC,
        speed: float = 1.0,
        start_at_s: float = 0.0,
        update_period_s: float = 0.01,
    ) -> None:
        self._setup(
            SimOptions(
                seed=seed,
                anomalies=tuple(anomalies),
                modbus_host=modbus_host,
                modbus_port=modbus_port,
                can_interface=can_interface,
                can_channel=can_channel,
                can_bitrate=can_bitrate,
                can_options=dict(can_options or {}),
                dbc=dbc,
                speed=speed,
                start_at_s=start_at_s,
                update_period_s=update_period_s,
            )
        )

    @classmethod
    def from_options(cls, options: SimOptions) -> "PlantSimulator":
        """A simulator for ``options`` (as :func:`serve` builds it)."""
        sim = cls.__new__(cls)
        sim._setup(options)
        return sim

    def _setup(self, options: SimOptions) -> None:
        self.options = options
        #: The plant being served; query it for ground truth (``values_at``, labels).
        self.plant = MotorPlant(options.seed, options.anomalies)
        self._server: ModbusTcpServer | None = None
        self._context: ModbusServerContext | None = None
        self._port: int | None = None
        self._bus: can.BusABC | None = None
        self._plans: list[_FramePlan] = []
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._unix0 = 0.0
        self._ticks = 0
        self._late = 0
        self._modbus_updates = 0
        self._can_errors = 0
        self._plant_t = options.start_at_s
        self._plant_step = 0
        self._active: tuple[Anomaly, ...] = ()
        self._started = False
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> "PlantSimulator":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Bind the server, open the bus, publish the first snapshot, start ticking."""
        if self._started:
            raise RuntimeError("PlantSimulator already started")
        self._started = True
        opts = self.options
        try:
            if opts.can_interface is not None:
                # Parsing a DBC reads a file and takes milliseconds: off the loop.
                self._plans = await asyncio.to_thread(_frame_plans, opts.dbc, opts.update_period_s)
            # Reaching a late start time integrates the thermal model up to it, which can
            # take a while; do it before anything else touches the plant, so off the loop
            # it is safe (the plant is not thread-safe, but nobody else uses it yet).
            await asyncio.to_thread(self.plant.values_at, opts.start_at_s)
            if opts.modbus_port is not None:
                await self._start_modbus(opts.modbus_host, opts.modbus_port)
            if opts.can_interface is not None:
                self._bus = _open_bus(opts)
            loop = asyncio.get_running_loop()
            self._t0 = loop.time()
            self._unix0 = time.time()
            # The first snapshot is in place before start() returns: no client ever reads
            # the zeros of an empty datastore.
            self._tick(0, self._t0)
            self._task = asyncio.create_task(self._run(), name="sim-tick")
            self._task.add_done_callback(_log_task_failure)
        except BaseException:
            await self.stop()
            raise
        logger.debug(
            "simulator started: seed=%d modbus=%s can=%s anomalies=%s",
            opts.seed,
            self._port,
            opts.can_interface,
            [str(a) for a in opts.anomalies],
        )

    async def stop(self) -> None:
        """Stop ticking, close the Modbus server and the CAN bus. Idempotent.

        Re-raises the error that killed the update task, if one did.
        """
        if self._closed:
            return
        self._closed = True
        failure: BaseException | None = None
        task, self._task = self._task, None
        try:
            if task is not None:
                task.cancel()
                # asyncio.wait never raises the task's own outcome, so a CancelledError here
                # is our caller being cancelled: it propagates, after the cleanup below.
                await asyncio.wait({task})
                if not task.cancelled():
                    failure = task.exception()
        finally:
            server, self._server = self._server, None
            if server is not None:
                # No suspension point inside: runs to the end even while we are cancelled.
                await server.shutdown()  # type: ignore[no-untyped-call]
            bus, self._bus = self._bus, None
            if bus is not None:
                try:
                    bus.shutdown()
                except (can.CanError, OSError) as exc:
                    logger.warning("closing CAN bus: %s", exc)
            logger.debug("simulator stopped: %s", self.stats())
        if failure is not None:
            raise failure

    async def wait(self, timeout_s: float | None = None) -> None:
        """Return after ``timeout_s`` (or never) while running; raise if the update task died."""
        task = self._task
        if task is None:
            raise RuntimeError("PlantSimulator is not running")
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if done:
            task.result()
            raise DriverError("simulator update task ended")

    # -- what it serves ---------------------------------------------------------------------

    @property
    def modbus_port(self) -> int:
        """The TCP port the Modbus server is bound to (the real one when asked for 0)."""
        if self._port is None:
            raise RuntimeError("Modbus server is not running")
        return self._port

    def plant_time(self) -> float:
        """Plant time now."""
        return self._plant_time(asyncio.get_running_loop().time())

    def plant_time_at(self, unix_s: float) -> float:
        """Plant time at UNIX time ``unix_s`` (e.g. a CAN frame's or a Sample's timestamp).

        Maps arrival stamps back to the plant for labelling with
        ``plant.active_anomalies``; exact to the clock difference between ``time.time()``
        and the loop's monotonic clock at start-up.
        """
        return self.options.start_at_s + (unix_s - self._unix0) * self.options.speed

    def stats(self) -> SimStats:
        """Counters since start."""
        return SimStats(
            ticks=self._ticks,
            late_ticks=self._late,
            modbus_updates=self._modbus_updates,
            frames_sent=sum(p.sent for p in self._plans),
            frames_suppressed=sum(p.suppressed for p in self._plans),
            can_errors=self._can_errors,
            frames_by_message={p.message.name: p.sent for p in self._plans},
            suppressed_by_message={p.message.name: p.suppressed for p in self._plans},
            plant_t_s=self._plant_t,
            plant_step=self._plant_step,
        )

    def describe(self) -> list[str]:
        """Human-readable lines saying what is served where (for logs and the CLI)."""
        opts = self.options
        lines = [
            f"plant: motor drive, seed {opts.seed}, speed x{opts.speed:g}, "
            f"starting at t={opts.start_at_s:g} s"
        ]
        if self._port is not None:
            tables: dict[str, list[int]] = {}
            for spec in SIM_REGISTERS:
                tables.setdefault(spec.function, []).extend(
                    range(spec.address, spec.address + spec.width)
                )
            spans = ", ".join(
                f"{fn} {min(a)}" + (f"-{max(a)}" if max(a) > min(a) else "")
                for fn, a in tables.items()
            )
            lines.append(
                f"modbus: tcp {opts.modbus_host}:{self._port} unit 1, "
                f"{len(SIM_REGISTERS)} values ({spans}), refreshed every "
                f"{opts.update_period_s * 1000:g} ms"
            )
        if self._bus is not None:
            frames = ", ".join(
                f"{p.message.name} 0x{p.message.frame_id:X} @ "
                f"{1.0 / (p.period_ticks * opts.update_period_s):g} Hz"
                for p in self._plans
            )
            lines.append(f"can: {opts.can_interface}:{opts.can_channel} {opts.dbc.name}: {frames}")
        for a in opts.anomalies:
            lines.append(f"anomaly: {a} (plant t {a.start_s:g}-{a.end_s:g} s)")
        return lines

    # -- the tick ---------------------------------------------------------------------------

    def _plant_time(self, now: float) -> float:
        return self.options.start_at_s + max(0.0, now - self._t0) * self.options.speed

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        period = self.options.update_period_s
        n = 0
        while True:
            n += 1
            delay = self._t0 + n * period - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                missed = int(-delay / period)
                if missed:
                    n += missed
                    self._late += missed
                await asyncio.sleep(0)  # still yield, or a slow host would starve the loop
            self._tick(n, loop.time())

    def _tick(self, n: int, now: float) -> None:
        t = self._plant_time(now)
        plant = self.plant
        values = plant.values_at(t)
        named: dict[str, float] = {**values, **plant.state_at(t).as_signals()}
        self._plant_t = t
        self._plant_step = step_index(t)
        self._ticks += 1
        if self.options.anomalies:
            self._log_anomaly_edges(t)
        if self._context is not None:
            for write in register_writes(named):
                device = self._context[write.unit]
                fc = _FUNCTION_CODE[write.function]
                words: list[int] | list[bool] = write.words
                if write.function in ("coil", "discrete_input"):
                    words = [bool(w) for w in write.words]
                # setValues adds 1 to the address itself (pymodbus 3.11's off-by-one, matched
                # by getValues), so protocol addresses go in unchanged.
                if device.setValues(fc, write.address, words) is not None:
                    raise DriverError(f"datastore rejected {write}")
            self._modbus_updates += 1
        if self._bus is not None:
            self._send_due(n, named)

    def _send_due(self, n: int, named: Mapping[str, float]) -> None:
        bus = self._bus
        assert bus is not None
        for plan in self._plans:
            bucket = n // plan.period_ticks
            if bucket == plan.last_bucket:
                continue
            plan.last_bucket = bucket
            page, signals = plan.pages[bucket % len(plan.pages)]
            data = _payload(plan, page, signals, named)
            if data is None:
                plan.suppressed += 1
                continue
            message = plan.message
            frame = can.Message(
                arbitration_id=message.frame_id,
                is_extended_id=message.is_extended_frame,
                is_fd=message.is_fd,
                data=message.encode(data, strict=True),
            )
            try:
                # timeout=0: never block the loop on a full TX queue; a lost frame is counted.
                bus.send(frame, timeout=0.0)
            except can.CanError as exc:
                self._can_errors += 1
                if self._can_errors % _ERROR_LOG_EVERY == 1:
                    logger.warning("CAN send failed (%d so far): %s", self._can_errors, exc)
                continue
            plan.sent += 1
        if self.options.can_interface == "virtual":
            # A virtual bus queues every frame others send to us without bound; we never
            # read them, so drop them here or they pile up for the life of the process.
            for _ in range(_VIRTUAL_RX_DRAIN):
                if bus.recv(timeout=0.0) is None:
                    break

    def _log_anomaly_edges(self, t: float) -> None:
        active = tuple(self.plant.active_anomalies(t))
        if active == self._active:
            return
        for a in active:
            if a not in self._active:
                logger.info("anomaly %s active at plant t=%.2f s", a, t)
        for a in self._active:
            if a not in active:
                logger.info("anomaly %s over at plant t=%.2f s", a, t)
        self._active = active

    async def _start_modbus(self, host: str, port: int) -> None:
        sizes = table_sizes(SIM_REGISTERS)

        def block(function: RegisterFunction) -> ModbusSequentialDataBlock:
            size = sizes.get((1, function), 0)
            fill: list[int] | list[bool] = (
                [False] * (size + 1) if function in ("coil", "discrete_input") else [0] * (size + 1)
            )
            # One slot more than the map: the device context shifts addresses up by one.
            return ModbusSequentialDataBlock(0, fill)  # type: ignore[no-untyped-call]

        device = ModbusDeviceContext(
            hr=block("holding"), ir=block("input"), co=block("coil"), di=block("discrete_input")
        )
        self._context = ModbusServerContext(devices={1: device}, single=False)  # type: ignore[no-untyped-call]
        check_bindable(host, port)
        server = ModbusTcpServer(self._context, address=(host, port))
        try:
            await server.serve_forever(background=True)
        except RuntimeError as exc:  # pymodbus' "Could not start listen"
            raise ModbusConnectionError(f"cannot listen on {host}:{port}: {exc}") from exc
        self._server = server
        sockets = getattr(server.transport, "sockets", None) or ()
        if not sockets:
            raise ModbusConnectionError(f"Modbus server on {host}:{port} has no socket")
        self._port = int(sockets[0].getsockname()[1])


def _log_task_failure(task: "asyncio.Task[None]") -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("simulator update task failed", exc_info=task.exception())


def _open_bus(opts: SimOptions) -> can.BusABC:
    assert opts.can_interface is not None
    kwargs: dict[str, Any] = dict(opts.can_options)
    if opts.can_bitrate is not None:
        kwargs["bitrate"] = opts.can_bitrate
    try:
        return can.Bus(interface=opts.can_interface, channel=opts.can_channel, **kwargs)
    except can.CanInterfaceNotImplementedError as exc:
        raise DriverConfigError(f"CAN interface {opts.can_interface!r}: {exc}") from exc
    except (can.CanError, OSError, ValueError, TypeError) as exc:
        raise CanBusError(
            f"cannot open CAN {opts.can_interface}:{opts.can_channel}: {exc}"
        ) from exc


def _frame_plans(dbc: Path, update_period_s: float) -> list[_FramePlan]:
    """The send schedule of every message in ``dbc``; raises DriverConfigError."""
    try:
        db = cantools.database.load_file(str(dbc), strict=True)
    except (OSError, CantoolsError, ValueError) as exc:
        raise DriverConfigError(f"{dbc}: cannot load DBC: {exc}") from exc
    if not isinstance(db, CanDatabase):
        raise DriverConfigError(f"{dbc}: not a CAN database")
    plans: list[_FramePlan] = []
    for message in db.messages:
        cycle_ms = message.cycle_time
        if not cycle_ms:
            raise DriverConfigError(
                f"{dbc}: message {message.name} has no GenMsgCycleTime; the simulator sends "
                "each message at its cycle time"
            )
        unknown = [
            s.name
            for s in message.signals
            if not (s.is_multiplexer or s.name in _KNOWN_SIGNALS or s.name.endswith("_counter"))
        ]
        if unknown:
            raise DriverConfigError(
                f"{dbc}: message {message.name}: no simulated value for signal(s) "
                f"{', '.join(unknown)}; expected plant or state names "
                f"({', '.join(sorted(_KNOWN_SIGNALS))}) or *_counter"
            )
        muxes = [s for s in message.signals if s.is_multiplexer]
        if len(muxes) > 1:
            raise DriverConfigError(f"{dbc}: message {message.name}: nested multiplexing")
        plain = [s for s in message.signals if not s.is_multiplexer and not s.multiplexer_ids]
        pages: list[tuple[int | None, list[Any]]]
        if muxes:
            ids = sorted({i for s in message.signals for i in (s.multiplexer_ids or ())})
            pages = [
                (i, plain + [s for s in message.signals if i in (s.multiplexer_ids or ())])
                for i in ids
            ]
        else:
            pages = [(None, plain)]
        period_ticks = max(1, round(cycle_ms / 1000.0 / update_period_s))
        if cycle_ms / 1000.0 < update_period_s:
            logger.warning(
                "%s: %s every %d ms is faster than the %g ms update period; sent every tick",
                dbc.name,
                message.name,
                cycle_ms,
                update_period_s * 1000,
            )
        plans.append(
            _FramePlan(
                message=message,
                period_ticks=period_ticks,
                mux=muxes[0].name if muxes else None,
                pages=pages,
            )
        )
    return plans


def _payload(
    plan: _FramePlan, page: int | None, signals: list[Any], named: Mapping[str, float]
) -> dict[str, float] | None:
    """Physical values for one frame, or ``None`` when a plant signal in it is missing."""
    data: dict[str, float] = {}
    if plan.mux is not None and page is not None:
        data[plan.mux] = page
    for signal in signals:
        name = signal.name
        value = named.get(name)
        if value is None:
            if name in _PLANT_SIGNALS:
                return None
            maximum = int(signal.maximum) if signal.maximum is not None else 15
            value = float(plan.sent % (maximum + 1))  # an alive counter
        # Saturate at the DBC range (like a sensor at full scale) instead of failing encode.
        if signal.minimum is not None:
            value = max(value, float(signal.minimum))
        if signal.maximum is not None:
            value = min(value, float(signal.maximum))
        data[name] = value
    return data


async def serve(options: SimOptions) -> None:
    """Run the simulator until cancelled, logging what it serves and a periodic status.

    This is the body of ``edge-agent simulate``. Errors at start-up are the
    :class:`DriverError` subclasses :class:`PlantSimulator` raises; cancellation shuts down
    cleanly and propagates.
    """
    async with PlantSimulator.from_options(options) as sim:
        for line in sim.describe():
            logger.info("%s", line)
        while True:
            await sim.wait(options.status_interval_s)
            st = sim.stats()
            values = sim.plant.values_at(st.plant_t_s)
            shown = " ".join(f"{k}={v:.2f}" for k, v in values.items())
            active = ",".join(str(a) for a in sim.plant.active_anomalies(st.plant_t_s)) or "none"
            logger.info(
                "t=%.1f s %s | modbus updates=%d can frames=%d suppressed=%d errors=%d "
                "late ticks=%d | anomalies: %s",
                st.plant_t_s,
                shown,
                st.modbus_updates,
                st.frames_sent,
                st.frames_suppressed,
                st.can_errors,
                st.late_ticks,
                active,
            )
