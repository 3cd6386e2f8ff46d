"""The training statistics in the manifest and a window's view of them (models.input_stats).

Real data throughout: windows of the simulator through the training acquisition
(:mod:`models.dataset`) and the committed manifests.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from models import load_model
from models.dataset import FIELD_BUSES, SIGNALS, WINDOW, continuous_normal
from models.errors import ModelRejected
from models.input_stats import (
    MARGINS,
    S_MAX,
    S_MIN,
    S_REPEAT,
    S_RUN,
    S_STEP,
    InputStats,
    compute,
    out_of_training,
    why_outside,
    window_stats,
)
from models.kernels import kernels
from models.runtime import DEFAULT_MODEL_DIR, ModelManifest

ROOT = Path(__file__).parents[1]
SLOW_DIR = ROOT / "models" / "motor_drive_slow"


def test_window_stats_measure_levels_repeats_runs_and_changes() -> None:
    x = np.zeros((WINDOW, 3), dtype=np.float32)
    x[:, 0] = np.arange(WINDOW)  # a new value every step, changes of 1
    x[:, 1] = np.repeat(np.arange(WINDOW // 4), 4)  # held 4 steps, then +1
    x[:, 2] = 5.0  # frozen
    x[10, 2] = np.nan  # a hole: neither a repeat nor a change
    st = window_stats(x)
    assert st[0, S_MIN] == 0
    assert st[0, S_MAX] == WINDOW - 1
    assert st[0, S_REPEAT] == 0
    assert st[0, S_RUN] == 0
    assert st[0, S_STEP] == 1
    assert st[1, S_REPEAT] == pytest.approx(48 / 63)
    assert st[1, S_RUN] == 3
    assert st[1, S_STEP] == 1
    assert st[2, S_MIN] == st[2, S_MAX] == 5
    assert st[2, S_REPEAT] == pytest.approx(61 / 63)  # two steps touch the NaN
    assert st[2, S_RUN] == 52
    assert st[2, S_STEP] == 0
    batch = window_stats(np.stack([x, x]))
    np.testing.assert_array_equal(batch[1], st)


def test_the_longest_repeat_run_matches_a_step_by_step_count() -> None:
    """window_stats counts runs without a Python step per row; the count must equal the
    obvious one on windows and batches of random repeats, NaN holes and none at all."""
    rng = np.random.default_rng(7)
    for shape in [(WINDOW, 5), (3, WINDOW, 4), (2, 2, 3), (WINDOW, 1)]:
        for p_hold in (0.0, 0.5, 0.9, 1.0):
            x = rng.integers(0, 4, size=shape).astype(np.float32)
            hold = rng.random(shape) < p_hold
            for t in range(1, shape[-2]):  # a held point repeats the one before
                x[..., t, :] = np.where(hold[..., t, :], x[..., t - 1, :], x[..., t, :])
            x[rng.random(shape) < 0.05] = np.nan
            same = x[..., 1:, :] == x[..., :-1, :]
            want = np.zeros(same.shape[:-2] + same.shape[-1:])
            cur = np.zeros_like(want)
            for t in range(same.shape[-2]):
                cur = np.where(same[..., t, :], cur + 1, 0)
                want = np.maximum(want, cur)
            np.testing.assert_array_equal(window_stats(x)[..., S_RUN], want)


def test_the_committed_manifests_carry_statistics_and_still_load() -> None:
    """The statistics were added without retraining: the model files, their sha256 and
    every manifest check are untouched."""
    model = load_model()
    stats = model.manifest.input_stats
    assert stats is not None
    assert set(stats.signals) == set(SIGNALS)
    assert stats.windows > 40_000  # every normal training window
    current = stats.signals["current"]
    assert current.step_median == pytest.approx(0.08, abs=0.005)
    assert current.repeat_share[0] == 0.0 < current.repeat_share[1] < 1.0
    temperature = stats.signals["temperature"]
    assert temperature.repeat_run[1] == WINDOW - 1  # a 200 ms poll of a slow signal
    slow = ModelManifest.load(SLOW_DIR / "manifest.json")
    assert slow.input_stats == stats  # trained on the same windows
    raw = json.loads((DEFAULT_MODEL_DIR / "manifest.json").read_text())
    assert raw["training"]["input_stats"] == stats.describe()


def test_a_malformed_statistics_entry_is_rejected_naming_the_key() -> None:
    doc = json.loads((DEFAULT_MODEL_DIR / "manifest.json").read_text())
    doc["training"]["input_stats"]["signals"]["speed"]["repeat_run"] = [5, 2]
    with pytest.raises(ModelRejected, match=r"input_stats\.signals\.speed\.repeat_run"):
        ModelManifest.from_json(doc)
    del doc["training"]["input_stats"]["signals"]["speed"]
    with pytest.raises(ModelRejected, match="no statistics for speed"):
        ModelManifest.from_json(doc)
    doc["training"]["acquisition"]["signals"]["current"]["period_ms"] = "10"
    with pytest.raises(ModelRejected, match=r"acquisition\.signals\.current\.period_ms"):
        ModelManifest.from_json(doc)


def test_a_statistics_round_trip_is_exact() -> None:
    windows = continuous_normal(170_001, 100.0, 40)
    stats = compute(windows, SIGNALS, "a test run")
    again = InputStats.from_description(json.loads(json.dumps(stats.describe())), SIGNALS)
    assert again == stats
    assert again.windows == 40
    assert again.source == "a test run"


def test_held_out_normal_running_stays_inside_and_a_frozen_sensor_does_not() -> None:
    """10 minutes of normal running on a plant seed never trained on: at most 0.5 % of
    windows outside (the evidence: 1 in 22,500 over 4 h). The same running with current
    frozen: every window outside, on current only, and the reason says so."""
    m = load_model().manifest
    assert m.input_stats is not None
    bounds = m.input_stats.bounds(m.signals, MARGINS)
    stats = np.zeros((len(SIGNALS), 5), dtype=np.float32)
    windows = continuous_normal(250_003, 900.0, 940)
    outside = [out_of_training(x, bounds, stats) for x in windows]
    assert sum(1 for mask in outside if mask) <= 0.005 * len(windows)
    col = SIGNALS.index("current")
    frozen = windows[:50].copy()
    frozen[:, :, col] = frozen[:, :1, col]
    masks = {out_of_training(x, bounds, stats) for x in frozen}
    assert masks == {1 << col}
    reason = why_outside(stats[col], bounds[col])
    assert "repeats on 100% of steps" in reason
    assert "held 64 steps" in reason


def test_the_compiled_kernel_flags_exactly_what_numpy_flags() -> None:
    k = kernels()
    if k is None:
        pytest.skip("numba kernels unavailable here")
    m = load_model().manifest
    assert m.input_stats is not None
    bounds = m.input_stats.bounds(m.signals)
    rng = np.random.default_rng(3)
    windows = list(continuous_normal(250_001, 60.0, 60))
    windows += list(continuous_normal(250_001, 60.0, 30, FIELD_BUSES)[:, ::-1].copy())
    for w in windows[:40]:
        x = w.copy()
        x[:, rng.integers(6)] = x[0, rng.integers(6)]  # a frozen column
        windows.append(x)
        y = w.copy()
        y[:, rng.integers(6)] *= rng.choice([0.5, 2.0, 10.0])  # off scale
        windows.append(y)
    hole = windows[0].copy()
    hole[5:9, 2] = np.nan
    windows += [hole, np.full((WINDOW, 6), np.nan, dtype=np.float32)]
    a = np.zeros((6, 5), dtype=np.float32)
    b = np.zeros((6, 5), dtype=np.float32)
    flagged = 0
    for w in windows:
        x = np.ascontiguousarray(w, dtype=np.float32)
        mask = k.input_out_mask(x, bounds, a)
        assert mask == out_of_training(x, bounds, b)
        np.testing.assert_allclose(a, b, rtol=1e-6, equal_nan=True)
        flagged += bool(mask)
    assert flagged >= 60  # the frozen and off-scale ones
