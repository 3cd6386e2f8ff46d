"""The processes of the chaos benchmark (``bench.chaos``): ``fleet serve`` in a session of
its own, the device-host processes (``bench.chaos_devices``) and the ledger of what their
devices numbered, read from their stdout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from tests.support.mosquitto import Mosquitto
from tests.support.procs import children

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
FLEET_ID = "fleet"
GAP_CHECK_S = 5.0


class Serve:
    """``fleet serve`` as a process in a session of its own, its stderr in ``log``."""

    def __init__(
        self, url: str, broker: Mosquitto, tls: Path, workers: int, log: TextIO, grace: float
    ) -> None:
        cert = tls / FLEET_ID
        args = ["--store", url, "--broker", f"{broker.host}:{broker.port}", "--workers",
                str(workers), "--client-id", "chaos", "--no-rollouts", "--connect-timeout", "0",
                "--status-interval", "10", "--gap-grace", str(grace), "--gap-check",
                str(GAP_CHECK_S), "--tls-ca", str(cert / "ca.crt"), "--tls-cert",
                str(cert / f"{FLEET_ID}.crt"), "--tls-key",
                str(cert / f"{FLEET_ID}.key")]  # fmt: skip
        log.write(f"=== fleet serve --workers {workers} at {time.time_ns()}\n")
        log.flush()
        self.workers = workers
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet.cli", "serve", "--http", "127.0.0.1:0", *args],
            cwd=REPO,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )

    def worker_pids(self) -> list[int]:
        return children(self.proc.pid, "spawn_main")

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        """SIGTERM and wait; SIGKILL the group if it has not ended within 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill_all()
            return -9


class Ledger:
    """What the device hosts said: per ``(device, boot)`` the most seqs it numbered, each
    device's latest ``[boot, next_seq, outbox_rows, connected]``, each host's last report."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.numbered: dict[tuple[str, str], int] = {}
        self.latest: dict[str, list[Any]] = {}
        self.reported: dict[int, float] = {}
        self.stopped: set[int] = set()

    def feed(self, line: str) -> None:
        event = json.loads(line)
        with self.lock:
            if event["event"] == "boots":
                for boot, n in event["boots"]:
                    self._number(event["device"], boot, int(n))
            elif event["event"] in ("stats", "stopped"):
                host = int(event["host"])
                for device, snap in event["devices"].items():
                    self.latest[device] = snap
                    self._number(device, snap[0], int(snap[1]))
                self.reported[host] = time.monotonic()
                if event["event"] == "stopped":
                    self.stopped.add(host)

    def _number(self, device: str, boot: str, n: int) -> None:
        key = (device, boot)
        self.numbered[key] = max(n, self.numbered.get(key, 0))

    def sent(self) -> int:
        with self.lock:
            return sum(self.numbered.values())

    def drained(self, devices: list[str]) -> bool:
        with self.lock:
            return all(d in self.latest and self.latest[d][2] == 0 for d in devices)


class Hosts:
    """The device-host processes (``bench.chaos_devices``); a killed one can start again."""

    def __init__(self, spec: Path, names: list[list[str]], ledger: Ledger, log: TextIO) -> None:
        self.spec, self.names, self.ledger, self.log = spec, names, ledger, log
        self.procs: list[subprocess.Popen[str] | None] = [None] * len(names)
        self._readers: list[threading.Thread] = []

    def start(self, i: int) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.chaos_devices", "--spec", str(self.spec),
             "--host", str(i)],
            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=self.log, text=True,
        )  # fmt: skip
        self.procs[i] = proc
        t = threading.Thread(target=self._read, args=(proc,), daemon=True)
        t.start()
        self._readers.append(t)

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with contextlib.suppress(ValueError, KeyError):
                self.ledger.feed(line)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)

    def signal_all(self, sig: signal.Signals) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(sig)

    def stop_all(self) -> None:
        self.signal_all(signal.SIGTERM)
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for t in self._readers:
            t.join(10)
