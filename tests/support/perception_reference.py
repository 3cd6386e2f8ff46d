"""The aligner as it was before window building went incremental: every window from scratch.

Kept only as an oracle for ``test_perception.py``: it converts each track to numpy and
recomputes all rows, staleness and jitter for every window, which is slow but obviously
follows the rules in the ``edge_agent.perception`` docstring. The incremental
:class:`~edge_agent.perception.Aligner` must give the same windows and stats for any input.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable

import numpy as np

from drivers.sample import Sample
from edge_agent.perception import PerceptionSpec, PerceptionStats, Window

_NS_PER_MS = 1_000_000


class _Track:
    __slots__ = ("t", "v")

    def __init__(self) -> None:
        self.t: list[int] = []
        self.v: list[float] = []

    def add(self, t_ns: int, value: float) -> None:
        if not self.t or t_ns >= self.t[-1]:
            self.t.append(t_ns)
            self.v.append(value)
        else:
            i = bisect_right(self.t, t_ns)
            self.t.insert(i, t_ns)
            self.v.insert(i, value)

    def prune_before(self, t_ns: int) -> None:
        i = bisect_right(self.t, t_ns) - 1
        if i > 0:
            del self.t[:i]
            del self.v[:i]


class ReferenceAligner:
    """Same interface and rules as ``Aligner``; builds every window in full."""

    def __init__(self, spec: PerceptionSpec) -> None:
        self.spec = spec
        self.stats = PerceptionStats()
        self._index = {name: i for i, name in enumerate(spec.signals)}
        self._tracks = [_Track() for _ in spec.signals]
        self._period = spec.period_ns
        self._lateness = round(spec.lateness_ms * _NS_PER_MS)
        self._staleness = round(spec.max_staleness_ms * _NS_PER_MS)
        self._next_start: int | None = None
        self._horizon_ns: int | None = None
        self._seq = 0

    def push(self, sample: Sample) -> None:
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
            first = -(-sample.t_ns // self._period)
            if self._next_start is None or first < self._next_start:
                self._next_start = first
        self._tracks[i].add(sample.t_ns, sample.value)
        self.stats.samples += 1

    def push_many(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            self.push(s)

    def advance(self, now_ns: int) -> list[Window]:
        if self._next_start is None:
            return []
        spec, period = self.spec, self._period
        span = (spec.window - 1) * period
        if self._next_start * period + span + self._lateness > now_ns:
            return []
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
            lo = int(np.searchsorted(t, start_ns, side="left"))
            hi = int(np.searchsorted(t, end_ns, side="right"))
            if hi - lo >= 3:
                jitter[i] = float(np.diff(t[lo:hi]).std()) / _NS_PER_MS
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
