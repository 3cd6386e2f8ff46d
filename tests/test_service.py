"""The agent end to end: the plant simulator's real Modbus server and CAN bus -> windows."""

import asyncio
import dataclasses
import json
import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from drivers.buffer import SampleBuffer
from drivers.sim.plant import parse_anomaly
from drivers.sim.server import PlantSimulator
from edge_agent.cli import app
from edge_agent.compose import build_agent, build_parts
from edge_agent.config import parse_config
from edge_agent.errors import ModelMismatch, ReasoningError
from edge_agent.perception import Window
from edge_agent.rules import Decision
from edge_agent.service import Agent
from models import load_model
from models.copies import copy_with_new_sha
from tests.support.agent import EXAMPLES, example_config, example_config_text, example_text
from tests.support.ports import free_port

pytestmark = pytest.mark.peers


async def run_beside_simulator(
    agent: Agent, seconds: float, port: int | None, channel: str
) -> dict[str, Any]:
    """Run ``agent`` for ``seconds`` beside the plant simulator (Modbus on ``port`` unless
    None, CAN on ``channel``); its status at the end."""
    stop = asyncio.Event()
    async with PlantSimulator(seed=3, modbus_port=port, can_channel=channel):
        asyncio.get_running_loop().call_later(seconds, stop.set)
        await agent.run(stop)
    return agent.status()


def test_agent_turns_simulated_plant_into_complete_windows() -> None:
    port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    cfg = example_config(port, channel)
    seen: list[Window] = []

    status = asyncio.run(
        run_beside_simulator(build_agent(cfg, on_window=seen.append), 3.0, port, channel)
    )
    # 3 s at 100 Hz / 64 points: 4 windows, the first after ~0.66 s.
    assert len(seen) >= 3
    assert status["windows"] == len(seen)
    w = seen[-1]
    assert w.values.shape == (64, 6)
    assert w.signals == cfg.perception.signals
    # Every signal is fresh by the second window: both buses deliver.
    assert not w.stale.any(), dict(zip(w.signals, w.stale.tolist(), strict=True))
    assert w.completeness >= 0.95
    volts = w.values[:, w.signals.index("voltage")]
    assert 350 < float(volts.mean()) < 450
    buffer = status["buffer"]
    assert isinstance(buffer, dict)
    assert buffer["dropped"] == 0
    sources = status["sources"]
    assert isinstance(sources, dict)
    assert sources["drive-modbus"]["samples"] > 0
    assert sources["drive-can"]["samples"] > 0


class SlowToStop:
    """A source that takes 0.6 s to stop once cancelled, as a reader finishing a long recv
    or a serial port closing can; it delivers nothing."""

    name = "slow-to-stop"

    async def run(self, sink: SampleBuffer) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.6)
            raise

    def stats(self) -> dict[str, int]:
        return {"up": 1}


def test_windows_falling_due_while_the_sources_stop_are_decided_on_time() -> None:
    """On stop the sources end first while the gates go on: the windows falling due while a
    source takes its time are decided as they close, not all at once in the final drain."""
    port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    text = example_config_text(port, channel).replace("# hop = 64", "hop = 8")
    cfg = parse_config(text, base_dir=EXAMPLES)
    decisions: list[Decision] = []

    parts = build_parts(cfg)
    parts.sources.append(SlowToStop())
    agent = Agent(parts, on_decision=decisions.append)
    status = asyncio.run(run_beside_simulator(agent, 2.0, port, channel))
    # 2.6 s at one window per 80 ms: the stop's 0.6 s holds ~7 of them.
    assert len(decisions) == status["windows"] >= 25
    e2e = status["latency_us"]["e2e"]
    assert e2e["n"] == len(decisions)
    # Decided in the drain they would wait up to the whole 0.6 s.
    assert e2e["max"] < 200_000, e2e


