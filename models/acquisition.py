"""How each model input reaches perception: the acquisition a model was trained for.

Pure data, shared by training (:mod:`models.dataset` simulates it), the manifest
(``training.acquisition``, written by :mod:`models.train`, read back by
:func:`Acquisition.from_description`), the agent's config (``edge_agent.acquisition`` says
what a config delivers, in the same terms) and the input contract that compares the two
(:mod:`models.contract`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The grid the sample-and-hold text of :meth:`Acquisition.describe` names by default.
DEFAULT_RATE_HZ = 100.0


@dataclass(frozen=True, slots=True)
class SignalAcquisition:
    """How one signal reaches perception: the field-bus source's schedule and encoding.

    A source updates every ``period_ms`` (a CAN frame's cycle, a Modbus poll), its value is
    rounded to ``quantum`` (0: full float32) and saturated to ``[lo, hi]``; with a
    ``deadband`` a value is only sent when it moved by at least that much since the last
    one sent, or ``heartbeat_ms`` after it. Each sample arrives ``jitter_ms`` (mean of an
    exponential delay) after it was read. Signals with the same ``source`` share one
    schedule (one frame, one poll). ``synced``: the source sends on the plant's own update
    tick (a drive's cyclic CAN frame) rather than at an arbitrary time (a poll).

    ``source`` starts with the source's kind (``can``, ``modbus``, ``ideal``): see
    :attr:`kind`. ``period_ms`` is NaN when the config does not say (a DBC message without a
    cycle time): the contract then cannot check the timing and says so.
    """

    source: str
    period_ms: float
    quantum: float = 0.0
    lo: float = -math.inf
    hi: float = math.inf
    deadband: float = 0.0
    heartbeat_ms: float = 0.0
    jitter_ms: float = 0.0
    synced: bool = True

    @property
    def kind(self) -> str:
        """The source's kind: the first word of ``source`` (``can``, ``modbus``, ...)."""
        return self.source.split(" ", 1)[0]

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "source": self.source,
            "period_ms": self.period_ms,
            "quantum": self.quantum,
            "jitter_ms": self.jitter_ms,
        }
        if math.isfinite(self.lo) or math.isfinite(self.hi):
            out["range"] = [self.lo, self.hi]
        if self.deadband:
            out["deadband"] = self.deadband
            out["heartbeat_ms"] = self.heartbeat_ms
        return out

    @classmethod
    def from_description(cls, data: object, where: str) -> SignalAcquisition:
        """The inverse of :meth:`describe`. Raises ValueError naming ``where`` and the key.

        ``synced`` is not recorded: a ``can`` (or ``ideal``) source is, anything else is not.
        """
        d = _obj(data, where)
        known = {"source", "period_ms", "quantum", "jitter_ms", "range", "deadband", "heartbeat_ms"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise _invalid(f"{where}.{unknown[0]}: unknown key; expected one of {sorted(known)}")
        source = d.get("source")
        if not isinstance(source, str) or not source.strip():
            raise _invalid(f"{where}.source: expected a non-empty string; got {source!r}")
        lo, hi = -math.inf, math.inf
        if "range" in d:
            r = d["range"]
            if not isinstance(r, list) or len(r) != 2:
                raise _invalid(f"{where}.range: expected [low, high]; got {r!r}")
            lo = _number(r[0], f"{where}.range[0]")
            hi = _number(r[1], f"{where}.range[1]")
            if lo > hi:
                raise _invalid(f"{where}.range: expected low <= high; got {r!r}")
        deadband = _number(d.get("deadband", 0.0), f"{where}.deadband", minimum=0.0)
        heartbeat = _number(d.get("heartbeat_ms", 0.0), f"{where}.heartbeat_ms", minimum=0.0)
        kind = source.split(" ", 1)[0]
        return cls(
            source=source,
            period_ms=_number(d.get("period_ms"), f"{where}.period_ms", minimum=0.0, strict=True),
            quantum=_number(d.get("quantum", 0.0), f"{where}.quantum", minimum=0.0),
            lo=lo,
            hi=hi,
            deadband=deadband,
            heartbeat_ms=heartbeat,
            jitter_ms=_number(d.get("jitter_ms", 0.0), f"{where}.jitter_ms", minimum=0.0),
            synced=kind in ("can", "ideal"),
        )


@dataclass(frozen=True, slots=True)
class Acquisition:
    """Per-signal :class:`SignalAcquisition` of one deployment, in the model's signal order."""

    name: str
    signals: Mapping[str, SignalAcquisition]

    def describe(self, rate_hz: float = DEFAULT_RATE_HZ) -> dict[str, object]:
        """The manifest's ``training.acquisition`` entry."""
        return {
            "name": self.name,
            "grid": (
                f"sample-and-hold onto the {rate_hz:g} Hz grid as edge_agent.perception "
                "(newest sample arrived at or before each grid point)"
            ),
            "signals": {s: a.describe() for s, a in self.signals.items()},
        }

    @classmethod
    def from_description(cls, data: object, where: str = "training.acquisition") -> Acquisition:
        """The inverse of :meth:`describe`. Raises ValueError naming the key."""
        d = _obj(data, where)
        name = d.get("name", "")
        if not isinstance(name, str):
            raise _invalid(f"{where}.name: expected a string; got {name!r}")
        signals = _obj(d.get("signals"), f"{where}.signals")
        return cls(
            name=name,
            signals={
                s: SignalAcquisition.from_description(a, f"{where}.signals.{s}")
                for s, a in signals.items()
            },
        )


def _invalid(message: str) -> ValueError:
    """A manifest value that is not what it should be (type or range alike): the runtime
    reports every one as ModelRejected, naming the key."""
    return ValueError(message)


def _obj(data: object, where: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise _invalid(f"{where}: expected a JSON object; got {type(data).__name__}")
    return data


def _number(
    value: object, where: str, *, minimum: float | None = None, strict: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(f"{where}: expected a number; got {value!r}")
    x = float(value)
    if math.isnan(x):
        raise _invalid(f"{where}: expected a number; got NaN")
    if minimum is not None and (x < minimum or (strict and x <= minimum)):
        raise _invalid(f"{where}: expected {'>' if strict else '>='} {minimum:g}; got {x!r}")
    return x


__all__ = ["DEFAULT_RATE_HZ", "Acquisition", "SignalAcquisition"]
