"""The health API over real HTTP: a real aiohttp server on 127.0.0.1, port 0, real stages.

The view is this test's own harness (:class:`PipelineView`): real perception windows of the
simulated plant, a real MemoryStage on a tmp_path store and a ReasoningStage with the
committed model, wired the way the agent wires them, plus a status shaped like
``Agent.status()``. It is not a stand-in for our code: every stage it calls is the real one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from drivers.sim.plant import SIGNALS, parse_anomaly
from edge_agent.api import ApiSection, HealthApi, jsonable
from edge_agent.memory import MemoryStage
from edge_agent.metrics import AgentMetrics
from edge_agent.perception import Window
from edge_agent.probe import Probe, ProbeResult, run_probe
from edge_agent.reasoning import ReasoningStage
from edge_agent.rules import RuleSet
from edge_agent.simwindows import T0_NS, plant_windows
from models import LoadedModel, load_model
from tests.support.memory import config
from tests.support.probe import MALFORMED, SPEC, body, good

pytestmark = pytest.mark.peers

MS = 1_000_000


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def windows() -> list[Window]:
    spike = parse_anomaly("spike:current@4+2x20")
    return list(plant_windows(seed=4, anomalies=[spike], seconds=10, spec=SPEC))


class PipelineView:
    """The test's agent: real stages behind the :class:`~edge_agent.api.AgentView` protocol."""

    def __init__(self, memory: MemoryStage, reasoning: ReasoningStage) -> None:
        self.memory = memory
        self.reasoning = reasoning
        self.metrics = AgentMetrics()
        self.metrics.register_status(self.status)
        self.last: Window | None = None
        self.windows = 0
        self.fail: Exception | None = None

    @property
    def signals(self) -> Sequence[str]:
        return SPEC.signals

    def decide(self, w: Window, perception_ms: float = 0.2) -> None:
        """One window through memory and reasoning, as the agent's gates run them."""
        ctx = self.memory.process(w, now_ns=w.end_ns)
        d = self.reasoning.process(w, w.end_ns + 25 * MS, perception_ms, ctx.latency_ms)
        self.memory.record_decision(d, now_ns=d.t_ns, window_seq=d.window_seq)
        self.metrics.observe_decision(d.stage_latency_ms, 0.004, d.label)
        self.metrics.observe_gate("compute", 20e-6)
        self.last = w
        self.windows += 1

    def probe(self, probe: Probe) -> ProbeResult:
        if self.fail is not None:
            raise self.fail
        return run_probe(
            probe,
            spec=SPEC,
            last=self.last,
            memory=self.memory,
            reasoning=self.reasoning,
            now_ns=probe.timestamp_ns,
        )

    def health_status(self) -> str:
        return "degraded" if self.reasoning.breaker.mode != "full" else "ok"

    async def ota_request(self, action: str, arg: str) -> tuple[int, Mapping[str, Any]]:
        # This view has no updater; the agent's own OTA path is tested in test_ota_agent.
        return 409, {"result": "failed", "reason": f"no OTA here ({action} {arg})"}

    def status(self) -> Mapping[str, Any]:
        return {
            "agent": {"version": "test", "loop": "asyncio", "uptime_s": 1.5, "health": "ok"},
            "windows": self.windows,
            "mean_completeness": math.nan,  # before any window; must reach JSON as null
            "buffer": {"depth": 3, "max": 65536, "dropped": 0, "high_water": 40},
            "perception": {"late_dropped": 2, "unknown_signal": 0, "windows_skipped": 0},
            "queues": {"reasoning": {"depth": 0, "max": 2, "dropped": 0, "high_water": 1}},
            "reasoning": {"enabled": True, **self.reasoning.snapshot()},
            "memory": self.memory.stats(),
            "gates": {
                "entries": {"compute": {"openings": self.windows, "missed": 0}},
                "stages": {"reasoning": {"runs": self.windows, "overruns": 0}},
            },
            "latency_us": {"e2e": {"p50": 4000.0, "p99": 4100.0, "p999": 4200.0, "max": 4300.0}},
            "sources": {
                "plc": {"state": "open", "bus_errors": 1, "restarts": 0},
                "drive": {"connected": 0, "timeouts": 4, "errors": 1, "restarts": 2},
            },
        }


