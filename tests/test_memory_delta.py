"""Delta encoding: the state reconstructed from stored rows equals a full-state record."""

import math
from pathlib import Path

import numpy as np
import pytest

from edge_agent.memory.delta import DeltaEncoder, Row, reconstruct, series
from tests.support.memory import (
    PERIOD,
    POINTS,
    T0,
    feed,
    random_walk,
    record_at,
    run,
    same,
    stage,
)

SIGNALS = ("a", "b", "c", "d")
IDS = [1, 2, 3, 4]


def encode_all(
    enc: DeltaEncoder, values: np.ndarray, *, keyframe_every: int = 10
) -> tuple[list[Row], list[tuple[int, int]]]:
    """Encode ``values`` window by window; returns rows and (keyframe t, row index)."""
    rows: list[Row] = []
    keyframes: list[tuple[int, int]] = []
    for i in range(values.shape[0] // POINTS):
        res = enc.encode(
            T0 + i * POINTS * PERIOD,
            PERIOD,
            values[i * POINTS : (i + 1) * POINTS],
            keyframe=i % keyframe_every == 0,
        )
        if res.keyframe:
            assert res.first_ns is not None
            keyframes.append((res.first_ns, len(rows)))
        rows.extend(res.rows)
    return rows, keyframes


def state_at(rows: list[Row], keyframes: list[tuple[int, int]], t: int) -> dict[int, float]:
    """What the store does: nearest keyframe at or before t, then the rows after it."""
    start = max(i for kt, i in keyframes if kt <= t)
    return reconstruct(rows[start:], t, IDS)


def test_lossless_round_trip_at_random_timestamps() -> None:
    rng = np.random.default_rng(42)
    values = random_walk(rng, 40, len(IDS), nan_rate=0.002)
    enc = DeltaEncoder(IDS, [0.0] * len(IDS))
    rows, keyframes = encode_all(enc, values)
    assert len(rows) < values.size  # held values are not repeated
    end = T0 + values.shape[0] * PERIOD
    for t in rng.integers(T0, end, size=500).tolist():
        got = state_at(rows, keyframes, t)
        want = record_at(values, t)
        for j, sid in enumerate(IDS):
            # Bit-identical: float32 in, float32 out (NaN where the cell was NaN or inf).
            assert same(np.float32(got[sid]), want[j]), (t, j, got[sid], want[j])
    # Every grid point, not only random ones, for one signal.
    for k in range(0, values.shape[0], 7):
        t = T0 + k * PERIOD
        assert same(np.float32(state_at(rows, keyframes, t)[1]), record_at(values, t)[0])


def test_lossless_fast_path_and_loop_agree() -> None:
    rng = np.random.default_rng(3)
    clean = random_walk(rng, 8, len(IDS))
    dirty = clean.copy()
    dirty[5, 1] = np.nan  # forces the general loop for that window
    fast, _ = encode_all(DeltaEncoder(IDS, [0.0] * 4), clean)
    slow_enc = DeltaEncoder(IDS, [0.0] * 4)
    slow, _ = encode_all(slow_enc, dirty)
    # Same rows except around the NaN cell (unknown at row 5, known again at row 6).
    extra = [r for r in slow if r not in fast]
    assert extra == [(T0 + 5 * PERIOD, 2, None), (T0 + 6 * PERIOD, 2, float(dirty[6, 1]))]


def test_deadband_reconstruction_stays_within_the_deadband() -> None:
    rng = np.random.default_rng(7)
    values = random_walk(rng, 30, len(IDS), hold=1, nan_rate=0.001)
    deadbands = [0.0, 0.25, 1.0, 5.0]
    enc = DeltaEncoder(IDS, deadbands)
    rows, keyframes = encode_all(enc, values)
    lossless, _ = encode_all(DeltaEncoder(IDS, [0.0] * 4), values)
    assert len(rows) < len(lossless)
    for k in range(values.shape[0]):
        t = T0 + k * PERIOD
        got = state_at(rows, keyframes, t)
        want = record_at(values, t)
        for j, sid in enumerate(IDS):
            if math.isnan(want[j]):
                assert math.isnan(got[sid]), (k, j)
            else:
                assert abs(got[sid] - float(want[j])) <= deadbands[j] + 1e-9, (k, j)


def test_deadband_is_measured_from_the_stored_value_so_creep_is_caught() -> None:
    enc = DeltaEncoder([1], [1.0])
    creep = (np.arange(POINTS, dtype=np.float32) * 0.3).reshape(-1, 1)
    res = enc.encode(T0, PERIOD, creep)
    stored = [v for _, _, v in res.rows]
    # 0.0, then each time it is more than 1.0 above the last STORED value.
    assert stored[:4] == pytest.approx([0.0, 1.2, 2.4, 3.6], abs=1e-5)
    assert res.keyframe
    assert res.cells == POINTS


def test_unknown_and_known_again_are_rows_and_non_finite_is_counted() -> None:
    enc = DeltaEncoder([1, 2], [0.0, 0.5])
    v = np.array([[1.0, 1.0], [np.nan, np.inf], [np.nan, -np.inf], [2.0, 1.2]], dtype=np.float32)
    res = enc.encode(T0, PERIOD, v)
    assert res.non_finite == 4
    assert res.rows == [
        (T0, 1, 1.0),
        (T0, 2, 1.0),
        (T0 + PERIOD, 1, None),
        (T0 + PERIOD, 2, None),
        (T0 + 3 * PERIOD, 1, 2.0),
        (T0 + 3 * PERIOD, 2, pytest.approx(1.2)),
    ]


def test_clock_going_backwards_skips_points_already_encoded() -> None:
    enc = DeltaEncoder([1], [0.0])
    first = enc.encode(T0, PERIOD, np.arange(4, dtype=np.float32).reshape(-1, 1))
    assert first.last_ns == T0 + 3 * PERIOD
    again = enc.encode(T0 + 2 * PERIOD, PERIOD, np.full((4, 1), 9.0, dtype=np.float32))
    assert again.behind == 2
    assert again.first_ns == T0 + 4 * PERIOD
    assert [r[0] for r in again.rows] == [T0 + 4 * PERIOD]
    whole = enc.encode(T0, PERIOD, np.zeros((4, 1), dtype=np.float32))
    assert whole.behind == 4
    assert whole.rows == []
    assert whole.first_ns is None


def test_disabled_encoder_writes_every_cell() -> None:
    enc = DeltaEncoder([1, 2], [0.0, 0.0], enabled=False)
    v = np.ones((POINTS, 2), dtype=np.float32)
    v[3, 1] = np.nan
    res = enc.encode(T0, PERIOD, v)
    assert len(res.rows) == v.size
    assert (T0 + 3 * PERIOD, 2, None) in res.rows


def test_invalidate_forces_a_keyframe() -> None:
    enc = DeltaEncoder([1, 2], [0.0, 0.0])
    v = np.ones((4, 2), dtype=np.float32)
    assert enc.encode(T0, PERIOD, v).keyframe
    assert enc.encode(T0 + 4 * PERIOD, PERIOD, v).rows == []
    enc.invalidate()
    res = enc.encode(T0 + 8 * PERIOD, PERIOD, v)
    assert res.keyframe
    assert len(res.rows) == 2


def test_series_reports_state_at_since_and_changes() -> None:
    rows: list[Row] = [(10, 1, 1.0), (10, 2, 5.0), (20, 1, 2.0), (30, 1, None), (40, 1, 3.0)]
    initial, changes = series(rows, 1, 15, 35)
    assert initial == 1.0
    assert changes[0] == (20, 2.0)
    assert changes[1][0] == 30
    assert math.isnan(changes[1][1])
    initial, changes = series(rows, 1, 25, 100)
    assert initial == 2.0
    assert [t for t, _ in changes] == [30, 40]
    assert changes[1] == (40, 3.0)


def test_store_round_trip_matches_the_full_state_record(tmp_path: Path) -> None:
    """Through the real stage and SQLite: state_at and history equal the record."""
    tmp = tmp_path
    rng = np.random.default_rng(11)
    values = random_walk(rng, 30, len(SIGNALS), nan_rate=0.002)

    async def main() -> None:
        st = stage(tmp, SIGNALS, keyframe_interval_s=3.0)
        async with st:
            end = feed(st, values, SIGNALS)
            assert await st.flush()
            for t in rng.integers(T0, end, size=200).tolist():
                got = await st.state_at(t)
                want = record_at(values, t)
                for j, name in enumerate(SIGNALS):
                    assert same(np.float32(got[name]), want[j]), (t, name)
            since, until = T0 + 137 * PERIOD, T0 + 901 * PERIOD
            h = await st.history("b", since, until)
            assert same(np.float32(h.initial), record_at(values, since)[1])
            state = h.initial
            changes = dict(h.changes)
            for k in range(138, 902):
                t = T0 + k * PERIOD
                state = changes.get(t, state)
                assert same(np.float32(state), record_at(values, t)[1]), k
            stats = st.stats()
            assert stats["non_finite"] > 0
            assert stats["rows"] < values.size

    run(main())
