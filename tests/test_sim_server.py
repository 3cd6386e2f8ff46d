"""PlantSimulator against real peers: a pymodbus TCP client and a python-can virtual bus."""

import asyncio
import itertools
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path

import can
import cantools
import pytest
from cantools.database.can import Database as CanDatabase
from pymodbus.client import AsyncModbusTcpClient

from drivers.errors import DriverConfigError, PortInUse
from drivers.modbus.codec import decode
from drivers.sim.plant import STEP_S, Anomaly, MotorPlant, step_index
from drivers.sim.registers import SIM_REGISTERS
from drivers.sim.server import MOTOR_DRIVE_DBC, PlantSimulator, SimOptions, serve
from drivers.specs import RegisterSpec
from tests.support.ports import free_port

pytestmark = [pytest.mark.peers, pytest.mark.timeout(30)]

SEED = 3
START = 31.0  # steady 45 Hz until t = 61 s for seed 3
_channels = itertools.count()

STATUS, THERMAL, DIAG, VIBRATION = 0x100, 0x101, 0x102, 0x18FF5001


def _channel() -> str:
    return f"test-sim-{next(_channels)}"


async def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    # Polling on purpose: the conditions are counters of a running peer, not events.
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


def _decode(db: CanDatabase, frame: can.Message) -> dict[str, float]:
    decoded = db.decode_message(frame.arbitration_id, bytes(frame.data), decode_choices=False)
    assert isinstance(decoded, Mapping)
    return {name: float(value) for name, value in decoded.items()}  # type: ignore[arg-type]


def _past_step(sim: PlantSimulator, step: int) -> Callable[[], bool]:
    return lambda: sim.stats().plant_step > step


def _drain(bus: can.BusABC) -> list[can.Message]:
    frames = []
    while (frame := bus.recv(timeout=0.0)) is not None:
        frames.append(frame)
    return frames


def _load_dbc() -> CanDatabase:
    db = cantools.database.load_file(str(MOTOR_DRIVE_DBC), strict=True)
    assert isinstance(db, CanDatabase)
    return db


def _tolerance(spec: RegisterSpec) -> float:
    """Largest honest difference between a decoded register and the plant's float."""
    if spec.type.startswith("float"):
        return 1e-4  # float32 rounding of values ~400
    return spec.scale / 2 + 1e-9


def _registers_match(
    specs: list[RegisterSpec], words: list[int], expected: Mapping[str, float]
) -> bool:
    return all(
        abs(decode(s, words[s.address : s.address + s.width]) - expected[s.name]) <= _tolerance(s)
        for s in specs
    )


def test_dbc_ships_and_loads_strictly() -> None:
    db = _load_dbc()
    ids = {m.frame_id: m for m in db.messages}
    assert set(ids) == {STATUS, THERMAL, DIAG, VIBRATION}
    assert ids[VIBRATION].is_extended_frame
    assert ids[DIAG].is_multiplexed()
    can_signals = {s.name for m in db.messages for s in m.signals}
    modbus_signals = {s.name for s in SIM_REGISTERS}
    plant_signals = {"voltage", "current", "frequency", "speed", "temperature", "vibration"}
    assert plant_signals <= can_signals | modbus_signals
    assert plant_signals <= modbus_signals
    assert plant_signals - can_signals == {"voltage"}


