"""Agents whose field buses are simulated windows: for fleet-scale tests, benches and demos.

A :class:`SimAgent` is the real :class:`~edge_agent.service.Agent` minus acquisition: its
reasoning stage, its MQTT uplink (outbox, ``boot_id``/``seq``, birth and Last Will, one
real connection per device), its OTA updater (fetch from the artifact server, the whole
verification, the journal, hot swap, probation with the health probe in process) are the
agent's own code. Only the windows come from :func:`edge_agent.simwindows.plant_windows`
(the plant simulator through real perception) at ``window_hz``, instead of Modbus and CAN.
Fifty of them fit on two cores; fifty full agents, each polling its own simulated plant at
100 Hz, do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path

from edge_agent.agent_status import RunReport
from edge_agent.compose import build_parts
from edge_agent.config import AgentConfig, parse_config
from edge_agent.perception import Window
from edge_agent.rules import Decision
from edge_agent.service import Agent
from edge_agent.simwindows import plant_windows

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def sim_config(
    *,
    device: str,
    site: str,
    state_dir: Path,
    broker: tuple[str, int],
    trust_root: Path | None,
    device_type: str = "motor-drive-gw",
    extra: str = "",
) -> AgentConfig:
    """The example agent config for one simulated device (paths made absolute).

    :func:`sim_config` makes a device's config from the example one (uplink to the given broker,
    no health API, no memory store, a trust root, ``agent:replace`` not granted).
    """
    text = (EXAMPLES / "agent.toml").read_text()
    host, port = broker
    edits = [
        ('device = "demo-gw-01"', f'device = "{device}"'),
        ('site = "demo-plant"', f'site = "{site}"'),
        ('device_type = "motor-drive-gw"', f'device_type = "{device_type}"'),
        ('state_dir = "../var/demo-gw-01"', f'state_dir = "{state_dir}"'),
        ("[uplink]\nenabled = false", "[uplink]\nenabled = true"),
        ('host = "127.0.0.1"\nport = 1883', f'host = "{host}"\nport = {port}'),
        ("[api]\nenabled = true", "[api]\nenabled = false"),
    ]
    if trust_root is not None:
        edits.append(
            ("[ota]\nenabled = true\n", f'[ota]\nenabled = true\ntrust_root = "{trust_root}"\n')
        )
    for old, new in edits:
        if old not in text:
            raise ValueError(f"examples/agent.toml changed: {old!r} not found")
        text = text.replace(old, new, 1)
    text = text.replace('"../', f'"{EXAMPLES.parent}/')
    text += "\n[memory]\nenabled = false\n"
    return parse_config(text + extra, source=f"{device}.toml", base_dir=EXAMPLES)


@functools.cache
def _windows(seed: int) -> tuple[Window, ...]:
    return tuple(plant_windows(seed=seed, start_s=20.0, seconds=30.0))


class SimAgent(Agent):
    """The agent with simulated windows in place of its sources (see the module docstring)."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        window_hz: float = 10.0,
        seed: int = 3,
        on_decision: Callable[[Decision], None] | None = None,
    ) -> None:
        self.window_hz = window_hz
        self.seed = seed
        # Its OTA probation counts on the simulated window rate, not the config's.
        parts = build_parts(config, windows_per_s=window_hz)
        super().__init__(parts, on_decision=on_decision)

    def windows_per_s(self) -> float:
        return self.window_hz

    def rss_bytes(self) -> int | None:
        # Many SimAgents share one process: its memory is nobody's in particular, so the
        # probation's memory rule is not judged (no figure rather than a wrong one).
        return None

    def sources_up(self) -> dict[str, bool]:
        return {s.name: True for s in self.sources}

    async def run(self, stop: asyncio.Event) -> RunReport:
        # No start-up to wait out: the windows are simulated, the stage is as built.
        if self.stage is not None:
            self.stage.warming = False
        self.settled.set()
        if self.ota is not None:
            await self.ota.start()
        async with asyncio.TaskGroup() as tg:
            uplink = tg.create_task(self.uplink.run(), name="uplink") if self.uplink else None
            feed = tg.create_task(self._feed(stop), name="windows")
            await stop.wait()
            feed.cancel()
            if uplink is not None:
                uplink.cancel()
        return self.report

    async def _feed(self, stop: asyncio.Event) -> None:
        source = _windows(self.seed)
        period = 1.0 / self.window_hz
        step_ns = source[1].start_ns - source[0].start_ns if len(source) > 1 else 640_000_000
        n = 0
        next_t = time.monotonic()
        while not stop.is_set():
            base = source[n % len(source)]
            # Fresh seq and time, the plant's values: a steady stream as from the field buses.
            w = dataclasses.replace(base, seq=n + 1, start_ns=time.time_ns() - step_ns)
            n += 1
            self.report.windows += 1
            self.report.last_window = w
            if self.stage is not None:
                with contextlib.suppress(Exception):
                    self._decide_window(w)
            next_t += period
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))

    def _decide_window(self, w: Window) -> None:
        stage = self.stage
        if stage is None:
            return
        try:
            d = stage.process(w, self.clock_ns(), 0.1, 0.1)
        except Exception:
            self.stage_errors["reasoning"] += 1
            raise
        self.progress["reasoning"] += 1
        self.report.decisions += 1
        if self.ota is not None:
            self.ota.on_decision(d)
        if self._on_decision_cb is not None:
            self._on_decision_cb(d)
