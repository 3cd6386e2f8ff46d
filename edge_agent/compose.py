"""The agent's composition root: :func:`build_agent` makes every collaborator from the
config and hands them to :class:`edge_agent.service.Agent`, which only wires and runs them.

Order matters: the state folders first (one line naming a key that cannot be used), then
OTA (its journal says which model is live), the reasoning stage with that model (checked:
contract, known answers), memory, sources and the uplink. How the parts fit: the "Data flow
on the device" section of ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from drivers.source import open_source
from edge_agent import __version__
from edge_agent.config import AgentConfig
from edge_agent.errors import ReasoningError
from edge_agent.gates import uplink_priority
from edge_agent.health_report import state_health
from edge_agent.memory.stage import MemoryStage
from edge_agent.ota import AgentOta
from edge_agent.parts import AgentParts, UplinkParts
from edge_agent.perception import Window
from edge_agent.reasoning import ReasoningStage
from edge_agent.rules import Decision
from edge_agent.sdnotify import Notifier
from edge_agent.service import Agent, build_stage
from edge_agent.statepaths import prepare_state_paths
from edge_agent.uplink.publisher import Uplink
from edge_agent.uplink.telemetry import DeltaEncoder, TelemetryAggregator

log = logging.getLogger("edge_agent.service")


def build_agent(
    config: AgentConfig,
    *,
    clock_ns: Callable[[], int] = time.time_ns,
    on_window: Callable[[Window], None] | None = None,
    on_decision: Callable[[Decision], None] | None = None,
    notifier: Notifier | None = None,
) -> Agent:
    """The agent for ``config``, built and ready to :meth:`Agent.run`.

    Raises :class:`edge_agent.errors.StatePathError` (a state folder it cannot make or
    use) and :class:`edge_agent.errors.ReasoningError` (a model that does not load, does
    not fit the config or fails its known answers): both fatal at start.
    """
    parts = build_parts(config, clock_ns=clock_ns)
    return Agent(
        parts, clock_ns=clock_ns, on_window=on_window, on_decision=on_decision, notifier=notifier
    )


def build_parts(
    config: AgentConfig,
    *,
    clock_ns: Callable[[], int] = time.time_ns,
    windows_per_s: float | None = None,
) -> AgentParts:
    """The agent's collaborators (see :func:`build_agent`; ``windows_per_s`` overrides the
    config's window rate for the OTA probation, as the fleet simulator's agents need)."""
    prepare_state_paths(config)
    rate = config.perception.windows_per_s if windows_per_s is None else windows_per_s
    ota = AgentOta(config, windows_per_s=rate, clock_ns=clock_ns) if config.ota.enabled else None
    stage = _stage_at_start(config, ota) if config.reasoning.enabled else None
    # Opening the store (lock, integrity check, migrations) happens in Agent.run().
    memory = (
        MemoryStage(
            config.memory,
            config.perception.signals,
            state_dir=config.state_dir,
            period_ns=config.perception.period_ns,
            clock_ns=clock_ns,
        )
        if config.memory.enabled
        else None
    )
    sources = [open_source(spec) for spec in config.sources]
    uplink = _uplink_parts(config, stage, ota, clock_ns) if config.uplink.enabled else None
    return AgentParts(config, stage, memory, sources, ota, uplink)


def _stage_at_start(config: AgentConfig, ota: AgentOta | None) -> ReasoningStage:
    """The stage with the model the OTA journal says is live (else the configured one)."""
    ota_model = ota.model_dir_at_start() if ota is not None else None
    if ota_model is not None:
        ota_config = replace(config, reasoning=replace(config.reasoning, model_dir=ota_model))
        try:
            stage = build_stage(ota_config)
        except ReasoningError as exc:
            log.error("ota: the active OTA model does not load (%s); the factory one runs", exc)
        else:
            if ota is not None:
                ota.serving_model = ota_model.name
            return stage
    stage = build_stage(config)
    if ota is not None:
        ota.factory_sha = stage.model.sha256
    return stage


def _uplink_parts(
    config: AgentConfig,
    stage: ReasoningStage | None,
    ota: AgentOta | None,
    clock_ns: Callable[[], int],
) -> UplinkParts:
    up = config.uplink
    signals = config.perception.signals

    def on_command(name: str, payload: bytes) -> None:
        if name == "ota" and ota is not None:
            ota.on_command(name, payload)
        else:
            log.info("command %r ignored (no handler)", name[:128])

    try:
        priority: int | None = uplink_priority(config.gate_control_list)
    except KeyError:  # the schedule has no uplink traffic class
        priority = None
    uplink = Uplink(
        up,
        site=config.agent.site,
        device=config.agent.device,
        device_type=config.agent.device_type,
        agent_version=__version__,
        state_dir=config.state_dir,
        model_sha256=lambda: stage.model.sha256 if stage is not None else "",
        model_health=lambda: state_health(stage),
        priority=priority,
        clock_ns=clock_ns,
        on_command=on_command,
    )
    delta = (
        DeltaEncoder(
            signals,
            default_deadband=up.delta.default_deadband,
            deadband=up.delta.deadband,
            keyframe_every=up.delta.keyframe_every,
        )
        if up.delta.enabled
        else None
    )
    return UplinkParts(
        uplink, TelemetryAggregator(signals, up.telemetry_period_ms * 1_000_000), delta
    )
