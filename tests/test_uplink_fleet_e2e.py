"""Agent -> Mosquitto -> fleet ingest -> store, end to end, with real everything.

The agent runs against the plant simulator with its uplink on; a fleet ingest worker on
the same broker writes into an SQLite store. Every data message the agent numbered must be
in the store once, seq 0..N-1 of one boot, and the registry must follow the device's
birth and clean offline.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from pathlib import Path

import pytest

from drivers.sim.server import PlantSimulator
from edge_agent.compose import build_agent
from edge_agent.config import parse_config
from edge_agent.uplink.telemetry import Reconstructor, periods_of
from fleet.ingest import IngestConfig, IngestWorker
from fleet.store import open_store
from tests.support.agent import EXAMPLES, example_text
from tests.support.mosquitto import mosquitto
from tests.support.ports import free_port
from wire import TelemetryMsg, decode

pytestmark = pytest.mark.peers


def test_agent_to_broker_to_fleet_store_with_seq_continuity(tmp_path: Path) -> None:
    port, channel = free_port(), f"e2e-{uuid.uuid4().hex[:8]}"
    store_url = f"sqlite://{tmp_path / 'fleet.db'}"
    with mosquitto(tmp_path / "broker") as broker:
        text = example_text().replace("port = 15020", f"port = {port}")
        text = text.replace('channel = "edgefleet-demo"', f'channel = "{channel}"')
        text = (
            text.replace("enabled = false                # the demo", "enabled = true #")
            .replace("port = 1883", f"port = {broker.port}")
            # 50 ms periods, four to a message: batches and single messages both occur.
            .replace("telemetry_period_ms = 1000", "telemetry_period_ms = 50")
            .replace("telemetry_batch = 1 ", "telemetry_batch = 4 ")
        )
        cfg = parse_config(text, base_dir=EXAMPLES)
        worker = IngestWorker(
            IngestConfig(store_url=store_url, broker_port=broker.port, client_id="ingest-e2e")
        )
        worker.start()
        try:

            async def main() -> dict[str, object]:
                agent = build_agent(cfg)
                stop = asyncio.Event()
                async with PlantSimulator(seed=3, modbus_port=port, can_channel=channel):
                    asyncio.get_running_loop().call_later(4.0, stop.set)
                    await agent.run(stop)
                return agent.status()

            status = asyncio.run(main())
            uplink = status["uplink"]
            assert isinstance(uplink, dict)
            numbered = int(uplink["next_seq"])
            assert numbered > 10
            # Everything numbered left the outbox (acked) during the last-second flush.
            assert uplink["outbox_rows"] == 0, uplink
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and worker.stats.stored < numbered:
                time.sleep(0.05)
        finally:
            worker.stop()
    store = open_store(store_url)
    try:
        counts = store.counts()
        reasoning = status["reasoning"]
        assert isinstance(reasoning, dict)
        assert counts["decision"] == reasoning["decisions"]
        assert counts["telemetry"] + counts["decision"] == numbered
        assert store.gaps() == []
        info = store.device("demo-gw-01")
        assert info is not None
        assert info.online is False  # the clean offline at shutdown
        assert info.last_seq == numbered - 1
        assert info.latency_ms.keys() >= {"perception", "memory", "reasoning"}
        tail = store.telemetry("demo-gw-01", limit=1000)
        decisions = store.decisions(device="demo-gw-01", limit=1000)
        seqs = sorted([seq for _, seq, _, _ in tail] + [seq for _, _, seq, _ in decisions])
        assert seqs == list(range(numbered))
        assert len({boot for _, _, boot, _ in tail}) == 1
        # Batches of four periods (the last may be short), each period 50 ms after the one
        # before it, all rebuilt in order by the fleet's side.
        rebuilt = Reconstructor()
        ends: list[int] = []
        for _, _, _, body in tail:
            msg = decode("telemetry", body)
            assert isinstance(msg, TelemetryMsg)
            assert 1 <= len(periods_of(msg)) <= 4
            ends += [t for t, _ in rebuilt.apply_each(msg)]
        assert len(ends) > 4 * (len(tail) - 2)
        assert ends == sorted(ends)
        assert all((b - a) % 50_000_000 == 0 for a, b in itertools.pairwise(ends))
        assert rebuilt.synced
    finally:
        store.close()