async def serving(
    tmp_path: Path, model: LoadedModel, **section: Any
) -> AsyncIterator[tuple[PipelineView, str, aiohttp.ClientSession]]:
    memory = MemoryStage(config(), SIGNALS, state_dir=tmp_path, clock_ns=lambda: T0_NS)
    view = PipelineView(memory, ReasoningStage(model, RuleSet(), perception=SPEC))
    async with (
        memory,
        HealthApi(view, ApiSection(port=0, **section)) as api,
        aiohttp.ClientSession() as http,
    ):
        assert api.port > 0
        yield view, f"http://127.0.0.1:{api.port}", http


def strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in JSON")

    return json.loads(text, parse_constant=refuse)


def test_health_probe_runs_through_the_stages(
    tmp_path: Path, model: LoadedModel, windows: list[Window]
) -> None:
    async def main() -> None:
        async for view, url, http in serving(tmp_path, model):
            # Before any window: no history, still an answer from every stage.
            async with http.post(f"{url}/v1/health", data=body(good())) as r:
                assert r.status == 200, await r.text()
                first = strict_json(await r.text())
            for w in windows[:4]:
                view.decide(w)
            rows = view.memory.stats()["rows"]
            probe = good(timestamp_ns=windows[3].end_ns + 4 * MS, payload={"speed": 931.5})
            async with http.post(f"{url}/v1/health", data=body(probe)) as r:
                assert r.status == 200, await r.text()
                assert r.content_type == "application/json"
                doc = strict_json(await r.text())
            for answer in (first, doc):
                assert {"status", "sensor_id", "label", "score", "stage_latency_ms"} <= set(answer)
                assert answer["status"] == "ok"
                assert answer["sensor_id"] == "line-3/probe"
                assert answer["label"] in model.manifest.labels
                assert 0.0 <= answer["score"] <= 1.0
                lat = answer["stage_latency_ms"]
                assert set(lat) == {"perception", "memory", "reasoning"}
                assert all(v > 0 for v in lat.values()), lat
            assert doc["stale"] == []
            assert first["stale"] == [s for s in SIGNALS if s not in ("current", "speed")]
            # The probe went through memory without being stored.
            assert view.memory.stats()["rows"] == rows
            assert view.reasoning.stats.decisions == 4

    asyncio.run(main())


def test_malformed_probes_get_400_with_the_reason(tmp_path: Path, model: LoadedModel) -> None:
    async def main() -> None:
        async for view, url, http in serving(tmp_path, model):
            for name, raw, where, what in MALFORMED:
                async with http.post(f"{url}/v1/health", data=raw) as r:
                    assert r.status == 400, name
                    doc = strict_json(await r.text())
                assert doc["where"] == where, name
                assert what in doc["error"], (name, doc)
            # None of them reached the stages.
            assert view.memory.stats()["windows"] == 0

    asyncio.run(main())


def test_oversize_body_is_413(tmp_path: Path, model: LoadedModel) -> None:
    async def chunks(n: int) -> AsyncIterator[bytes]:
        for _ in range(n):
            yield b" " * 1000

    async def main() -> None:
        async for _view, url, http in serving(tmp_path, model, max_body_bytes=4096):
            padded = body(good()) + b" " * 4096  # valid JSON, but over the cap
            async with http.post(f"{url}/v1/health", data=padded) as r:
                assert r.status == 413
                doc = strict_json(await r.text())
                assert doc == {
                    "error": f"body is {len(padded)} bytes; at most 4096",
                    "where": "body",
                }
            # No Content-Length (chunked): refused while reading.
            async with http.post(f"{url}/v1/health", data=chunks(8)) as r:
                assert r.status == 413
                assert "over 4096 bytes" in strict_json(await r.text())["error"]
            # Exactly at the cap is fine.
            exact = body(good())
            exact += b" " * (4096 - len(exact))
            async with http.post(f"{url}/v1/health", data=exact) as r:
                assert r.status == 200, await r.text()
        # The default cap (64 KiB).
        async for _view, url, http in serving(tmp_path / "b", model):
            async with http.post(f"{url}/v1/health", data=b"{" + b" " * 65536 + b"}") as r:
                assert r.status == 413

    asyncio.run(main())


