"""Telemetry for the uplink: per-period statistics of the grid, sent as deltas.

Pure code: windows and aggregates in, aggregates and messages out; no clock, no I/O.
:class:`TelemetryAggregator` folds perception's grid rows (each once, by its timestamp) into
periods aligned to multiples of ``period_ns`` in UNIX time: per signal ``mean``, ``min``,
``max``, ``last``, ``n``. :class:`DeltaEncoder` sends a keyframe every ``keyframe_every``
aggregates and otherwise only the signals that moved past their deadband since last *sent*;
:class:`Reconstructor` is the receiving side. The exact rules (what closes a period, NaN
cells, float32 text, when a signal is sent): ``docs/ARCHITECTURE.md``, "Telemetry
aggregation and deltas".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from edge_agent.perception import Window
from wire.messages import SignalStats, TelemetryMsg, TelemetryPeriod

#: The wire's limit on ``period_ns`` (:class:`wire.messages.TelemetryMsg`).
MAX_PERIOD_NS = 3_600_000_000_000


class PeriodStats(NamedTuple):
    """One signal over one period: ``(mean, min, max, last, n)``, ``n >= 1``."""

    mean: float
    min: float
    max: float
    last: float
    n: int


@dataclass(frozen=True, slots=True)
class Aggregate:
    """Statistics of ``[t_ns - period_ns, t_ns)``; signals without a finite cell are absent."""

    t_ns: int
    period_ns: int
    stats: dict[str, PeriodStats]


#: Up to this many new rows per window are folded one at a time in Python; beyond, one numpy
#: pass per window (about twenty calls of a few microseconds each) is cheaper.
_SCALAR_ROWS_MAX = 8

_Stretch = tuple[list[int], list[float], list[float], list[float], list[float]]


def _f32(x: float) -> float:
    """The shortest decimal that is the same float32 as ``x``, as a Python float."""
    return float(str(np.float32(x)))


def _check_signals(signals: Sequence[str]) -> tuple[str, ...]:
    names = tuple(signals)
    if not names:
        raise ValueError("telemetry needs at least one signal")
    if len(set(names)) != len(names):
        dupes = sorted({s for s in names if names.count(s) > 1})
        raise ValueError(f"telemetry signals must be unique; repeated: {', '.join(dupes)}")
    return names


class TelemetryAggregator:
    """Grid rows -> per-period statistics. See the module docstring.

    ``rows`` counts the grid rows folded in, ``rows_repeated`` those skipped because an
    earlier (overlapping) window had already delivered them.
    """

    def __init__(self, signals: Sequence[str], period_ns: int) -> None:
        self.signals = _check_signals(signals)
        if not 0 < period_ns <= MAX_PERIOD_NS:
            raise ValueError(
                f"telemetry period_ns must be in (0, {MAX_PERIOD_NS}], got {period_ns}"
            )
        self.period_ns = period_ns
        self.rows = 0
        self.rows_repeated = 0
        self._last_row_ns: int | None = None
        # The open period (its index, t // period_ns) and its running figures per signal.
        # Python lists: the agent's usual window (hop 1) brings one row, and a handful of
        # float operations per cell beats numpy's per-call cost.
        self._open: int | None = None
        n = len(self.signals)
        self._count = [0] * n
        self._sum = [0.0] * n
        self._min = [math.inf] * n
        self._max = [-math.inf] * n
        self._last = [math.nan] * n
        self._columns: tuple[tuple[str, ...], list[int], list[int]] | None = None

    def _map(self, names: tuple[str, ...]) -> tuple[list[int], list[int]]:
        """(our index, window column) of each of our signals the window has."""
        if self._columns is None or self._columns[0] != names:
            where = {name: j for j, name in enumerate(names)}
            pairs = [(i, where[s]) for i, s in enumerate(self.signals) if s in where]
            self._columns = (names, [i for i, _ in pairs], [j for _, j in pairs])
        return self._columns[1], self._columns[2]

    def add(self, window: Window) -> list[Aggregate]:
        """Fold the window's rows not seen yet; return the periods that closed."""
        period_w = window.period_ns
        rows = int(window.values.shape[0])
        first = 0
        if self._last_row_ns is not None and self._last_row_ns >= window.start_ns:
            first = min(rows, (self._last_row_ns - window.start_ns) // period_w + 1)
        self.rows_repeated += first
        if first >= rows:
            return []
        self.rows += rows - first
        self._last_row_ns = window.start_ns + (rows - 1) * period_w
        ours, theirs = self._map(window.signals)
        # Float32 cells summed in float64: exact for any realistic period, so the order
        # in which rows arrive (one by one or a window at a time) cannot change a figure.
        block = window.values[first:, theirs].astype(np.float64)
        out: list[Aggregate] = []
        if rows - first <= _SCALAR_ROWS_MAX:
            isfinite = math.isfinite
            t = window.start_ns + first * period_w
            for values in block.tolist():
                self._enter(t // self.period_ns, out)
                ok = [1 if isfinite(v) else 0 for v in values]
                self._fold(ours, (ok, values, values, values, values))
                t += period_w
            return out
        stamps = window.start_ns + np.arange(first, rows, dtype=np.int64) * period_w
        periods = stamps // self.period_ns
        starts = np.flatnonzero(np.r_[True, periods[1:] != periods[:-1]])
        finite = np.isfinite(block)
        counts = np.add.reduceat(finite.astype(np.int64), starts, axis=0).tolist()
        sums = np.add.reduceat(np.where(finite, block, 0.0), starts, axis=0).tolist()
        mins = np.minimum.reduceat(np.where(finite, block, np.inf), starts, axis=0).tolist()
        maxs = np.maximum.reduceat(np.where(finite, block, -np.inf), starts, axis=0).tolist()
        row_of = np.where(finite, np.arange(block.shape[0])[:, None], -1)
        last_row = np.maximum.reduceat(row_of, starts, axis=0)
        cols = np.arange(block.shape[1])
        lasts = block[np.maximum(last_row, 0), cols].tolist()
        for k, start in enumerate(starts.tolist()):
            self._enter(int(periods[start]), out)
            self._fold(ours, (counts[k], sums[k], mins[k], maxs[k], lasts[k]))
        return out

    def _enter(self, period: int, out: list[Aggregate]) -> None:
        """Make ``period`` the open one, closing the one before it into ``out``."""
        if self._open != period:
            if self._open is not None:
                out.append(self._close())
            self._open = period

    def _fold(self, ours: list[int], stretch: _Stretch) -> None:
        """Add one stretch of rows of the open period to its running figures. ``stretch``
        holds, per window column, (count of finite cells, their sum, min, max, last one);
        the last four mean nothing where the count is 0."""
        counts, sums, mins, maxs, lasts = stretch
        count, total, lo, hi, last = self._count, self._sum, self._min, self._max, self._last
        for j, i in enumerate(ours):
            c = counts[j]
            if c:
                count[i] += c
                total[i] += sums[j]
                lo[i] = min(lo[i], mins[j])
                hi[i] = max(hi[i], maxs[j])
                last[i] = lasts[j]

    def flush(self) -> list[Aggregate]:
        """Close the open period, however little of it has passed (at shutdown)."""
        return [self._close()] if self._open is not None else []

    def _close(self) -> Aggregate:
        assert self._open is not None
        stats: dict[str, PeriodStats] = {}
        count, total, lo, hi, last = self._count, self._sum, self._min, self._max, self._last
        for i, name in enumerate(self.signals):
            n = count[i]
            if n:
                stats[name] = PeriodStats(
                    _f32(total[i] / n), _f32(lo[i]), _f32(hi[i]), _f32(last[i]), n
                )
        agg = Aggregate(
            t_ns=(self._open + 1) * self.period_ns, period_ns=self.period_ns, stats=stats
        )
        self._open = None
        n = len(self.signals)
        self._count = [0] * n
        self._sum = [0.0] * n
        self._min = [math.inf] * n
        self._max = [-math.inf] * n
        self._last = [math.nan] * n
        return agg


#: What a signal that lost its data is sent as once (``n == 0``: the numbers mean nothing).
GONE = SignalStats(0.0, 0.0, 0.0, 0.0, 0)

_NO_OVERRIDES: Mapping[str, float] = MappingProxyType({})


@dataclass(slots=True)
class EncoderStats:
    aggregates: int = 0
    keyframes: int = 0
    #: Deltas with nothing to send (the publisher may skip them).
    empty: int = 0
    signals_sent: int = 0
    #: Signals with data left out of a delta because they stayed within their deadband.
    signals_suppressed: int = 0
    #: Signals in an aggregate the encoder was not configured with (ignored).
    unknown_signals: int = 0


class DeltaEncoder:
    """What each telemetry message carries. See the module docstring.

    ``deadband`` overrides ``default_deadband`` per signal (signal units, >= 0).
    """

    def __init__(
        self,
        signals: Sequence[str],
        *,
        default_deadband: float,
        deadband: Mapping[str, float] = _NO_OVERRIDES,
        keyframe_every: int,
    ) -> None:
        self.signals = _check_signals(signals)
        unknown = sorted(set(deadband) - set(self.signals))
        if unknown:
            raise ValueError(
                f"deadband for unknown signal(s) {', '.join(unknown)}; "
                f"expected one of {', '.join(self.signals)}"
            )
        bands = {s: float(deadband.get(s, default_deadband)) for s in self.signals}
        for name, band in bands.items():
            if not (math.isfinite(band) and band >= 0):
                raise ValueError(f"deadband of {name!r} must be finite and >= 0, got {band!r}")
        if keyframe_every < 1:
            raise ValueError(f"keyframe_every must be >= 1, got {keyframe_every}")
        self.deadband: Mapping[str, float] = MappingProxyType(bands)
        self.keyframe_every = keyframe_every
        self.stats = EncoderStats()
        self._known = frozenset(self.signals)
        # Aggregates encoded since the last keyframe; None forces the next one.
        self._since_key: int | None = None
        self._period_ns: int | None = None
        # What the receiver holds: per signal, the stats last sent (absent: no data).
        self._sent: dict[str, PeriodStats] = {}

    def reset(self) -> None:
        """The receiver may have missed messages (a reconnect gap): next is a keyframe."""
        self._since_key = None
        self._sent.clear()

    def encode(self, agg: Aggregate) -> tuple[bool, dict[str, SignalStats]]:
        """``(keyframe, signals to send)`` for ``agg``; an empty delta need not be sent."""
        st = self.stats
        st.aggregates += 1
        extra = len(agg.stats.keys() - self._known)
        st.unknown_signals += extra
        keyframe = (
            self._since_key is None
            or self._since_key >= self.keyframe_every
            or agg.period_ns != self._period_ns
        )
        self._period_ns = agg.period_ns
        out: dict[str, SignalStats] = {}
        if keyframe:
            self._since_key = 1
            self._sent = {s: agg.stats[s] for s in self.signals if s in agg.stats}
            out = {s: SignalStats(*v) for s, v in self._sent.items()}
            st.keyframes += 1
            st.signals_sent += len(out)
            return True, out
        assert self._since_key is not None
        self._since_key += 1
        sent = self._sent
        for name in self.signals:
            cur = agg.stats.get(name)
            prev = sent.get(name)
            if cur is None:
                if prev is not None:
                    out[name] = GONE
                    del sent[name]
                continue
            band = self.deadband[name]
            if (
                prev is None
                or cur.n != prev.n
                or abs(cur.mean - prev.mean) > band
                or abs(cur.min - prev.min) > band
                or abs(cur.max - prev.max) > band
            ):
                out[name] = SignalStats(*cur)
                sent[name] = cur
            else:
                st.signals_suppressed += 1
        st.signals_sent += len(out)
        if not out:
            st.empty += 1
        return False, out


class Reconstructor:
    """The receiving side of :class:`DeltaEncoder`: the per-signal state a stream implies.

    Messages must be applied in seq order with none missing (the fleet checks for gaps);
    after a keyframe the state is complete (``synced``). A new ``boot_id`` means a new
    encoder: the state is dropped until its first keyframe.
    """

    def __init__(self) -> None:
        self.state: dict[str, SignalStats] = {}
        self.synced = False
        self._boot_id: str | None = None

    def apply(self, msg: TelemetryMsg) -> dict[str, SignalStats]:
        """Fold ``msg`` (all its periods) in; return the state (signals with data only)."""
        self.apply_each(msg)
        return self.state

    def apply_each(self, msg: TelemetryMsg) -> list[tuple[int, dict[str, SignalStats]]]:
        """Fold ``msg`` in period by period; the state after each, with its end ``t_ns``."""
        if msg.boot_id != self._boot_id:
            self._boot_id = msg.boot_id
            self.state = {}
            self.synced = False
        out = []
        for t_ns, keyframe, signals in periods_of(msg):
            self._fold(keyframe, signals)
            out.append((t_ns, dict(self.state)))
        return out

    def _fold(self, keyframe: bool, signals: Mapping[str, SignalStats]) -> None:
        if keyframe:
            self.state = {s: v for s, v in signals.items() if v.n > 0}
            self.synced = True
            return
        for name, value in signals.items():
            if value.n > 0:
                self.state[name] = value
            else:
                self.state.pop(name, None)


def periods_of(msg: TelemetryMsg) -> list[tuple[int, bool, Mapping[str, SignalStats]]]:
    """Every period a telemetry message carries, oldest first: ``(t_ns, keyframe, signals)``."""
    first = (msg.t_ns, msg.keyframe, msg.signals)
    return [first, *((p.t_ns, p.keyframe, p.signals) for p in msg.more)]


def telemetry_batch_msg(
    periods: Sequence[tuple[Aggregate, bool, Mapping[str, SignalStats]]],
    *,
    device: str,
    boot_id: str,
    seq: int,
) -> TelemetryMsg:
    """One wire message for several encoded aggregates of one period length, oldest first."""
    (agg, keyframe, signals), rest = periods[0], periods[1:]
    if any(a.period_ns != agg.period_ns for a, _, _ in rest):
        raise ValueError("a telemetry batch holds periods of one length only")
    return TelemetryMsg(
        device=device,
        boot_id=boot_id,
        seq=seq,
        t_ns=agg.t_ns,
        period_ns=agg.period_ns,
        keyframe=keyframe,
        signals=dict(signals),
        more=[TelemetryPeriod(a.t_ns, k, dict(sig)) for a, k, sig in rest],
    )


def telemetry_msg(
    agg: Aggregate,
    keyframe: bool,
    signals: Mapping[str, SignalStats],
    *,
    device: str,
    boot_id: str,
    seq: int,
) -> TelemetryMsg:
    """The wire message for one encoded aggregate (``t_ns`` is the period's end)."""
    return TelemetryMsg(
        device=device,
        boot_id=boot_id,
        seq=seq,
        t_ns=agg.t_ns,
        period_ns=agg.period_ns,
        keyframe=keyframe,
        signals=dict(signals),
    )


__all__ = [
    "GONE",
    "MAX_PERIOD_NS",
    "Aggregate",
    "DeltaEncoder",
    "EncoderStats",
    "PeriodStats",
    "Reconstructor",
    "TelemetryAggregator",
    "periods_of",
    "telemetry_batch_msg",
    "telemetry_msg",
]
