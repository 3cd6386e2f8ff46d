"""The reasoning stage on real windows of the simulated plant, with the committed model.

No mocks of our own code: windows come from :mod:`drivers.sim.plant` through real
perception (:func:`edge_agent.simwindows.plant_windows`), scores from the committed INT8
model. The one fake is :class:`SlowModel`, the real model plus a sleep, to drive the breaker.
"""

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from drivers.sim.plant import SIGNALS, parse_anomaly
from edge_agent.breaker import BreakerSpec
from edge_agent.errors import ModelMismatch
from edge_agent.perception import PerceptionSpec, Window
from edge_agent.reasoning import DropOldestQueue, ReasoningStage
from edge_agent.rules import (
    DROPOUT,
    AlarmTracker,
    Condition,
    ConstraintRule,
    Decision,
    HysteresisSpec,
    Level,
    RuleSet,
)
from edge_agent.simwindows import T0_NS, plant_windows
from models import LoadedModel, ModelManifest, load_model
from models.copies import copy_with_new_sha
from models.errors import ModelRejected
from models.runtime import ColumnMedian

pytestmark = pytest.mark.peers

#: Spike heights that stand well out of each signal's noise (signal units).
SPIKE = {
    "voltage": 40,
    "current": 8,
    "frequency": 6,
    "speed": 200,
    "temperature": 6,
    "vibration": 3,
}


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return load_model()


def decide_all(stage: ReasoningStage, windows: Iterator[Window]) -> list[Decision]:
    return [stage.process(w, w.end_ns + 25_000_000, perception_ms=0.1) for w in windows]


def raised(decisions: list[Decision], label: str) -> list[Decision]:
    return [d for d in decisions if label in d.raised]


