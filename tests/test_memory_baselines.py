"""Baselines: decayed mean/variance, min/max, last seen, drift; persisted and consolidated."""

import math
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from edge_agent.memory.baselines import Baselines
from tests.support.memory import PERIOD, POINTS, T0, S, feed, run, stage

HOUR = 3600.0


def test_without_decay_mean_and_variance_match_numpy_ignoring_non_finite() -> None:
    rng = np.random.default_rng(1)
    b = Baselines(3, half_life_s=1e9, drift_half_life_s=1e9)
    data = rng.normal([10.0, -3.0, 0.0], [2.0, 0.5, 1.0], size=(20 * POINTS, 3))
    data[5, 0] = np.nan
    data[100:130, 2] = np.inf
    for i in range(20):
        b.update(data[i * POINTS : (i + 1) * POINTS], T0 + i * POINTS * PERIOD, PERIOD)
    for j in range(3):
        col = data[:, j][np.isfinite(data[:, j])]
        assert b.means()[j] == pytest.approx(col.mean(), abs=1e-9)
        assert b.var()[j] == pytest.approx(col.var(), rel=1e-6)
        assert b.min[j] == col.min()
        assert b.max[j] == col.max()
        assert b.count[j] == col.size
    assert b.non_finite == 31
    assert b.last_seen_ns[0] == T0 + (20 * POINTS - 1) * PERIOD


def test_decay_forgets_an_old_level_with_the_half_life() -> None:
    b = Baselines(1, half_life_s=60.0, drift_half_life_s=6.0)
    ones = np.ones((POINTS, 1))
    b.update(ones * 0.0, T0, PERIOD)
    w0 = float(b.weight[0])
    # One half-life later, the old points weigh half as much as the same count of new ones.
    end0 = T0 + (POINTS - 1) * PERIOD
    b.update(ones * 10.0, end0 + 60 * S - (POINTS - 1) * PERIOD, PERIOD)
    assert b.weight[0] == pytest.approx(w0 * 0.5 + POINTS)
    assert b.means()[0] == pytest.approx(10.0 * POINTS / (0.5 * POINTS + POINTS))


def test_drift_is_small_when_stationary_and_large_after_a_step() -> None:
    rng = np.random.default_rng(5)
    b = Baselines(2, half_life_s=HOUR, drift_half_life_s=30.0)
    t = T0
    for _ in range(2000):  # ~21 min of stationary noise
        b.update(rng.normal(0, 1, size=(POINTS, 2)), t, PERIOD)
        t += POINTS * PERIOD
    assert np.all(np.abs(b.drift()) < 1.0)
    for _ in range(100):  # signal 0 steps up by 3 sigma for 64 s
        v = rng.normal(0, 1, size=(POINTS, 2))
        v[:, 0] += 3.0
        b.update(v, t, PERIOD)
        t += POINTS * PERIOD
    drift = b.drift()
    assert drift[0] > 1.5
    assert abs(drift[1]) < 1.0
    norm = b.normalize(np.array([[3.0, 0.0]]))
    assert norm[0, 0] > 1.5


def test_constant_signal_has_a_floored_std_and_no_division_by_zero() -> None:
    b = Baselines(1, half_life_s=HOUR, drift_half_life_s=60.0)
    b.update(np.full((POINTS, 1), 5.0), T0, PERIOD)
    mean, std, drift = b.summary()
    assert mean[0] == 5.0
    assert std[0] == 0.0
    assert drift[0] == 0.0
    assert np.isfinite(b.normalize(np.array([[5.1]])))[0, 0]


def test_no_data_yet_is_nan() -> None:
    b = Baselines(2, half_life_s=HOUR, drift_half_life_s=60.0)
    v = np.full((POINTS, 2), np.nan)
    v[:, 0] = 1.0
    b.update(v, T0, PERIOD)
    mean, std, drift = b.summary()
    assert mean[0] == 1.0
    assert math.isnan(mean[1])
    assert math.isnan(std[1])
    assert math.isnan(drift[1])


def test_update_held_equals_updating_with_the_held_points() -> None:
    a = Baselines(1, half_life_s=1e9, drift_half_life_s=1e9)
    b = Baselines(1, half_life_s=1e9, drift_half_life_s=1e9)
    a.update(np.full((POINTS, 1), 2.0), T0, PERIOD)
    a.update(np.full((POINTS, 1), 4.0), T0 + POINTS * PERIOD, PERIOD)
    b.update_held(0, 2.0, T0 + POINTS * PERIOD, POINTS * PERIOD, PERIOD)
    b.update_held(0, 4.0, T0 + 2 * POINTS * PERIOD, POINTS * PERIOD, PERIOD)
    assert b.means()[0] == pytest.approx(a.means()[0])
    assert b.var()[0] == pytest.approx(a.var()[0])


def test_baselines_are_persisted_and_reloaded(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    sig = ("x", "y")
    values = rng.normal([50.0, 1.0], [5.0, 0.1], size=(30 * POINTS, 2)).astype(np.float32)

    async def first() -> tuple[float, float]:
        st = stage(tmp_path, sig, keyframe_interval_s=1.0)
        async with st:
            feed(st, values, sig)
            mean, std, _ = st.baselines.summary()
        return float(mean[0]), float(std[0])

    mean0, std0 = run(first())

    async def second() -> tuple[float, float]:
        st = stage(tmp_path, sig)
        async with st:
            mean, std, _ = st.baselines.summary()
        return float(mean[0]), float(std[0])

    # The last keyframe's baselines were persisted (at most one keyframe interval behind).
    mean1, std1 = run(second())
    assert mean1 == pytest.approx(mean0, rel=0.01)
    assert std1 == pytest.approx(std0, rel=0.05)


def test_baselines_are_consolidated_from_the_episodic_store_when_missing(tmp_path: Path) -> None:
    sig = ("x",)
    values = np.repeat(np.arange(10, dtype=np.float32), 3 * POINTS).reshape(-1, 1)

    async def write() -> None:
        st = stage(tmp_path, sig)
        async with st:
            feed(st, values, sig)

    run(write())
    conn = sqlite3.connect(tmp_path / "memory.db")
    conn.execute("DELETE FROM baselines")
    conn.commit()
    conn.close()

    async def reopen() -> tuple[float, float, float]:
        st = stage(tmp_path, sig, baseline_half_life_s=1e6, drift_half_life_s=1e6)
        async with st:
            b = st.baselines
            return float(b.means()[0]), float(b.min[0]), float(b.max[0])

    mean, lo, hi = run(reopen())
    assert mean == pytest.approx(4.5, abs=0.05)  # 0..9 each held equally long
    assert (lo, hi) == (0.0, 9.0)
