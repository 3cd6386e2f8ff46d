"""End to end: the whole agent as a process under field-bus load: latency, CPU, READY.

``python -m bench.e2e [--quick] [--json]``

Everything runs in one throw-away network namespace (``tests.support.netns``; needs root), so no
multicast reaches a real NIC:

* a **Modbus load** process: a pymodbus TCP server on ``127.0.0.1:<free port>`` serving the
  simulated drive's register map (:mod:`drivers.sim.registers`), rewritten from a
  :class:`~drivers.sim.plant.MotorPlant` every 10 ms; it counts the requests it answers;
* a **CAN sender** process: 8,000 frames/s paced (as ``bench.can_ingest`` does) on two
  python-can ``udp_multicast`` buses: the motor drive's ``DRIVE_STATUS`` and
  ``DRIVE_VIBRATION`` (``drivers/sim/motor_drive.dbc``, 2,000 frames/s, the same plant's
  values) and the auxiliary equipment of ``bench/data/e2e/extra.dbc`` (6,000 frames/s,
  values derived from the plant; one message is chatter the agent selects nothing from);
* the **agent**: ``edge-agent run --config CFG --duration D --status-json`` with
  ``NOTIFY_SOCKET`` on a unix datagram socket of ours, configured by
  ``bench/data/e2e/agent.toml``: 16 perception signals at 100 Hz, ``window = 64``,
  ``hop = 1`` (a window closes at every grid step), ``lateness_ms = 20``, reasoning and
  memory at their defaults, no API. Four signals come from Modbus (the drive's status block
  polled every 10 ms, voltage every 100 ms, temperature every 200 ms: 115 reads/s), twelve
  from CAN.

The six signals the committed model reads reach it as in its training (the manifest's
``training.acquisition``: voltage's deadband and poll period, temperature's poll period,
``DRIVE_STATUS`` values refreshed every 10 ms and ``DRIVE_VIBRATION``'s every 20 ms), and
the plant starts at plant time 1200 s (seed 1), where the motor runs for the next 470 s:
the model sees normal operation and decides ``normal``.

Sequence: spawn the agent, wait for ``READY=1`` (at most 10 s), start the CAN sender, warm
up 2 s, measure (15 s with ``--quick``, else 60 s), stop the sender, stop the agent with
SIGTERM (``--duration`` is only a safety net) and read its final status. Then the **bare**
baseline: a process that only receives the same CAN stream with a python-can
``Bus.recv()`` loop per bus and makes the same Modbus reads (100 Hz + 10 Hz + 5 Hz) with a
bare pymodbus client, measured the same way for half as long.

Keys (``--json``: one object on the last line):

* ``p50_us``, ``p99_us``, ``p999_us``: the agent's own ``status["latency_us"]["e2e"]``, from
  the instant a window can close (its last grid point + ``lateness_ms``) to its Decision,
  over every decision of the run (the agent keeps the last 10,000); ``null`` when the
  status has no such key (nothing is computed here instead);
* ``cpu_pct``: agent process CPU (all threads) over the measured interval, % of one core
  (psutil); ``bare_cpu_pct`` the same for the bare baseline;
* ``cpu_vs_bare``: ``cpu_pct / bare_cpu_pct`` (target <= 1.5);
* ``host_stalls_per_s``: wake-ups of a probe process (:mod:`bench.host_stalls`, outside the
  namespace) more than 1 ms late per second over the agent's measured interval
  (``bare_host_stalls_per_s``: the bare one's): near 0 on a quiet host; a run with more is
  a noisy run, whatever the agent did;
* ``ready_s``: from spawning the agent to the first ``READY=1`` datagram, ``null`` if none
  came within 10 s;
* ``windows``, ``decisions``, ``drops`` (the sum of every drop counter in the status, listed
  in ``drops_detail``), ``loop`` (the event loop the agent reports, if it does);
* ``frames_per_s``: CAN frames the agent's sources counted / the time the sender sent (it
  sends only between READY and the stop); ``lost_frames`` = sent - counted;
  ``udp_kernel_drops``: of those, datagrams the kernel dropped because the agent's socket
  buffer was full (its reader fell behind);
* ``modbus_reads_per_s``: requests the server answered during the measured interval (only
  the agent is connected then; per read block in ``modbus_reads_per_s_by_block``);
  ``status_modbus_reads_per_s``: the agent's own ``replies`` over the time from its first
  request to SIGTERM.

Targets: P99 <= 2,000 µs; CPU < 50 % of one core; READY <= 1.5 s.
"""

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from bench.e2e_trace import analyze
from bench.host_stalls import HostStallProbe
from bench.profile import Profile
from drivers.osthread import name_os_thread

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "bench" / "data" / "e2e"
TEMPLATE = DATA / "agent.toml"
EXTRA_DBC = DATA / "extra.dbc"
DRIVE_DBC = REPO / "drivers" / "sim" / "motor_drive.dbc"

