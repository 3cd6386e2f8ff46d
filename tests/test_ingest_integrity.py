"""What the ingest must never let through or lose quietly, end to end on both stores: a real
Mosquitto, a real worker, SQLite and PostgreSQL.

Payloads msgspec alone accepted (a key given twice, NUL inside ``detail``, ``detail`` nested
60,000 deep), a second body under a stored key (a conflict), and messages the broker
dropped for the ingest (gaps, see the second half).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
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
from fleet.ingest import IngestConfig, IngestStats, serve
from fleet.ingest.gapwatch import HOLD_MAX_S, SHOWN_BOOTS, GapWatch, gap_lines, horizon_after
from fleet.ingest.serve import ingest_horizon
from fleet.store import Gap, Store
from tests.support.fleet import (
    REPO,
    SITE,
    Publisher,
    boot_id,
    make_worker,
    opened,
    ota_status,
    probe_until_stored,
    sqlite_url,
    state,
    stored_seqs,
    telemetry,
    wait_until,
)
from tests.support.mosquitto import Mosquitto, mosquitto
from tests.support.pg import pg_schema_url
from tests.support.uplink import kill9, spawn_device, wait_line
from wire import encode, topic

pytestmark = pytest.mark.peers


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with mosquitto(tmp_path / "broker") as b:
        yield b


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh store: a SQLite file, or a PostgreSQL schema of this test's own (so its
    migrations and rows never meet another test's, or another branch's code, in the
    shared database), dropped afterwards."""
    if request.param == "sqlite":
        yield sqlite_url(tmp_path / "fleet.db")
        return
    with pg_schema_url() as url:
        yield url


@pytest.fixture
def device() -> str:
    """A device name of this test alone."""
    return f"gw-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = opened(store_url)
    try:
        yield s
    finally:
        s.close()


def _ota_with(device: str, boot: str, seq: int, detail_json: bytes) -> bytes:
    raw = encode(ota_status(device, boot, seq))
    assert raw.endswith(b'"detail":{}}')
    return raw.removesuffix(b"{}}") + detail_json + b"}"


def test_payloads_msgspec_let_through_are_quarantined_with_reason_and_where(
    broker: Mosquitto, store_url: str, store: Store, device: str
) -> None:
    """Before: a repeated key was stored (last one wins), NUL inside `detail` was stored
    (on PostgreSQL, whose text refuses NUL everywhere else), 60,000 levels of `detail`
    were quarantined as `internal error: RecursionError`, and an unknown field named with
    a NUL made a reason PostgreSQL could not store."""
    boot = boot_id()
    ota_t = topic(SITE, device, "ota/status")
    tel_t = topic(SITE, device, "telemetry")
    twice = encode(telemetry(device, boot, 1025)).replace(b'"seq":1025', b'"seq":1025,"seq":3')
    unknown = json.dumps({**msgspec.to_builtins(telemetry(device, boot, 4)), "x\u0000": 1})
    bad = [
        (tel_t, twice, 'duplicate key "seq"', "$.seq"),
        (ota_t, _ota_with(device, boot, 5, b'{"code":"a\\u0000b"}'), "NUL", "$.detail.code"),
        (
            ota_t,
            _ota_with(device, boot, 6, b'{"a":' + b"[" * 60_000 + b"]" * 60_000 + b"}"),
            "nested deeper than 32 levels",
            "$.detail.a" + "[0]" * 30,
        ),
        (tel_t, unknown.encode(), "unknown field `x\\u0000`", "$"),
    ]
    with make_worker(broker, store_url, f"w-{device}") as worker:
        assert worker.wait_ready(10)
        pub = Publisher(broker.host, broker.port)
        probe_until_stored(pub, store, state(device, boot, 0), 30)
        pub.send(telemetry(device, boot, 0))
        for t, payload, _, _ in bad:
            pub.publish(t, payload)
        pub.send(telemetry(device, boot, 1))
        pub.close()
        wait_until(
            lambda: worker.stats.stored == 2 and sum(worker.stats.quarantined.values()) == 4,
            30,
            "two stored, four quarantined",
        )
    assert worker.stats.quarantined["schema"] == 4, worker.stats.quarantined
    assert worker.stats.store_retries == 0
    held = {q.payload: q for q in store.quarantined(limit=10_000) if q.device == device}
    for _, payload, reason, where in bad:
        q = held[payload[:4096]]
        assert reason in q.reason, q.reason
        assert q.where == where
    assert [seq for _, seq, _, _ in store.telemetry(device)] == [0, 1]
    stored_ota = store.ota_status_since(0, limit=100_000)
    assert all(device.encode() not in body for _, body in stored_ota)


