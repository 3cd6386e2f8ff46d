"""The demo's logged lines for rollouts: a line per wave and per device step and outcome,
made from real rollouts driven through the rollout state machine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from fleet.rollout import machine as m

REPO = Path(__file__).resolve().parents[1]
S = 1_000_000_000


def demo_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("demo_fleet", REPO / "scripts" / "demo_fleet.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_fleet"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def report(r: m.Rollout, device: str, seq: int, state: str, now: int, **kw: Any) -> m.Rollout:
    return m.on_status(
        r, device=device, boot_id="b", seq=seq, bundle_id=r.bundle_id, state=state,
        reason=kw.get("reason", ""), detail=kw.get("detail", {}), t_ns=now, received_ns=now,
        now_ns=now,
    )  # fmt: skip


def test_a_line_per_wave_and_per_device_step_and_outcome() -> None:
    events = demo_module().rollout_events
    seen: dict[tuple[object, ...], object] = {}
    r = m.create(
        "r1", bundle_id="model-2.0.0", version="2.0.0", kind="model", sha256="0" * 64,
        length=1, waves=[["gw-01"], ["gw-02", "gw-03"]],
        params=m.Params(waves=(0.34, 1.0), min_devices=1, max_failure=0.0), now_ns=0,
    )  # fmt: skip
    r, _ = m.tick(r, 1 * S)
    lines = events([r], seen)
    assert lines == [
        "rollout r1 (2.0.0): created: 3 devices in 2 waves (1/2)",
        "rollout r1 (2.0.0): wave 1 started: 1 device(s)",
        "rollout r1: gw-01 offered 2.0.0",
    ]
    assert events([r], seen) == []  # nothing new, nothing said
    r = report(r, "gw-01", 1, "fetching", 2 * S)
    r = report(r, "gw-01", 2, "probation", 3 * S)
    assert events([r], seen) == ["rollout r1: gw-01 probation 2.0.0"]
    r = report(r, "gw-01", 3, "committed", 4 * S, reason="probation passed")
    r, _ = m.tick(r, 5 * S)
    assert events([r], seen) == [
        "rollout r1 (2.0.0): wave 1 passed: 1/1 committed",
        "rollout r1 (2.0.0): wave 2 started: 2 device(s)",
        "rollout r1: gw-01 committed 2.0.0",
        "rollout r1: gw-02 offered 2.0.0",
        "rollout r1: gw-03 offered 2.0.0",
    ]
    why = "latency regression: reasoning median 349 µs per window against 121 µs before"
    r = report(r, "gw-02", 1, "rolled_back", 6 * S, reason=why)
    r, _ = m.tick(r, 7 * S)
    lines = events([r], seen)
    assert f"rollout r1: gw-02 rolled_back 2.0.0: {why}" in lines
    assert any(line.startswith("rollout r1 (2.0.0): halted: ") for line in lines), lines
