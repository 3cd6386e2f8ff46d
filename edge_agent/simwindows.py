"""Windows of the simulated plant through real perception, without a field bus.

For tests, benches and offline checks: every 100 Hz step of a
:class:`~drivers.sim.plant.MotorPlant` becomes one :class:`~drivers.Sample` per signal,
stamped on the grid, and an :class:`~edge_agent.perception.Aligner` cuts the windows, so
staleness (a ``dropout`` anomaly) and sample-and-hold come out exactly as in the agent.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from drivers.sample import Sample
from drivers.sim.plant import SIGNALS, STEP_HZ, Anomaly, MotorPlant
from edge_agent.perception import Aligner, PerceptionSpec, Window

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
) -> Iterator[Window]:
    """Yield the windows perception makes of ``seconds`` of plant time from ``start_s``.

    ``spec`` defaults to the plant's six signals, 100 Hz, 64-step windows and a 200 ms
    staleness limit (the example config's grid).
    """
    spec = spec or PerceptionSpec(signals=SIGNALS, rate_hz=STEP_HZ, window=64, hop=64)
    plant = MotorPlant(seed, anomalies)
    aligner = Aligner(spec)
    first = round(start_s * STEP_HZ)
    for k in range(first, first + round(seconds * STEP_HZ)):
        t_ns = T0_NS + k * _STEP_NS
        values = plant.values_at(k / STEP_HZ)
        aligner.push_many(Sample(name, v, t_ns) for name, v in values.items())
        # "now" is just past this step plus the lateness allowance: windows come out as
        # soon as the agent would emit them.
        yield from aligner.advance(t_ns + round(spec.lateness_ms * 1e6) + 1)


__all__ = ["T0_NS", "plant_windows"]
