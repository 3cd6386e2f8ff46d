"""The model's health at run time: inputs out of distribution, and alarm storms. Pure.

Two monitors, each a sliding horizon over the windows the model scored, with hysteresis,
fed the window's facts and its time (``t_ns``, injected); each says when its state changes
(a :class:`Notice`). :class:`OodMonitor`: inputs outside the training statistics (model
labels masked meanwhile). :class:`StormMonitor`: alarms on too large a share of windows
(reported, never suppressed). The thresholds and why: ``docs/ARCHITECTURE.md``, "Model
health at run time".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from models.input_stats import STAT_NAMES, out_of_training, why_outside

#: Out of distribution: the horizon, and the share of its windows a signal must be flagged
#: on to be out (and at most to be back). See the module docstring for why.
OOD_HORIZON_S: Final = 30.0
OOD_ON_SHARE: Final = 0.6
OOD_OFF_SHARE: Final = 0.2
#: Alarm storm: the horizon and the share of windows the model alarms on.
STORM_HORIZON_S: Final = 60.0
STORM_ON_SHARE: Final = 0.5
STORM_OFF_SHARE: Final = 0.1

OOD: Final = "model_out_of_distribution"
STORM: Final = "alarm_storm"

NoticeKind = Literal["model_out_of_distribution", "alarm_storm"]


@dataclass(frozen=True, slots=True)
class Notice:
    """A change of the model's health: ``kind`` ``raised`` or ``cleared`` at ``t_ns``, with
    the signals concerned (out of distribution) and why, in words."""

    kind: NoticeKind
    state: Literal["raised", "cleared"]
    t_ns: int
    signals: tuple[str, ...] = ()
    reason: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "state": self.state,
            "signals": list(self.signals),
            "reason": self.reason[:1024],
        }


class ShareWindow:
    """The windows of the last ``horizon_ns``, each with a bit mask; per bit, how many of
    them have it set. ``push`` is O(1) amortised, and cheaper still while no bit is set."""

    __slots__ = ("_counts", "_entries", "_first", "_horizon", "_marked")

    def __init__(self, horizon_ns: int, bits: int) -> None:
        self._horizon = horizon_ns
        self._entries: deque[tuple[int, int]] = deque()
        self._counts = [0] * bits
        self._marked = 0  # entries with a non-zero mask
        self._first: int | None = None

    def push(self, t_ns: int, mask: int) -> None:
        entries = self._entries
        if self._first is None:
            self._first = t_ns
        entries.append((t_ns, mask))
        if mask:
            self._marked += 1
            self._add(mask, 1)
        cut = t_ns - self._horizon
        while entries[0][0] <= cut:
            _, old = entries.popleft()
            if old:
                self._marked -= 1
                self._add(old, -1)

    def _add(self, mask: int, delta: int) -> None:
        counts = self._counts
        i = 0
        while mask:
            if mask & 1:
                counts[i] += delta
            mask >>= 1
            i += 1

    @property
    def quiet(self) -> bool:
        """No window in the horizon has a bit set."""
        return self._marked == 0

    def covered(self, t_ns: int) -> bool:
        """Whether a whole horizon has been watched (the first window is that old)."""
        return self._first is not None and t_ns - self._first >= self._horizon

    def share(self, bit: int) -> float:
        n = len(self._entries)
        return self._counts[bit] / n if n else 0.0

    def reset(self) -> None:
        self._entries.clear()
        self._counts = [0] * len(self._counts)
        self._marked = 0
        self._first = None


class OodMonitor:
    """Which signals are out of distribution, with hysteresis (see the module docstring).

    ``update(t_ns, mask)`` takes one scored window's flags (bit ``i``: ``signals[i]`` is
    outside its training ranges) and ``reasons`` (called only when a signal goes out: its
    words for the operator); it returns the :class:`Notice` of a change of the overall
    state (the first signal out: ``raised``; the last one back: ``cleared``), else None.
    """

    def __init__(
        self,
        signals: Sequence[str],
        *,
        horizon_s: float = OOD_HORIZON_S,
        on_share: float = OOD_ON_SHARE,
        off_share: float = OOD_OFF_SHARE,
    ) -> None:
        if not 0.0 <= off_share < on_share <= 1.0:
            raise ValueError(
                f"expected 0 <= off_share < on_share <= 1; got {off_share}, {on_share}"
            )
        self.signals = tuple(signals)
        self.on_share = on_share
        self.off_share = off_share
        self.horizon_s = horizon_s
        self._window = ShareWindow(round(horizon_s * 1e9), len(self.signals))
        self._out: dict[str, str] = {}  # signal -> why, while out
        #: The signals out of distribution now, in signal order (empty: all in).
        self.active: tuple[str, ...] = ()
        self.since_ns: int | None = None
        self.events = 0

    @property
    def reasons(self) -> dict[str, str]:
        """Why each signal out went out (its statistics then)."""
        return dict(self._out)

    def shares(self) -> dict[str, float]:
        """Per signal, the share of the horizon's windows it was flagged on."""
        return {s: round(self._window.share(i), 3) for i, s in enumerate(self.signals)}

    def update(
        self, t_ns: int, mask: int, why: Callable[[int], str] | None = None
    ) -> Notice | None:
        """Feed one window; ``why(i)`` says why signal ``i`` is flagged on this window (called
        only when a signal goes out)."""
        w = self._window
        w.push(t_ns, mask)
        if w.quiet and not self._out:
            return None
        was = bool(self._out)
        for i, s in enumerate(self.signals):
            share = w.share(i)
            if s in self._out:
                if share <= self.off_share:
                    del self._out[s]
            elif share >= self.on_share and w.covered(t_ns):
                self._out[s] = (why(i) if why is not None else "") or "outside its training ranges"
        self.active = tuple(s for s in self.signals if s in self._out)
        now = bool(self._out)
        if now and not was:
            self.since_ns = t_ns
            self.events += 1
            active = self.active
            reason = "; ".join(f"{s}: {self._out[s]}" for s in active)
            return Notice(OOD, "raised", t_ns, active, reason)
        if was and not now:
            self.since_ns = None
            return Notice(OOD, "cleared", t_ns, (), "inputs back in the training distribution")
        return None

    def reset(self, t_ns: int, why: str) -> Notice | None:
        """Forget the horizon (a new model, other statistics); ``cleared`` if it was out."""
        was = bool(self._out)
        self._window.reset()
        self._out.clear()
        self.active = ()
        self.since_ns = None
        return Notice(OOD, "cleared", t_ns, (), why) if was else None

    def snapshot(self) -> dict[str, object]:
        return {
            "active": bool(self._out),
            "signals": list(self.active),
            "why": self.reasons,
            "since_ns": self.since_ns,
            "events": self.events,
            "flagged_share": self.shares(),
            "horizon_s": self.horizon_s,
            "on_share": self.on_share,
            "off_share": self.off_share,
        }


