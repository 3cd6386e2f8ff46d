"""Health probes: a client's reading pushed through the real stages without changing them.

Pure code, no I/O: :func:`parse_probe` is the only thing that turns the untrusted bytes of a
``POST /v1/health`` body into a :class:`Probe` (every fault is a :class:`ProbeError` naming
where it is); :func:`probe_window` makes a window of it (how, and why it moves the last live
window on by one step: there); :func:`run_probe` times that and the side-effect-free paths of
memory (:meth:`MemoryStage.probe`) and reasoning (:meth:`ReasoningStage.evaluate`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from drivers.sample import Sample
from edge_agent.errors import ProbeError, ProbeTooLarge
from edge_agent.perception import Aligner, PerceptionSpec, Window

if TYPE_CHECKING:
    from edge_agent.memory.stage import MemoryStage
    from edge_agent.reasoning import ReasoningStage

#: Default cap on a probe's body (bytes); the health API's ``max_body_bytes``.
MAX_BODY_BYTES = 65_536
MAX_SENSOR_ID = 128
#: Window values are float32: anything larger would become inf in the window.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_KEYS = ("sensor_id", "timestamp_ns", "payload")
_INT64_MAX = 2**63 - 1
STAGES = ("perception", "memory", "reasoning")


@dataclass(frozen=True, slots=True)
class Probe:
    """One reading a client asks the agent to judge. Only :func:`parse_probe` checks one."""

    sensor_id: str
    timestamp_ns: int
    #: Perception signal -> value, each finite and within float32 range.
    payload: dict[str, float]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The stages' answer to a probe. ``label``/``score`` are None when reasoning is off.

    ``stage_latency_ms`` has every stage of :data:`STAGES`; a stage that did not run
    (disabled in the config) shows 0.0 and is listed in ``skipped``.
    """

    sensor_id: str
    label: str | None
    score: float | None
    stage_latency_ms: Mapping[str, float]
    skipped: tuple[str, ...] = ()
    model_sha256: str | None = None
    top_signals: tuple[tuple[str, float], ...] = ()
    #: How ``top_signals`` were found (``occlusion``, ``keep_one``, ``none``): see Decision.
    attribution: str = "none"
    rules_fired: tuple[tuple[str, str], ...] = ()
    #: Signals stale at the end of the probe window (what the ``dropout`` rule names).
    stale: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: scores to 4 places, latencies to the µs, NaN as None."""
        return {
            "sensor_id": self.sensor_id,
            "label": self.label,
            "score": None if self.score is None else _num(self.score, 4),
            "stage_latency_ms": {k: _num(v, 3) for k, v in self.stage_latency_ms.items()},
            "skipped": list(self.skipped),
            "model_sha256": self.model_sha256,
            "top_signals": [{"signal": s, "contribution": _num(c, 4)} for s, c in self.top_signals],
            "attribution": self.attribution,
            "rules_fired": [{"rule": r, "reason": why} for r, why in self.rules_fired],
            "stale": list(self.stale),
        }


# -- parsing ----------------------------------------------------------------------------------


class _NonFinite:
    """Stands for a ``NaN``/``Infinity`` literal until the path it sits at is known."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


class _Object(dict[str, Any]):
    """A JSON object that remembers the keys it had more than once (json keeps the last)."""

    duplicates: tuple[str, ...] = ()


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dups: list[str] = []
        for k, _ in pairs:
            if k in seen:
                dups.append(k)
            seen.add(k)
        obj.duplicates = tuple(dups)
    return obj


