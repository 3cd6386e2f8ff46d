"""``edge-agent ota`` when there is no agent to talk to: the help says the commands talk to the
running agent, and the error is one line (whatever the terminal's width) with exit 3."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edge_agent.cli import app
from tests.support.agent import EXAMPLES, example_text
from tests.support.ports import free_port

pytestmark = pytest.mark.peers

runner = CliRunner()


def config_file(tmp: Path, *, api: bool = True) -> tuple[Path, int]:
    """The example config, its API on a free port nothing listens on."""
    port = free_port()
    # example_text() puts the API on port 0 (any free port, for agents that run).
    text = re.sub(r"(\[api\]\n(?:.*\n)*?port = )0\b", rf"\g<1>{port}", example_text(), count=1)
    assert f"port = {port}" in text
    text = text.replace('"../', f'"{EXAMPLES.parent}/')
    if not api:
        text = text.replace("[api]\nenabled = true", "[api]\nenabled = false")
    path = tmp / "agent.toml"
    path.write_text(text)
    return path, port


@pytest.mark.parametrize("command", ["install", "rollback"])
def test_help_says_it_talks_to_the_running_agent(command: str) -> None:
    res = runner.invoke(app, ["ota", command, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    assert "running agent through its health API" in res.output
    assert "exits 3" in res.output.lower()


@pytest.mark.parametrize("args", [["install", "BUNDLE"], ["rollback", "--kind", "model"]])
def test_no_agent_is_one_line_and_exit_3(tmp_path: Path, args: list[str]) -> None:
    config, port = config_file(tmp_path)
    bundle = tmp_path / "m.efb"
    bundle.write_bytes(b"x")
    argv = ["ota", *[str(bundle) if a == "BUNDLE" else a for a in args], "-c", str(config)]
    res = runner.invoke(app, argv, env={"COLUMNS": "40"})  # a narrow terminal
    assert res.exit_code == 3
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(
        f"error: the agent is not running: nothing answers at 127.0.0.1:{port} "
        f"([api] in {config}): "
    )


def test_an_agent_without_its_api_is_said_up_front(tmp_path: Path) -> None:
    config, _ = config_file(tmp_path, api=False)
    bundle = tmp_path / "m.efb"
    bundle.write_bytes(b"x")
    res = runner.invoke(app, ["ota", "install", str(bundle), "-c", str(config)])
    assert res.exit_code == 3
    assert res.stderr == (
        f"error: the agent's API is off ([api] enabled = false in {config}); edge-agent ota "
        "install and rollback talk to the running agent through it\n"
    )
