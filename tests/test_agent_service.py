"""The agent as a service: systemd notify, SIGTERM drain, gates under load, the health API.

Real parts only: the plant simulator's Modbus server and CAN bus, the committed model, a
real SQLite memory store, a real unix datagram socket as ``NOTIFY_SOCKET``, the agent's
own HTTP server. The one fake is a model wrapper that only delays or blocks ``predict``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from drivers.sim.server import PlantSimulator
from edge_agent.compose import build_agent
from edge_agent.config import AgentConfig, parse_config
from edge_agent.sdnotify import Notifier
from models import LoadedModel, ModelManifest
from tests.support.agent import Datagrams, Lines, example_text, notify_socket
from tests.support.ports import free_port

pytestmark = pytest.mark.peers

ROOT = Path(__file__).parents[1]


def write_config(tmp_path: Path, port: int, channel: str, extra: str = "") -> Path:
    text = example_text().replace("port = 15020", f"port = {port}")
    text = text.replace('channel = "edgefleet-demo"', f'channel = "{channel}"')
    text = text.replace(
        'dbc = "../drivers/sim/motor_drive.dbc"', f'dbc = "{ROOT}/drivers/sim/motor_drive.dbc"'
    )
    path = tmp_path / "agent.toml"
    path.write_text(text + extra)
    return path


# -- systemd: READY, WATCHDOG, STOPPING; SIGTERM drains within 5 s ------------------------------


@contextlib.contextmanager
def running_agent(cfg: Path, env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], Lines]]:
    """``edge-agent run --simulate --status-json`` on ``cfg``, its stderr read as it comes;
    killed on the way out if a failed assertion left it running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge_agent.cli", "run", "-c", str(cfg), "--simulate",
         "--status-json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        yield proc, Lines(proc.stderr)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def sigterm(proc: subprocess.Popen[str], log: Lines) -> tuple[float, str, str]:
    """SIGTERM to the agent; the seconds it took to exit, its stdout and its stderr."""
    assert proc.stdout is not None
    term = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    return time.monotonic() - term, proc.stdout.read(), log.text()


def test_sigterm_drains_within_5s_and_memory_keeps_every_decision(tmp_path: Path) -> None:
    port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    cfg = write_config(tmp_path, port, channel)
    env = {
        **os.environ,
        "NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
        "WATCHDOG_USEC": "1000000",  # ping every 0.5 s
    }
    with notify_socket(tmp_path) as notes:
        started = time.monotonic()
        with running_agent(cfg, env) as (proc, log):
            ready = notes.wait_for("READY=1", timeout=20)
            assert ready - started < 20
            # numba's kernels load after READY (edge_agent.warm): in a fresh checkout that
            # is a compile of a few seconds, with no disk cache yet.
            log.wait_for("features compiled (kernels loaded", timeout=60)
            # Pings only after READY, then about every 0.5 s while windows flow.
            time.sleep(max(0.0, ready + 3.0 - time.monotonic()))
            pings = notes.times_of("WATCHDOG=1", since=ready)
            assert len(pings) >= 4, notes.messages
            assert not notes.times_of("WATCHDOG=1", until=ready)
            took, out, err = sigterm(proc, log)
        assert proc.returncode == 0, err[-3000:]
        assert took < 5.0, f"shutdown took {took:.2f} s"
        notes.wait_for("STOPPING=1", timeout=1)
    status = json.loads(out)
    decisions = status["reasoning"]["decisions"]
    assert decisions >= 3
    # READY came before numba loaded; the kernels serve by the end.
    assert err.index("ready: ") < err.index("features compiled (kernels loaded"), err[-3000:]
    assert status["reasoning"]["model"]["jit"] is True
    assert decisions == status["windows"]  # no window dropped, none left behind
    db = Path(status["memory"]["db_path"])
    with sqlite3.connect(db) as con:
        stored = [row[0] for row in con.execute("SELECT window_seq FROM decisions ORDER BY id")]
        last_change = con.execute("SELECT max(t_ns) FROM changes").fetchone()[0]
    # Every decision reached the store, the last ones (made while draining) included.
    assert stored == list(range(1, decisions + 1))
    last = json.loads(
        sqlite3.connect(db)
        .execute("SELECT body FROM decisions ORDER BY id DESC LIMIT 1")
        .fetchone()[0]
    )
    last_end = last["window"]["start_ns"] + 63 * 10_000_000
    assert last_change >= last_end - 10_000_000


def test_sigterm_during_a_cold_kernel_compile_does_not_wait_for_it(tmp_path: Path) -> None:
    # An empty numba cache: the kernels compile after READY (~3 s of CPU) and the agent is
    # stopped during that compile. It drains on numpy and leaves; the compile is dropped.
    port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    cfg = write_config(tmp_path, port, channel)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    with running_agent(cfg, env) as (proc, log):
        log.wait_for("ready: ", timeout=20)
        time.sleep(0.3)
        took, out, err = sigterm(proc, log)
    assert proc.returncode == 0, err[-3000:]
    assert took < 5.0, f"shutdown took {took:.2f} s"
    assert "features compiled" not in err, "the compile finished first: the case was not run"
    status = json.loads(out)
    assert status["reasoning"]["model"]["jit"] is False
    assert status["reasoning"]["decisions"] == status["windows"]


