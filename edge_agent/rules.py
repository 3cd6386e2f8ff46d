"""Rules over the model's scores: symbolic constraints, alarm hysteresis, the Decision.

Pure code: values, probabilities and ``now`` come in as arguments; nothing here reads a
clock, a file or a socket. A :class:`ConstraintRule` masks a label (``exclude`` while, or
``require`` unless, a window statistic holds; NaN never excludes and never satisfies); the
built-in ``dropout`` rule names stale signals. Each label's alarm is the small state machine
in :data:`_TRANSITIONS` (clear, raising, raised, clearing; ``raise_after``/``clear_after``
windows), so a score flapping around its threshold raises and clears at most once. Why and
how: ``docs/ARCHITECTURE.md``, section "Reasoning".
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from edge_agent.errors import RulesError
from edge_agent.ood import Notice

Stat = Literal["mean", "min", "max", "last"]
Op = Literal["<", "<=", ">", ">="]
RuleKind = Literal["exclude", "require"]
Mode = Literal["full", "every_k", "rules_only"]

STATS: tuple[Stat, ...] = ("mean", "min", "max", "last")
OPS: tuple[Op, ...] = ("<", "<=", ">", ">=")
#: The label a model must list first: "nothing wrong". It never raises an alarm.
NORMAL = "normal"
#: Name of the built-in stale-signal rule (and of its alarm).
DROPOUT = "dropout"


# -- constraints ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Condition:
    """``signal``'s window ``stat`` compared with ``value`` by ``op``."""

    signal: str
    stat: Stat
    op: Op
    value: float

    def test(self, x: float) -> bool:
        """Whether the condition holds for statistic ``x`` (False for NaN: see module doc)."""
        op = self.op
        if op == "<":
            return x < self.value
        if op == "<=":
            return x <= self.value
        if op == ">":
            return x > self.value
        return x >= self.value

    def __str__(self) -> str:
        return f"{self.signal}.{self.stat} {self.op} {self.value:g}"


@dataclass(frozen=True, slots=True)
class ConstraintRule:
    """Mask ``label`` while ``when`` holds (``exclude``) or while it does not (``require``)."""

    name: str
    kind: RuleKind
    label: str
    when: Condition


@dataclass(frozen=True, slots=True)
class HysteresisSpec:
    """Consecutive windows to raise / clear an alarm, and the gap below the threshold."""

    raise_after: int = 2
    clear_after: int = 3
    margin: float = 0.1

    def __post_init__(self) -> None:
        if self.raise_after < 1 or self.clear_after < 1:
            raise ValueError("raise_after and clear_after must be >= 1")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")


@dataclass(frozen=True, slots=True)
class RuleFiring:
    """One rule that changed or annotated a decision, and why (for the operator)."""

    rule: str
    reason: str


def window_stat(column: npt.NDArray[np.float32], stat: Stat) -> float:
    """``stat`` of one signal's window column, ignoring NaN cells; NaN if none is finite."""
    if stat == "last":
        return float(column[-1])
    # Fast path (the usual case: no NaN). A NaN anywhere makes the plain reduction NaN.
    # min/max: the ufunc reductions ndarray.min/max run, without their Python wrapper.
    if stat == "max":
        x = float(np.maximum.reduce(column))
    elif stat == "min":
        x = float(np.minimum.reduce(column))
    else:
        x = float(column.mean())
    if not math.isnan(x):
        return x
    finite = column[~np.isnan(column)]
    if finite.size == 0:
        return math.nan
    if stat == "mean":
        return float(finite.mean())
    if stat == "min":
        return float(finite.min())
    return float(finite.max())


