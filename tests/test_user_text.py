"""Text people read says what the code does: the CLIs' help as rendered, the README's
annotations of ``/v1/status``, and one name per counter in the log, status and metrics."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import typer
from rich.text import Text
from typer.testing import CliRunner

from drivers.sim.server import PlantSimulator
from edge_agent.cli import app as agent_app
from edge_agent.compose import build_agent
from edge_agent.config import parse_config
from fleet.cli import app as fleet_app
from tests.support.agent import example_text
from tests.support.ports import free_port

pytestmark = pytest.mark.peers

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def help_texts(command: Any, path: str) -> Iterator[tuple[str, str]]:
    """``(where, text)`` for the help of ``command``, its options and its sub-commands."""
    if command.help:
        yield path, command.help
    for param in command.params:
        if getattr(param, "help", None):
            yield f"{path} {param.opts[0]}", param.help
    for name, sub in getattr(command, "commands", {}).items():
        yield from help_texts(sub, f"{path} {name}")


@pytest.mark.parametrize(("app", "name"), [(agent_app, "edge-agent"), (fleet_app, "fleet")])
def test_no_help_text_loses_words_to_rich_markup(app: typer.Typer, name: str) -> None:
    """Help is rendered as rich markup: ``[default: x]`` or ``[schedule]`` vanish unless
    escaped, and reST ``literals`` show their backquotes."""
    found = list(help_texts(typer.main.get_command(app), name))
    assert len(found) > 50
    for where, text in found:
        assert "``" not in text, where
        assert Text.from_markup(text).plain == text.replace("\\[", "["), where


def plain_help(app: typer.Typer, *args: str) -> str:
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return result.output


def test_edge_agent_help_says_what_it_does() -> None:
    text = plain_help(agent_app)
    assert "(later)" not in text
    assert "reasoning" in text
    assert "uplink" in text
    assert "KIND:SIGNAL@START+DURATION[xMAGNITUDE]" in plain_help(agent_app, "run")
    assert "with a [schedule] section" in plain_help(agent_app, "tsn", "render")


def test_fleet_serve_help_has_no_raw_markup_or_stray_spaces() -> None:
    text = plain_help(fleet_app, "serve")
    assert "``" not in text
    assert not re.search(r"\S \.(\s|$)", text), text  # a space before a full stop
    assert "with --rollouts (the default)" in text
    assert "session the store records (default: fleet-ingest-HOSTNAME)" in text
    assert "artifact server (default: the bind address)" in text
    assert "[default: ./fleet.db]" in text


def status_lines() -> list[tuple[str, list[str]]]:
    """README's ``curl .../v1/status | jq PATH  # key, key, ...`` lines as (PATH, keys)."""
    pattern = re.compile(r"/v1/status \| jq (\S+)\s+# (.+)$")
    out = []
    for line in (REPO / "README.md").read_text().splitlines():
        m = pattern.search(line)
        if m:
            keys = [k.strip() for k in m.group(2).split(",") if k.strip() != "..."]
            out.append((m.group(1), keys))
    return out


def test_readme_status_annotations_and_one_counter_name_match_a_running_agent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port, channel = free_port(), f"txt-{uuid.uuid4().hex[:8]}"
    text = example_text().replace("port = 15020", f"port = {port}")
    text = text.replace('channel = "edgefleet-demo"', f'channel = "{channel}"')
    cfg = parse_config(text, base_dir=REPO / "examples")
    caplog.set_level(logging.INFO, logger="edge_agent.service")

    async def main() -> tuple[dict[str, Any], str]:
        agent = build_agent(cfg)
        stop = asyncio.Event()
        async with PlantSimulator(seed=3, modbus_port=port, can_channel=channel):
            task = asyncio.create_task(agent.run(stop))
            while agent.report.decisions < 2:  # noqa: ASYNC110 - polling the agent's counter
                await asyncio.sleep(0.05)
            base = f"http://127.0.0.1:{agent.api_port}"
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{base}/v1/status") as r:
                    status = await r.json()
                async with http.get(f"{base}/metrics") as r:
                    metrics = await r.text()
            stop.set()
            await task
        return status, metrics

    status, metrics = asyncio.run(main())
    annotated = status_lines()
    assert [path for path, _ in annotated] == [".", ".gates", ".reasoning.model_health"]
    for path, keys in annotated:
        node = status
        for part in path.strip(".").split(".") if path != "." else []:
            node = node[part]
        missing = [k for k in keys if k not in node]
        assert not missing, f"README: jq {path} has no {missing}; it has {sorted(node)}"
    # Samples of a signal perception does not take: one name in status, metrics and log.
    assert status["perception"]["unknown_signal"] > 0
    assert re.search(r'edgefleet_drops_total\{where="unknown_signal"\} [1-9]', metrics), metrics
    lines = [r.getMessage() for r in caplog.records if "drops: buffer=" in r.getMessage()]
    assert lines
    assert all(" unknown_signal=" in line for line in lines), lines
    assert "not_in_window" not in metrics + "".join(lines)
