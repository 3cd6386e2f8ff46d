"""``edge-agent read`` against real peers: a pymodbus server the test starts (with an
unmapped register and an absent unit), a port where nothing listens, and python-can's
virtual bus carrying frames encoded with the simulator's DBC."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import can
import pytest
from typer.testing import CliRunner

from drivers.can.dbc import load_dbc
from drivers.modbus import codec
from drivers.specs import WORD_ORDERS, RegisterSpec, RegisterType
from edge_agent.cli import app
from tests.support.modbus_peer import device, peer_in_thread
from tests.support.ports import free_port

pytestmark = pytest.mark.peers

ROOT = Path(__file__).parents[1]
DBC = ROOT / "drivers/sim/motor_drive.dbc"

INT64_MAX, INT64_MIN, UINT64_MAX = (1 << 63) - 1, -(1 << 63), (1 << 64) - 1
EXTREMES: list[tuple[RegisterType, int]] = [
    ("int64", INT64_MAX),
    ("int64", INT64_MIN),
    ("uint64", UINT64_MAX),
]

HEAD = """
[agent]
state_dir = "{state}"

[perception]
signals = ["voltage"]

[[sources.modbus]]
name = "plc"
port = {port}
timeout_ms = 200
"""


def register(name: str, address: int, **keys: object) -> str:
    lines = [f'name = "{name}"', f"address = {address}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    return "\n[[sources.modbus.registers]]\n" + "\n".join(lines) + "\n"


# Registers on the server and what `read` must say about each (address: 4 words apart).
BIG = [
    (f"{t}_{'max' if raw > 0 else 'min'}_{order}", 100 + 4 * i, t, order, raw)
    for i, (order, (t, raw)) in enumerate(
        (order, extreme) for order in WORD_ORDERS for extreme in EXTREMES
    )
]


def plc_config(tmp_path: Path, port: int, extra: str = "") -> Path:
    text = HEAD.format(state=tmp_path / "state", port=port)
    text += register("voltage", 0, type="float32", order="CDAB")
    text += register("temperature", 2, type="int16", scale=0.1)
    text += register("status", 3, type="bitfield", order="BADC", bit=4, bits=8)
    text += register("running", 5, function="coil", type="bool")
    for name, address, t, order, _ in BIG:
        text += register(name, address, type=t, order=order, scale=1.0)
    # The device maps 0..199: 199 reads, 200 is refused (coalesced with 199 first).
    text += register("last_mapped", 199)
    text += register("unmapped", 200)
    # Unit 7 is not behind this "gateway": it never answers.
    text += register("absent", 0, unit=7)
    path = tmp_path / "agent.toml"
    path.write_text(text + extra)
    return path


def fill(peer: Any) -> None:
    peer.write(1, RegisterSpec("v", 0, type="float32", order="CDAB"), 231.5)
    peer.set_registers(1, "holding", 2, [235])  # 23.5 at scale 0.1
    peer.set_registers(1, "holding", 3, [0x3412])  # 0x1234 byte-swapped: field 0x23
    peer.set_registers(1, "coil", 5, [True])
    for _, address, t, order, raw in BIG:
        words = codec.encode_raw(RegisterSpec("x", address, type=t, order=order), raw)
        peer.set_registers(1, "holding", address, words)
    peer.set_registers(1, "holding", 199, [42])


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["read", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def by_signal(out: str) -> dict[str, dict[str, Any]]:
    doc = json.loads(out)
    return {r["signal"]: r for r in doc["readings"]}


def test_every_register_once_with_raw_words_exact_values_and_errors(tmp_path: Path) -> None:
    with peer_in_thread({1: device(size=200)}) as peer:
        fill(peer)
        code, out, err = run("-c", str(plc_config(tmp_path, peer.port)), "--json")
    assert code == 1, err  # two registers failed
    doc = json.loads(out)
    assert (doc["ok"], doc["read"], doc["failed"]) == (False, len(BIG) + 5, 2)
    got = by_signal(out)
    assert list(got)[:4] == ["voltage", "temperature", "status", "running"]  # config order
    volt = got["voltage"]
    assert volt["where"] == "unit 1 holding 0+2"
    assert volt["type"] == "float32 CDAB"
    assert volt["raw"] == codec.encode(RegisterSpec("v", 0, type="float32", order="CDAB"), 231.5)
    assert (volt["decoded"], volt["value"], volt["error"]) == (231.5, 231.5, None)
    temp = got["temperature"]
    assert (temp["raw"], temp["decoded"], temp["value"]) == ([235], 235, pytest.approx(23.5))
    status = got["status"]
    assert (status["type"], status["raw"], status["decoded"]) == (
        "bitfield BADC bit 4+8",
        [0x3412],
        0x23,
    )
    assert (got["running"]["raw"], got["running"]["decoded"]) == ([1], 1)
    for name, _, _, _, raw in BIG:
        assert got[name]["decoded"] == raw, name  # every digit, beyond 2^53
        assert got[name]["value"] == float(raw), name
    assert got["last_mapped"]["decoded"] == 42  # read alone after its block was refused
    unmapped = got["unmapped"]["error"]
    assert unmapped["kind"] == "exception"
    assert (unmapped["code"], unmapped["name"]) == (2, "illegal data address")
    assert "exception code 2 (illegal data address) reading holding 200+1" in unmapped["message"]
    absent = got["absent"]
    assert absent["where"] == "unit 7 holding 0"
    assert absent["error"] == {
        "kind": "timeout",
        "message": "unit 7 did not answer within 200 ms",
    }
    assert absent["raw"] is None
    assert absent["value"] is None


def test_a_device_that_is_down(tmp_path: Path) -> None:
    code, out, _ = run("-c", str(plc_config(tmp_path, free_port())), "--json")
    assert code == 1
    readings = json.loads(out)["readings"]
    assert len(readings) == len(BIG) + 7
    for r in readings:
        assert r["error"]["kind"] == "connection"
        assert r["error"]["message"].endswith(": connection refused"), r
        assert r["error"]["message"].startswith("cannot connect to 127.0.0.1:")


def test_the_table_for_people_is_one_line_per_value_in_a_pipe(tmp_path: Path) -> None:
    with peer_in_thread({1: device(size=200)}) as peer:
        fill(peer)
        code, out, err = run("-c", str(plc_config(tmp_path, peer.port)))
    assert code == 1
    rows = {line.split("│")[2].strip(): line for line in out.splitlines() if "│" in line}
    assert len(rows) == len(BIG) + 7  # each value on one line, however wide
    assert "0x3412" in rows["status"]
    assert "9223372036854775807" in rows["int64_max_ABCD"]
    assert "23.5" in rows["temperature"]
    assert "exception code 2 (illegal data address)" in rows["unmapped"]
    assert "timeout: unit 7 did not answer within 200 ms" in rows["absent"]
    assert max(len(line) for line in out.splitlines()) > 120  # not cut to 80 columns
    assert err.strip().endswith(f"{len(BIG) + 5} read, 2 failed")


def test_pick_a_source_and_refuse_an_unknown_one(tmp_path: Path) -> None:
    can_section = f"""