#: Total CAN rate over both buses (a saturated 1 Mbit/s classic CAN bus).
RATE = 8000
#: The repeating send pattern, one slot per frame: (bus, message). 1,000 frames/s a slot at
#: 8,000 frames/s: the drive bus carries 2,000 frames/s, the aux bus 6,000.
SLOTS: tuple[tuple[str, str], ...] = (
    ("drive", "DRIVE_STATUS"),
    ("aux", "AUX_POWER"),
    ("drive", "DRIVE_VIBRATION"),
    ("aux", "AUX_COOLING"),
    ("aux", "AUX_POWER"),
    ("aux", "AUX_BEARINGS"),
    ("aux", "AUX_CABINET"),
    ("aux", "AUX_HEARTBEAT"),
)
BUS_DBC = {"drive": DRIVE_DBC, "aux": EXTRA_DBC}
#: Last octet of each bus's multicast group (tests.support.netns.GROUP_PREFIX + this).
GROUP_OCTET = {"drive": 81, "aux": 82}
SEED = 1
#: Plant time at start: seed 1 runs the motor from 1158 s to 1669 s, longer than any run.
PLANT_START_S = 1200.0
#: Plant evaluation period of the load processes (the simulator's update period).
TICK_S = 0.01
#: Holding-register reads (start, count, period s) of the agent's Modbus source as its poller
#: plans bench/data/e2e/agent.toml: the drive's fast status block (ramp_state,
#: frequency_setpoint) every 10 ms, voltage every 100 ms and temperature every 200 ms, the
#: periods the committed model was trained with. The bare baseline makes the same reads.
MODBUS_READS: tuple[tuple[int, int, float], ...] = ((8, 2, 0.01), (0, 2, 0.1), (6, 1, 0.2))
#: The motor drive refreshes DRIVE_VIBRATION's value every 20 ms (motor_drive.dbc), the
#: other frames' every 10 ms; frames sent in between repeat the last value.
VIBRATION_EVERY_TICKS = 2
READY_TIMEOUT_S = 10.0
WARMUP_S = 2.0
BARE_WARMUP_S = 1.0
TARGET_P99_US = 2000.0
TARGET_CPU_PCT = 50.0
TARGET_READY_S = 1.5
_TAG = re.compile(
    r"^(?P<key>\s*[A-Za-z0-9_.]+\s*=\s*)(?P<value>.+?)(?P<tag>\s+#\s*@(?P<name>\w+).*)$"
)


# -- config -------------------------------------------------------------------------------


def render_config(template: str, values: Mapping[str, str | int]) -> str:
    """``template`` with the value of every line tagged ``# @name`` replaced by ``values[name]``.

    Raises ``KeyError`` for a tag without a value and ``ValueError`` for a value no line takes.
    """
    used: set[str] = set()
    lines = []
    for line in template.splitlines():
        m = _TAG.match(line)
        if m is None:
            lines.append(line)
            continue
        name = m["name"]
        value = values[name]
        literal = json.dumps(value) if isinstance(value, str) else str(int(value))
        lines.append(f"{m['key']}{literal}{m['tag']}")
        used.add(name)
    unused = set(values) - used
    if unused:
        raise ValueError(f"{TEMPLATE}: no line tagged {', '.join(sorted(unused))}")
    return "\n".join(lines) + "\n"


# -- Modbus load (runs in the netns) ------------------------------------------------------


async def serve_modbus(start_at_s: float) -> None:
    """Serve the plant's registers until stdin closes; ``COUNT`` prints the requests so far."""
    from pymodbus.datastore import (  # noqa: PLC0415
        ModbusDeviceContext,
        ModbusSequentialDataBlock,
        ModbusServerContext,
    )
    from pymodbus.server import ModbusTcpServer  # noqa: PLC0415

    from drivers.sim.plant import MotorPlant  # noqa: PLC0415
    from drivers.sim.registers import SIM_REGISTERS, register_writes, table_sizes  # noqa: PLC0415

    plant = MotorPlant(SEED)
    plant.values_at(start_at_s)  # integrates the thermal model up to the start once
    sizes = table_sizes(SIM_REGISTERS)
    block: Any = ModbusSequentialDataBlock
    # One slot more than the map: the device context shifts addresses up by one (as in
    # drivers.sim.server, whose setValues/getValues pair takes protocol addresses).
    device = ModbusDeviceContext(
        hr=block(0, [0] * (sizes.get((1, "holding"), 0) + 1)),
        ir=block(0, [0] * (sizes.get((1, "input"), 0) + 1)),
        co=block(0, [False] * (sizes.get((1, "coil"), 0) + 1)),
        di=block(0, [False] * (sizes.get((1, "discrete_input"), 0) + 1)),
    )
    server_context: Any = ModbusServerContext
    context = server_context(devices={1: device}, single=False)
    function_code = {"coil": 1, "discrete_input": 2, "holding": 3, "input": 4}
    requests = 0
    by_block: dict[str, int] = {}
    first_mono: float | None = None

    def trace(sending: bool, pdu: Any) -> Any:
        nonlocal requests, first_mono
        if not sending:
            requests += 1
            key = (
                f"fc{pdu.function_code}@{getattr(pdu, 'address', '?')}+{getattr(pdu, 'count', '?')}"
            )
            by_block[key] = by_block.get(key, 0) + 1
            if first_mono is None:
                first_mono = time.monotonic()
        return pdu

    def write(t: float) -> None:
        named = {**plant.values_at(t), **plant.state_at(t).as_signals()}
        for w in register_writes(named):
            words: list[int] | list[bool] = w.words
            if w.function in ("coil", "discrete_input"):
                words = [bool(x) for x in w.words]
            context[w.unit].setValues(function_code[w.function], w.address, words)

    origin = time.time()
    write(start_at_s)
    server = ModbusTcpServer(context, address=("127.0.0.1", 0), trace_pdu=trace)
    await server.serve_forever(background=True)
    transport: Any = server.transport
    port = int(transport.sockets[0].getsockname()[1])

    async def tick() -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        n = 0
        while True:
            n += 1
            delay = t0 + n * TICK_S - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                n += int(-delay / TICK_S)  # late: skip, never replay a burst
                await asyncio.sleep(0)
            write(start_at_s + (time.time() - origin))

    ticker = asyncio.create_task(tick(), name="e2e-modbus-tick")
    print(json.dumps({"port": port, "origin": origin, "start_at_s": start_at_s}), flush=True)
    try:
        while True:
            # Blocks on the parent's next command: a thread, not the loop.
            line = await asyncio.to_thread(sys.stdin.readline)
            if line.strip() != "COUNT":
                break
            reply = {
                "requests": requests,
                "by_block": by_block,
                "mono": time.monotonic(),
                "first_mono": first_mono,
            }
            print(json.dumps(reply), flush=True)
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
        await server.shutdown()  # type: ignore[no-untyped-call]


# -- CAN sender (runs in the netns) -------------------------------------------------------


