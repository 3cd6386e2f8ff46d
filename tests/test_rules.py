"""Rules: hysteresis table, constraint masks, the dropout rule, the Decision's JSON; breaker."""

import json
import math

import numpy as np
import pytest

from edge_agent.breaker import Breaker, BreakerSpec
from edge_agent.errors import RulesError
from edge_agent.rules import (
    _TRANSITIONS,
    DROPOUT,
    AlarmState,
    AlarmTracker,
    CompiledRules,
    Condition,
    ConstraintRule,
    Decision,
    HysteresisSpec,
    Level,
    Phase,
    RuleFiring,
    RuleSet,
    classify,
    dropout_finding,
    step,
    window_stat,
)

LABELS = ("normal", "drift", "spike", "stuck", "noise")
SIGNALS = ("voltage", "current", "frequency", "speed", "temperature", "vibration")
MODEL_THRESHOLDS = {"drift": 0.5, "spike": 0.6, "stuck": 0.5, "noise": 0.5}


def levels_for(scores: list[float], threshold: float = 0.5, margin: float = 0.1) -> list[Level]:
    return [classify(p, threshold, margin) for p in scores]


def run(spec: HysteresisSpec, scores: list[float]) -> tuple[list[bool], int, int]:
    """Feed one label's scores; return whether it was active after each, raises, clears."""
    tracker = AlarmTracker(spec)
    active = []
    for level in levels_for(scores, margin=spec.margin):
        alarms, _, _ = tracker.update({"drift": level})
        active.append("drift" in alarms)
    return active, tracker.raised_total, tracker.cleared_total


# -- hysteresis -------------------------------------------------------------------------------


def test_transition_table_is_complete() -> None:
    assert set(_TRANSITIONS) == {(p, lv) for p in Phase for lv in Level}


def test_classify_levels_and_nan() -> None:
    assert classify(0.5, 0.5, 0.1) is Level.ABOVE
    assert classify(0.45, 0.5, 0.1) is Level.HOLD
    assert classify(0.39, 0.5, 0.1) is Level.BELOW
    assert classify(math.nan, 0.5, 0.1) is Level.BELOW


def test_raises_after_n_consecutive_and_clears_after_m() -> None:
    spec = HysteresisSpec(raise_after=3, clear_after=2, margin=0.1)
    scores = [0.9, 0.9, 0.9, 0.9, 0.1, 0.1, 0.1]
    active, raised, cleared = run(spec, scores)
    assert active == [False, False, True, True, True, False, False]
    assert (raised, cleared) == (1, 1)


def test_raise_needs_consecutive_windows() -> None:
    spec = HysteresisSpec(raise_after=3, clear_after=2)
    active, raised, _ = run(spec, [0.9, 0.9, 0.2, 0.9, 0.9, 0.45, 0.9, 0.9])
    assert not any(active)
    assert raised == 0


def test_flapping_score_raises_at_most_once() -> None:
    spec = HysteresisSpec(raise_after=2, clear_after=3, margin=0.1)
    # Alternates above / below the threshold for 200 windows: never 2 above in a row.
    _, raised, cleared = run(spec, [0.55, 0.35] * 100)
    assert (raised, cleared) == (0, 0)
    # Flapping between "above" and the hysteresis band once raised: one alarm, no storm.
    _, raised, cleared = run(spec, [0.9, 0.9] + [0.55, 0.45] * 100)
    assert (raised, cleared) == (1, 0)
    # Flapping across the whole band once raised: never clear_after quiet windows in a row.
    _, raised, cleared = run(spec, [0.9, 0.9] + [0.1, 0.1, 0.9] * 60)
    assert (raised, cleared) == (1, 0)


def test_band_restarts_clearing() -> None:
    spec = HysteresisSpec(raise_after=1, clear_after=2, margin=0.2)
    active, raised, cleared = run(spec, [0.9, 0.1, 0.4, 0.1, 0.1])
    # 0.4 is inside [0.3, 0.5): the quiet count starts over after it.
    assert active == [True, True, True, True, False]
    assert (raised, cleared) == (1, 1)


