"""Status that tells the truth: a source that cannot reach its device is not up.

Real parts: the agent with a real pymodbus server (stopped under it, or never listening),
a CAN interface that cannot open, a real ``NOTIFY_SOCKET`` and the agent's own metrics.
What must agree: ``/v1/status`` (``sources.*.up``, the unit state, ``last_error``),
``agent.health``, ``edgefleet_source_up`` and systemd's READY/STATUS.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from drivers.specs import RegisterSpec
from edge_agent import service
from edge_agent.compose import build_agent
from edge_agent.config import parse_config
from edge_agent.dashboard import source_state
from edge_agent.sdnotify import Notifier
from edge_agent.service import Agent
from tests.support.agent import notify_socket
from tests.support.modbus_peer import device, start_peer, wait_until
from tests.support.ports import free_port

pytestmark = pytest.mark.peers

ROOT = Path(__file__).parents[1]

CONFIG = """
[agent]
device = "gw-status"
state_dir = "{state}"
stats_interval_s = 60

[perception]
signals = ["voltage", "speed"]

[reasoning]
enabled = false

[api]
enabled = false

[ota]
enabled = false

[[sources.modbus]]
name = "plc"
port = {port}
unit = {unit}
poll_ms = 20
timeout_ms = 100
backoff_min_ms = 50
backoff_max_ms = 200

[[sources.modbus.registers]]
name = "voltage"
address = 0
type = "float32"

[[sources.modbus.registers]]
name = "speed"
address = 2
type = "int16"
"""

CAN = """
[[sources.can]]
name = "bus"
interface = "socketcan"
channel = "edgefleet-none0"
dbc = "{dbc}"
signals = ["current"]
backoff_min_ms = 50
backoff_max_ms = 200
"""


def agent_for(
    tmp_path: Path, port: int, *, unit: int = 1, can: bool = False, notify: bool = True
) -> Agent:
    text = CONFIG.format(state=tmp_path / "state", port=port, unit=unit)
    if can:
        text = text.replace('"speed"]', '"speed", "current"]', 1)
        text += CAN.format(dbc=ROOT / "drivers/sim/motor_drive.dbc")
    # READY/STATUS go to the test's socket (tests.test_agent_service.notify_socket).
    notifier = Notifier(str(tmp_path / "notify.sock") if notify else None)
    return build_agent(parse_config(text, base_dir=tmp_path), notifier=notifier)


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        yield
    finally:
        stop.set()
        await task


def source(agent: Agent, name: str = "plc") -> dict[str, Any]:
    entry: dict[str, Any] = agent.status()["sources"][name]
    return entry


def metric_up(agent: Agent, name: str) -> float:
    text, _ = agent.metrics.render()
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name == "edgefleet_source_up" and s.labels.get("source") == name:
                return float(s.value)
    raise AssertionError(f"no edgefleet_source_up for {name}")


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    await wait_until(cond, timeout=timeout, step=0.02)


def test_a_modbus_device_that_goes_away_is_not_up(tmp_path: Path) -> None:
    """The reported case: data came in, then the device went away; the status said up,
    unit ok and no error. Now: not up, the unit unreachable, the reason in last_error."""

    async def main() -> None:
        peer = await start_peer({1: device()})
        port = peer.port
        peer.write(1, RegisterSpec("voltage", 0, type="float32"), 230.0)
        agent = agent_for(tmp_path, port)
        with notify_socket(tmp_path) as notes:
            async with running(agent):
                await until(lambda: source(agent)["samples"] > 0)
                assert source(agent)["up"] is True
                assert source(agent)["unit.1.state"] == "ok"
                assert agent.status()["agent"]["health"] == "ok"
                assert metric_up(agent, "plc") == 1
                await asyncio.to_thread(notes.wait_for, "READY=1", 5)
                ready = [m for _, m in notes.messages if "READY=1" in m.splitlines()]
                assert "STATUS=running" in ready[0].splitlines()

                await peer.stop()
                await until(lambda: source(agent)["connection_errors"] >= 2)
                st = source(agent)
                assert st["samples"] > 0  # data came in before
                assert st["up"] is False, st
                assert st["unit.1.state"] == "unreachable"
                assert "connection refused" in st["last_error"], st["last_error"]
                assert "connection refused" in st["unit.1.last_error"]
                assert agent.status()["agent"]["health"] == "degraded"
                assert metric_up(agent, "plc") == 0
                assert source_state(st) == ("disconnected", False)

                peer = await start_peer({1: device()}, port=port)
                await until(lambda: source(agent)["up"] is True)
                st = source(agent)
                assert st["unit.1.state"] == "ok"
                assert "connection refused" in st["last_error"]  # the last one, kept
                assert agent.status()["agent"]["health"] == "ok"
        await peer.stop()

    asyncio.run(main())


def test_a_unit_that_never_answers_is_not_up_and_holds_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TCP connects, but unit 7 is not behind the gateway: connected is not up. READY waits
    its grace and then names the source (the contract in docs/INSTALL.md)."""
    monkeypatch.setattr(service, "READY_GRACE_S", 1.0)

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            peer = await start_peer({1: device()})
            stack.push_async_callback(peer.stop)
            agent = agent_for(tmp_path, peer.port, unit=7)
            notes = stack.enter_context(notify_socket(tmp_path))
            await stack.enter_async_context(running(agent))
            await until(lambda: source(agent)["timeouts"] >= 2)
            st = source(agent)
            assert st["connected"] == 1
            assert st["up"] is False, st
            assert st["unit.7.state"] == "backoff"
            assert st["last_error"] == "unit 7 did not answer within 100 ms"
            assert source_state(st) == ("connected, unit 7 backing off", False)
            assert metric_up(agent, "plc") == 0
            await asyncio.to_thread(notes.wait_for, "READY=1", 5)
            ready = [m for _, m in notes.messages if "READY=1" in m.splitlines()]
            assert "STATUS=running; not up yet: plc" in ready[0].splitlines()

    asyncio.run(main())


def test_nothing_listening_and_a_can_bus_that_cannot_open(tmp_path: Path) -> None:
    """Down from the start: a Modbus port where nothing listens, a CAN interface that does
    not exist. Neither is up; each says why (the CAN reason used to be hidden by the
    agent's own empty last_error)."""

    async def main() -> None:
        agent = agent_for(tmp_path, free_port(), can=True, notify=False)
        async with running(agent):
            await until(
                lambda: (
                    source(agent)["connection_errors"] >= 2
                    and source(agent, "bus")["bus_errors"] >= 2
                )
            )
            plc, bus = source(agent), source(agent, "bus")
            assert plc["up"] is False
            assert plc["unit.1.state"] == "unreachable"
            assert plc["last_error"].startswith("cannot connect to 127.0.0.1:")
            assert plc["last_error"].endswith(": connection refused")
            assert bus["up"] is False
            assert bus["state"] in ("backoff", "connecting")
            assert bus["last_error"].startswith("cannot open socketcan edgefleet-none0: ")
            assert metric_up(agent, "bus") == 0
            assert agent.status()["agent"]["health"] == "degraded"

    asyncio.run(main())


def test_the_dashboard_reads_up_not_connected() -> None:
    """An open port with no unit answering is not shown healthy."""
    waiting = {"connected": 1, "up": False, "unit.1.state": "unknown"}
    assert source_state(waiting) == ("connected, no unit answers yet", False)
    assert source_state({**waiting, "up": True, "unit.1.state": "ok"}) == ("connected", True)
