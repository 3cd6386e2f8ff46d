"""``fleet serve`` as a process: reaching the broker (or saying why not), riding out an outage,
its worker processes, and the ingest sessions it owns. Real Mosquitto, real SQLite (and
PostgreSQL where the store matters), the real agent uplink as the device."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from typer.testing import CliRunner

from fleet.cli import app
from fleet.ingest import IngestConfig, serve
from fleet.ingest.config import IngestStats
from fleet.ingest.drain import SessionDrainer
from fleet.ingest.link import REPEAT_LOG_S, Link
from fleet.ingest.serve import status_line
from fleet.ingest.sessions import (
    ACTIVE,
    DRAINING,
    ENDED,
    ORPHANED,
    STOPPED,
    orphans,
    plan,
    retire,
)
from fleet.store import IngestSession
from tests.support.fleet import (
    REPO,
    Publisher,
    boot_id,
    make_worker,
    opened,
    sqlite_url,
    stored_seqs,
    telemetry,
    wait_until,
)
from tests.support.mosquitto import Mosquitto, mosquitto
from tests.support.pg import pg_schema_url
from tests.support.ports import free_port
from tests.support.procs import alive, children
from tests.support.tcp_proxy import TcpProxy, target_of, via

pytestmark = pytest.mark.peers


class Serve:
    """``python -m fleet.cli serve ...`` in a session of its own; its stderr lines collected."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet.cli", "serve", "--http", "127.0.0.1:0", *args],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, pattern: str, timeout: float, start: int = 0) -> int:
        """Index of the first line from ``start`` on that matches ``pattern``."""
        found: list[int] = []

        def seen() -> bool:
            found[:] = [i for i, x in enumerate(self.lines[start:], start) if re.search(pattern, x)]
            return bool(found) or self.proc.poll() is not None

        wait_until(seen, timeout, f"a line matching {pattern!r}")
        assert found, f"fleet serve exited ({self.proc.returncode}) first:\n{self.text()}"
        return found[0]

    def workers(self) -> list[int]:
        """Pids of the worker processes (spawned children of fleet serve)."""
        return children(self.proc.pid, "spawn_main")

    def finish(self, sig: signal.Signals | None = signal.SIGTERM, timeout: float = 60) -> int:
        """Send ``sig`` (None: none), then wait for the exit code."""
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def kill_all(self) -> None:
        """SIGKILL fleet serve and every process it started (no flush, no ack, no DISCONNECT)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._reader.join(10)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with mosquitto(tmp_path / "broker") as b:
        yield b


def _serve_args(url: str, broker: Mosquitto, *extra: str) -> list[str]:
    return ["--store", url, "--broker", f"{broker.host}:{broker.port}", "--batch-ms", "20",
            "--no-rollouts", *extra]  # fmt: skip


# --- reaching the broker -------------------------------------------------------------------


def test_link_logs_every_first_failure_then_one_line_per_period_of_an_outage() -> None:
    link = Link("b:1")
    lines = [link.failed("connection refused", t) for t in (0.0, 0.3, 0.9)]
    assert lines == [f"cannot connect to b:1: connection refused (attempt {n})" for n in (1, 2, 3)]
    assert link.up(1.0) is None  # the first connection ends no outage
    assert (link.connected, link.error, link.failures) == (True, None, 0)
    link.lost("Unspecified error", 100.0)
    first = link.failed("connection refused", 100.5)
    assert first is not None
    assert first.startswith("cannot reconnect to b:1: connection refused (down 0 s, 1 attempt")
    assert [link.failed("connection refused", 101.0 + i) for i in range(20)] == [None] * 20
    again = link.failed("no answer (timed out)", 100.5 + REPEAT_LOG_S)
    assert again is not None
    assert "no answer (timed out) (down 30 s, 22 attempt(s)" in again
    assert link.up(140.0) == "reconnected to b:1 after 40.0 s (22 failed attempt(s))"
    # Backoff: jittered, from a quarter second up to 2 s, never more.
    link.failures = 0
    assert 0.125 <= link.retry_in() <= 0.25
    link.failures = 1000
    assert all(1.0 <= link.retry_in() <= 2.0 for _ in range(100))


def test_status_line_says_how_many_workers_reach_the_broker() -> None:
    up = IngestStats(received=10, stored=9, duplicates=1, connected=True, connects=1)
    down = IngestStats(received=5, stored=5, connects=1, link_error="connection refused")
    level, line = status_line([up, IngestStats(connected=True)], "b:1")
    assert level == logging.INFO
    assert line.startswith("ingest: 2/2 worker(s) connected to b:1; received 10, stored 9, ")
    level, line = status_line([up, down], "b:1")
    assert level == logging.WARNING
    assert line.startswith(
        "ingest: 1/2 worker(s) connected to b:1 (not connected: connection refused); "
        "received 15, stored 14, duplicates 1, "
    )


@pytest.mark.parametrize(
    ("broker_arg", "reason"),
    [
        ("127.0.0.1:{free}", "connection refused"),
        ("nosuchhost.invalid:1883", "cannot resolve the host name"),
    ],
    ids=["port-closed", "host-unknown"],
)
def test_serve_exits_with_one_line_when_the_broker_is_never_reached(
    tmp_path: Path, broker_arg: str, reason: str
) -> None:
    """Before, `fleet serve --broker 127.0.0.1:1` printed nothing and never exited."""
    where = broker_arg.format(free=free_port())
    url = sqlite_url(tmp_path / "fleet.db")
    t0 = time.monotonic()
    serve = Serve("--store", url, "--broker", where, "--connect-timeout", "3",
                  "--artifact-port", "0", "--coap-port", "0", "--workers", "2")  # fmt: skip
    code = serve.finish(None, timeout=60)
    took = time.monotonic() - t0
    assert code == 3, serve.text()
    assert took < 3 + 20, took  # process start and teardown; never the old "for ever"
    last = serve.lines[-1]
    assert re.fullmatch(
        rf"fleet: cannot connect to the MQTT broker {re.escape(where)} within 3 s: "
        rf"{reason}.* \(\d+ attempt\(s\)\)",
        last,
    ), serve.text()
    # Every failed attempt was logged with its reason, by each worker.
    for worker in ("0", "1"):
        attempts = [x for x in serve.lines if re.search(rf"-{worker}: cannot connect to", x)]
        assert len(attempts) >= 2, serve.text()
        assert all(f"cannot connect to {where}: {reason}" in x for x in attempts)
        assert "(attempt 1)" in attempts[0]
        assert "(attempt 2)" in attempts[1]
    assert "Traceback" not in serve.text()


def test_serve_exits_with_one_line_when_the_broker_refuses_it(tmp_path: Path) -> None:
    plain = Mosquitto(tmp_path / "broker")
    conf = plain.config_text().replace("allow_anonymous true", "allow_anonymous false")
    with mosquitto(tmp_path / "broker", port=plain.port, config=conf) as broker:  # nobody may
        where = f"{broker.host}:{broker.port}"
        serve = Serve("--store", sqlite_url(tmp_path / "fleet.db"), "--broker", where,
                      "--connect-timeout", "2", "--no-rollouts")  # fmt: skip
        assert serve.finish(None) == 3, serve.text()
    assert re.fullmatch(
        rf"fleet: cannot connect to the MQTT broker {re.escape(where)} within 2 s: the broker "
        r"refused the connection: Not authorized \(\d+ attempt\(s\)\)",
        serve.lines[-1],
    ), serve.text()
    assert "cannot connect to" in serve.lines[-2]


def test_serve_rides_out_a_broker_outage_says_so_and_stores_every_message(
    tmp_path: Path, broker: Mosquitto
) -> None:
    url = sqlite_url(tmp_path / "fleet.db")
    store = opened(url)
    serve = Serve(*_serve_args(url, broker, "--status-interval", "0.5", "--client-id", "out"))
    try:
        serve.wait_line(r"INFO ingest: 1/1 worker\(s\) connected to", 30)
        boot = boot_id()
        pub = Publisher(broker.host, broker.port, reconnect_s=(3, 4))
        for seq in range(50):
            pub.send(telemetry("gw-1", boot, seq))
        pub.flush()
        wait_until(lambda: len(stored_seqs(store, "gw-1")) == 50, 30, "the first 50 stored")
        broker.stop()
        mark = serve.wait_line(r"WARNING ingest out-ingest-0: connection to .* lost", 30)
        serve.wait_line(
            r"WARNING ingest out-ingest-0: cannot reconnect to .*connection refused", 30, mark
        )
        serve.wait_line(
            r"WARNING ingest: 0/1 worker\(s\) connected to .*\(not connected: connection refused\)",
            30,
            mark,
        )
        time.sleep(3)  # an outage of several attempts
        assert serve.proc.poll() is None, serve.text()
        broker.start()
        serve.wait_line(r"INFO ingest out-ingest-0: reconnected to .* after", 30, mark)
        for seq in range(50, 100):
            pub.send(telemetry("gw-1", boot, seq))
        pub.close()
        wait_until(lambda: len(stored_seqs(store, "gw-1")) == 100, 30, "all 100 stored")
        assert stored_seqs(store, "gw-1") == list(range(100))
        assert serve.finish() == 0, serve.text()
    finally:
        serve.kill_all()
        store.close()
    # One line for the loss, one per 30 s for the failures: not one per attempt.
    failures = [x for x in serve.lines if "cannot reconnect" in x]
    assert len(failures) == 1, failures


# --- worker processes ----------------------------------------------------------------------


def test_worker_processes_end_when_fleet_serve_is_killed(tmp_path: Path, broker: Mosquitto) -> None:
    """A worker left running would hold its session against the next fleet serve."""
    url = sqlite_url(tmp_path / "fleet.db")
    serve = Serve(*_serve_args(url, broker, "--workers", "2", "--client-id", "orph"))
    try:
        serve.wait_line(r"orph-ingest-1 connected", 60)
        workers = serve.workers()
        assert len(workers) == 2
        serve.proc.send_signal(signal.SIGKILL)  # the parent only
        serve.proc.wait(10)
        wait_until(lambda: not any(alive(p) for p in workers), 15, "the workers to end")
    finally:
        serve.kill_all()
        for p in serve.workers():
            os.kill(p, signal.SIGKILL)


def test_a_killed_worker_process_is_started_again_on_its_session(
    tmp_path: Path, broker: Mosquitto
) -> None:
    """Its session keeps its share of the group's messages: unread, they would be hidden."""
    url = sqlite_url(tmp_path / "fleet.db")
    store = opened(url)
    serve = Serve(*_serve_args(url, broker, "--workers", "2", "--client-id", "restart"))
    try:
        serve.wait_line(r"restart-ingest-1 connected", 60)
        serve.wait_line(r"restart-ingest-0 connected", 60)
        first, second = serve.workers()
        os.kill(second, signal.SIGKILL)
        mark = serve.wait_line(r"its process exited \(code -9\); starting it again", 30)
        boot = boot_id()
        pub = Publisher(broker.host, broker.port)
        for seq in range(200):
            pub.send(telemetry("gw-2", boot, seq))
        pub.close()
        wait_until(lambda: len(stored_seqs(store, "gw-2")) == 200, 60, "all 200 stored")
        assert stored_seqs(store, "gw-2") == list(range(200))
        serve.wait_line(r"connected .*session present: True", 30, mark)
        assert first in serve.workers()
        assert serve.finish() == 0, serve.text()
    finally:
        serve.kill_all()
        store.close()