@dataclass(frozen=True, slots=True)
class RuleSet:
    """Everything configured about rules, independent of any particular model.

    ``thresholds`` overrides the manifest's per-label thresholds; ``top_k`` is how many
    signals a decision names in ``top_signals``. :meth:`compile` binds the set to a model's
    labels and the window's signal columns.
    """

    constraints: tuple[ConstraintRule, ...] = ()
    hysteresis: HysteresisSpec = field(default_factory=HysteresisSpec)
    thresholds: Mapping[str, float] = field(default_factory=dict)
    top_k: int = 3

    def compile(
        self,
        labels: Sequence[str],
        signals: Sequence[str],
        model_thresholds: Mapping[str, float],
    ) -> CompiledRules:
        """Resolve names to indices. Raises :class:`RulesError` naming every unknown label.

        ``labels`` are the model's (``normal`` first); ``signals`` the window's columns.
        """
        errors: list[str] = []
        if not labels or labels[0] != NORMAL:
            errors.append(f"model labels must start with {NORMAL!r}; got {list(labels)}")
        label_index = {name: i for i, name in enumerate(labels)}
        signal_index = {name: i for i, name in enumerate(signals)}
        for label in self.thresholds:
            if label not in label_index or label == NORMAL:
                errors.append(
                    f"reasoning.thresholds.{label}: no such alarm label in the model; "
                    f"expected one of {', '.join(labels[1:])}"
                )
        compiled: list[_CompiledConstraint] = []
        for rule in self.constraints:
            if rule.label not in label_index or rule.label == NORMAL:
                errors.append(
                    f"reasoning.rules {rule.name!r}: label {rule.label!r} is not an alarm label "
                    f"of the model; expected one of {', '.join(labels[1:])}"
                )
                continue
            if rule.when.signal not in signal_index:
                errors.append(
                    f"reasoning.rules {rule.name!r}: signal {rule.when.signal!r} is not a "
                    f"perception signal; expected one of {', '.join(signals)}"
                )
                continue
            compiled.append(
                _CompiledConstraint(rule, label_index[rule.label], signal_index[rule.when.signal])
            )
        if errors:
            raise RulesError("; ".join(errors))
        thresholds = []
        for label in labels:
            t = self.thresholds.get(label, model_thresholds.get(label, 0.5))
            thresholds.append(float(t))
        return CompiledRules(
            labels=tuple(labels),
            signals=tuple(signals),
            thresholds=tuple(thresholds),
            hysteresis=self.hysteresis,
            constraints=tuple(compiled),
            top_k=self.top_k,
        )


class _CompiledConstraint(NamedTuple):
    rule: ConstraintRule
    label: int
    column: int


@dataclass(frozen=True, slots=True)
class CompiledRules:
    """A :class:`RuleSet` bound to one model's labels and the window's columns."""

    labels: tuple[str, ...]
    signals: tuple[str, ...]
    thresholds: tuple[float, ...]
    hysteresis: HysteresisSpec
    constraints: tuple[_CompiledConstraint, ...]
    top_k: int

    def masks(self, values: npt.NDArray[np.float32]) -> tuple[list[bool], list[RuleFiring]]:
        """Which labels are allowed on this window, and the rules that masked one.

        ``values`` is the window (rows = time, columns = :attr:`signals`). Each distinct
        (signal, statistic) is computed once however many rules use it.
        """
        allowed = [True] * len(self.labels)
        fired: list[RuleFiring] = []
        if not self.constraints:
            return allowed, fired
        cache: dict[tuple[int, Stat], float] = {}
        for c in self.constraints:
            cond = c.rule.when
            key = (c.column, cond.stat)
            x = cache.get(key)
            if x is None:
                x = cache[key] = window_stat(values[:, c.column], cond.stat)
            holds = cond.test(x)
            if c.rule.kind == "exclude" and holds:
                allowed[c.label] = False
                fired.append(RuleFiring(c.rule.name, f"{c.rule.label} excluded: {cond} ({x:.4g})"))
            elif c.rule.kind == "require" and not holds:
                allowed[c.label] = False
                fired.append(
                    RuleFiring(c.rule.name, f"{c.rule.label} requires {cond}; got {x:.4g}")
                )
        return allowed, fired

    def winner(self, probs: Sequence[float], allowed: Sequence[bool]) -> tuple[str, float]:
        """The most probable allowed alarm label at or above its threshold, else ``normal``.

        ``normal``'s score is its own probability. The label is the instantaneous verdict;
        alarms (debounced) come from :class:`AlarmTracker`.
        """
        best, best_p = 0, -1.0
        for i in range(1, len(self.labels)):
            p = probs[i]
            if allowed[i] and p >= self.thresholds[i] and p > best_p:
                best, best_p = i, p
        return self.labels[best], float(probs[best])

    def verdict(self, probs: Sequence[float], allowed: Sequence[bool]) -> tuple[str, float, bool]:
        """:meth:`winner`, and whether every alarm label is ``below`` (the quiet window).

        One pass for the hot path: a quiet window needs no :meth:`levels`.
        """
        best, best_p = 0, -1.0
        quiet = True
        margin = self.hysteresis.margin
        thresholds = self.thresholds
        for i in range(1, len(self.labels)):
            if not allowed[i]:
                continue  # a masked label counts as below
            p = probs[i]
            t = thresholds[i]
            if p >= t - margin:
                quiet = False
                if p >= t and p > best_p:
                    best, best_p = i, p
        return self.labels[best], float(probs[best]), quiet

    def levels(self, probs: Sequence[float], allowed: Sequence[bool]) -> dict[str, Level]:
        """The hysteresis event of every alarm label; a masked label counts as ``below``."""
        margin = self.hysteresis.margin
        out: dict[str, Level] = {}
        thresholds = self.thresholds
        for i in range(1, len(self.labels)):
            p = float(probs[i]) if allowed[i] else 0.0
            t = thresholds[i]
            # classify() inlined: this runs for every label on every window.
            out[self.labels[i]] = (
                Level.ABOVE if p >= t else Level.HOLD if p >= t - margin else Level.BELOW
            )
        return out


