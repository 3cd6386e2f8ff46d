"""What the model's inputs looked like in training, per signal, and a window's view of it.

A window whose signal sits outside the levels, change sizes or repeat patterns the model was
trained on is outside its training distribution, and its scores mean little.
:func:`window_stats` measures those per window, :class:`InputStats` holds their ranges from
training (in the manifest), :func:`out_of_training` tells which signals of a window are
outside them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

#: Columns of :func:`window_stats`'s last axis.
STAT_NAMES: Final = ("min", "max", "repeat_share", "repeat_run", "step")
S_MIN, S_MAX, S_REPEAT, S_RUN, S_STEP = range(5)
#: Columns of :meth:`InputStats.bounds`: the allowed range of each statistic.
B_LEVEL_LO, B_LEVEL_HI, B_REPEAT_LO, B_REPEAT_HI, B_RUN_HI, B_STEP_LO, B_STEP_HI = range(7)
N_BOUNDS: Final = 7


@dataclass(frozen=True, slots=True)
class Margins:
    """How far past the training ranges a window may go before it counts as outside.

    ``level``: a share of the training level span added on each side; ``repeat_share``: an
    absolute share added on each side; ``repeat_run``: grid steps added to the longest
    training run; ``step``: a factor the mean change may be smaller or larger by.
    """

    level: float
    repeat_share: float
    repeat_run: float
    step: float


#: Measured with ``scripts/ood_evidence.py`` on the committed model's data (the table is in
#: ``models/README.md``, "Out of distribution"): with these margins the held-out continuous
#: normal runs (4 h, 4 plant seeds never trained on) have at most 0.3 % of windows outside
#: on any signal, while every window of the Modbus-only profiles (all six signals polled
#: at 100 ms, or at 10 ms) is outside on the signals whose acquisition differs, and a
#: frozen or off-scale sensor is outside on every window of its signal. The level margin
#: covers operating points the training runs touched only briefly (a cold winding).
MARGINS: Final = Margins(level=0.1, repeat_share=0.05, repeat_run=2.0, step=1.25)


@dataclass(frozen=True, slots=True)
class SignalInputStats:
    """Ranges of :func:`window_stats` over the normal training windows of one signal."""

    level: tuple[float, float]
    repeat_share: tuple[float, float]
    repeat_run: tuple[float, float]
    step: tuple[float, float]
    #: The median absolute change over every step that changed: the change size the
    #: model learned (the input contract compares resolutions and deadbands with it).
    step_median: float

    def describe(self) -> dict[str, object]:
        return {
            "level": list(self.level),
            "repeat_share": list(self.repeat_share),
            "repeat_run": list(self.repeat_run),
            "step": list(self.step),
            "step_median": self.step_median,
        }

    @classmethod
    def from_description(cls, data: object, where: str) -> SignalInputStats:
        d = _obj(data, where)
        keys = ("level", "repeat_share", "repeat_run", "step", "step_median")
        unknown = sorted(set(d) - set(keys))
        if unknown:
            raise _invalid(f"{where}.{unknown[0]}: unknown key; expected one of {list(keys)}")
        if "step_median" not in d:
            raise _invalid(f"{where}.step_median: missing key")
        median = d["step_median"]
        if isinstance(median, bool) or not isinstance(median, int | float):
            raise _invalid(f"{where}.step_median: expected a number; got {median!r}")
        if not math.isfinite(float(median)) or float(median) < 0:
            raise _invalid(f"{where}.step_median: expected a finite number >= 0; got {median!r}")
        return cls(
            level=_pair(d, "level", where),
            repeat_share=_pair(d, "repeat_share", where),
            repeat_run=_pair(d, "repeat_run", where),
            step=_pair(d, "step", where),
            step_median=float(median),
        )


@dataclass(frozen=True, slots=True)
class InputStats:
    """Per-signal :class:`SignalInputStats` of a model's normal training windows.

    :class:`InputStats` holds their ranges over the normal training windows (and the median
    change, which the input contract compares resolutions and deadbands with). It is stored in
    the manifest under ``training.input_stats``: :mod:`models.train` writes it from its
    training sets; ``scripts/model_input_stats.py`` computed it for the committed models from
    the same generator without retraining (the statistics depend on the data, not on the
    network).
    """

    windows: int
    source: str
    signals: Mapping[str, SignalInputStats]

    def describe(self) -> dict[str, object]:
        """The manifest's ``training.input_stats`` entry."""
        return {
            "definition": (
                "per window and signal: min and max (level), the share of steps repeating "
                "the previous value, the longest run of such repeats (grid steps), the mean "
                "absolute change of the steps that changed; each given as [min, max] over "
                "the normal training windows; step_median: the median absolute change over "
                "all steps that changed (models/input_stats.py)"
            ),
            "computed_from": self.source,
            "windows": self.windows,
            "signals": {s: v.describe() for s, v in self.signals.items()},
        }

    @classmethod
    def from_description(
        cls, data: object, signals: Sequence[str], where: str = "training.input_stats"
    ) -> InputStats:
        """The inverse of :meth:`describe`; every model signal must be there. ValueError
        names the key."""
        d = _obj(data, where)
        per = _obj(d.get("signals"), f"{where}.signals")
        missing = [s for s in signals if s not in per]
        if missing:
            raise _invalid(f"{where}.signals: no statistics for {', '.join(missing)}")
        windows = d.get("windows", 0)
        if isinstance(windows, bool) or not isinstance(windows, int) or windows < 0:
            raise _invalid(f"{where}.windows: expected an integer >= 0; got {windows!r}")
        source = d.get("computed_from", "")
        return cls(
            windows=windows,
            source=source if isinstance(source, str) else "",
            signals={
                s: SignalInputStats.from_description(per[s], f"{where}.signals.{s}")
                for s in signals
            },
        )

    def bounds(self, signals: Sequence[str], margins: Margins = MARGINS) -> npt.NDArray[np.float32]:
        """``(n, N_BOUNDS)`` float32: the allowed range of each statistic, margins applied,
        in ``signals`` order (the kernel's input; ``B_*`` name the columns)."""
        out = np.empty((len(signals), N_BOUNDS), dtype=np.float32)
        for i, s in enumerate(signals):
            st = self.signals[s]
            lo, hi = st.level
            pad = margins.level * (hi - lo)
            out[i, B_LEVEL_LO] = lo - pad
            out[i, B_LEVEL_HI] = hi + pad
            out[i, B_REPEAT_LO] = st.repeat_share[0] - margins.repeat_share
            out[i, B_REPEAT_HI] = st.repeat_share[1] + margins.repeat_share
            out[i, B_RUN_HI] = st.repeat_run[1] + margins.repeat_run
            out[i, B_STEP_LO] = st.step[0] / margins.step
            out[i, B_STEP_HI] = st.step[1] * margins.step
        return out


