"""The agent in a child process, for the OTA crash tests.

    python -m tests.support.ota_agent_proc CONFIG MODBUS_PORT CHANNEL [BUNDLE KILL_AT]

Runs the agent against the plant simulator. With BUNDLE, installs it once a few windows
were decided and SIGKILLs itself right after the journal reached state KILL_AT (the
transition is on disk, its action not yet done: the worst moment). Without, it runs two
seconds and prints one JSON line: the OTA state and the sha of the model serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from drivers.sim.server import PlantSimulator
from edge_agent.compose import build_agent
from edge_agent.config import load_config
from edge_agent.ota import AgentOta
from edge_agent.rules import Decision
from fleet.artifacts import ArtifactServer, publish
from ota.fetch import fetch
from ota.machine import Journal


async def _until(pred: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for decisions")
        await asyncio.sleep(0.05)


async def _fetch_and_die(ota: AgentOta, bundle: Path) -> None:
    """Offer the bundle from a real artifact server; die once the first bytes are on disk."""
    artifacts = bundle.parent / "artifacts"
    sha = publish(artifacts, bundle)
    length = (artifacts / f"{sha}.efb").stat().st_size

    def die(done: int) -> None:
        if done > 0:
            os.kill(os.getpid(), signal.SIGKILL)

    async def fetch_then_die(url: str, dest: Path, *, length: int) -> Path:
        return await fetch(url, dest, length=length, progress=die)

    ota.updater._fetch = fetch_then_die
    async with ArtifactServer(artifacts) as srv:
        await ota.updater.install_url(
            srv.http_url(sha),
            length=length,
            bundle_id="m2",
            incoming_name="m2.efb",
        )
    await asyncio.sleep(30)


def main(config: Path, port: int, channel: str, bundle: Path | None, kill_at: str) -> None:
    cfg = load_config(config)
    decisions: list[Decision] = []

    async def run() -> dict[str, Any]:
        agent = build_agent(cfg, on_decision=decisions.append)
        assert agent.ota is not None
        ota = agent.ota
        report = ota.updater.on_transition

        def hook(j: Journal, reason: str, detail: dict[str, Any]) -> None:
            if report is not None:
                report(j, reason, detail)
            # "fetching" dies mid-transfer instead (see _fetch_and_die).
            if j.state == kill_at != "fetching":
                os.kill(os.getpid(), signal.SIGKILL)

        ota.updater.on_transition = hook
        stop = asyncio.Event()

        async def drive() -> None:
            await _until(lambda: len(decisions) >= 2)
            if bundle is not None and kill_at == "fetching":
                await _fetch_and_die(ota, bundle)
            elif bundle is not None:
                await ota.install_file(bundle)
                await asyncio.sleep(30)  # only a missed kill point gets here
            else:
                n = len(decisions)
                await _until(lambda: len(decisions) >= n + 2)
            stop.set()

        async with PlantSimulator(seed=3, modbus_port=port, can_channel=channel):
            task = asyncio.create_task(drive())
            await agent.run(stop)
            await task
        return {
            "state": ota.updater.journal.state,
            "serving": agent.model_sha256(),
            "scored": sorted({d.model_sha256 for d in decisions[-2:]}),
            "status": ota.status(),
        }

    print(json.dumps(asyncio.run(run())), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        Path(args[0]),
        int(args[1]),
        args[2],
        Path(args[3]) if len(args) > 3 else None,
        args[4] if len(args) > 4 else "",
    )