# --- the sessions fleet serve owns -----------------------------------------------------------

T = 1_800_000_000 * 10**9


def _session(cid: str, state: str, *, prefix: str = "fi-h", node: str = "h", index: int = 0,
             group: str = "ingest", seen: int = T) -> IngestSession:  # fmt: skip
    return IngestSession(cid, prefix, node, group, index, "b:1", state, T - 10**9, seen)


def test_plan_names_sessions_and_drains_what_no_worker_will_read() -> None:
    first = plan([], prefix="fi-h", node="h", group="ingest", workers=2, broker="b:1", now_ns=T,
                 used_before=False)  # fmt: skip
    assert [s.client_id for s in first.run] == ["fi-h-ingest-0", "fi-h-ingest-1"]
    assert all(s.state == ACTIVE and s.created_ns == T and s.node == "h" for s in first.run)
    assert first.drain == ()
    assert first.legacy == ()
    known = [
        _session("fi-h-ingest-0", ACTIVE),  # killed: still "active"
        _session("fi-h-ingest-1", STOPPED, index=1),
        _session("fi-h-ingest-2", DRAINING, index=2),  # a drain cut short
        _session("fi-h-ingest-3", ENDED, index=3),
        _session("fi-h-other-0", STOPPED, group="other"),  # the group changed
        _session("fi-x-ingest-1", STOPPED, prefix="fi-x", node="x", index=1),  # not ours
        _session("fi-y-ingest-0", ORPHANED, prefix="fi-y", node="y"),  # retired: orphans()
    ]
    p = plan(known, prefix="fi-h", node="h2", group="ingest", workers=1, broker="b:2", now_ns=T)
    (run,) = p.run
    assert (run.client_id, run.state, run.node, run.broker) == (
        "fi-h-ingest-0",
        ACTIVE,
        "h2",
        "b:2",
    )
    assert run.created_ns == T - 10**9  # kept from the record
    assert [(s.client_id, s.state) for s in p.drain] == [
        ("fi-h-ingest-1", DRAINING), ("fi-h-ingest-2", DRAINING), ("fi-h-other-0", DRAINING),
    ]  # fmt: skip
    assert p.legacy == ()  # the prefix is known: its sessions are recorded
    assert "draining fi-h-ingest-1 (draining)" in p.describe()
    (claim,) = orphans(known, {"fi-h-ingest-0"}, "h2", T + 1)
    assert (claim.client_id, claim.state, claim.node, claim.last_seen_ns) == (
        "fi-y-ingest-0", DRAINING, "h2", T + 1,
    )  # fmt: skip
    # A drain this node claimed and did not finish is resumed by its next start.
    mine = replace(claim, client_id="fi-z-ingest-0", prefix="fi-z")
    resumed = plan([*known, mine], prefix="fi-h", node="h2", group="ingest", workers=1,
                   broker="b:2", now_ns=T)  # fmt: skip
    assert "fi-z-ingest-0" in [s.client_id for s in resumed.drain]
    # Growing again reuses the sessions and drains nothing.
    grown = plan(known, prefix="fi-h", node="h", group="ingest", workers=3, broker="b:1", now_ns=T)
    assert [s.client_id for s in grown.drain] == ["fi-h-other-0"]


