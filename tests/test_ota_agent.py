"""OTA in the running agent: model bundles through the API, probation, rollback, recovery.

The agent runs in-process against the plant simulator (real Modbus TCP, python-can virtual
bus); bundles are real signed ``.efb`` files; the API is the agent's own HTTP server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from typer.testing import CliRunner

from edge_agent.cli import app
from edge_agent.config import load_config, parse_config
from edge_agent.rules import Decision
from edge_agent.service import Agent
from models import load_model
from ota.journal import load as load_journal
from tests.support.agent import EXAMPLES, example_text
from tests.support.ota import Signer, model_members
from tests.support.ota_agent import ota_config, run_agent, until, with_root
from tests.support.ports import free_port

pytestmark = pytest.mark.peers


async def post(
    agent: Agent, route: str, body: dict[str, Any], timeout: float = 60
) -> tuple[int, Any]:
    port = agent.api_port
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://127.0.0.1:{port}{route}",
            json=body,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as r,
    ):
        return r.status, await r.json()


def assert_no_window_missed(decisions: list[Decision]) -> None:
    seqs = [d.window_seq for d in decisions]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a window was missed"


def test_model_bundle_installs_through_the_api_and_commits(tmp_path: Path) -> None:
    signer = Signer()
    cfg, port, channel = ota_config(tmp_path, signer)
    members, new_sha = model_members(tmp_path, "v2")
    bundle = signer.bundle(tmp_path / "m2.efb", members, version="1.1.0", counter=2)
    old_sha = load_model().sha256

    async def scenario(agent: Agent) -> tuple[int, Any]:
        return await post(agent, "/v1/ota/install", {"path": str(bundle)})

    (code, outcome), decisions, status = run_agent(cfg, port, channel, scenario)
    assert code == 200, outcome
    assert outcome["result"] == "committed", outcome
    shas = [d.model_sha256 for d in decisions]
    switch = shas.index(new_sha)
    assert shas == [old_sha] * switch + [new_sha] * (len(shas) - switch)
    assert_no_window_missed(decisions)
    ota = status["ota"]
    assert ota["active"]["model"]["version"] == "1.1.0"
    assert ota["floors"] == {"model": 2}
    assert ota["last"]["result"] == "committed"
    assert bundle.exists(), "the user's file is copied, not moved"

    # The next start runs the committed OTA model; the same bundle again is "already installed".
    async def again(agent: Agent) -> tuple[int, Any]:
        return await post(agent, "/v1/ota/install", {"path": str(bundle)})

    (code, outcome), decisions, status = run_agent(cfg, port, channel, again)
    assert {d.model_sha256 for d in decisions} == {new_sha}
    assert code == 422
    assert outcome["code"] == "already_installed"


def test_probation_over_the_bundle_latency_limit_rolls_back(tmp_path: Path) -> None:
    signer = Signer()
    cfg, port, channel = ota_config(tmp_path, signer)
    members, new_sha = model_members(tmp_path, "v2")
    # No real stage runs in 1 µs: the manifest's own limit trips as soon as enough windows ran.
    bundle = signer.bundle(
        tmp_path / "m2.efb", members, probation={"seconds": 3, "p99_us": 1, "min_windows": 3}
    )
    old_sha = load_model().sha256

    async def scenario(agent: Agent) -> tuple[int, Any]:
        return await post(agent, "/v1/ota/install", {"path": str(bundle)})

    (code, outcome), decisions, _status = run_agent(cfg, port, channel, scenario)
    assert code == 422, outcome
    assert outcome["result"] == "rolled_back"
    assert "over the bundle's limit of 1 µs" in outcome["reason"]
    shas = [d.model_sha256 for d in decisions]
    assert new_sha in shas
    assert shas[-1] == old_sha
    assert_no_window_missed(decisions)
    journal, _ = load_journal(cfg.state_dir / "ota" / "journal.json")
    assert "model" not in journal.active  # the factory model is live again
    assert journal.floors == {}  # nothing was committed
    assert journal.last is not None
    assert journal.last.result == "rolled_back"


def test_health_api_silent_during_probation_rolls_back(tmp_path: Path) -> None:
    signer = Signer()
    cfg, port, channel = ota_config(tmp_path, signer)
    members, _ = model_members(tmp_path, "v2")
    bundle = signer.bundle(tmp_path / "m2.efb", members, probation={"seconds": 2, "min_windows": 3})
    old_sha = load_model().sha256

    async def scenario(agent: Agent) -> Any:
        assert agent.ota is not None
        assert agent._api is not None
        api = agent._api
        # The agent's own API dies as the new model goes live: nothing answers the probes.
        task = asyncio.create_task(agent.ota.install_file(bundle))
        await until(
            lambda: agent.ota is not None and agent.ota.updater.journal.state == "probation"
        )
        await api.stop()
        return await task

    outcome, decisions, _ = run_agent(cfg, port, channel, scenario)
    assert outcome.result == "rolled_back"
    assert "health API silent" in outcome.reason
    assert decisions[-1].model_sha256 == old_sha


def test_restart_during_probation_rolls_back_to_one_consistent_version(tmp_path: Path) -> None:
    signer = Signer()
    cfg, port, channel = ota_config(tmp_path, signer)
    members, new_sha = model_members(tmp_path, "v2")
    bundle = signer.bundle(
        tmp_path / "m2.efb", members, probation={"seconds": 30, "min_windows": 3}
    )

    async def scenario(agent: Agent) -> str:
        assert agent.ota is not None
        task = asyncio.create_task(agent.ota.install_file(bundle))
        await until(
            lambda: agent.ota is not None and agent.ota.updater.journal.state == "probation"
        )
        task.cancel()  # the process "dies" here: the journal says probation, new model live
        return agent.model_sha256()

    live, _, _ = run_agent(cfg, port, channel, scenario)
    assert live == new_sha
    journal, _ = load_journal(cfg.state_dir / "ota" / "journal.json")
    assert journal.state == "probation"

    async def idle(agent: Agent) -> None:
        return None

    _, decisions, status = run_agent(cfg, port, channel, idle)
    assert {d.model_sha256 for d in decisions} == {load_model().sha256}
    assert status["ota"]["state"] == "idle"
    assert status["ota"]["last"]["result"] == "rolled_back"
    assert "during probation" in status["ota"]["last"]["reason"]


def test_no_trust_root_refuses_every_bundle(tmp_path: Path) -> None:
    cfg, port, channel = ota_config(tmp_path, None)
    members, _ = model_members(tmp_path, "v2")
    bundle = Signer().bundle(tmp_path / "m2.efb", members)

    async def scenario(agent: Agent) -> tuple[int, Any]:
        return await post(agent, "/v1/ota/install", {"path": str(bundle)})

    (code, outcome), decisions, _ = run_agent(cfg, port, channel, scenario)
    assert code == 422
    assert outcome["code"] == "trust"
    assert "no trust root" in outcome["reason"]
    assert {d.model_sha256 for d in decisions} == {load_model().sha256}


def test_cli_status_reads_the_journal_when_the_agent_is_down(tmp_path: Path) -> None:
    signer = Signer()
    cfg, port, channel = ota_config(tmp_path, signer)
    members, _ = model_members(tmp_path, "v2")
    bundle = signer.bundle(tmp_path / "m2.efb", members, version="1.1.0", counter=5)
    config_file = tmp_path / "agent.toml"
    text = example_text().replace("port = 15020", f"port = {port}")
    text = text.replace('channel = "edgefleet-demo"', f'channel = "{channel}"')
    text = text.replace("port = 0", f"port = {free_port()}")
    text = with_root(text, tmp_path / "root.json")
    text = text.replace('"../', f'"{EXAMPLES.parent}/')
    config_file.write_text(text)
    cfg = parse_config(text, base_dir=EXAMPLES)
    runner = CliRunner()

    async def scenario(agent: Agent) -> Any:
        res = await asyncio.to_thread(
            runner.invoke, app, ["ota", "install", str(bundle), "-c", str(config_file), "--json"]
        )
        return res

    res, _, _ = run_agent(cfg, port, channel, scenario)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["result"] == "committed"
    res = runner.invoke(app, ["ota", "status", "-c", str(config_file), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["active"]["model"]["version"] == "1.1.0"
    assert doc["floors"] == {"model": 5}
    res = runner.invoke(app, ["ota", "status", "-c", str(config_file)])
    assert "journal (agent not running)" in res.output
    assert "1.1.0" in res.output
    res = runner.invoke(app, ["ota", "install", str(bundle), "-c", str(config_file)])
    assert res.exit_code == 3
    assert "not running" in res.output


# -- SIGKILL at each step, then a restart: exactly one consistent version ---------------------


def _write_config(tmp: Path, signer: Signer) -> tuple[Path, int, str]:
    port, channel = free_port(), f"ota-{uuid.uuid4().hex[:8]}"
    text = example_text().replace("port = 15020", f"port = {port}")
    text = text.replace('channel = "edgefleet-demo"', f'channel = "{channel}"')
    text = with_root(text, signer.write_root(tmp / "root.json"))
    text = text.replace('"../', f'"{EXAMPLES.parent}/')
    path = tmp / "agent.toml"
    path.write_text(text)
    return path, port, channel


def _child(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.support.ota_agent_proc", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=Path(__file__).parents[1],
    )


@pytest.mark.parametrize(
    ("kill_at", "failing"),
    [
        ("fetching", False),
        ("verifying", False),
        ("staged", False),
        ("activating", False),
        ("probation", False),
        ("committing", False),
        ("rolling_back", True),
    ],
)
def test_sigkill_at_each_step_leaves_one_consistent_version(
    tmp_path: Path, kill_at: str, failing: bool
) -> None:
    signer = Signer()
    config, port, channel = _write_config(tmp_path, signer)
    members, new_sha = model_members(tmp_path, "v2")
    probation = {"seconds": 1, "min_windows": 1}
    if failing:
        probation["p99_us"] = 1  # fails at once: the kill lands in rolling_back
    if kill_at == "fetching":
        # Big enough that the transfer takes several chunks: the kill lands mid-way.
        members = [*members, ("padding.bin", os.urandom(4 * 1024 * 1024))]
    bundle = signer.bundle(tmp_path / "m2.efb", members, probation=probation)
    first = _child(str(config), str(port), channel, str(bundle), kill_at)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    state_dir = load_config(config).state_dir
    journal, _ = load_journal(state_dir / "ota" / "journal.json")
    assert journal.state == kill_at
    if kill_at == "fetching":
        assert list((state_dir / "ota" / "incoming").glob("*.part")), "killed mid-transfer"

    second = _child(str(config), str(port), channel)
    assert second.returncode == 0, second.stderr[-2000:]
    after = json.loads(second.stdout.strip().splitlines()[-1])
    assert after["state"] == "idle"
    factory = load_model().sha256
    active = after["status"]["active"].get("model")
    # Only a kill after the probation passed may keep the new model; then it is committed.
    expected = new_sha if kill_at == "committing" else factory
    assert after["serving"] == expected
    assert after["scored"] == [expected]
    if expected == new_sha:
        assert active is not None
        assert active["version"] == "1.1.0"
        assert after["status"]["floors"] == {"model": 2}
    else:
        assert active is None
        assert after["status"]["floors"] == {}


def test_config_bundle_swaps_reasoning_rules_live_and_refuses_a_restart_change(
    tmp_path: Path,
) -> None:
    signer = Signer()
    cfg, port, channel = ota_config(tmp_path, signer)
    base = (tmp_path / "agent.toml").read_text()
    live = base.replace("[reasoning.thresholds]", "[reasoning.thresholds]\nnoise = 0.97", 1)
    restart = base.replace(f"port = {port}", f"port = {port + 1}", 1)
    good = signer.bundle(
        tmp_path / "c1.efb", [("agent.toml", live.encode())], kind="config", counter=1
    )
    bad = signer.bundle(
        tmp_path / "c2.efb", [("agent.toml", restart.encode())], kind="config", counter=2
    )

    async def scenario(agent: Agent) -> tuple[Any, Any, float]:
        assert agent.ota is not None
        first = await agent.ota.install_file(good)
        assert agent.stage is not None
        threshold = agent.stage.rules.compile(
            agent.stage.model.manifest.labels,
            agent.config.perception.signals,
            agent.stage.model.manifest.thresholds,
        ).thresholds
        second = await agent.ota.install_file(bad)
        labels = list(agent.stage.model.manifest.labels)
        return first, second, float(threshold[labels.index("noise")])

    (first, second, noise), decisions, status = run_agent(cfg, port, channel, scenario)
    assert first.result == "committed", first
    assert noise == pytest.approx(0.97)
    assert second.result == "rolled_back"
    assert "need a restart" in second.reason
    assert "sources" in second.reason
    assert status["ota"]["active"]["config"]["counter"] == 1
    assert_no_window_missed(decisions)
