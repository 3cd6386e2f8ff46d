"""The uplink's durable outbox, boot session and config section (real SQLite files)."""

from __future__ import annotations

import itertools
import sqlite3
from pathlib import Path

import pytest
from pydantic import ValidationError

from edge_agent.uplink.config import UplinkSection
from edge_agent.uplink.errors import OutboxError
from edge_agent.uplink.outbox import MAX_PREVIOUS_BOOTS, Outbox, Session

pytestmark = pytest.mark.peers

T = "edgefleet/v1/s/d/telemetry"
D = "edgefleet/v1/s/d/decision"
OTA = "edgefleet/v1/s/d/ota/status"


def _outbox(path: Path, max_bytes: int = 10_000, reserve: int = 5_000) -> Outbox:
    return Outbox(path, boot_id="a" * 32, max_bytes=max_bytes, reserve_bytes=reserve)


def test_put_peek_ack_in_id_order(tmp_path: Path) -> None:
    ob = _outbox(tmp_path / "o.db")
    kinds = ["telemetry", "decision", "ota/status"] * 4
    topics = {"telemetry": T, "decision": D, "ota/status": OTA}
    for i, k in enumerate(kinds):
        assert ob.put(k, topics[k], f"p{i}".encode(), i)
    rows = ob.peek(0, 100)
    assert [r.seq for r in rows] == list(range(12))
    assert [r.kind for r in rows] == kinds
    assert rows[0].payload == b"p0"
    assert rows[0].boot_id == "a" * 32
    assert rows[0].bytes == len(b"p0") + len(T)
    assert [r.seq for r in ob.peek(rows[4].id, 3)] == [5, 6, 7]
    assert ob.ack([rows[0].id, rows[1].id, 999_999]) == 2
    assert [r.seq for r in ob.peek(0, 100)][:2] == [2, 3]
    assert ob.stats()["rows"] == 10
    assert ob.stats()["bytes"] == sum(r.bytes for r in ob.peek(0, 100))