def test_plan_looks_for_an_older_versions_sessions_once_on_a_used_store() -> None:
    p = plan([], prefix="fi-h", node="h", group="ingest", workers=1, broker="b:1", now_ns=T)
    assert [s.client_id for s in p.legacy] == ["fi-h"] + [f"fi-h-{i}" for i in range(64)]
    assert all(s.index == -1 and s.state == DRAINING for s in p.legacy)
    again = plan(p.run, prefix="fi-h", node="h", group="ingest", workers=1, broker="b:1", now_ns=T)
    assert again.legacy == ()


def test_retire_refuses_a_node_seen_lately_unless_forced() -> None:
    known = [
        _session("fi-a-ingest-0", ACTIVE, prefix="fi-a", node="a", seen=T - 5 * 10**9),
        _session("fi-a-ingest-1", STOPPED, prefix="fi-a", node="a", index=1, seen=T - 10**9),
        _session("fi-a-ingest-2", ENDED, prefix="fi-a", node="a", index=2),
        _session("fi-b-ingest-0", ACTIVE, prefix="fi-b", node="b"),
    ]
    todo, lately = retire(known, "a", T)
    assert todo == []
    assert [s.client_id for s in lately] == ["fi-a-ingest-0"]
    todo, _ = retire(known, "a", T, force=True)
    assert [(s.client_id, s.state) for s in todo] == [
        ("fi-a-ingest-0", ORPHANED), ("fi-a-ingest-1", ORPHANED),
    ]  # fmt: skip
    todo, lately = retire(known, "a", T + 60 * 10**9)  # its fleet serve stopped beating
    assert len(todo) == 2
    assert lately == []