def test_modbus_registers_track_the_plant() -> None:
    holding = [s for s in SIM_REGISTERS if s.function == "holding" and s.type != "bitfield"]
    bits = [s for s in SIM_REGISTERS if s.type == "bitfield"]
    inputs = [s for s in SIM_REGISTERS if s.function == "input"]
    truth = MotorPlant(SEED)  # a separate instance: the simulator must match it exactly

    async def scenario() -> None:
        async with PlantSimulator(seed=SEED, can_interface=None, start_at_s=START) as sim:
            assert sim.modbus_port > 0
            client = AsyncModbusTcpClient("127.0.0.1", port=sim.modbus_port, timeout=2)
            assert await client.connect()
            try:
                seen: set[int] = set()
                for _ in range(6):
                    before = sim.stats().plant_step
                    hr = await client.read_holding_registers(0, count=10, device_id=1)
                    after = sim.stats().plant_step
                    assert not hr.isError()
                    steps = range(before, after + 1)
                    match = [
                        k
                        for k in steps
                        if _registers_match(
                            holding,
                            hr.registers,
                            truth.values_at(k * STEP_S) | truth.state_at(k * STEP_S).as_signals(),
                        )
                    ]
                    assert match, f"registers {hr.registers} match no plant step in {steps}"
                    state = truth.state_at(match[0] * STEP_S).as_signals()
                    assert _registers_match(bits, hr.registers, state)
                    values = {
                        s.name: decode(s, hr.registers[s.address : s.address + s.width])
                        for s in holding
                    }
                    assert 385 < values["voltage"] < 415
                    assert 1300 < values["speed"] < 1360  # 45 Hz minus slip
                    assert state["at_setpoint"] == 1.0
                    seen.add(match[0])
                    await _wait_for(_past_step(sim, after))

                t_before = sim.stats().plant_t_s
                ir = await client.read_input_registers(0, count=3, device_id=1)
                co = await client.read_coils(0, count=1, device_id=1)
                assert not ir.isError()
                assert not co.isError()
                assert decode(inputs[0], ir.registers[0:2]) in (int(t_before), int(t_before) + 1)
                assert decode(inputs[1], ir.registers[2:3]) == pytest.approx(
                    truth.ambient_c, abs=0.05
                )
                assert co.bits[0] is True
                # Beyond the map the unit answers like a real one: illegal data address.
                beyond = await client.read_holding_registers(10, count=1, device_id=1)
                assert beyond.isError()
            finally:
                client.close()
            assert len(seen) == 6  # the registers move on with the plant
            assert sim.stats().modbus_updates >= sim.stats().ticks > 6

    asyncio.run(scenario())


def test_can_frames_follow_the_dbc_rates_and_the_plant() -> None:
    db = _load_dbc()
    truth = MotorPlant(SEED)
    channel = _channel()

    async def scenario() -> list[can.Message]:
        async with PlantSimulator(
            seed=SEED, modbus_port=None, can_channel=channel, start_at_s=START
        ) as sim:
            await _wait_for(lambda: sim.stats().frames_by_message["DRIVE_DIAG"] >= 4)
            frames = _drain(rx)
            stats = sim.stats()
            assert stats.can_errors == 0
            assert stats.frames_suppressed == 0
            assert stats.frames_sent >= len(frames) > 0
            for frame in frames:
                _check_frame(frame, sim.plant_time_at(frame.timestamp))
        return frames

    def _check_frame(frame: can.Message, t_est: float) -> None:
        decoded = _decode(db, frame)
        # The frame carries the step evaluated just before it was stamped.
        candidates = range(step_index(t_est) - 10, step_index(t_est) + 2)
        for k in candidates:
            t = k * STEP_S
            expected = truth.values_at(t) | truth.state_at(t).as_signals()
            if all(
                name.endswith("_counter")
                or name == "diag_page"
                or abs(value - expected[name]) <= _CAN_TOLERANCE.get(name, 1e-9)
                for name, value in decoded.items()
            ):
                return
        raise AssertionError(f"frame {frame} = {decoded} matches no plant step near {t_est}")

    rx = can.Bus(interface="virtual", channel=channel)
    try:
        frames = asyncio.run(scenario())
    finally:
        rx.shutdown()

    by_id: dict[int, list[can.Message]] = defaultdict(list)
    for frame in frames:
        by_id[frame.arbitration_id].append(frame)
    assert by_id[VIBRATION][0].is_extended_id
    assert not by_id[STATUS][0].is_extended_id
    for frame_id, hz in ((STATUS, 100), (VIBRATION, 50), (THERMAL, 10)):
        stamps = [f.timestamp for f in by_id[frame_id]]
        rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
        assert rate == pytest.approx(hz, rel=0.3), f"0x{frame_id:X}"
    # The alive counter steps by one per frame and wraps at 16.
    counters = [_decode(db, f)["status_counter"] for f in by_id[STATUS]]
    assert all((b - a) % 16 == 1 for a, b in itertools.pairwise(counters))
    pages = [_decode(db, f)["diag_page"] for f in by_id[DIAG]]
    assert set(pages) == {0, 1}


