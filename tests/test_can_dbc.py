"""DBC loading and decoding, checked against cantools and against hand-computed bytes."""

import hashlib
import logging
import math
import re
import struct
from collections import Counter
from pathlib import Path

import can
import cantools
import cantools.database
import pytest
from cantools.database.can import Database as CanDatabase

from drivers.can.dbc import MAX_TRACKED_UNKNOWN_IDS, FrameDecoder, load_dbc
from drivers.errors import DriverConfigError
from drivers.sample import Sample
from tests.support.can import (
    SUBARU_DBC,
    SUBARU_DIR,
    SUBARU_FRAMES,
    SUBARU_IN_DBC_FRAMES,
    SUBARU_LOG,
    SUBARU_UNKNOWN_IDS,
    SYNTHETIC_DBC,
    load_db,
    reference_decode,
    require_subaru,
)

pytestmark = pytest.mark.peers

EXT_ID = 0x18FF0103


def decode_one(
    dec: FrameDecoder, frame_id: int, data: bytes, *, extended: bool = False
) -> dict[str, float]:
    out: list[Sample] = []
    dec.decode(frame_id, extended, data, 123, out)
    assert all(s.t_ns == 123 for s in out)
    assert all(type(s.value) is float for s in out)
    return {s.signal: s.value for s in out}


# -- the real capture ------------------------------------------------------------------


def test_real_capture_decodes_exactly_like_cantools() -> None:
    log_path, dbc_path = require_subaru()
    db = load_db(dbc_path)
    known = {m.frame_id for m in db.messages}
    dec = FrameDecoder.from_file(dbc_path)

    compared = 0
    total_samples = 0
    for msg in can.LogReader(log_path):
        got = decode_one(dec, msg.arbitration_id, bytes(msg.data), extended=msg.is_extended_id)
        if msg.arbitration_id not in known:
            assert got == {}
            continue
        want = reference_decode(db, msg.arbitration_id, bytes(msg.data))
        assert got == want, hex(msg.arbitration_id)
        compared += 1
        total_samples += len(got)

    assert compared == SUBARU_IN_DBC_FRAMES
    stats = dec.stats()
    assert stats["frames"] == SUBARU_FRAMES
    assert stats["decoded_frames"] == SUBARU_IN_DBC_FRAMES
    assert stats["unknown_frames"] == SUBARU_FRAMES - SUBARU_IN_DBC_FRAMES
    assert stats["unknown_ids"] == SUBARU_UNKNOWN_IDS
    assert stats["decode_errors"] == 0
    assert stats["samples"] == total_samples
    unknown = dec.unknown_ids
    assert (0x002, False) in unknown
    assert sum(unknown.values()) == SUBARU_FRAMES - SUBARU_IN_DBC_FRAMES


def test_real_capture_sample_frames_from_readme() -> None:
    # Independent of cantools: the physical values the README reads off these frames.
    _, dbc_path = require_subaru()
    dec = FrameDecoder.from_file(dbc_path)
    v = decode_one(dec, 0x140, bytes.fromhex("FD403A11B8B8FF20"))
    assert v["THROTTLE"] == pytest.approx(99.22, abs=0.01)
    assert v["CLUTCH"] == 0.0
    assert v["RPM"] == 4410.0
    v = decode_one(dec, 0x360, bytes.fromhex("7B4900836046A100"))
    assert v == pytest.approx({"COOLANT_TEMP": 91.0, "BOOST": 92.05, "SI_MODE": 2.0}, abs=0.01)
    v = decode_one(dec, 0x0D0, bytes.fromhex("3E01E6FFFD0FFADE"))
    assert v == pytest.approx(
        {"STEER_ANGLE": 31.8, "GYRO_YAW": -0.13, "ACCEL_LAT": -1.2, "ACCEL_LONG": -5.1}, abs=1e-6
    )
    v = decode_one(dec, 0x0D1, bytes.fromhex("65080000"))
    assert v["SPEED"] * 3.6 == pytest.approx(120.0, abs=0.05)


def test_signal_filter_and_prefix() -> None:
    _, dbc_path = require_subaru()
    dec = FrameDecoder.from_file(dbc_path, signals=("RPM", "ID_360.BOOST"), prefix="car.")
    assert dec.signals == ("car.BOOST", "car.RPM")
    assert decode_one(dec, 0x140, bytes.fromhex("FD403A11B8B8FF20")) == {"car.RPM": 4410.0}
    # A known message none of whose signals are wanted is not decoded at all.
    assert decode_one(dec, 0x0D0, bytes.fromhex("3E01E6FFFD0FFADE")) == {}
    assert dec.stats()["filtered_frames"] == 1