def test_a_failing_probe_is_500_and_the_server_carries_on(
    tmp_path: Path, model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async for view, url, http in serving(tmp_path, model):
            view.fail = RuntimeError("the model file vanished")
            async with http.post(f"{url}/v1/health", data=body(good())) as r:
                assert r.status == 500
                doc = strict_json(await r.text())
                assert doc["error"] == "probe failed: RuntimeError: the model file vanished"
            view.fail = None
            async with http.post(f"{url}/v1/health", data=body(good())) as r:
                assert r.status == 200
            async with http.get(f"{url}/v1/nothing") as r:
                assert r.status == 404

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert any("health probe from line-3/probe failed" in r.message for r in caplog.records)
    # Access log off by default: no line per request.
    assert not [r for r in caplog.records if r.name in ("aiohttp.access", "edge_agent.api.access")]


def test_status_is_json_with_nan_as_null(
    tmp_path: Path, model: LoadedModel, windows: list[Window]
) -> None:
    async def main() -> None:
        async for view, url, http in serving(tmp_path, model):
            for w in windows[:3]:
                view.decide(w)
            async with http.get(f"{url}/v1/status") as r:
                assert r.status == 200
                assert r.content_type == "application/json"
                doc = strict_json(await r.text())
            assert doc["windows"] == 3
            assert doc["mean_completeness"] is None
            assert doc["reasoning"]["decisions"] == 3
            assert doc["reasoning"]["model"]["sha256"] == model.sha256
            assert doc["memory"]["windows"] == 3

    asyncio.run(main())


def scrape(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    for fam in families.values():
        for s in fam.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {sample}{labels}")


def test_metrics_scrape_has_histograms_and_status_counters(
    tmp_path: Path, model: LoadedModel, windows: list[Window]
) -> None:
    async def get(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
        async with http.get(f"{url}/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=")
            text = await r.text()
        names = [f.name for f in text_string_to_metric_families(text)]
        assert len(names) == len(set(names)), "a family exported twice"
        return scrape(text)

    async def main() -> None:
        async for view, url, http in serving(tmp_path, model):
            for w in windows[:2]:
                view.decide(w)
            before = await get(http, url)
            for w in windows[2:]:
                view.decide(w)
            after = await get(http, url)
        n = len(windows) - 2
        for fam, kind in (
            ("edgefleet_stage_latency_seconds", "histogram"),
            ("edgefleet_e2e_latency_seconds", "histogram"),
            ("edgefleet_gate_lateness_seconds", "histogram"),
            ("edgefleet_windows", "counter"),
            ("edgefleet_decisions", "counter"),
            ("edgefleet_drops", "counter"),
            ("edgefleet_gate_openings", "counter"),
            ("edgefleet_source_errors", "counter"),
            ("edgefleet_source_up", "gauge"),
            ("edgefleet_queue_depth", "gauge"),
            ("edgefleet_breaker_open", "gauge"),
        ):
            assert after[fam].type == kind, fam
        # Live histograms: one observation per stage and window.
        for stage in ("perception", "memory", "reasoning"):
            key = "edgefleet_stage_latency_seconds_count"
            assert value(after, key, stage=stage) - value(before, key, stage=stage) == n
        assert value(after, "edgefleet_e2e_latency_seconds_count") == len(windows)
        assert value(after, "edgefleet_e2e_latency_seconds_bucket", le="0.00316") == 0
        assert value(after, "edgefleet_e2e_latency_seconds_bucket", le="0.00562") == len(windows)
        lateness = "edgefleet_gate_lateness_seconds_count"
        assert value(after, lateness, entry="compute") == len(windows)
        # Status counters, read at scrape time.
        assert value(before, "edgefleet_windows_total") == 2
        assert value(after, "edgefleet_windows_total") == len(windows)
        decided = sum(s.value for s in after["edgefleet_decisions"].samples)
        assert decided == len(windows)
        labels = {s.labels["label"] for s in after["edgefleet_decisions"].samples}
        assert "spike" in labels  # the anomaly
        assert value(after, "edgefleet_drops_total", where="late") == 2
        assert value(after, "edgefleet_memory_rows_total") > value(
            before, "edgefleet_memory_rows_total"
        )
        assert value(after, "edgefleet_source_errors_total", source="drive") == 5
        assert value(after, "edgefleet_source_up", source="plc") == 1
        assert value(after, "edgefleet_source_up", source="drive") == 0
        assert value(after, "edgefleet_source_restarts_total", source="drive") == 2
        assert value(after, "edgefleet_gate_openings_total", entry="compute") == len(windows)
        assert value(after, "edgefleet_recent_latency_seconds", stage="e2e", quantile="0.99") == (
            pytest.approx(4100e-6)
        )
        assert value(after, "edgefleet_model_info", sha256=model.sha256) == 1
        assert value(after, "edgefleet_breaker_open") == 0
        assert value(after, "edgefleet_reasoning_mode", mode="full") == 1
        assert value(after, "edgefleet_queue_capacity", queue="buffer") == 65536
        # Families the status does not have are absent, not zero.
        assert "edgefleet_memory_store_bytes" not in after
        assert "edgefleet_gate_missed" in after

    asyncio.run(main())


def test_metrics_survive_any_status_shape() -> None:
    calls = {"n": 0}

    def status() -> Mapping[str, Any]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("reasoning")
        return {
            "windows": "many",  # not a number: left out
            "reasoning": {"labels": {"normal": 3, "spike": math.nan}, "breaker": []},
            "buffer": None,
            "sources": {"x": "not a mapping", "y": {"up": True}},
            "memory": {"store": {"db_bytes": 4096}, "dropped_windows": 1},
        }

    m = AgentMetrics()
    m.register_status(status)
    for _ in range(3):
        raw, content_type = m.render()
        fams = scrape(raw.decode())
        assert content_type.startswith("text/plain")
        assert "edgefleet_stage_latency_seconds" in fams
    assert calls["n"] == 3
    assert value(fams, "edgefleet_status_errors_total") == 1
    assert "edgefleet_windows" not in fams
    assert [s.labels["label"] for s in fams["edgefleet_decisions"].samples] == ["normal"]
    assert value(fams, "edgefleet_source_up", source="y") == 1
    assert value(fams, "edgefleet_memory_store_bytes", kind="db") == 4096
    assert value(fams, "edgefleet_drops_total", where="memory") == 1
    # A second status source replaces the first rather than export every family twice.
    m.register_status(lambda: {"windows": 7})
    fams = scrape(m.render()[0].decode())
    assert value(fams, "edgefleet_windows_total") == 7
    # Two agents in one process: separate registries.
    other = AgentMetrics()
    other.observe_decision({"perception": 1.0, "memory": 0.0, "reasoning": 0.05}, 0.01, "normal")
    fams = scrape(other.render()[0].decode())
    assert value(fams, "edgefleet_stage_latency_seconds_count", stage="perception") == 1
    # A stage at 0.0 ms did not run: not observed.
    assert value(fams, "edgefleet_stage_latency_seconds_count", stage="memory") == 0
    assert value(fams, "edgefleet_last_decision_label", label="normal") == 1
    assert value(scrape(m.render()[0].decode()), "edgefleet_e2e_latency_seconds_count") == 0


def test_port_zero_stop_and_disabled(tmp_path: Path, model: LoadedModel) -> None:
    async def main() -> None:
        memory = MemoryStage(config(enabled=False), SIGNALS, state_dir=tmp_path)
        view = PipelineView(memory, ReasoningStage(model, RuleSet(), perception=SPEC))
        api = HealthApi(view, ApiSection(port=0))
        await api.start()
        port = api.port
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/v1/status") as r:
                assert r.status == 200
            await api.stop()
            await api.stop()  # idempotent
            with pytest.raises(RuntimeError, match="not listening"):
                _ = api.port
            with pytest.raises(aiohttp.ClientConnectionError):
                await http.get(f"http://127.0.0.1:{port}/v1/status")
        off = HealthApi(view, ApiSection(enabled=False, port=0))
        async with off:
            with pytest.raises(RuntimeError):
                _ = off.port

    asyncio.run(main())


def test_api_section_is_strict() -> None:
    assert ApiSection() == ApiSection(
        enabled=True, host="127.0.0.1", port=8080, max_body_bytes=65536, access_log=False
    )
    for bad in (
        {"port": "8080"},
        {"port": 65536},
        {"port": -1},
        {"max_body_bytes": 10},
        {"tls": 1},
    ):
        with pytest.raises(pydantic.ValidationError):
            ApiSection(**bad)
    with pytest.raises(pydantic.ValidationError):
        ApiSection().port = 1


def test_jsonable_makes_strict_json() -> None:
    doc = jsonable({"a": math.inf, 1: (np.float32(np.nan), np.int64(3)), "p": Path("/x")})
    assert doc == {"a": None, "1": [None, 3], "p": "/x"}
    assert json.dumps(doc, allow_nan=False)
    assert jsonable(Probe("s", T0_NS, {"x": 1.0})).startswith("Probe(")