_CAN_TOLERANCE = {
    "speed": 0.25 + 1e-9,
    "frequency": 0.005 + 1e-9,
    "current": 0.005 + 1e-9,
    "temperature": 0.03125 / 2 + 1e-9,
    "vibration": 0.005 + 1e-9,
    "frequency_setpoint": 0.005 + 1e-9,
    "ambient_temperature": 0.5 + 1e-9,
    "uptime": 1.0,
}


def test_dropout_stops_the_frame_and_the_register_updates() -> None:
    dropout_at = START + 0.4
    channel = _channel()
    truth = MotorPlant(SEED)
    vibration = next(s for s in SIM_REGISTERS if s.name == "vibration")
    current = next(s for s in SIM_REGISTERS if s.name == "current")

    async def read(client: AsyncModbusTcpClient) -> list[int]:
        hr = await client.read_holding_registers(0, count=8, device_id=1)
        assert not hr.isError()
        return list(hr.registers)

    async def scenario() -> PlantSimulator:
        sim = PlantSimulator(
            seed=SEED,
            anomalies=[Anomaly("dropout", "vibration", dropout_at, 100)],
            can_channel=channel,
            start_at_s=START,
        )
        async with sim:
            client = AsyncModbusTcpClient("127.0.0.1", port=sim.modbus_port, timeout=2)
            assert await client.connect()
            try:
                await _wait_for(lambda: sim.stats().plant_t_s > dropout_at + 0.1)
                first = await read(client)
                updates = sim.stats().modbus_updates
                await _wait_for(lambda: sim.stats().modbus_updates > updates + 10)
                second = await read(client)
            finally:
                client.close()
        # Vibration froze at its last value before the dropout; current kept moving.
        assert first[7] == second[7]
        assert first[2:4] != second[2:4]
        frozen = decode(vibration, first[7:8])
        last_steps = range(step_index(dropout_at) - 15, step_index(dropout_at))
        assert any(
            abs(truth.values_at(k * STEP_S)["vibration"] - frozen) <= 0.005 + 1e-9
            for k in last_steps
        )
        assert decode(current, second[2:4]) > 5
        return sim

    rx = can.Bus(interface="virtual", channel=channel)
    try:
        sim = asyncio.run(scenario())
        frames = _drain(rx)
    finally:
        rx.shutdown()
    stats = sim.stats()
    assert stats.suppressed_by_message["DRIVE_VIBRATION"] > 10
    assert stats.suppressed_by_message["DRIVE_STATUS"] == 0
    vib_times = [sim.plant_time_at(f.timestamp) for f in frames if f.arbitration_id == VIBRATION]
    status_times = [sim.plant_time_at(f.timestamp) for f in frames if f.arbitration_id == STATUS]
    assert vib_times
    assert max(vib_times) < dropout_at + 0.02
    assert max(status_times) > dropout_at + 0.1