class Device:
    """``tests/support/uplink_device_proc.py``: the real agent uplink (outbox, QoS 1, births with
    the seq watermark) producing ``count`` decisions at ``rate`` per second."""

    def __init__(self, tmp: Path, port: int, count: int, rate: float, name: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.uplink_device_proc",
             "--state-dir", str(tmp / name), "--port", str(port), "--count", str(count),
             "--rate", str(rate), "--device", name],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.produced = False
        self.stats: dict[str, Any] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = json.loads(line)
            if event["event"] == "produced":
                self.produced = True
            elif event["event"] == "stats":
                self.stats = event

    def delivered(self) -> bool:
        """Everything produced is acked by the broker (nothing left in the outbox)."""
        return self.produced and self.stats.get("outbox_rows") == 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # clean offline, with the seq watermark
        self.proc.wait(30)


def _at_broker(broker: Mosquitto, client_id: str) -> bool:
    """Whether the broker holds a session for ``client_id`` (asked without leaving one)."""
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    present: list[bool] = []
    c.on_connect = lambda _c, _u, flags, _rc, _p: present.append(flags.session_present)
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.SessionExpiryInterval = 0  # nothing stays after this look
    c.connect(broker.host, broker.port, clean_start=False, properties=props)
    c.loop_start()
    wait_until(lambda: bool(present), 10, f"a CONNACK for {client_id}")
    c.disconnect()
    c.loop_stop()
    return present[0]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_worker_count_changes_2_1_3_1_while_a_device_publishes_lose_and_hide_nothing(
    tmp_path: Path, broker: Mosquitto, backend: str
) -> None:
    """Before, 2 -> 1 left the sessions -0 and -1 of the two workers unread (the one worker
    was fleet-ingest-HOST) and the broker kept handing them a share of live messages.
    SIGKILL after 2 and 1 workers, SIGTERM after 3."""
    with contextlib.ExitStack() as stack:
        url = (
            sqlite_url(tmp_path / "fleet.db")
            if backend == "sqlite"
            else stack.enter_context(pg_schema_url())
        )
        _changes_lose_nothing(tmp_path, broker, url)