class StormMonitor:
    """Whether the model alarms on too many windows (see the module docstring)."""

    def __init__(
        self,
        *,
        horizon_s: float = STORM_HORIZON_S,
        on_share: float = STORM_ON_SHARE,
        off_share: float = STORM_OFF_SHARE,
    ) -> None:
        if not 0.0 <= off_share < on_share <= 1.0:
            raise ValueError(
                f"expected 0 <= off_share < on_share <= 1; got {off_share}, {on_share}"
            )
        self.horizon_s = horizon_s
        self.on_share = on_share
        self.off_share = off_share
        self._window = ShareWindow(round(horizon_s * 1e9), 1)
        self.active = False
        self.since_ns: int | None = None
        self.events = 0

    def share(self) -> float:
        return self._window.share(0)

    def update(self, t_ns: int, alarmed: bool, labels: str = "") -> Notice | None:
        """Feed one scored window: whether the model's verdict was an alarm label
        (``labels``: which, for the reason's words)."""
        w = self._window
        w.push(t_ns, 1 if alarmed else 0)
        if w.quiet and not self.active:
            return None
        share = w.share(0)
        if not self.active and share >= self.on_share and w.covered(t_ns):
            self.active = True
            self.since_ns = t_ns
            self.events += 1
            what = f" (latest: {labels})" if labels else ""
            return Notice(
                STORM,
                "raised",
                t_ns,
                (),
                f"the model alarmed on {share:.0%} of the windows of the last "
                f"{self.horizon_s:g} s{what}",
            )
        if self.active and share <= self.off_share:
            self.active = False
            self.since_ns = None
            return Notice(
                STORM,
                "cleared",
                t_ns,
                (),
                f"the model alarms on {share:.0%} of the windows of the last {self.horizon_s:g} s",
            )
        return None

    def reset(self, t_ns: int, why: str) -> Notice | None:
        was = self.active
        self._window.reset()
        self.active = False
        self.since_ns = None
        return Notice(STORM, "cleared", t_ns, (), why) if was else None

    def snapshot(self) -> dict[str, object]:
        return {
            "active": self.active,
            "share": round(self.share(), 3),
            "since_ns": self.since_ns,
            "events": self.events,
            "horizon_s": self.horizon_s,
            "on_share": self.on_share,
            "off_share": self.off_share,
        }