def test_speed_scales_plant_time_not_frame_rates() -> None:
    channel = _channel()

    async def scenario() -> None:
        async with PlantSimulator(
            seed=SEED, modbus_port=None, can_channel=channel, speed=10.0
        ) as sim:
            loop = asyncio.get_running_loop()
            started = loop.time()
            await _wait_for(lambda: sim.stats().frames_by_message["DRIVE_THERMAL"] >= 6)
            elapsed = loop.time() - started
            assert sim.plant_time() == pytest.approx(10.0 * (loop.time() - started), abs=0.3)
            frames = _drain(rx)
        status = [f for f in frames if f.arbitration_id == STATUS]
        assert len(status) == pytest.approx(100 * elapsed, rel=0.3)

    rx = can.Bus(interface="virtual", channel=channel)
    try:
        asyncio.run(scenario())
    finally:
        rx.shutdown()


async def _port_open(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


def test_exit_closes_the_port_and_the_bus() -> None:
    channel = _channel()

    async def scenario() -> None:
        async with PlantSimulator(seed=SEED, can_channel=channel) as sim:
            port = sim.modbus_port
            assert await _port_open(port)
            client = AsyncModbusTcpClient("127.0.0.1", port=port, timeout=2)
            assert await client.connect()  # a client still connected at exit
        assert not await _port_open(port)
        _drain(rx)
        await asyncio.sleep(0.05)
        assert rx.recv(timeout=0.0) is None  # nothing sends any more
        client.close()

    rx = can.Bus(interface="virtual", channel=channel)
    try:
        asyncio.run(scenario())
    finally:
        rx.shutdown()


def test_serve_runs_until_cancelled(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    options = SimOptions(
        seed=SEED,
        anomalies=(Anomaly("drift", "temperature", 0.1, 5, 3),),
        modbus_port=port,
        can_channel=_channel(),
        status_interval_s=0.05,
    )

    async def scenario() -> None:
        task = asyncio.create_task(serve(options), name="serve")
        await _wait_for(lambda: "anomaly drift:temperature@0.1+5x3 active" in caplog.text)
        await _wait_for(lambda: "anomalies: drift:temperature@0.1+5x3" in caplog.text)
        assert await _port_open(port)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not await _port_open(port)

    with caplog.at_level(logging.INFO, logger="drivers.sim.server"):
        asyncio.run(scenario())
    assert f"modbus: tcp 127.0.0.1:{port} unit 1" in caplog.text
    assert "DRIVE_STATUS 0x100 @ 100 Hz" in caplog.text
    assert "anomaly drift:temperature@0.1+5x3 active at plant t=0.1" in caplog.text
    assert "| modbus updates=" in caplog.text


def test_start_up_errors_are_ours(tmp_path: Path) -> None:
    async def start(**kwargs: object) -> None:
        async with PlantSimulator(**kwargs):  # type: ignore[arg-type]
            pass

    async def port_taken() -> None:
        async with PlantSimulator(can_interface=None) as first:
            with pytest.raises(PortInUse, match=r"^127\.0\.0\.1:\d+ is already in use$"):
                await start(can_interface=None, modbus_port=first.modbus_port)

    asyncio.run(port_taken())
    with pytest.raises(DriverConfigError, match="CAN interface 'no-such-bus'"):
        asyncio.run(start(modbus_port=None, can_interface="no-such-bus"))
    with pytest.raises(DriverConfigError, match="speed 0 must be > 0"):
        PlantSimulator(speed=0)

    no_cycle = tmp_path / "no_cycle.dbc"
    no_cycle.write_text(
        MOTOR_DRIVE_DBC.read_text().replace('BA_ "GenMsgCycleTime" BO_ 257 100;\n', "")
    )
    with pytest.raises(DriverConfigError, match="message DRIVE_THERMAL has no GenMsgCycleTime"):
        asyncio.run(start(modbus_port=None, can_channel=_channel(), dbc=no_cycle))

    unknown = tmp_path / "unknown.dbc"
    unknown.write_text(MOTOR_DRIVE_DBC.read_text().replace("SG_ temperature ", "SG_ oil_temp "))
    with pytest.raises(DriverConfigError, match="no simulated value for signal\\(s\\) oil_temp"):
        asyncio.run(start(modbus_port=None, can_channel=_channel(), dbc=unknown))
