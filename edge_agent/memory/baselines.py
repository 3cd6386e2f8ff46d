"""Semantic memory: per-signal baselines with exponential decay. Pure (numpy, no I/O, no clock).

For each signal we keep an exponentially decayed *weight*, *mean* and *M2* (sum of squared
deviations, so ``variance = M2 / weight``), a faster decayed mean for drift, the min and max
ever seen, when the signal was last finite, and how many finite cells went in.

Design: ``docs/MEMORY.md``, "Semantic memory (baselines)".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]

_LN2 = float(np.log(2.0))


@dataclass(frozen=True, slots=True)
class Baseline:
    """One signal's baseline, as persisted and as shown to people."""

    weight: float
    mean: float
    m2: float
    fast_weight: float
    fast_mean: float
    min: float
    max: float
    last_seen_ns: int
    count: int

    @property
    def var(self) -> float:
        return self.m2 / self.weight if self.weight > 0 else float("nan")

    @property
    def std(self) -> float:
        v = self.var
        return float(np.sqrt(v)) if v >= 0 else float("nan")  # NaN >= 0 is False


class Baselines:
    """Baselines of ``n`` signals (columns). See the module docstring.

    Decay is by data time: before a window ending at ``t`` is folded in, everything so far is
    multiplied by ``0.5 ** ((t - updated) / half_life)``. A window is one batch (its rows count
    as simultaneous, which is exact enough while the window is much shorter than the half-life)
    merged with Chan's parallel formula, so one update is a handful of numpy calls whatever the
    window size. Non-finite cells are ignored and counted.

    ``drift`` is ``(fast_mean - mean) / std``: how many baseline standard deviations the recent
    level has moved. ``normalize`` is ``(x - mean) / std``. Both use a floor on ``std``
    (``1e-6 * max(1, |mean|)``) so a signal that has been constant so far does not divide by 0.

    :meth:`Baselines.update_held` folds in "value ``x`` held for ``d`` ns" as ``d / period``
    points: that is how baselines are consolidated from the episodic store's state changes
    when none were persisted (a new store, a migration).
    """

    def __init__(self, n: int, *, half_life_s: float, drift_half_life_s: float) -> None:
        if n < 1 or half_life_s <= 0 or drift_half_life_s <= 0:
            raise ValueError("need n >= 1 and positive half-lives")
        self.n = n
        self._k_slow = _LN2 / (half_life_s * 1e9)
        self._k_fast = _LN2 / (drift_half_life_s * 1e9)
        self.weight: F64 = np.zeros(n)
        self.mean: F64 = np.zeros(n)
        self.m2: F64 = np.zeros(n)
        self.fast_weight: F64 = np.zeros(n)
        self.fast_mean: F64 = np.zeros(n)
        self.min: F64 = np.full(n, np.inf)
        self.max: F64 = np.full(n, -np.inf)
        self.last_seen_ns = np.zeros(n, dtype=np.int64)
        self.count = np.zeros(n, dtype=np.int64)
        #: Data time the weights refer to (0: nothing yet).
        self.updated_ns = 0
        self.non_finite = 0

    # -- updates -----------------------------------------------------------------------------

    def update(self, values: npt.NDArray[np.floating], start_ns: int, period_ns: int) -> None:
        """Fold in a window: ``values`` is ``(points, n)``, point ``k`` at ``start + k*period``."""
        if values.ndim != 2 or values.shape[1] != self.n:
            raise ValueError(f"expected (points, {self.n}) values, got {values.shape}")
        points = int(values.shape[0])
        if points == 0:
            return
        end_ns = start_ns + (points - 1) * period_ns
        total = values.sum(axis=0, dtype=np.float64)  # NaN/inf anywhere in a column shows here
        if np.isfinite(total).all():  # the usual case: fewer, cheaper numpy calls
            mean_b = total / points
            dev = values - mean_b  # float64: mean_b is
            m2_b = np.einsum("ij,ij->j", dev, dev)
            self._merge_all(float(points), mean_b, m2_b, end_ns)
            np.minimum(self.min, values.min(axis=0), out=self.min)
            np.maximum(self.max, values.max(axis=0), out=self.max)
            np.maximum(self.last_seen_ns, end_ns, out=self.last_seen_ns)
            self.count += points
            return
        x = values.astype(np.float64)
        finite = np.isfinite(x)
        n_b = finite.sum(axis=0)
        self.non_finite += x.size - int(n_b.sum())
        x = np.where(finite, x, 0.0)
        mean_b = np.divide(x.sum(axis=0), n_b, out=np.zeros(self.n), where=n_b > 0)
        dev = np.where(finite, x - mean_b, 0.0)
        m2_b = (dev * dev).sum(axis=0)
        seen = n_b > 0
        self._merge(n_b.astype(np.float64), mean_b, m2_b, end_ns, seen)
        np.minimum(self.min, np.where(finite, x, np.inf).min(axis=0), out=self.min)
        np.maximum(self.max, np.where(finite, x, -np.inf).max(axis=0), out=self.max)
        last_idx = points - 1 - np.argmax(finite[::-1], axis=0)
        t_seen = start_ns + last_idx.astype(np.int64) * period_ns
        self.last_seen_ns = np.where(seen, np.maximum(self.last_seen_ns, t_seen), self.last_seen_ns)
        self.count += n_b

    def update_held(
        self, column: int, value: float, end_ns: int, held_ns: int, period_ns: int
    ) -> None:
        """Fold in ``value`` held on column ``column`` for ``held_ns`` up to ``end_ns``."""
        if not np.isfinite(value) or held_ns <= 0:
            return
        points = held_ns / period_ns
        n_b = np.zeros(self.n)
        n_b[column] = points
        mean_b = np.zeros(self.n)
        mean_b[column] = value
        seen = n_b > 0
        self._merge(n_b, mean_b, np.zeros(self.n), end_ns, seen)
        self.min[column] = min(self.min[column], value)
        self.max[column] = max(self.max[column], value)
        self.last_seen_ns[column] = max(int(self.last_seen_ns[column]), end_ns)
        self.count[column] += max(1, round(points))

    def _decay(self, t_ns: int) -> tuple[float, float]:
        dt = max(0, t_ns - self.updated_ns) if self.updated_ns else 0
        self.updated_ns = max(self.updated_ns, t_ns)
        return float(np.exp(-self._k_slow * dt)), float(np.exp(-self._k_fast * dt))

    def _merge_all(self, n_b: float, mean_b: F64, m2_b: F64, t_ns: int) -> None:
        """:meth:`_merge` when every column has ``n_b`` points (Chan et al., decayed)."""
        slow, fast = self._decay(t_ns)
        w_a = self.weight * slow
        w = w_a + n_b
        delta = mean_b - self.mean
        self.mean += delta * (n_b / w)
        self.m2 = self.m2 * slow + m2_b + delta * delta * (w_a * n_b / w)
        self.weight = w
        fw = self.fast_weight * fast + n_b
        self.fast_mean += (mean_b - self.fast_mean) * (n_b / fw)
        self.fast_weight = fw

    def _merge(
        self, n_b: F64, mean_b: F64, m2_b: F64, t_ns: int, seen: npt.NDArray[np.bool_]
    ) -> None:
        slow, fast = self._decay(t_ns)
        w_a = self.weight * slow
        w = w_a + n_b
        safe_w = np.where(w > 0, w, 1.0)
        delta = mean_b - self.mean
        mean = self.mean + delta * n_b / safe_w
        m2 = self.m2 * slow + m2_b + delta * delta * w_a * n_b / safe_w
        fw = self.fast_weight * fast + n_b
        fmean = self.fast_mean + (mean_b - self.fast_mean) * n_b / np.where(fw > 0, fw, 1.0)
        # Columns without data in this batch only decay (mean unchanged).
        self.weight = np.where(seen, w, w_a)
        self.mean = np.where(seen, mean, self.mean)
        self.m2 = np.where(seen, m2, self.m2 * slow)
        self.fast_weight = np.where(seen, fw, self.fast_weight * fast)
        self.fast_mean = np.where(seen, fmean, self.fast_mean)

    # -- reading -----------------------------------------------------------------------------

    def var(self) -> F64:
        """Decayed variance per signal (NaN: no data yet)."""
        out = np.full(self.n, np.nan)
        np.divide(self.m2, self.weight, out=out, where=self.weight > 0)
        return out

    def std(self) -> F64:
        return np.sqrt(np.maximum(self.var(), 0.0))

    def means(self) -> F64:
        """Decayed mean per signal (NaN: no data yet)."""
        return np.where(self.weight > 0, self.mean, np.nan)

    def _std_floor(self) -> F64:
        return np.maximum(self.std(), 1e-6 * np.maximum(1.0, np.abs(self.mean)))

    def drift(self) -> F64:
        """``(fast_mean - mean) / std`` per signal; NaN where there is no data yet."""
        d = (self.fast_mean - self.mean) / self._std_floor()
        return np.where(self.weight > 0, d, np.nan)

    def normalize(self, values: npt.NDArray[np.floating]) -> F64:
        """``(values - mean) / std`` column-wise (NaN for signals without a baseline yet)."""
        return (values.astype(np.float64, copy=False) - self.means()) / self._std_floor()

    def summary(self) -> tuple[F64, F64, F64]:
        """``(means(), std(), drift())`` in one pass (what each window's context carries)."""
        have = self.weight > 0
        if have.all():
            var = self.m2 / self.weight
            mean = self.mean.copy()
        else:
            var = np.full(self.n, np.nan)
            np.divide(self.m2, self.weight, out=var, where=have)
            mean = np.where(have, self.mean, np.nan)
        std = np.sqrt(np.maximum(var, 0.0))
        floor = np.maximum(std, 1e-6 * np.maximum(1.0, np.abs(self.mean)))
        drift = (self.fast_mean - self.mean) / floor
        if not have.all():
            drift[~have] = np.nan
        return mean, std, drift

    def get(self, column: int) -> Baseline:
        j = column
        return Baseline(
            weight=float(self.weight[j]),
            mean=float(self.mean[j]),
            m2=float(self.m2[j]),
            fast_weight=float(self.fast_weight[j]),
            fast_mean=float(self.fast_mean[j]),
            min=float(self.min[j]),
            max=float(self.max[j]),
            last_seen_ns=int(self.last_seen_ns[j]),
            count=int(self.count[j]),
        )

    def set(self, column: int, b: Baseline) -> None:
        j = column
        self.weight[j], self.mean[j], self.m2[j] = b.weight, b.mean, b.m2
        self.fast_weight[j], self.fast_mean[j] = b.fast_weight, b.fast_mean
        self.min[j], self.max[j] = b.min, b.max
        self.last_seen_ns[j], self.count[j] = b.last_seen_ns, b.count

    def copy(self) -> Baselines:
        out = Baselines.__new__(Baselines)
        out.n, out._k_slow, out._k_fast = self.n, self._k_slow, self._k_fast
        out.weight, out.mean, out.m2 = self.weight.copy(), self.mean.copy(), self.m2.copy()
        out.fast_weight, out.fast_mean = self.fast_weight.copy(), self.fast_mean.copy()
        out.min, out.max = self.min.copy(), self.max.copy()
        out.last_seen_ns, out.count = self.last_seen_ns.copy(), self.count.copy()
        out.updated_ns, out.non_finite = self.updated_ns, self.non_finite
        return out


__all__ = ["Baseline", "Baselines"]
