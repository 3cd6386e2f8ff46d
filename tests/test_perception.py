"""Perception: exact grids for known inputs, staleness, late samples, jitter, catch-up."""

import math
import random

import numpy as np
import pytest

from drivers.sample import Sample
from edge_agent import perception
from edge_agent.perception import Aligner, PerceptionSpec, Window
from tests.support.perception_reference import ReferenceAligner

MS = 1_000_000
T0 = 1_700_000_000_000_000_000  # a multiple of 10 ms: grid point 0


def spec(**kw: object) -> PerceptionSpec:
    base: dict[str, object] = {
        "signals": ("a", "b"),
        "rate_hz": 100.0,
        "window": 4,
        "hop": 4,
        "max_staleness_ms": 12.0,
        "lateness_ms": 20.0,
    }
    base.update(kw)
    return PerceptionSpec(**base)  # type: ignore[arg-type]


def feed(aligner: Aligner) -> None:
    aligner.push_many(
        [
            Sample("a", 1.0, T0),
            Sample("b", 10.0, T0 + 5 * MS),
            Sample("a", 2.0, T0 + 15 * MS),
            Sample("a", 3.0, T0 + 31 * MS),
        ]
    )


def test_sample_and_hold_grid_is_exact() -> None:
    al = Aligner(spec())
    feed(al)
    # Last grid point is T0+30 ms; it is due 20 ms (lateness) later.
    assert al.advance(T0 + 50 * MS - 1) == []
    (w,) = al.advance(T0 + 50 * MS)
    assert w.start_ns == T0
    assert w.end_ns == T0 + 30 * MS
    assert w.signals == ("a", "b")
    assert w.values.dtype == np.float32
    assert w.values.shape == (4, 2)
    np.testing.assert_array_equal(w.values[:, 0], [1.0, 1.0, 2.0, 2.0])
    assert math.isnan(w.values[0, 1])
    np.testing.assert_array_equal(w.values[1:, 1], [10.0, 10.0, 10.0])


def test_linear_interpolation_uses_next_sample_and_never_extrapolates() -> None:
    al = Aligner(spec(interpolation="linear"))
    feed(al)
    (w,) = al.advance(T0 + 60 * MS)
    np.testing.assert_allclose(
        w.values[:, 0], [1.0, 1.0 + 10 / 15, 2.0 + 5 / 16, 2.0 + 15 / 16], rtol=1e-6
    )
    # b has no later sample: held, not extrapolated.
    np.testing.assert_array_equal(w.values[1:, 1], [10.0, 10.0, 10.0])


def test_staleness_flags_and_completeness() -> None:
    al = Aligner(spec())
    feed(al)
    (w,) = al.advance(T0 + 50 * MS)
    # a: ages 0, 10, 5, 15 ms -> fresh, fresh, fresh, stale (limit 12 ms).
    # b: none, 5, 15, 25 ms -> stale, fresh, stale, stale.
    assert w.stale.tolist() == [True, True]
    assert w.completeness == pytest.approx(4 / 8)


def test_never_seen_signal_is_nan_and_stale() -> None:
    al = Aligner(spec(signals=("a", "ghost")))
    al.push(Sample("a", 1.0, T0))
    (w,) = al.advance(T0 + 50 * MS)
    assert np.isnan(w.values[:, 1]).all()
    assert w.stale.tolist() == [True, True]  # a is 30 ms old at the last point


def test_late_samples_are_counted_and_dropped_not_reordered() -> None:
    al = Aligner(spec())
    feed(al)
    (w1,) = al.advance(T0 + 50 * MS)
    al.push(Sample("a", 99.0, T0 + 25 * MS))  # inside the emitted window
    al.push(Sample("a", 98.0, T0 + 30 * MS))  # exactly its last point
    assert al.stats.late_dropped == 2
    al.push(Sample("a", 4.0, T0 + 45 * MS))
    (w2,) = al.advance(T0 + 90 * MS)
    assert w2.start_ns == T0 + 40 * MS
    # Grid 40 holds the sample at 31 ms (3.0); 50..70 hold 4.0. The late 99/98 never appear.
    np.testing.assert_array_equal(w2.values[:, 0], [3.0, 4.0, 4.0, 4.0])
    assert w1.values[:, 0].tolist() == [1.0, 1.0, 2.0, 2.0]