def test_a_second_body_under_a_stored_key_is_a_conflict_not_a_duplicate(
    broker: Mosquitto, store_url: str, store: Store, device: str
) -> None:
    """Before: counted as a duplicate and the second body silently dropped."""
    boot = boot_id()
    first = [telemetry(device, boot, seq) for seq in range(4)]
    forged = telemetry(device, boot, 2, t_ns=first[2].t_ns + 1)
    with make_worker(broker, store_url, f"w-{device}") as worker:
        assert worker.wait_ready(10)
        pub = Publisher(broker.host, broker.port)
        probe_until_stored(pub, store, state(device, boot, 0), 30)
        for msg in first:
            pub.send(msg)
        pub.flush()
        wait_until(lambda: worker.stats.stored == 4, 30, "the first four stored")
        pub.send(forged)  # same key, another body
        pub.send(first[3])  # the same bytes again: a redelivery
        pub.close()
        wait_until(
            lambda: worker.stats.conflicts + worker.stats.duplicates == 2, 30, "both handled"
        )
    assert (worker.stats.stored, worker.stats.duplicates, worker.stats.conflicts) == (4, 1, 1)
    assert sum(worker.stats.quarantined.values()) == 0
    assert worker.stats.as_dict()["conflicts"] == 1
    bodies = {seq: body for _, seq, _, body in store.telemetry(device)}
    assert bodies[2] == encode(first[2])
    (q,) = [q for q in store.quarantined(limit=10_000) if q.device == device]
    assert q.reason.startswith(f"conflict: seq 2 of boot {boot}")
    assert q.payload == encode(forged)


# --- gaps: messages a broker dropped for the ingest -----------------------------------------

SEC = 1_000_000_000


def test_gap_watch_audits_up_to_grace_ago_every_period_and_waits_after_a_failure() -> None:
    t0 = 1_000 * SEC
    w = GapWatch.starting(t0, grace_s=30, check_s=5)
    # Right away: what the previous process received in its last 35 s before this start.
    assert w.due(t0) == (t0 - 35 * SEC, t0 - 30 * SEC)
    w.audited(t0 - 30 * SEC, t0)
    assert w.due(t0 + 4 * SEC) is None, "once per period"
    assert w.due(t0 + 5 * SEC) == (t0 - 30 * SEC, t0 - 25 * SEC)
    w.audit_failed(t0 + 5 * SEC)
    assert w.due(t0 + 6 * SEC) is None
    assert w.due(t0 + 10 * SEC) == (t0 - 30 * SEC, t0 - 20 * SEC), "the same window again"
    w.audited(t0 - 20 * SEC, t0 + 10 * SEC)
    # A batch failed: older messages of other workers may be retried; wait a whole grace.
    w.store_failed(t0 + 11 * SEC)
    assert w.due(t0 + 40 * SEC) is None
    assert w.due(t0 + 41 * SEC) == (t0 - 20 * SEC, t0 + 11 * SEC)


def test_gap_lines_name_device_boot_and_ranges() -> None:
    gaps = [Gap("gw-1", "b" * 32, 1000, 2999)] + [
        Gap("gw-2", "c" * 32, s, s) for s in (9, 7, 5, 3, 1, 11, 13)
    ]
    lines = gap_lines(gaps, now_ns=100 * SEC, connected_ns=58 * SEC)
    assert lines[0] == (
        f"ingest gap: device gw-1 boot {'b' * 32} seqs 1000..2999 never arrived (2000 "
        "messages; a broker drops what it cannot queue for the ingest; this worker "
        "(re)connected 42 s ago); see fleet gaps"
    )
    assert "seqs 1..1, 3..3, 5..5, 7..7, 9..9 and 2 more ranges" in lines[1]
    assert "(7 messages;" in lines[1]
    assert "connected" not in gap_lines(gaps, 1, None)[0]


def test_gap_lines_of_a_fleet_wide_outage_stay_readable() -> None:
    """A broker outage leaves a gap in every device: the first SHOWN_BOOTS get their line,
    the rest one line that counts them (before: 10,000 lines in bench.fleet_scale)."""
    gaps = [Gap(f"gw-{i:05d}", "b" * 32, 10, 12) for i in range(10_000)]
    gaps.append(Gap("gw-09999", "c" * 32, 1, 1))  # a second boot of the last device
    lines = gap_lines(gaps, now_ns=100 * SEC, connected_ns=None)
    assert len(lines) == SHOWN_BOOTS + 1
    assert all(f"device gw-{i:05d} " in lines[i] for i in range(SHOWN_BOOTS))
    assert lines[-1] == (
        f"ingest gap: {10_001 - SHOWN_BOOTS} more boots of {10_000 - SHOWN_BOOTS} devices "
        f"have seqs that never arrived ({3 * (10_000 - SHOWN_BOOTS) + 1} messages); "
        "see fleet gaps"
    )
    assert len(gap_lines(gaps[:SHOWN_BOOTS], 1, None)) == SHOWN_BOOTS