def test_step_is_pure_and_counts() -> None:
    spec = HysteresisSpec(raise_after=2, clear_after=2)
    s0 = AlarmState()
    s1 = step(s0, Level.ABOVE, spec)
    assert s1 == AlarmState(Phase.RAISING, 1)
    assert step(s1, Level.ABOVE, spec) == AlarmState(Phase.RAISED, 0)
    assert s0 == AlarmState()  # untouched


def test_tracker_reports_raised_and_cleared_labels() -> None:
    tracker = AlarmTracker(HysteresisSpec(raise_after=1, clear_after=1))
    alarms, raised, cleared = tracker.update({"spike": Level.ABOVE, "drift": Level.BELOW})
    assert (alarms, raised, cleared) == (frozenset({"spike"}), ("spike",), ())
    # A label missing from the update keeps its state (a window the model skipped).
    alarms, raised, cleared = tracker.update({"drift": Level.BELOW})
    assert (alarms, raised, cleared) == (frozenset({"spike"}), (), ())
    alarms, raised, cleared = tracker.update({"spike": Level.BELOW})
    assert (alarms, raised, cleared) == (frozenset(), (), ("spike",))


def test_tracker_settled_is_every_state_clear_and_verdict_matches_levels() -> None:
    """The stage skips the tracker when verdict() says quiet and settled() holds: both must
    agree with levels() and the states, on any sequence (random, fixed seed)."""
    rng = np.random.default_rng(8)
    rules = RuleSet(hysteresis=HysteresisSpec(raise_after=2, clear_after=3, margin=0.1)).compile(
        LABELS, SIGNALS, MODEL_THRESHOLDS
    )
    tracker = AlarmTracker(rules.hysteresis)
    saw_quiet_unsettled = 0
    for k in range(3000):
        probs = rng.dirichlet(np.ones(len(LABELS)) * 0.3).tolist()
        allowed = (rng.random(len(LABELS)) > 0.1).tolist()
        label, score, quiet = rules.verdict(probs, allowed)
        levels = rules.levels(probs, allowed)
        assert (label, score) == rules.winner(probs, allowed)
        assert quiet == all(level is Level.BELOW for level in levels.values())
        if quiet and not tracker.settled():
            saw_quiet_unsettled += 1
        tracker.update(levels)
        assert tracker.settled() == all(st.phase is Phase.CLEAR for st in tracker.states.values())
        if k == 1500:
            tracker.forget(["spike"])
            assert tracker.settled() == all(
                st.phase is Phase.CLEAR for st in tracker.states.values()
            )
    assert saw_quiet_unsettled > 0  # the case the stage must not skip happened


def test_hysteresis_spec_validation() -> None:
    with pytest.raises(ValueError, match="raise_after"):
        HysteresisSpec(raise_after=0)
    with pytest.raises(ValueError, match="margin"):
        HysteresisSpec(margin=1.0)


# -- constraints ------------------------------------------------------------------------------


def window(temperature: float, **cols: float) -> np.ndarray:
    values = np.ones((64, len(SIGNALS)), dtype=np.float32)
    values[:, SIGNALS.index("temperature")] = temperature
    for name, v in cols.items():
        values[:, SIGNALS.index(name)] = v
    return values


COLD_NO_DRIFT = ConstraintRule(
    "cold-no-drift", "exclude", "drift", Condition("temperature", "mean", "<", 40.0)
)
NOISE_NEEDS_RUNNING = ConstraintRule(
    "noise-needs-speed", "require", "noise", Condition("speed", "max", ">", 100.0)
)


def compiled(*rules: ConstraintRule, **thresholds: float) -> CompiledRules:
    return RuleSet(constraints=rules, thresholds=thresholds).compile(
        LABELS, SIGNALS, MODEL_THRESHOLDS
    )


def test_exclusion_masks_label_while_condition_holds() -> None:
    rules = compiled(COLD_NO_DRIFT)
    allowed, fired = rules.masks(window(25.0))
    assert allowed == [True, False, True, True, True]
    assert fired == [RuleFiring("cold-no-drift", "drift excluded: temperature.mean < 40 (25)")]
    allowed, fired = rules.masks(window(60.0))
    assert all(allowed)
    assert fired == []


