"""An agent with OTA configured (the trust root of a test signer, a free port, the
simulator), run for one scenario."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from drivers.sim.server import PlantSimulator
from edge_agent.compose import build_agent
from edge_agent.config import AgentConfig, load_config
from edge_agent.rules import Decision
from edge_agent.service import Agent
from ota.machine import Installed
from ota.verify import verify_bundle
from tests.support.agent import EXAMPLES, example_text
from tests.support.ota import Signer
from tests.support.ports import free_port


def ota_config(
    tmp: Path, signer: Signer | None, *, extra: str = ""
) -> tuple[AgentConfig, int, str]:
    """The example config with a trust root, written to a real file (as on a device)."""
    port, channel = free_port(), f"ota-{uuid.uuid4().hex[:8]}"
    text = example_text().replace("port = 15020", f"port = {port}")
    text = text.replace('channel = "edgefleet-demo"', f'channel = "{channel}"')
    text = text.replace('"../', f'"{EXAMPLES.parent}/')
    if signer is not None:
        root = signer.write_root(tmp / "root.json")
        text = with_root(text, root, extra)
    path = tmp / "agent.toml"
    path.write_text(text)
    return load_config(path), port, channel


async def until(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


def run_agent(
    cfg: AgentConfig,
    port: int,
    channel: str,
    scenario: Callable[[Agent], Awaitable[Any]],
) -> tuple[Any, list[Decision], dict[str, Any]]:
    decisions: list[Decision] = []

    async def main() -> tuple[Any, dict[str, Any]]:
        agent = build_agent(cfg, on_decision=decisions.append)
        stop = asyncio.Event()
        result: list[Any] = []

        async def drive() -> None:
            try:
                await until(lambda: agent._api is not None and len(decisions) >= 3)
                result.append(await scenario(agent))
                n = len(decisions)
                await until(lambda: len(decisions) >= n + 3)
            finally:
                stop.set()

        async with (
            PlantSimulator(seed=3, modbus_port=port, can_channel=channel),
            asyncio.TaskGroup() as tg,
        ):
            tg.create_task(drive())
            await agent.run(stop)
        return result[0] if result else None, agent.status()

    result, status = asyncio.run(main())
    return result, decisions, status


def with_root(text: str, root: Path, extra: str = "") -> str:
    """The example's ``[ota]`` section with a trust root (and ``extra`` lines)."""
    head = "[ota]\nenabled = true\n"
    assert head in text
    return text.replace(head, f'{head}trust_root = "{root}"\n{extra}', 1)


def installed_of(agent: Agent, path: Path) -> Installed:
    """Verify ``path`` into the agent's own store as its updater would."""
    assert agent.ota is not None
    up = agent.ota.updater
    vb = verify_bundle(
        path,
        root=up.trust_root(),
        policy=up.policy,
        floors=up.journal.floors,
        now=datetime.now(UTC),
        store=up.store,
        keep_source=True,
    )
    s = vb.signed
    return Installed(
        s.bundle_id, s.kind, s.version, s.counter, vb.manifest_sha256, dict(vb.payloads)
    )