def _clamp_to_dbc(message: Any, values: dict[str, float]) -> dict[str, float]:
    """``values`` saturated at each signal's DBC range (a sensor at full scale)."""
    out: dict[str, float] = {}
    for sig in message.signals:
        v = values[sig.name]
        if sig.minimum is not None:
            v = max(v, float(sig.minimum))
        if sig.maximum is not None:
            v = min(v, float(sig.maximum))
        out[sig.name] = v
    return out


def plant_frames(
    values: Mapping[str, float], ambient: float, counter: int, rng: random.Random
) -> dict[str, dict[str, float]]:
    """Physical values of every message for one plant tick.

    The motor drive's frames carry the plant's values; the auxiliary ones are derived from
    them (power from voltage and current, coolant and bearings from the winding
    temperature) plus a little sensor noise, so every signal is plausible and moves.
    """
    voltage, current = values["voltage"], values["current"]
    temperature, speed = values["temperature"], values["speed"]
    load = min(1.0, current / 20.0)
    pf = 0.80 + 0.06 * load + rng.gauss(0.0, 0.003)
    heat = temperature - ambient
    return {
        "DRIVE_STATUS": {
            "speed": speed,
            "frequency": values["frequency"],
            "current": current,
            "status_counter": counter % 16,
        },
        "DRIVE_VIBRATION": {"vibration": values["vibration"]},
        "AUX_POWER": {
            "dc_link_voltage": 1.35 * voltage + rng.gauss(0.0, 0.4),
            "active_power": math.sqrt(3.0) * voltage * current * pf / 1000.0 + rng.gauss(0.0, 0.02),
            "power_factor": pf,
            "power_counter": counter % 16,
        },
        "AUX_COOLING": {
            "coolant_temperature": ambient + 6.0 + 0.3 * heat + rng.gauss(0.0, 0.05),
            "coolant_flow": 12.0 + rng.gauss(0.0, 0.08),
            "coolant_pressure": 2.4 + 0.0002 * speed + rng.gauss(0.0, 0.005),
        },
        "AUX_BEARINGS": {
            "bearing_temperature_de": ambient + 4.0 + 0.55 * heat + rng.gauss(0.0, 0.05),
            "bearing_temperature_nde": ambient + 3.0 + 0.45 * heat + rng.gauss(0.0, 0.05),
        },
        "AUX_CABINET": {
            "cabinet_temperature": ambient + 8.0 + rng.gauss(0.0, 0.2),
            "cabinet_humidity": 42.0 + rng.gauss(0.0, 0.3),
        },
        "AUX_HEARTBEAT": {"alive_counter": counter % 256, "fault_word": 0},
    }