def _changes_lose_nothing(tmp_path: Path, broker: Mosquitto, url: str) -> None:
    # 60 s of publishing: three starts of fleet serve must fit in it on a loaded machine
    # (30 s did not with the 2-core box at load 9), so the growth happens while it publishes.
    count, device = 2400, "press-7"
    store = opened(url)
    dev = Device(tmp_path, broker.port, count, 40.0, device)
    serves: list[Serve] = []

    def stored() -> int:
        return len(stored_seqs(store, device))

    def run(workers: int) -> Serve:
        serve = Serve(*_serve_args(url, broker, "--workers", str(workers), "--client-id", "chg"))
        serves.append(serve)
        before = stored()
        # Consuming: the device's stream grows the store (by far more than a drain's share).
        wait_until(lambda: stored() >= before + 80, 60, f"{workers} worker(s) to store")
        return serve

    try:
        # Shrinking after a crash and after a clean stop, growing after a crash.
        run(2).kill_all()  # SIGKILL: no flush, no ack, no DISCONNECT
        run(1).kill_all()
        serve = run(3)
        assert not dev.delivered(), "the device must still be publishing"
        assert serve.finish() == 0, serve.text()  # SIGTERM: a clean stop
        last = run(1)
        wait_until(dev.delivered, 120, "the device's outbox to empty")
        wait_until(lambda: stored() == count, 60, f"all {count} seqs stored")
        dev.stop()
        wait_until(lambda: not store.device(device).online, 30, "the clean offline")  # type: ignore[union-attr]
        assert last.finish() == 0, last.text()
    finally:
        dev.stop()
        for s in serves:
            s.kill_all()
    try:
        assert stored_seqs(store, device) == list(range(count))
        assert store.gaps() == []  # the watermark of the clean offline: no tail either
    finally:
        store.close()
    gaps = CliRunner().invoke(app, ["gaps", "--json", "--store", url])
    assert gaps.exit_code == 0, gaps.output
    assert json.loads(gaps.stdout) == []
    # The starts drained what the ones before left and no worker reads (a drain that a stop
    # cut short says so, and the next start takes the session on).
    logs = "\n".join(s.text() for s in serves)
    assert re.search(r"ingest drain chg-ingest-[12]: (stopped after )?[1-9]\d* message", logs)
    listed = CliRunner().invoke(app, ["sessions", "list", "--json", "--store", url])
    assert listed.exit_code == 0, listed.output
    assert [(s["client_id"], s["state"]) for s in json.loads(listed.stdout)] == [
        ("chg-ingest-0", "stopped")
    ]
    # And nothing is left queued at the broker in a session no worker reads.
    assert not _at_broker(broker, "chg-ingest-1")
    assert not _at_broker(broker, "chg-ingest-2")
    assert _at_broker(broker, "chg-ingest-0")


