"""Out of distribution and alarm storms at run time (issue 20, item 2).

The monitors are pure and take the window's time (an injected clock: no sleeping); the
stage runs the committed model on the simulator's windows through real perception; the
agent runs against the simulator's real Modbus server and CAN bus, with its memory store.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from drivers.sim.plant import Anomaly
from drivers.sim.server import PlantSimulator
from edge_agent.compose import build_agent
from edge_agent.config import parse_config
from edge_agent.memory.store import MemoryStore
from edge_agent.ood import (
    OOD,
    OOD_HORIZON_S,
    STORM,
    HealthSpec,
    Notice,
    OodMonitor,
    ShareWindow,
    StormMonitor,
)
from edge_agent.perception import Window
from edge_agent.reasoning import ReasoningStage
from edge_agent.rules import Decision, RuleSet
from edge_agent.simwindows import T0_NS, plant_windows
from fleet.ingest import IngestConfig, IngestWorker
from fleet.store import open_store
from models import LoadedModel, load_model
from models.acquisition import Acquisition, SignalAcquisition
from models.dataset import SIGNALS
from tests.support.agent import EXAMPLES, example_config, example_text
from tests.support.mosquitto import mosquitto
from tests.support.ports import free_port
from wire.messages import DecisionMsg, StateMsg, decode, encode

pytestmark = pytest.mark.peers

#: The agent's window period at 100 Hz / 64 steps, ns.
HOP_NS = 640_000_000


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return load_model()


def windows_at(n: int, start_ns: int = 0) -> Iterator[int]:
    return (start_ns + k * HOP_NS for k in range(n))


# -- the monitors, pure ------------------------------------------------------------------------


def test_a_share_window_counts_the_horizon_only() -> None:
    w = ShareWindow(horizon_ns=10 * HOP_NS, bits=3)
    for k, t in enumerate(windows_at(10)):
        w.push(t, 0b101 if k < 4 else 0b001)
    assert (w.share(0), w.share(1), w.share(2)) == (1.0, 0.0, 0.4)
    assert not w.covered(9 * HOP_NS)
    assert w.covered(10 * HOP_NS)
    for t in windows_at(10, 10 * HOP_NS):
        w.push(t, 0)
    assert w.quiet
    assert w.share(0) == 0.0


def test_ood_is_raised_once_after_the_horizon_and_clears_with_hysteresis() -> None:
    """A signal out on every window: nothing until a whole horizon has been watched and
    60 % of it was out; one notice naming it; back only at 20 % or less."""
    mon = OodMonitor(("a", "b"))
    notices: list[Notice] = []
    horizon = round(OOD_HORIZON_S * 1e9)
    times = list(windows_at(200))
    for t in times[:120]:
        n = mon.update(t, 0b10, lambda i: f"why {i}")
        if n is not None:
            notices.append(n)
    (raised,) = notices
    assert (raised.kind, raised.state, raised.signals) == (OOD, "raised", ("b",))
    assert raised.reason == "b: why 1"
    assert raised.t_ns >= horizon  # not before a whole horizon was watched
    assert raised.t_ns - horizon < 2 * HOP_NS
    assert mon.active == ("b",)
    assert mon.snapshot()["why"] == {"b": "why 1"}
    # Back in: it stays out while more than 20 % of the horizon was out.
    for t in times[120:]:
        n = mon.update(t, 0)
        if n is not None:
            notices.append(n)
    cleared = notices[-1]
    assert (cleared.state, cleared.signals) == ("cleared", ())
    back_after_s = (cleared.t_ns - times[119]) / 1e9
    assert 0.8 * OOD_HORIZON_S - 1 <= back_after_s <= 0.8 * OOD_HORIZON_S + 1
    assert len(notices) == 2
    assert mon.events == 1


def test_a_fault_as_long_as_the_trained_ones_is_not_out_of_distribution() -> None:
    """Training anomalies last at most 10 s: 10 s flagged inside a 30 s horizon is a third."""
    mon = OodMonitor(("a",))
    fault = range(int(40e9 / HOP_NS), int(50e9 / HOP_NS))
    for k, t in enumerate(windows_at(300)):
        assert mon.update(t, 1 if k in fault else 0) is None


def test_an_alarm_storm_is_raised_once_and_clears() -> None:
    mon = StormMonitor()
    notices = []
    for k, t in enumerate(windows_at(400)):
        n = mon.update(t, k < 200, "stuck")
        if n is not None:
            notices.append(n)
    raised, cleared = notices
    assert (raised.kind, raised.state) == (STORM, "raised")
    assert "100% of the windows of the last 60 s (latest: stuck)" in raised.reason
    assert cleared.state == "cleared"
    assert mon.events == 1
    # Alarms on a quarter of the windows: never a storm.
    quarter = StormMonitor()
    assert all(quarter.update(t, k % 4 == 0) is None for k, t in enumerate(windows_at(400)))


# -- the stage, on the simulator's windows -------------------------------------------------------


def run(stage: ReasoningStage, windows: Iterator[Window]) -> list[Decision]:
    return [stage.process(w, w.end_ns) for w in windows]


def notices(decisions: list[Decision]) -> list[tuple[float, str, str, tuple[str, ...]]]:
    return [
        ((d.window_start_ns - T0_NS) / 1e9, n.kind, n.state, n.signals)
        for d in decisions
        for n in d.notices
    ]


def test_a_sensor_stuck_for_long_is_out_of_distribution_then_back(model: LoadedModel) -> None:
    """Current frozen for 90 s: the model says stuck (the alarm is raised: a stuck sensor
    is what it was trained for); once current has been outside its training ranges for
    most of 30 s, one notice names it, every decision is marked, the model's alarm clears
    and none is raised while it lasts; after the sensor thaws it clears by itself. The
    model alarmed on every window meanwhile: an alarm storm, reported too."""
    stage = ReasoningStage(model, RuleSet())
    stuck = Anomaly("stuck", "current", 40.0, 90.0)
    decisions = run(stage, plant_windows(seed=5, anomalies=[stuck], start_s=20, seconds=190))
    got = notices(decisions)
    assert [(kind, state) for _, kind, state, _ in got] == [
        (OOD, "raised"),
        (STORM, "raised"),
        (OOD, "cleared"),
        (STORM, "cleared"),
    ], got
    t_raised, _, _, signals = got[0]
    assert signals == ("current",)
    assert 40 + 0.6 * OOD_HORIZON_S - 2 <= t_raised <= 40 + 0.6 * OOD_HORIZON_S + 2
    t_back = got[2][0]
    assert 130 < t_back < 130 + OOD_HORIZON_S
    during = [d for d in decisions if t_raised < (d.window_start_ns - T0_NS) / 1e9 < t_back]
    assert during
    assert all(d.ood == ("current",) for d in during)
    assert all(d.label == "normal" and not d.raised for d in during)
    assert all(any(r.rule == "model_out_of_distribution" for r in d.rules_fired) for d in during)
    # The stuck alarm came up before (the model is right about a stuck sensor), and went
    # down once its inputs were declared out of distribution.
    raised_at = [(d.window_start_ns - T0_NS) / 1e9 for d in decisions if "stuck" in d.raised]
    cleared_at = [(d.window_start_ns - T0_NS) / 1e9 for d in decisions if "stuck" in d.cleared]
    assert raised_at
    assert 40 <= raised_at[0] < t_raised
    assert cleared_at
    assert t_raised <= cleared_at[0] < t_raised + 5
    after = [d for d in decisions if (d.window_start_ns - T0_NS) / 1e9 > t_back]
    assert not any(d.ood for d in after)
    health: Any = stage.snapshot()["model_health"]
    assert health["ood"]["events"] == 1
    assert health["ood"]["masked_alarm_windows"] > 10
    # The decision that raised it, on the wire: the notice and the mark.
    onset = next(d for d in decisions if d.notices)
    body: Any = onset.to_json()
    assert body["ood"] == ["current"]
    assert body["notices"][0]["kind"] == OOD
    assert "current: repeats on 100% of steps" in body["notices"][0]["reason"]
    msg = decode("decision", encode(_decision_msg(body)))
    assert isinstance(msg, DecisionMsg)
    assert msg.ood == ["current"]


def _decision_msg(body: dict[str, object]) -> DecisionMsg:
    import msgspec  # noqa: PLC0415

    return msgspec.convert({**body, "device": "gw", "boot_id": "0" * 32, "seq": 1}, DecisionMsg)


def test_a_stretch_that_alarms_continuously_is_a_storm(model: LoadedModel) -> None:
    """Every signal polled over Modbus at 100 ms (the issue's finding, run anyway): the
    model says stuck on every window. Both notices come, once each."""
    profile = Acquisition(
        "modbus 100 ms",
        {
            s: SignalAcquisition("modbus block", 100.0, 0.01, jitter_ms=1.0, synced=False)
            for s in SIGNALS
        },
    )
    stage = ReasoningStage(model, RuleSet())
    decisions = run(stage, plant_windows(seed=6, seconds=100, acquisition=profile))
    kinds = [(kind, state) for _, kind, state, _ in notices(decisions)]
    assert kinds == [(OOD, "raised"), (STORM, "raised")], kinds
    storm_at = next(t for t, kind, _, _ in notices(decisions) if kind == STORM)
    assert storm_at >= 60.0  # a whole 60 s horizon first
    assert decisions[-1].alarm_storm
    assert decisions[-1].to_json()["alarm_storm"] is True
    health: Any = stage.snapshot()["model_health"]
    assert health["alarm_storm"]["share"] > 0.9


def test_normal_running_raises_no_notice(model: LoadedModel) -> None:
    stage = ReasoningStage(model, RuleSet())
    decisions = run(stage, plant_windows(seed=7, seconds=180))
    assert notices(decisions) == []
    assert not any(d.ood or d.alarm_storm for d in decisions)
    assert all("ood" not in d.to_json() for d in decisions)


# -- the agent ---------------------------------------------------------------------------------


def test_the_agent_reports_ood_in_status_metrics_memory_and_state(model: LoadedModel) -> None:
    """The real agent against the simulator, current frozen for 8 s, with the horizons
    shortened to 3 s so the whole episode fits in seconds: while it lasts /v1/status,
    /metrics and the retained state say so, and the agent is degraded; one memory event
    each way; then it clears by itself. (The model alarms on the frozen sensor all along:
    with a 3 s horizon that is a storm too, reported and cleared the same way.)"""
    port, channel = free_port(), f"ood-{uuid.uuid4().hex[:8]}"
    cfg = example_config(port, channel)
    decisions: list[Decision] = []
    seen: dict[str, object] = {}
    short = HealthSpec(ood_horizon_s=3.0, storm_horizon_s=3.0)

    async def main() -> dict[str, object]:
        agent = build_agent(cfg, on_decision=decisions.append)
        assert agent.stage is not None
        agent.stage.health_spec = short
        agent.stage.health = agent.stage.new_health()
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                health = agent.status()["reasoning"]["model_health"]
                if health["ood"]["active"] and "status" not in seen:
                    seen["status"] = health
                    seen["metrics"] = agent.metrics.render()[0].decode()
                    seen["state"] = agent.model_health()
                calm = not (health["ood"]["active"] or health["alarm_storm"]["active"])
                if "status" in seen and calm:
                    seen["after"] = agent.status()["agent"]["health"]
                    stop.set()
                await asyncio.sleep(0.05)

        loop = asyncio.get_running_loop()
        loop.call_later(40.0, stop.set)  # a bound, not a timing: the episode ends by itself
        async with (
            PlantSimulator(
                seed=3,
                modbus_port=port,
                can_channel=channel,
                anomalies=[Anomaly("stuck", "current", 3.0, 8.0)],
            ),
            asyncio.TaskGroup() as tg,
        ):
            tg.create_task(watch())
            await agent.run(stop)
        return agent.status()

    final: Any = asyncio.run(main())
    assert "status" in seen, "never out of distribution"
    status = seen["status"]
    assert isinstance(status, dict)
    assert status["ood"]["signals"] == ["current"]
    metrics = str(seen["metrics"])
    assert "edgefleet_model_out_of_distribution 1.0" in metrics
    assert 'edgefleet_model_input_flagged_share{signal="current"}' in metrics
    assert "edgefleet_healthy 0.0" in metrics
    assert isinstance(seen["state"], dict)
    assert seen["state"]["ood"] == ["current"]
    state = _state_msg(seen["state"])
    assert state.model_health.ood == ["current"]  # type: ignore[union-attr]
    assert seen.get("after") == "ok"
    got = [(n.kind, n.state) for d in decisions for n in d.notices]
    assert [g for g in got if g[0] == OOD] == [(OOD, "raised"), (OOD, "cleared")]
    assert [g for g in got if g[0] == STORM] == [(STORM, "raised"), (STORM, "cleared")]
    assert final["reasoning"]["model_health"]["ood"]["events"] == 1
    store = MemoryStore.open_readonly(cfg.state_dir / cfg.memory.path)
    try:
        events = [(k, s, json.loads(d or "{}")) for _, k, s, d in store.events(0, 2**62)]
    finally:
        store.conn.close()
    ood_events = [e for e in events if e[0].startswith(OOD)]
    assert [k for k, _, _ in ood_events] == [OOD, f"{OOD}_cleared"]
    assert ood_events[0][1] == "current"
    assert ood_events[0][2]["signals"] == ["current"]


def _state_msg(health: object) -> StateMsg:
    import msgspec  # noqa: PLC0415

    fields = {
        "device": "gw",
        "boot_id": "0" * 32,
        "seq": 0,
        "t_ns": 1,
        "state": "online",
        "site": "s",
        "model_health": health,
    }
    msg = decode("state", encode(msgspec.convert(fields, StateMsg)))
    assert isinstance(msg, StateMsg)
    return msg


def test_the_fleet_device_record_follows_the_model_health(tmp_path: Path) -> None:
    """Agent -> Mosquitto -> fleet ingest -> store: while current is frozen (3 s horizons
    again) the fleet's record of the device says which input is out of distribution, and
    its decisions carry the notice; afterwards the record is clean again."""
    port, channel = free_port(), f"oodf-{uuid.uuid4().hex[:8]}"
    store_url = f"sqlite://{tmp_path / 'fleet.db'}"
    seen: list[dict[str, object]] = []
    with mosquitto(tmp_path / "broker") as broker:
        text = example_text().replace("port = 15020", f"port = {port}")
        text = text.replace('channel = "edgefleet-demo"', f'channel = "{channel}"')
        text = text.replace("enabled = false                # the demo", "enabled = true #")
        text = text.replace("port = 1883", f"port = {broker.port}")
        cfg = parse_config(text, base_dir=EXAMPLES)
        worker = IngestWorker(
            IngestConfig(store_url=store_url, broker_port=broker.port, client_id="ingest-ood")
        )
        worker.start()
        try:

            async def main() -> None:
                agent = build_agent(cfg)
                assert agent.stage is not None
                agent.stage.health_spec = HealthSpec(ood_horizon_s=3.0, storm_horizon_s=3.0)
                agent.stage.health = agent.stage.new_health()
                stop = asyncio.Event()

                async def watch() -> None:
                    store = open_store(store_url)
                    try:
                        while not stop.is_set():
                            info = store.device(cfg.agent.device)
                            health = info.model_health if info is not None else {}
                            if health or seen:
                                seen.append(dict(health))
                            if seen and not health:
                                stop.set()
                            await asyncio.sleep(0.1)
                    finally:
                        store.close()

                asyncio.get_running_loop().call_later(40.0, stop.set)  # a bound only
                anomaly = Anomaly("stuck", "current", 3.0, 8.0)
                async with (
                    PlantSimulator(
                        seed=3, modbus_port=port, can_channel=channel, anomalies=[anomaly]
                    ),
                    asyncio.TaskGroup() as tg,
                ):
                    tg.create_task(watch())
                    await agent.run(stop)

            asyncio.run(main())
        finally:
            worker.stop()
    assert seen, "the fleet's record never showed the model's health"
    assert any(h.get("ood") == ["current"] for h in seen), seen
    assert seen[-1] == {}
    store = open_store(store_url)
    try:
        bodies = [json.loads(body) for _, _, _, body in store.decisions(limit=1000)]
    finally:
        store.close()
    raised = [n for b in bodies for n in b.get("notices", []) if n["state"] == "raised"]
    assert [n["kind"] for n in raised if n["kind"] == OOD] == [OOD]
    assert any(b.get("ood") == ["current"] for b in bodies)