def _serve(url: str, broker: Mosquitto, client_id: str, log: Path) -> subprocess.Popen[str]:
    """`fleet serve` as a process, gaps reported after 1 s, its log in ``log``."""
    cmd = [
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
        client_id,
        "--no-rollouts",
        "--gap-grace",
        "1",
        "--gap-check",
        "0.2",
        "--json",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("w") as err:
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True
        )


def _stop(proc: subprocess.Popen[str]) -> dict[str, Any]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    (worker,) = json.loads(out.splitlines()[-1])["workers"]
    assert isinstance(worker, dict)
    return worker


def test_fleet_serve_logs_and_counts_the_messages_a_broker_dropped_for_it(
    tmp_path: Path, store_url: str, store: Store, device: str
) -> None:
    """`fleet serve` down; the broker queues 10 messages for its session and drops the
    rest after PUBACKing them to the device. Before: `fleet serve` came back and said
    nothing (only `fleet gaps` showed the hole, to whoever ran it)."""
    boot = boot_id()
    cid = f"w-{device}"
    log = tmp_path / "serve.log"
    with mosquitto(tmp_path / "broker", extra="max_queued_messages 10\n") as broker:
        pub = Publisher(broker.host, broker.port)
        proc = _serve(store_url, broker, cid, log)
        try:
            probe_until_stored(pub, store, state(device, boot, 0), 60)
        finally:
            _stop(proc)
        for seq in range(50):  # while it is down
            pub.send(telemetry(device, boot, seq))
        pub.flush()
        proc = _serve(store_url, broker, cid, log)
        try:
            wait_until(lambda: len(stored_seqs(store, device)) == 10, 60, "the ten queued")
            for seq in range(50, 55):
                pub.send(telemetry(device, boot, seq))
            pub.close()
            wait_until(lambda: "ingest gap" in log.read_text(), 60, "the gap logged")
            time.sleep(1.0)  # no second report of the same hole
        finally:
            summary = _stop(proc)
        assert "Outgoing messages are being dropped for client " + cid in broker.log()
    lines = [line for line in log.read_text().splitlines() if "ingest gap" in line]
    assert len(lines) == 1, lines
    assert " WARNING " in lines[0]
    assert f"device {device} boot {boot} seqs 10..49 never arrived (40 messages" in lines[0]
    assert "this worker (re)connected" in lines[0]
    assert (summary["gaps"], summary["gap_seqs"], summary["stored"]) == (1, 40, 15)
    assert store.gaps(device) == [Gap(device, boot, 10, 49)]


@contextlib.contextmanager
def two_workers(
    broker: Mosquitto, store_url: str, device: str, *, grace_s: float
) -> Iterator[tuple[IngestConfig, Publisher, list[IngestStats]]]:
    """``serve`` with two worker processes (gaps audited every 0.2 s after ``grace_s``) in a
    thread, a publisher, and the workers' final stats (filled once the block is left)."""
    config = IngestConfig(
        store_url=store_url,
        broker_host=broker.host,
        broker_port=broker.port,
        client_id=f"w-{device}",
        batch_ms=20,
        gap_grace_s=grace_s,
        gap_check_s=0.2,
    )
    stop = threading.Event()
    results: list[IngestStats] = []
    runner = threading.Thread(target=lambda: results.extend(serve(config, workers=2, stop=stop)))
    runner.start()
    try:
        yield config, Publisher(broker.host, broker.port), results
    finally:
        stop.set()
        runner.join(90)


def test_two_workers_storing_out_of_order_report_no_gap(
    broker: Mosquitto, store_url: str, store: Store, device: str
) -> None:
    """Two workers of the shared group store one device's messages in two interleaved
    streams: every message's predecessor is the other worker's, often not yet committed.
    Within the grace period that is no gap."""
    boots = {f"{device}-{i}": boot_id() for i in range(3)}
    with two_workers(broker, store_url, device, grace_s=3.0) as (config, pub, results):
        first = next(iter(boots))
        probe_until_stored(pub, store, state(first, boots[first], 0), 60)
        time.sleep(2)  # the second worker joins the group
        n = 300
        for seq in range(n):
            for dev, boot in boots.items():
                pub.send(telemetry(dev, boot, seq))
        pub.close()
        wait_until(
            lambda: all(len(store.telemetry(d, limit=n)) == n for d in boots), 60, "all stored"
        )
        time.sleep(config.gap_grace_s + 1.5)  # every window audited
    assert len(results) == 2
    assert all(r.stored > 0 for r in results), [r.stored for r in results]
    assert sum(r.gaps for r in results) == 0
    assert all(store.gaps(d) == [] for d in boots)


