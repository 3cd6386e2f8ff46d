"""The model's input contract: does a config deliver each input the way the model learned it?

A model learns its inputs from one acquisition (``training.acquisition``: period, resolution,
deadband of each source); a signal read another way means something else to its features.
:func:`check_contract` compares, per model signal, the training acquisition with what a
config delivers (``edge_agent.acquisition``) and returns findings (``error`` past the
tolerances, ``note`` for what it cannot check). Pure. The tolerances' evidence:
models/README.md, "Input contract".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from models.acquisition import SignalAcquisition
from models.input_stats import InputStats, SignalInputStats

Severity = Literal["error", "note"]

#: A config period (at least one grid step) may be up to this much longer than the model's.
PERIOD_SLOWER: Final = 1.1
#: ... and down to this fraction of it.
PERIOD_FASTER: Final = 0.95
#: A quantum coarser than the model's may reach this share of the median change it saw.
QUANTUM_OF_STEP: Final = 0.5
#: A deadband on a signal learned without one may reach this share of the median change.
DEADBAND_OF_STEP: Final = 0.3
#: The longest hold a deadband allows may be this much longer than the model's.
HOLD_LONGER: Final = 2.5


@dataclass(frozen=True, slots=True)
class Finding:
    """One difference between what the model learned and what the config delivers.

    ``aspect``: ``missing``, ``period``, ``resolution``, ``deadband``, ``hold``, ``range``,
    ``source`` or ``unchecked``. ``text`` says what the config does, what the model was
    trained for and what it does to decisions; ``str()`` is the one line an operator reads.
    """

    signal: str
    severity: Severity
    aspect: str
    text: str
    #: The same in a few words, for places with little room (an OTA status reason).
    short: str = ""

    def __str__(self) -> str:
        return f"{self.signal}: {self.text}"


def check_contract(
    model: Mapping[str, SignalAcquisition],
    config: Mapping[str, SignalAcquisition | None],
    *,
    grid_ms: float,
    stats: InputStats | None = None,
    where: Mapping[str, str] | None = None,
    units: Mapping[str, str] | None = None,
) -> list[Finding]:
    """Findings for every model signal (``model``: the manifest's acquisition) against what
    ``config`` delivers (None or absent: no source produces it). ``grid_ms`` is the
    perception grid step; ``stats`` the manifest's ``training.input_stats`` (without it,
    resolution and deadband are judged against the model's own values only and the range
    is not checked); ``where`` names the config key of each signal, ``units`` its unit.
    Errors come first, then notes, each in ``model``'s signal order.
    """
    out: list[Finding] = []
    for name, m in model.items():
        c = config.get(name)
        at = (where or {}).get(name, "")
        unit = (units or {}).get(name, "")
        st = stats.signals.get(name) if stats is not None else None
        out.extend(_signal(name, m, c, at=at, unit=unit, grid_ms=grid_ms, stats=st))
    return sorted(out, key=lambda f: f.severity != "error")


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


def _signal(
    name: str,
    m: SignalAcquisition,
    c: SignalAcquisition | None,
    *,
    at: str,
    unit: str,
    grid_ms: float,
    stats: SignalInputStats | None,
) -> list[Finding]:
    u = f" {unit}" if unit else ""
    learned = m.source
    if c is None:
        return [
            Finding(
                name,
                "error",
                "missing",
                f"no source in this config produces it; the model learned it from {learned}: "
                "a never-seen signal reads as held at its normal mean, so windows will look "
                "stuck",
                "not produced",
            )
        ]
    given = at or c.source
    found: list[Finding] = []
    # -- timing --------------------------------------------------------------------------
    if math.isnan(c.period_ms):
        found.append(
            Finding(
                name,
                "note",
                "unchecked",
                f"{given} does not say how often it sends (no cycle time); the model learned a "
                f"value every {m.period_ms:g} ms: the timing is not checked",
                "period unknown",
            )
        )
    else:
        cfg_gap, mod_gap = max(c.period_ms, grid_ms), max(m.period_ms, grid_ms)
        ratio = cfg_gap / mod_gap
        steps = cfg_gap / grid_ms
        if ratio > PERIOD_SLOWER:
            found.append(
                Finding(
                    name,
                    "error",
                    "period",
                    f"windows will look stuck: the model learned a value every "
                    f"{m.period_ms:g} ms ({learned}); {given} gives one every "
                    f"{c.period_ms:g} ms, held for {steps:.3g} grid steps",
                    f"every {c.period_ms:g} ms, learned {m.period_ms:g} ms",
                )
            )
        elif ratio < PERIOD_FASTER:
            held = mod_gap / grid_ms
            found.append(
                Finding(
                    name,
                    "error",
                    "period",
                    f"windows will look noisy: the model learned a value every "
                    f"{m.period_ms:g} ms ({learned}), held for {held:.3g} grid steps; "
                    f"{given} gives a new one every {c.period_ms:g} ms",
                    f"every {c.period_ms:g} ms, learned {m.period_ms:g} ms",
                )
            )
    if c.kind != m.kind:
        found.append(
            Finding(
                name,
                "note",
                "source",
                f"{given} reads it over {c.kind} where the model learned {learned}; at the "
                "same period and resolution that measured harmless",
                f"over {c.kind}, learned {m.kind}",
            )
        )
    # -- resolution ----------------------------------------------------------------------
    median = stats.step_median if stats is not None else 0.0
    allowed_q = max(m.quantum, QUANTUM_OF_STEP * median)
    if c.quantum > allowed_q * (1 + 1e-9) and (allowed_q > 0 or stats is not None):
        typical = f" and typical changes of {median:.3g}{u}" if stats is not None else ""
        learned_q = f"steps of {m.quantum:g}{u}" if m.quantum else "full float precision"
        found.append(
            Finding(
                name,
                "error",
                "resolution",
                f"windows will look stuck: {given} gives values in steps of {c.quantum:g}{u}; "
                f"the model learned {learned_q}{typical}: smaller changes vanish",
                f"steps of {c.quantum:g}, learned {m.quantum:g}",
            )
        )
    # -- deadband and hold ---------------------------------------------------------------
    c_db = c.deadband if c.deadband > c.quantum else 0.0
    m_db = m.deadband if m.deadband > m.quantum else 0.0
    if m_db == 0.0:
        allowed_db = DEADBAND_OF_STEP * median
        if c_db > allowed_db * (1 + 1e-9):
            typical = f" (typical change {median:.3g}{u})" if stats is not None else ""
            found.append(
                Finding(
                    name,
                    "error",
                    "deadband",
                    f"windows will look stuck: {given} has a deadband of {c_db:g}{u}, which "
                    f"holds every change smaller than that; the model learned every change"
                    f"{typical}",
                    f"deadband {c_db:g}, learned none",
                )
            )
    else:
        c_hold, m_hold = _hold_ms(c), _hold_ms(m)
        if c_hold > HOLD_LONGER * m_hold:
            found.append(
                Finding(
                    name,
                    "error",
                    "hold",
                    f"windows will look stuck: {given} can hold a value for up to "
                    f"{c_hold:g} ms (deadband {c_db:g}{u}, heartbeat {c.heartbeat_ms:g} ms, "
                    f"polled every {c.period_ms:g} ms); the model saw at most {m_hold:g} ms",
                    f"held up to {c_hold:g} ms, learned {m_hold:g} ms",
                )
            )
    # -- range ---------------------------------------------------------------------------
    if stats is not None:
        lo, hi = stats.level
        if c.lo > lo or c.hi < hi:
            found.append(
                Finding(
                    name,
                    "error",
                    "range",
                    f"windows will look stuck where it saturates: {given} can only carry "
                    f"{c.lo:g}..{c.hi:g}{u}; the model saw {lo:.4g}..{hi:.4g}{u} in training",
                    f"range {c.lo:g}..{c.hi:g}, saw {lo:.4g}..{hi:.4g}",
                )
            )
    return found


def _hold_ms(a: SignalAcquisition) -> float:
    """The longest a value can stay unsent: the heartbeat rounded up to whole periods."""
    if not a.deadband or math.isnan(a.period_ms) or a.period_ms <= 0:
        return a.period_ms
    return a.period_ms * max(1, math.ceil(a.heartbeat_ms / a.period_ms - 1e-9))


__all__ = [
    "DEADBAND_OF_STEP",
    "HOLD_LONGER",
    "PERIOD_FASTER",
    "PERIOD_SLOWER",
    "QUANTUM_OF_STEP",
    "Finding",
    "Severity",
    "check_contract",
    "errors",
]
