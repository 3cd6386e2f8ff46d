"""Perception: align samples from every source onto one fixed-rate grid and cut windows.

Pure code. It takes :class:`~drivers.Sample` values and ``now`` (UNIX ns) and returns
:class:`Window` objects; no asyncio, no clock, no I/O, so tests give exact inputs and
expect exact grids.

How the grid works
------------------
Grid points sit at integer multiples of the period (``t_k = k * period_ns`` in UNIX ns), so
two gateways at the same rate sample at the same instants. A window is ``window`` grid
points; consecutive windows start ``hop`` points apart (``hop == window``: back to back).

A window is emitted once ``now`` has passed its last grid point by ``lateness_ms``: that
is how long we wait for a sample stamped before the grid point to arrive (samples are
stamped at arrival, so only a slow hand-off between threads makes them late). A sample
stamped at or before the last grid point already emitted can no longer change anything:
it is counted in ``late_dropped`` and discarded, never slipped into a later window.

Each grid point gets, per signal:

* ``hold``   the newest sample at or before the point (sample-and-hold);
* ``linear`` the straight line between the samples around the point; when the next sample
  has not arrived by emission time, the held value is used (we never extrapolate).

A signal that has never been seen is NaN. A cell is *fresh* when the signal's newest sample
at or before the grid point is at most ``max_staleness_ms`` old. ``stale[i]`` says that
signal ``i`` was not fresh at the window's last point; ``completeness`` is the fraction of
fresh cells in the window. ``jitter_ms[i]`` is the standard deviation of signal ``i``'s
inter-arrival intervals inside the window (0 with fewer than three samples).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from drivers.sample import Sample

Interpolation = Literal["hold", "linear"]

_NS_PER_MS = 1_000_000


@dataclass(frozen=True, slots=True)
class PerceptionSpec:
    """Grid and window geometry. Validated by the config loader; re-checked here."""

    signals: tuple[str, ...]
    rate_hz: float = 100.0
    window: int = 64
    hop: int = 64
    interpolation: Interpolation = "hold"
    max_staleness_ms: float = 200.0
    lateness_ms: float = 20.0
    max_catch_up_windows: int = 16

    def __post_init__(self) -> None:
        if not self.signals:
            raise ValueError("perception needs at least one signal")
        if len(set(self.signals)) != len(self.signals):
            raise ValueError("perception signals must be unique")
        if not 0 < self.rate_hz <= 10_000:
            raise ValueError(f"rate_hz must be in (0, 10000], got {self.rate_hz}")
        if 1e9 / self.rate_hz != int(1e9 / self.rate_hz):
            raise ValueError(f"rate_hz must give a whole number of ns per step, got {self.rate_hz}")
        if self.window < 1 or not 1 <= self.hop <= self.window:
            raise ValueError(
                f"need window >= 1 and 1 <= hop <= window, got {self.window}/{self.hop}"
            )
        if self.max_staleness_ms <= 0 or self.lateness_ms < 0 or self.max_catch_up_windows < 1:
            raise ValueError("max_staleness_ms > 0, lateness_ms >= 0, max_catch_up_windows >= 1")

    @property
    def period_ns(self) -> int:
        return int(1e9 / self.rate_hz)


@dataclass(frozen=True, slots=True, eq=False)
class Window:
    """``window`` grid points x ``len(signals)`` values, float32, oldest row first."""

    seq: int
    start_ns: int
    period_ns: int
    signals: tuple[str, ...]
    values: npt.NDArray[np.float32]
    stale: npt.NDArray[np.bool_]
    completeness: float
    jitter_ms: npt.NDArray[np.float32]

    @property
    def end_ns(self) -> int:
        """Time of the last grid point."""
        return self.start_ns + (int(self.values.shape[0]) - 1) * self.period_ns

    @property
    def max_jitter_ms(self) -> float:
        return float(self.jitter_ms.max()) if self.jitter_ms.size else 0.0


@dataclass(slots=True)
class PerceptionStats:
    samples: int = 0
    unknown_signal: int = 0
    late_dropped: int = 0
    non_finite: int = 0
    windows: int = 0
    windows_skipped: int = 0
    unknown_names: set[str] = field(default_factory=set)


class _Track:
    """Arrival-ordered samples of one signal not yet behind the emitted horizon."""

    __slots__ = ("t", "v")

    def __init__(self) -> None:
        self.t: list[int] = []
        self.v: list[float] = []

    def add(self, t_ns: int, value: float) -> None:
        if not self.t or t_ns >= self.t[-1]:
            self.t.append(t_ns)
            self.v.append(value)
        else:
            # Out of order but still ahead of the horizon: keep time order.
            i = bisect_right(self.t, t_ns)
            self.t.insert(i, t_ns)
            self.v.insert(i, value)

    def prune_before(self, t_ns: int) -> None:
        """Forget samples older than the newest one at or before ``t_ns`` (still needed to hold)."""
        i = bisect_right(self.t, t_ns) - 1
        if i > 0:
            del self.t[:i]
            del self.v[:i]


class Aligner:
    """Turns a stream of samples into windows on a fixed grid. See the module docstring."""

    def __init__(self, spec: PerceptionSpec) -> None:
        self.spec = spec
        self.stats = PerceptionStats()
        self._index = {name: i for i, name in enumerate(spec.signals)}
        self._tracks = [_Track() for _ in spec.signals]
        self._period = spec.period_ns
        self._lateness = round(spec.lateness_ms * _NS_PER_MS)
        self._staleness = round(spec.max_staleness_ms * _NS_PER_MS)
        # Grid index of the next window's first point; set by the first sample.
        self._next_start: int | None = None
        # Last grid point already emitted (ns); samples at or before it are late.
        self._horizon_ns: int | None = None
        self._seq = 0

    # -- input ------------------------------------------------------------------------------

    def push(self, sample: Sample) -> None:
        """Accept one sample (any order, any source)."""
        i = self._index.get(sample.signal)
        if i is None:
            self.stats.unknown_signal += 1
            if len(self.stats.unknown_names) < 64:
                self.stats.unknown_names.add(sample.signal)
            return
        if not math.isfinite(sample.value):
            self.stats.non_finite += 1
            return
        if self._horizon_ns is not None and sample.t_ns <= self._horizon_ns:
            self.stats.late_dropped += 1
            return
        if self._horizon_ns is None:
            # Until the first window is out, it starts at the first grid point at or after
            # the earliest sample seen, whatever order the sources delivered them in.
            first = -(-sample.t_ns // self._period)
            if self._next_start is None or first < self._next_start:
                self._next_start = first
        self._tracks[i].add(sample.t_ns, sample.value)
        self.stats.samples += 1

    def push_many(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            self.push(s)

    # -- output -----------------------------------------------------------------------------

    def advance(self, now_ns: int) -> list[Window]:
        """Emit every window whose last point is at least ``lateness_ms`` behind ``now_ns``.

        After a long stall (a suspended process, a clock step) at most
        ``max_catch_up_windows`` of the most recent windows are built; older ones are
        skipped and counted in ``windows_skipped`` rather than flooding the pipeline.
        """
        if self._next_start is None:
            return []
        spec, period = self.spec, self._period
        span = (spec.window - 1) * period

        def due(start_index: int) -> bool:
            return start_index * period + span + self._lateness <= now_ns

        if not due(self._next_start):
            return []
        # Number of windows due now: the largest n with due(next_start + (n-1)*hop).
        last_due_start = (now_ns - self._lateness - span) // period
        n_due = (last_due_start - self._next_start) // spec.hop + 1
        if n_due > spec.max_catch_up_windows:
            skip = n_due - spec.max_catch_up_windows
            self.stats.windows_skipped += skip
            self._next_start += skip * spec.hop
            n_due = spec.max_catch_up_windows
        out = [self._build(self._next_start + k * spec.hop) for k in range(n_due)]
        self._next_start += n_due * spec.hop
        return out

    def _build(self, start_index: int) -> Window:
        spec, period = self.spec, self._period
        start_ns = start_index * period
        grid = start_ns + np.arange(spec.window, dtype=np.int64) * period
        end_ns = int(grid[-1])
        n = len(spec.signals)
        values = np.full((spec.window, n), np.nan, dtype=np.float32)
        fresh = np.zeros((spec.window, n), dtype=np.bool_)
        jitter = np.zeros(n, dtype=np.float32)
        linear = spec.interpolation == "linear"
        for i, track in enumerate(self._tracks):
            if not track.t:
                continue
            t = np.asarray(track.t, dtype=np.int64)
            v = np.asarray(track.v, dtype=np.float64)
            # idx[k]: newest sample at or before grid[k] (-1: none yet).
            idx = np.searchsorted(t, grid, side="right") - 1
            have = idx >= 0
            held_idx = np.where(have, idx, 0)
            col = np.where(have, v[held_idx], np.nan)
            if linear:
                nxt = held_idx + 1
                can = have & (nxt < t.size)
                if can.any():
                    nxt_c = np.minimum(nxt, t.size - 1)
                    t0, t1 = t[held_idx], t[nxt_c]
                    dt = np.where(can, t1 - t0, 1)
                    frac = np.where(can, (grid - t0) / dt, 0.0)
                    col = np.where(can, v[held_idx] + frac * (v[nxt_c] - v[held_idx]), col)
            values[:, i] = col
            fresh[:, i] = have & (grid - t[held_idx] <= self._staleness)
            # Inter-arrival jitter of the samples that fall inside this window.
            lo = int(np.searchsorted(t, start_ns, side="left"))
            hi = int(np.searchsorted(t, end_ns, side="right"))
            if hi - lo >= 3:
                jitter[i] = float(np.diff(t[lo:hi]).std()) / _NS_PER_MS
        # Rows up to end_ns are now final (overlapping windows reuse them): a sample stamped
        # at or before end_ns that arrives from now on is late.
        next_start_ns = (start_index + spec.hop) * period
        self._horizon_ns = end_ns
        for track in self._tracks:
            track.prune_before(next_start_ns)
        self._seq += 1
        self.stats.windows += 1
        return Window(
            seq=self._seq,
            start_ns=start_ns,
            period_ns=period,
            signals=spec.signals,
            values=values,
            stale=~fresh[-1],
            completeness=float(fresh.mean()),
            jitter_ms=jitter,
        )


__all__ = ["Aligner", "Interpolation", "PerceptionSpec", "PerceptionStats", "Window"]