def test_the_audit_waits_for_the_ingest_horizon_and_passes_a_held_one_after_the_cap() -> None:
    t0 = 10_000 * SEC
    w = GapWatch.starting(t0, grace_s=30, check_s=5)
    w.audited(t0 - 30 * SEC, t0)
    # The ingest stored everything sent before t0 - 40 s: nothing later is looked at.
    assert w.due(t0 + 5 * SEC, t0 - 40 * SEC) is None
    assert w.due(t0 + 5 * SEC, t0 - 28 * SEC) == (t0 - 30 * SEC, t0 - 28 * SEC)
    assert w.due(t0 + 5 * SEC, t0 + 5 * SEC) == (t0 - 30 * SEC, t0 - 25 * SEC), "grace still"
    # Held (0: a worker gone, a drain) for longer than the cap: audited all the same.
    assert w.due(t0 + 100 * SEC, 0) is None
    late = t0 + int(HOLD_MAX_S * SEC) + 31 * SEC
    assert w.due(late, 0) == (t0 - 30 * SEC, late - 30 * SEC - int(HOLD_MAX_S * SEC))


def test_a_worker_horizon_is_now_only_when_it_has_caught_up() -> None:
    now, grace = 1_000 * SEC, 30 * SEC
    fresh = [now - 2 * SEC, now - SEC, now - 3 * SEC]
    assert horizon_after(0, now, stored_t_ns=fresh, grace_ns=grace) == now
    # More waiting in its queue: only as far as what it stored.
    assert horizon_after(0, now, stored_t_ns=fresh, waiting=True, grace_ns=grace) == now - 2 * SEC
    # A backlog (a session's queue from while it was down), even with the queue empty.
    old = [now - 300 * SEC, now - 299 * SEC, now + 3600 * SEC]  # one device clock far ahead
    assert horizon_after(0, now, stored_t_ns=old, grace_ns=grace) == now - 299 * SEC
    # Idle: caught up once settled; not connected long enough: unchanged.
    assert horizon_after(7, now, settled=True, grace_ns=grace) == now
    assert horizon_after(7, now, settled=False, grace_ns=grace) == 7
    assert horizon_after(7, now, settled=True, waiting=True, grace_ns=grace) == 7
    # fleet serve hands every worker the lowest; 0 while one is unknown or a drain runs.
    a, b = IngestStats(horizon_ns=5), IngestStats(horizon_ns=9)
    assert ingest_horizon([a, b], draining=0) == 5
    assert ingest_horizon([a, b], draining=1) == 0
    assert ingest_horizon([a, IngestStats()], draining=0) == 0


def test_a_restarted_worker_delivering_its_session_late_is_no_gap(
    broker: Mosquitto, store_url: str, store: Store, device: str
) -> None:
    """One of two worker processes is SIGKILLed while devices publish; fleet serve starts
    it again seconds later and its session hands it what the broker kept for it, older
    than the 1 s grace. Before, the other worker's audit called that share missing (false
    gaps, 5,914 ranges in the chaos benchmark's full SQLite run); now the audit waits
    until every worker has caught up."""
    boots = {f"{device}-{i}": boot_id() for i in range(3)}
    n = 200
    with two_workers(broker, store_url, device, grace_s=1.0) as (config, pub, results):
        first = next(iter(boots))
        probe_until_stored(pub, store, state(first, boots[first], 0), 60)
        wait_until(lambda: len(multiprocessing.active_children()) >= 2, 30, "two workers")
        time.sleep(2)  # the second worker joins the group
        victim = next(p for p in multiprocessing.active_children() if p.name == "ingest-1")
        for seq in range(n):
            if seq == 20:
                assert victim.pid is not None
                os.kill(victim.pid, signal.SIGKILL)
            for dev, boot in boots.items():
                pub.send(telemetry(dev, boot, seq))
            time.sleep(0.02)
        pub.close()
        wait_until(
            lambda: all(len(store.telemetry(d, limit=n)) == n for d in boots), 90, "all stored"
        )
        time.sleep(config.gap_grace_s + 3)  # every window audited
    assert sum(r.gaps for r in results) == 0, [r.gaps for r in results]
    assert all(store.gaps(d) == [] for d in boots)