class SlowModel:
    """The real model; ``predict`` first sleeps ``delay_s``. The only fake in these tests."""

    def __init__(self, model: LoadedModel) -> None:
        self.inner = model
        self.delay_s = 0.0

    @property
    def manifest(self) -> ModelManifest:
        return self.inner.manifest

    @property
    def sha256(self) -> str:
        return self.inner.sha256

    def predict(self, values: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.inner.predict(values)


# -- scoring, attribution, rules --------------------------------------------------------------


def test_normal_plant_raises_no_alarm(model: LoadedModel) -> None:
    stage = ReasoningStage(model, RuleSet())
    decisions = decide_all(stage, plant_windows(seed=1, seconds=60))
    assert len(decisions) == 93
    assert not [d for d in decisions if d.raised], [d.raised for d in decisions if d.raised]
    for d in decisions:
        assert d.model_ran
        assert d.mode == "full"
        assert not d.degraded
        assert d.model_sha256 == model.sha256
        assert set(d.probabilities) == set(model.manifest.labels)
        assert abs(sum(d.probabilities.values()) - 1.0) < 0.02
        if d.label == "normal":
            assert d.top_signals == ()
            assert d.attribution == "none"


@pytest.mark.parametrize("signal", ["current", "speed", "vibration"])
def test_spike_raises_one_alarm_naming_the_signal(model: LoadedModel, signal: str) -> None:
    stage = ReasoningStage(model, RuleSet())
    anomaly = parse_anomaly(f"spike:{signal}@20+8x{SPIKE[signal]}")
    decisions = decide_all(stage, plant_windows(seed=1, anomalies=[anomaly], seconds=40))
    (alarm,) = raised(decisions, "spike")
    assert alarm.label == "spike"
    assert alarm.attribution == "occlusion"
    assert alarm.top_signals[0][0] == signal, alarm.top_signals
    assert 0.0 < alarm.top_signals[0][1] <= 1.0
    # Inside the anomaly and nowhere else.
    assert 20e9 <= alarm.window_start_ns - T0_NS <= 28e9
    # Every spike verdict blames the spiking signal first.
    spikes = [d for d in decisions if d.label == "spike"]
    assert all(d.top_signals[0][0] == signal for d in spikes)
    # The alarm clears after the anomaly, once.
    assert len([d for d in decisions if "spike" in d.cleared]) == 1
    assert "spike" not in decisions[-1].alarms


def test_stuck_signal_is_named(model: LoadedModel) -> None:
    stage = ReasoningStage(model, RuleSet(hysteresis=HysteresisSpec(raise_after=1)))
    anomaly = parse_anomaly("stuck:current@30+8")
    decisions = decide_all(
        stage, plant_windows(seed=2, anomalies=[anomaly], start_s=25, seconds=20)
    )
    stuck = [d for d in decisions if d.label == "stuck"]
    assert stuck, dict(stage.stats.labels)
    assert raised(decisions, "stuck")
    assert all(30e9 <= d.window_start_ns - T0_NS < 38e9 for d in stuck)
    # Most stuck verdicts blame the stuck signal first.
    blamed = [d.top_signals[0][0] for d in stuck if d.top_signals]
    assert blamed.count("current") > len(blamed) / 2, blamed


@pytest.mark.parametrize(
    "stuck", [("current", "speed"), ("current", "speed", "vibration")], ids=["two", "three"]
)
def test_several_stuck_signals_are_named_by_keep_one(
    model: LoadedModel, stuck: tuple[str, ...]
) -> None:
    """Occluding one of several stuck signals leaves a stuck window, so occlusion names
    nobody; the converse (only that signal left as it was) names the stuck ones."""
    stage = ReasoningStage(model, RuleSet())
    anomalies = [parse_anomaly(f"stuck:{s}@10+20") for s in stuck]
    decisions = decide_all(stage, plant_windows(seed=7, anomalies=anomalies, seconds=40))
    alarms = [d for d in decisions if d.label == "stuck"]
    assert len(alarms) >= 20, dict(stage.stats.labels)
    assert all(d.top_signals for d in alarms), "a stuck alarm named no signal"
    assert all(d.attribution == "keep_one" for d in alarms)
    threshold = model.manifest.thresholds["stuck"]
    # Frequency is the drive's: it follows a stuck speed.
    allowed = {*stuck, "frequency"}
    for d in alarms:
        names = {n for n, _ in d.top_signals}
        assert names <= allowed, d.top_signals
        assert all(threshold <= p <= 1.0 for _, p in d.top_signals), d.top_signals
    named_all = [d for d in alarms if set(stuck) <= {n for n, _ in d.top_signals}]
    assert len(named_all) >= 0.9 * len(alarms)


def test_exclusion_rule_masks_the_label(model: LoadedModel) -> None:
    never_spike = ConstraintRule(
        "no-spike-while-turning", "exclude", "spike", Condition("speed", "max", ">", 100.0)
    )
    stage = ReasoningStage(model, RuleSet(constraints=(never_spike,)))
    anomaly = parse_anomaly("spike:current@20+8x8")
    decisions = decide_all(stage, plant_windows(seed=1, anomalies=[anomaly], seconds=40))
    assert not raised(decisions, "spike")
    assert all(d.label != "spike" for d in decisions)
    masked = [d for d in decisions if d.rules_fired]
    assert masked
    assert masked[0].rules_fired[0].rule == "no-spike-while-turning"
    assert masked[0].rules_fired[0].reason.startswith("spike excluded: speed.max > 100 (")
    # The model still saw the spike: the probability is there, the verdict is not.
    assert max(d.probabilities["spike"] for d in masked) > 0.9


def test_require_rule_allows_the_label_only_when_it_holds(model: LoadedModel) -> None:
    def run(threshold: float) -> list[Decision]:
        rule = ConstraintRule(
            "spike-needs-load", "require", "spike", Condition("current", "mean", ">", threshold)
        )
        stage = ReasoningStage(model, RuleSet(constraints=(rule,)))
        anomaly = parse_anomaly("spike:voltage@20+8x40")
        return decide_all(stage, plant_windows(seed=1, anomalies=[anomaly], seconds=40))

    assert raised(run(0.0), "spike")  # the motor runs: condition holds, alarm as usual
    held_back = run(1000.0)  # never holds: label masked
    assert not raised(held_back, "spike")
    assert any(
        r.reason.startswith("spike requires current.mean > 1000") for r in held_back[40].rules_fired
    )


def test_dropout_rule_names_the_stale_signal(model: LoadedModel) -> None:
    stage = ReasoningStage(model, RuleSet())
    anomaly = parse_anomaly("dropout:voltage@20+3")
    decisions = decide_all(stage, plant_windows(seed=1, anomalies=[anomaly], seconds=30))
    (alarm,) = raised(decisions, DROPOUT)
    assert alarm.rules_fired[-1].rule == DROPOUT
    assert alarm.rules_fired[-1].reason == "stale: voltage"
    assert len([d for d in decisions if DROPOUT in d.cleared]) == 1
    # The held value of the dead signal is not scored as a stuck sensor: not while it is
    # stale, nor in the window where it comes back (its start is still the held value).
    assert "stuck" not in {d.label for d in decisions}, [d.label for d in decisions]
    assert [d.raised for d in decisions if d.raised] == [(DROPOUT,)]


def test_perception_columns_are_picked_by_name(model: LoadedModel) -> None:
    """Perception may carry more signals, in any order, than the model needs."""
    spec = PerceptionSpec(signals=("ramp_state", *reversed(SIGNALS)), window=64)
    stage = ReasoningStage(model, RuleSet(), perception=spec)
    plain = ReasoningStage(model, RuleSet())
    spike = parse_anomaly("spike:speed@10+5x200")
    for w in plant_windows(seed=1, seconds=20, anomalies=[spike]):
        wide = np.concatenate([np.zeros((64, 1), np.float32), w.values[:, ::-1]], axis=1)
        moved = Window(
            seq=w.seq,
            start_ns=w.start_ns,
            period_ns=w.period_ns,
            signals=spec.signals,
            values=wide,
            stale=np.zeros(7, dtype=np.bool_),
            completeness=1.0,
            jitter_ms=np.zeros(7, dtype=np.float32),
        )
        a, b = stage.process(moved, 0), plain.process(w, 0)
        assert a.probabilities == b.probabilities
        assert a.top_signals == b.top_signals


def test_batched_occlusion_names_what_one_run_per_signal_names(model: LoadedModel) -> None:
    """The model's one batched occlusion run and a scorer without it (one predict() per
    signal, the fallback) give the same attribution, on every kind of fault."""
    faults = [
        parse_anomaly(a)
        for a in (
            "spike:current@10+4x8",
            "stuck:speed@22+6",
            "noise:vibration@34+6x2",
            "drift:voltage@46+12x30",
            "dropout:temperature@62+3",
        )
    ]
    windows = list(plant_windows(seed=3, seconds=70, anomalies=faults))
    batched = decide_all(ReasoningStage(model, RuleSet()), iter(windows))
    one_by_one = decide_all(ReasoningStage(SlowModel(model), RuleSet()), iter(windows))
    alarms = [d for d in batched if d.label != "normal"]
    assert len({d.label for d in alarms}) >= 3, [d.label for d in alarms]
    assert all(d.attribution == "occlusion" and d.top_signals for d in alarms)
    assert [(d.label, d.top_signals) for d in batched] == [
        (d.label, d.top_signals) for d in one_by_one
    ]


def test_column_median_is_numpys_median() -> None:
    rng = np.random.default_rng(5)
    for rows in (64, 63, 2, 1):
        median = ColumnMedian(rows, 6)
        for _ in range(3):
            x = (rng.standard_normal((rows, 6)) * 50 + 230).astype(np.float32)
            x[:, 1] = np.round(x[:, 1])  # ties
            x[:, 2] = x[0, 2]  # a flat column
            kept = x.copy()
            got = median(x)
            np.testing.assert_array_equal(got, np.median(x, axis=0))
            assert got.dtype == np.float32
            np.testing.assert_array_equal(x, kept)  # the window itself is left alone


def test_tracker_active_set_follows_raise_clear_and_forget() -> None:
    tracker = AlarmTracker(HysteresisSpec(raise_after=1, clear_after=1))
    assert tracker.update({"spike": Level.ABOVE, "stuck": Level.ABOVE})[:2] == (
        frozenset({"spike", "stuck"}),
        ("spike", "stuck"),
    )
    assert tracker.update({"spike": Level.BELOW, "stuck": Level.HOLD}) == (
        frozenset({"stuck"}),
        (),
        ("spike",),
    )
    tracker.forget(["spike"])
    assert tracker.active() == frozenset()
    assert tracker.update({"spike": Level.BELOW})[0] == frozenset()


# -- breaker ----------------------------------------------------------------------------------


def test_breaker_trips_to_rules_only_and_recovers(model: LoadedModel) -> None:
    slow = SlowModel(model)
    spec = BreakerSpec(
        budget_us=2000, trip_after=3, recover_after=2, mode="rules_only", probe_every=4
    )
    stage = ReasoningStage(slow, RuleSet(), breaker=spec)
    windows = list(
        plant_windows(seed=1, seconds=40, anomalies=[parse_anomaly("dropout:voltage@3+10")])
    )
    slow.delay_s = 0.004  # twice the budget
    modes = [stage.process(w, 0).mode for w in windows[:3]]
    assert modes == ["full", "full", "full"]
    assert stage.breaker.mode == "rules_only"
    # Degraded: rules only, the model probes one window in four.
    degraded = [stage.process(w, 0) for w in windows[3:23]]
    assert all(d.mode == "rules_only" and d.degraded for d in degraded)
    assert [d.model_ran for d in degraded[:8]] == [False, False, False, True] * 2
    skipped = [d for d in degraded if not d.model_ran]
    assert all(d.probabilities == {} for d in skipped)
    # Rules keep working without the model: the dropout is reported.
    assert any(DROPOUT in d.alarms for d in skipped)
    assert any(r.reason == "stale: voltage" for d in skipped for r in d.rules_fired)
    # Fast again: two probes within budget close the breaker.
    slow.delay_s = 0.0
    after = [stage.process(w, 0) for w in windows[23:40]]
    assert after[-1].mode == "full"
    assert all(d.model_ran for d in after[-5:])
    snap = stage.snapshot()["breaker"]
    assert isinstance(snap, dict)
    assert (snap["trips"], snap["recoveries"], snap["state"]) == (1, 1, "closed")


def test_breaker_every_k(model: LoadedModel) -> None:
    slow = SlowModel(model)
    spec = BreakerSpec(budget_us=2000, trip_after=2, recover_after=3, mode="every_k", k=3)
    stage = ReasoningStage(slow, RuleSet(), breaker=spec)
    windows = list(plant_windows(seed=1, seconds=30))
    slow.delay_s = 0.004
    ds = [stage.process(w, 0) for w in windows[:11]]
    assert [d.model_ran for d in ds] == [True, True] + [False, False, True] * 3
    assert ds[-1].mode == "every_k"
    # A skipped window repeats the last verdict, marked as not scored.
    assert ds[2].label == ds[1].label
    assert not ds[2].model_ran


# -- queue ------------------------------------------------------------------------------------


def test_queue_drops_oldest_and_counts() -> None:
    q: DropOldestQueue[int] = DropOldestQueue(2)
    assert q.put_nowait(1) is None
    assert q.put_nowait(2) is None
    assert q.put_nowait(3) == 1
    assert (len(q), q.dropped, q.high_water) == (2, 1, 2)

    async def main() -> list[int]:
        got = [await q.get(), await q.get()]
        waiter = asyncio.create_task(q.get())
        await asyncio.sleep(0)
        q.put_nowait(4)
        got.append(await waiter)
        return got

    assert asyncio.run(main()) == [2, 3, 4]


# -- hot swap ---------------------------------------------------------------------------------


def model_copy(tmp_path: Path, name: str, edit: dict[str, Any] | None = None) -> Path:
    """A copy of the committed model with its own sha256 (see ``copy_with_new_sha``)."""
    out = copy_with_new_sha(tmp_path / name, name)
    if edit:
        manifest = json.loads((out / "manifest.json").read_text())
        manifest.update(edit)
        (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_hot_swap_under_a_100hz_stream(model: LoadedModel, tmp_path: Path) -> None:
    other = load_model(model_copy(tmp_path, "b"))
    assert other.sha256 != model.sha256
    source = list(plant_windows(seed=1, seconds=60))
    stage = ReasoningStage(model, RuleSet())
    queue: DropOldestQueue[Window] = DropOldestQueue(2)
    n = 300
    decisions: list[Decision] = []
    swaps: list[str] = []

    async def producer() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(n):
            w = source[i % len(source)]
            queue.put_nowait(
                Window(
                    seq=i + 1,
                    start_ns=w.start_ns,
                    period_ns=w.period_ns,
                    signals=w.signals,
                    values=w.values,
                    stale=w.stale,
                    completeness=w.completeness,
                    jitter_ms=w.jitter_ms,
                )
            )
            await asyncio.sleep(max(0.0, start + (i + 1) * 0.01 - loop.time()))

    async def consumer() -> None:
        while len(decisions) < n:
            w = await queue.get()
            decisions.append(stage.process(w, time.time_ns()))

    async def swapper(done: asyncio.Event) -> None:
        models = [other, model]
        while not done.is_set():
            await asyncio.sleep(0.023)
            new = models[len(swaps) % 2]
            stage.swap_model(new)
            swaps.append(new.sha256)

    async def main() -> None:
        done = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(producer(), name="producer")
            c = tg.create_task(consumer(), name="consumer")
            s = tg.create_task(swapper(done), name="swapper")
            await c
            done.set()
            await s

    asyncio.run(main())
    assert queue.dropped == 0
    assert [d.window_seq for d in decisions] == list(range(1, n + 1))  # each exactly once
    shas = [d.model_sha256 for d in decisions]
    assert set(shas) == {model.sha256, other.sha256}
    assert len(swaps) >= 50
    assert stage.stats.swaps == len(swaps)
    # Both models scored windows, and the counts add up to every window.
    by_model = stage.stats.by_model
    assert by_model[model.sha256] + by_model[other.sha256] == n
    versions = {d.model_sha256: d.model_version for d in decisions}
    assert versions[other.sha256] == "1.0.1"


def test_a_rejected_model_leaves_the_old_one_serving(model: LoadedModel, tmp_path: Path) -> None:
    stage = ReasoningStage(model, RuleSet())
    windows = list(plant_windows(seed=1, seconds=5))
    before = stage.process(windows[0], 0)
    corrupt = model_copy(tmp_path, "corrupt")
    blob = corrupt / "model.tflite"
    data = bytearray(blob.read_bytes())
    data[100:140] = bytes(40)  # flipped on disk after the manifest was written
    blob.write_bytes(bytes(data))
    with pytest.raises(ModelRejected, match="sha256"):
        stage.swap_model(load_model(corrupt))
    after = stage.process(windows[1], 0)
    assert before.model_sha256 == after.model_sha256 == model.sha256
    assert stage.model is model


def test_a_model_that_does_not_fit_is_refused(model: LoadedModel, tmp_path: Path) -> None:
    rule = ConstraintRule("r", "exclude", "noise", Condition("speed", "max", "<", 1.0))
    stage = ReasoningStage(model, RuleSet(constraints=(rule,)))
    labels = ["normal", "drift", "spike", "stuck", "hum"]
    thresholds = dict(model.manifest.thresholds)
    thresholds["hum"] = thresholds.pop("noise")
    renamed = load_model(model_copy(tmp_path, "hum", {"labels": labels, "thresholds": thresholds}))
    with pytest.raises(ModelMismatch, match="label 'noise' is not an alarm label of the model"):
        stage.swap_model(renamed)
    assert stage.model is model
    assert stage.stats.swaps_refused == 1
    # A perception grid the model was not trained for is refused too.
    with pytest.raises(ModelMismatch, match=r"model window is 64 steps, perception\.window is 32"):
        ReasoningStage(
            model, RuleSet(), perception=PerceptionSpec(signals=SIGNALS, window=32, hop=32)
        )
    with pytest.raises(ModelMismatch, match=r"missing: vibration"):
        ReasoningStage(model, RuleSet(), perception=PerceptionSpec(signals=SIGNALS[:5]))