def dropout_finding(signals: Sequence[str], stale: npt.NDArray[np.bool_]) -> RuleFiring | None:
    """The built-in ``dropout`` rule: a finding naming every stale signal, or None."""
    if not stale.any():
        return None
    names = [s for s, st in zip(signals, stale.tolist(), strict=True) if st]
    return RuleFiring(DROPOUT, "stale: " + ", ".join(names))


# -- hysteresis -------------------------------------------------------------------------------


class Level(enum.Enum):
    """Where a label's score sits relative to its threshold on one window."""

    ABOVE = "above"  # p >= threshold
    HOLD = "hold"  # threshold - margin <= p < threshold: changes nothing once raised
    BELOW = "below"  # p < threshold - margin

    # Members are singletons compared by identity: hash them by identity too, in C. Enum's
    # own __hash__ is a Python call, and the alarm machine hashes members on every window
    # of an alarm (its table lookups) several times.
    __hash__ = object.__hash__


class Phase(enum.Enum):
    CLEAR = "clear"
    RAISING = "raising"  # above for fewer than raise_after windows so far
    RAISED = "raised"
    CLEARING = "clearing"  # raised, below for fewer than clear_after windows so far

    __hash__ = object.__hash__  # as Level's


#: The complete alarm machine (see the module docstring). A counting phase reached again
#: from itself increments its counter; entered from elsewhere it starts at 1.
_TRANSITIONS: Mapping[tuple[Phase, Level], Phase] = {
    (Phase.CLEAR, Level.ABOVE): Phase.RAISING,
    (Phase.CLEAR, Level.HOLD): Phase.CLEAR,
    (Phase.CLEAR, Level.BELOW): Phase.CLEAR,
    (Phase.RAISING, Level.ABOVE): Phase.RAISING,
    # Raising needs *consecutive* windows above: anything else starts over.
    (Phase.RAISING, Level.HOLD): Phase.CLEAR,
    (Phase.RAISING, Level.BELOW): Phase.CLEAR,
    (Phase.RAISED, Level.ABOVE): Phase.RAISED,
    (Phase.RAISED, Level.HOLD): Phase.RAISED,
    (Phase.RAISED, Level.BELOW): Phase.CLEARING,
    (Phase.CLEARING, Level.ABOVE): Phase.RAISED,
    # In the band the alarm is neither confirmed nor quiet: clearing starts over.
    (Phase.CLEARING, Level.HOLD): Phase.RAISED,
    (Phase.CLEARING, Level.BELOW): Phase.CLEARING,
}
#: A counting phase and where it leads once its counter reaches its limit.
_PROMOTE: Mapping[Phase, Phase] = {Phase.RAISING: Phase.RAISED, Phase.CLEARING: Phase.CLEAR}
_ACTIVE = frozenset({Phase.RAISED, Phase.CLEARING})


