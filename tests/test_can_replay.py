"""ReplaySource: the real candump capture, a Vector .asc written here, and bad files."""

import asyncio
import statistics
import struct
import time
from pathlib import Path

import can
import pytest

from drivers.buffer import SampleBuffer
from drivers.can.capture import MalformedLine, parse_candump_line
from drivers.can.reader import CanSource
from drivers.can.replay import ReplaySource
from drivers.errors import DriverConfigError, ReplayError
from drivers.sample import Sample
from drivers.source import open_source
from drivers.specs import CanSpec, ReplaySpec
from edge_agent.config import load_config
from edge_agent.errors import ConfigError
from tests.support.can import (
    REPO,
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

pytestmark = pytest.mark.peers


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
        (
            "capture.log",
            "this is not candump output\n",
            "contains no CAN frames; 1 malformed line.s., first: line 1: timestamp",
        ),
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


def test_strict_capture_refuses_a_bad_first_line(tmp_path: Path) -> None:
    path = tmp_path / "capture.log"
    path.write_text("this is not candump output\n(1.0) can0 100#00\n")
    with pytest.raises(ReplayError, match=r"line 1: malformed: timestamp.*not a valid .log"):
        ReplaySource(ReplaySpec(name="x", path=path, dbc=SYNTHETIC_DBC, strict=True))


#: 100#... decodes RPM (synthetic.dbc); lines 2-6 are what a real capture has in it.
MIXED_CAPTURE = (
    "(1.000000) can0 100#71171C73F3000000\n"
    "# a comment: skipped, not counted\n"
    "garbage that is no frame at all\n"
    "(1.010000) can0 10G#71171C73F3000000\n"
    "can0 100#71171C73F3000000\n"
    "(1.020000) can0 100#71171C73F300000\n"
    "(1.030000) can0 100#81171C73F3000000\n"
    "(1.04"
)


def test_malformed_lines_are_skipped_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "torn.log"
    path.write_text(MIXED_CAPTURE)
    caplog.set_level("WARNING", logger="drivers.can.replay")
    got, source, _ = asyncio.run(
        play(ReplaySpec(name="t", path=path, dbc=SYNTHETIC_DBC, speed=0, signals=("RPM",)))
    )
    # Both good frames played, the one after the bad lines included.
    assert [s.value for s in got] == pytest.approx([1500.25, 1500.25 + 4.0])
    stats = source.stats()
    assert stats["malformed_lines"] == 5
    assert stats["malformed.timestamp"] == 3  # garbage, no timestamp, the torn last line
    assert stats["malformed.id"] == 1
    assert stats["malformed.odd_hex_digits"] == 1
    assert stats["frames"] == 2
    logged = [r.getMessage() for r in caplog.records]
    assert any("line 3 skipped: timestamp" in m for m in logged), logged
    assert any("line 4 skipped: id" in m for m in logged), logged
    assert any("line 6 skipped: odd_hex_digits" in m for m in logged), logged


def test_strict_replay_stops_at_the_first_malformed_line(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.log"
    path.write_text("(1.0) can0 100#0000000000000000\n(1.1) can0 100#00\n(1.2) can0 10G#zz\n")
    source = ReplaySource(ReplaySpec(name="x", path=path, dbc=SYNTHETIC_DBC, speed=0, strict=True))
    with pytest.raises(ReplayError, match=r"corrupt.log: line 3: malformed: id"):
        asyncio.run(source.run(SampleBuffer(10)))


def test_a_looping_replay_counts_every_pass_and_logs_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "loop.log"
    path.write_text("(1.0) can0 100#71171C73F3000000\n(1.1) can0 1#00\n")
    caplog.set_level("WARNING", logger="drivers.can.replay")

    async def main() -> ReplaySource:
        source = ReplaySource(
            ReplaySpec(name="l", path=path, dbc=SYNTHETIC_DBC, loop=True, speed=0)
        )
        task = asyncio.create_task(source.run(SampleBuffer(100_000)))
        await wait_until(lambda: int(source.stats()["passes"]) >= 3, 5, "three passes")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return source

    stats = asyncio.run(main()).stats()
    assert int(stats["malformed_lines"]) >= 3
    assert stats["malformed.id"] == stats["malformed_lines"]
    assert sum("skipped" in r.getMessage() for r in caplog.records) == 1


def test_asc_malformed_line_is_skipped_and_the_next_frame_kept(tmp_path: Path) -> None:
    good = tmp_path / "good.asc"
    write_asc(good)
    lines = good.read_text().splitlines()
    # A torn record after the first frame: ASCReader raises on it.
    first = next(i for i, line in enumerate(lines) if " 100 " in line and "Rx" in line)
    bad = [
        "   0.0050 1  200             Rx   d 8 zz 01",
        "   0.0060 1  2G0             Rx   d 1 01",
    ]
    torn = lines[: first + 1] + bad + lines[first + 1 :]
    path = tmp_path / "torn.asc"
    path.write_text("\n".join(torn) + "\n")
    got, source, _ = asyncio.run(
        play(ReplaySpec(name="asc", path=path, dbc=SYNTHETIC_DBC, speed=0))
    )
    want, _, _ = asyncio.run(play(ReplaySpec(name="asc", path=good, dbc=SYNTHETIC_DBC, speed=0)))
    assert [(s.signal, s.value) for s in got] == [(s.signal, s.value) for s in want]
    assert source.stats()["malformed_lines"] == 2


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


def test_candump_parser_agrees_with_python_can_on_the_real_capture() -> None:
    log_path, _ = require_subaru()
    ours = [parse_candump_line(line) for line in log_path.read_text().splitlines()]
    theirs = list(can.CanutilsLogReader(log_path))
    assert len(ours) == len(theirs) == SUBARU_FRAMES
    for a, b in zip(ours, theirs, strict=True):
        assert a is not None
        assert a.equals(b, timestamp_delta=0.0), (a, b)


@pytest.mark.parametrize(
    ("line", "want"),
    [
        ("(1.5) can0 123#DEADBEEF", {"arbitration_id": 0x123, "data": b"\xde\xad\xbe\xef"}),
        ("(1.5) can0 123#", {"arbitration_id": 0x123, "data": b"", "dlc": 0}),
        ("(1.5) can0 1ABCDEF0#01 T", {"arbitration_id": 0x1ABCDEF0, "is_extended_id": True}),
        ("(1.5) can0 123#R", {"is_remote_frame": True, "dlc": 0}),
        ("(1.5) can0 123#R8", {"is_remote_frame": True, "dlc": 8}),
        ("(1.5) can0 123##1" + "00" * 12, {"is_fd": True, "bitrate_switch": True, "dlc": 12}),
        ("(1.5) can0 20000080#0000000000000000", {"is_error_frame": True}),
    ],
)
def test_candump_line_kinds(line: str, want: dict[str, object]) -> None:
    msg = parse_candump_line(line)
    assert msg is not None
    assert msg.timestamp == 1.5
    for key, value in want.items():
        assert getattr(msg, key) == value, key


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("(1.5) can0 700#D02341AF870", "odd_hex_digits"),
        ("(1.5) can0 800#00", "id"),
        ("(1.5) can0 12#00", "id"),
        ("(1.5) can0 5FFFFFFF#00", "id"),
        ("(1.5) can0 123#0011223344556677889", "odd_hex_digits"),
        ("(1.5) can0 123#001122334455667788", "length"),
        ("(1.5) can0 123##1" + "00" * 9, "length"),
        ("(1.5) can0 123#R9", "data"),
        ("(1.5) can0 123#GG", "data"),
        ("(x) can0 123#00", "timestamp"),
        ("(nan) can0 123#00", "timestamp"),
        ("1.5 can0 123#00", "timestamp"),
        ("(1.5) can0 12300", "format"),
        ("(1.5) can0 123#00 X", "format"),
    ],
)
def test_candump_malformed_line_reasons(line: str, reason: str) -> None:
    with pytest.raises(MalformedLine) as err:
        parse_candump_line(line)
    assert err.value.reason == reason


def test_blank_lines_and_comments_are_no_frames() -> None:
    for line in ("", "   \n", "# candump header", "// note", "; vector-style"):
        assert parse_candump_line(line) is None


def test_replay_strict_key_in_the_agent_config(tmp_path: Path) -> None:
    log_path, dbc_path = require_subaru()
    cfg = tmp_path / "agent.toml"
    # The example's paths are relative to examples/.
    base = (REPO / "examples" / "agent.toml").read_text().replace('"../', f'"{REPO}/')
    cfg.write_text(
        base
        + f'\n[[sources.replay]]\nname = "wrx"\npath = "{log_path}"\ndbc = "{dbc_path}"\n'
        + 'signals = ["RPM"]\nstrict = true\n'
    )
    loaded = load_config(cfg)
    (spec,) = [s for s in loaded.sources if isinstance(s, ReplaySpec)]
    assert spec.strict is True
    cfg.write_text(cfg.read_text().replace("strict = true", 'strict = "yes"'))
    with pytest.raises(ConfigError, match=r"sources.replay\[0\].strict"):
        load_config(cfg)
