"""The processes ``bench.e2e`` starts in its network namespace: the Modbus load, the CAN
sender and the bare baseline (``python -m bench.e2e --role modbus|sender|bare``).

What each sends or reads, and why at those rates: :mod:`bench.e2e`.
"""

import asyncio
import contextlib
import json
import math
import random
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from drivers.osthread import name_os_thread

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "bench" / "data" / "e2e"
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
