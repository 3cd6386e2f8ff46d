"""What the agent is made of, as :func:`edge_agent.compose.build_parts` hands it over."""

from __future__ import annotations

from dataclasses import dataclass

from drivers.source import Source
from edge_agent.config import AgentConfig
from edge_agent.memory.stage import MemoryStage
from edge_agent.ota import AgentOta
from edge_agent.reasoning import ReasoningStage
from edge_agent.uplink.publisher import Uplink
from edge_agent.uplink.telemetry import DeltaEncoder, TelemetryAggregator


@dataclass(frozen=True)
class UplinkParts:
    """The uplink and what feeds it telemetry (``[uplink] enabled``)."""

    uplink: Uplink
    telemetry: TelemetryAggregator
    delta: DeltaEncoder | None


@dataclass(frozen=True)
class AgentParts:
    """Everything :class:`Agent` runs, made from one config by :func:`build_parts`."""

    config: AgentConfig
    stage: ReasoningStage | None
    memory: MemoryStage | None
    sources: list[Source]
    ota: AgentOta | None
    uplink: UplinkParts | None