@dataclass(frozen=True, slots=True)
class HealthSpec:
    """The horizons and shares of both monitors (defaults: the stated ones above; tests
    shorten the horizons to watch a whole episode in seconds)."""

    ood_horizon_s: float = OOD_HORIZON_S
    ood_on_share: float = OOD_ON_SHARE
    ood_off_share: float = OOD_OFF_SHARE
    storm_horizon_s: float = STORM_HORIZON_S
    storm_on_share: float = STORM_ON_SHARE
    storm_off_share: float = STORM_OFF_SHARE


class ModelHealth:
    """The two monitors of one serving model, fed by the reasoning stage per scored window.

    ``bounds`` (:meth:`models.input_stats.InputStats.bounds`, in the model's signal order)
    is None for a model whose manifest has no ``training.input_stats``: then nothing is
    checked for distribution (``snapshot()`` says so) and only storms are watched.
    ``out_mask`` is the compiled kernel (:func:`models.kernels.input_out_mask`) or None for
    the numpy reference.
    """

    __slots__ = ("_bounds", "_kernel", "_stats", "ood", "signals", "storm")

    def __init__(
        self,
        signals: Sequence[str],
        bounds: npt.NDArray[np.float32] | None,
        out_mask: Callable[
            [npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.float32]], int
        ]
        | None = None,
        spec: HealthSpec = HealthSpec(),
    ) -> None:
        self.signals = tuple(signals)
        self._bounds = bounds
        self._kernel = out_mask
        self._stats = np.zeros((len(self.signals), len(STAT_NAMES)), dtype=np.float32)
        self.ood = OodMonitor(
            self.signals,
            horizon_s=spec.ood_horizon_s,
            on_share=spec.ood_on_share,
            off_share=spec.ood_off_share,
        )
        self.storm = StormMonitor(
            horizon_s=spec.storm_horizon_s,
            on_share=spec.storm_on_share,
            off_share=spec.storm_off_share,
        )

    def use_kernel(
        self,
        out_mask: Callable[
            [npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.float32]], int
        ],
    ) -> None:
        """The compiled ``out_mask`` from the next window on (loaded after start)."""
        self._kernel = out_mask

    @property
    def checks_inputs(self) -> bool:
        return self._bounds is not None

    def observe(
        self,
        values: npt.NDArray[np.float32],
        held: npt.NDArray[np.bool_] | None,
        alarm: str | None,
        t_ns: int,
    ) -> list[Notice] | None:
        """One scored window: ``values`` as the model saw it (its signal order), ``held``
        the columns the stage replaced (a dead signal: the dropout rule's, never out of
        distribution), ``alarm`` the model's alarm label or None. Returns the notices (None:
        none, the usual window)."""
        out: list[Notice] | None = None
        bounds = self._bounds
        if bounds is not None:
            k = self._kernel
            if k is not None and values.dtype == np.float32:
                mask = k(values, bounds, self._stats)
            else:
                mask = out_of_training(values, bounds, self._stats)
            if held is not None and mask:
                for i in np.flatnonzero(held).tolist():
                    mask &= ~(1 << i)
            n = self.ood.update(t_ns, mask, self._why)
            if n is not None:
                out = [n]
        n = self.storm.update(t_ns, alarm is not None, alarm or "")
        if n is not None:
            out = [*(out or ()), n]
        return out

    def _why(self, i: int) -> str:
        assert self._bounds is not None
        return why_outside(self._stats[i], self._bounds[i])

    def reset(self, t_ns: int, why: str) -> list[Notice]:
        out = [self.ood.reset(t_ns, why), self.storm.reset(t_ns, why)]
        return [n for n in out if n is not None]

    def snapshot(self) -> dict[str, object]:
        ood: dict[str, object] = {"checked": self.checks_inputs}
        if self.checks_inputs:
            ood.update(self.ood.snapshot())
        else:
            ood["note"] = "the model has no training.input_stats: its inputs are not checked"
        return {"ood": ood, "alarm_storm": self.storm.snapshot()}


__all__ = [
    "OOD",
    "OOD_HORIZON_S",
    "OOD_OFF_SHARE",
    "OOD_ON_SHARE",
    "STORM",
    "STORM_HORIZON_S",
    "STORM_OFF_SHARE",
    "STORM_ON_SHARE",
    "HealthSpec",
    "ModelHealth",
    "Notice",
    "OodMonitor",
    "ShareWindow",
    "StormMonitor",
]