def test_committed_rows_survive_reopen_with_original_numbers(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    ob = Outbox(path, boot_id="b" * 32)
    for i in range(5):
        ob.put("decision", D, b"x" * 10, i)
    ob.close()
    again = Outbox(path, boot_id="c" * 32)
    rows = again.peek(0, 10)
    assert [(r.boot_id, r.seq) for r in rows] == [("b" * 32, i) for i in range(5)]
    assert again.stats()["rows"] == 5
    assert again.stats()["bytes"] == 5 * (10 + len(D))
    again.put("decision", D, b"y", 0)
    assert again.peek(rows[-1].id, 10)[0].boot_id == "c" * 32


def test_cap_drops_telemetry_oldest_first_and_counts(tmp_path: Path) -> None:
    ob = _outbox(tmp_path / "o.db", max_bytes=10_000, reserve=5_000)
    size = 1000 - len(T)  # each row counts 1000 bytes
    for i in range(10):
        assert ob.put("telemetry", T, b"t" * size, i)
    assert ob.stats()["bytes"] == 10_000
    assert ob.stats()["dropped"] == {}
    for i in range(10, 13):
        assert ob.put("telemetry", T, b"t" * size, i)
    seqs = [r.seq for r in ob.peek(0, 100)]
    assert seqs == list(range(3, 13))  # the three oldest went
    assert ob.stats()["dropped"] == {"telemetry": 3}
    assert ob.stats()["bytes"] == 10_000


def test_decisions_kept_past_max_bytes_until_the_hard_cap(tmp_path: Path) -> None:
    ob = _outbox(tmp_path / "o.db", max_bytes=10_000, reserve=5_000)
    tsize, dsize = 1000 - len(T), 1000 - len(D)
    for i in range(5):
        ob.put("telemetry", T, b"t" * tsize, i)
    # Decisions push telemetry out first, then grow into the reserve.
    for i in range(5, 20):
        assert ob.put("decision", D, b"d" * dsize, i)
    rows = ob.peek(0, 100)
    assert all(r.kind == "decision" for r in rows)
    assert [r.seq for r in rows] == list(range(5, 20))
    assert ob.stats()["bytes"] == 15_000
    assert ob.stats()["dropped"] == {"telemetry": 5}
    # Telemetry cannot get in while decisions alone are over max_bytes: the new row is dropped.
    assert not ob.put("telemetry", T, b"t" * tsize, 20)
    assert ob.stats()["dropped"] == {"telemetry": 6}
    # Beyond the hard cap, the oldest decisions go (counted), the newest stays.
    assert ob.put("ota/status", OTA, b"o" * (1000 - len(OTA)), 21)
    assert ob.put("decision", D, b"d" * dsize, 22)
    seqs = [r.seq for r in ob.peek(0, 100)]
    assert seqs == [*range(7, 20), 21, 22]
    assert ob.stats()["dropped"] == {"telemetry": 6, "decision": 2}
    assert ob.stats()["bytes"] == 15_000


def test_message_over_its_own_cap_is_refused_and_the_backlog_kept(tmp_path: Path) -> None:
    ob = _outbox(tmp_path / "o.db", max_bytes=10_000, reserve=5_000)
    for i in range(5):
        assert ob.put("telemetry", T, b"t" * (1000 - len(T)), i)
    for i in range(5, 8):
        assert ob.put("decision", D, b"d" * (1000 - len(D)), i)
    before = [(r.kind, r.seq) for r in ob.peek(0, 100)]
    # Telemetry bigger than max_bytes (fits the hard cap), a decision bigger than the hard cap.
    assert not ob.put("telemetry", T, b"z" * 12_000, 8)
    assert not ob.put("decision", D, b"w" * 16_000, 9)
    assert [(r.kind, r.seq) for r in ob.peek(0, 100)] == before
    assert ob.stats()["dropped"] == {"telemetry": 1, "decision": 1}
    assert ob.stats()["rows"] == 8
    assert ob.stats()["bytes"] == 8_000
    # A decision over max_bytes but within the hard cap is still kept (telemetry goes first).
    assert ob.put("decision", D, b"d" * (12_000 - len(D)), 10)
    assert [r.seq for r in ob.peek(0, 100)] == [5, 6, 7, 10]


def test_each_boot_remembers_how_many_seqs_it_numbered_until_the_fleet_was_told(
    tmp_path: Path,
) -> None:
    """What a killed boot numbered last is known at the next start (its epitaph's watermark),
    also when its last message was dropped by the outbox's cap or its rows were all acked."""
    path = tmp_path / "o.db"
    clock = iter(range(1, 1000)).__next__
    a = Outbox(path, boot_id="a" * 32, max_bytes=10_000, reserve_bytes=0, clock_ns=clock)
    for i in range(3):
        assert a.put("decision", D, b"x", i)
    assert a.ack([r.id for r in a.peek(0, 10)]) == 3
    assert not a.put("decision", D, b"y" * 20_000, 3)  # over its cap: seq 3 numbered, lost
    assert a.previous_boots() == []
    a.close()  # killed: no clean stop
    b = Outbox(path, boot_id="b" * 32, clock_ns=clock)
    assert b.previous_boots() == [("a" * 32, 4, False)]
    b.stopped_clean()
    b.close()  # b numbered nothing: no tail to tell, forgotten at the next start
    c = Outbox(path, boot_id="c" * 32, clock_ns=clock)
    assert c.previous_boots() == [("a" * 32, 4, False)]
    c.forget_boot("a" * 32)
    assert c.put("telemetry", T, b"t", 0)
    c.stopped_clean()
    c.close()
    d = Outbox(path, boot_id="d" * 32, clock_ns=clock)
    assert d.previous_boots() == [("c" * 32, 1, True)]
    d.close()


def test_previous_boots_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    for n in range(MAX_PREVIOUS_BOOTS + 5):
        ob = Outbox(path, boot_id=f"{n:032x}", clock_ns=itertools.repeat(n).__next__)
        assert ob.put("decision", D, b"x", 0)
        ob.close()
    last = Outbox(path, boot_id="f" * 32, clock_ns=lambda: 10_000)
    kept = [b for b, _, _ in last.previous_boots()]
    assert kept == [f"{n:032x}" for n in range(5, MAX_PREVIOUS_BOOTS + 5)]


def test_an_outbox_of_the_first_schema_is_upgraded_with_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, "
        "topic TEXT NOT NULL, payload BLOB NOT NULL, boot_id TEXT NOT NULL, "
        "seq INTEGER NOT NULL, bytes INTEGER NOT NULL, t_ns INTEGER NOT NULL)"
    )
    conn.execute("INSERT INTO outbox VALUES (1, 'decision', ?, x'78', ?, 7, 1, 1)", (D, "e" * 32))
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()
    ob = Outbox(path, boot_id="a" * 32)
    assert [(r.boot_id, r.seq) for r in ob.peek(0, 10)] == [("e" * 32, 7)]
    assert ob.previous_boots() == []  # what v1 numbered is unknown; its rows still go out
    assert ob.put("decision", D, b"x", 0)
    ob.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=7")
    conn.close()
    with pytest.raises(OutboxError, match="schema version 7"):
        Outbox(path, boot_id="a" * 32)


def test_put_error_is_counted_not_raised(tmp_path: Path) -> None:
    ob = _outbox(tmp_path / "o.db")
    ob.close()
    assert not ob.put("decision", D, b"x", 0)
    assert ob.stats()["put_errors"] == 1
    assert ob.stats()["dropped"] == {"decision": 1}


def test_session_numbers() -> None:
    s = Session()
    assert len(s.boot_id) == 32
    assert int(s.boot_id, 16) >= 0
    assert Session().boot_id != s.boot_id
    assert s.watermark == 0
    assert s.next_seq == 0
    assert [s.take() for _ in range(3)] == [0, 1, 2]
    assert s.watermark == 3  # how many were numbered: the next seq
    assert s.next_seq == 3