def sender(
    buses: Mapping[str, tuple[str, int]], origin: float, start_at_s: float, seconds: float
) -> None:
    """Send ``RATE`` frames/s for ``seconds``; print a start line, then what was sent."""
    import can  # noqa: PLC0415 -- the parent process never needs python-can
    import cantools  # noqa: PLC0415

    from drivers.sim.plant import STEP_HZ, MotorPlant  # noqa: PLC0415

    messages: dict[str, Any] = {}
    route: dict[str, str] = {}
    for bus_name, dbc in BUS_DBC.items():
        db = cantools.database.load_file(dbc, database_format="dbc", strict=True)
        assert isinstance(db, cantools.database.can.Database)
        for slot_bus, name in SLOTS:
            if slot_bus == bus_name:
                messages[name] = db.get_message_by_name(name)
                route[name] = bus_name
    plant = MotorPlant(SEED)
    rng = random.Random(11)
    # Tick n shows plant step k0 + n (mid-step), so no step is skipped or shown twice
    # whatever the jitter of the loop; the plant is the Modbus server's (same seed, origin).
    k0 = math.floor((start_at_s + (time.time() - origin)) * STEP_HZ)
    last: dict[str, Any] = {}

    def frames_at(tick: int) -> dict[str, Any]:
        t = (k0 + tick + 0.5) / STEP_HZ
        ambient = plant.state_at(t).as_signals()["ambient_temperature"]
        for name, values in plant_frames(plant.values_at(t), ambient, tick, rng).items():
            if name == "DRIVE_VIBRATION" and tick % VIBRATION_EVERY_TICKS and name in last:
                continue
            msg = messages[name]
            last[name] = can.Message(
                arbitration_id=msg.frame_id,
                is_extended_id=msg.is_extended_frame,
                data=msg.encode(_clamp_to_dbc(msg, values), strict=True),
            )
        return dict(last)

    frames_at(0)  # the first evaluation integrates the plant up to now: not in the paced loop
    opened = {
        name: can.Bus(interface="udp_multicast", channel=group, port=port, fd=False)
        for name, (group, port) in buses.items()
    }
    try:
        send = {name: opened[route[name]].send for _, name in SLOTS}
        pattern = [name for _, name in SLOTS]
        per_tick = max(1, round(RATE * TICK_S))
        sent = dict.fromkeys(buses, 0)
        total = int(RATE * seconds)
        frames: dict[str, Any] = {}
        print(json.dumps({"started": True}), flush=True)
        t0 = time.perf_counter()
        for i in range(total):
            if i % per_tick == 0:
                frames = frames_at(1 + i // per_tick)
            ahead = t0 + i / RATE - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
            name = pattern[i % len(pattern)]
            send[name](frames[name])
            sent[route[name]] += 1
        elapsed = time.perf_counter() - t0
    finally:
        for bus in opened.values():
            bus.shutdown()
    print(json.dumps({"sent": sent, "elapsed_s": elapsed}), flush=True)


# -- bare baseline (runs in the netns) ----------------------------------------------------


async def bare(buses: Mapping[str, tuple[str, int]], modbus_port: int) -> None:
    """Receive every bus with ``Bus.recv()`` in a thread each, poll Modbus at 100 Hz."""
    import can  # noqa: PLC0415
    from pymodbus.client import AsyncModbusTcpClient  # noqa: PLC0415
    from pymodbus.exceptions import ModbusException  # noqa: PLC0415

    opened = [
        can.Bus(interface="udp_multicast", channel=group, port=port, fd=False)
        for group, port in buses.values()
    ]
    frames = [0] * len(opened)
    stop = threading.Event()

    def receive(i: int, bus: Any) -> None:
        name_os_thread(f"bare-rx-{i}")
        recv = bus.recv
        n = 0
        while not stop.is_set():
            if recv(0.2) is not None:
                n += 1
                frames[i] = n

    threads = [
        threading.Thread(target=receive, args=(i, b), name=f"bare-rx-{i}", daemon=True)
        for i, b in enumerate(opened)
    ]
    for t in threads:
        t.start()
    client = AsyncModbusTcpClient("127.0.0.1", port=modbus_port, timeout=0.3, retries=0)
    await client.connect()
    reads = errors = 0
    # Pollers stop at this flag, not by cancellation: pymodbus turns the CancelledError of a
    # request in flight into a ModbusIOException (see drivers/modbus/client.py).
    stopping = False

    async def poll(start: int, count: int, period_s: float) -> None:
        nonlocal reads, errors
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        n = 0
        while not stopping:
            try:
                # pymodbus serialises requests on one connection, as the agent's poller does.
                rr = await client.read_holding_registers(start, count=count, device_id=1)
            except ModbusException:
                errors += 1
            else:
                if rr.isError():
                    errors += 1
                else:
                    reads += 1
            n += 1
            delay = t0 + n * period_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                n += int(-delay / period_s)  # late: skip the missed slots

    pollers = [
        asyncio.create_task(poll(*read), name=f"bare-modbus-{read[0]}") for read in MODBUS_READS
    ]
    print("READY", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    stopping = True
    await asyncio.gather(*pollers)
    stop.set()
    for t in threads:
        t.join()
    client.close()
    for b in opened:
        b.shutdown()
    print(json.dumps({"frames": sum(frames), "reads": reads, "errors": errors}), flush=True)


# -- orchestration (host namespace) -------------------------------------------------------


class NotifyListener:
    """A bound ``AF_UNIX`` datagram socket standing in for systemd's ``NOTIFY_SOCKET``.

    A thread reads every datagram (so the agent never finds the queue full) and records
    when the first one holding ``READY=1`` arrived (``time.monotonic()``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[tuple[float, str]] = []
        self.ready_at: float | None = None
        self._ready = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="notify-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.monotonic()
            text = data.decode(errors="replace")
            self.messages.append((now, text))
            if self.ready_at is None and "READY=1" in text.splitlines():
                self.ready_at = now
                self._ready.set()

    def wait_ready(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s)

    def close(self) -> None:
        self._closed = True
        self._thread.join()
        self._sock.close()


class ModbusLoad:
    """The Modbus load process: its port, and its request counter on demand."""

    def __init__(self, proc: "subprocess.Popen[str]") -> None:
        self.proc = proc
        assert proc.stdin is not None
        assert proc.stdout is not None
        self._stdin: IO[str] = proc.stdin
        self._stdout: IO[str] = proc.stdout
        hello = self._stdout.readline()
        if not hello:
            raise RuntimeError("Modbus load process did not start")
        info = json.loads(hello)
        self.port = int(info["port"])
        self.origin = float(info["origin"])

    def count(self) -> dict[str, Any]:
        """``requests`` answered so far, at ``mono``; ``first_mono``: the first request."""
        self._stdin.write("COUNT\n")
        self._stdin.flush()
        reply: dict[str, Any] = json.loads(self._stdout.readline())
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Interval:
    """CPU of one process and the Modbus requests served over one measured interval."""

    wall_s: float
    cpu_s: float
    modbus_requests: int
    #: Requests per read block (``fc3@8+2``: function 3, address 8, 2 registers).
    modbus_by_block: dict[str, int]
    #: Wake-ups of the host stall probe more than 1 ms late per second, same interval.
    host_stalls_per_s: float = float("nan")
    #: The interval on the wall clock (UNIX ns), to pick the agent's traced windows in it.
    start_ns: int = 0
    end_ns: int = 0
    #: CPU % of one core per thread name over the interval.
    threads_pct: dict[str, float] = field(default_factory=dict)

    @classmethod
    def between(
        cls, c0: Mapping[str, Any], cpu0: float, c1: Mapping[str, Any], cpu1: float
    ) -> "Interval":
        """From two (Modbus load count, process CPU seconds) snapshots."""
        b0, b1 = c0["by_block"], c1["by_block"]
        return cls(
            wall_s=float(c1["mono"]) - float(c0["mono"]),
            cpu_s=cpu1 - cpu0,
            modbus_requests=int(c1["requests"]) - int(c0["requests"]),
            modbus_by_block={k: int(v) - int(b0.get(k, 0)) for k, v in sorted(b1.items())},
        )

    @property
    def cpu_pct(self) -> float:
        return 100.0 * self.cpu_s / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def modbus_reads_per_s(self) -> float:
        return self.modbus_requests / self.wall_s if self.wall_s > 0 else float("nan")

    def modbus_block_rates(self) -> dict[str, float]:
        if self.wall_s <= 0:
            return {}
        return {k: round(n / self.wall_s, 1) for k, n in self.modbus_by_block.items() if n}


@dataclass
class SenderRun:
    """A CAN sender process started in the netns; ``started`` is when it began sending."""

    proc: "subprocess.Popen[str]"
    started: float
    result: dict[str, Any] = field(default_factory=dict)

    def finish(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        out, _ = self.proc.communicate(timeout=timeout_s)
        if self.proc.returncode != 0 or not out.strip():
            raise RuntimeError(f"CAN sender failed (exit {self.proc.returncode})")
        self.result = json.loads(out.strip().splitlines()[-1])
        return self.result

    @property
    def sent(self) -> int:
        return sum(int(v) for v in self.result["sent"].values())

    @property
    def elapsed_s(self) -> float:
        return float(self.result["elapsed_s"])


def _cpu_s(proc: Any) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (the kernel's ``comm``; threads of one name summed)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip()
            # comm may hold spaces and parentheses: the fields start after the last ')'.
            fields = (task / "stat").read_text().rpartition(")")[2].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _threads_pct(
    t0: Mapping[str, float], t1: Mapping[str, float], wall_s: float
) -> dict[str, float]:
    if wall_s <= 0:
        return {}
    pct = {k: round(100.0 * (v - t0.get(k, 0.0)) / wall_s, 1) for k, v in t1.items()}
    return dict(sorted(((k, v) for k, v in pct.items() if v >= 0.1), key=lambda kv: -kv[1]))


def _agent_process(pid: int) -> Any:
    """The psutil process running ``edge-agent``: ``ip netns exec`` execs it in place."""
    import psutil  # noqa: PLC0415

    proc = psutil.Process(pid)
    for candidate in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            if any("edge-agent" in part for part in candidate.cmdline()):
                return candidate
    return proc


def _sleep_until(deadline: float, alive: Callable[[], bool]) -> None:
    while (left := deadline - time.monotonic()) > 0:
        if not alive():
            raise RuntimeError("a bench process exited early")
        time.sleep(min(left, 0.1))


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def parse_status(text: str) -> dict[str, Any] | None:
    """The last JSON object in the agent's stdout (``--status-json`` prints it last)."""
    with contextlib.suppress(ValueError):
        whole = json.loads(text)
        if isinstance(whole, dict):
            return whole
    decoder = json.JSONDecoder()
    starts = [m.start() for m in re.finditer(r"(?m)^\{", text)]
    for start in reversed(starts):
        with contextlib.suppress(ValueError):
            obj, _ = decoder.raw_decode(text, start)
            if isinstance(obj, dict):
                return obj
    return None


_DROP_KEY = re.compile(r"(^|_)(dropped|drops)(_|$)")


def drop_counters(status: Mapping[str, Any]) -> dict[str, int]:
    """Every drop counter in ``status`` by its dotted path.

    A counter is an integer whose key says ``dropped``/``drops``, plus perception's
    ``windows_skipped`` (windows never built after a stall). ``*_rows`` counters are left
    out: they count again, in rows, drops another counter already counts in items.
    """
    found: dict[str, int] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, Mapping):
                walk(value, path + ".")
            elif isinstance(value, int) and not isinstance(value, bool):
                if key.endswith("_rows"):
                    continue
                if _DROP_KEY.search(key) or key == "windows_skipped":
                    found[path] = value

    walk(status, "")
    return found


def _get(node: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def udp_drops(ns: str, ports: set[int]) -> int | None:
    """Datagrams the kernel dropped on full receive buffers, over the UDP sockets bound to
    ``ports`` in namespace ``ns`` (``/proc/net/udp``'s last column); None if unreadable."""
    from tests.support.netns import in_netns  # noqa: PLC0415

    done = subprocess.run(
        in_netns(ns, ["cat", "/proc/net/udp"]), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return None
    total = 0
    for line in done.stdout.splitlines()[1:]:
        cols = line.split()
        if len(cols) > 12 and int(cols[1].rpartition(":")[2], 16) in ports:
            total += int(cols[-1])
    return total


def _reap(proc: "subprocess.Popen[str]") -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@dataclass
class AgentRun:
    """What the agent phase measured and the agent's final status."""

    status: dict[str, Any]
    ready_s: float | None
    interval: Interval
    sender: SenderRun
    #: From the agent's first Modbus request to SIGTERM (None: no request seen).
    polled_s: float | None
    #: Datagrams the kernel dropped on the agent's CAN sockets (None: unknown).
    udp_drops: int | None


@dataclass
class BareRun:
    """What the bare baseline phase measured."""

    interval: Interval
    sender: SenderRun
    frames: int


class Bench:
    """The Modbus load in namespace ``ns``, and the two phases measured against it.

    Use as ``with``: leaving kills every process it started (by its Popen) and closes the
    logs it writes to ``tmp``.
    """

    load: ModbusLoad

    def __init__(
        self, ns: str, tmp: Path, profile_dir: Path | None = None, trace: bool = False
    ) -> None:
        from tests.support.netns import GROUP_PREFIX  # noqa: PLC0415

        self.ns = ns
        self.tmp = tmp
        #: Where ``py-spy`` records the agent over its measured interval (None: no profile).
        self.profile_dir = profile_dir
        self.profile: dict[str, Any] | None = None
        #: Run the agent with ``--trace`` and analyze it (:mod:`bench.e2e_trace`).
        self.trace = trace
        self.trace_figures: dict[str, Any] | None = None
        self.me = [sys.executable, "-m", "bench.e2e"]
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONPATH": path}
        port0 = 41_000 + random.randrange(10_000)
        self.buses = {
            name: (f"{GROUP_PREFIX}{GROUP_OCTET[name]}", port0 + i)
            for i, name in enumerate(BUS_DBC)
        }
        self.bus_args = [
            f"--bus={name}={group}:{port}" for name, (group, port) in self.buses.items()
        ]
        self._stack = contextlib.ExitStack()
        self.notes: list[str] = []

    def __enter__(self) -> "Bench":
        try:
            proc = self.spawn_device(
                [*self.me, "--role", "modbus", "--start-at", repr(PLANT_START_S)],
                "load",
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            self.load = ModbusLoad(proc)
            self._stack.callback(self.load.close)
            # Outside the namespace: the host's own scheduling is what it measures.
            self.stalls = HostStallProbe()
            self._stack.callback(self.stalls.close)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def spawn_device(self, argv: list[str], log: str, **kwargs: Any) -> "subprocess.Popen[str]":
        """Start ``argv`` in the namespace, stderr to ``<tmp>/<log>.log``; reaped on exit."""
        from tests.support.netns import in_netns  # noqa: PLC0415

        kwargs.setdefault("env", self.env)
        err = self._stack.enter_context(open(self.tmp / f"{log}.log", "a"))  # noqa: SIM115
        proc: subprocess.Popen[str] = subprocess.Popen(
            in_netns(self.ns, argv), cwd=REPO, stderr=err, text=True, **kwargs
        )
        self._stack.callback(_reap, proc)
        return proc

    def send_can(self, seconds: float) -> SenderRun:
        """Start the CAN sender; returns once it sends (``started``)."""
        proc = self.spawn_device(
            [
                *self.me,
                "--role",
                "sender",
                *self.bus_args,
                "--origin",
                repr(self.load.origin),
                "--seconds",
                str(seconds),
            ],
            "sender",
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        if not proc.stdout.readline():
            proc.wait()
            raise RuntimeError("CAN sender did not start:\n" + _tail(self.tmp / "sender.log"))
        return SenderRun(proc, time.monotonic())

    def _measure(
        self,
        tx: SenderRun,
        warmup_s: float,
        measure_s: float,
        ps: Any,
        alive: Callable[[], bool],
        on_start: Callable[[], None] | None = None,
    ) -> Interval:
        _sleep_until(tx.started + warmup_s, alive)
        if on_start is not None:
            on_start()
        c0, cpu0, s0, t0 = self.load.count(), _cpu_s(ps), self.stalls.read(), time.time_ns()
        th0 = thread_cpu_s(ps.pid)
        _sleep_until(tx.started + warmup_s + measure_s, alive)
        c1, cpu1, s1, t1 = self.load.count(), _cpu_s(ps), self.stalls.read(), time.time_ns()
        th1 = thread_cpu_s(ps.pid)
        tx.finish(timeout_s=30)
        time.sleep(0.3)  # frames still in the sockets reach the receiver
        interval = Interval.between(c0, cpu0, c1, cpu1)
        return replace(
            interval,
            host_stalls_per_s=s1.rate_since(s0),
            start_ns=t0,
            end_ns=t1,
            threads_pct=_threads_pct(th0, th1, interval.wall_s),
        )

    def agent_phase(self, measure_s: float) -> AgentRun:
        """Spawn the agent, wait for READY, load it with CAN, measure, SIGTERM, read status."""
        state_dir = self.tmp / "state"
        state_dir.mkdir()
        config = self.tmp / "agent.toml"
        config.write_text(
            render_config(
                TEMPLATE.read_text(),
                {
                    "state_dir": str(state_dir),
                    "modbus_port": self.load.port,
                    "drive_group": self.buses["drive"][0],
                    "drive_port": self.buses["drive"][1],
                    "drive_dbc": str(DRIVE_DBC),
                    "aux_group": self.buses["aux"][0],
                    "aux_port": self.buses["aux"][1],
                    "aux_dbc": str(EXTRA_DBC),
                },
            )
        )
        listener = NotifyListener(self.tmp / "notify.sock")
        self._stack.callback(listener.close)
        env = {**os.environ, "NOTIFY_SOCKET": str(listener.path)}
        for key in ("WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID"):
            env.pop(key, None)
        # --duration is a safety net only: the agent is stopped with SIGTERM.
        duration = READY_TIMEOUT_S + WARMUP_S + measure_s + 30.0
        out_path = self.tmp / "agent.stdout"
        argv = [str(Path(sys.executable).parent / "edge-agent"), "run", "--config", str(config)]
        argv += ["--duration", f"{duration:g}", "--status-json"]
        trace_path = self.tmp / "trace.json"
        if self.trace:
            argv += ["--trace", str(trace_path)]
        with open(out_path, "w") as out:
            spawned = time.monotonic()
            agent = self.spawn_device(argv, "agent", env=env, stdin=subprocess.DEVNULL, stdout=out)

        def alive() -> bool:
            return agent.poll() is None

        deadline = spawned + READY_TIMEOUT_S
        while not listener.wait_ready(0.05) and time.monotonic() < deadline:
            if not alive():
                raise RuntimeError(
                    f"agent exited with {agent.returncode} before READY:\n"
                    + _tail(self.tmp / "agent.log")
                )
        ready_s = listener.ready_at - spawned if listener.ready_at is not None else None
        if ready_s is None:
            self.notes.append(f"no READY=1 on NOTIFY_SOCKET within {READY_TIMEOUT_S:g} s")
        ps = _agent_process(agent.pid)

        # CAN only while the agent's buses are open: every frame sent is one it should count.
        tx = self.send_can(WARMUP_S + measure_s)
        profiles: list[Profile] = []

        def start_profile() -> None:
            if self.profile_dir is not None:
                out = self.profile_dir / "agent.folded"
                profiles.append(Profile(agent.pid, measure_s, out))

        interval = self._measure(tx, WARMUP_S, measure_s, ps, alive, start_profile)
        if profiles:
            self.profile = profiles[0].wait()
        stopped = time.monotonic()
        first_request = self.load.count().get("first_mono")
        # Only the agent's sockets are bound to the bus ports now (the sender has exited).
        kernel_drops = udp_drops(self.ns, {port for _, port in self.buses.values()})
        ps.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise RuntimeError("agent did not stop within 30 s of SIGTERM") from None
        if agent.returncode != 0:
            raise RuntimeError(
                f"agent exited with {agent.returncode}:\n" + _tail(self.tmp / "agent.log")
            )
        status = parse_status(out_path.read_text(errors="replace"))
        if status is None:
            raise RuntimeError("no status JSON on the agent's stdout")
        polled = stopped - float(first_request) if first_request is not None else None
        if self.trace:
            if not trace_path.exists():
                raise RuntimeError("the agent wrote no --trace file")
            doc = json.loads(trace_path.read_text())
            self.trace_figures = analyze(doc, interval.start_ns, interval.end_ns)
            if self.profile_dir is not None:
                shutil.copy(trace_path, self.profile_dir / "trace.json")
        return AgentRun(status, ready_s, interval, tx, polled, kernel_drops)

    def bare_phase(self, measure_s: float) -> BareRun:
        """The bare receiver and poller under the same load, measured the same way."""
        import psutil  # noqa: PLC0415

        argv = [*self.me, "--role", "bare", *self.bus_args, "--modbus-port", str(self.load.port)]
        proc = self.spawn_device(argv, "bare", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "READY":
            raise RuntimeError("bare baseline did not start:\n" + _tail(self.tmp / "bare.log"))

        def alive() -> bool:
            return proc.poll() is None

        tx = self.send_can(BARE_WARMUP_S + measure_s)
        interval = self._measure(tx, BARE_WARMUP_S, measure_s, psutil.Process(proc.pid), alive)
        out, _ = proc.communicate("STOP\n", timeout=30)
        return BareRun(interval, tx, int(json.loads(out.strip().splitlines()[-1])["frames"]))


def figures(agent: AgentRun, bare_run: BareRun, notes: list[str]) -> dict[str, Any]:
    """The keys of the module docstring from what the two phases measured."""
    status = agent.status
    sources: Mapping[str, Any] = status.get("sources") or {}
    can_frames = sum(int(s["frames"]) for s in sources.values() if "frames" in s)
    replies = sum(int(s["replies"]) for s in sources.values() if "replies" in s)
    e2e = _get(status, "latency_us", "e2e")
    if not isinstance(e2e, Mapping) or "p99" not in e2e:
        e2e = None
        notes.append("status has no latency_us.e2e: p50/p99/p999 are null")
    loop = status.get("loop")
    if loop is None:
        loop = _get(status, "agent", "loop")
    drops = drop_counters(status)
    iv, tx, polled = agent.interval, agent.sender, agent.polled_s
    return {
        "p50_us": e2e.get("p50") if e2e else None,
        "p99_us": e2e.get("p99") if e2e else None,
        "p999_us": e2e.get("p999") if e2e else None,
        "e2e_max_us": e2e.get("max") if e2e else None,
        "e2e_n": e2e.get("n") if e2e else None,
        "cpu_pct": round(iv.cpu_pct, 1),
        "ready_s": round(agent.ready_s, 3) if agent.ready_s is not None else None,
        "agent_ready_s": _get(status, "agent", "ready_s"),
        "windows": status.get("windows"),
        "decisions": _get(status, "reasoning", "decisions"),
        "drops": sum(drops.values()),
        "drops_detail": drops,
        "frames_per_s": round(can_frames / tx.elapsed_s, 1),
        "sent_frames_per_s": round(tx.sent / tx.elapsed_s, 1),
        "lost_frames": tx.sent - can_frames,
        "udp_kernel_drops": agent.udp_drops,
        "modbus_reads_per_s": round(iv.modbus_reads_per_s, 1),
        "modbus_reads_per_s_by_block": iv.modbus_block_rates(),
        "status_modbus_reads_per_s": round(replies / polled, 1) if polled else None,
        "modbus_late_polls": sum(int(s.get("late_polls", 0)) for s in sources.values()),
        "loop": loop,
        "bare_cpu_pct": round(bare_run.interval.cpu_pct, 1),
        "cpu_vs_bare": round(iv.cpu_pct / bare_run.interval.cpu_pct, 2)
        if bare_run.interval.cpu_pct > 0
        else None,
        "cpu_by_thread_pct": iv.threads_pct,
        "bare_cpu_by_thread_pct": bare_run.interval.threads_pct,
        "host_stalls_per_s": round(iv.host_stalls_per_s, 2),
        "bare_host_stalls_per_s": round(bare_run.interval.host_stalls_per_s, 2),
        "bare_frames_per_s": round(bare_run.frames / bare_run.sender.elapsed_s, 1),
        "bare_modbus_reads_per_s": round(bare_run.interval.modbus_reads_per_s, 1),
        "labels": _get(status, "reasoning", "labels"),
        "measured_s": round(iv.wall_s, 2),
        "bare_measured_s": round(bare_run.interval.wall_s, 2),
        "signals": 16,
        "rate_hz": 100,
        "window": 64,
        "hop": 1,
        "lateness_ms": 20,
        "notes": notes,
    }


def run_bench(
    ns: str, tmp: Path, quick: bool, profile_dir: Path | None = None, trace: bool = False
) -> dict[str, Any]:
    """Both phases in namespace ``ns``; the figures (see the module docstring)."""
    measure_s = 15.0 if quick else 60.0
    with Bench(ns, tmp, profile_dir, trace) as bench:
        agent = bench.agent_phase(measure_s)
        bare_run = bench.bare_phase(measure_s / 2)
    fig = figures(agent, bare_run, bench.notes)
    if bench.profile is not None:
        fig["profile"] = bench.profile
    if bench.trace_figures is not None:
        fig["trace"] = bench.trace_figures
    return fig


def _fmt(value: Any, spec: str = ".0f") -> str:
    if value is None:
        return "null"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return format(value, spec) if isinstance(value, int | float) else str(value)


def _verdict(value: Any, ok: Callable[[float], bool]) -> str:
    if value is None:
        return "n/a"
    return "ok" if ok(float(value)) else "MISS"


def report(fig: Mapping[str, Any], say: Callable[..., None]) -> None:
    rows: list[tuple[str, str, str, str]] = [
        ("e2e latency p50 µs", _fmt(fig["p50_us"]), "", ""),
        (
            "e2e latency p99 µs",
            _fmt(fig["p99_us"]),
            f"<= {TARGET_P99_US:,.0f}",
            _verdict(fig["p99_us"], lambda v: v <= TARGET_P99_US),
        ),
        ("e2e latency p99.9 µs", _fmt(fig["p999_us"]), "", ""),
        ("e2e latency max µs (n)", f"{_fmt(fig['e2e_max_us'])} ({_fmt(fig['e2e_n'])})", "", ""),
        (
            "agent CPU % of one core",
            _fmt(fig["cpu_pct"], ".1f"),
            f"< {TARGET_CPU_PCT:.0f}",
            _verdict(fig["cpu_pct"], lambda v: v < TARGET_CPU_PCT),
        ),
        ("bare baseline CPU %", _fmt(fig["bare_cpu_pct"], ".1f"), "", ""),
        (
            "agent CPU / bare CPU",
            _fmt(fig["cpu_vs_bare"], ".2f"),
            "<= 1.5",
            _verdict(fig["cpu_vs_bare"], lambda v: v <= 1.5),
        ),
        (
            "host stalls/s > 1 ms (bare phase)",
            f"{_fmt(fig['host_stalls_per_s'], '.2f')} "
            f"({_fmt(fig['bare_host_stalls_per_s'], '.2f')})",
            "~0 when quiet",
            "",
        ),
        (
            "READY s (spawn -> READY=1)",
            _fmt(fig["ready_s"], ".3f"),
            f"<= {TARGET_READY_S:g}",
            _verdict(fig["ready_s"], lambda v: v <= TARGET_READY_S),
        ),
        ("windows / decisions", f"{_fmt(fig['windows'])} / {_fmt(fig['decisions'])}", "", ""),
        ("drops (all counters)", _fmt(fig["drops"]), "", ""),
        (
            "CAN frames/s received (sent)",
            f"{_fmt(fig['frames_per_s'])} ({_fmt(fig['sent_frames_per_s'])})",
            "",
            "",
        ),
        (
            "CAN frames lost (kernel drops)",
            f"{_fmt(fig['lost_frames'])} ({_fmt(fig['udp_kernel_drops'])})",
            "",
            "",
        ),
        (
            "Modbus reads/s (status)",
            f"{_fmt(fig['modbus_reads_per_s'], '.1f')} "
            f"({_fmt(fig['status_modbus_reads_per_s'], '.1f')})",
            "",
            "",
        ),
        ("Modbus late polls", _fmt(fig["modbus_late_polls"]), "", ""),
        (
            "bare: frames/s, reads/s",
            f"{_fmt(fig['bare_frames_per_s'])}, {_fmt(fig['bare_modbus_reads_per_s'], '.1f')}",
            "",
            "",
        ),
        ("event loop", _fmt(fig["loop"]), "", ""),
    ]
    width = max(len(r[0]) for r in rows)
    say(f"{'figure':<{width}}  {'value':>16}  {'target':>8}")
    for name, value, target, verdict in rows:
        say(f"{name:<{width}}  {value:>16}  {target:>8}  {verdict}".rstrip())
    nonzero = {k: v for k, v in fig["drops_detail"].items() if v}
    if nonzero:
        say("drops by counter: " + ", ".join(f"{k}={v}" for k, v in nonzero.items()))
    blocks = fig["modbus_reads_per_s_by_block"]
    if blocks:
        say("Modbus reads/s by block: " + ", ".join(f"{k} {v:g}" for k, v in blocks.items()))
    if fig["labels"]:
        say(f"model labels: {fig['labels']}")
    for note in fig["notes"]:
        say(f"note: {note}")


def orchestrate(
    quick: bool, as_json: bool, profile_dir: Path | None = None, trace: bool = False
) -> int:
    from tests.support.netns import netns, netns_problem  # noqa: PLC0415

    problem = netns_problem()
    if problem is not None:
        print(f"e2e: cannot run: {problem}", file=sys.stderr)
        return 2
    say: Callable[..., None] = (lambda *a: print(*a, file=sys.stderr)) if as_json else print
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edgefleet-e2e-") as tmp, netns("efe2e") as ns:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        say(
            f"e2e: edge-agent as a process in netns {ns}; 16 signals @ 100 Hz, window 64, hop 1, "
            f"lateness 20 ms; CAN {RATE} frames/s on 2 udp_multicast buses; Modbus status block "
            f"every 10 ms (+ voltage 100 ms, temperature 200 ms); {os.cpu_count()} cpus, "
            f"load average {load}"
        )
        try:
            figures = run_bench(ns, Path(tmp), quick, profile_dir, trace)
        except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
            print(f"e2e: failed: {exc}", file=sys.stderr)
            return 1
    report(figures, say)
    say(f"{time.monotonic() - t_start:.1f} s")
    if as_json:
        print(json.dumps(figures))
    return 0


def _bus(text: str) -> tuple[str, tuple[str, int]]:
    """``NAME=GROUP:PORT`` -> (name, (group, port))."""
    name, _, where = text.partition("=")
    group, _, port = where.rpartition(":")
    return name, (group, int(port))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.e2e", description=(__doc__ or "").split("\n", 1)[0]
    )
    parser.add_argument("--quick", action="store_true", help="15 s of measurement (else 60 s)")
    parser.add_argument(
        "--json", action="store_true", help="figures as one JSON object on the last line"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="record the agent with py-spy over the measured interval into DIR/agent.folded "
        "and add its summary (threads, functions by self and inclusive time) as 'profile'",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="run the agent with --trace: steady-state percentiles over the measured interval "
        "and what the slowest 1 %% of windows waited for, as 'trace' (the file itself goes "
        "to the --profile DIR when there is one)",
    )
    parser.add_argument("--role", choices=("modbus", "sender", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--bus", action="append", type=_bus, default=[], help=argparse.SUPPRESS)
    parser.add_argument("--origin", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, default=PLANT_START_S, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--modbus-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is None:
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
        return orchestrate(args.quick, args.json, args.profile, args.trace)
    if args.role == "modbus":
        asyncio.run(serve_modbus(args.start_at))
        return 0
    from tests.support.netns import assert_isolated  # noqa: PLC0415

    assert_isolated()  # the sender and the bare baseline use multicast
    buses = dict(args.bus)
    if args.role == "sender":
        sender(buses, args.origin, args.start_at, args.seconds)
    else:
        asyncio.run(bare(buses, args.modbus_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
