"""Offers a new lead cannot know were sent: held until the device has had time to answer.

A leader saves a step's offers under its epoch, hands them to the broker, then records them
as sent (``DeviceRun.sent_ns``). The broker and the store cannot commit together, so a
leader killed between the send and the record leaves offers that the next one cannot tell
from offers never sent. The device can: an agent that gets an offer answers at once
(``fetching`` on ``ota/status``), and that report moves it out of ``offered``. So the next
lead holds each such offer and sends it again only once the device has been online for
:data:`RESEND_GRACE_S` without a report. An offline device's persistent session keeps an
offer that was sent, so its grace counts from the step that first sees it online.

Pure: the orchestrator passes the rollouts, which held devices are online, and ``now``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fleet.rollout.machine import Rollout

#: How long an online device may take to answer an offer that may have reached it before
#: the offer goes again: the agent's outbox flush (1 s), the ingest's commit, the
#: orchestrator's tick, with room for a busy broker. Far under any device timeout.
RESEND_GRACE_S = 15.0


@dataclass
class _Held:
    offered_ns: int
    #: The first step that saw the device online since it was held or last offline.
    online_since: int | None = None


class HeldOffers:
    """The ``(rollout, device)`` offers saved but not recorded as sent, under one lead."""

    def __init__(self, grace_s: float = RESEND_GRACE_S) -> None:
        self.grace_ns = int(grace_s * 1e9)
        self._held: dict[tuple[str, str], _Held] = {}

    def hold(self, rollouts: Mapping[str, Rollout]) -> int:
        """Start over from the stored rollouts (a new lead, or this process started): hold
        every offer of a running or paused rollout that is not known to be sent. Returns
        how many are held."""
        self._held = {
            (rid, d.device): _Held(d.offered_ns)
            for rid, r in rollouts.items()
            if r.state in ("running", "paused")
            for d in r.devices.values()
            if _unrecorded(r, d.device)
        }
        return len(self._held)

    def devices(self) -> set[str]:
        """The devices whose online state :meth:`due` needs."""
        return {device for _, device in self._held}

    def due(
        self, rollouts: Mapping[str, Rollout], online: Mapping[str, bool], now: int
    ) -> list[tuple[str, str]]:
        """The held offers to send again now, dropped from the hold. An offer leaves the
        hold without a send when its device answered (or was offered anew, or the record
        came), or its rollout stopped; a paused rollout's offers wait for its resume."""
        out: list[tuple[str, str]] = []
        for key, held in list(self._held.items()):
            rid, device = key
            r = rollouts.get(rid)
            if r is None or r.state not in ("running", "paused") or not _unrecorded(r, device):
                del self._held[key]
                continue
            if r.devices[device].offered_ns != held.offered_ns:
                del self._held[key]  # offered again since: that offer has its own record
                continue
            if not online.get(device, False):
                held.online_since = None
                continue
            if held.online_since is None:
                held.online_since = now
            if r.state == "running" and now - held.online_since >= self.grace_ns:
                del self._held[key]
                out.append(key)
        return sorted(out)


def _unrecorded(r: Rollout, device: str) -> bool:
    d = r.devices.get(device)
    return d is not None and d.state == "offered" and d.attempts > 0 and d.sent_ns < d.offered_ns


__all__ = ["RESEND_GRACE_S", "HeldOffers"]
