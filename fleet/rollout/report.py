"""A rollout as JSON for people and tools: ``fleet rollout status --json`` and the API."""

from __future__ import annotations

from typing import Any

from fleet.rollout import machine as m


def _device(d: m.DeviceRun) -> dict[str, Any]:
    return {
        "wave": d.wave + 1,
        "state": d.state,
        "attempts": d.attempts,
        "reason": d.reason,
        "code": d.code,
    }


def summary(r: m.Rollout) -> dict[str, Any]:
    """What ``status --json`` prints for one rollout."""
    waves = []
    for k, names in enumerate(r.waves):
        waves.append({"wave": k + 1, "devices": len(names), "states": r.counts(k)})
    return {
        "id": r.id,
        "state": r.state,
        "reason": r.reason,
        "bundle_id": r.bundle_id,
        "version": r.version,
        "kind": r.kind,
        "sha256": r.sha256,
        "wave": r.wave + 1,
        "waves": waves,
        "devices": {d.device: _device(d) for d in r.devices.values()},
        "history": [{"t_ns": t, "event": e} for t, e in r.history],
    }