[[sources.can]]
name = "bus"
interface = "virtual"
channel = "read-{uuid.uuid4().hex[:8]}"
dbc = "{DBC}"
signals = ["current"]
"""
    cfg = plc_config(tmp_path, free_port(), can_section)
    code, out, _ = run("-c", str(cfg), "--source", "bus", "--can-listen", "0.1", "--json")
    assert code == 1
    assert [r["signal"] for r in json.loads(out)["readings"]] == ["current"]
    code, _, err = run("-c", str(cfg), "--source", "nope")
    assert code == 2
    assert "--source 'nope': no such source; known: plc, bus" in err


@contextmanager
def sending(channel: str, frames: list[can.Message]) -> Iterator[None]:
    """Another node on the virtual bus, sending ``frames`` round and round every 10 ms."""
    stop = threading.Event()

    def send() -> None:
        with can.Bus(interface="virtual", channel=channel) as bus:
            while not stop.is_set():
                for frame in frames:
                    bus.send(frame)
                stop.wait(0.01)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def test_can_signals_heard_on_the_bus(tmp_path: Path) -> None:
    """The last value of each selected signal; both pages of a multiplexed message; a frame
    that does not decode and a message never sent are failures that say so."""
    db = load_dbc(DBC)
    status = db.get_message_by_name("DRIVE_STATUS")
    diag = db.get_message_by_name("DRIVE_DIAG")
    page0 = {
        "diag_page": 0,
        "frequency_setpoint": 50.0,
        "ramp_state": 1,
        "running": 1,
        "at_setpoint": 0,
        "overtemp_warning": 0,
    }
    page1 = {"diag_page": 1, "uptime": 12345, "ambient_temperature": 21}
    frames = [
        can.Message(
            arbitration_id=0x100,
            is_extended_id=False,
            data=status.encode(
                {"speed": -1500.5, "frequency": 50.0, "current": 12.34, "status_counter": 3}
            ),
        ),
        can.Message(arbitration_id=0x102, is_extended_id=False, data=diag.encode(page0)),
        can.Message(arbitration_id=0x102, is_extended_id=False, data=diag.encode(page1)),
        can.Message(arbitration_id=0x101, is_extended_id=False, data=b"\x01\x02"),  # short
    ]
    channel = f"read-{uuid.uuid4().hex[:8]}"
    signals = ["speed", "current", "frequency_setpoint", "uptime", "temperature", "vibration"]
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        f"""
[agent]
state_dir = "{tmp_path / "state"}"
[perception]
signals = ["speed"]
[[sources.can]]
name = "bus"
interface = "virtual"
channel = "{channel}"
dbc = "{DBC}"
signals = {json.dumps(signals)}
"""
    )
    with sending(channel, frames):
        code, out, _ = run("-c", str(cfg), "--can-listen", "0.5", "--json")
    assert code == 1
    got = by_signal(out)
    assert sorted(got) == sorted(signals)
    speed = got["speed"]
    assert (speed["where"], speed["type"], speed["unit"]) == ("0x100 DRIVE_STATUS", "can", "rpm")
    assert speed["raw"] == list(frames[0].data)
    assert (speed["decoded"], speed["value"]) == (-3001, -1500.5)
    assert got["current"]["value"] == pytest.approx(12.34)
    assert got["frequency_setpoint"]["value"] == pytest.approx(50.0)
    assert got["uptime"]["value"] == 12345
    assert got["temperature"]["error"] == {
        "kind": "decode",
        "message": "frame 0x101 (DRIVE_THERMAL) did not decode: 2 bytes, the DBC says 8",
    }
    assert got["vibration"]["error"] == {
        "kind": "no_frame",
        "message": "no frame 0x18FF5001 (DRIVE_VIBRATION) carrying it in 0.5 s",
    }


def test_a_gateway_that_says_the_unit_is_gone(tmp_path: Path) -> None:
    """Exception 11 from a gateway: the code and its name; the unit is not asked again."""
    cfg = tmp_path / "agent.toml"
    text = HEAD.format(state=tmp_path / "state", port="{port}")
    text += register("voltage", 0, type="float32", unit=9)
    text += register("speed", 50, unit=9)  # another block of the same unit
    with peer_in_thread({1: device()}, ignore_missing=False) as peer:
        cfg.write_text(text.replace("{port}", str(peer.port)))
        code, out, _ = run("-c", str(cfg), "--json")
        asked = peer.requests[9]
    assert code == 1
    got = by_signal(out)
    first = got["voltage"]["error"]
    assert (first["kind"], first["code"], first["name"]) == (
        "exception",
        11,
        "gateway target device failed to respond",
    )
    second = got["speed"]["error"]
    assert second["kind"] == "exception"
    assert second["message"].startswith("not asked: unit 9 failed an earlier read (")
    assert asked == 1
