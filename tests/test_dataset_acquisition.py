"""Training windows go through the same acquisition as the live agent (:mod:`models.dataset`).

The field-bus profile must match the example config and the DBC, its grid must be exactly
what :class:`edge_agent.perception.Aligner` makes of the same samples, and the ideal profile
must still be ``values_at`` on the grid.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import cantools
import numpy as np
import pytest
from cantools.database.can import Database as CanDatabase

from drivers.sample import Sample
from drivers.sim.plant import Anomaly, MotorPlant
from edge_agent.perception import Aligner, PerceptionSpec
from edge_agent.simwindows import T0_NS, plant_windows
from models import dataset
from models.dataset import FIELD_BUSES, IDEAL, SIGNALS, WINDOW

pytestmark = pytest.mark.peers

ROOT = Path(__file__).resolve().parents[1]
STEP_NS = 10_000_000


def _rows(plant: MotorPlant, first: int, n: int) -> np.ndarray:
    return np.array(
        [[plant.values_at((first + i) / 100)[s] for s in SIGNALS] for i in range(n)],
        dtype=np.float64,
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_grid_is_what_perception_makes_of_the_same_samples(seed: int) -> None:
    rows = _rows(MotorPlant(seed), 2500, 300)
    n_grid = 200
    grid = dataset.acquire(rows, n_grid, FIELD_BUSES, np.random.default_rng(seed))
    samples = dataset.acquire_samples(rows, n_grid, FIELD_BUSES, np.random.default_rng(seed))
    spec = PerceptionSpec(
        signals=SIGNALS,
        window=n_grid,
        hop=1,
        max_staleness_ms=10_000.0,
        max_catch_up_windows=1000,
    )
    aligner = Aligner(spec)
    for name, (t_ms, v) in samples.items():
        aligner.push_many(
            Sample(name, float(x), T0_NS + round(t * 1e6)) for t, x in zip(t_ms, v, strict=True)
        )
    windows = aligner.advance(T0_NS + (rows.shape[0] + 10) * STEP_NS)
    start_ns = T0_NS + (rows.shape[0] - n_grid) * STEP_NS
    (window,) = [w for w in windows if w.start_ns == start_ns]
    np.testing.assert_array_equal(window.values, grid)


def test_the_ideal_profile_is_values_at_on_the_grid() -> None:
    rows = _rows(MotorPlant(4), 3000, WINDOW)
    grid = dataset.acquire(rows, WINDOW, IDEAL, np.random.default_rng(0))
    np.testing.assert_array_equal(grid, rows.astype(np.float32))


def test_the_field_bus_profile_matches_the_example_config_and_the_dbc() -> None:
    cfg = tomllib.loads((ROOT / "examples" / "agent.toml").read_text(encoding="utf-8"))
    (modbus,) = cfg["sources"]["modbus"]
    registers = {r["name"]: r for r in modbus["registers"]}
    for name in ("voltage", "temperature"):
        acq, reg = FIELD_BUSES.signals[name], registers[name]
        assert acq.period_ms == reg.get("poll_ms", modbus["poll_ms"])
        assert acq.deadband == reg.get("deadband", 0.0)
        if acq.deadband:
            assert acq.heartbeat_ms == modbus["heartbeat_ms"]
        assert acq.quantum == (0.0 if reg["type"].startswith("float") else reg["scale"])
    db = cantools.database.load_file(ROOT / "drivers" / "sim" / "motor_drive.dbc")
    assert isinstance(db, CanDatabase)
    (can,) = cfg["sources"]["can"]
    for name in can["signals"]:
        acq = FIELD_BUSES.signals[name]
        message = next(m for m in db.messages if any(s.name == name for s in m.signals))
        signal = message.get_signal_by_name(name)
        assert acq.period_ms == message.cycle_time
        assert acq.quantum == signal.scale
        assert (acq.lo, acq.hi) == (signal.minimum, signal.maximum)
    assert set(FIELD_BUSES.signals) == set(SIGNALS)


def test_field_bus_windows_repeat_like_live_ones_and_stuck_repeats_all_along() -> None:
    plant = MotorPlant(5, [Anomaly("stuck", "current", 30.0, 3.0)])
    rng = np.random.default_rng(5)
    normal = dataset._acquired_window(plant, 2500, FIELD_BUSES, rng)[1]
    stuck = dataset._acquired_window(plant, 3100, FIELD_BUSES, rng)[1]
    repeats = (normal[1:] == normal[:-1]).mean(axis=0)
    col = SIGNALS.index
    # Slow Modbus sources are held; fast CAN signals mostly move; quantization shows.
    assert repeats[col("temperature")] > 0.7
    assert repeats[col("voltage")] > 0.7
    assert repeats[col("current")] < 0.3
    np.testing.assert_allclose(normal[:, col("speed")] * 2, np.round(normal[:, col("speed")] * 2))
    assert (stuck[1:, col("current")] == stuck[:-1, col("current")]).all()


def test_plant_windows_go_through_the_same_acquisition() -> None:
    seconds, start_s = 3.2, 30.0
    windows = list(plant_windows(seed=6, start_s=start_s, seconds=seconds))
    assert [w.start_ns for w in windows] == [
        T0_NS + (3000 + 64 * i) * STEP_NS for i in range(len(windows))
    ]
    assert len(windows) == 5
    values = np.concatenate([w.values for w in windows])
    assert np.isfinite(values).all()
    repeats = (values[1:] == values[:-1]).mean(axis=0)
    assert repeats[SIGNALS.index("temperature")] > 0.7
    assert repeats[SIGNALS.index("current")] < 0.3
    ideal = list(plant_windows(seed=6, start_s=start_s, seconds=seconds, acquisition=IDEAL))
    plant = MotorPlant(6)
    np.testing.assert_array_equal(
        np.concatenate([w.values for w in ideal]),
        _rows(plant, 3000, 320).astype(np.float32),
    )