def test_sessions_an_older_version_left_are_drained_at_the_first_start(
    tmp_path: Path, broker: Mosquitto
) -> None:
    """The names before this version: PREFIX for one worker, PREFIX-i for several."""
    url = sqlite_url(tmp_path / "fleet.db")
    store = opened(url)
    store.register_device("gw-old", "plant1")  # a store an older fleet serve wrote
    for cid in ("leg", "leg-1"):  # the sessions of a 1-worker and a 2-worker run
        with make_worker(broker, url, cid) as w:
            assert w.wait_ready(10)
    boot = boot_id()
    pub = Publisher(broker.host, broker.port)
    for seq in range(100):
        pub.send(telemetry("gw-old", boot, seq))
    pub.close()  # all at the broker, split between the two sessions nobody reads
    serve = Serve(*_serve_args(url, broker, "--client-id", "leg"))
    try:
        wait_until(lambda: len(stored_seqs(store, "gw-old")) == 100, 60, "all 100 stored")
        assert stored_seqs(store, "gw-old") == list(range(100))
        serve.wait_line(r"ingest drain leg-1: [1-9]\d* message", 30)
        serve.wait_line(r"ingest drain leg: [1-9]\d* message", 30)
        assert serve.finish() == 0, serve.text()
    finally:
        serve.kill_all()
        store.close()
    assert "looking for 65 session name(s) of an older version" in serve.text()
    assert not _at_broker(broker, "leg")
    assert not _at_broker(broker, "leg-1")


def test_a_retired_nodes_sessions_are_drained_by_a_running_fleet_serve(
    tmp_path: Path, broker: Mosquitto
) -> None:
    url = sqlite_url(tmp_path / "fleet.db")
    store = opened(url)
    config = IngestConfig(store_url=url, broker_host=broker.host, broker_port=broker.port,
                          batch_ms=20)  # fmt: skip
    runner = CliRunner()

    def run(node: str, stop: threading.Event) -> threading.Thread:
        t = threading.Thread(
            target=serve, args=(config,), kwargs={"stop": stop, "node": node}, daemon=True
        )
        t.start()
        return t

    stop_a, stop_b = threading.Event(), threading.Event()
    a = run("node-a", stop_a)
    session_a = "fleet-ingest-node-a-ingest-0"
    wait_until(lambda: any(s.client_id == session_a for s in store.ingest_sessions()), 30, "a")
    refused = runner.invoke(app, ["sessions", "retire", "node-a", "--store", url])
    assert refused.exit_code == 2, refused.output
    assert refused.stderr.startswith(
        f"fleet: node 'node-a': {session_a} seen running within 30 s: stop its fleet serve"
    )
    time.sleep(2)  # connected and subscribed
    stop_a.set()
    a.join(30)
    b = run("node-b", stop_b)
    try:
        boot = boot_id()
        pub = Publisher(broker.host, broker.port)
        wait_until(
            lambda: (
                "fleet-ingest-node-b-ingest-0" in {s.client_id for s in store.ingest_sessions()}
            ),
            30,
            "node b's session",
        )
        time.sleep(2)  # connected and subscribed
        for seq in range(100):
            pub.send(telemetry("gw-r", boot, seq))
        pub.close()  # half of it waits in node-a's session
        wait_until(lambda: len(stored_seqs(store, "gw-r")) >= 30, 30, "node-b's share")
        assert len(stored_seqs(store, "gw-r")) < 100
        done = runner.invoke(app, ["sessions", "retire", "node-a", "--store", url])
        assert done.exit_code == 0, done.output
        assert done.stdout.startswith("node node-a: 1 session(s) retired")
        wait_until(lambda: len(stored_seqs(store, "gw-r")) == 100, 60, "node-a's share too")
        assert stored_seqs(store, "gw-r") == list(range(100))
        wait_until(
            lambda: {s.client_id: s.state for s in store.ingest_sessions()}[session_a] == ENDED,
            30,
            "node-a's session ended",
        )
    finally:
        stop_b.set()
        b.join(60)
        store.close()
    listed = runner.invoke(app, ["sessions", "list", "--store", url])
    assert listed.exit_code == 0, listed.output
    assert "fleet-ingest-node-b-ingest-0" in listed.stdout
    assert session_a not in listed.stdout  # ended: shown with --all only
    shown = json.loads(runner.invoke(app, ["sessions", "list", "--all", "--json",
                                           "--store", url]).stdout)  # fmt: skip
    drained = {s["client_id"]: s["drained"] for s in shown}
    assert 0 < drained[session_a] < 100
    assert not _at_broker(broker, session_a)


