"""Fleet ingest end to end: a real Mosquitto, real paho publishers, real SQLite / PostgreSQL.

Publishers build messages with the wire classes (the agent's own schema). The helpers at
the top are also used by ``tests/test_fleet_cli.py`` and ``bench/fleet_ingest.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from fleet.cli import app
from fleet.errors import IngestError, MessageRefused
from fleet.ingest import (
    IngestConfig,
    IngestStats,
    check_message,
    parse_broker,
    serve,
)
from fleet.ingest.config import backoff_s
from fleet.store import Row
from tests.support.fleet import (
    REPO,
    SITE,
    Publisher,
    boot_id,
    decision,
    make_worker,
    opened,
    ota_status,
    probe_until_stored,
    sqlite_url,
    state,
    stored_seqs,
    telemetry,
    topic_of,
    wait_until,
)
from tests.support.mosquitto import Mosquitto, mosquitto
from tests.support.pg import pg_schema_url
from tests.support.tcp_proxy import TcpProxy, target_of, via
from wire import (
    MAX_PAYLOAD_BYTES,
    DecisionMsg,
    TelemetryMsg,
    WireError,
    decode,
    encode,
    topic,
)

pytestmark = pytest.mark.peers

# --- helpers (shared with test_fleet_cli and bench/fleet_ingest) ---------------------------


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with mosquitto(tmp_path / "broker") as b:
        yield b


# --- pure parts ----------------------------------------------------------------------------


def test_backoff_is_capped_however_long_the_outage() -> None:
    # 2 ** 1024 overflows a float: an outage long enough once killed the writer thread.
    for failures in (1, 5, 60, 1024, 100_000):
        assert 0.0 <= backoff_s(failures) <= 5.0
    assert max(backoff_s(1) for _ in range(200)) <= 0.2


def test_parse_broker() -> None:
    assert parse_broker("mq.example:8883") == ("mq.example", 8883)
    assert parse_broker("localhost") == ("localhost", 1883)
    assert parse_broker("[::1]:1884") == ("::1", 1884)
    with pytest.raises(IngestError, match="not a number"):
        parse_broker("host:abc")
    with pytest.raises(IngestError, match="out of range"):
        parse_broker("host:70000")


def test_config_hides_password_and_checks_limits() -> None:
    cfg = IngestConfig(store_url="sqlite:///x.db", username="u", password="s3cret")
    assert "s3cret" not in repr(cfg)
    with pytest.raises(IngestError, match="queue_max"):
        IngestConfig(store_url="sqlite:///x.db", queue_max=70_000)


def test_check_message_refuses_what_the_subscription_cannot_deliver() -> None:
    # Kinds outside the subscription (a command, an unknown kind) still get a clear refusal.
    payload = encode(telemetry("gw-1", boot_id(), 1))
    for bad in ("edgefleet/v1/plant1/gw-1/cmd/ota", "edgefleet/v1/plant1/gw-1/nope", "x/y"):
        with pytest.raises(MessageRefused, match="is not an uplink topic") as info:
            check_message(bad, payload)
        assert info.value.cls == "topic"
    parsed, msg = check_message(topic(SITE, "gw-1", "telemetry"), payload)
    assert parsed.device == "gw-1"
    assert isinstance(msg, TelemetryMsg)


def test_telemetry_decode_accepts_and_refuses_exactly_as_the_strict_schema() -> None:
    # wire.decode takes a fast path for telemetry (signal names checked apart from msgspec);
    # what it accepts, and every refusal with its path, must be the strict schema's.
    strict = msgspec.json.Decoder(TelemetryMsg)
    stats = [1.0, 0.5, 1.5, 1.2, 10]
    good: dict[str, Any] = msgspec.to_builtins(telemetry("gw-1", boot_id(), 7))
    good["more"] = [[good["t_ns"] + 1, False, {"b.c:d-1": stats}]]
    names = ["ok_1", "", "x" * 128, "x" * 129, "bad name", "trailing\n", "émoji", "a/b"]
    cases = (
        [good]
        + [{**good, "signals": {"ok": stats, name: stats}} for name in names]
        + [{**good, "more": [[good["t_ns"] + 1, True, {name: stats}]]} for name in names]
    )
    for case in cases:
        raw = json.dumps(case).encode()
        assert _fast(raw) == _strict(strict, raw), case
    refused = sum(1 for c in cases if _strict(strict, json.dumps(c).encode())[0] == "refused")
    assert refused >= 10, "the cases must exercise refusals in both places"


def _fast(raw: bytes) -> tuple[str, Any, str]:
    try:
        msg = decode("telemetry", raw)
    except WireError as exc:
        return ("refused", exc.reason, exc.where)
    return ("accepted", msg, type(msg).__name__)


def _strict(strict: msgspec.json.Decoder[TelemetryMsg], raw: bytes) -> tuple[str, Any, str]:
    try:
        msg = strict.decode(raw)
    except msgspec.ValidationError as exc:
        reason, _, where = str(exc).partition(" - at `")
        return ("refused", reason, where.rstrip("`") or "$")
    return ("accepted", msg, type(msg).__name__)


# --- broker -> worker -> store -------------------------------------------------------------


def test_messages_reach_the_store_with_seq_continuity(tmp_path: Path, broker: Mosquitto) -> None:
    url = sqlite_url(tmp_path / "fleet.db")
    devices = {f"gw-{i}": boot_id() for i in range(3)}
    sent: dict[str, bytes] = {}
    with make_worker(broker, url) as worker:
        assert worker.wait_ready(10)
        pub = Publisher(broker.host, broker.port)
        for dev, boot in devices.items():
            pub.send(state(dev, boot, 0), retain=True)
        n = 150
        for seq in range(n):
            for dev, boot in devices.items():
                msg: TelemetryMsg | DecisionMsg = (
                    decision(dev, boot, seq, label="overheat" if seq == 50 else "normal")
                    if seq % 10 == 0
                    else telemetry(dev, boot, seq)
                )
                sent[f"{dev}/{seq}"] = encode(msg)
                pub.send(msg)
        pub.close()
        wait_until(lambda: worker.stats.stored == n * len(devices), 30, "all rows stored")
    stats = worker.stats
    assert stats.states == len(devices)
    assert stats.duplicates == 0
    assert sum(stats.quarantined.values()) == 0
    assert stats.acked == stats.received
    store = opened(url)
    try:
        for dev, boot in devices.items():
            assert stored_seqs(store, dev) == list(range(n))
            info = store.device(dev)
            assert info is not None
            assert info.online
            assert info.boot_id == boot
            assert info.site == SITE
            assert info.agent_version == "0.1.0"
            assert info.last_seq == n - 1
            assert info.latency_ms == {"perception": 1.5, "reasoning": 0.25}
            rows = store.telemetry(dev, limit=3)
            # Stored byte for byte as published, newest last.
            assert [r[1] for r in rows] == [147, 148, 149]
            assert rows[-1][3] == sent[f"{dev}/149"]
        assert store.gaps() == []
        overheat = store.decisions(label="overheat")
        assert sorted(d for d, *_ in overheat) == sorted(devices)
    finally:
        store.close()


def _malformed(boot: str) -> list[tuple[str, str, bytes, str, str]]:
    """(name, topic, payload, reason substring, reason class): every way a message is wrong."""
    t = topic(SITE, "gw-1", "telemetry")
    good: dict[str, Any] = msgspec.to_builtins(telemetry("gw-1", boot, 10_000))

    def mut(**changes: Any) -> bytes:
        d = dict(good)
        for k, v in changes.items():
            if v is ...:
                del d[k]
            else:
                d[k] = v
        return json.dumps(d).encode()

    deep = b"[" * 20_000 + b"]" * 20_000
    valid_json = mut()
    cases = [
        ("non_json", t, b"hello world", "not a JSON object", "schema"),
        ("json_array", t, b"[1, 2, 3]", "Expected `object`, got `array`", "schema"),
        ("json_string", t, b'"telemetry"', "Expected `object`, got `str`", "schema"),
        ("device_int", t, mut(device=7), "Expected `str`, got `int`", "schema"),
        ("boot_id_int", t, mut(boot_id=12), "Expected `str`, got `int`", "schema"),
        ("seq_str", t, mut(seq="5"), "Expected `int`, got `str`", "schema"),
        ("t_ns_null", t, mut(t_ns=None), "Expected `int`, got `null`", "schema"),
        ("unknown_field", t, mut(extra=1), "unknown field `extra`", "schema"),
        (
            "oversize",
            t,
            valid_json + b" " * MAX_PAYLOAD_BYTES,
            f"expected at most {MAX_PAYLOAD_BYTES}",
            "schema",
        ),
        ("nan", t, valid_json.replace(b'"t_ns": ', b'"t_ns": NaN, "x": '), "malformed", "schema"),
        ("bad_boot_id", t, mut(boot_id="not-hex"), "matching regex", "schema"),
        ("negative_seq", t, mut(seq=-1), "Expected `int` >= 0", "schema"),
        ("device_mismatch", t, mut(device="gw-2"), "does not match topic", "device_mismatch"),
        (
            "bad_topic",
            "edgefleet/v1/bad site!/gw-1/telemetry",
            mut(seq=20_000),
            "is not an uplink topic",
            "topic",
        ),
        (
            "unknown_device",
            topic(SITE, "gw-9", "telemetry"),
            encode(telemetry("gw-9", boot, 1)),
            "unknown device 'gw-9'",
            "unknown_device",
        ),
        ("bad_utf8", t, valid_json.replace(b'"gw-1"', b'"gw-\xff"'), "UTF-8", "schema"),
        ("empty", t, b"", "truncated", "schema"),
        (
            "deep_nesting",
            t,
            valid_json.replace(b'"keyframe": true', b'"keyframe": ' + deep),
            "Expected `bool`",
            "schema",
        ),
        ("bool_for_int", t, mut(seq=True), "Expected `int`, got `bool`", "schema"),
        ("float_seq", t, mut(seq=5.0), "Expected `int`, got `float`", "schema"),
        ("missing_field", t, mut(t_ns=...), "missing required field `t_ns`", "schema"),
        ("stats_arity", t, mut(signals={"a": [1, 2, 3]}), "length 5, got 3", "schema"),
        ("huge_number", t, mut(seq=2**64), "<= 9223372036854775807", "schema"),
        (
            "infinite_float",
            t,
            mut(signals={"a": [1e308, 0, 0, 0, 1]}).replace(b"1e+308", b"1e999"),
            "out of range",
            "schema",
        ),
        ("period_zero", t, mut(period_ns=0), "Expected `int` >= 1", "schema"),
        ("signals_array", t, mut(signals=[1, 2]), "Expected `object`, got `array`", "schema"),
        (
            "state_bad_enum",
            topic(SITE, "gw-1", "state"),
            json.dumps(
                {**msgspec.to_builtins(state("gw-1", boot, 0)), "state": "sleeping"}
            ).encode(),
            "Invalid enum value 'sleeping'",
            "schema",
        ),
        (
            "state_site_mismatch",
            topic(SITE, "gw-1", "state"),
            encode(state("gw-1", boot, 0, site="elsewhere")),
            "site in payload 'elsewhere' does not match",
            "device_mismatch",
        ),
        (
            "telemetry_on_decision_topic",
            topic(SITE, "gw-1", "decision"),
            valid_json,
            "unknown field",
            "schema",
        ),
        # msgspec alone let these through (last key won; NUL and depth inside `detail`).
        (
            "repeated_key",
            t,
            valid_json.replace(b'"seq": 10000', b'"seq": 1025, "seq": 10000'),
            'duplicate key "seq"',
            "schema",
        ),
        (
            "detail_nul",
            topic(SITE, "gw-1", "ota/status"),
            encode(ota_status("gw-1", boot, 10_001)).replace(
                b'"detail":{}', b'"detail":{"a":"\\u0000"}'
            ),
            "NUL character",
            "schema",
        ),
        (
            "detail_60000_deep",
            topic(SITE, "gw-1", "ota/status"),
            encode(ota_status("gw-1", boot, 10_002)).replace(
                b'"detail":{}', b'"detail":{"a":' + b"[" * 60_000 + b"]" * 60_000 + b"}"
            ),
            "nested deeper than 32 levels",
            "schema",
        ),
    ]
    payloads = [c[2] for c in cases]
    assert len(set(payloads)) == len(payloads), "each case must be distinct"
    return cases


def test_malformed_messages_are_quarantined_and_valid_ones_stored(
    tmp_path: Path, broker: Mosquitto
) -> None:
    url = sqlite_url(tmp_path / "fleet.db")
    boot = boot_id()
    setup = opened(url)
    setup.register_device("gw-1", SITE, "gateway")
    setup.register_device("gw-2", SITE, "gateway")
    setup.close()
    cases = _malformed(boot)
    assert len(cases) >= 20
    with make_worker(broker, url, auto_register=False) as worker:
        assert worker.wait_ready(10)
        pub = Publisher(broker.host, broker.port)
        seq = 0  # data seqs start at 0 at every boot
        for _, t, payload, _, _ in cases:
            pub.send(telemetry("gw-1", boot, seq))
            pub.publish(t, payload)
            seq += 1
        pub.send(telemetry("gw-1", boot, seq))
        seq += 1  # now: how many valid messages were sent
        pub.close()
        wait_until(
            lambda: (
                worker.stats.received == len(cases) + seq
                and worker.stats.acked == worker.stats.received
            ),
            30,
            "every message handled",
        )
    stats = worker.stats
    assert stats.stored == seq
    expected_classes: dict[str, int] = {}
    for *_, cls in cases:
        expected_classes[cls] = expected_classes.get(cls, 0) + 1
    assert {k: v for k, v in stats.quarantined.items() if v} == expected_classes
    store = opened(url)
    try:
        assert stored_seqs(store, "gw-1") == list(range(seq))
        assert store.gaps("gw-1") == []
        assert store.device("gw-9") is None, "auto-registration is off"
        held = store.quarantined(limit=1000)
        assert len(held) == len(cases)
        by_payload = {q.payload: q for q in held}
        for name, t, payload, reason, _ in cases:
            q = by_payload.get(payload[:4096])
            assert q is not None, f"{name} not quarantined"
            assert reason in q.reason, f"{name}: {q.reason!r}"
            assert q.topic == t
            if name != "bad_topic":
                assert q.device in ("gw-1", "gw-9"), name
        mismatch = by_payload[cases[12][2]]
        assert mismatch.where == "$.device"
        assert by_payload[cases[5][2]].where == "$.seq"
        assert all(len(q.payload) <= 4096 for q in held)
    finally:
        store.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_device_publishing_under_another_site_is_quarantined_and_stays_put(
    tmp_path: Path, broker: Mosquitto, backend: str
) -> None:
    """The broker's ACL refuses this (tests/test_fleet_pki.py); a broker without it (this
    plain listener) lets it through, and the ingest must refuse it: before, a retained
    birth under `other-site` moved the registry row there and set its agent version."""
    with contextlib.ExitStack() as stack:
        url = (
            sqlite_url(tmp_path / "fleet.db")
            if backend == "sqlite"
            else stack.enter_context(pg_schema_url())
        )
        _site_mismatch_case(broker, url)


def _site_mismatch_case(broker: Mosquitto, url: str) -> None:
    dev = f"dev-a-{uuid.uuid4().hex[:8]}"
    boot = boot_id()
    store = opened(url)
    try:
        with make_worker(broker, url) as worker:
            assert worker.wait_ready(10)
            pub = Publisher(broker.host, broker.port)
            probe_until_stored(pub, store, state(dev, boot, 0), 30)  # first seen at SITE
            forged = msgspec.structs.replace(
                state(dev, boot, 0, site="other-site"), agent_version="9.9.9"
            )
            pub.send(forged, retain=True)
            pub.publish(topic("other-site", dev, "telemetry"), encode(telemetry(dev, boot, 0)))
            pub.send(telemetry(dev, boot, 1))
            pub.close()
            wait_until(
                lambda: (
                    1 in stored_seqs(store, dev) and worker.stats.acked == worker.stats.received
                ),
                30,
                "every message handled",
            )
        info = store.device(dev)
        assert info is not None
        assert (info.site, info.agent_version) == (SITE, "0.1.0")
        assert stored_seqs(store, dev) == [1]
        assert worker.stats.quarantined.get("site_mismatch") == 2
        held = [q for q in store.quarantined(limit=100) if q.device == dev]
        assert sorted(q.topic for q in held) == [
            topic("other-site", dev, "state"),
            topic("other-site", dev, "telemetry"),
        ]
        assert all(
            q.reason == f"site mismatch: topic site 'other-site' is not {dev!r}'s registered "
            f"site {SITE!r}"
            for q in held
        ), [q.reason for q in held]
    finally:
        store.close()


def test_a_packet_past_the_workers_maximum_never_reaches_its_memory(
    tmp_path: Path, broker: Mosquitto
) -> None:
    """The queue counts messages, not bytes: the worker tells the broker the largest packet
    it takes (CONNECT Maximum Packet Size), so a 4 MB publish (Mosquitto allows 256 MB)
    is dropped for it by the broker. One just past the payload limit still arrives and is
    quarantined with its size."""
    url = sqlite_url(tmp_path / "fleet.db")
    boot = boot_id()
    with make_worker(broker, url) as worker:
        assert worker.wait_ready(10)
        pub = Publisher(broker.host, broker.port)
        probe_until_stored(pub, opened(url), state("gw-1", boot, 0), 30)
        received = worker.stats.received
        pub.publish(topic(SITE, "gw-1", "telemetry"), b"{" + b" " * (4 << 20))
        pub.publish(topic(SITE, "gw-1", "telemetry"), b"{" + b" " * MAX_PAYLOAD_BYTES)
        pub.send(telemetry("gw-1", boot, 0))
        pub.close()
        wait_until(lambda: worker.stats.stored == 1, 30, "the valid message stored")
        wait_until(lambda: worker.stats.acked == worker.stats.received, 10, "all acked")
    assert worker.stats.received == received + 2  # the 4 MB one never came
    assert sum(worker.stats.quarantined.values()) == 1


def test_two_workers_share_the_stream_without_loss_or_duplicates(
    tmp_path: Path, broker: Mosquitto
) -> None:
    url = sqlite_url(tmp_path / "fleet.db")
    opened(url).close()
    devices = {f"gw-{i}": boot_id() for i in range(20)}
    per_device = 60
    total = per_device * len(devices)
    w1 = make_worker(broker, url, "w1", migrate=False)
    w2 = make_worker(broker, url, "w2", migrate=False)
    with w1, w2:
        assert w1.wait_ready(10)
        assert w2.wait_ready(10)
        pub = Publisher(broker.host, broker.port)
        for seq in range(per_device):
            for dev, boot in devices.items():
                pub.send(telemetry(dev, boot, seq))
        pub.close()
        wait_until(
            lambda: w1.stats.stored + w2.stats.stored == total, 30, "both workers' share stored"
        )
    assert w1.stats.duplicates + w2.stats.duplicates == 0
    for w in (w1, w2):
        assert w.stats.stored > total * 0.10, f"{w.client_id} got {w.stats.stored} of {total}"
    store = opened(url)
    try:
        assert store.counts()["telemetry"] == total
        for dev in devices:
            assert stored_seqs(store, dev) == list(range(per_device))
        assert store.gaps() == []
    finally:
        store.close()


def _serve_cmd(url: str, broker: Mosquitto, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fleet.cli",
        "serve",
        "--http",
        "127.0.0.1:0",
        "--store",
        url,
        "--broker",
        f"{broker.host}:{broker.port}",
        "--client-id",
        "ingest-kill",
        "--batch-ms",
        "20",
        *extra,
    ]


def test_serve_stops_with_an_error_when_its_rollout_service_cannot_run(
    tmp_path: Path, broker: Mosquitto
) -> None:
    """The artifact port is taken: the rollout service cannot start, and `fleet serve`
    must say so and exit non-zero instead of ingesting on with no orchestrator."""
    url = sqlite_url(tmp_path / "fleet.db")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = _serve_cmd(url, broker, "--artifact-port", str(port), "--coap-port", "0")
        cmd += ["--artifacts", str(tmp_path / "artifacts"), "--duration", "60"]
        t0 = time.monotonic()
        done = subprocess.run(
            cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=60
        )
    assert done.returncode == 3, done.stderr  # EXIT_FAILURE
    assert "Traceback" not in done.stderr
    assert time.monotonic() - t0 < 30  # not after --duration
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"fleet: --artifact-port: 127.0.0.1:{port} is already in use"), last


def test_serve_applies_its_retention_at_start_and_refuses_a_bad_one(
    tmp_path: Path, broker: Mosquitto
) -> None:
    url = sqlite_url(tmp_path / "fleet.db")
    store = opened(url)
    boot = boot_id()
    old, new = time.time_ns() - 3 * 86_400 * 10**9, time.time_ns()
    rows = [(old + s, s) for s in range(4)] + [(new + s, 4 + s) for s in range(2)]
    store.ingest([
        Row("gw-1", SITE, "telemetry", boot, seq, t, encode(telemetry("gw-1", boot, seq, t)), t)
        for t, seq in rows
    ])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    bad = _serve_cmd(url, broker, "--retention", "telemetry=2w", "--duration", "30")
    done = subprocess.run(
        bad, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "age '2w': expected whole days or hours" in done.stderr
    cmd = _serve_cmd(url, broker, "--retention", "telemetry=1d", "--no-rollouts")
    cmd += ["--duration", "4"]
    done = subprocess.run(
        cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "history kept: telemetry 1 d" in done.stderr
    assert "retention: deleted 4 telemetry" in done.stderr
    try:
        assert stored_seqs(store, "gw-1") == [4, 5]
    finally:
        store.close()


def test_killed_worker_loses_nothing_after_restart(tmp_path: Path, broker: Mosquitto) -> None:
    url = sqlite_url(tmp_path / "fleet.db")
    store = opened(url)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(_serve_cmd(url, broker), cwd=REPO, env=env, stderr=subprocess.PIPE)
    try:
        pub = Publisher(broker.host, broker.port)
        boot = boot_id()
        # The birth doubles as the readiness probe: stored once the worker is subscribed.
        probe_until_stored(pub, store, state("gw-1", boot, 0), 30)
        total = 3000

        def stream() -> None:
            for seq in range(total):
                pub.send(telemetry("gw-1", boot, seq))
                if seq % 10 == 0:
                    time.sleep(0.005)

        sender = threading.Thread(target=stream)
        sender.start()
        wait_until(lambda: store.counts()["telemetry"] >= 300, 30, "some rows stored")
        proc.send_signal(signal.SIGKILL)  # mid-stream: no flush, no ack, no DISCONNECT
        proc.wait(10)
        before = store.counts()["telemetry"]
        sender.join()
        pub.close()  # every message is at the broker, queued for the dead worker's session
        assert before < total, "the worker must die mid-stream"
        proc = subprocess.Popen(
            [*_serve_cmd(url, broker), "--json"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        wait_until(lambda: store.counts()["telemetry"] == total, 60, "every row stored")
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        (restarted,) = json.loads(stdout.splitlines()[-1])["workers"]
        assert stored_seqs(store, "gw-1") == list(range(total))
        assert store.gaps() == []
        # What the killed worker had committed but not acked comes back as duplicates.
        print(
            f"killed after {before} rows; restarted worker stored {restarted['stored']}, "
            f"duplicates {restarted['duplicates']}"
        )
        assert restarted["stored"] == total - before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        store.close()


def test_broker_outage_mid_stream_stores_every_message_once(
    tmp_path: Path, broker: Mosquitto
) -> None:
    url = sqlite_url(tmp_path / "fleet.db")
    boot = boot_id()
    total = 600
    with make_worker(broker, url) as worker:
        assert worker.wait_ready(10)
        pub = Publisher(broker.host, broker.port, client_id="gw-1-uplink", reconnect_s=(3, 6))

        def stream() -> None:
            for seq in range(total):
                pub.send(telemetry("gw-1", boot, seq))
                time.sleep(0.02)

        sender = threading.Thread(target=stream)
        sender.start()
        time.sleep(3)
        # SIGTERM: Mosquitto saves its persistence (sessions, queued QoS 1 messages). It does
        # not restore shared subscriptions, though: the device reconnects after the ingest
        # (3 s backoff vs 1 s), as agents backing off do, or what it sends first is lost.
        broker.stop()
        time.sleep(10)
        broker.start()
        sender.join()
        pub.close()
        wait_until(lambda: worker.stats.stored == total, 60, "every message stored")
        time.sleep(0.5)  # let any late redelivery arrive, to be counted
    store = opened(url)
    try:
        assert store.counts()["telemetry"] == total
        assert stored_seqs(store, "gw-1") == list(range(total))
        assert store.gaps() == []
    finally:
        store.close()
    assert worker.stats.connects >= 2
    print(f"broker outage: duplicates seen (and dropped by the store): {worker.stats.duplicates}")


_DEVICE_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from tests.support.fleet import state, topic_of
    from wire import encode

    host, port, boot = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="gw-will", protocol=mqtt.MQTTv5)
    will = state("gw-will", boot, 0, online=False, clean=False)
    c.will_set(topic_of(will), encode(will), qos=1, retain=True)
    c.connect(host, port, keepalive=60)
    c.loop_start()
    birth = state("gw-will", boot, 0)
    c.publish(topic_of(birth), encode(birth), qos=1, retain=True).wait_for_publish(10)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def test_last_will_marks_a_vanished_device_offline(tmp_path: Path, broker: Mosquitto) -> None:
    url = sqlite_url(tmp_path / "fleet.db")
    store = opened(url)
    with make_worker(broker, url) as worker:
        assert worker.wait_ready(10)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        device = subprocess.Popen(
            [sys.executable, "-c", _DEVICE_SCRIPT, broker.host, str(broker.port), boot_id()],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
        )
        try:
            assert device.stdout is not None
            assert device.stdout.readline().strip() == b"ready"
            wait_until(
                lambda: (d := store.device("gw-will")) is not None and d.online, 20, "online"
            )
            runner = CliRunner()
            listed = runner.invoke(app, ["devices", "list", "--json", "--store", url])
            assert json.loads(listed.stdout)[0]["online"] is True
            device.send_signal(signal.SIGKILL)  # the socket closes without a DISCONNECT
            device.wait(10)
            wait_until(
                lambda: (d := store.device("gw-will")) is not None and not d.online,
                20,
                "offline via the Last Will",
            )
        finally:
            if device.poll() is None:
                device.kill()
                device.wait()
            if device.stdout is not None:
                device.stdout.close()
    store.close()
    result = CliRunner().invoke(app, ["devices", "list", "--json", "--store", url])
    assert result.exit_code == 0, result.output
    (listed_dev,) = json.loads(result.stdout)
    assert listed_dev["device"] == "gw-will"
    assert listed_dev["online"] is False
    human = CliRunner().invoke(app, ["devices", "list", "--store", url])
    assert "offline" in human.stdout
    assert worker.stats.states == 2


def test_end_to_end_on_postgresql_with_two_worker_processes(
    tmp_path: Path, broker: Mosquitto
) -> None:
    with pg_schema_url() as url:
        _two_workers_on_postgresql(url, broker)


def _two_workers_on_postgresql(url: str, broker: Mosquitto) -> None:
    tag = uuid.uuid4().hex[:8]
    devices = {f"pg-{tag}-{i}": boot_id() for i in range(10)}
    per_device = 80
    config = IngestConfig(
        store_url=url,
        broker_host=broker.host,
        broker_port=broker.port,
        client_id=f"pg-{tag}",
        batch_ms=20,
    )
    stop = threading.Event()
    results: list[IngestStats] = []
    runner = threading.Thread(
        target=lambda: results.extend(serve(config, workers=2, stop=stop)), name="serve"
    )
    runner.start()
    store = opened(url)
    try:
        pub = Publisher(broker.host, broker.port)
        probe = next(iter(devices))
        probe_until_stored(pub, store, state(probe, devices[probe], 0), 60)
        # Give the second worker time to join the group before the stream starts.
        time.sleep(2)
        for dev, boot in devices.items():
            pub.send(state(dev, boot, 0), retain=True)
        for seq in range(per_device):
            for dev, boot in devices.items():
                pub.send(decision(dev, boot, seq) if seq % 8 == 0 else telemetry(dev, boot, seq))
        pub.close()
        wait_until(
            lambda: all(len(stored_seqs(store, d)) == per_device for d in devices),
            60,
            "every row in PostgreSQL",
        )
    finally:
        stop.set()
        runner.join(90)
    try:
        for dev, boot in devices.items():
            assert stored_seqs(store, dev) == list(range(per_device))
            assert store.gaps(dev) == []
            info = store.device(dev)
            assert info is not None
            assert info.online
            assert info.boot_id == boot
    finally:
        store.close()
    assert len(results) == 2
    assert sum(r.stored for r in results) == per_device * len(devices)
    assert sum(r.duplicates for r in results) == 0
    assert all(r.stored > 0 for r in results), [r.stored for r in results]


@pytest.mark.parametrize("store_process", [True, False], ids=["store-process", "in-thread"])
def test_database_outage_mid_stream_stores_every_message_once(
    broker: Mosquitto, store_process: bool
) -> None:
    """PostgreSQL unreachable for 6 s while a device streams: the worker retries (nothing
    acked, so the broker keeps the messages), quarantines nothing, and stores every message
    exactly once when the database is back."""
    tag = uuid.uuid4().hex[:8]
    device, boot, total = f"pgcut-{tag}", boot_id(), 500
    with pg_schema_url() as direct, TcpProxy(*target_of(direct)) as proxy:
        url = via(direct, proxy.port)
        store = opened(direct)
        try:
            with make_worker(
                broker, url, client_id=f"cut-{tag}", store_process=store_process
            ) as worker:
                assert worker.wait_ready(10)
                pub = Publisher(broker.host, broker.port, client_id=f"{device}-uplink")

                def stream() -> None:
                    for seq in range(total):
                        pub.send(telemetry(device, boot, seq))
                        time.sleep(0.02)

                sender = threading.Thread(target=stream)
                sender.start()
                wait_until(lambda: worker.stats.stored > 50, 30, "the first rows stored")
                proxy.cut()
                at_cut = len(stored_seqs(store, device))
                time.sleep(6)
                during_cut = len(stored_seqs(store, device))
                proxy.restore()
                sender.join()
                pub.close()
                # Rows whose commit landed but whose reply the cut lost come back as
                # duplicates on the retry: wait for the store's content, not the counter.
                wait_until(
                    lambda: stored_seqs(store, device) == list(range(total)),
                    90,
                    "every message stored",
                )
                time.sleep(0.5)  # a late redelivery would be counted as a duplicate
            assert stored_seqs(store, device) == list(range(total))
            assert store.gaps(device) == []
        finally:
            store.close()
    assert during_cut <= at_cut + 10  # the cut stopped the writes (a batch may be in flight)
    assert proxy.refused > 0  # and the worker tried to reconnect through it
    assert worker.stats.store_retries > 0
    # Nothing good was taken for bad input.
    assert sum(worker.stats.quarantined.values()) == 0, worker.stats.quarantined
    print(
        f"database outage: {worker.stats.store_retries} retries, "
        f"{worker.stats.duplicates} duplicates dropped by the store"
    )


@pytest.mark.parametrize("store_process", [True, False], ids=["store-process", "in-thread"])
def test_messages_the_database_refuses_are_quarantined_and_the_rest_stored(
    tmp_path: Path, broker: Mosquitto, store_process: bool
) -> None:
    """A constraint of the database's own (here a trigger a DBA might add) refuses one
    device's rows: its batches are split, each refused message is quarantined with the
    database's reason, and every other device's messages are stored."""
    url = sqlite_url(tmp_path / "fleet.db")
    store = opened(url)
    db = sqlite3.connect(tmp_path / "fleet.db")
    db.execute(
        "CREATE TRIGGER refuse_gw_bad BEFORE INSERT ON messages WHEN NEW.device = 'gw-bad' "
        "BEGIN SELECT RAISE(ABORT, 'gw-bad is decommissioned'); END"
    )
    db.commit()
    db.close()
    good, bad = boot_id(), boot_id()
    per_device = 40
    try:
        with make_worker(broker, url, store_process=store_process) as worker:
            assert worker.wait_ready(10)
            pub = Publisher(broker.host, broker.port)
            for seq in range(per_device):
                pub.send(telemetry("gw-ok", good, seq))
                pub.send(telemetry("gw-bad", bad, seq))
            pub.close()
            wait_until(
                lambda: (
                    worker.stats.stored == per_device
                    and worker.stats.quarantined.get("store", 0) == per_device
                ),
                60,
                "gw-ok stored and gw-bad quarantined",
            )
        assert stored_seqs(store, "gw-ok") == list(range(per_device))
        assert stored_seqs(store, "gw-bad") == []
        refused = [q for q in store.quarantined(limit=1000) if "gw-bad" in q.topic]
        assert len(refused) == per_device
        assert all("store refused the message" in q.reason for q in refused)
        assert all("gw-bad is decommissioned" in q.reason for q in refused)
    finally:
        store.close()


def test_a_locked_database_and_a_full_queue_lose_nothing_sent_at_least_once(
    tmp_path: Path, broker: Mosquitto
) -> None:
    """Another writer holds the SQLite write lock for 8 s (a VACUUM, a long CLI transaction)
    while a device streams at QoS 1 and a misbehaving one floods at QoS 0 (outside the
    broker's flow control) into a 20-message queue. Nothing is quarantined: every commit
    fails, but the store's ping fails too (it takes the write lock), so the failures are an
    outage, not a message the store refuses. The full queue drops QoS 0 messages, counted,
    without forcing a reconnect; every QoS 1 message is stored exactly once."""
    path = tmp_path / "fleet.db"
    url = sqlite_url(path) + "?busy_timeout_ms=300"
    store = opened(url)
    good, noisy = boot_id(), boot_id()
    total, flood = 60, 400
    try:
        with make_worker(broker, url, queue_max=20, full_wait_s=0.3) as worker:
            assert worker.wait_ready(10)
            pub = Publisher(broker.host, broker.port)
            probe_until_stored(pub, store, state("gw-steady", good, 0), 30)
            connects = worker.stats.connects
            other = sqlite3.connect(path, isolation_level=None)
            other.execute("BEGIN IMMEDIATE")
            try:
                for seq in range(1, total + 1):
                    pub.send(telemetry("gw-steady", good, seq))
                for seq in range(flood):
                    pub.client.publish(
                        topic_of(telemetry("gw-noisy", noisy, seq)),
                        encode(telemetry("gw-noisy", noisy, seq)),
                        qos=0,
                    )
                wait_until(lambda: worker.stats.dropped_qos0 > 0, 20, "a QoS 0 message dropped")
                time.sleep(8)
                retries_during_lock = worker.stats.store_retries
            finally:
                other.execute("ROLLBACK")
                other.close()
            pub.close()
            wait_until(
                lambda: stored_seqs(store, "gw-steady") == list(range(1, total + 1)),
                60,
                "every QoS 1 message stored",
            )
            time.sleep(0.5)
        stats = worker.stats
        assert retries_during_lock > 3  # the commits did fail for the whole lock
        assert sum(stats.quarantined.values()) == 0, (stats.quarantined, stats.last_error)
        assert stats.dropped == 0  # flow control held every QoS 1 message at the broker
        assert stats.connects == connects  # QoS 0 drops forced no resync
        noisy_seqs = stored_seqs(store, "gw-noisy")
        assert noisy_seqs == sorted(set(noisy_seqs))
        # Every QoS 0 message was stored or counted as dropped (none silently vanished).
        assert len(noisy_seqs) + stats.dropped_qos0 == flood, (len(noisy_seqs), stats)
        assert stored_seqs(store, "gw-steady") == list(range(1, total + 1))
    finally:
        store.close()
