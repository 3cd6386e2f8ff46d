"""ReplaySource: the real candump capture, a Vector .asc written here, and bad files."""

import asyncio
import statistics
import struct
import time
from pathlib import Path

import can
import pytest

from drivers.buffer import SampleBuffer
from drivers.can.reader import CanSource
from drivers.can.replay import ReplaySource
from drivers.errors import DriverConfigError, ReplayError
from drivers.sample import Sample
from drivers.source import open_source
from drivers.specs import CanSpec, ReplaySpec
from tests.can_support import (
    SUBARU_DURATION_S,
    SUBARU_FRAMES,
    SUBARU_IN_DBC_FRAMES,
    SUBARU_UNKNOWN_IDS,
    SYNTHETIC_DBC,
    load_db,
    reference_decode,
    require_subaru,
    wait_until,
)


def expected_samples(log_path: Path, dbc_path: Path) -> list[tuple[str, float, float]]:
    """(signal, value, recorded time) for every sample cantools decodes from the capture."""
    db = load_db(dbc_path)
    known = {m.frame_id for m in db.messages}
    out: list[tuple[str, float, float]] = []
    for msg in can.LogReader(log_path):
        if msg.arbitration_id in known:
            decoded = reference_decode(db, msg.arbitration_id, bytes(msg.data))
            out.extend((k, v, msg.timestamp) for k, v in decoded.items())
    return out


async def play(spec: ReplaySpec, maxlen: int = 1000) -> tuple[list[Sample], ReplaySource, int]:
    """Run a replay to its end, draining as a consumer would; return samples and drops."""
    source = ReplaySource(spec)
    sink = SampleBuffer(maxlen)
    task = asyncio.create_task(source.run(sink))
    got: list[Sample] = []
    deadline = time.monotonic() + 30
    while not (source.stats()["state"] == "finished" and len(sink) == 0):
        assert not task.done(), task
        assert time.monotonic() < deadline, source.stats()
        await sink.wait(0.05)
        got.extend(sink.drain())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return got, source, sink.dropped


def test_real_capture_as_fast_as_possible_loses_nothing() -> None:
    log_path, dbc_path = require_subaru()
    spec = ReplaySpec(name="wrx", path=log_path, dbc=dbc_path, speed=0)
    t0 = time.time_ns()
    # A buffer far smaller than the capture: speed 0 must wait for the consumer, not drop.
    got, source, dropped = asyncio.run(play(spec, maxlen=500))
    t1 = time.time_ns()
    want = expected_samples(log_path, dbc_path)
    assert [(s.signal, s.value) for s in got] == [(s, v) for s, v, _ in want]
    assert dropped == 0
    stamps = [s.t_ns for s in got]
    assert stamps == sorted(stamps)
    # Stamped at replay time, not with the 2021 recording times.
    assert t0 <= stamps[0]
    assert stamps[-1] <= t1
    stats = source.stats()
    assert stats["frames"] == SUBARU_FRAMES
    assert stats["frames_total"] == SUBARU_FRAMES
    assert stats["position"] == SUBARU_FRAMES
    assert stats["passes"] == 1
    assert stats["decoded_frames"] == SUBARU_IN_DBC_FRAMES
    assert stats["unknown_ids"] == SUBARU_UNKNOWN_IDS
    assert stats["decode_errors"] == 0
    assert stats["samples"] == len(want)


def test_scaled_speed_keeps_recorded_timing() -> None:
    log_path, dbc_path = require_subaru()
    speed = 20.0  # the 20 s capture in ~1 s
    spec = ReplaySpec(name="wrx", path=log_path, dbc=dbc_path, speed=speed, signals=("RPM",))
    got, _, dropped = asyncio.run(play(spec))
    want = [w for w in expected_samples(log_path, dbc_path) if w[0] == "RPM"]
    assert [s.value for s in got] == [v for _, v, _ in want]
    assert dropped == 0
    # Each sample's emission offset against its recorded offset / speed, anchored at the
    # first sample. Frames are released up to 1 ms early and never before they are due.
    errors = [
        (s.t_ns - got[0].t_ns) / 1e9 - (ts - want[0][2]) / speed
        for s, (_, _, ts) in zip(got, want, strict=True)
    ]
    span = (got[-1].t_ns - got[0].t_ns) / 1e9
    assert span == pytest.approx(SUBARU_DURATION_S / speed, rel=0.1)
    assert abs(statistics.median(errors)) < 0.01
    assert max(abs(e) for e in errors) < 0.1


def test_loop_starts_over(tmp_path: Path) -> None:
    log_path, dbc_path = require_subaru()
    path = tmp_path / "slice.log"
    path.write_text("\n".join(log_path.read_text().splitlines()[:100]) + "\n")
    one_pass = [(s, v) for s, v, _ in expected_samples(path, dbc_path)]

    async def main() -> tuple[ReplaySource, list[Sample]]:
        source = ReplaySource(ReplaySpec(name="l", path=path, dbc=dbc_path, speed=0, loop=True))
        sink = SampleBuffer(100_000)
        task = asyncio.create_task(source.run(sink))
        await wait_until(lambda: int(source.stats()["passes"]) >= 3, 5, "three passes")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return source, sink.drain()

    source, got = asyncio.run(main())
    stats = source.stats()
    assert stats["frames_total"] == 100
    assert int(stats["frames"]) >= 300
    assert [(s.signal, s.value) for s in got[: 3 * len(one_pass)]] == one_pass * 3
    assert stats["state"] == "stopped"


