"""Labelled windows from the motor-drive simulator (:mod:`drivers.sim.plant`). Pure numpy.

Used by :mod:`models.train` for the training, validation and test sets and by the tests to
regenerate a held-out set without TensorFlow. A window is :data:`WINDOW` steps of the 100 Hz
grid of the six :data:`SIGNALS`, made as perception makes it from an :class:`Acquisition`
(per signal: period and phase, resolution and range, deadband with heartbeat, arrival
delay; :data:`FIELD_BUSES` by default, :data:`IDEAL` for comparison). Each plant seed's
timeline is cut into :data:`SLOT_S`-second slots holding one window and at most one anomaly,
the window always inside the anomaly's interval. How each label's window is placed and why:
models/README.md, "Data and training".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from drivers.sim.plant import SIGNALS, STEP_HZ, Anomaly, AnomalyKind, MotorPlant
from models.acquisition import Acquisition, SignalAcquisition

LABELS: Final[tuple[str, ...]] = ("normal", "drift", "spike", "stuck", "noise")
WINDOW: Final = 64
RATE_HZ: Final = STEP_HZ
SLOT_S: Final = 12.0
MAX_START_S: Final = 2000.0
SPIKE_STEPS: Final = 10  # the plant's spike length (100 ms)
_SPIKE_DRAWS: Final = 8  # acquisition draws per spike window candidate
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


# -- acquisition -----------------------------------------------------------------------------


#: Every signal fresh at every grid step at full precision (``values_at`` on the grid).
IDEAL: Final = Acquisition(
    "ideal-100hz", {s: SignalAcquisition(source="ideal", period_ms=10.0) for s in SIGNALS}
)
_CAN_JITTER_MS: Final = 0.7
_MODBUS_JITTER_MS: Final = 1.0
#: ``examples/agent.toml`` with ``drivers/sim/motor_drive.dbc``: voltage (float32, 0.5 V
#: deadband, 150 ms heartbeat) polled every 100 ms and temperature (int16 x 0.1) every
#: 200 ms over Modbus; current, frequency, speed in DRIVE_STATUS at 100 Hz and vibration in
#: DRIVE_VIBRATION at 50 Hz over CAN, at the DBC's resolution and range.
FIELD_BUSES: Final = Acquisition(
    "examples/agent.toml+motor_drive.dbc",
    {
        "voltage": SignalAcquisition(
            source="modbus holding 0 float32 poll",
            period_ms=100.0,
            deadband=0.5,
            heartbeat_ms=150.0,
            jitter_ms=_MODBUS_JITTER_MS,
            synced=False,
        ),
        "current": SignalAcquisition(
            source="can DRIVE_STATUS",
            period_ms=10.0,
            quantum=0.01,
            lo=0.0,
            hi=655.35,
            jitter_ms=_CAN_JITTER_MS,
        ),
        "frequency": SignalAcquisition(
            source="can DRIVE_STATUS",
            period_ms=10.0,
            quantum=0.01,
            lo=0.0,
            hi=655.35,
            jitter_ms=_CAN_JITTER_MS,
        ),
        "speed": SignalAcquisition(
            source="can DRIVE_STATUS",
            period_ms=10.0,
            quantum=0.5,
            lo=-16384.0,
            hi=16383.5,
            jitter_ms=_CAN_JITTER_MS,
        ),
        "temperature": SignalAcquisition(
            source="modbus holding 6 int16 poll",
            period_ms=200.0,
            quantum=0.1,
            lo=-3276.8,
            hi=3276.7,
            jitter_ms=_MODBUS_JITTER_MS,
            synced=False,
        ),
        "vibration": SignalAcquisition(
            source="can DRIVE_VIBRATION",
            period_ms=20.0,
            quantum=0.01,
            lo=0.0,
            hi=655.35,
            jitter_ms=_CAN_JITTER_MS,
        ),
    },
)
#: The acquisition every set is generated with unless told otherwise.
DEFAULT_ACQUISITION: Final = FIELD_BUSES
_STEP_MS: Final = 1000.0 / STEP_HZ


def warmup_steps(acq: Acquisition) -> int:
    """Plant steps before a window that acquisition needs (the slowest source and jitter)."""
    worst = max(
        a.period_ms + max(a.heartbeat_ms, a.period_ms) + 8 * a.jitter_ms
        for a in acq.signals.values()
    )
    return 0 if acq is IDEAL else math.ceil(worst / _STEP_MS) + 1


def acquire_samples(
    rows: npt.NDArray[np.float64],
    n_grid: int,
    acq: Acquisition,
    rng: np.random.Generator,
) -> dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]]:
    """Per signal, the samples ``(arrival_ms, value)`` ``acq`` delivers from plant ``rows``.

    ``rows[i]`` holds the plant's values (anomalies applied) during plant step ``i``; times
    are ms from the start of step 0, on the grid's time base (grid point ``i`` at
    ``i * 10`` ms). Every source reads the plant on its own schedule (a random phase
    against the grid; a synced source on the plant's tick, whose phase against the grid is
    random too), saturates, rounds and filters (deadband + heartbeat) the value and
    delivers it with a random delay, in order. Samples cover steps up to the last row.
    """
    n_rows = rows.shape[0]
    end_ms = (n_rows - 1) * _STEP_MS
    plant_offset = float(rng.uniform(0.0, _STEP_MS))  # plant tick phase against the grid
    schedules: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]] = {}
    out: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]] = {}
    for col, name in enumerate(SIGNALS):
        a = acq.signals[name]
        sched = schedules.get(a.source)
        if sched is None:
            period = a.period_ms
            if a.synced:
                phase = plant_offset + _STEP_MS * int(
                    rng.integers(max(1, round(period / _STEP_MS)))
                )
            else:
                phase = float(rng.uniform(0.0, period))
            ticks = np.arange(phase, end_ms + 1e-9, period)
            delay = rng.exponential(a.jitter_ms, ticks.size) if a.jitter_ms else 0.0
            # Delivered in order (one bus, one connection): a late sample delays the next.
            arrival = np.maximum.accumulate(ticks + delay)
            sched = (ticks, arrival)
            schedules[a.source] = sched
        ticks, arrival = sched
        step = np.clip(
            np.floor((ticks - plant_offset) / _STEP_MS + 1e-6).astype(np.int64), 0, n_rows - 1
        )
        v = rows[step, col].astype(np.float64)
        v = np.clip(v, a.lo, a.hi)
        if a.quantum:
            v = np.round(v / a.quantum) * a.quantum
        v = v.astype(np.float32).astype(np.float64)
        t = arrival
        if a.deadband:
            keep = np.zeros(v.size, dtype=np.bool_)
            last_v, last_t = math.nan, -math.inf
            for j in range(v.size):
                if abs(v[j] - last_v) < a.deadband and t[j] - last_t < a.heartbeat_ms:
                    continue
                keep[j] = True
                last_v, last_t = float(v[j]), float(t[j])
            v, t = v[keep], t[keep]
        out[name] = (t, v)
    return out


def acquire(
    rows: npt.NDArray[np.float64],
    n_grid: int,
    acq: Acquisition,
    rng: np.random.Generator,
) -> FloatArray:
    """Grid values ``(n_grid, 6)`` perception makes of plant ``rows`` through ``acq``.

    The grid is the last ``n_grid`` plant steps of ``rows`` (the ones before are warm-up);
    each grid point holds the newest sample of :func:`acquire_samples` that arrived at or
    before it, as ``edge_agent.perception.Aligner`` does with ``interpolation = "hold"``
    (samples are stamped at arrival, like every driver stamps them).
    """
    n_rows = rows.shape[0]
    out = np.empty((n_grid, len(SIGNALS)), dtype=np.float32)
    if acq is IDEAL:
        out[:] = rows[n_rows - n_grid :]
        return out
    grid = (np.arange(n_grid, dtype=np.float64) + (n_rows - n_grid)) * _STEP_MS
    for col, (t, v) in enumerate(acquire_samples(rows, n_grid, acq, rng).values()):
        idx = np.searchsorted(t, grid, side="right") - 1
        out[:, col] = np.where(idx >= 0, v[np.maximum(idx, 0)], np.nan)
    return out


def _rows(plant: MotorPlant, first_step: int, n: int) -> npt.NDArray[np.float64]:
    out = np.empty((n, len(SIGNALS)), dtype=np.float64)
    for i in range(n):
        row = plant.values_at(max(0, first_step + i) / STEP_HZ)
        out[i] = [row[s] for s in SIGNALS]
    return out


def _acquired_window(
    plant: MotorPlant, start_step: int, acq: Acquisition, rng: np.random.Generator
) -> tuple[FloatArray, FloatArray]:
    """(plant values on the grid, what perception makes of them through ``acq``)."""
    warm = warmup_steps(acq)
    rows = _rows(plant, start_step - warm, warm + WINDOW)
    return rows[warm:].astype(np.float32), acquire(rows, WINDOW, acq, rng)


def _inside_run(changed: npt.NDArray[np.bool_]) -> bool:
    """Whether ``changed`` holds a run off both edges (a spike as acquired, any length)."""
    padded = np.concatenate(([False], changed, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, ends = edges[::2], edges[1::2]
    return bool(((starts > 0) & (ends < changed.size)).any())


def _whole_spike(changed: npt.NDArray[np.bool_]) -> bool:
    """Whether ``changed`` holds a run of exactly one spike's length off both edges."""
    padded = np.concatenate(([False], changed, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, ends = edges[::2], edges[1::2]
    ok = (ends - starts == SPIKE_STEPS) & (starts > 0) & (ends < changed.size)
    return bool(ok.any())


def _spike_window(
    plant: MotorPlant,
    reference: MotorPlant,
    col: int,
    candidates: Sequence[int],
    *,
    acq: Acquisition,
    rng: np.random.Generator,
    anomaly: Anomaly,
) -> tuple[int, FloatArray]:
    """The first candidate start whose window holds a whole spike and shows it as acquired.

    Each start with a whole spike in the plant values gets up to :data:`_SPIKE_DRAWS`
    acquisition draws (a slow poll sees a 100 ms spike only at some phases). Should no
    draw ever show one (rare: a short interval with one usable spike on the 200 ms
    temperature poll), the first start with a whole spike in the plant values is used.
    """
    warm = warmup_steps(acq)
    fallback: tuple[int, FloatArray] | None = None
    for candidate in candidates:
        start = int(candidate)
        rows = _rows(plant, start - warm, warm + WINDOW)
        clean_rows = _rows(reference, start - warm, warm + WINDOW)
        if not _whole_spike(rows[warm:, col] != clean_rows[warm:, col]):
            continue
        for _ in range(_SPIKE_DRAWS):
            state = rng.bit_generator.state
            window = acquire(rows, WINDOW, acq, rng)
            rng.bit_generator.state = state
            clean = acquire(clean_rows, WINDOW, acq, rng)
            if fallback is None:
                fallback = (start, window)
            if _inside_run(window[:, col] != clean[:, col]):
                return start, window
    if fallback is None:
        raise RuntimeError(f"no window with a whole spike in {anomaly}")
    return fallback


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
    acquisition: Acquisition = DEFAULT_ACQUISITION,
) -> WindowSet:
    """``n_windows`` labelled windows from plant ``seed`` (deterministic in both seeds)."""
    rng = np.random.default_rng([rng_seed, seed])
    acq_rng = np.random.default_rng([rng_seed, seed, 1])
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
        _, window = _acquired_window(plant, start, acquisition, acq_rng)
        if pl.anomaly is not None:
            col = SIGNALS.index(pl.anomaly.signal)
            signal[i] = col
            if pl.anomaly.kind == "spike":
                # Spikes come once a second at a random place; move the window until it
                # holds a whole one, and one the acquisition saw (a poll slower than the
                # spike can miss it) entirely inside the window. An interval of >= 2 s
                # always has such a position.
                last = pl.anomaly.end_step - WINDOW
                candidates = [
                    start,
                    *rng.permutation(np.arange(pl.anomaly.start_step, last + 1)).tolist(),
                ]
                start, window = _spike_window(
                    plant,
                    reference,
                    col,
                    candidates,
                    acq=acquisition,
                    rng=acq_rng,
                    anomaly=pl.anomaly,
                )
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
    acquisition: Acquisition = DEFAULT_ACQUISITION,
) -> WindowSet:
    """:func:`generate_seed` over ``seeds``, concatenated in order."""
    return concat(
        [
            generate_seed(
                s,
                per_seed,
                rng_seed=rng_seed,
                weights=weights,
                drift_signals=drift_signals,
                acquisition=acquisition,
            )
            for s in seeds
        ]
    )


