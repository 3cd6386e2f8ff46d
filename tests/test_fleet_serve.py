"""``fleet serve`` as a process: reaching the broker (or saying why not), riding out an outage,
its worker processes, and the ingest sessions it owns. Real Mosquitto, real SQLite (and
PostgreSQL where the store matters), the real agent uplink as the device."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.ingest.config import IngestStats
from fleet.ingest.link import REPEAT_LOG_S, Link
from fleet.ingest.serve import status_line
from tests.mqtt_broker import Mosquitto, free_port, mosquitto
from tests.test_fleet_ingest import (
    REPO,
    Publisher,
    boot_id,
    opened,
    sqlite_url,
    stored_seqs,
    telemetry,
    wait_until,
)


class Serve:
    """``python -m fleet.cli serve ...`` in a session of its own; its stderr lines collected."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet.cli", "serve", *args],
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


def children(pid: int, marker: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and marker in cmd:
            out.append(int(entry.name))
    return sorted(out)


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


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
        mark = serve.wait_line(r"WARNING ingest out: connection to .* lost", 30)
        serve.wait_line(r"WARNING ingest out: cannot reconnect to .*connection refused", 30, mark)
        serve.wait_line(
            r"WARNING ingest: 0/1 worker\(s\) connected to .*\(not connected: connection refused\)",
            30,
            mark,
        )
        time.sleep(3)  # an outage of several attempts
        assert serve.proc.poll() is None, serve.text()
        broker.start()
        serve.wait_line(r"INFO ingest out: reconnected to .* after", 30, mark)
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
        serve.wait_line(r"orph-1 connected", 60)
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
        serve.wait_line(r"restart-1 connected", 60)
        serve.wait_line(r"restart-0 connected", 60)
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
