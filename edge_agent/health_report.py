"""What the agent does with the serving model's health: the I/O side of :mod:`edge_agent.ood`
and of the input contract (:mod:`edge_agent.acquisition`).

The reasoning stage decides (pure); this logs, stores and publishes: a notice is logged
once (WARNING when raised), stored as a memory event (``model_out_of_distribution``,
``model_out_of_distribution_cleared``, ``alarm_storm``, ``alarm_storm_cleared``) and makes
the uplink publish its retained ``online`` state again, whose ``model_health`` the fleet
keeps per device; the decision itself carries the notice upstream.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge_agent.acquisition import ContractReport
    from edge_agent.memory.stage import MemoryStage
    from edge_agent.reasoning import ReasoningStage
    from edge_agent.rules import Decision
    from edge_agent.uplink.publisher import Uplink

log = logging.getLogger(__name__)


def report_notices(d: Decision, memory: MemoryStage | None, uplink: Uplink | None) -> None:
    """``d.notices``: logged, stored as memory events, and the state published again."""
    for n in d.notices:
        text = f"{n.kind} {n.state}" + (f": {n.reason}" if n.reason else "")
        if n.state == "raised":
            log.warning("reasoning: %s (decisions are marked until it clears)", text)
        else:
            log.info("reasoning: %s", text)
        if memory is not None:
            memory.record_event(
                n.kind if n.state == "raised" else f"{n.kind}_cleared",
                t_ns=d.t_ns,
                signal=n.signals[0] if len(n.signals) == 1 else None,
                detail=n.to_json(),
            )
    if uplink is not None:
        uplink.announce()


def state_health(stage: ReasoningStage | None) -> dict[str, object] | None:
    """The serving model's health for the retained state (None when all is well)."""
    if stage is None:
        return None
    h = stage.health
    mismatch = stage.prepared.acquisition_mismatch
    if not (h.ood.active or h.storm.active or mismatch):
        return None
    return {
        "ood": list(h.ood.active),
        "alarm_storm": h.storm.active,
        "acquisition_mismatch": mismatch,
    }


def log_contract(report: ContractReport | None) -> None:
    """Once per model put in service: a contract run anyway, or one that was not checked."""
    if report is None:
        return
    if report.mismatch and report.accepted:
        log.warning(
            "reasoning: %s runs although this config does not deliver its inputs as it was "
            'trained ([reasoning] acquisition = "accept-mismatch"); every decision is marked '
            "acquisition_mismatch: %s",
            report.model,
            "; ".join(str(f) for f in report.errors),
        )
    elif not report.checked:
        log.info("reasoning: %s: %s", report.model, "; ".join(report.notes))


__all__ = ["log_contract", "report_notices", "state_health"]