def test_require_masks_label_unless_condition_holds() -> None:
    rules = compiled(NOISE_NEEDS_RUNNING)
    allowed, fired = rules.masks(window(50.0, speed=0.0))
    assert allowed == [True, True, True, True, False]
    assert fired == [RuleFiring("noise-needs-speed", "noise requires speed.max > 100; got 0")]
    allowed, _ = rules.masks(window(50.0, speed=1400.0))
    assert all(allowed)


def test_unknown_signal_never_excludes_and_never_satisfies() -> None:
    rules = compiled(COLD_NO_DRIFT, NOISE_NEEDS_RUNNING)
    values = window(float("nan"), speed=float("nan"))
    allowed, _ = rules.masks(values)
    assert allowed[LABELS.index("drift")]  # exclude: no evidence, label stays
    assert not allowed[LABELS.index("noise")]  # require: no evidence, label masked


def test_masked_label_cannot_win_or_alarm() -> None:
    rules = compiled(COLD_NO_DRIFT)
    probs = [0.05, 0.9, 0.02, 0.02, 0.01]
    allowed, _ = rules.masks(window(25.0))
    label, score = rules.winner(probs, allowed)
    assert (label, score) == ("normal", 0.05)
    assert rules.levels(probs, allowed)["drift"] is Level.BELOW
    allowed, _ = rules.masks(window(60.0))
    label, score = rules.winner(probs, allowed)
    assert (label, score) == ("drift", 0.9)
    assert rules.levels(probs, allowed)["drift"] is Level.ABOVE


def test_winner_respects_thresholds_and_overrides() -> None:
    probs = [0.4, 0.0, 0.55, 0.05, 0.0]
    allowed = [True] * 5
    assert compiled().winner(probs, allowed)[0] == "normal"  # spike threshold 0.6
    assert compiled(spike=0.5).winner(probs, allowed)[0] == "spike"


def test_window_stats() -> None:
    col = np.array([np.nan, 1.0, 5.0, 3.0], dtype=np.float32)
    assert window_stat(col, "mean") == 3.0
    assert window_stat(col, "min") == 1.0
    assert window_stat(col, "max") == 5.0
    assert window_stat(col, "last") == 3.0
    assert math.isnan(window_stat(np.full(4, np.nan, dtype=np.float32), "mean"))


def test_compile_rejects_unknown_labels_and_signals() -> None:
    bad = RuleSet(
        constraints=(
            ConstraintRule("a", "exclude", "overheat", Condition("temperature", "mean", "<", 1)),
            ConstraintRule("b", "exclude", "drift", Condition("pressure", "mean", "<", 1)),
        ),
        thresholds={"bogus": 0.5},
    )
    with pytest.raises(RulesError) as info:
        bad.compile(LABELS, SIGNALS, MODEL_THRESHOLDS)
    text = str(info.value)
    assert "reasoning.thresholds.bogus: no such alarm label" in text
    assert "reasoning.rules 'a': label 'overheat' is not an alarm label of the model" in text
    assert "reasoning.rules 'b': signal 'pressure' is not a perception signal" in text


def test_dropout_finding_names_stale_signals() -> None:
    stale = np.zeros(len(SIGNALS), dtype=np.bool_)
    assert dropout_finding(SIGNALS, stale) is None
    stale[[0, 4]] = True
    assert dropout_finding(SIGNALS, stale) == RuleFiring(DROPOUT, "stale: voltage, temperature")


# -- decision ---------------------------------------------------------------------------------