def parse_probe(body: bytes, signals: Sequence[str], *, max_bytes: int = MAX_BODY_BYTES) -> Probe:
    """Check and parse a probe body: ``{"sensor_id", "timestamp_ns", "payload"}``.

    ``sensor_id``: a printable string of 1..128 characters. ``timestamp_ns``: an integer
    (not a float or a boolean) in ``[0, 2**63)``. ``payload``: a non-empty object mapping
    perception ``signals`` to finite numbers. No other keys, no key twice. Raises
    :class:`ProbeTooLarge` over ``max_bytes`` (before parsing anything) and
    :class:`ProbeError` for everything else, naming where and what.
    """
    if len(body) > max_bytes:
        raise ProbeTooLarge("body", f"{len(body)} bytes; at most {max_bytes}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProbeError("body", f"not UTF-8 (byte {exc.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_object, parse_constant=_NonFinite)
    except json.JSONDecodeError as exc:
        raise ProbeError(
            "body", f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise ProbeError("body", "not JSON we accept: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer over Python's 4300-digit conversion limit
        raise ProbeError("body", f"not JSON we accept: {exc}") from None
    if not isinstance(doc, dict):
        raise ProbeError("body", f"expected a JSON object, got {_kind(doc)}")
    _no_duplicates(doc, "")
    unknown = [k for k in doc if k not in _KEYS]
    if unknown:
        raise ProbeError(
            unknown[0],
            f"unknown key(s) {', '.join(map(repr, unknown))}; expected {', '.join(_KEYS)}",
        )
    for key in _KEYS:
        if key not in doc:
            raise ProbeError(key, "required")
    return Probe(
        sensor_id=_sensor_id(doc["sensor_id"]),
        timestamp_ns=_timestamp(doc["timestamp_ns"]),
        payload=_payload(doc["payload"], signals),
    )


def _sensor_id(v: Any) -> str:
    if not isinstance(v, str):
        raise ProbeError("sensor_id", f"expected a string, got {_kind(v)}")
    if not v:
        raise ProbeError("sensor_id", "must not be empty")
    if len(v) > MAX_SENSOR_ID:
        raise ProbeError("sensor_id", f"{len(v)} characters; at most {MAX_SENSOR_ID}")
    if not v.isprintable():
        # It ends up in logs and responses: a newline would forge a log line.
        raise ProbeError("sensor_id", "must be printable (no control characters)")
    return v


def _timestamp(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        hint = " (write it without a decimal point or exponent)" if isinstance(v, float) else ""
        raise ProbeError("timestamp_ns", f"expected an integer (UNIX ns), got {_kind(v)}{hint}")
    if v < 0:
        raise ProbeError("timestamp_ns", f"must be >= 0, got {v}")
    if v >= 2**63:
        raise ProbeError("timestamp_ns", f"must be < 2**63 (int64 ns), got {v}")
    return v


def _payload(v: Any, signals: Sequence[str]) -> dict[str, float]:
    if not isinstance(v, dict):
        raise ProbeError("payload", f"expected an object of signal -> number, got {_kind(v)}")
    _no_duplicates(v, "payload.")
    if not v:
        raise ProbeError("payload", f"must name at least one signal; known: {', '.join(signals)}")
    known = set(signals)
    unknown = [k for k in v if k not in known]
    if unknown:
        raise ProbeError(
            f"payload.{unknown[0]}",
            f"unknown signal(s) {', '.join(map(repr, unknown))}; known: {', '.join(signals)}",
        )
    out: dict[str, float] = {}
    for name, x in v.items():
        where = f"payload.{name}"
        if isinstance(x, _NonFinite):
            raise ProbeError(where, f"{x.text} is not allowed; values must be finite numbers")
        if isinstance(x, bool) or not isinstance(x, int | float):
            raise ProbeError(where, f"expected a number, got {_kind(x)}")
        try:
            f = float(x)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):  # 1e999 parses as inf; so does a huge integer here
            raise ProbeError(where, "not a finite number")
        if abs(f) > _FLOAT32_MAX:
            raise ProbeError(where, f"{f:g} is out of float32 range (|x| <= {_FLOAT32_MAX:.4g})")
        out[name] = f
    return out


def _no_duplicates(obj: dict[str, Any], prefix: str) -> None:
    dups = getattr(obj, "duplicates", ())
    if dups:
        raise ProbeError(f"{prefix}{dups[0]}", "key given more than once")


def _kind(v: Any) -> str:
    if isinstance(v, _NonFinite):
        return v.text
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, int):
        return f"an integer ({v})"
    if isinstance(v, float):
        return f"a float ({v!r})"
    if isinstance(v, str):
        return f"a string ({v[:32]!r})"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _num(x: float, digits: int) -> float | None:
    return round(x, digits) if math.isfinite(x) else None


# -- the window -------------------------------------------------------------------------------


def probe_window(probe: Probe, spec: PerceptionSpec, last: Window | None) -> Window:
    """The window perception makes of ``probe`` (after ``last``); see the module docstring.

    A probe is one reading per signal at one instant, but the model judges a window of
    ``spec.window`` steps, and a window whose every column is flat is exactly what it calls
    ``stuck`` (every signal, score ~1). So when the agent has a last live window (``last``),
    the probe window is that window moved on by one step, the probe's reading as its newest
    row: the verdict answers "what would the agent say if this were the next reading?". A
    signal the payload leaves out keeps the last live row's value; a signal stale at the end
    of ``last`` and not in the payload stays absent (NaN, stale: the ``dropout`` rule names it,
    as it would live). Without ``last`` (nothing perceived yet), each payload value holds over
    the whole window and every other signal is absent; expect ``stuck`` from the model then.

    Every cell becomes a :class:`~drivers.Sample` on its grid point (the probe's own at
    ``timestamp_ns``, which the newest grid point is the first at or after), fed to a fresh
    Aligner, advanced just far enough to emit exactly one window. Fresh: the live Aligner's
    horizon and counters are never touched.
    """
    period, n_rows, n = spec.period_ns, spec.window, len(spec.signals)
    lateness_ns = round(spec.lateness_ms * 1_000_000)
    # The newest grid point is the first at or after the reading, as perception places it.
    # Readings in the last few ms before 2**63 ns (year 2262) are moved back onto the last
    # grid point that still leaves room for the lateness allowance in int64.
    t_ns = min(probe.timestamp_ns, (_INT64_MAX - lateness_ns) // period * period)
    end_ns = -(-t_ns // period) * period
    start_ns = end_ns - (n_rows - 1) * period
    rows = _history(last, spec) if last is not None else None
    if rows is None or np.isnan(rows[0]).all():
        # No usable history (the window would not start at start_ns): every known value,
        # the probe's and the last live row's, holds over the whole window.
        rows = np.full((n_rows, n), np.nan)
        if last is not None and last.values.shape[0]:
            for j, i in _live_columns(last, spec):
                rows[:, j] = last.values[-1, i]
    for j, name in enumerate(spec.signals):
        if name in probe.payload:
            if np.isnan(rows[:-1, j]).all():
                rows[:-1, j] = probe.payload[name]
            rows[-1, j] = math.nan  # the probe's own sample, pushed last at t_ns
    aligner = Aligner(spec)
    # In time order per signal, as a source delivers: its grid rows, then the reading.
    for j, name in enumerate(spec.signals):
        col = rows[:, j]
        ks = np.flatnonzero(~np.isnan(col))
        values = col[ks].tolist()
        times = (start_ns + ks * period).tolist()  # int64 holds them: t_ns was clamped
        aligner.push_many(map(Sample, [name] * len(values), values, times))
        if name in probe.payload:
            aligner.push(Sample(name, probe.payload[name], t_ns))
    windows = aligner.advance(end_ns + lateness_ns)
    if len(windows) != 1:  # pragma: no cover - the grid arithmetic above makes exactly one
        raise AssertionError(f"probe made {len(windows)} windows; expected 1")
    return windows[0]


def _live_columns(last: Window, spec: PerceptionSpec) -> list[tuple[int, int]]:
    """``(spec column, last column)`` of every signal that was fresh at the end of ``last``."""
    where = {name: i for i, name in enumerate(last.signals)}
    out: list[tuple[int, int]] = []
    for j, name in enumerate(spec.signals):
        i = where.get(name)
        if i is not None and not (last.stale.size and bool(last.stale[i])):
            out.append((j, i))
    return out


def _history(last: Window, spec: PerceptionSpec) -> npt.NDArray[np.float64] | None:
    """``last`` moved on by one grid step: its rows 1.. end just before the newest row,
    which holds its last row. Signals stale at its end are left out (NaN)."""
    n_rows = spec.window
    rows = np.full((n_rows, len(spec.signals)), np.nan)
    hist = min(n_rows - 1, int(last.values.shape[0]) - 1)
    if hist < 0:
        return None
    for j, i in _live_columns(last, spec):
        col = last.values[:, i]
        rows[n_rows - 1 - hist : n_rows - 1, j] = col[len(col) - hist :]
        rows[-1, j] = col[-1]
    return rows


# -- running it -------------------------------------------------------------------------------


def run_probe(
    probe: Probe,
    *,
    spec: PerceptionSpec,
    last: Window | None,
    memory: MemoryStage | None,
    reasoning: ReasoningStage | None,
    timer: Callable[[], int] = time.perf_counter_ns,
    now_ns: int,
) -> ProbeResult:
    """Perception, memory and reasoning on ``probe``, each timed, none of them changed.

    Synchronous and cheap (one window's work): the agent calls it on the event loop between
    two windows, so it never races the live path over the stages' state. A ``None`` stage
    is disabled: 0.0 ms and listed in ``skipped``.
    """
    latency = dict.fromkeys(STAGES, 0.0)
    skipped: list[str] = []
    t0 = timer()
    window = probe_window(probe, spec, last)
    latency["perception"] = (timer() - t0) / 1e6
    if memory is not None:
        t0 = timer()
        memory.probe(window, now_ns=now_ns)
        latency["memory"] = (timer() - t0) / 1e6
    else:
        skipped.append("memory")
    stale = tuple(s for s, st in zip(window.signals, window.stale.tolist(), strict=True) if st)
    if reasoning is None:
        return ProbeResult(
            sensor_id=probe.sensor_id,
            label=None,
            score=None,
            stage_latency_ms=latency,
            skipped=(*skipped, "reasoning"),
            stale=stale,
        )
    t0 = timer()
    ev = reasoning.evaluate(window)
    latency["reasoning"] = (timer() - t0) / 1e6
    return ProbeResult(
        sensor_id=probe.sensor_id,
        label=ev.label,
        score=ev.score,
        stage_latency_ms=latency,
        skipped=tuple(skipped),
        model_sha256=ev.model_sha256,
        top_signals=ev.top_signals,
        attribution=ev.attribution,
        rules_fired=tuple((r.rule, r.reason) for r in ev.rules_fired),
        stale=stale,
    )


__all__ = [
    "MAX_BODY_BYTES",
    "STAGES",
    "Probe",
    "ProbeError",
    "ProbeResult",
    "ProbeTooLarge",
    "parse_probe",
    "probe_window",
    "run_probe",
]