def test_unknown_signal_lists_the_known_ones() -> None:
    _, dbc_path = require_subaru()
    with pytest.raises(DriverConfigError) as err:
        FrameDecoder.from_file(dbc_path, signals=("RPM", "RMP"))
    text = str(err.value)
    assert str(dbc_path) in text
    assert "'RMP'" in text
    assert "did you mean RPM" in text
    assert "STEER_ANGLE" in text
    assert "WS_RR" in text


# -- synthetic DBC: what the real capture does not cover --------------------------------


@pytest.fixture(scope="module")
def synth_db() -> CanDatabase:
    return load_db(SYNTHETIC_DBC)


def test_duplicate_names_are_qualified(synth_db: CanDatabase) -> None:
    dec = FrameDecoder(synth_db)
    assert "ENGINE.TEMP" in dec.signals
    assert "EXT_STATUS.TEMP" in dec.signals
    assert "TEMP" not in dec.signals
    assert "RPM" in dec.signals  # unique: bare
    with pytest.raises(DriverConfigError, match=r"'TEMP' is in several messages.*ENGINE\.TEMP"):
        FrameDecoder(synth_db, signals=("TEMP",))


def test_intel_signed_offset_and_choice(synth_db: CanDatabase) -> None:
    dec = FrameDecoder(synth_db)
    data = synth_db.encode_message(
        "ENGINE", {"RPM": 1500.25, "TEMP": -12, "GEAR_STATE": "DRIVE", "TORQUE": -100.5}
    )
    # The choice comes out as its raw number: every sample value is a float.
    assert decode_one(dec, 0x100, data) == {
        "RPM": 1500.25,
        "ENGINE.TEMP": -12.0,
        "GEAR_STATE": 3.0,
        "TORQUE": -100.5,
    }
    # Hand-made bytes: TEMP raw 0x80 = -128 -> -128 - 40; TORQUE (bits 28..39) raw 0x800 = -2048.
    raw = bytes([0x00, 0x00, 0x80, 0x02, 0x80, 0x00, 0x00, 0x00])
    v = decode_one(dec, 0x100, raw)
    assert v["ENGINE.TEMP"] == -168.0
    assert v["GEAR_STATE"] == 2.0
    assert v["TORQUE"] == -1024.0


def test_multiplexed_only_signals_of_the_mux_value(
    synth_db: CanDatabase,
) -> None:
    dec = FrameDecoder(synth_db)
    # MUX 0: PRESSURE is Motorola signed in bytes 1..2 (big-endian), FLOW Intel in 3..4.
    m0 = bytes([0x00]) + struct.pack(">h", -123) + struct.pack("<H", 456) + bytes([0, 0, 7])
    assert decode_one(dec, 0x200, m0) == pytest.approx(
        {"MUX": 0.0, "PRESSURE": -12.3, "FLOW": 4.56, "COUNTER": 7.0}
    )
    m1 = bytes([0x01]) + struct.pack("<H", 201) + bytes([0x01, 0, 0, 0, 8])
    assert decode_one(dec, 0x200, m1) == {"MUX": 1.0, "LEVEL": 100.5, "VALVE": 1.0, "COUNTER": 8.0}
    for data in (m0, m1):
        assert decode_one(dec, 0x200, data) == reference_decode(synth_db, 0x200, data)


def test_extended_id_big_endian_and_float(synth_db: CanDatabase) -> None:
    dec = FrameDecoder(synth_db)
    # HEIGHT: Motorola signed 16 bit at bytes 0..1, 0.01 m, offset -10; VOLTAGE: IEEE float.
    data = struct.pack(">h", 2234) + struct.pack("<b", -7) + b"\x00" + struct.pack("<f", 13.75)
    v = decode_one(dec, EXT_ID, data, extended=True)
    assert v == pytest.approx({"HEIGHT": 12.34, "EXT_STATUS.TEMP": -3.5, "VOLTAGE": 13.75})
    # The same number as a standard id, or the extended id masked to 11 bits, is not it.
    assert decode_one(dec, EXT_ID, data, extended=False) == {}
    assert decode_one(dec, 0x100, bytes(8), extended=True) == {}
    assert dec.unknown_ids == {(EXT_ID, False): 1, (0x100, True): 1}


