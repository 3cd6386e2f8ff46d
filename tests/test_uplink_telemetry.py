"""Telemetry aggregation and delta upload: exact periods, overlap, NaN, deadbands, rebuild."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import pytest

from drivers.sim.plant import NOISE_STD, SIGNALS, STEP_HZ, parse_anomaly
from edge_agent.perception import PerceptionSpec, Window
from edge_agent.simwindows import T0_NS, plant_windows
from edge_agent.uplink.telemetry import (
    GONE,
    Aggregate,
    DeltaEncoder,
    PeriodStats,
    Reconstructor,
    TelemetryAggregator,
    periods_of,
    telemetry_batch_msg,
    telemetry_msg,
)
from wire.messages import SignalStats, TelemetryMsg, decode, encode

pytestmark = pytest.mark.peers

MS = 1_000_000
NAN = math.nan
BOOT = "0123456789abcdef0123456789abcdef"


def win(
    start_ns: int,
    rows: Sequence[Sequence[float]],
    signals: tuple[str, ...] = ("a", "b"),
    period_ns: int = 10 * MS,
) -> Window:
    values = np.array(rows, dtype=np.float32).reshape(len(rows), len(signals))
    return Window(
        seq=0,
        start_ns=start_ns,
        period_ns=period_ns,
        signals=signals,
        values=values,
        stale=np.zeros(len(signals), dtype=np.bool_),
        completeness=1.0,
        jitter_ms=np.zeros(len(signals), dtype=np.float32),
    )


def f32(x: float) -> float:
    """What the aggregator reports for a float32 value: its shortest decimal."""
    return float(str(np.float32(x)))


def run_all(agg: TelemetryAggregator, windows: Iterable[Window]) -> list[Aggregate]:
    out: list[Aggregate] = []
    for w in windows:
        out += agg.add(w)
    return out + agg.flush()


def plant_spec(hop: int) -> PerceptionSpec:
    # plant_windows' default grid, only the hop differs.
    return PerceptionSpec(
        signals=SIGNALS, rate_hz=STEP_HZ, window=64, hop=hop, max_staleness_ms=250.0
    )


def agg_of(
    t_ns: int, period_ns: int = 10 * MS, **stats: tuple[float, float, float, int]
) -> Aggregate:
    """An aggregate with ``name=(mean, min, max, n)``; ``last`` is the mean."""
    return Aggregate(
        t_ns=t_ns,
        period_ns=period_ns,
        stats={k: PeriodStats(m, lo, hi, m, n) for k, (m, lo, hi, n) in stats.items()},
    )


# -- aggregation ------------------------------------------------------------------------------


def test_periods_are_aligned_to_unix_time_and_close_on_the_row_at_their_end() -> None:
    period = 30 * MS
    base = (T0_NS // period) * period
    agg = TelemetryAggregator(("a", "b"), period)
    # Rows at base+20, +30, +40, +50 ms: the first belongs to [base, base+30), the others to
    # [base+30, base+60), which stays open: no row at or past base+60 yet.
    out = agg.add(win(base + 20 * MS, [[1, 10], [2, 20], [3, 30], [4, 40]]))
    assert [a.t_ns for a in out] == [base + period]
    assert out[0].period_ns == period
    assert out[0].stats == {"a": (1.0, 1.0, 1.0, 1.0, 1), "b": (10.0, 10.0, 10.0, 10.0, 1)}
    # The row at base+60 closes it.
    out = agg.add(win(base + 60 * MS, [[5, 50]]))
    assert [a.t_ns for a in out] == [base + 2 * period]
    assert out[0].stats["a"] == (3.0, 2.0, 4.0, 4.0, 3)
    assert out[0].stats["b"] == (30.0, 20.0, 40.0, 40.0, 3)
    assert agg.flush()[0].stats["a"] == (5.0, 5.0, 5.0, 5.0, 1)


def test_window_not_aligned_to_periods_and_periods_spanning_windows() -> None:
    period = 25 * MS  # not a multiple of the 10 ms grid: 2 or 3 rows per period
    base = (T0_NS // (50 * MS)) * 50 * MS
    agg = TelemetryAggregator(("a",), period)
    rows = [[float(i)] for i in range(10)]  # base .. base+90 ms
    got = run_all(agg, [win(base, rows[:4], ("a",)), win(base + 40 * MS, rows[4:], ("a",))])
    # [0,25): 0,10,20 | [25,50): 30,40 | [50,75): 50,60,70 | [75,100): 80,90
    assert [(a.t_ns - base) // MS for a in got] == [25, 50, 75, 100]
    assert [a.stats["a"].n for a in got] == [3, 2, 3, 2]
    assert [a.stats["a"].mean for a in got] == [1.0, 3.5, 6.0, 8.5]
    assert [a.stats["a"].last for a in got] == [2.0, 4.0, 7.0, 9.0]


def test_nan_cells_are_skipped_and_signals_without_data_omitted() -> None:
    period = 40 * MS
    base = (T0_NS // period) * period
    agg = TelemetryAggregator(("a", "b", "c"), period)
    rows = [
        [1.0, NAN],
        [NAN, NAN],
        [5.0, NAN],
        [NAN, NAN],  # last row of period 1: "last" is the last *finite* value
        [NAN, 2.0],
        [NAN, 4.0],
        [NAN, NAN],
        [NAN, NAN],
    ]
    got = run_all(agg, [win(base, rows)])
    assert len(got) == 2
    assert got[0].stats == {"a": (3.0, 1.0, 5.0, 5.0, 2)}  # b all NaN, c never in a window
    assert got[1].stats == {"b": (3.0, 2.0, 4.0, 4.0, 2)}


def test_a_period_with_no_finite_cell_is_still_reported_empty() -> None:
    base = (T0_NS // (20 * MS)) * 20 * MS
    agg = TelemetryAggregator(("a", "b"), 20 * MS)
    got = run_all(agg, [win(base, [[NAN, NAN], [NAN, NAN], [1, 2]])])
    assert [a.stats for a in got] == [{}, {"a": (1.0, 1.0, 1.0, 1.0, 1), "b": (2.0,) * 4 + (1,)}]


def test_overlapping_windows_count_each_row_once() -> None:
    period = 50 * MS
    base = (T0_NS // period) * period
    values = [[float(i), float(i * i)] for i in range(12)]
    back_to_back = run_all(
        TelemetryAggregator(("a", "b"), period),
        [win(base, values[:4]), win(base + 40 * MS, values[4:8]), win(base + 80 * MS, values[8:])],
    )
    # hop 1 over 4-row windows, each shifted by one row, plus a repeat of one window.
    agg = TelemetryAggregator(("a", "b"), period)
    windows = [win(base + k * 10 * MS, values[k : k + 4]) for k in range(9)]
    overlapping = run_all(agg, [*windows[:5], windows[4], *windows[5:]])
    assert overlapping == back_to_back
    assert agg.rows == 12
    assert agg.rows_repeated == 3 * 8 + 4
    assert [a.stats["a"].n for a in overlapping] == [5, 5, 2]


def test_hop_1_and_hop_64_give_identical_aggregates_on_the_plant() -> None:
    seconds = 16.0  # 1600 grid rows: 25 whole 64-row windows, nothing left over
    hop64 = list(plant_windows(seconds=seconds, spec=plant_spec(64)))
    hop1 = list(plant_windows(seconds=seconds, spec=plant_spec(1)))
    assert len(hop64) == 25
    assert len(hop1) == 1600 - 63
    grid = np.concatenate([w.values for w in hop64]).astype(np.float64)
    stamps = hop64[0].start_ns + np.arange(grid.shape[0], dtype=np.int64) * hop64[0].period_ns
    for period_ms in (10, 250, 1000):
        period = period_ms * MS
        a64 = run_all(TelemetryAggregator(SIGNALS, period), hop64)
        a1 = run_all(TelemetryAggregator(SIGNALS, period), hop1)
        assert a1 == a64
        # Against a plain reference over the concatenated grid.
        ids = stamps // period
        expect_ends = [(int(p) + 1) * period for p in np.unique(ids)]
        assert [a.t_ns for a in a64] == expect_ends
        for a in a64:
            rows = grid[ids == a.t_ns // period - 1]
            for j, name in enumerate(SIGNALS):
                col = rows[:, j]
                got = a.stats[name]
                assert got.n == len(col)
                assert got.min == f32(col.min())
                assert got.max == f32(col.max())
                assert got.last == f32(col[-1])
                assert got.mean == pytest.approx(col.mean(), rel=1e-6)


def test_flush_closes_the_open_period_once() -> None:
    period = 100 * MS
    base = (T0_NS // period) * period
    agg = TelemetryAggregator(("a", "b"), period)
    assert agg.flush() == []
    assert agg.add(win(base, [[1, 2], [3, 4]])) == []
    flushed = agg.flush()
    assert [(a.t_ns, a.stats["a"]) for a in flushed] == [(base + period, (2.0, 1.0, 3.0, 3.0, 2))]
    assert agg.flush() == []
    # The rows already flushed are not counted again; later rows start a fresh period.
    assert agg.add(win(base, [[1, 2], [3, 4], [5, 6]])) == []
    assert agg.flush()[0].stats["a"] == (5.0, 5.0, 5.0, 5.0, 1)


def test_window_columns_are_matched_by_name() -> None:
    base = (T0_NS // (20 * MS)) * 20 * MS
    agg = TelemetryAggregator(("a", "b", "c"), 20 * MS)
    got = run_all(agg, [win(base, [[1, 7, 2], [3, 7, 4]], signals=("b", "x", "a"))])
    assert got[0].stats == {"a": (3.0, 2.0, 4.0, 4.0, 2), "b": (2.0, 1.0, 3.0, 3.0, 2)}


def test_values_travel_as_their_shortest_float32_decimal() -> None:
    base = (T0_NS // (20 * MS)) * 20 * MS
    got = run_all(TelemetryAggregator(("a",), 20 * MS), [win(base, [[400.12], [400.13]], ("a",))])
    st = got[0].stats["a"]
    assert (st.min, st.max, st.last) == (400.12, 400.13, 400.13)
    assert np.float32(st.mean) == np.float32((np.float32(400.12) + np.float32(400.13)) / 2)
    msg = telemetry_msg(got[0], True, {"a": SignalStats(*st)}, device="d1", boot_id=BOOT, seq=0)
    assert b"[400.125,400.12,400.13,400.13,2]" in encode(msg)


@pytest.mark.parametrize(
    ("signals", "period", "match"),
    [
        ((), 10 * MS, "at least one signal"),
        (("a", "a"), 10 * MS, "repeated: a"),
        (("a",), 0, "period_ns"),
        (("a",), 3_600_000_000_001, "period_ns"),
    ],
)
def test_aggregator_rejects_bad_arguments(
    signals: tuple[str, ...], period: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        TelemetryAggregator(signals, period)


# -- delta encoding ---------------------------------------------------------------------------


def test_keyframe_first_then_every_n_and_after_reset_or_period_change() -> None:
    enc = DeltaEncoder(("a", "b"), default_deadband=1.0, keyframe_every=3)
    one, two = (1.0, 1.0, 1.0, 1), (2.0, 2.0, 2.0, 1)
    kinds = []
    for i in range(7):
        keyframe, signals = enc.encode(agg_of(T0_NS + i * 10 * MS, a=one, b=two))
        kinds.append(keyframe)
        # A keyframe carries every signal even when nothing moved; a quiet delta nothing.
        assert set(signals) == ({"a", "b"} if keyframe else set())
    assert kinds == [True, False, False, True, False, False, True]
    enc.reset()
    assert [enc.encode(agg_of(T0_NS, a=one, b=two))[0] for _ in range(4)] == [
        True,
        False,
        False,
        True,
    ]
    assert enc.encode(agg_of(T0_NS, period_ns=20 * MS, a=one, b=two))[0] is True
    assert enc.stats.keyframes == 6
    assert enc.stats.aggregates == 12
    assert enc.stats.empty == 6


def test_deadband_is_strictly_greater_on_mean_min_and_max() -> None:
    enc = DeltaEncoder(("a", "b"), default_deadband=0.5, deadband={"b": 2.0}, keyframe_every=1000)
    base = (10.0, 9.0, 11.0, 4)

    def sent(a: tuple[float, float, float, int]) -> set[str]:
        return set(enc.encode(agg_of(T0_NS, a=a, b=(0.0, 0.0, 0.0, 1)))[1])

    assert sent(base) == {"a", "b"}  # keyframe
    assert sent((10.5, 9.5, 11.5, 4)) == set()  # exactly the deadband: not more
    assert sent((9.5, 8.5, 10.5, 4)) == set()
    assert sent((10.0, 9.0, 11.75, 4)) == {"a"}  # max alone moved past it
    assert sent((10.0, 9.0, 11.75, 4)) == set()
    assert sent((10.0, 8.0, 11.75, 4)) == {"a"}  # min alone
    assert sent((10.75, 8.0, 11.75, 4)) == {"a"}  # mean alone
    assert sent((10.75, 8.0, 11.75, 3)) == {"a"}  # n changed: coverage is news
    # b's own deadband (2.0) overrides the default.
    assert (
        set(enc.encode(agg_of(T0_NS, a=(10.75, 8.0, 11.75, 3), b=(2.0, 2.0, 2.0, 1)))[1]) == set()
    )
    assert set(enc.encode(agg_of(T0_NS, a=(10.75, 8.0, 11.75, 3), b=(2.5, 2.5, 2.5, 1)))[1]) == {
        "b"
    }
    assert enc.deadband == {"a": 0.5, "b": 2.0}


def test_slow_drift_is_sent_once_it_adds_up_past_the_deadband() -> None:
    # Each step moves 0.125, a quarter of the deadband: compared with the last value *seen*
    # it would never be sent; compared with the last value sent it is, every 5th step.
    enc = DeltaEncoder(("a",), default_deadband=0.5, keyframe_every=10_000)
    rebuilt = Reconstructor()
    sent_at = []
    for i in range(21):
        v = 100.0 + 0.125 * i
        a = agg_of(T0_NS + i * 10 * MS, a=(v, v, v, 1))
        keyframe, signals = enc.encode(a)
        if signals:
            sent_at.append(i)
            msg = telemetry_msg(a, keyframe, signals, device="d1", boot_id=BOOT, seq=len(sent_at))
            rebuilt.apply(msg)
        assert abs(rebuilt.state["a"].mean - v) <= 0.5
    assert sent_at == [0, 5, 10, 15, 20]


def test_signals_that_disappear_are_sent_once_as_n_zero_and_reappear() -> None:
    enc = DeltaEncoder(("a", "b"), default_deadband=1.0, keyframe_every=100)
    rebuilt = Reconstructor()
    one = PeriodStats(1.0, 1.0, 1.0, 1.0, 1)
    steps: list[dict[str, PeriodStats]] = [
        {"a": one, "b": one},
        {"a": one},
        {"a": one},
        {"a": one, "b": one},
    ]
    carried = []
    for i, stats in enumerate(steps):
        a = Aggregate(t_ns=T0_NS + i * 10 * MS, period_ns=10 * MS, stats=stats)
        keyframe, signals = enc.encode(a)
        carried.append(signals)
        rebuilt.apply(telemetry_msg(a, keyframe, signals, device="d1", boot_id=BOOT, seq=i))
        assert set(rebuilt.state) == set(stats)
    assert carried[1] == {"b": GONE}
    assert carried[2] == {}
    assert carried[3] == {"b": SignalStats(1.0, 1.0, 1.0, 1.0, 1)}


def test_signals_the_encoder_does_not_know_are_ignored_and_counted() -> None:
    enc = DeltaEncoder(("a",), default_deadband=0.0, keyframe_every=5)
    keyframe, signals = enc.encode(agg_of(T0_NS, a=(1.0, 1.0, 1.0, 1), zz=(1.0, 1.0, 1.0, 1)))
    assert keyframe
    assert set(signals) == {"a"}
    assert enc.stats.unknown_signals == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"default_deadband": 0.1, "deadband": {"nope": 1.0}, "keyframe_every": 5}, "nope"),
        ({"default_deadband": -0.1, "keyframe_every": 5}, "'a'.*>= 0"),
        ({"default_deadband": 0.1, "deadband": {"a": math.nan}, "keyframe_every": 5}, "finite"),
        ({"default_deadband": 0.1, "keyframe_every": 0}, "keyframe_every"),
    ],
)
def test_encoder_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DeltaEncoder(("a",), **kwargs)  # type: ignore[arg-type]


def test_reconstructor_needs_a_keyframe_and_starts_over_on_a_new_boot() -> None:
    rebuilt = Reconstructor()
    a = agg_of(T0_NS, a=(1.0, 1.0, 1.0, 1))
    stats = {"a": SignalStats(1.0, 1.0, 1.0, 1.0, 1)}
    rebuilt.apply(telemetry_msg(a, False, stats, device="d1", boot_id=BOOT, seq=3))
    assert not rebuilt.synced  # joined mid-stream: partial state only
    rebuilt.apply(telemetry_msg(a, True, stats, device="d1", boot_id=BOOT, seq=4))
    assert rebuilt.synced
    other = "f" * 32
    rebuilt.apply(telemetry_msg(a, False, {}, device="d1", boot_id=other, seq=0))
    assert not rebuilt.synced
    assert rebuilt.state == {}


def test_telemetry_msg_round_trips_the_wire() -> None:
    a = agg_of(T0_NS + 10 * MS, a=(1.5, 1.0, 2.0, 3))
    msg = telemetry_msg(
        a, False, {"a": SignalStats(*a.stats["a"])}, device="press-01", boot_id=BOOT, seq=7
    )
    assert (msg.t_ns, msg.period_ns, msg.seq, msg.keyframe) == (T0_NS + 10 * MS, 10 * MS, 7, False)
    assert decode("telemetry", encode(msg)) == msg


# -- on the simulated plant -------------------------------------------------------------------


def _stream(
    aggs: Sequence[Aggregate], enc: DeltaEncoder, reset_at: int | None = None
) -> tuple[int, int, list[bool]]:
    """Encode, send through the wire, rebuild; check every period. (full B, delta B, kinds)."""
    rebuilt = Reconstructor()
    full = delta = seq = 0
    kinds: list[bool] = []
    for i, a in enumerate(aggs):
        if i == reset_at:
            enc.reset()  # a reconnect gap: the receiver may have missed messages
            rebuilt = Reconstructor()
        everything = {s: SignalStats(*v) for s, v in a.stats.items()}
        full += len(encode(telemetry_msg(a, True, everything, device="d1", boot_id=BOOT, seq=i)))
        keyframe, signals = enc.encode(a)
        if i == reset_at:
            assert keyframe
        if keyframe or signals:
            payload = encode(
                telemetry_msg(a, keyframe, signals, device="d1", boot_id=BOOT, seq=seq)
            )
            seq += 1
            delta += len(payload)
            kinds.append(keyframe)
            msg = decode("telemetry", payload)
            assert isinstance(msg, TelemetryMsg)
            rebuilt.apply(msg)
        assert rebuilt.synced
        assert rebuilt.state.keys() == a.stats.keys(), a.t_ns
        for name, v in a.stats.items():
            r, band = rebuilt.state[name], enc.deadband[name]
            assert abs(r.mean - v.mean) <= band, (a.t_ns, name)
            assert abs(r.min - v.min) <= band, (a.t_ns, name)
            assert abs(r.max - v.max) <= band, (a.t_ns, name)
            assert r.n == v.n
    return full, delta, kinds


@pytest.mark.parametrize("period_ms", [10, 1000])
def test_every_message_rebuilds_within_the_deadband_through_a_spike(period_ms: int) -> None:
    spike = parse_anomaly("spike:current@20+10x30")
    windows = list(plant_windows(seconds=45.0, anomalies=[spike]))
    aggs = run_all(TelemetryAggregator(SIGNALS, period_ms * MS), windows)
    bands = dict(NOISE_STD)
    enc = DeltaEncoder(SIGNALS, default_deadband=0.0, deadband=bands, keyframe_every=500)
    full, delta, kinds = _stream(aggs, enc, reset_at=len(aggs) * 2 // 3)
    assert delta < full
    assert kinds.count(True) >= 2
    # The spikes (18-30 A above normal) reach the receiver in the periods they happen in.
    in_spike = [a for a in aggs if spike.start_s <= (a.t_ns - T0_NS) / 1e9 - 0.01 < spike.end_s]
    normal = [a.stats["current"].max for a in aggs if a not in in_spike]
    assert max(a.stats["current"].max for a in in_spike) > max(normal) + 15


def test_delta_messages_are_much_smaller_than_full_ones_at_100_hz() -> None:
    windows = list(plant_windows(seconds=30.0))
    aggs = run_all(TelemetryAggregator(SIGNALS, 10 * MS), windows)
    enc = DeltaEncoder(SIGNALS, default_deadband=0.0, deadband=NOISE_STD, keyframe_every=1000)
    full, delta, kinds = _stream(aggs, enc)
    # Deadband = 1 sigma of noise: ~54 % saved (bench.uplink_delta has the figures).
    assert delta < 0.6 * full
    assert len(kinds) < len(aggs)  # empty deltas were not sent
    # A keyframe costs what a full message does.
    a = aggs[0]
    keyframe, signals = DeltaEncoder(SIGNALS, default_deadband=0.0, keyframe_every=1).encode(a)
    everything = {s: SignalStats(*v) for s, v in a.stats.items()}
    assert keyframe
    assert signals == everything


def test_batched_periods_rebuild_like_single_ones_and_cost_far_less() -> None:
    windows = list(plant_windows(seconds=30.0))
    aggs = run_all(TelemetryAggregator(SIGNALS, 10 * MS), windows)
    bands = dict(NOISE_STD)
    one = DeltaEncoder(SIGNALS, default_deadband=0.0, deadband=bands, keyframe_every=1000)
    many = DeltaEncoder(SIGNALS, default_deadband=0.0, deadband=bands, keyframe_every=1000)
    singles, batched = Reconstructor(), Reconstructor()
    single_bytes = batch_bytes = 0
    pending: list[tuple[Aggregate, bool, dict[str, SignalStats]]] = []
    expected: list[tuple[int, dict[str, SignalStats]]] = []
    got: list[tuple[int, dict[str, SignalStats]]] = []
    for i, a in enumerate(aggs):
        k1, s1 = one.encode(a)
        if k1 or s1:
            raw = encode(telemetry_msg(a, k1, s1, device="gw", boot_id="b" * 32, seq=i))
            single_bytes += len(raw)
            msg = decode("telemetry", raw)
            assert isinstance(msg, TelemetryMsg)
            expected += singles.apply_each(msg)
        k2, s2 = many.encode(a)
        if k2 or s2:
            pending.append((a, k2, s2))
        if len(pending) == 100 or (i == len(aggs) - 1 and pending):
            raw = encode(telemetry_batch_msg(pending, device="gw", boot_id="b" * 32, seq=i))
            batch_bytes += len(raw)
            msg = decode("telemetry", raw)
            assert isinstance(msg, TelemetryMsg)
            assert len(periods_of(msg)) == len(pending)
            got += batched.apply_each(msg)
            pending = []
    # The receiver sees exactly the same states period by period, for a fraction of the bytes.
    assert got == expected
    assert batch_bytes < 0.75 * single_bytes
    other = Aggregate(aggs[1].t_ns, 20 * MS, aggs[1].stats)
    mixed: list[tuple[Aggregate, bool, dict[str, SignalStats]]] = [
        (aggs[0], True, {}),
        (other, True, {}),
    ]
    with pytest.raises(ValueError, match="one length"):
        telemetry_batch_msg(mixed, device="gw", boot_id="b" * 32, seq=0)


def test_a_window_without_our_signals_still_moves_time_forward() -> None:
    base = (T0_NS // (20 * MS)) * 20 * MS
    agg = TelemetryAggregator(("a",), 20 * MS)
    assert agg.add(win(base, [[1], [2]], ("a",))) == []
    got = agg.add(win(base + 20 * MS, [[5]], ("x",)))  # one row: the scalar path
    assert [(a.t_ns - base, a.stats) for a in got] == [(20 * MS, {"a": (1.5, 1.0, 2.0, 2.0, 2)})]
    got = agg.add(win(base + 30 * MS, [[5]] * 12, ("x",)))  # a window's worth: numpy
    assert [a.t_ns - base for a in got] == [k * 20 * MS for k in range(2, 8)]
    assert all(a.stats == {} for a in got)
    assert agg.rows == 15