def test_out_of_order_samples_ahead_of_the_horizon_are_sorted() -> None:
    forward, backward = Aligner(spec()), Aligner(spec())
    samples = [Sample("a", float(i), T0 + i * 7 * MS) for i in range(6)]
    forward.push_many(samples)
    backward.push_many(reversed(samples))
    (wf,) = forward.advance(T0 + 50 * MS)
    (wb,) = backward.advance(T0 + 50 * MS)
    np.testing.assert_array_equal(wf.values, wb.values)
    assert backward.stats.late_dropped == 0


def test_jitter_is_std_of_inter_arrival_intervals() -> None:
    al = Aligner(spec())
    for off in (0, 8, 20, 30):
        al.push(Sample("a", 1.0, T0 + off * MS))
    for off in (0, 10, 20, 30):
        al.push(Sample("b", 1.0, T0 + off * MS))
    (w,) = al.advance(T0 + 50 * MS)
    # a: intervals 8, 12, 10 ms -> population std sqrt(8/3); b: perfectly regular.
    assert w.jitter_ms[0] == pytest.approx(math.sqrt(8 / 3), rel=1e-5)
    assert w.jitter_ms[1] == 0.0
    assert w.max_jitter_ms == pytest.approx(math.sqrt(8 / 3), rel=1e-5)


def test_overlapping_windows_share_rows() -> None:
    al = Aligner(spec(hop=2))
    for i in range(10):
        al.push(Sample("a", float(i), T0 + i * 10 * MS))
    w1, w2 = al.advance(T0 + 70 * MS)
    assert w2.start_ns - w1.start_ns == 20 * MS
    np.testing.assert_array_equal(w1.values[2:], w2.values[:2])
    assert [w1.seq, w2.seq] == [1, 2]


def test_catch_up_after_a_stall_is_bounded_and_counted() -> None:
    al = Aligner(spec(max_catch_up_windows=3))
    al.push(Sample("a", 1.0, T0))
    windows = al.advance(T0 + 10_000 * MS)  # 10 s late: ~250 windows due
    assert len(windows) == 3
    assert al.stats.windows_skipped > 200
    # The windows built are the most recent ones, back to back.
    assert windows[1].start_ns - windows[0].start_ns == 40 * MS
    assert windows[-1].end_ns + 20 * MS <= T0 + 10_000 * MS


def run_stream(al: Aligner, start_ns: int, n: int) -> list[Window]:
    """``n`` ticks of 10 ms from ``start_ns``: one sample of each signal, then advance."""
    out: list[Window] = []
    for k in range(n):
        t = start_ns + k * 10 * MS
        al.push_many([Sample("a", float(k), t), Sample("b", float(k), t)])
        out += al.advance(t)
    return out


def test_a_clock_stepped_back_restarts_the_grid_instead_of_dropping_everything() -> None:
    al = Aligner(spec())
    before = run_stream(al, T0, 100)
    assert len(before) >= 20
    assert al.stats.late_dropped == 0
    # The clock steps back 30 s: samples and now both come from the new clock.
    back = T0 + 1000 * MS - 30_000 * MS
    after = run_stream(al, back, 100)
    assert al.stats.clock_steps == 1
    # Windows again within a window span and the lateness of the step, on the new clock.
    assert len(after) >= len(before) - 3
    assert after[0].start_ns >= back
    assert after[0].start_ns <= back + 80 * MS
    assert after[0].seq == before[-1].seq + 1
    assert not after[-1].stale.any()
    assert al.stats.late_dropped <= 2 * 2  # at most the samples before the next advance
    # A step back shorter than a window span is ridden out as late samples, not a restart.
    short = Aligner(spec())
    run_stream(short, T0, 50)
    run_stream(short, T0 + 500 * MS - 30 * MS, 50)
    assert short.stats.clock_steps == 0