def test_fleet_gaps_reports_the_tail_of_a_killed_boot_the_broker_dropped(
    tmp_path: Path, store_url: str, store: Store, device: str
) -> None:
    """The device numbered 40 decisions; the broker acked them all but kept only 10 for the
    offline ingest, then the device was killed (its Last Will, made at connect, says 0
    numbered, and was dropped too). Before: `fleet gaps` showed nothing for that boot.
    Now the next boot's epitaph gives the fleet the count, and the tail is a gap."""
    cid = f"w-{device}"
    state_dir = tmp_path / "device"
    with mosquitto(tmp_path / "broker", extra="max_queued_messages 10\n") as broker:
        with make_worker(broker, store_url, cid) as first:
            assert first.wait_ready(10)
        killed = spawn_device(state_dir, broker.port, 40, device=device, after_connect=True)
        try:
            old = wait_line(killed, lambda o: o["event"] == "produced")["boot_id"]
            wait_line(killed, lambda o: o["event"] == "stats" and o["acked"] == 40)
        finally:
            kill9(killed)
        with make_worker(broker, store_url, cid) as worker:
            wait_until(lambda: worker.stats.stored + worker.stats.states >= 10, 30, "the 10")
            kept = stored_seqs(store, device)
            assert kept == list(range(len(kept)))
            assert len(kept) < 40
            assert store.gaps(device) == [], "nothing tells the fleet the boot went on"
            restarted = spawn_device(state_dir, broker.port, 0, device=device)
            try:
                wait_line(restarted, lambda o: o["event"] == "stats" and o.get("epitaphs") == 1)
                wait_until(lambda: bool(store.gaps(device)), 30, "the epitaph stored")
                restarted.send_signal(signal.SIGTERM)
                wait_line(restarted, lambda o: o["event"] == "stopped")
            finally:
                kill9(restarted)
    done = CliRunner().invoke(app, ["gaps", "--store", store_url, "--device", device, "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout) == [
        {
            "device": device,
            "boot_id": old,
            "first_missing": len(kept),
            "last_missing": 39,
            "missing": 40 - len(kept),
        }
    ]


def test_messages_held_when_a_crashed_broker_comes_back_with_the_session_are_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker is SIGKILLed while the worker holds messages it received but has not
    stored (the store is locked); it comes back from a persistence file saved before they
    arrived, with the worker's session but without them, so it never resends them. Before,
    the worker reconnected to a session present and skipped every message of the old
    connection (it counted on the broker resending them): they were lost, though the device
    had its PUBACKs. The chaos benchmark found it (``bench.chaos``, broker SIGKILL)."""
    plain = Mosquitto(tmp_path / "broker")
    # Saved only when the test says so (SIGTERM): a crash loses what came since.
    conf = plain.config_text().replace("autosave_interval 1\n", "autosave_interval 3600\n")
    broker = Mosquitto(tmp_path / "broker", port=plain.port, config=conf)
    broker.start()
    caplog.set_level(logging.INFO, logger="fleet.ingest")
    path = tmp_path / "fleet.db"
    url = sqlite_url(path) + "?busy_timeout_ms=200"
    store = opened(url)
    device, boot, total = "gw-held", boot_id(), 40
    try:
        with make_worker(broker, url, "held") as worker:
            assert worker.wait_ready(10)
            broker.restart()  # saves the worker's session and subscriptions, nothing else
            wait_until(lambda: worker.stats.connects >= 2, 30, "the worker back")
            pub = Publisher(broker.host, broker.port)
            probe_until_stored(pub, store, state(device, boot, 0), 30)
            lock = sqlite3.connect(path, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")  # the worker receives, and cannot store
            try:
                for seq in range(total):
                    pub.send(telemetry(device, boot, seq))
                pub.flush()  # the broker has them all: the device would let them go
                wait_until(lambda: worker.stats.received >= total + 1, 30, "all received")
                broker.kill()
                broker.start()
                wait_until(lambda: worker.stats.connects >= 3, 30, "the worker reconnected")
            finally:
                lock.execute("ROLLBACK")
                lock.close()
            pub.client.disconnect()
            pub.client.loop_stop()
            wait_until(lambda: stored_seqs(store, device) == list(range(total)), 30, "all stored")
    finally:
        store.close()
        broker.stop()
    # The third connection (after the crash) found the session: nothing was resent.
    connected = [r.getMessage() for r in caplog.records if " connected to " in r.getMessage()]
    assert len(connected) >= 3, connected
    assert connected[2].endswith("(session present: True)"), connected
