"""Windows of the simulated plant through real perception, without a field bus.

For tests, benches and offline checks: the :class:`~drivers.sim.plant.MotorPlant`'s values go
through an acquisition profile (:class:`models.dataset.Acquisition`: per signal the source's
period, resolution, deadband and arrival delay; by default the example config's field buses,
the one the shipped model was trained for), become :class:`~drivers.Sample` values stamped at
arrival, and an :class:`~edge_agent.perception.Aligner` cuts the windows, so staleness (a
``dropout`` anomaly) and sample-and-hold come out exactly as in the agent.
``acquisition=IDEAL`` gives one sample per signal at every 100 Hz step, stamped on the grid.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from drivers.sample import Sample
from drivers.sim.plant import SIGNALS, STEP_HZ, Anomaly, MotorPlant
from edge_agent.perception import Aligner, PerceptionSpec, Window
from models.dataset import DEFAULT_ACQUISITION, IDEAL, Acquisition, acquire_samples, warmup_steps

#: Grid-aligned UNIX time of plant t = 0 (2023-11-14T22:13:20Z).
T0_NS = 1_700_000_000_000_000_000
_STEP_NS = 1_000_000_000 // STEP_HZ


def plant_windows(
    *,
    seed: int = 1,
    anomalies: Sequence[Anomaly] = (),
    start_s: float = 0.0,
    seconds: float = 10.0,
    spec: PerceptionSpec | None = None,
    acquisition: Acquisition = DEFAULT_ACQUISITION,
    acquisition_seed: int = 0,
    plant: MotorPlant | None = None,
) -> Iterator[Window]:
    """Yield the windows perception makes of ``seconds`` of plant time from ``start_s``.

    ``spec`` defaults to the plant's six signals, 100 Hz, 64-step windows and a 250 ms
    staleness limit (the example config's grid; a 200 ms poll must not read as stale).
    ``acquisition_seed`` draws the sources' phases and arrival delays. A signal in a
    ``dropout`` sends nothing. ``plant``: a :class:`MotorPlant` built with ``seed`` and
    ``anomalies``, reused across calls that walk one timeline in pieces (a bench's hours):
    it keeps its temperature checkpoints, so a later piece does not integrate from t = 0.
    """
    spec = spec or PerceptionSpec(
        signals=SIGNALS, rate_hz=STEP_HZ, window=64, hop=64, max_staleness_ms=250.0
    )
    plant = plant or MotorPlant(seed, anomalies)
    aligner = Aligner(spec)
    first = round(start_s * STEP_HZ)
    n_steps = round(seconds * STEP_HZ)
    late_ns = round(spec.lateness_ms * 1e6) + 1
    if acquisition is IDEAL:
        for k in range(first, first + n_steps):
            t_ns = T0_NS + k * _STEP_NS
            values = plant.values_at(k / STEP_HZ)
            aligner.push_many(Sample(name, v, t_ns) for name, v in values.items())
            # "now" is just past this step plus the lateness allowance: windows come out as
            # soon as the agent would emit them.
            yield from aligner.advance(t_ns + late_ns)
        return
    warm = warmup_steps(acquisition)
    rows = np.full((warm + n_steps, len(SIGNALS)), np.nan, dtype=np.float64)
    for i in range(rows.shape[0]):
        values = plant.values_at(max(0, first - warm + i) / STEP_HZ)
        rows[i] = [values.get(s, math.nan) for s in SIGNALS]
    rng = np.random.default_rng([acquisition_seed, seed, first])
    base_ns = T0_NS + (first - warm) * _STEP_NS
    first_ns = T0_NS + first * _STEP_NS
    events: list[tuple[int, str, float]] = []
    for name, (t_ms, v) in acquire_samples(rows, n_steps, acquisition, rng).items():
        stamps = base_ns + np.round(t_ms * 1e6).astype(np.int64)
        # Warm-up: only the sample held at the first grid point matters; stamp it there so
        # the first window starts at start_s, as it did without acquisition.
        held = int(np.searchsorted(stamps, first_ns, side="right")) - 1
        if held >= 0:
            events.append((first_ns, name, float(v[held])))
        later = zip(stamps[held + 1 :].tolist(), v[held + 1 :].tolist(), strict=True)
        events += [(t, name, x) for t, x in later]
    events.sort(key=lambda e: e[0])
    j = 0
    for k in range(first, first + n_steps):
        grid_ns = T0_NS + k * _STEP_NS
        while j < len(events) and events[j][0] <= grid_ns:
            t, name, value = events[j]
            aligner.push(Sample(name, value, t))
            j += 1
        yield from aligner.advance(grid_ns + late_ns)


__all__ = ["T0_NS", "plant_windows"]
