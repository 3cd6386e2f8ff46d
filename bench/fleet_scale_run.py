"""The processes ``bench.fleet_scale`` runs and watches: its peers, the ``fleet serve``
nodes, the offer counter, and the store counts it reads."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import psutil
import psycopg
from paho.mqtt.enums import CallbackAPIVersion

from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from wire import TelemetryMsg, encode, topic

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


class Peer:
    """A :mod:`bench.fleet_scale_peers` process: commands on its stdin, JSON lines back."""

    def __init__(self, args: list[str], name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.fleet_scale_peers", *args],
            cwd=REPO, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.errors: list[str] = []
        self.last: dict[str, Any] = {}
        threading.Thread(
            target=self._pump, args=(self.proc.stdout, self.lines), daemon=True
        ).start()
        threading.Thread(target=self._tail, daemon=True).start()

    @staticmethod
    def _pump(stream: Any, q: queue.Queue[str | None]) -> None:
        for line in stream:
            q.put(line)
        q.put(None)

    def _tail(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.errors = [*self.errors[-20:], line.rstrip()]

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float) -> dict[str, Any]:
        """The next JSON line; RuntimeError (with the peer's last stderr) if none comes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                tail = " | ".join(self.errors[-5:])
                raise RuntimeError(f"{self.name}: no answer within {timeout:g} s: {tail}")
            if line.startswith("{"):
                self.last = json.loads(line)
                return self.last

    def close(self) -> None:
        """``quit``, then wait for it to end (killed after 60 s); keeps its last answer."""
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                self.send("quit")
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            with contextlib.suppress(RuntimeError):
                while True:
                    self.read(60)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Nodes:
    """``fleet serve --node-id NAME`` processes on one store and broker, each in a process
    group of its own (a kill takes its ingest workers with it), on fixed ports per name so a
    restarted node serves the artifacts its offers named."""

    def __init__(self, url: str, broker: Mosquitto, work: Path) -> None:
        self.url = url
        self.broker = broker
        self.work = work
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, tuple[int, int]] = {}

    def start(self, name: str) -> None:
        ports = self.ports.setdefault(name, (free_port(), free_port()))
        log = (self.work / f"{name}.log").open("a")
        self.running[name] = subprocess.Popen(
            [sys.executable, "-m", "fleet.cli", "serve", "--store", self.url, "--broker",
             f"{self.broker.host}:{self.broker.port}", "--node-id", name, "--http", "off",
             "--artifact-port", str(ports[0]), "--coap-port", str(ports[1]),
             "--artifacts", str(self.work / f"artifacts-{name}"), "--status-interval", "0"],
            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
        )  # fmt: skip

    def _alive(self) -> dict[str, bool]:
        with psycopg.connect(self.url) as db:
            rows = db.execute("SELECT node, seen_ns FROM fleet_nodes").fetchall()
        now = time.time_ns()
        return {n: now - seen < 10_000_000_000 for n, seen in rows}

    def wait_alive(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(psycopg.Error):
                if sum(self._alive().get(k, False) for k in self.running) >= n:
                    time.sleep(2.0)  # its ingest sessions join the group
                    return
            for name, p in self.running.items():
                if p.poll() is not None:
                    raise RuntimeError(f"fleet serve {name} exited with {p.returncode}")
            time.sleep(0.2)
        raise RuntimeError(f"{n} fleet serve nodes not all running after {timeout:g} s")

    def leader(self) -> tuple[str, int]:
        with psycopg.connect(self.url) as db:
            row = db.execute("SELECT node, epoch FROM fleet_leader").fetchone()
        return (row[0], row[1]) if row else ("", 0)

    def kill(self, name: str) -> None:
        p = self.running.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)

    def _procs(self) -> list[psutil.Process]:
        out: list[psutil.Process] = []
        for p in self.running.values():
            with contextlib.suppress(psutil.Error):
                top = psutil.Process(p.pid)
                out += [top, *top.children(recursive=True)]
        return out

    def cpu_s(self) -> float:
        total = 0.0
        for p in self._procs():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def rss_mb(self) -> float:
        """The largest node's resident memory with its workers, MB."""
        worst = 0.0
        for p in self.running.values():
            with contextlib.suppress(psutil.Error):
                top = psutil.Process(p.pid)
                rss = sum(q.memory_info().rss for q in [top, *top.children(recursive=True)])
                worst = max(worst, rss / 1e6)
        return round(worst, 1)

    def stop_all(self) -> None:
        for p in self.running.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in list(self.running.items()):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
            del self.running[name]


def engines_cpu_s(broker: Mosquitto) -> dict[str, float]:
    """CPU seconds so far of the broker and of every PostgreSQL server process (the server
    is shared: other clients' work counts too, which the bench has none of)."""
    out = {"broker": 0.0, "postgres": 0.0}
    with contextlib.suppress(psutil.Error):
        if broker.proc is not None:
            t = psutil.Process(broker.proc.pid).cpu_times()
            out["broker"] = t.user + t.system
    for p in psutil.process_iter(["name", "cpu_times"]):
        if p.info["name"] == "postgres" and p.info["cpu_times"] is not None:
            out["postgres"] += p.info["cpu_times"].user + p.info["cpu_times"].system
    return out


def broker_rss_mb(broker: Mosquitto) -> float:
    with contextlib.suppress(psutil.Error):
        if broker.proc is not None:
            rss: int = psutil.Process(broker.proc.pid).memory_info().rss
            return round(rss / 1e6, 1)
    return 0.0


class OfferCounter:
    """Every ``cmd/ota`` install offer to a rollout device, counted per device."""

    def __init__(self, port: int) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id="bench-offers", protocol=mqtt.MQTTv5
        )
        self.client.on_message = self._on_message
        done = threading.Event()
        self.client.on_subscribe = lambda *a: done.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe("edgefleet/v1/rollout/+/cmd/ota", qos=1)
        if not done.wait(30):
            raise RuntimeError("the offer counter could not subscribe")

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        body = json.loads(msg.payload)
        if body.get("action") == "install":
            with self.lock:
                self.counts[msg.topic.split("/")[3]] += 1

    def offers(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def stored_count(url: str) -> int:
    """Telemetry rows of the bench's device hosts (``d0-00000`` ...)."""
    with psycopg.connect(url) as db:
        row = db.execute(
            "SELECT count(*) FROM messages WHERE kind = 'telemetry' AND device LIKE 'd%%'"
        ).fetchone()
    return int(row[0]) if row else 0


def ready_probe(broker: Mosquitto, url: str) -> None:
    """Publish probe messages (device ``bench-probe``) until one is stored: then the ingest's
    shared subscription exists and nothing the devices send can miss it."""
    probe = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-probe", protocol=mqtt.MQTTv5)
    probe.connect(broker.host, broker.port)
    probe.loop_start()
    boot = uuid.uuid4().hex
    try:
        for seq in range(120):
            msg = TelemetryMsg(device="bench-probe", boot_id=boot, seq=seq, t_ns=time.time_ns(),
                               period_ns=1_000_000_000, keyframe=True, signals={})  # fmt: skip
            probe.publish(topic("bench", "bench-probe", "telemetry"), encode(msg), qos=1)
            time.sleep(0.5)
            with psycopg.connect(url) as db:
                row = db.execute(
                    "SELECT count(*) FROM messages WHERE device = 'bench-probe'"
                ).fetchone()
            if row and row[0]:
                return
        raise RuntimeError("fleet serve stored no probe message within 60 s")
    finally:
        probe.disconnect()
        probe.loop_stop()
