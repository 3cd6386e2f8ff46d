"""How the uplink stops, against a real Mosquitto: a cancel always ends it, and a connection
that goes down while it stops is part of the shutdown (INFO), not a fault (WARNING)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import pytest

from tests.support.mosquitto import mosquitto
from tests.support.uplink import section, until, uplink
from tests.support.uplink_device_proc import make_decision

pytestmark = pytest.mark.peers

UPLINK_LOG = "edge_agent.uplink.publisher"


def test_a_cancel_right_after_a_publish_ends_the_uplink(tmp_path: Path) -> None:
    """The agent publishes its last windows and cancels the uplink in one step; that cancel
    must not get lost while the publish wakes the uplink (the agent would never exit)."""
    with mosquitto(tmp_path / "broker") as broker:
        up = uplink(section(broker.port), tmp_path / "state")

        async def main() -> None:
            task = asyncio.create_task(up.run())
            await until(lambda: up.stats()["connected"] is True, 10, "connect")
            for i in range(50):
                up.publish_decision(make_decision(i))
                await asyncio.sleep(0.005)
            up.publish_decision(make_decision(50))
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=15)
            if not done:
                task.cancel()  # again, so that the test itself can end
                await asyncio.wait([task], timeout=5)
            assert done, "the uplink did not stop when cancelled"
            assert task.cancelled()

        asyncio.run(main())


def test_the_broker_going_away_while_the_uplink_stops_is_not_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker stops (demo teardown, site shutdown) while the uplink flushes its last
    rows: an INFO line, no WARNING (the rows stay in the outbox for the next start)."""
    caplog.set_level(logging.INFO, logger=UPLINK_LOG)
    with mosquitto(tmp_path / "broker") as broker:
        up = uplink(section(broker.port), tmp_path / "state")

        async def main() -> None:
            task = asyncio.create_task(up.run())
            await until(lambda: up.stats()["connected"] is True, 10, "connect")
            assert broker.proc is not None
            # A broker that takes no more: the rows below stay in flight, so the flush at
            # stop waits for their PUBACKs (FLUSH_S) and the broker dies meanwhile.
            os.kill(broker.proc.pid, signal.SIGSTOP)
            for i in range(20):
                up.publish_decision(make_decision(i))
            await asyncio.sleep(0.3)
            task.cancel()
            await asyncio.sleep(0.2)
            await asyncio.to_thread(broker.kill)
            done, _ = await asyncio.wait([task], timeout=15)
            assert done, "the uplink did not stop"

        asyncio.run(main())
    records = [r for r in caplog.records if r.name == UPLINK_LOG]
    assert not [r for r in records if r.levelno >= logging.WARNING], [
        r.getMessage() for r in records
    ]
    lost = [r.getMessage() for r in records if "while stopping" in r.getMessage()]
    assert len(lost) == 1, [r.getMessage() for r in records]


def test_a_broker_lost_while_running_is_still_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=UPLINK_LOG)
    with mosquitto(tmp_path / "broker") as broker:
        up = uplink(section(broker.port), tmp_path / "state")

        async def main() -> None:
            task = asyncio.create_task(up.run())
            await until(lambda: up.stats()["connected"] is True, 10, "connect")
            await asyncio.to_thread(broker.kill)
            await until(lambda: up.stats()["connected"] is False, 10, "the loss")
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=15)
            assert done, "the uplink did not stop"

        asyncio.run(main())
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == UPLINK_LOG and r.levelno == logging.WARNING
    ]
    assert any("lost" in w for w in warnings), warnings
