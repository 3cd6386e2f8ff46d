"""Perception: exact grids for known inputs, staleness, late samples, jitter, catch-up."""

import math

import numpy as np
import pytest

from drivers.sample import Sample
from edge_agent.perception import Aligner, PerceptionSpec

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