def test_config_defaults_and_paths(tmp_path: Path) -> None:
    sec = UplinkSection()
    assert sec.enabled is False
    assert sec.port == 1883
    assert sec.keepalive_s == 30
    assert sec.outbox.max_bytes == 64 << 20
    assert sec.outbox.decision_reserve_bytes == 16 << 20
    assert sec.replay_rate_per_s == 200
    assert sec.max_inflight == 32
    assert sec.delta.enabled
    assert sec.delta.keyframe_every == 10
    assert sec.resolve_outbox(tmp_path) == tmp_path / "outbox.db"
    assert sec.effective_client_id("press-7") == "press-7"
    assert UplinkSection(client_id="x").effective_client_id("press-7") == "x"
    assert sec.check() == []


def test_config_rejects_unknown_keys_and_bad_types() -> None:
    with pytest.raises(ValidationError, match="passwrd"):
        UplinkSection.model_validate({"passwrd": "x"})
    with pytest.raises(ValidationError, match="port"):
        UplinkSection.model_validate({"port": "1883"})
    with pytest.raises(ValidationError, match="reconnect_max_ms"):
        UplinkSection(reconnect_min_ms=5000, reconnect_max_ms=100)


def test_config_check_names_key_value_and_expectation(tmp_path: Path) -> None:
    cert = tmp_path / "dev.pem"
    cert.write_text("x")
    sec = UplinkSection.model_validate(
        {
            "enabled": True,
            "tls": {"cert_file": str(cert), "ca_file": str(tmp_path / "nope.pem")},
            "password_file": str(tmp_path / "missing.pass"),
            "delta": {"deadband": {"current": 0.1, "ghost": 1.0}},
        }
    )
    errors = sec.check(["current", "voltage"])
    text = "\n".join(errors)
    assert "uplink.tls.cert_file: set without uplink.tls.key_file" in text
    assert f"uplink.tls.ca_file: {str(tmp_path / 'nope.pem')!r} does not exist" in text
    assert "uplink.password_file:" in text
    assert "without uplink.username" in text
    assert "does not exist" in errors[-2] or any("missing.pass" in e for e in errors)
    assert any(e.startswith("uplink.delta.deadband.ghost: 'ghost' is not") for e in errors)
    assert not any("current" in e.split(":")[0] for e in errors)
    assert UplinkSection.model_validate({"tls": {"cert_file": "x"}}).check() == []


def test_bad_messages_are_dropped_and_counted_without_a_seq_gap(tmp_path: Path) -> None:
    from edge_agent.uplink.publisher import Uplink  # noqa: PLC0415
    from tests.support.uplink_device_proc import MODEL_SHA, make_decision  # noqa: PLC0415
    from wire.messages import OtaStatusMsg  # noqa: PLC0415

    up = Uplink(
        UplinkSection(enabled=True),
        site="plant1",
        device="press-7",
        device_type="press",
        agent_version="0.1.0",
        state_dir=tmp_path,
        model_sha256=lambda: MODEL_SHA,
    )

    def boom(boot_id: str, seq: int) -> OtaStatusMsg:
        raise KeyError("bug")

    def wrong_seq(boot_id: str, seq: int) -> OtaStatusMsg:
        return OtaStatusMsg(
            device="press-7", boot_id=boot_id, seq=seq + 1, t_ns=1, bundle_id="b", state="x"
        )

    def bad_name(boot_id: str, seq: int) -> OtaStatusMsg:
        return OtaStatusMsg(
            device="press 7", boot_id=boot_id, seq=seq, t_ns=1, bundle_id="b", state="x"
        )

    def good(boot_id: str, seq: int) -> OtaStatusMsg:
        return OtaStatusMsg(
            device="press-7", boot_id=boot_id, seq=seq, t_ns=1, bundle_id="b", state="staged"
        )

    assert not up.publish("ota/status", boom)
    assert not up.publish("ota/status", wrong_seq)
    assert not up.publish("ota/status", bad_name)
    assert not up.publish("decision", good)  # built a message of another kind
    assert up.publish("ota/status", good)
    assert up.publish_decision(make_decision(1))
    rows = up.outbox.peek(0, 10)
    assert [(r.kind, r.seq) for r in rows] == [("ota/status", 0), ("decision", 1)]
    assert rows[0].topic == "edgefleet/v1/plant1/press-7/ota/status"
    assert up.stats()["invalid"] == {"ota/status": 3, "decision": 1}
    up.outbox.close()


def test_a_corrupt_outbox_is_moved_aside_and_started_empty(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    path.write_bytes(b"this is not an SQLite database, " * 256)
    ob = _outbox(path)
    assert len(ob) == 0
    assert ob.stats()["corrupt_recoveries"] == 1
    aside = ob.corrupt_moved_to
    assert aside is not None
    assert aside.name.startswith("o.db.corrupt-")
    assert aside.read_bytes().startswith(b"this is not an SQLite database")
    assert ob.put("decision", D, b"x", 0)
    ob.close()
    again = _outbox(path)  # the fresh file is good: nothing more moved
    assert again.stats()["corrupt_recoveries"] == 0
    assert [r.seq for r in again.peek(0, 10)] == [0]
