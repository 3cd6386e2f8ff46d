"""Perception: align samples from every source onto one fixed-rate grid and cut windows.

Pure code. It takes :class:`~drivers.Sample` values and ``now`` (UNIX ns) and returns
:class:`Window` objects; no asyncio, no clock, no I/O, so tests give exact inputs and
expect exact grids. Grid points sit at multiples of the period in UNIX ns (gateways at the
same rate sample at the same instants); a window is emitted once ``now`` is ``lateness_ms``
past its last point, each cell ``hold`` or ``linear`` (never extrapolated), with per-signal
freshness, completeness and jitter; a sample older than the last emitted point is counted
``late_dropped``, never slipped into a later window. The rules: ``docs/ARCHITECTURE.md``,
"Perception rules".
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
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

    @property
    def windows_per_s(self) -> float:
        """Windows this grid closes per second (``rate_hz / hop``): what an OTA probation
        can count on scoring."""
        return self.rate_hz / self.hop


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
    #: Samples refused as nan/inf, or as finite but beyond float32 range (which the float32
    #: window would hold as inf).
    non_finite: int = 0
    windows: int = 0
    windows_skipped: int = 0
    #: Times the clock was found stepped back behind the emitted windows (see advance()).
    clock_steps: int = 0
    unknown_names: set[str] = field(default_factory=set)


#: Up to this many new rows per window are computed one grid point at a time in Python;
#: beyond it a numpy pass per signal is cheaper (measured: about even at 32-64 rows of 16
#: signals; a scalar cell costs well under a microsecond, a numpy pass ~20 per signal).
_SCALAR_ROWS_MAX = 32

#: Pruned samples are deleted once a track has this many (a ``del`` per window per signal
#: costs more than the memory it frees).
_COMPACT_AT = 256

#: Intervals are summed as exact integers; numpy's int64 dot is used when it cannot overflow.
_INT64_MAX = 2**63 - 1
#: Windows are float32: a sample beyond this magnitude would become inf in one.
_F32_MAX = float(np.finfo(np.float32).max)


def _lerp(g: int, t0: int, t1: int, v0: float, v1: float) -> float:
    """Linear value at ``g`` between two samples, in the order numpy evaluates it for a
    whole column: int64 differences turned into doubles, then ``v0 + frac * (v1 - v0)``.
    Any other order can differ in the last bit of the double and so, now and then, of the
    float32 cell."""
    return v0 + float(g - t0) / float(t1 - t0) * (v1 - v0)


class _Track:
    """Time-ordered samples of one signal not yet behind the emitted horizon.

    Plain lists: with one new row per window the hot path is ``bisect``, indexing and
    appends, which are 2-3x faster on lists than on ``array('q')``; a build that needs numpy
    converts only the slice under its rows.

    Samples before ``floor`` are pruned: logically at once (nothing reads them), physically
    once there are enough of them to make the ``del`` worth its cost.

    ``lo``/``hi``/``s2`` carry the jitter sums from one window to the next: ``t[lo:hi]`` are
    the samples inside the window just built (after the build: inside the part of it the
    next window shares) and ``s2`` is the exact sum of their squared inter-arrival
    intervals. ``nxt`` is the first sample after the last emitted point as it was when that
    window was built; linear rows leaning on it are recomputed only if it has changed.
    """

    __slots__ = ("floor", "hi", "lo", "nxt", "s2", "t", "v")

    def __init__(self) -> None:
        self.t: list[int] = []
        self.v: list[float] = []
        self.floor = 0
        self.lo = 0
        self.hi = 0
        self.s2 = 0
        self.nxt: tuple[int, float] | None = None

    def add(self, t_ns: int, value: float) -> None:
        t = self.t
        if not t or t_ns >= t[-1]:
            t.append(t_ns)
            self.v.append(value)
        else:
            # Out of order but still ahead of the horizon: keep time order. Equal stamps
            # keep arrival order, so the later arrival is the one held.
            i = bisect_right(t, t_ns)
            if self.floor and i <= self.floor:
                # Before the kept sample, among the pruned ones (only when windows do not
                # overlap, so the horizon trails the prune point): delete those first, so
                # the newcomer is kept and the floor still marks the kept sample.
                self.compact()
                i = bisect_right(t, t_ns)
            t.insert(i, t_ns)
            self.v.insert(i, value)

    def compact(self, at_least: int = 1) -> None:
        """Delete the pruned samples if there are ``at_least`` of them (indices shift)."""
        k = self.floor
        if k < max(at_least, 1):
            return
        del self.t[:k]
        del self.v[:k]
        self.floor = 0
        self.lo = max(self.lo - k, 0)
        self.hi = max(self.hi - k, 0)


def _sum_sq_diffs(t: list[int], lo: int, hi: int) -> int:
    """Exact sum of squared intervals between consecutive ``t[lo:hi]``."""
    if hi - lo < 2:
        return 0
    d = np.diff(np.array(t[lo:hi], dtype=np.int64))
    top = int(d.max())
    if top * top * int(d.size) <= _INT64_MAX:
        return int(np.dot(d, d))
    # Gaps of seconds over many samples: Python ints cannot overflow.
    return sum(x * x for x in d.tolist())


class Aligner:
    """Turns a stream of samples into windows on a fixed grid. See the module docstring.

    Overlapping windows (``hop < window``) are built incrementally: the rows the new window
    shares with the last one are copied, and only the ``hop`` new rows are computed. That is
    exact because nothing stamped at or before an emitted grid point is accepted afterwards,
    so a shared row's held sample, freshness and the samples under the shared span cannot
    change. The one exception is ``linear``: rows after a signal's last sample at or before
    the previous window's end interpolate towards the first sample after that end, which may
    have arrived (or been overtaken by an earlier one) since; those rows are recomputed when
    that sample differs, exactly as a full build of the new window would compute them.
    """

    def __init__(self, spec: PerceptionSpec) -> None:
        self.spec = spec
        self.stats = PerceptionStats()
        self._index = {name: i for i, name in enumerate(spec.signals)}
        self._tracks = [_Track() for _ in spec.signals]
        self._period = spec.period_ns
        self._lateness = round(spec.lateness_ms * _NS_PER_MS)
        self._staleness = round(spec.max_staleness_ms * _NS_PER_MS)
        self._linear = spec.interpolation == "linear"
        # Grid index of the next window's first point; set by the first sample.
        self._next_start: int | None = None
        # Last grid point already emitted (ns); samples at or before it are late.
        self._horizon_ns: int | None = None
        self._seq = 0
        # What the next window can reuse: the last window's start (grid index; None forces
        # a full build), its values and its fresh-cell count per row. Private copies, so a
        # consumer writing into an emitted window cannot leak into the next one.
        self._prev_start: int | None = None
        self._vals = np.empty((0, len(spec.signals)), dtype=np.float32)
        self._fresh_rows: list[int] = []

    # -- input ------------------------------------------------------------------------------

    def push(self, sample: Sample) -> None:
        """Accept one sample (any order, any source)."""
        i = self._index.get(sample.signal)
        if i is None:
            self.stats.unknown_signal += 1
            if len(self.stats.unknown_names) < 64:
                self.stats.unknown_names.add(sample.signal)
            return
        if not abs(sample.value) <= _F32_MAX:  # also false for nan
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
        if self._horizon_ns is None:
            for s in samples:
                self.push(s)
            return
        # The steady-state path of push(), inlined: this runs for every CAN frame.
        index, tracks, stats, horizon = self._index, self._tracks, self.stats, self._horizon_ns
        lo, hi = -_F32_MAX, _F32_MAX
        accepted = 0
        try:
            for s in samples:
                name, value, t_ns = s
                i = index.get(name)
                # `not lo <= value <= hi`: nan, inf and beyond float32 range, as in push().
                if i is None or not lo <= value <= hi or t_ns <= horizon:
                    self.push(s)  # counts it
                    continue
                track = tracks[i]
                t = track.t
                if t and t_ns < t[-1]:
                    track.add(t_ns, value)
                else:
                    t.append(t_ns)
                    track.v.append(value)
                accepted += 1
        finally:
            stats.samples += accepted

    # -- output -----------------------------------------------------------------------------

    def advance(self, now_ns: int) -> list[Window]:
        """Emit every window whose last point is at least ``lateness_ms`` behind ``now_ns``.

        After a long stall (a suspended process, a clock step) at most
        ``max_catch_up_windows`` of the most recent windows are built; older ones are
        skipped and counted in ``windows_skipped`` rather than flooding the pipeline.

        A clock stepped back by more than a window span (NTP, an RTC set late) leaves every
        new sample stamped before the windows already out: each would be late, and no
        window would be due, for as long as the step. Instead the grid starts over from
        the next sample (counted in ``clock_steps``); the samples held, stamped by the old
        clock, are dropped with it.
        """
        spec, period = self.spec, self._period
        span = (spec.window - 1) * period
        horizon = self._horizon_ns
        if horizon is not None and horizon - (now_ns - self._lateness) > span:
            self.stats.clock_steps += 1
            self._tracks = [_Track() for _ in spec.signals]
            self._next_start = self._horizon_ns = self._prev_start = None
            return []
        if self._next_start is None:
            return []

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
            # The carried jitter sums only know how to slide by one hop: start over.
            self._prev_start = None
        out = [self._build(self._next_start + k * spec.hop) for k in range(n_due)]
        self._next_start += n_due * spec.hop
        return out

    def _build(self, start_index: int) -> Window:
        spec, period, size = self.spec, self._period, self.spec.window
        start_ns = start_index * period
        end_ns = start_ns + (size - 1) * period
        n = len(spec.signals)
        prev = self._prev_start
        # Rows shared with the last window (its rows ``shift:``); 0 means a full build.
        keep = 0 if prev is None else max(0, size - (start_index - prev))
        values = np.empty((size, n), dtype=np.float32)
        if keep:
            values[:keep] = self._vals[size - keep :]
            fresh_rows = self._fresh_rows[size - keep :]
            if self._linear:
                self._refresh_linear_tails(values, start_ns, keep)
        else:
            fresh_rows = []
        if size - keep > _SCALAR_ROWS_MAX:
            new_fresh, last_fresh = self._rows_numpy(values, start_ns, keep)
        else:
            new_fresh, last_fresh = self._rows_scalar(values, start_ns, keep)
        fresh_rows += new_fresh
        # Rows up to end_ns are now final (for linear, see _refresh_linear_tails): a sample
        # stamped at or before end_ns that arrives from now on is late.
        self._horizon_ns = end_ns
        next_start_ns = (start_index + spec.hop) * period
        carry = spec.hop < size
        jitter = self._jitter_and_prune(start_ns, end_ns, next_start_ns, keep > 0, carry)

        self._prev_start = start_index if carry else None
        self._vals = values.copy()
        self._fresh_rows = fresh_rows
        self._seq += 1
        self.stats.windows += 1
        return Window(
            seq=self._seq,
            start_ns=start_ns,
            period_ns=period,
            signals=spec.signals,
            values=values,
            stale=~np.array(last_fresh, dtype=np.bool_),
            completeness=sum(fresh_rows) / (size * n),
            jitter_ms=jitter,
        )

    def _refresh_linear_tails(
        self, values: npt.NDArray[np.float32], start_ns: int, keep: int
    ) -> None:
        """Recompute shared rows that interpolated towards a sample after the last window.

        A shared row at or after the signal's last sample at or before the previous end
        (``end_prev``) takes its slope from the first sample after ``end_prev``. Samples
        after ``end_prev`` are still accepted, so that sample may now be a different one (or
        exist where it did not); the full build of this window would use the current one.
        """
        period = self._period
        end_prev = start_ns + (keep - 1) * period
        for i, track in enumerate(self._tracks):
            t = track.t
            k = bisect_right(t, end_prev)
            if k == 0:
                continue  # no sample yet: those rows are NaN whatever comes later
            nxt = (t[k], track.v[k]) if k < len(t) else None
            if nxt == track.nxt:
                continue
            t0, v0 = t[k - 1], track.v[k - 1]
            first = max(0, -(-(t0 - start_ns) // period))
            for r in range(first, keep):
                if nxt is None:
                    values[r, i] = v0
                else:
                    values[r, i] = _lerp(start_ns + r * period, t0, nxt[0], v0, nxt[1])

    def _rows_scalar(
        self, values: npt.NDArray[np.float32], start_ns: int, keep: int
    ) -> tuple[list[int], list[bool]]:
        """Fill rows ``keep:`` one grid point at a time; return fresh cells per new row and the
        last row's fresh flags.

        Same arithmetic as :meth:`_rows_numpy`, operation for operation (see :func:`_lerp`),
        so the float32 cells are bit-identical whichever path built them.
        """
        period, staleness, linear = self._period, self._staleness, self._linear
        size = self.spec.window
        n_new = size - keep
        nan = math.nan
        rows = [[nan] * len(self._tracks) for _ in range(n_new)]
        counts = [0] * n_new
        last_fresh = [False] * len(self._tracks)
        grid0 = start_ns + keep * period
        for i, track in enumerate(self._tracks):
            t = track.t
            n_t = len(t)
            if not n_t:
                continue
            v = track.v
            j = -1
            g = grid0
            for r in range(n_new):
                j = bisect_right(t, g, max(j, 0)) - 1
                if j >= 0:
                    t0 = t[j]
                    if g - t0 <= staleness:
                        counts[r] += 1
                        if r == n_new - 1:
                            last_fresh[i] = True
                    if linear and j + 1 < n_t:
                        rows[r][i] = _lerp(g, t0, t[j + 1], v[j], v[j + 1])
                    else:
                        rows[r][i] = v[j]
                g += period
        values[keep:] = rows
        return counts, last_fresh

    def _rows_numpy(
        self, values: npt.NDArray[np.float32], start_ns: int, keep: int
    ) -> tuple[list[int], list[bool]]:
        """Fill rows ``keep:`` with one vectorised pass per signal; see :meth:`_rows_scalar`."""
        period, staleness = self._period, self._staleness
        n_new = self.spec.window - keep
        grid = start_ns + keep * period + np.arange(n_new, dtype=np.int64) * period
        g_first, g_last = int(grid[0]), int(grid[-1])
        values[keep:] = np.nan
        fresh = np.zeros((n_new, len(self._tracks)), dtype=np.bool_)
        for i, track in enumerate(self._tracks):
            if not track.t:
                continue
            # Only the samples these rows can see, not the whole track: the one held at the
            # first row (or the track's start) through the one after the last row.
            a = max(bisect_right(track.t, g_first) - 1, 0)
            b = min(bisect_right(track.t, g_last) + 1, len(track.t))
            t = np.array(track.t[a:b], dtype=np.int64)
            v = np.array(track.v[a:b], dtype=np.float64)
            # idx[k]: newest sample at or before grid[k] (-1: none yet).
            idx = np.searchsorted(t, grid, side="right") - 1
            have = idx >= 0
            held_idx = np.where(have, idx, 0)
            col = np.where(have, v[held_idx], np.nan)
            if self._linear:
                nxt = held_idx + 1
                can = have & (nxt < t.size)
                if can.any():
                    nxt_c = np.minimum(nxt, t.size - 1)
                    t0, t1 = t[held_idx], t[nxt_c]
                    dt = np.where(can, t1 - t0, 1)
                    frac = np.where(can, (grid - t0) / dt, 0.0)
                    col = np.where(can, v[held_idx] + frac * (v[nxt_c] - v[held_idx]), col)
            values[keep:, i] = col
            fresh[:, i] = have & (grid - t[held_idx] <= staleness)
        counts: list[int] = fresh.sum(axis=1).tolist()
        last: list[bool] = fresh[-1].tolist()
        return counts, last

    def _jitter_and_prune(
        self, start_ns: int, end_ns: int, next_start_ns: int, incremental: bool, carry: bool
    ) -> npt.NDArray[np.float32]:
        """Per signal: the population std of its inter-arrival intervals inside the window,
        then prune up to the next window and, when it overlaps this one, slide the sums to
        its start. One loop over the tracks for all of it: this runs every 10 ms.

        The std comes from exact integer sums (count, first and last stamp, sum of squared
        intervals) rather than numpy's two-pass float std, so the sums slide with the window
        at the cost of the samples that enter and leave. It agrees with
        ``np.diff(t).std()`` to float rounding: asserted to 1e-6 relative, and in the
        equality tests bit-identical after the cast to float32.
        """
        out = [0.0] * len(self._tracks)
        linear = self._linear
        for i, track in enumerate(self._tracks):
            t = track.t
            if incremental:
                lo, hi, s2 = track.lo, track.hi, track.s2
                new_hi = bisect_right(t, end_ns, hi)
                for j in range(hi if hi > lo else lo + 1, new_hi):
                    d = t[j] - t[j - 1]
                    s2 += d * d
                hi = new_hi
            else:
                lo = max(bisect_left(t, start_ns), track.floor)
                hi = bisect_right(t, end_ns, lo)
                s2 = _sum_sq_diffs(t, lo, hi)
            m = hi - lo - 1  # intervals
            if m >= 2:
                s1 = t[hi - 1] - t[lo]
                out[i] = math.sqrt((m * s2 - s1 * s1) / (m * m)) / _NS_PER_MS
            if linear:
                track.nxt = (t[hi], track.v[hi]) if hi < len(t) else None
            # Prune: forget samples older than the newest one at or before next_start (still
            # needed to hold); of equal stamps exactly there, the last to arrive is kept.
            floor = track.floor = max(track.floor, bisect_right(t, next_start_ns) - 1)
            if carry:
                # The next window's samples start at next_start, but not before the floor:
                # of equal stamps exactly there, pruning kept only the last (their
                # intervals are 0, so only the count changes).
                new_lo = max(bisect_left(t, next_start_ns, lo, hi), floor)
                for j in range(lo + 1, min(new_lo + 1, hi)):
                    d = t[j] - t[j - 1]
                    s2 -= d * d
                lo = new_lo
            track.lo, track.hi, track.s2 = lo, hi, s2
            if floor >= _COMPACT_AT:
                track.compact()
        return np.array(out, dtype=np.float32)


__all__ = ["Aligner", "Interpolation", "PerceptionSpec", "PerceptionStats", "Window"]