# -- the watchdog stops when a stage stalls ------------------------------------------------------


class GatedModel:
    """The real model; ``predict`` blocks while ``hold`` is set or raises while ``fail`` is.

    The only fake here: it stands in for a stage that hangs or breaks.
    """

    def __init__(self, model: LoadedModel) -> None:
        self.inner = model
        self.block_s = 0.0
        self.fail = False

    @property
    def manifest(self) -> ModelManifest:
        return self.inner.manifest

    @property
    def sha256(self) -> str:
        return self.inner.sha256

    def predict(self, values: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        if self.block_s:
            block, self.block_s = self.block_s, 0.0
            time.sleep(block)  # a hung stage: it blocks the loop, as a real one would
        if self.fail:
            raise RuntimeError("stage broken on purpose")
        return self.inner.predict(values)


def hop_config(port: int, channel: str, hop: int, extra: str = "") -> AgentConfig:
    text = example_text().replace("port = 15020", f"port = {port}")
    text = text.replace('channel = "edgefleet-demo"', f'channel = "{channel}"')
    text = text.replace("# hop = 64 ", f"hop = {hop} #")
    if extra:
        text = text.replace("trip_after = 3 ", f"{extra} #")
    cfg = parse_config(text, base_dir=ROOT / "examples")
    assert cfg.perception.hop == hop
    return cfg


def test_watchdog_stops_while_a_stage_hangs_or_fails_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # ping every 0.2 s
    cfg = hop_config(port, channel, hop=8)
    marks: dict[str, float] = {}

    async def main(notes: Datagrams) -> dict[str, Any]:
        agent = build_agent(cfg)
        assert agent.stage is not None
        model = GatedModel(agent.stage.model)  # type: ignore[arg-type]
        agent.stage.swap_model(model)
        stop = asyncio.Event()

        async def script() -> None:
            await asyncio.to_thread(notes.wait_for, "READY=1", 20)
            await asyncio.sleep(2.0)
            marks["hang"] = time.monotonic()
            model.block_s = 2.0  # the next window hangs reasoning (and the loop) for 2 s
            await asyncio.sleep(0.5)
            marks["hang_end"] = marks["hang"] + 2.0
            await asyncio.sleep(max(0.0, marks["hang_end"] - time.monotonic()) + 1.5)
            marks["fail"] = time.monotonic()
            model.fail = True  # reasoning raises on every window; the loop keeps running
            await asyncio.sleep(2.0)
            model.fail = False
            marks["fail_end"] = time.monotonic()
            await asyncio.sleep(1.5)
            stop.set()

        async with (
            PlantSimulator(seed=3, modbus_port=port, can_channel=channel),
            asyncio.TaskGroup() as tg,
        ):
            tg.create_task(script())
            await agent.run(stop)
        return agent.status()

    with notify_socket(tmp_path) as notes:
        status = asyncio.run(main(notes))
        ready = notes.wait_for("READY=1", timeout=0)
    assert notes.times_of("WATCHDOG=1", since=ready, until=marks["hang"]), "no pings before"
    # While the stage hangs: nothing (allow the ping already in flight at the mark).
    assert not notes.times_of("WATCHDOG=1", since=marks["hang"] + 0.3, until=marks["hang_end"])
    # While it fails (the loop is alive): no ping, and a STATUS= naming reasoning.
    assert not notes.times_of("WATCHDOG=1", since=marks["fail"] + 0.6, until=marks["fail_end"])
    assert any(
        "reasoning" in m and m.startswith("STATUS=")
        for t, m in notes.messages
        if marks["fail"] <= t <= marks["fail_end"] + 0.5
    ), notes.messages
    # And it comes back.
    assert notes.times_of("WATCHDOG=1", since=marks["fail_end"] + 0.5)
    assert status["stages"]["reasoning"]["errors"] > 0


# -- gates under an artificially slow stage: overruns and skips are counted ------------------


def test_slow_reasoning_counts_overruns_and_drops_and_loses_no_window_silently() -> None:
    port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    # A window every 10 ms, a model that needs 15 ms, and a breaker that never degrades.
    cfg = hop_config(port, channel, hop=1, extra="trip_after = 10000")
    decided: list[int] = []

    async def main() -> dict[str, Any]:
        agent = build_agent(cfg, on_decision=lambda d: decided.append(d.window_seq))
        assert agent.stage is not None
        model = GatedModel(agent.stage.model)  # type: ignore[arg-type]
        slow = SlowPredict(model, delay_s=0.015)
        agent.stage.swap_model(slow)
        stop = asyncio.Event()
        async with PlantSimulator(seed=3, modbus_port=port, can_channel=channel):
            asyncio.get_running_loop().call_later(4.0, stop.set)
            await agent.run(stop)
        return agent.status()

    status = asyncio.run(main())
    gates = status["gates"]
    assert gates["stages"]["reasoning"]["overruns"] > 0, gates
    q = status["queues"]
    dropped = q["memory"]["dropped"] + q["reasoning"]["dropped"]
    assert dropped > 0
    # Every window is accounted for: decided, or dropped by the skip policy and counted.
    assert status["windows"] == len(decided) + dropped
    assert decided == sorted(decided)


class SlowPredict(GatedModel):
    def __init__(self, inner: GatedModel, delay_s: float) -> None:
        super().__init__(inner.inner)
        self.delay_s = delay_s

    def predict(self, values: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        time.sleep(self.delay_s)
        return self.inner.predict(values)


# -- the health API on a running agent ------------------------------------------------------------


def test_health_api_on_a_running_agent() -> None:
    port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    cfg = hop_config(port, channel, hop=16)

    async def main() -> tuple[dict[str, Any], dict[str, Any], str, dict[str, Any]]:
        agent = build_agent(cfg)
        stop = asyncio.Event()
        async with PlantSimulator(seed=3, modbus_port=port, can_channel=channel):
            task = asyncio.create_task(agent.run(stop))
            while agent.report.decisions < 3:  # noqa: ASYNC110 - polling the agent's counter
                await asyncio.sleep(0.05)
            base = f"http://127.0.0.1:{agent.api_port}"
            probe = {
                "sensor_id": "bench-probe",
                "timestamp_ns": time.time_ns(),
                "payload": {"current": 12.5, "voltage": 400.0},
            }
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{base}/v1/health", json=probe) as r:
                    assert r.status == 200
                    health = await r.json()
                async with http.post(f"{base}/v1/health", json={"payload": {}}) as r:
                    assert r.status == 400
                    bad = await r.json()
                async with http.get(f"{base}/v1/status") as r:
                    status = await r.json()
                async with http.get(f"{base}/metrics") as r:
                    metrics = await r.text()
            stop.set()
            await task
        return health, status, metrics, bad

    health, status, metrics, bad = asyncio.run(main())
    assert health["status"] in {"ok", "degraded"}
    assert set(health["stage_latency_ms"]) == {"perception", "memory", "reasoning"}
    assert all(v > 0 for v in health["stage_latency_ms"].values())
    assert bad["error"]
    assert status["agent"]["device"] == "demo-gw-01"
    assert len(status["reasoning"]["model"]["sha256"]) == 64
    assert status["gates"]["stages"]["perception"]["runs"] > 0
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    e2e = families["edgefleet_e2e_latency_seconds"]
    count = [s.value for s in e2e.samples if s.name.endswith("_count")]
    assert count
    assert count[0] >= 3


# -- a task crashing still drains what the agent accepted ---------------------------------------


class NotifierBreaking(Notifier):
    """systemd's notifier (disabled) whose watchdog ping raises once ``after_s`` passed: a
    stand-in for any agent task crashing, the TaskGroup then cancelling all the others."""

    def __init__(self, after_s: float) -> None:
        super().__init__(None)
        self.at = time.monotonic() + after_s

    def watchdog(self) -> bool:
        if time.monotonic() >= self.at:
            raise RuntimeError("watchdog task broken on purpose")
        return super().watchdog()


def test_a_crashing_task_still_drains_into_the_outbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # the watchdog task runs every 0.2 s
    # The uplink on (no broker: everything stays in the outbox) with a period that never
    # closes while the test runs: only the shutdown drain can write telemetry.
    text = example_text().replace("port = 15020", f"port = {port}")
    text = text.replace('channel = "edgefleet-demo"', f'channel = "{channel}"')
    text = text.replace("# hop = 64 ", "hop = 8 #")
    text = text.replace("enabled = false                # the demo runs", "enabled = true #")
    text = text.replace("port = 1883", f"port = {free_port()}")
    period_ns = 3_600_000 * 1_000_000
    text = text.replace("telemetry_period_ms = 1000 ", "telemetry_period_ms = 3600000 ")
    cfg = parse_config(text, base_dir=ROOT / "examples")
    assert cfg.uplink.enabled
    agent = build_agent(cfg, notifier=NotifierBreaking(after_s=2.0))
    assert agent.uplink is not None
    outbox = agent.uplink.outbox.path

    async def main() -> None:
        stop = asyncio.Event()
        async with PlantSimulator(seed=3, modbus_port=port, can_channel=channel):
            asyncio.get_running_loop().call_later(10.0, stop.set)
            with pytest.RaisesGroup(RuntimeError):
                await agent.run(stop)
            assert not stop.is_set(), "the crash, not the stop, ended the run"

    t0 = time.time_ns()
    asyncio.run(main())
    # Periods are anchored at multiples of the period in UNIX time: a run that crosses
    # the top of an hour closes one period on the way (CI once crossed a boundary).
    crossed = time.time_ns() // period_ns - t0 // period_ns
    assert agent.report.windows >= 3
    assert agent.report.decisions == agent.report.windows
    with sqlite3.connect(outbox) as con:
        kinds = dict(con.execute("SELECT kind, count(*) FROM outbox GROUP BY kind").fetchall())
    # The open telemetry period and every decision reached the outbox on the way down.
    assert 1 <= kinds.get("telemetry", 0) <= 1 + crossed, (kinds, crossed)
    assert kinds.get("decision") == agent.report.decisions, kinds