class AlarmState(NamedTuple):
    phase: Phase = Phase.CLEAR
    streak: int = 0  # windows counted so far in RAISING / CLEARING

    @property
    def active(self) -> bool:
        """Whether the alarm is up (raised, or raised and counting quiet windows)."""
        return self.phase in _ACTIVE


def classify(p: float, threshold: float, margin: float) -> Level:
    """The hysteresis event for probability ``p`` (NaN counts as ``below``)."""
    if p >= threshold:
        return Level.ABOVE
    if p >= threshold - margin:
        return Level.HOLD
    return Level.BELOW


def step(state: AlarmState, level: Level, spec: HysteresisSpec) -> AlarmState:
    """One window of one label's alarm: the table, then the counters."""
    phase = _TRANSITIONS[(state.phase, level)]
    if phase not in _PROMOTE:
        return AlarmState(phase, 0)
    streak = state.streak + 1 if phase == state.phase else 1
    limit = spec.raise_after if phase == Phase.RAISING else spec.clear_after
    if streak >= limit:
        return AlarmState(_PROMOTE[phase], 0)
    return AlarmState(phase, streak)


class AlarmTracker:
    """Per-label alarm states across windows. Mutable, but pure: no clock, no I/O."""

    def __init__(self, spec: HysteresisSpec) -> None:
        self.spec = spec
        self.states: dict[str, AlarmState] = {}
        self.raised_total = 0
        self.cleared_total = 0
        self._active: frozenset[str] = frozenset()
        self._unsettled = 0  # labels whose phase is not CLEAR
        # step() is pure and its states are few (phase x streak below the limits): each
        # (state, level) is computed once.
        self._next: dict[tuple[AlarmState, Level], AlarmState] = {}

    def update(
        self, levels: Mapping[str, Level]
    ) -> tuple[frozenset[str], tuple[str, ...], tuple[str, ...]]:
        """Feed one window's events. Returns (active alarms, raised now, cleared now).

        Labels absent from ``levels`` keep their state (no evidence either way), which is
        what a window without a model run means.
        """
        raised: list[str] = []
        cleared: list[str] = []
        spec = self.spec
        states = self.states
        changed = False
        for label, level in levels.items():
            old = states.get(label, _CLEAR)
            # The usual window: a clear alarm that is not above its threshold stays clear
            # (what step() returns for it, without building the new state).
            if level is not Level.ABOVE and old.phase is Phase.CLEAR:
                continue
            new = self._next.get((old, level))
            if new is None:
                new = self._next[(old, level)] = step(old, level, spec)
            if new is old or new == old:
                continue
            states[label] = new
            self._unsettled += (old.phase is Phase.CLEAR) - (new.phase is Phase.CLEAR)
            changed = True
            if new.active and not old.active:
                raised.append(label)
            elif old.active and not new.active:
                cleared.append(label)
        if changed:
            self._active = frozenset(label for label, s in states.items() if s.active)
        self.raised_total += len(raised)
        self.cleared_total += len(cleared)
        return self._active, tuple(raised), tuple(cleared)

    def active(self) -> frozenset[str]:
        """The labels whose alarm is up."""
        return self._active

    def settled(self) -> bool:
        """Whether every alarm is clear and counting nothing: then a window with every
        level ``below`` changes nothing, and the caller need not call :meth:`update`."""
        return self._unsettled == 0

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the state of every label not in ``keep`` (a swapped-in model lost it)."""
        keep = set(keep)
        for label in [lb for lb in self.states if lb not in keep]:
            del self.states[label]
        self._active = frozenset(label for label, s in self.states.items() if s.active)
        self._unsettled = sum(s.phase is not Phase.CLEAR for s in self.states.values())


_CLEAR = AlarmState()


# -- the decision -----------------------------------------------------------------------------


def _num(x: float, digits: int) -> float | None:
    """A float for JSON: rounded, and None for NaN/inf (JSON has neither)."""
    return round(x, digits) if math.isfinite(x) else None


@dataclass(frozen=True, slots=True)
class Decision:
    """What reasoning concluded about one window, with its provenance.

    ``model_sha256``/``model_version`` name the model that was serving; ``model_ran`` says
    whether it actually scored this window (it does not when the breaker has degraded the
    stage). Without a run, ``label``/``score`` repeat the last scored verdict and
    ``probabilities`` is empty. ``mode`` is the breaker's (``full``, ``every_k``,
    ``rules_only``). ``top_signals`` are (signal, value) pairs, most contributing first;
    ``attribution`` says how they were computed and what the value is: ``occlusion`` (the
    drop of the label's probability without the signal), ``keep_one`` (the label's
    probability with only that signal left as it was, when the cause is joint) or
    ``none``. :meth:`to_json` is the payload published on ``.../decision``.

    The model's health (:mod:`edge_agent.ood`), each absent from :meth:`to_json` when it
    has nothing to say, so older fleets read an ordinary decision as before: ``ood`` names
    the signals out of the training distribution while they are (every model label was
    masked: the label is ``normal`` unless a rule says otherwise); ``alarm_storm``: the
    model alarms on most windows; ``acquisition_mismatch``: the config does not deliver
    the inputs the model was trained for and ``[reasoning] acquisition =
    "accept-mismatch"`` runs it anyway; ``notices``: a change of these on this window.
    """

    trace_id: str
    t_ns: int
    window_seq: int
    window_start_ns: int
    model_sha256: str
    model_version: str
    model_ran: bool
    label: str
    score: float
    probabilities: Mapping[str, float]
    alarms: frozenset[str]
    raised: tuple[str, ...]
    cleared: tuple[str, ...]
    rules_fired: tuple[RuleFiring, ...]
    top_signals: tuple[tuple[str, float], ...]
    attribution: str
    mode: Mode
    stage_latency_ms: Mapping[str, float]
    ood: tuple[str, ...] = ()
    alarm_storm: bool = False
    acquisition_mismatch: bool = False
    notices: tuple[Notice, ...] = ()

    @property
    def degraded(self) -> bool:
        """Whether the breaker had taken the model (partly) out of the loop."""
        return self.mode != "full"

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict: floats rounded (probabilities 4 places, ms to the µs), NaN None."""
        out: dict[str, object] = {
            "trace_id": self.trace_id,
            "t_ns": self.t_ns,
            "window": {"seq": self.window_seq, "start_ns": self.window_start_ns},
            "model": {
                "sha256": self.model_sha256,
                "version": self.model_version,
                "ran": self.model_ran,
            },
            "label": self.label,
            "score": _num(self.score, 4),
            "probabilities": {k: _num(v, 4) for k, v in self.probabilities.items()},
            "alarms": sorted(self.alarms),
            "raised": list(self.raised),
            "cleared": list(self.cleared),
            "rules_fired": [{"rule": r.rule, "reason": r.reason} for r in self.rules_fired],
            "top_signals": [{"signal": s, "contribution": _num(c, 4)} for s, c in self.top_signals],
            "attribution": self.attribution,
            "degraded": self.degraded,
            "mode": self.mode,
            "stage_latency_ms": {k: _num(v, 3) for k, v in self.stage_latency_ms.items()},
        }
        if self.ood:
            out["ood"] = list(self.ood)
        if self.alarm_storm:
            out["alarm_storm"] = True
        if self.acquisition_mismatch:
            out["acquisition_mismatch"] = True
        if self.notices:
            out["notices"] = [n.to_json() for n in self.notices]
        return out


__all__ = [
    "DROPOUT",
    "NORMAL",
    "OPS",
    "STATS",
    "AlarmState",
    "AlarmTracker",
    "CompiledRules",
    "Condition",
    "ConstraintRule",
    "Decision",
    "HysteresisSpec",
    "Level",
    "Mode",
    "Op",
    "Phase",
    "RuleFiring",
    "RuleKind",
    "RuleSet",
    "Stat",
    "classify",
    "dropout_finding",
    "step",
    "window_stat",
]