def test_decode_errors_counted_and_logged_once(
    synth_db: CanDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    dec = FrameDecoder(synth_db, source="synthetic.dbc")
    with caplog.at_level(logging.WARNING, logger="drivers.can.dbc"):
        for _ in range(3):
            assert decode_one(dec, 0x100, b"\x01\x02") == {}  # too short
        assert decode_one(dec, 0x200, bytes([5, 0, 0, 0, 0, 0, 0, 0])) == {}  # no MUX 5
        # Longer than the DBC says is accepted (cantools' allow_excess): extra bytes ignored.
        assert decode_one(dec, 0x100, bytes(8) + b"\xff")["RPM"] == 0.0
    assert dec.stats()["decode_errors"] == 4
    assert dec.stats()["decoded_frames"] == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "0x100" in warnings[0].getMessage()
    assert "2 bytes" in warnings[0].getMessage()
    assert "0x200" in warnings[1].getMessage()


def test_unknown_ids_tracking_is_bounded(synth_db: CanDatabase) -> None:
    dec = FrameDecoder(synth_db)
    out: list[Sample] = []
    for frame_id in range(0x300, 0x300 + MAX_TRACKED_UNKNOWN_IDS + 50):
        dec.decode(frame_id, False, bytes(8), 0, out)
        dec.decode(frame_id, False, bytes(8), 0, out)
    assert out == []
    assert dec.stats()["unknown_frames"] == 2 * (MAX_TRACKED_UNKNOWN_IDS + 50)
    assert len(dec.unknown_ids) == MAX_TRACKED_UNKNOWN_IDS
    assert set(Counter(dec.unknown_ids.values())) == {2}


REPO = Path(__file__).parents[1]
EVERY_DBC = sorted(p for p in REPO.glob("**/*.dbc") if ".venv" not in p.parts)


@pytest.mark.parametrize("path", EVERY_DBC, ids=lambda p: p.name)
def test_compiled_decoding_gives_cantools_floats_for_every_dbc_in_the_repo(path: Path) -> None:
    """The shift-and-mask steps compiled at load time against cantools' own decode, on
    random payloads and the all-zero and all-one ones, for every message of every DBC."""
    import random  # noqa: PLC0415

    db = load_db(path)
    dec = FrameDecoder(db)
    rng = random.Random(path.name)
    compiled = 0
    for msg in db.messages:
        key = (msg.frame_id, bool(msg.is_extended_frame))
        compiled += dec._plans[key].fast is not None
        payloads = [bytes(msg.length), b"\xff" * msg.length]
        payloads += [rng.randbytes(msg.length) for _ in range(300)]
        for data in payloads:
            try:
                want = {sig: float(v) for sig, v in msg.decode_simple(data, False).items()}  # type: ignore[arg-type]
            except cantools.database.DecodeError:
                continue  # a multiplexer value the DBC does not define: cantools' path
            got = decode_one(dec, msg.frame_id, data, extended=bool(msg.is_extended_frame))
            assert set(got) == {dec._plans[key].names[s] for s in want}
            for sig, value in want.items():
                name = dec._plans[key].names[sig]
                assert got[name] == value or (math.isnan(value) and math.isnan(got[name])), (
                    f"{path.name} {msg.name}.{sig} on {data.hex()}: {got[name]} != {value}"
                )
    plain = [m for m in db.messages if not m.is_multiplexed()]
    if any(not s.is_float for m in plain for s in m.signals):
        assert compiled > 0


def test_float_of_64_bit_raw_value() -> None:
    # A 64-bit counter (the bench's sender clock) survives as a float to within 2**-52.
    db = cantools.database.load_string(
        'VERSION ""\nBS_:\nBU_: A\nBO_ 1 CLOCK: 8 A\n SG_ T_NS : 0|64@1+ (1,0) [0|0] "ns" A\n',
        database_format="dbc",
    )
    assert isinstance(db, CanDatabase)
    t = 1_765_000_000_123_456_789
    v = decode_one(FrameDecoder(db), 1, t.to_bytes(8, "little"))["T_NS"]
    assert math.isclose(v, t, rel_tol=2**-52)


# -- load errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "expect"),
    [
        (None, "no such file"),
        ("garbage here\n", "not a valid DBC"),
        (
            'VERSION ""\nBS_:\nBU_: X\nBO_ 100 M: 8 X\n'
            ' SG_ A : 0|16@1+ (1,0) [0|0] "" X\n SG_ B : 8|16@1+ (1,0) [0|0] "" X\n',
            "overlapping",
        ),
        ('VERSION ""\nBS_:\nBU_: X\n', "defines no messages"),
    ],
)
def test_load_errors_name_the_file(tmp_path: Path, content: str | None, expect: str) -> None:
    path = tmp_path / "bad.dbc"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DriverConfigError) as err:
        load_dbc(path)
    assert str(path) in str(err.value)
    assert expect in str(err.value)


def test_directory_is_not_a_dbc(tmp_path: Path) -> None:
    with pytest.raises(DriverConfigError, match="cannot read"):
        load_dbc(tmp_path)


def test_the_copied_capture_is_the_one_its_readme_describes() -> None:
    """The data lives in the repository (a clone alone must pass); its README states the
    source, the license and each file's sha256, which the files must still match."""
    readme = (SUBARU_DIR / "README.md").read_text()
    listed = dict(re.findall(r"\| `([^`]+)` \|[^|]*\| `([0-9a-f]{64})` \|", readme))
    assert set(listed) == {SUBARU_LOG.name, SUBARU_DBC.name}
    for name, digest in listed.items():
        assert hashlib.sha256((SUBARU_DIR / name).read_bytes()).hexdigest() == digest, name
    assert "WTFPL" in readme
