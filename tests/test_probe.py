"""Health probes: parsing untrusted bodies, the probe window, and the stages' probe paths.

No mocks of our own code: windows come from the simulated plant through real perception,
scores from the committed INT8 model, context from a real MemoryStage on a tmp_path store.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from drivers.sim.plant import SIGNALS, parse_anomaly
from edge_agent.breaker import BreakerSpec
from edge_agent.errors import AgentError, ProbeError, ProbeTooLarge
from edge_agent.memory import MemoryStage
from edge_agent.perception import Window
from edge_agent.probe import Probe, parse_probe, probe_window, run_probe
from edge_agent.reasoning import ReasoningStage
from edge_agent.rules import Decision, HysteresisSpec, RuleSet
from edge_agent.simwindows import T0_NS, plant_windows
from models import LoadedModel, load_model
from tests.support.memory import config, count, run
from tests.support.probe import MALFORMED, MS, SPEC, body, good

pytestmark = pytest.mark.peers

TABLES = ("changes", "keyframes", "decisions", "events", "gaps")


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def windows() -> list[Window]:
    spike = parse_anomaly("spike:current@8+2x20")
    return list(plant_windows(seed=2, anomalies=[spike], seconds=14, spec=SPEC))


def stage(model: LoadedModel, **kw: Any) -> ReasoningStage:
    return ReasoningStage(model, RuleSet(**kw), perception=SPEC)


# -- parse_probe ----------------------------------------------------------------------------


def test_good_probe_parses() -> None:
    p = parse_probe(body(good()), SIGNALS)
    assert p == Probe("line-3/probe", T0_NS + 5 * MS, {"current": 9.5, "speed": 930.0})
    assert isinstance(p.payload["speed"], float)
    # The largest timestamp there is, and ints beyond float precision, stay exact.
    assert parse_probe(body(good(timestamp_ns=2**63 - 1)), SIGNALS).timestamp_ns == 2**63 - 1


@pytest.mark.parametrize(
    ("raw", "where", "what"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_probe_names_where_and_what(raw: bytes, where: str, what: str) -> None:
    with pytest.raises(ProbeError) as info:
        parse_probe(raw, SIGNALS)
    assert info.value.where == where
    assert what in info.value.message, info.value.message
    assert str(info.value) == f"{where}: {info.value.message}"


def test_oversize_body_is_refused_before_parsing() -> None:
    raw = body(good(sensor_id="x" * 100))
    with pytest.raises(ProbeTooLarge) as info:
        parse_probe(raw, SIGNALS, max_bytes=len(raw) - 1)
    assert info.value.where == "body"
    assert f"{len(raw)} bytes; at most {len(raw) - 1}" in info.value.message
    # Over the cap even when it is not JSON: nothing was parsed.
    with pytest.raises(ProbeTooLarge):
        parse_probe(b"\xff" * 100, SIGNALS, max_bytes=99)


def test_probe_errors_are_agent_errors_and_value_errors() -> None:
    assert issubclass(ProbeError, AgentError)
    assert issubclass(ProbeError, ValueError)
    assert issubclass(ProbeTooLarge, ProbeError)


# -- probe_window ---------------------------------------------------------------------------


def test_probe_window_moves_the_last_window_on_by_one_step(windows: list[Window]) -> None:
    last = windows[3]
    assert not last.stale.any()
    t = last.end_ns + 7 * MS  # between two grid points
    w = probe_window(Probe("s", t, {"current": 12.5}), SPEC, last)
    assert w.signals == SPEC.signals
    assert w.values.shape == (64, 6)
    assert w.end_ns == last.end_ns + 10 * MS  # the first grid point at or after t
    assert w.start_ns == last.start_ns + 10 * MS
    c = SIGNALS.index("current")
    # History: the last window's rows 1.. end one step before the newest row.
    np.testing.assert_array_equal(w.values[:-1], last.values[1:])
    # The newest row: the probe's reading, and the last live row for the other signals.
    assert w.values[-1, c] == np.float32(12.5)
    others = [i for i in range(6) if i != c]
    np.testing.assert_array_equal(w.values[-1, others], last.values[-1, others])
    assert not w.stale.any()
    assert w.completeness == 1.0


def test_probe_window_without_history_holds_the_reading(windows: list[Window]) -> None:
    t = T0_NS + 123 * MS
    w = probe_window(Probe("s", t, {"current": 9.0, "speed": 950.0}), SPEC, None)
    assert w.end_ns == T0_NS + 130 * MS
    for name in SIGNALS:
        col = w.values[:, SIGNALS.index(name)]
        if name in ("current", "speed"):
            assert (col == np.float32(9.0 if name == "current" else 950.0)).all()
        else:
            assert np.isnan(col).all()
    assert [s for s, st in zip(SIGNALS, w.stale.tolist(), strict=True) if st] == [
        "voltage",
        "frequency",
        "temperature",
        "vibration",
    ]
    assert w.completeness == pytest.approx(2 / 6)


def test_probe_window_keeps_a_dead_signal_dead(windows: list[Window]) -> None:
    last = windows[3]
    v = SIGNALS.index("vibration")
    stale = last.stale.copy()
    stale[v] = True
    dead = dataclasses.replace(last, stale=stale)
    w = probe_window(Probe("s", last.end_ns + 10 * MS, {"current": 9.0}), SPEC, dead)
    # Not in the payload and stale at the end of the live window: absent, as it is live.
    assert np.isnan(w.values[:, v]).all()
    assert w.stale.tolist() == [i == v for i in range(6)]
    # Given in the payload, it is back (held over the window, like a fresh source).
    w = probe_window(Probe("s", last.end_ns + 10 * MS, {"vibration": 1.5}), SPEC, dead)
    assert (w.values[:, v] == np.float32(1.5)).all()
    assert not w.stale.any()


def test_probe_window_at_the_ends_of_time() -> None:
    for t in (0, 1, 2**63 - 1):
        w = probe_window(Probe("s", t, {"current": 1.0}), SPEC, None)
        assert w.values[-1, 1] == 1.0
        assert w.end_ns <= 2**63 - 1
        assert w.end_ns - 10 * MS < min(t, w.end_ns) <= w.end_ns


# -- ReasoningStage.evaluate ---------------------------------------------------------------


def same_verdict(ev: Any, d: Decision) -> None:
    assert ev.label == d.label
    assert ev.score == d.score
    assert ev.probabilities == d.probabilities
    assert ev.top_signals == d.top_signals
    assert ev.attribution == d.attribution
    assert ev.rules_fired == d.rules_fired
    assert ev.model_sha256 == d.model_sha256
    assert ev.latency_ms > 0


def test_evaluate_scores_like_process(model: LoadedModel, windows: list[Window]) -> None:
    st = stage(model)
    labels = set()
    for w in windows:
        ev = st.evaluate(w)
        same_verdict(ev, st.process(w, w.end_ns))
        labels.add(ev.label)
    assert {"normal", "spike"} <= labels  # both paths: with and without occlusion
    # A dead signal: neutralised and reported the same way on a fresh stage.
    w = windows[5]
    stale = w.stale.copy()
    stale[SIGNALS.index("speed")] = True
    dead = dataclasses.replace(w, stale=stale)
    st = stage(model)
    ev = st.evaluate(dead)
    assert [r.rule for r in ev.rules_fired] == ["dropout"]
    same_verdict(ev, st.process(dead, dead.end_ns))


def comparable(d: Decision) -> dict[str, Any]:
    out = dataclasses.asdict(d)
    out["trace_id"] = d.trace_id[16:]  # the per-stage random prefix differs
    del out["stage_latency_ms"]
    return out


def state(st: ReasoningStage) -> dict[str, Any]:
    snap = st.snapshot()
    del snap["latency_us"]
    return {
        "snapshot": snap,
        "tracker": dict(st.tracker.states),
        "breaker": st.breaker.snapshot(),
        "trace": st._trace,
        "prev": (st._prev_seq, None if st._prev_stale is None else st._prev_stale.tolist()),
        "held": st._held,
        "latencies": len(st.stats.reasoning_us),
    }


def test_evaluate_changes_nothing(model: LoadedModel, windows: list[Window]) -> None:
    hysteresis = HysteresisSpec(raise_after=1, clear_after=2)
    plain, probed = stage(model, hysteresis=hysteresis), stage(model, hysteresis=hysteresis)
    spike = [d for d in map(plain.evaluate, windows) if d.label == "spike"]
    assert spike, "the anomaly must give spike windows"
    for w in windows:
        before = state(probed)
        for _ in range(3):
            probed.evaluate(w)
        assert state(probed) == before
        assert comparable(probed.process(w, w.end_ns)) == comparable(plain.process(w, w.end_ns))
    # One evaluate of a spike window would raise at once (raise_after=1) if it reached the
    # tracker; the alarm is raised by process() only, the same number of times.
    assert probed.tracker.raised_total == plain.tracker.raised_total >= 1


def test_evaluate_runs_the_model_when_the_breaker_is_open(
    model: LoadedModel, windows: list[Window]
) -> None:
    st = ReasoningStage(
        model, RuleSet(), perception=SPEC, breaker=BreakerSpec(budget_us=0.001, trip_after=1)
    )
    for w in windows[:3]:
        st.process(w, w.end_ns)
    assert st.breaker.mode == "every_k"
    before = state(st)
    ev = st.evaluate(windows[4])
    assert set(ev.probabilities) == set(model.manifest.labels)
    assert state(st) == before


# -- MemoryStage.probe ---------------------------------------------------------------------


def counters(st: MemoryStage) -> dict[str, Any]:
    s = st.stats()
    keys = ("windows", "cells", "rows", "keyframes", "decisions", "events", "unknown_signal")
    return {k: s[k] for k in (*keys, "missing_signal", "unknown_names", "ring", "latency_us")}


def baselines(st: MemoryStage) -> list[list[Any]]:
    b = st.baselines
    return [a.tolist() for a in (b.weight, b.mean, b.m2, b.fast_mean, b.min, b.max, b.count)]


def test_memory_probe_writes_nothing_and_keeps_working_memory(
    tmp_path: Path, windows: list[Window]
) -> None:
    async def main() -> None:
        # The store's clock follows the data (2023): with the wall clock, TTL aging could
        # delete these windows' rows between the two counts.
        st = MemoryStage(
            config(ring_windows=4),
            SIGNALS,
            state_dir=tmp_path,
            clock_ns=lambda: windows[5].end_ns,
        )
        async with st:
            for w in windows[:6]:
                st.process(w, {"label": "normal"}, now_ns=w.end_ns)
            assert await st.flush()
            db = tmp_path / "memory.db"
            rows = {t: count(db, t) for t in TABLES}
            assert rows["changes"] > 0
            ring, before, base = st.ring.windows(), counters(st), baselines(st)
            probe = probe_window(
                Probe("s", windows[5].end_ns + 10 * MS, {"current": 30.0}), SPEC, windows[5]
            )
            ctxs = [st.probe(probe, now_ns=probe.end_ns) for _ in range(3)]
            # Another column layout: neither counted nor cached by a probe.
            odd = dataclasses.replace(probe, signals=(*SIGNALS[:5], "torque"), seq=99)
            st.probe(odd, now_ns=probe.end_ns)
            assert await st.flush()
            assert {t: count(db, t) for t in TABLES} == rows
            assert st.ring.windows() == ring
            assert counters(st) == before
            assert baselines(st) == base
            ctx = ctxs[0]
            assert ctx.window is probe
            assert ctx.recent == (*ring[1:], probe)  # the ring holds 4
            assert ctx.decisions == st.ring.decisions()
            assert not ctx.persisted
            assert ctx.latency_ms > 0
            # What process() then returns for the same window: the same context.
            real = st.process(probe, now_ns=probe.end_ns)
            assert real.recent == ctx.recent
            for a, b in (
                (ctx.baseline_mean, real.baseline_mean),
                (ctx.baseline_std, real.baseline_std),
                (ctx.drift, real.drift),
            ):
                np.testing.assert_array_equal(a, b)
            st.process(odd, now_ns=probe.end_ns)
            assert st.stats()["unknown_names"] == ["torque"]
            assert st.stats()["missing_signal"] == 1

    run(main())


# -- run_probe -----------------------------------------------------------------------------


def steps(step_ns: int) -> Iterator[int]:
    t = 0
    while True:
        yield t
        t += step_ns


def test_run_probe_times_each_stage(
    tmp_path: Path, model: LoadedModel, windows: list[Window]
) -> None:
    async def main() -> None:
        memory = MemoryStage(
            config(), SIGNALS, state_dir=tmp_path, clock_ns=lambda: windows[5].end_ns
        )
        reasoning = stage(model)
        async with memory:
            last = windows[5]
            p = Probe("s", last.end_ns + 3 * MS, {"current": float(last.values[-1, 1]) + 30.0})
            res = run_probe(
                p, spec=SPEC, last=last, memory=memory, reasoning=reasoning, now_ns=p.timestamp_ns
            )
            assert res.sensor_id == "s"
            assert res.skipped == ()
            assert set(res.stage_latency_ms) == {"perception", "memory", "reasoning"}
            assert all(v > 0 for v in res.stage_latency_ms.values()), res.stage_latency_ms
            # A 30 A jump on the newest reading of a live window: the model calls it.
            assert res.label == "spike"
            assert res.top_signals[0][0] == "current"
            assert res.model_sha256 == model.sha256
            doc = res.to_json()
            assert json.loads(json.dumps(doc, allow_nan=False)) == doc
            assert doc["label"] == "spike"
            assert doc["top_signals"][0]["signal"] == "current"
            assert doc["attribution"] == "occlusion"
            # An injected clock: every stage takes exactly one tick of 2 ms.
            clock = steps(2 * MS)
            res = run_probe(
                p,
                spec=SPEC,
                last=last,
                memory=memory,
                reasoning=reasoning,
                timer=lambda: next(clock),
                now_ns=p.timestamp_ns,
            )
            assert res.stage_latency_ms == {"perception": 2.0, "memory": 2.0, "reasoning": 2.0}

    run(main())


def test_run_probe_with_stages_disabled(windows: list[Window]) -> None:
    p = Probe("s", T0_NS, {"speed": 900.0})
    res = run_probe(p, spec=SPEC, last=windows[2], memory=None, reasoning=None, now_ns=T0_NS)
    assert res.label is None
    assert res.score is None
    assert res.skipped == ("memory", "reasoning")
    assert res.stage_latency_ms["memory"] == res.stage_latency_ms["reasoning"] == 0.0
    assert res.stage_latency_ms["perception"] > 0
    assert res.to_json()["label"] is None