def test_unknown_and_non_finite_samples_are_counted() -> None:
    al = Aligner(spec())
    al.push(Sample("nope", 1.0, T0))
    al.push(Sample("a", float("nan"), T0))
    al.push(Sample("a", float("inf"), T0))
    assert al.stats.unknown_signal == 1
    assert al.stats.unknown_names == {"nope"}
    assert al.stats.non_finite == 2
    assert al.stats.samples == 0
    assert al.advance(T0 + 10_000 * MS) == []  # nothing seen: no grid yet


def test_values_beyond_float32_range_are_refused_not_made_inf() -> None:
    f32_max = float(np.finfo(np.float32).max)
    al = Aligner(spec(signals=("a",), lateness_ms=0.0))
    # push() (no window out yet) and push_many()'s steady-state path (after the first one).
    al.push(Sample("a", 1e39, T0))
    al.push(Sample("a", 1.0, T0))
    first = al.advance(T0 + 40 * MS)
    assert len(first) == 1
    al.push_many(
        [
            Sample("a", 2.0, T0 + 40 * MS),
            Sample("a", -1e39, T0 + 50 * MS),
            Sample("a", f32_max, T0 + 60 * MS),
            Sample("a", 3.0, T0 + 70 * MS),
        ]
    )
    (w,) = al.advance(T0 + 80 * MS)
    assert al.stats.non_finite == 2
    assert al.stats.samples == 4
    assert first[0].values.ravel().tolist() == [1.0] * 4
    assert w.values.ravel().tolist() == [2.0, 2.0, f32_max, 3.0]
    assert np.isfinite(w.values).all()


