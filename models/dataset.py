"""Labelled windows from the motor-drive simulator (:mod:`drivers.sim.plant`). Pure numpy.

Used by :mod:`models.train` to make the training, validation and test sets and by the test
suite to regenerate a fresh held-out set without TensorFlow.

A window is :data:`WINDOW` consecutive 100 Hz steps of the six signals in
:data:`SIGNALS` order: exactly what sample-and-hold perception produces from sources that
report every step (``values_at`` at ``t = (start_step + k) / 100``).

How a set is drawn
------------------
Every plant seed gets its own timeline, cut into :data:`SLOT_S`-second slots starting at a
random time below ~2000 s (the plant integrates temperature from t = 0, so moderate times
are cheap; a seed is walked forward in time). Each slot holds one window and at most one
anomaly, so anomalies never overlap and one :class:`~drivers.sim.plant.MotorPlant` per seed
carries all of them:

* ``normal``: a window anywhere in the slot;
* ``drift``: duration 3-10 s; the window lies in the second half of the interval, so the
  offset is at least half the magnitude;
* ``spike``: duration 2-10 s; the window must hold one whole spike, both edges inside
  (checked against the anomaly-free plant), otherwise it is moved. A spike cut by the window
  edge is a single step, which normal running makes too (a ramp starting steps current and
  slip at once); spikes recur every second, so an interval is still caught;
* ``stuck`` and ``noise``: duration 1-10 s, the window anywhere inside.

The window always lies fully inside the anomaly interval. ``dropout`` is not a model label:
perception flags a missing signal as stale and the reasoning rules deal with it. Drift is
drawn on :data:`DRIFT_SIGNALS` only: a temperature offset of a few degrees is what a cold or
hot winding looks like in any 0.64 s window (the winding lags the current by minutes), so
it is left to rules over longer horizons rather than taught as a label no window can show.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from drivers.sim.plant import SIGNALS, STEP_HZ, Anomaly, AnomalyKind, MotorPlant

LABELS: Final[tuple[str, ...]] = ("normal", "drift", "spike", "stuck", "noise")
WINDOW: Final = 64
RATE_HZ: Final = STEP_HZ
SLOT_S: Final = 12.0
MAX_START_S: Final = 2000.0
SPIKE_STEPS: Final = 10  # the plant's spike length (100 ms)
#: Signals drift is drawn on (see the module docstring for temperature).
DRIFT_SIGNALS: Final[tuple[str, ...]] = tuple(s for s in SIGNALS if s != "temperature")

#: Anomaly magnitude ranges (absolute value, signal units; the sign is drawn separately).
DRIFT_RANGE: Final[Mapping[str, tuple[float, float]]] = {
    "voltage": (10.0, 40.0),
    "current": (2.0, 8.0),
    "frequency": (2.0, 8.0),
    "speed": (60.0, 240.0),
    "temperature": (5.0, 20.0),
    "vibration": (0.5, 2.5),
}
SPIKE_RANGE: Final[Mapping[str, tuple[float, float]]] = {
    "voltage": (15.0, 60.0),
    "current": (2.0, 10.0),
    "frequency": (2.0, 10.0),
    "speed": (60.0, 300.0),
    "temperature": (2.0, 10.0),
    "vibration": (0.8, 4.0),
}
#: Noise bursts multiply the signal's measurement noise by this much.
NOISE_RANGE: Final = (3.0, 10.0)
#: Default share of each label in a generated set.
DEFAULT_WEIGHTS: Final[Mapping[str, float]] = {
    "normal": 0.3,
    "drift": 0.175,
    "spike": 0.175,
    "stuck": 0.175,
    "noise": 0.175,
}

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, eq=False)
class WindowSet:
    """``values[i]`` is a ``(WINDOW, 6)`` window, ``labels[i]`` an index into :data:`LABELS`.

    ``signal[i]`` is the anomalous signal's index in :data:`SIGNALS` (-1 for normal),
    ``seed[i]`` and ``start_step[i]`` say where the window came from.
    """

    values: FloatArray
    labels: IntArray
    signal: IntArray
    seed: IntArray
    start_step: IntArray

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def counts(self) -> dict[str, int]:
        return {name: int((self.labels == i).sum()) for i, name in enumerate(LABELS)}


@dataclass(frozen=True, slots=True)
class _Planned:
    label: int
    start_step: int
    anomaly: Anomaly | None


def _window(plant: MotorPlant, start_step: int) -> FloatArray:
    rows = [plant.values_at((start_step + k) / STEP_HZ) for k in range(WINDOW)]
    return np.array([[row[s] for s in SIGNALS] for row in rows], dtype=np.float32)


def _whole_spike(changed: npt.NDArray[np.bool_]) -> bool:
    """Whether ``changed`` holds a run of exactly one spike's length off both edges."""
    padded = np.concatenate(([False], changed, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, ends = edges[::2], edges[1::2]
    ok = (ends - starts == SPIKE_STEPS) & (starts > 0) & (ends < changed.size)
    return bool(ok.any())


def _plan_slot(
    rng: np.random.Generator,
    label: int,
    slot_start_s: float,
    drift_signals: Sequence[str] = DRIFT_SIGNALS,
) -> _Planned:
    """Anomaly and window position for one slot (the spike check happens later)."""
    window_s = WINDOW / STEP_HZ
    kind = LABELS[label]
    if kind == "normal":
        start = slot_start_s + rng.uniform(0.0, SLOT_S - window_s - 0.1)
        return _Planned(label, math.floor(start * STEP_HZ), None)
    pool = drift_signals if kind == "drift" else SIGNALS
    signal = pool[int(rng.integers(len(pool)))]
    a_start = round(slot_start_s + rng.uniform(0.1, 1.0), 2)
    lo_d = {"drift": 3.0, "spike": 2.0}.get(kind, 1.0)
    duration = round(rng.uniform(lo_d, 10.0), 2)
    sign = 1.0 if rng.random() < 0.5 else -1.0
    if kind == "drift":
        magnitude = sign * rng.uniform(*DRIFT_RANGE[signal])
    elif kind == "spike":
        magnitude = sign * rng.uniform(*SPIKE_RANGE[signal])
    elif kind == "noise":
        magnitude = rng.uniform(*NOISE_RANGE)
    else:
        magnitude = 0.0
    anomaly = Anomaly(
        kind=_kind(kind),
        signal=signal,
        start_s=a_start,
        duration_s=duration,
        magnitude=round(float(magnitude), 3),
    )
    first = anomaly.start_step
    last = anomaly.end_step - WINDOW  # last window start fully inside
    if kind == "drift":
        first = anomaly.start_step + (anomaly.end_step - anomaly.start_step) // 2
    start_step = int(rng.integers(first, last + 1))
    return _Planned(label, start_step, anomaly)


def _kind(name: str) -> AnomalyKind:
    for kind in ("drift", "spike", "stuck", "noise"):
        if kind == name:
            return kind
    raise ValueError(f"not an anomaly label: {name!r}")


def generate_seed(
    seed: int,
    n_windows: int,
    *,
    rng_seed: int,
    weights: Mapping[str, float] = DEFAULT_WEIGHTS,
    drift_signals: Sequence[str] = DRIFT_SIGNALS,
) -> WindowSet:
    """``n_windows`` labelled windows from plant ``seed`` (deterministic in both seeds)."""
    rng = np.random.default_rng([rng_seed, seed])
    p = np.array([weights.get(name, 0.0) for name in LABELS], dtype=np.float64)
    p /= p.sum()
    labels = rng.choice(len(LABELS), size=n_windows, p=p)
    span = n_windows * SLOT_S
    t0 = float(rng.uniform(0.0, max(0.0, MAX_START_S - span)))
    plans = [
        _plan_slot(rng, int(lab), t0 + i * SLOT_S, drift_signals) for i, lab in enumerate(labels)
    ]
    anomalies = [pl.anomaly for pl in plans if pl.anomaly is not None]
    plant = MotorPlant(seed, anomalies)
    reference = MotorPlant(seed)
    values = np.empty((n_windows, WINDOW, len(SIGNALS)), dtype=np.float32)
    signal = np.full(n_windows, -1, dtype=np.int64)
    starts = np.empty(n_windows, dtype=np.int64)
    for i, pl in enumerate(plans):
        start = pl.start_step
        window = _window(plant, start)
        if pl.anomaly is not None:
            col = SIGNALS.index(pl.anomaly.signal)
            signal[i] = col
            if pl.anomaly.kind == "spike":
                # Spikes come once a second at a random place; move the window until it
                # holds a whole one. An interval of >= 2 s always has such a position.
                last = pl.anomaly.end_step - WINDOW
                for _ in range(60):
                    clean = _window(reference, start)
                    if _whole_spike(window[:, col] != clean[:, col]):
                        break
                    start = int(rng.integers(pl.anomaly.start_step, last + 1))
                    window = _window(plant, start)
                else:
                    raise RuntimeError(f"no window with a whole spike in {pl.anomaly}")
        values[i] = window
        starts[i] = start
    return WindowSet(
        values=values,
        labels=labels.astype(np.int64),
        signal=signal,
        seed=np.full(n_windows, seed, dtype=np.int64),
        start_step=starts,
    )


def concat(parts: Sequence[WindowSet]) -> WindowSet:
    return WindowSet(
        values=np.concatenate([p.values for p in parts]),
        labels=np.concatenate([p.labels for p in parts]),
        signal=np.concatenate([p.signal for p in parts]),
        seed=np.concatenate([p.seed for p in parts]),
        start_step=np.concatenate([p.start_step for p in parts]),
    )


def generate(
    seeds: Sequence[int],
    per_seed: int,
    *,
    rng_seed: int,
    weights: Mapping[str, float] = DEFAULT_WEIGHTS,
    drift_signals: Sequence[str] = DRIFT_SIGNALS,
) -> WindowSet:
    """:func:`generate_seed` over ``seeds``, concatenated in order."""
    return concat(
        [
            generate_seed(
                s, per_seed, rng_seed=rng_seed, weights=weights, drift_signals=drift_signals
            )
            for s in seeds
        ]
    )


def continuous_normal(seed: int, start_s: float, n_windows: int) -> FloatArray:
    """``n_windows`` back-to-back windows of anomaly-free operation from ``start_s`` on.

    What the agent sees in normal running (hop = window): used to count false alarms/hour.
    """
    plant = MotorPlant(seed)
    first = math.floor(start_s * STEP_HZ)
    n_steps = n_windows * WINDOW
    rows = [plant.values_at((first + k) / STEP_HZ) for k in range(n_steps)]
    flat = np.array([[row[s] for s in SIGNALS] for row in rows], dtype=np.float32)
    return flat.reshape(n_windows, WINDOW, len(SIGNALS))


__all__ = [
    "DEFAULT_WEIGHTS",
    "DRIFT_RANGE",
    "DRIFT_SIGNALS",
    "LABELS",
    "NOISE_RANGE",
    "RATE_HZ",
    "SIGNALS",
    "SPIKE_RANGE",
    "WINDOW",
    "WindowSet",
    "concat",
    "continuous_normal",
    "generate",
    "generate_seed",
]