def test_decision_json_shape() -> None:
    d = Decision(
        trace_id="ab" * 16,
        t_ns=1_700_000_000_123_456_789,
        window_seq=7,
        window_start_ns=1_700_000_000_000_000_000,
        model_sha256="f" * 64,
        model_version="1.0.0",
        model_ran=True,
        label="spike",
        score=0.912345678,
        probabilities={"normal": 0.05, "spike": 0.912345678, "drift": float("nan")},
        alarms=frozenset({"spike", DROPOUT}),
        raised=("spike",),
        cleared=(),
        rules_fired=(RuleFiring(DROPOUT, "stale: voltage"),),
        top_signals=(("current", 0.8123456), ("speed", 0.01)),
        attribution="occlusion",
        mode="full",
        stage_latency_ms={"perception": 0.12345, "memory": 0.0, "reasoning": 0.0456789},
    )
    doc = d.to_json()
    text = json.dumps(doc, allow_nan=False, ensure_ascii=False)  # strict JSON: no NaN
    assert json.loads(text) == doc
    assert set(doc) == {
        "trace_id",
        "t_ns",
        "window",
        "model",
        "label",
        "score",
        "probabilities",
        "alarms",
        "raised",
        "cleared",
        "rules_fired",
        "top_signals",
        "attribution",
        "degraded",
        "mode",
        "stage_latency_ms",
    }
    assert doc["window"] == {"seq": 7, "start_ns": 1_700_000_000_000_000_000}
    assert doc["model"] == {"sha256": "f" * 64, "version": "1.0.0", "ran": True}
    assert doc["score"] == 0.9123
    assert doc["probabilities"] == {"normal": 0.05, "spike": 0.9123, "drift": None}
    assert doc["alarms"] == ["dropout", "spike"]
    assert doc["rules_fired"] == [{"rule": "dropout", "reason": "stale: voltage"}]
    assert doc["top_signals"] == [
        {"signal": "current", "contribution": 0.8123},
        {"signal": "speed", "contribution": 0.01},
    ]
    assert doc["stage_latency_ms"] == {"perception": 0.123, "memory": 0.0, "reasoning": 0.046}
    assert doc["degraded"] is False


# -- breaker ----------------------------------------------------------------------------------


def test_breaker_trips_after_n_overruns_and_recovers_after_m() -> None:
    b = Breaker(BreakerSpec(budget_us=100, trip_after=3, recover_after=2, mode="every_k", k=3))
    for latency in (150, 50, 150, 150):  # the 50 breaks the streak
        assert b.should_run()
        assert b.record(latency) == "full"
    assert b.record(150) == "every_k"
    assert b.trips == 1
    # Open: the model runs on every 3rd window only.
    runs = []
    for _ in range(6):
        run_it = b.should_run()
        runs.append(run_it)
        b.record(150 if run_it else None)
    assert runs == [False, False, True, False, False, True]
    assert b.mode == "every_k"
    # Two in-budget runs in a row close it.
    for _ in range(2):
        while not b.should_run():
            b.record(None)
        b.record(50)
    assert b.snapshot()["mode"] == "full"
    assert b.recoveries == 1


def test_overruns_while_the_agent_warms_up_are_counted_but_never_trip_the_breaker() -> None:
    b = Breaker(BreakerSpec(budget_us=100, trip_after=3, recover_after=2))
    for _ in range(5):  # the start-up's slow windows: five overruns in a row
        assert b.record(40_000, warming=True) == "full"
    snap = b.snapshot()
    assert (snap["state"], snap["trips"], snap["overruns"], snap["excused"]) == ("closed", 0, 5, 5)
    # Warm: the streak starts from nothing, and three overruns in a row trip it.
    assert [b.record(150) for _ in range(3)] == ["full", "full", "every_k"]
    assert (b.trips, b.overruns, b.excused) == (1, 8, 5)
    # Open, an excused overrun does not restart the count of in-budget runs either.
    b.record(50)
    b.record(500, warming=True)
    b.record(50)
    assert b.mode == "full"


def test_breaker_rules_only_probes() -> None:
    b = Breaker(BreakerSpec(budget_us=100, trip_after=1, recover_after=1, mode="rules_only"))
    assert b.record(500) == "rules_only"
    skipped = 0
    while not b.should_run():
        b.record(None)
        skipped += 1
    assert skipped == b.spec.probe_every - 1
    assert b.record(10) == "full"
    snap = b.snapshot()
    assert snap["state"] == "closed"
    assert snap["trips"] == 1