class Collect(logging.Handler):
    """Keeps the records of one logger (caplog's root handler misses a set level)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def run_agent_with_anomaly(
    anomaly: str, seconds: float
) -> tuple[list[Window], list[Decision], dict[str, object], str]:
    """The example agent against the simulator (plant time from 20 s: the motor runs)."""
    port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    cfg = example_config(port, channel)
    windows: list[Window] = []
    decisions: list[Decision] = []

    async def main() -> dict[str, object]:
        agent = build_agent(cfg, on_window=windows.append, on_decision=decisions.append)
        stop = asyncio.Event()
        async with PlantSimulator(
            seed=3,
            anomalies=[parse_anomaly(anomaly)],
            start_at_s=20.0,
            modbus_port=port,
            can_channel=channel,
        ):
            asyncio.get_running_loop().call_later(seconds, stop.set)
            await agent.run(stop)
        return agent.status()

    handler = Collect()
    logger = logging.getLogger("edge_agent.service")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        status = asyncio.run(main())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return windows, decisions, status, "\n".join(r.getMessage() for r in handler.records)


def test_agent_decides_about_every_window() -> None:
    windows, decisions, status, log_text = run_agent_with_anomaly("spike:current@21+30x8", 5.0)
    assert len(decisions) == len(windows) >= 6
    assert [d.window_seq for d in decisions] == [w.seq for w in windows]
    sha = load_model().sha256
    for d in decisions:
        assert set(d.stage_latency_ms) == {"perception", "memory", "reasoning"}
        assert 0.0 < d.stage_latency_ms["memory"] < 50.0
        assert 0.0 < d.stage_latency_ms["perception"] < 50.0
        assert 0.0 < d.stage_latency_ms["reasoning"] < 50.0
        assert d.model_sha256 == sha
        assert d.model_ran
        json.dumps(d.to_json(), allow_nan=False)
    memory = status["memory"]
    assert isinstance(memory, dict)
    assert memory["windows"] == len(windows)
    assert memory["decisions"] == len(decisions)
    reasoning = status["reasoning"]
    assert isinstance(reasoning, dict)
    assert reasoning["decisions"] == len(decisions)
    assert sum(reasoning["labels"].values()) == len(decisions)
    queues = status["queues"]
    assert isinstance(queues, dict)
    assert queues["memory"]["dropped"] == queues["reasoning"]["dropped"] == 0
    assert reasoning["model"]["sha256"] == sha
    assert reasoning["breaker"]["mode"] == "full"
    assert reasoning["latency_us"]["reasoning"]["p99"] > 0
    # Alarms and label changes are logged at INFO with the window and the model.
    if any(d.raised for d in decisions):
        assert "RAISED=" in log_text
    assert f"model={sha[:12]}" in log_text


def test_a_simulated_spike_is_the_alarm_through_the_field_buses() -> None:
    _, decisions, _, log_text = run_agent_with_anomaly("spike:current@21+30x8", 6.0)
    labels = [d.label for d in decisions]
    # The model calls a spike window "noise" now and then (model card: spike recall < 1);
    # hysteresis keeps such a lone window from raising anything. Spike must dominate and be
    # the only alarm raised.
    anomalous = [label for label in labels if label != "normal"]
    assert anomalous.count("spike") > len(anomalous) / 2, labels
    assert {r for d in decisions for r in d.raised} == {"spike"}, labels
    spikes = [d for d in decisions if d.label == "spike"]
    assert spikes
    assert spikes[0].top_signals[0][0] == "current"
    assert "RAISED=spike" in log_text


def test_reload_model_swaps_between_windows(tmp_path: Path) -> None:
    port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    cfg = example_config(port, channel)
    other = copy_with_new_sha(tmp_path / "b", "reload")
    corrupt = copy_with_new_sha(tmp_path / "bad", "bad")
    (corrupt / "model.tflite").write_bytes(b"\0" * 64)
    decisions: list[Decision] = []
    errors: list[str] = []

    async def main() -> None:
        agent = build_agent(cfg, on_decision=decisions.append)
        stop = asyncio.Event()

        async def swap_later() -> None:
            await asyncio.sleep(2.0)
            await agent.reload_model(other)
            try:
                await agent.reload_model(corrupt)
            except ReasoningError as exc:
                errors.append(str(exc))
            await asyncio.sleep(1.5)
            stop.set()

        async with (
            PlantSimulator(seed=3, modbus_port=port, can_channel=channel),
            asyncio.TaskGroup() as tg,
        ):
            tg.create_task(swap_later())
            await agent.run(stop)

    asyncio.run(main())
    old_sha, new_sha = load_model().sha256, load_model(other).sha256
    shas = [d.model_sha256 for d in decisions]
    assert [d.window_seq for d in decisions] == list(range(1, len(decisions) + 1))
    # One switch, between two windows, and the rejected model never served.
    switch = shas.index(new_sha)
    assert switch > 0
    assert shas == [old_sha] * switch + [new_sha] * (len(shas) - switch)
    assert errors
    assert "reasoning: cannot load" in errors[0]
    assert "size" in errors[0] or "sha256" in errors[0]


def test_a_model_that_cannot_load_is_fatal_at_start(tmp_path: Path) -> None:
    cfg = example_config(free_port(), "unused")
    missing = dataclasses.replace(
        cfg, reasoning=dataclasses.replace(cfg.reasoning, model_dir=tmp_path / "nope")
    )
    with pytest.raises(ReasoningError, match=r"reasoning: cannot load .*nope.*manifest"):
        build_agent(missing)
    # A model that loads but does not fit the perception grid is a config error.
    short = dataclasses.replace(
        cfg, perception=dataclasses.replace(cfg.perception, window=32, hop=32)
    )
    with pytest.raises(ModelMismatch, match="does not fit this config"):
        build_agent(short)


def test_a_dead_modbus_port_does_not_stop_can() -> None:
    dead_port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    cfg = example_config(dead_port, channel)
    seen: list[Window] = []

    # CAN only: nothing listens on the Modbus port.
    agent = build_agent(cfg, on_window=seen.append)
    status = asyncio.run(run_beside_simulator(agent, 2.0, None, channel))
    assert seen, "windows must keep flowing from CAN"
    w = seen[-1]
    stale = dict(zip(w.signals, w.stale.tolist(), strict=True))
    assert stale == {
        "voltage": True,
        "current": False,
        "frequency": False,
        "speed": False,
        "temperature": True,
        "vibration": False,
    }
    sources = status["sources"]
    assert isinstance(sources, dict)
    mb = sources["drive-modbus"]
    assert mb["connection_errors"] > 0 or mb["errors"] > 0 or mb["timeouts"] > 0


runner = CliRunner()


def test_cli_check_config_ok_and_errors(tmp_path: Path) -> None:
    ok = runner.invoke(app, ["check-config", str(EXAMPLES / "agent.toml")])
    assert ok.exit_code == 0, ok.output
    assert "ok (2 source(s), 6 signal(s), 64 x 100 Hz windows)" in ok.output

    bad = tmp_path / "agent.toml"
    bad.write_text(
        example_text()
        .replace("port = 15020", 'port = "15020"')
        .replace('dbc = "../drivers/sim/motor_drive.dbc"', f'dbc = "{EXAMPLES.parent}/README.md"')
    )
    res = runner.invoke(app, ["check-config", str(bad)])
    assert res.exit_code == 2
    assert "sources.modbus[0].port: expected a valid integer; got '15020'" in res.output


def test_cli_check_config_reports_a_dbc_that_does_not_parse(tmp_path: Path) -> None:
    bad = tmp_path / "agent.toml"
    junk = tmp_path / "junk.dbc"
    junk.write_text("this is not a DBC\n")
    bad.write_text(
        example_text().replace('dbc = "../drivers/sim/motor_drive.dbc"', f'dbc = "{junk}"')
    )
    res = runner.invoke(app, ["check-config", str(bad)])
    assert res.exit_code == 2
    assert "sources 'drive-can':" in res.output
    assert "junk.dbc" in res.output


def test_cli_run_with_simulator_prints_status(tmp_path: Path) -> None:
    port, channel = free_port(), f"cli-{uuid.uuid4().hex[:8]}"
    cfg = tmp_path / "agent.toml"
    text = example_text()
    text = text.replace("port = 15020", f"port = {port}")
    text = text.replace('channel = "edgefleet-demo"', f'channel = "{channel}"')
    text = text.replace(
        'dbc = "../drivers/sim/motor_drive.dbc"',
        f'dbc = "{EXAMPLES.parent}/drivers/sim/motor_drive.dbc"',
    )
    cfg.write_text(text)
    res = runner.invoke(
        app,
        [
            "run",
            "-c",
            str(cfg),
            "--simulate",
            "--duration",
            "2.5",
            "--status-json",
            "--anomaly",
            "spike:vibration@0.5+10x3",
        ],
    )
    assert res.exit_code == 0, res.output
    status = json.loads(res.stdout[res.stdout.index("{") :])
    assert status["windows"] >= 2
    assert status["buffer"]["dropped"] == 0
    assert status["reasoning"]["decisions"] == status["windows"]


def test_cli_run_rejects_a_bad_anomaly(tmp_path: Path) -> None:
    cfg = EXAMPLES / "agent.toml"
    res = runner.invoke(app, ["run", "-c", str(cfg), "--simulate", "--anomaly", "spike:x@1+2"])
    assert res.exit_code == 2
    assert "unknown signal 'x'" in res.output
    res = runner.invoke(app, ["run", "-c", str(cfg), "--anomaly", "stuck:speed@1+2"])
    assert res.exit_code == 2
    assert "--anomaly needs --simulate" in res.output