def window_stats(values: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Statistics (:data:`STAT_NAMES`) of one window ``(window, n)`` or a batch
    ``(batch, window, n)``: ``(..., n, 5)``. Non-finite values are left out of the level
    range (a column with none has NaN there); every comparison runs in float32 as the
    features see the values.

    The features (:mod:`models.features`) read three things of each signal: its level, its
    step-to-step changes and whether a value repeats the one before. A window whose signal
    sits outside the levels, change sizes or repeat patterns the model was trained on is
    outside its training distribution, and its scores mean little. Per window and signal,
    :func:`window_stats` measures exactly those:

    * ``min``, ``max``: the level range (signal units);
    * ``repeat_share``: the share of steps whose value equals the previous one (a 100 ms poll
      on a 10 ms grid repeats 9 steps in 10; a value every step: none);
    * ``repeat_run``: the longest run of such repeats, in grid steps (a frozen sensor: the
      whole window; a 200 ms poll: 19);
    * ``step``: the mean absolute change over the steps that changed (0 when none did).
    """
    x = np.asarray(values, dtype=np.float32)
    if x.ndim not in (2, 3):
        raise _invalid(f"expected a window (window, n) or a batch of them, got {x.shape}")
    finite = np.isfinite(x)
    with np.errstate(invalid="ignore"):
        lo = np.where(finite, x, np.inf).min(axis=-2)
        hi = np.where(finite, x, -np.inf).max(axis=-2)
    lo = np.where(np.isfinite(lo), lo, np.nan)
    hi = np.where(np.isfinite(hi), hi, np.nan)
    same = x[..., 1:, :] == x[..., :-1, :]
    repeat = same.mean(axis=-2)
    run = _longest_runs(same)
    change = np.abs(x[..., 1:, :].astype(np.float64) - x[..., :-1, :].astype(np.float64))
    changed = ~same & np.isfinite(change)
    n_changed = changed.sum(axis=-2)
    total = np.where(changed, change, 0.0).sum(axis=-2)
    step = np.where(n_changed > 0, total / np.maximum(n_changed, 1), 0.0)
    return np.stack([lo, hi, repeat, run, step], axis=-1).astype(np.float64)


def _longest_runs(flags: npt.NDArray[np.bool_]) -> npt.NDArray[np.float64]:
    """Longest run of consecutive True along axis -2, per column (float64).

    Without a Python step per row: this is the numpy reference the agent serves from when
    numba cannot load (the systemd unit's MemoryDenyWriteExecute), once per window. The
    run ending at a row is the Trues counted so far minus the count at the last False.
    """
    if flags.shape[-2] == 0:
        return np.zeros(flags.shape[:-2] + flags.shape[-1:], dtype=np.float64)
    counted = np.cumsum(flags, axis=-2, dtype=np.int64)
    at_false = np.maximum.accumulate(np.where(flags, 0, counted), axis=-2)
    runs: npt.NDArray[np.float64] = (counted - at_false).max(axis=-2).astype(np.float64)
    return runs


def compute(windows: npt.ArrayLike, signals: Sequence[str], source: str) -> InputStats:
    """:class:`InputStats` of normal windows ``(batch, window, n)`` (``signals`` order)."""
    x = np.asarray(windows, dtype=np.float32)
    if x.ndim != 3 or x.shape[-1] != len(signals) or x.shape[0] == 0:
        raise _invalid(f"expected a non-empty batch (batch, window, {len(signals)}); {x.shape}")
    st = window_stats(x)
    change = np.abs(np.diff(x.astype(np.float64), axis=1))
    per: dict[str, SignalInputStats] = {}
    for i, s in enumerate(signals):
        c = change[:, :, i].ravel()
        c = c[np.isfinite(c) & (c > 0)]
        per[s] = SignalInputStats(
            level=(_f(np.nanmin(st[:, i, S_MIN])), _f(np.nanmax(st[:, i, S_MAX]))),
            repeat_share=(_f(st[:, i, S_REPEAT].min()), _f(st[:, i, S_REPEAT].max())),
            repeat_run=(_f(st[:, i, S_RUN].min()), _f(st[:, i, S_RUN].max())),
            step=(_f(st[:, i, S_STEP].min()), _f(st[:, i, S_STEP].max())),
            step_median=_f(np.median(c)) if c.size else 0.0,
        )
    return InputStats(windows=int(x.shape[0]), source=source, signals=per)


def out_of_training(
    values: npt.NDArray[np.float32],
    bounds: npt.NDArray[np.float32],
    stats: npt.NDArray[np.float32],
) -> int:
    """Bit ``i`` set: signal ``i`` of the window ``(window, n)`` is outside its ``bounds``
    row (:meth:`InputStats.bounds`) on any statistic. ``stats`` ``(n, 5)`` receives the
    window's :func:`window_stats`. The numpy reference of the compiled kernel; a column
    without a finite value is never outside (a never-seen signal is the dropout rule's).

    :func:`out_of_training` tells, for one window, which signals are outside those ranges
    widened by :data:`MARGINS` (why those margins: see there). The reasoning stage runs it on
    every window the model scores, through the compiled kernel of :mod:`models.kernels` when
    it can (one call) and this numpy code otherwise; both give the same mask (tested).
    """
    st = window_stats(values)
    stats[:] = st
    lo, hi = st[:, S_MIN], st[:, S_MAX]
    with np.errstate(invalid="ignore"):
        out = (
            (lo < bounds[:, B_LEVEL_LO])
            | (hi > bounds[:, B_LEVEL_HI])
            | (st[:, S_REPEAT] < bounds[:, B_REPEAT_LO])
            | (st[:, S_REPEAT] > bounds[:, B_REPEAT_HI])
            | (st[:, S_RUN] > bounds[:, B_RUN_HI])
            | (st[:, S_STEP] < bounds[:, B_STEP_LO])
            | (st[:, S_STEP] > bounds[:, B_STEP_HI])
        ) & np.isfinite(lo)
    mask = 0
    for i in np.flatnonzero(out).tolist():
        mask |= 1 << i
    return mask


def why_outside(
    stats: npt.NDArray[np.floating[Any]], row: npt.NDArray[np.float32], unit: str = ""
) -> str:
    """The statistics of one signal's window (``(5,)``) that are outside its ``bounds`` row,
    in words ("repeat run 63 steps (training at most 20)"); "" when none is."""
    u = f" {unit}" if unit else ""
    parts = []
    if stats[S_MIN] < row[B_LEVEL_LO] or stats[S_MAX] > row[B_LEVEL_HI]:
        parts.append(
            f"level {stats[S_MIN]:.4g}..{stats[S_MAX]:.4g}{u} "
            f"(training {row[B_LEVEL_LO]:.4g}..{row[B_LEVEL_HI]:.4g})"
        )
    if not row[B_REPEAT_LO] <= stats[S_REPEAT] <= row[B_REPEAT_HI]:
        lo, hi = max(0.0, float(row[B_REPEAT_LO])), min(1.0, float(row[B_REPEAT_HI]))
        parts.append(f"repeats on {stats[S_REPEAT]:.0%} of steps (training {lo:.0%}..{hi:.0%})")
    if stats[S_RUN] > row[B_RUN_HI]:
        parts.append(
            f"a value held {stats[S_RUN] + 1:.0f} steps (training at most {row[B_RUN_HI] + 1:.0f})"
        )
    if not row[B_STEP_LO] <= stats[S_STEP] <= row[B_STEP_HI]:
        parts.append(
            f"changes of {stats[S_STEP]:.3g}{u} on average "
            f"(training {row[B_STEP_LO]:.3g}..{row[B_STEP_HI]:.3g})"
        )
    return "; ".join(parts)


def _invalid(message: str) -> ValueError:
    """A manifest value that is not what it should be (type or range alike): the runtime
    reports every one as ModelRejected, naming the key."""
    return ValueError(message)


def _obj(data: object, where: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise _invalid(f"{where}: expected a JSON object; got {type(data).__name__}")
    return data


def _pair(d: Mapping[str, Any], key: str, where: str) -> tuple[float, float]:
    v = d.get(key)
    if (
        not isinstance(v, list)
        or len(v) != 2
        or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
        or not all(math.isfinite(float(x)) for x in v)
        or float(v[0]) > float(v[1])
    ):
        raise _invalid(f"{where}.{key}: expected [min, max] of finite numbers; got {v!r}")
    return float(v[0]), float(v[1])


def _f(x: Any) -> float:
    return float(np.float32(x))


__all__ = [
    "MARGINS",
    "N_BOUNDS",
    "STAT_NAMES",
    "InputStats",
    "Margins",
    "SignalInputStats",
    "compute",
    "out_of_training",
    "why_outside",
    "window_stats",
]