def write_asc(path: Path) -> None:
    ext = struct.pack(">h", 2234) + struct.pack("<b", -7) + b"\x00" + struct.pack("<f", 13.75)
    mux1 = bytes([0x01]) + struct.pack("<H", 201) + bytes([0x01, 0, 0, 0, 8])
    with can.ASCWriter(path) as writer:
        for i, msg in enumerate(
            [
                can.Message(
                    arbitration_id=0x100,
                    data=bytes([0x71, 0x17, 0x1C, 0x73, 0xF3, 0, 0, 0]),
                    is_extended_id=False,
                ),
                can.Message(arbitration_id=0x18FF0103, data=ext, is_extended_id=True),
                can.Message(arbitration_id=0x200, data=mux1, is_extended_id=False),
                can.Message(is_error_frame=True),
                can.Message(arbitration_id=0x123, data=bytes(8), is_extended_id=False),
                can.Message(
                    arbitration_id=0x100, is_remote_frame=True, dlc=8, is_extended_id=False
                ),
            ]
        ):
            msg.timestamp = 1_700_000_000.0 + i * 0.01
            writer.on_message_received(msg)


def test_vector_asc(tmp_path: Path) -> None:
    path = tmp_path / "bench.asc"
    write_asc(path)
    got, source, _ = asyncio.run(
        play(ReplaySpec(name="asc", path=path, dbc=SYNTHETIC_DBC, speed=1.0))
    )
    assert [s.signal for s in got] == [
        "RPM",
        "ENGINE.TEMP",
        "GEAR_STATE",
        "TORQUE",
        "HEIGHT",
        "EXT_STATUS.TEMP",
        "VOLTAGE",
        "MUX",
        "COUNTER",
        "LEVEL",
        "VALVE",
    ]
    assert [s.value for s in got] == pytest.approx(
        [1500.25, -12.0, 3.0, -100.5, 12.34, -3.5, 13.75, 1.0, 8.0, 100.5, 1.0]
    )
    # Recorded 20 ms apart, played at speed 1. Bounds are loose on purpose: a busy CI box
    # oversleeps; what matters is that recorded time is honoured at all (speed 0 gives ~0).
    assert 10 < (got[7].t_ns - got[0].t_ns) / 1e6 < 200
    stats = source.stats()
    assert stats["frames"] == 4
    assert stats["error_frames"] == 1
    assert stats["remote_frames"] == 1
    assert stats["unknown_frames"] == 1
    assert stats["frames_total"] == 6


def test_cancel_mid_replay_is_prompt(tmp_path: Path) -> None:
    log_path, dbc_path = require_subaru()

    async def main() -> float:
        source = ReplaySource(ReplaySpec(name="slow", path=log_path, dbc=dbc_path, speed=0.001))
        task = asyncio.create_task(source.run(SampleBuffer(100)))
        await wait_until(lambda: int(source.stats()["position"]) >= 1, 5, "replay started")
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert source.stats()["state"] == "stopped"
        return time.monotonic() - t0

    assert asyncio.run(main()) < 1.0


def test_missing_capture(tmp_path: Path) -> None:
    path = tmp_path / "nope.log"
    with pytest.raises(ReplayError, match=f"{path}: no such file"):
        ReplaySource(ReplaySpec(name="x", path=path, dbc=SYNTHETIC_DBC))


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("capture.txt", "(0.1) can0 100#00\n", "unknown format '.txt'"),
        ("capture.log", "this is not candump output\n", "not a valid .log capture"),
        ("capture.log", "", "contains no CAN frames"),
        ("capture.asc", "hello\nworld\n", "contains no CAN frames"),
    ],
)
def test_unplayable_capture(tmp_path: Path, name: str, content: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ReplayError, match=match) as err:
        ReplaySource(ReplaySpec(name="x", path=path, dbc=SYNTHETIC_DBC))
    assert str(path) in str(err.value)


def test_capture_corrupt_further_in_fails_run(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.log"
    path.write_text("(1.0) can0 100#0000000000000000\n(1.1) can0 100#00\n(1.2) can0 10G#zz\n")
    source = ReplaySource(ReplaySpec(name="x", path=path, dbc=SYNTHETIC_DBC, speed=0))
    with pytest.raises(ReplayError, match=r"corrupt.log: cannot parse frame 3"):
        asyncio.run(source.run(SampleBuffer(10)))


def test_bad_speed_is_a_config_error(tmp_path: Path) -> None:
    log_path, dbc_path = require_subaru()
    with pytest.raises(DriverConfigError, match="speed"):
        ReplaySource(ReplaySpec(name="x", path=log_path, dbc=dbc_path, speed=-1))


def test_factory_opens_both_kinds() -> None:
    log_path, dbc_path = require_subaru()
    replay = open_source(ReplaySpec(name="r", path=log_path, dbc=dbc_path))
    assert isinstance(replay, ReplaySource)
    live = open_source(CanSpec(name="c", interface="virtual", channel="x", dbc=dbc_path))
    assert isinstance(live, CanSource)
    assert live.name == "c"
