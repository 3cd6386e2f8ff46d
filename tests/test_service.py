"""The agent end to end: the plant simulator's real Modbus server and CAN bus -> windows."""

import asyncio
import json
import socket
import uuid
from pathlib import Path

from typer.testing import CliRunner

from drivers.sim.server import PlantSimulator
from edge_agent.cli import app
from edge_agent.config import AgentConfig, parse_config
from edge_agent.perception import Window
from edge_agent.service import Agent

EXAMPLES = Path(__file__).parents[1] / "examples"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def example_config(port: int, channel: str) -> AgentConfig:
    text = (EXAMPLES / "agent.toml").read_text()
    text = text.replace("port = 15020", f"port = {port}").replace(
        'channel = "edgefleet-demo"', f'channel = "{channel}"'
    )
    text = text.replace("stats_interval_s = 2.0", "stats_interval_s = 0.5")
    return parse_config(text, base_dir=EXAMPLES)


def test_agent_turns_simulated_plant_into_complete_windows() -> None:
    port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    cfg = example_config(port, channel)
    seen: list[Window] = []

    async def main() -> dict[str, object]:
        agent = Agent(cfg, on_window=seen.append)
        stop = asyncio.Event()
        async with PlantSimulator(seed=3, modbus_port=port, can_channel=channel):
            loop = asyncio.get_running_loop()
            loop.call_later(3.0, stop.set)
            await agent.run(stop)
        return agent.status()

    status = asyncio.run(main())
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


def test_a_dead_modbus_port_does_not_stop_can() -> None:
    dead_port, channel = free_port(), f"svc-{uuid.uuid4().hex[:8]}"
    cfg = example_config(dead_port, channel)
    seen: list[Window] = []

    async def main() -> dict[str, object]:
        agent = Agent(cfg, on_window=seen.append)
        stop = asyncio.Event()
        # CAN only: nothing listens on the Modbus port.
        async with PlantSimulator(seed=3, modbus_port=None, can_channel=channel):
            asyncio.get_running_loop().call_later(2.0, stop.set)
            await agent.run(stop)
        return agent.status()

    status = asyncio.run(main())
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
        (EXAMPLES / "agent.toml")
        .read_text()
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
        (EXAMPLES / "agent.toml")
        .read_text()
        .replace('dbc = "../drivers/sim/motor_drive.dbc"', f'dbc = "{junk}"')
    )
    res = runner.invoke(app, ["check-config", str(bad)])
    assert res.exit_code == 2
    assert "sources 'drive-can':" in res.output
    assert "junk.dbc" in res.output


def test_cli_run_with_simulator_prints_status(tmp_path: Path) -> None:
    port, channel = free_port(), f"cli-{uuid.uuid4().hex[:8]}"
    cfg = tmp_path / "agent.toml"
    text = (EXAMPLES / "agent.toml").read_text()
    text = text.replace("port = 15020", f"port = {port}")
    text = text.replace('channel = "edgefleet-demo"', f'channel = "{channel}"')
    text = text.replace(
        'dbc = "../drivers/sim/motor_drive.dbc"',
        f'dbc = "{EXAMPLES.parent}/drivers/sim/motor_drive.dbc"',
    )
    cfg.write_text(text)
    res = runner.invoke(
        app, ["run", "-c", str(cfg), "--simulate", "--duration", "2.5", "--status-json"]
    )
    assert res.exit_code == 0, res.output
    status = json.loads(res.stdout[res.stdout.index("{") :])
    assert status["windows"] >= 2
    assert status["buffer"]["dropped"] == 0