def continuous_normal(
    seed: int, start_s: float, n_windows: int, acquisition: Acquisition = DEFAULT_ACQUISITION
) -> FloatArray:
    """``n_windows`` back-to-back windows of anomaly-free operation from ``start_s`` on.

    What the agent sees in normal running (hop = window): used to count false alarms/hour.
    """
    plant = MotorPlant(seed)
    first = math.floor(start_s * STEP_HZ)
    n_steps = n_windows * WINDOW
    warm = warmup_steps(acquisition)
    rows = _rows(plant, first - warm, warm + n_steps)
    rng = np.random.default_rng([seed, first, 2])
    flat = acquire(rows, n_steps, acquisition, rng)
    return flat.reshape(n_windows, WINDOW, len(SIGNALS))


__all__ = [
    "DEFAULT_ACQUISITION",
    "DEFAULT_WEIGHTS",
    "DRIFT_RANGE",
    "DRIFT_SIGNALS",
    "FIELD_BUSES",
    "IDEAL",
    "LABELS",
    "NOISE_RANGE",
    "RATE_HZ",
    "SIGNALS",
    "SPIKE_RANGE",
    "WINDOW",
    "Acquisition",
    "SignalAcquisition",
    "WindowSet",
    "acquire",
    "acquire_samples",
    "concat",
    "continuous_normal",
    "generate",
    "generate_seed",
]
