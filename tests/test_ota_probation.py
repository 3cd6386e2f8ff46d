"""A bundle's probation must be reachable on the device it targets (DESIGN.md section 5):
the arithmetic, the defaults against the example config, and the device refusing a probation
it cannot pass before staging it (never a rollback after the fact). ``fleet bundle build``'s
side is in ``test_fleet_bundle.py``."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from edge_agent.compose import build_agent
from edge_agent.config import load_config
from edge_agent.fleetsim import SimAgent, sim_config
from ota import build
from ota.errors import ProbationUnreachable
from ota.manifest import Probation
from ota.probation import (
    REGRESSION_MIN_WINDOWS,
    Baseline,
    Observation,
    judge,
    min_seconds,
    unreachable,
)
from ota.store import ContentStore
from ota.trust import load_root
from ota.verify import Policy, verify_bundle
from tests.support.ota import DEVICE_TYPE, Signer, model_members
from tests.support.ota_agent import ota_config

pytestmark = pytest.mark.peers

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agent.toml"
#: The example config's grid: 100 Hz, a 64-step window every 64 steps.
EXAMPLE_RATE = 100 / 64


def test_unreachable_says_the_numbers_and_the_fix() -> None:
    assert unreachable(Probation(seconds=3, min_windows=10), EXAMPLE_RATE) == (
        "probation 3 s scores ~4.7 windows at 1.56 windows/s; at least 10 needed: "
        "raise probation.seconds to >= 7"
    )
    assert min_seconds(10, EXAMPLE_RATE) == 7
    assert unreachable(Probation(seconds=7, min_windows=10), EXAMPLE_RATE) == ""
    # Exactly enough is enough, whatever the float arithmetic makes of 7 * 10/7.
    assert unreachable(Probation(seconds=7, min_windows=10), 10 / 7) == ""
    assert unreachable(Probation(seconds=6, min_windows=10), 10 / 7) != ""
    # A zero-second probation scores nothing at any rate.
    assert "raise probation.seconds to >= 1" in unreachable(
        Probation(seconds=0, min_windows=1), 10_000.0
    )


def test_the_default_probation_passes_on_the_example_config_with_margin() -> None:
    rate = load_config(EXAMPLE).perception.windows_per_s
    assert rate == EXAMPLE_RATE
    default = Probation()
    assert unreachable(default, rate) == ""
    scored = default.seconds * rate
    assert scored >= 1.5 * default.min_windows, "no margin for a loaded gateway"
    assert scored >= REGRESSION_MIN_WINDOWS, "the latency regression rule would not be judged"
    # What a bundle built without a probation carries is that default.
    signed = build.bundle_signed(
        bundle_id="m",
        kind="model",
        version="1.0.0",
        counter=1,
        expires=datetime.now(UTC) + timedelta(days=1),
        device_types=[DEVICE_TYPE],
        payloads=[],
    )
    assert signed["probation"] == {"seconds": default.seconds}


def test_the_gatekeeper_refuses_an_unreachable_probation_before_staging(tmp_path: Path) -> None:
    signer = Signer()
    members, _ = model_members(tmp_path, "p")
    path = signer.bundle(tmp_path / "m.efb", members, probation={"seconds": 3})
    store = ContentStore(tmp_path / "ota" / "store")
    store.ensure()
    now = datetime.now(UTC)
    policy = Policy(DEVICE_TYPE, "0.1.0", frozenset({"model:swap"}), windows_per_s=EXAMPLE_RATE)
    with pytest.raises(ProbationUnreachable) as info:
        verify_bundle(
            path,
            root=load_root(signer.root_json(), now),
            policy=policy,
            floors={},
            now=now,
            store=store,
            keep_source=True,
        )
    assert str(info.value) == (
        "bundle model-1.1.0: probation 3 s scores ~4.7 windows at 1.56 windows/s on this "
        "device; at least 10 needed: raise probation.seconds to >= 7"
    )
    assert info.value.code == "probation_unreachable"
    assert info.value.permanent
    assert list(store.root.rglob("*")) == [store.bundles], "nothing staged"


def test_the_agent_refuses_it_up_front_and_swaps_nothing(tmp_path: Path) -> None:
    signer = Signer()
    cfg, _, _ = ota_config(tmp_path, signer)
    members, _ = model_members(tmp_path, "p")
    bundle = signer.bundle(tmp_path / "m.efb", members, probation={"seconds": 3})
    agent = build_agent(cfg)
    assert agent.ota is not None
    serving = agent.model_sha256()

    outcome = asyncio.run(agent.ota.install_file(bundle))
    assert (outcome.result, outcome.code) == ("failed", "probation_unreachable")
    assert "probation 3 s scores ~4.7 windows at 1.56 windows/s on this device" in outcome.reason
    up = agent.ota.updater
    assert up.journal.last is not None
    assert up.journal.last.result == "failed"  # refused, not rolled back
    assert "model" not in up.journal.active
    assert not list(up.store.bundles.iterdir()), "nothing staged"
    assert agent.model_sha256() == serving


def test_a_simulated_agent_offers_its_own_window_rate(tmp_path: Path) -> None:
    """SimAgents feed windows at ``window_hz``, not at their config's grid rate."""
    cfg = sim_config(
        device="d1", site="s", state_dir=tmp_path / "d1", broker=("127.0.0.1", 1), trust_root=None
    )
    agent = SimAgent(cfg, window_hz=10.0)
    assert agent.ota is not None
    assert agent.ota.updater.policy.windows_per_s == 10.0


def test_a_new_version_the_breaker_had_to_degrade_fails_as_a_latency_regression() -> None:
    """The demo's slow v3 on a slower host: each window over the reasoning budget, the
    breaker runs it on every k-th window only, so it scores fewer than the 20 windows the
    median rule needs. Before, that passed ("too few windows to judge"); the breaker having
    to step in is the regression."""
    limits = Probation(seconds=20, min_windows=10)
    base = Baseline(p50_us=400.0, rss_bytes=100 << 20)
    seen = Observation(
        windows=31, model_runs=12, errors=0, p50_us=2600.0, p99_us=3100.0,
        rss_bytes=100 << 20, health_ok=3, health_failed=0,
    )  # fmt: skip
    verdict, why = judge(replace(seen, degraded=19), base, limits, started_ns=0, now_ns=21 * 10**9)
    assert verdict == "fail"
    assert "breaker kept the new version out of 19 window(s)" in why
    # The same numbers without the breaker stepping in: too few to judge, a pass.
    verdict, why = judge(seen, base, limits, started_ns=0, now_ns=21 * 10**9)
    assert (verdict, "too few windows" in why) == ("pass", True)
