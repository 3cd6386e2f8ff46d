"""The deliberately slow model variant, ``models/motor_drive_slow`` (an OTA probation test model).

It must be a model the agent accepts (same signals, window, rate, labels, features and
tensors as the default model, so ``ReasoningStage.prepare`` takes it), that mostly says
``normal`` on normal running, and whose invoke is many times slower than the default's: the
"too slow" new version a probation window has to catch. Runtime only, no TensorFlow.

The one speed check is a ratio of medians measured here, interleaved, in the same process:
a shared, noisy machine slows both models alike, and the margin is wide (~30x measured
against the 3x asserted).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest

from edge_agent.config import AgentConfig, load_config
from edge_agent.reasoning import ReasoningStage
from edge_agent.service import build_stage
from edge_agent.simwindows import plant_windows
from models import DEFAULT_MODEL_DIR, LoadedModel, load_model

pytestmark = pytest.mark.peers

SLOW_DIR = DEFAULT_MODEL_DIR.parent / "motor_drive_slow"
EXAMPLE_CONFIG = Path(__file__).parents[1] / "examples" / "agent.toml"
#: Normal running from plant seeds the training pipeline never uses (it uses 1-600 and
#: 100_001 and up): ten operating profiles, a minute each.
NORMAL_SEEDS = range(7001, 7011)
NORMAL_SECONDS = 60.0


@pytest.fixture(scope="module")
def default() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def slow() -> LoadedModel:
    return load_model(SLOW_DIR)


@pytest.fixture(scope="module")
def config() -> AgentConfig:
    return load_config(EXAMPLE_CONFIG)


def _agent_stage(config: AgentConfig, model: LoadedModel) -> ReasoningStage:
    """A stage made as ``build_stage`` makes it, for a model already loaded."""
    rc = config.reasoning
    return ReasoningStage(model, rc.rules, perception=config.perception, breaker=rc.breaker)


def test_same_contract_as_the_default_model(default: LoadedModel, slow: LoadedModel) -> None:
    new, old = slow.manifest, default.manifest
    assert new.name == old.name
    assert new.version == "3.0.0"
    assert new.training["variant"] == "slow"
    assert slow.sha256 != default.sha256
    assert (new.signals, new.window, new.rate_hz, new.labels) == (
        old.signals,
        old.window,
        old.rate_hz,
        old.labels,
    )
    # Same feature definition and constants (from the same normal training windows).
    assert new.features.describe() == old.features.describe()
    assert dict(new.mean) == dict(old.mean)
    assert dict(new.std) == dict(old.std)
    assert new.input == old.input
    assert new.output == old.output
    assert set(new.thresholds) == set(new.anomaly_labels)
    # Small enough to commit and to ship in an OTA bundle.
    assert (SLOW_DIR / new.file).stat().st_size == new.size_bytes < 2 * 1024 * 1024
    # Much more work per window: that is where the time goes.
    assert new.training["params"] > 50 * old.training["params"]


def test_the_agent_builds_its_stage_on_it(config: AgentConfig, slow: LoadedModel) -> None:
    with_slow = dataclasses.replace(
        config, reasoning=dataclasses.replace(config.reasoning, model_dir=SLOW_DIR)
    )
    stage = build_stage(with_slow)
    assert stage.model.sha256 == slow.sha256
    assert stage.model.manifest.version == "3.0.0"


def test_it_hot_swaps_in_for_the_default_model(
    config: AgentConfig, default: LoadedModel, slow: LoadedModel
) -> None:
    stage = _agent_stage(config, default)
    old = stage.swap(stage.prepare(slow))
    assert old is default
    assert stage.model is slow
    window = next(iter(plant_windows(seed=NORMAL_SEEDS[0], seconds=1.0, spec=config.perception)))
    decision = stage.process(window, window.end_ns)
    assert decision.model_ran
    assert decision.model_sha256 == slow.sha256


def test_bare_invoke_is_many_times_slower(default: LoadedModel, slow: LoadedModel) -> None:
    windows = list(plant_windows(seed=NORMAL_SEEDS[0], seconds=10.0))
    inputs = [default.quantize(default.features(w.values)) for w in windows]
    for x in inputs:  # warm both interpreters and caches
        default.invoke_int8(x)
        slow.invoke_int8(x)
    times: dict[str, list[int]] = {"default": [], "slow": []}
    for i in range(200):
        x = inputs[i % len(inputs)]
        # Interleaved: a burst of load from a neighbour hits both models alike.
        for name, model in (("default", default), ("slow", slow)):
            t0 = time.perf_counter_ns()
            model.invoke_int8(x)
            times[name].append(time.perf_counter_ns() - t0)
    ratio = float(np.median(times["slow"])) / float(np.median(times["default"]))
    assert ratio >= 3.0, (ratio, {k: float(np.median(v)) for k, v in times.items()})


def test_normal_running_is_mostly_labelled_normal(
    config: AgentConfig, default: LoadedModel, slow: LoadedModel
) -> None:
    windows = [
        w
        for seed in NORMAL_SEEDS
        for w in plant_windows(seed=seed, seconds=NORMAL_SECONDS, spec=config.perception)
    ]
    assert len(windows) > 900
    results = {}
    for name, model in (("default", default), ("slow", slow)):
        stage = _agent_stage(config, model)
        decisions = [stage.process(w, w.end_ns + 25_000_000) for w in windows]
        normal = sum(d.label == "normal" for d in decisions) / len(decisions)
        raised = sum(len(d.raised) for d in decisions)
        results[name] = (normal, raised)
    normal, raised = results["slow"]
    assert normal >= 0.90, results
    # No alarm storm: about as few raised alarms as the default model on the same running.
    assert raised <= results["default"][1] + 2, results