def _drain(config: IngestConfig, stop: threading.Event, box: list[str]) -> threading.Thread:
    """A SessionDrainer's ``drain`` in a thread; its outcome appended to ``box``."""
    drainer = SessionDrainer(config, quiet_s=1.0)
    box.append("")
    t = threading.Thread(target=lambda: box.__setitem__(-1, drainer.drain(stop)), daemon=True)
    t.start()
    t.drainer = drainer  # type: ignore[attr-defined]
    return t


def test_a_drain_stopped_before_it_could_store_keeps_the_session_and_its_messages(
    tmp_path: Path, broker: Mosquitto
) -> None:
    """Never ended while it owes a message: the store is locked, the drain is stopped."""
    path = tmp_path / "fleet.db"
    url = sqlite_url(path)
    store = opened(url)
    with make_worker(broker, url, "dr-1") as w:
        assert w.wait_ready(10)
    boot = boot_id()
    pub = Publisher(broker.host, broker.port)
    for seq in range(50):
        pub.send(telemetry("gw-d", boot, seq))
    pub.close()
    config = IngestConfig(store_url=f"{url}?busy_timeout_ms=100", broker_host=broker.host,
                          broker_port=broker.port, client_id="dr-1", batch_ms=20)  # fmt: skip
    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # every write of the drain fails
    stop, box = threading.Event(), list[str]()
    first = _drain(config, stop, box)
    wait_until(lambda: first.drainer.stats.store_retries >= 2, 30, "failed commits")  # type: ignore[attr-defined]
    stop.set()
    first.join(60)
    assert box == ["stopped"]
    lock.execute("ROLLBACK")
    lock.close()
    assert stored_seqs(store, "gw-d") == []
    again = _drain(config, threading.Event(), box)
    again.join(60)
    assert box[-1] == "ended"
    assert again.drainer.present is True  # type: ignore[attr-defined]
    assert stored_seqs(store, "gw-d") == list(range(50))
    store.close()
    assert not _at_broker(broker, "dr-1")


def test_a_drain_gives_way_to_a_client_running_the_session(
    tmp_path: Path, broker: Mosquitto
) -> None:
    url = sqlite_url(tmp_path / "fleet.db")
    opened(url).close()
    with make_worker(broker, url, "dr-2") as live:
        assert live.wait_ready(10)
        config = IngestConfig(store_url=url, broker_host=broker.host, broker_port=broker.port,
                              client_id="dr-2")  # fmt: skip
        box: list[str] = []
        t = _drain(config, threading.Event(), box)
        t.join(60)
        assert box == ["taken over"]
        wait_until(lambda: live.stats.connected, 15, "the live worker to have it back")
    assert _at_broker(broker, "dr-2")  # kept: it was never the drain's to end


def test_a_worker_process_whose_store_cannot_open_says_so_and_is_started_again(
    broker: Mosquitto,
) -> None:
    with pg_schema_url() as direct, TcpProxy(*target_of(direct)) as proxy:
        url = via(direct, proxy.port)
        opened(url).close()  # migrated: fleet serve's own store calls are not the point
        serve = Serve(*_serve_args(url, broker, "--workers", "2", "--client-id", "pgcut",
                                   "--connect-timeout", "90"))  # fmt: skip
        try:
            serve.wait_line(r"ingest sessions: running pgcut-ingest-0, pgcut-ingest-1", 60)
            proxy.cut()  # the worker processes' store processes cannot connect
            mark = serve.wait_line(r"ERROR ingest pgcut-ingest-\d: cannot start: store ", 60)
            serve.wait_line(r"its process exited \(code 3\); starting it again", 30, mark)
            proxy.restore()
            serve.wait_line(r"pgcut-ingest-0 connected", 60, mark)
            serve.wait_line(r"pgcut-ingest-1 connected", 60, mark)
            assert serve.finish() == 0, serve.text()
        finally:
            serve.kill_all()
    assert "Traceback" not in serve.text()