def test_grid_is_anchored_to_multiples_of_the_period() -> None:
    al = Aligner(spec())
    al.push(Sample("a", 1.0, T0 + 3 * MS))
    (w,) = al.advance(T0 + 70 * MS)
    assert w.start_ns == T0 + 10 * MS
    assert w.start_ns % (10 * MS) == 0


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"signals": ()}, "at least one signal"),
        ({"signals": ("a", "a")}, "unique"),
        ({"rate_hz": 0.0}, "rate_hz must be in"),
        ({"rate_hz": 3.0}, "whole number of ns"),
        ({"hop": 5}, "1 <= hop <= window"),
    ],
)
def test_spec_rejects_impossible_geometry(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec(**kw)


# -- incremental building == building every window from scratch ------------------------------


def assert_same_window(got: Window, want: Window) -> None:
    assert (got.seq, got.start_ns, got.period_ns, got.signals) == (
        want.seq,
        want.start_ns,
        want.period_ns,
        want.signals,
    )
    assert got.values.dtype == want.values.dtype == np.float32
    assert got.values.shape == want.values.shape
    # Bit for bit (NaN, signed zeros and all), not just close.
    np.testing.assert_array_equal(got.values.view(np.uint32), want.values.view(np.uint32))
    np.testing.assert_array_equal(got.stale, want.stale)
    assert got.completeness == want.completeness
    assert got.jitter_ms.dtype == np.float32
    # Exact integer sums vs numpy's two-pass float std: equal up to float rounding.
    np.testing.assert_allclose(got.jitter_ms, want.jitter_ms, rtol=1e-6, atol=0)


def random_stream(rng: random.Random, n_signals: int, seconds: float) -> list[tuple[int, Sample]]:
    """(push time, sample) pairs: random rates, arrival jitter, silences longer than any
    staleness, stamps on grid points and duplicated, late arrivals, NaN/inf, unknown names."""
    t_start = T0 + rng.randrange(10 * MS)
    t_stop = t_start + int(seconds * 1e9)
    out: list[tuple[int, Sample]] = []
    # The last signal is never seen.
    for i in range(n_signals - 1):
        name = f"s{i}"
        # One fast signal (CAN), one slow (Modbus), the rest anything in between.
        steps = [int(0.5 * MS), MS, 2 * MS, 7 * MS, 10 * MS, 33 * MS, 100 * MS, 300 * MS]
        step = rng.choice(steps[:3] if i == 0 else steps[-2:] if i == 1 else steps)
        t = t_start + rng.randrange(step)
        while t < t_stop:
            stamp = t + rng.randint(-3 * MS, 3 * MS)
            if rng.random() < 0.05:
                stamp -= stamp % (10 * MS)  # exactly on a grid point
            value = rng.choice([rng.gauss(0.0, 5.0), float(rng.randint(-3, 3)), -0.0])
            if rng.random() < 0.01:
                value = rng.choice([math.nan, math.inf, -math.inf])
            # Mostly within lateness (20 ms); some late.
            delay = rng.choice([0, 0, rng.randrange(20 * MS), rng.randrange(60 * MS)])
            out.append((stamp + delay, Sample(name, value, stamp)))
            if rng.random() < 0.03:  # same stamp twice
                out.append((stamp + delay + rng.randrange(MS), Sample(name, value + 1.0, stamp)))
            if rng.random() < 0.01:
                out.append((stamp + delay, Sample("unknown", 1.0, stamp)))
            t += step
            if rng.random() < step / 1e9:  # about once a second: silent beyond any staleness
                t += rng.randrange(300 * MS, 2_000 * MS)
    out.sort(key=lambda pair: pair[0])
    return out


def run_both(
    seed: int, *, window: int, hop: int, interpolation: str, n_signals: int = 7, seconds: float = 3
) -> int:
    rng = random.Random(seed)
    sp = PerceptionSpec(
        signals=tuple(f"s{i}" for i in range(n_signals)),
        rate_hz=100.0,
        window=window,
        hop=hop,
        interpolation=interpolation,  # type: ignore[arg-type]
        max_staleness_ms=rng.choice([15.0, 50.0, 200.0]),
        lateness_ms=20.0,
        max_catch_up_windows=rng.choice([1, 4, 16]),
    )
    new, ref = Aligner(sp), ReferenceAligner(sp)
    # The agent is suspended once: more windows fall due than may be caught up. The plant
    # keeps sending meanwhile, and the stream goes on long enough after it to get back
    # to one window at a time.
    stall_ns = (sp.max_catch_up_windows + rng.randint(1, 5)) * hop * sp.period_ns
    stream = random_stream(rng, n_signals, seconds + stall_ns / 1e9)
    now = stream[0][0]
    stall_at = now + int(rng.uniform(0.3, 0.6) * seconds * 1e9)
    stalled = False
    k = windows = 0
    while k < len(stream):
        now += rng.randrange(1, 15 * MS)
        if not stalled and now >= stall_at:
            now += stall_ns
            stalled = True
        batch: list[Sample] = []
        while k < len(stream) and stream[k][0] <= now:
            batch.append(stream[k][1])
            k += 1
        if rng.random() < 0.5:
            new.push_many(batch)
        else:
            for s in batch:
                new.push(s)
        ref.push_many(batch)
        got, want = new.advance(now), ref.advance(now)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same_window(g, w)
            if rng.random() < 0.1:
                g.values[:] = 123.0  # a consumer scribbling on its copy changes nothing
        windows += len(got)
        assert new.stats == ref.stats
    assert ref.stats.windows_skipped > 0
    return windows


@pytest.mark.parametrize("interpolation", ["hold", "linear"])
@pytest.mark.parametrize("hop", [1, 3, 16, 64])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_incremental_windows_equal_full_builds(seed: int, hop: int, interpolation: str) -> None:
    windows = run_both(
        seed, window=64, hop=hop, interpolation=interpolation, seconds=max(3, hop / 8)
    )
    assert windows > 0


@pytest.mark.parametrize("interpolation", ["hold", "linear"])
@pytest.mark.parametrize(("window", "hop"), [(1, 1), (4, 1), (4, 3), (4, 4), (16, 7)])
@pytest.mark.parametrize("seed", [4, 5])
def test_incremental_windows_equal_full_builds_small_windows(
    seed: int, window: int, hop: int, interpolation: str
) -> None:
    run_both(seed, window=window, hop=hop, interpolation=interpolation)


@pytest.mark.parametrize(
    ("rows_max", "compact_at"), [(0, 1), (10**9, 10**9), (0, 10**9), (10**9, 1)]
)
@pytest.mark.parametrize("interpolation", ["hold", "linear"])
@pytest.mark.parametrize("hop", [1, 16])
def test_cost_tradeoffs_never_change_the_result(
    monkeypatch: pytest.MonkeyPatch,
    rows_max: int,
    compact_at: int,
    hop: int,
    interpolation: str,
) -> None:
    # New rows by numpy passes only, or one cell at a time only (first window included);
    # pruned samples deleted at once (as the reference does) or never.
    monkeypatch.setattr(perception, "_SCALAR_ROWS_MAX", rows_max)
    monkeypatch.setattr(perception, "_COMPACT_AT", compact_at)
    run_both(6, window=64, hop=hop, interpolation=interpolation)


def test_linear_rows_shared_with_the_last_window_follow_later_samples() -> None:
    # A row's linear value is not final when it is first emitted: the sample after it may
    # arrive later (stamped after the horizon, so not late) or an earlier one may overtake
    # the one it used. Each window must show what a full build would at its own emission.
    sp = spec(window=4, hop=1, interpolation="linear")
    new, ref = Aligner(sp), ReferenceAligner(sp)
    both = (new, ref)
    for al in both:
        al.push_many([Sample("a", 0.0, T0), Sample("a", 70.0, T0 + 70 * MS)])
    (w1,) = new.advance(T0 + 50 * MS)
    (r1,) = ref.advance(T0 + 50 * MS)
    assert_same_window(w1, r1)
    np.testing.assert_array_equal(w1.values[:, 0], [0.0, 10.0, 20.0, 30.0])
    for al in both:
        al.push(Sample("a", 0.0, T0 + 35 * MS))  # after the horizon (30 ms): accepted
    (w2,) = new.advance(T0 + 60 * MS)
    (r2,) = ref.advance(T0 + 60 * MS)
    assert_same_window(w2, r2)
    # Rows 10..30 now lean towards the 35 ms sample instead of the 70 ms one.
    np.testing.assert_array_equal(
        w2.values[:, 0], np.array([0.0, 0.0, 0.0, 10.0], dtype=np.float32)
    )
    for al in both:
        al.push(Sample("a", 20.0, T0 + 45 * MS))
    (w3,) = new.advance(T0 + 70 * MS)
    (r3,) = ref.advance(T0 + 70 * MS)
    assert_same_window(w3, r3)
    np.testing.assert_array_equal(
        w3.values[:, 0], np.array([0.0, 0.0, 10.0, 20.0 + 5 / 25 * 50], dtype=np.float32)
    )
    # b never had a sample: NaN throughout, never "recomputed" into a number.
    assert np.isnan(w3.values[:, 1]).all()


def test_hold_rows_shared_with_the_last_window_are_copied_unchanged() -> None:
    al = Aligner(spec(window=8, hop=1))
    al.push(Sample("a", 1.0, T0))
    (w1,) = al.advance(T0 + 90 * MS)
    al.push(Sample("a", 2.0, T0 + 71 * MS))  # after the horizon (70 ms), before row 80
    (w2,) = al.advance(T0 + 100 * MS)
    np.testing.assert_array_equal(w2.values[:-1], w1.values[1:])
    assert w2.values[-1, 0] == 2.0


def test_jitter_survives_a_duplicate_stamp_on_the_next_windows_first_point() -> None:
    # Pruning keeps only the newest of equal stamps at the next window's start; the carried
    # jitter sums must shrink their count the same way the full build sees it.
    sp = spec(window=8, hop=2)
    new, ref = Aligner(sp), ReferenceAligner(sp)
    samples = [Sample("a", 1.0, T0 + off * MS) for off in (0, 3, 11, 20, 20, 20, 27, 44, 61)]
    for al in (new, ref):
        al.push_many(samples)
    for now in (T0 + 90 * MS, T0 + 110 * MS, T0 + 130 * MS):
        got, want = new.advance(now), ref.advance(now)
        assert len(got) == len(want) == 1
        assert_same_window(got[0], want[0])


def test_scalar_lerp_is_bitwise_the_numpy_column_formula() -> None:
    # Windows hold float32, which hides most last-bit differences of the float64 arithmetic;
    # compare the doubles themselves against the expression the full build evaluates.
    rng = np.random.default_rng(3)
    n = 20_000
    t0 = T0 + rng.integers(0, 10**12, n)
    # Gaps up to 2**61 ns too: past 2**53 the int -> double conversion rounds, and so must ours.
    t1 = t0 + rng.integers(1, 10**10, n) * rng.choice([1, 2**28], n) + rng.integers(0, 999, n)
    g = t0 + rng.integers(0, t1 - t0)
    v0 = rng.normal(0.0, 1e3, n) * rng.choice([1e-6, 1.0, 1e6], n)
    v1 = rng.normal(0.0, 1e3, n) * rng.choice([1e-6, 1.0, 1e6], n)
    want = v0 + ((g - t0) / (t1 - t0)) * (v1 - v0)
    got = np.array(
        [
            perception._lerp(int(a), int(b), int(c), float(d), float(e))
            for a, b, c, d, e in zip(g, t0, t1, v0, v1, strict=True)
        ]
    )
    np.testing.assert_array_equal(got.view(np.int64), want.view(np.int64))


def test_out_of_order_sample_before_the_kept_one_when_windows_do_not_overlap() -> None:
    # hop == window: the prune point (next start) is ahead of the horizon, so a sample can
    # still arrive before the sample pruning kept. It must neither be lost nor revive the
    # equal stamps pruning dropped.
    sp = spec(window=4, hop=4)
    new, ref = Aligner(sp), ReferenceAligner(sp)
    first = [Sample("a", 1.0, T0 + off * MS) for off in (0, 12, 22, 40, 40, 40, 47, 55, 62)]
    for al in (new, ref):
        al.push_many(first)
    assert_same_window(new.advance(T0 + 50 * MS)[0], ref.advance(T0 + 50 * MS)[0])
    for al in (new, ref):
        al.push(Sample("a", 2.0, T0 + 35 * MS))  # after the horizon (30 ms), before 40 ms
    (got,) = new.advance(T0 + 90 * MS)
    (want,) = ref.advance(T0 + 90 * MS)
    assert_same_window(got, want)
    # Inside [40, 70]: one sample at 40 (the last of the three), 47, 55, 62.
    assert got.jitter_ms[0] == pytest.approx(float(np.std([7, 8, 7])), rel=1e-6)


def test_tracks_stay_bounded_while_windows_go_out() -> None:
    # Pruning is lazy (deleted in batches), but a fast signal must not pile up samples.
    al = Aligner(PerceptionSpec(signals=("fast",), window=64, hop=1))
    for k in range(3_000):  # 30 s at 2 kHz, one 10 ms tick at a time
        al.push_many(Sample("fast", 1.0, T0 + k * 10 * MS + j * MS // 2) for j in range(20))
        al.advance(T0 + (k + 1) * 10 * MS)
    in_reach = (64 + 2 + 2) * 20  # window + lateness ahead of the horizon, at 20 per tick
    assert len(al._tracks[0].t) <= in_reach + perception._COMPACT_AT
