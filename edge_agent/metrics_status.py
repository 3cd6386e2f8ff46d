"""The agent's status as Prometheus families: what is read, from where, in one table.

:data:`FAMILIES` lists every family the status gives, in exposition order: most are a row
(name, help, kind, where in the status), and the few whose value is computed (health,
modes, quantiles, sources) are small functions in the same list. :func:`families` runs
them against one status snapshot. The status is read defensively: a missing key or a value
that is not a number leaves the sample out and never fails a scrape. How the two sources of
metrics (live histograms, this status) divide the work: :mod:`edge_agent.metrics`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from edge_agent.metrics_health import health_families
from edge_agent.metrics_shape import QUANTILES, SOURCE_ERROR_KEYS
from wire.topics import UPLINK_KINDS

DATA_KINDS = tuple(k for k in UPLINK_KINDS if k != "state")


def status_at(obj: Any, *path: str) -> Any:
    """``obj[path[0]][path[1]]...``, or None where the status lacks a key (never raises)."""
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _number(x: Any) -> float | None:
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, numbers.Real):
        f = float(x)
        return f if math.isfinite(f) else None
    return None


def _items(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield str(k), v


#: ``(label values, raw value)`` pairs; a raw value that is not a number is skipped.
_Samples = Iterable[tuple[Sequence[str], Any]]


class _Out(list[Metric]):
    """The families of one scrape; a family with no numeric sample is left out."""

    def counter(
        self, name: str, doc: str, labels: Sequence[str], samples: _Samples, *, scale: float = 1.0
    ) -> None:
        self._add(CounterMetricFamily(name, doc, labels=labels), samples, scale)

    def gauge(
        self, name: str, doc: str, labels: Sequence[str], samples: _Samples, *, scale: float = 1.0
    ) -> None:
        self._add(GaugeMetricFamily(name, doc, labels=labels), samples, scale)

    def one_counter(self, name: str, doc: str, raw: Any) -> None:
        self.counter(name, doc, (), [((), raw)])

    def one_gauge(self, name: str, doc: str, raw: Any) -> None:
        self.gauge(name, doc, (), [((), raw)])

    def info(self, name: str, doc: str, obj: Any, keys: Sequence[str]) -> None:
        if isinstance(obj, Mapping):
            values = {k: str(obj[k]) for k in keys if obj.get(k) is not None}
            if values:
                fam = InfoMetricFamily(name, doc)
                fam.add_metric([], values)
                self.append(fam)

    def _add(
        self, fam: CounterMetricFamily | GaugeMetricFamily, samples: _Samples, scale: float
    ) -> None:
        for values, raw in samples:
            x = _number(raw)
            if x is not None:
                fam.add_metric(list(values), x * scale)
        if fam.samples:
            self.append(fam)


def _source_up(entry: Mapping[str, Any]) -> Any:
    up = entry.get("up")
    if up is not None:
        return up
    if "state" in entry:
        return entry["state"] in ("open", "playing")
    return entry.get("connected")


def _source_errors(entry: Mapping[str, Any]) -> float | None:
    counts = [_number(entry.get(k)) for k in SOURCE_ERROR_KEYS if k in entry]
    present = [c for c in counts if c is not None]
    return sum(present) if present else None


# -- the table -------------------------------------------------------------------------------

Path = tuple[str, ...]
Kind = Literal["counter", "gauge"]


def _emit(out: _Out, row: One | Fixed | Each, labels: Sequence[str], samples: _Samples) -> None:
    if row.kind == "counter":
        out.counter(row.name, row.doc, labels, samples)
    else:
        out.gauge(row.name, row.doc, labels, samples)


@dataclass(frozen=True, slots=True)
class One:
    """One unlabelled sample, the number at ``path``."""

    name: str
    doc: str
    kind: Kind
    path: Path

    def emit(self, s: Mapping[str, Any], out: _Out) -> None:
        _emit(out, self, (), [((), status_at(s, *self.path))])


@dataclass(frozen=True, slots=True)
class Fixed:
    """One label with a fixed set of values, each sample at its own path."""

    name: str
    doc: str
    kind: Kind
    label: str
    samples: tuple[tuple[str, Path], ...]

    def emit(self, s: Mapping[str, Any], out: _Out) -> None:
        samples = (((v,), status_at(s, *p)) for v, p in self.samples)
        _emit(out, self, (self.label,), samples)


@dataclass(frozen=True, slots=True)
class Each:
    """One label: a sample per entry of the mapping at ``path``, its number at ``key`` in
    the entry (the entry itself for ``()``)."""

    name: str
    doc: str
    kind: Kind
    label: str
    path: Path
    key: Path = ()

    def emit(self, s: Mapping[str, Any], out: _Out) -> None:
        items = _items(status_at(s, *self.path))
        samples = (((k,), status_at(v, *self.key)) for k, v in items)
        _emit(out, self, (self.label,), samples)


@dataclass(frozen=True, slots=True)
class Info:
    """An info family: the string fields ``keys`` of the mapping at ``path``."""

    name: str
    doc: str
    path: Path
    keys: tuple[str, ...]

    def emit(self, s: Mapping[str, Any], out: _Out) -> None:
        out.info(self.name, self.doc, status_at(s, *self.path), self.keys)


def _healthy(s: Mapping[str, Any], out: _Out) -> None:
    health = status_at(s, "agent", "health")
    if isinstance(health, str):
        out.one_gauge("edgefleet_healthy", "1 when the agent says ok.", health == "ok")


def _alarms_active(s: Mapping[str, Any], out: _Out) -> None:
    active = status_at(s, "reasoning", "alarms_active")
    if isinstance(active, Sequence) and not isinstance(active, str):
        out.gauge(
            "edgefleet_alarm_active",
            "1 for every alarm that is up.",
            ["label"],
            (((str(a),), 1) for a in active),
        )


def _model_health(s: Mapping[str, Any], out: _Out) -> None:
    health_families(status_at(s, "reasoning", "model_health"), out)


def _breaker_state(s: Mapping[str, Any], out: _Out) -> None:
    state = status_at(s, "reasoning", "breaker", "state")
    if isinstance(state, str):
        out.one_gauge("edgefleet_breaker_open", "1 while the breaker is open.", state != "closed")
    mode = status_at(s, "reasoning", "breaker", "mode")
    if isinstance(mode, str):
        out.gauge(
            "edgefleet_reasoning_mode",
            "1 for the mode the breaker has reasoning in.",
            ["mode"],
            (((m,), m == mode) for m in sorted({"full", "every_k", "rules_only", mode})),
        )


def _queue_gauges(s: Mapping[str, Any], out: _Out) -> None:
    queues = [("buffer", ("buffer",)), ("memory", ("queues", "memory"))]
    queues.append(("reasoning", ("queues", "reasoning")))
    for key, name, doc in (
        ("depth", "edgefleet_queue_depth", "Items waiting in a bounded queue."),
        ("max", "edgefleet_queue_capacity", "A bounded queue's size."),
        ("high_water", "edgefleet_queue_high_water", "Most items a queue ever held."),
    ):
        out.gauge(name, doc, ["queue"], (((q,), status_at(s, *p, key)) for q, p in queues))


def _gate_lateness(s: Mapping[str, Any], out: _Out) -> None:
    entries = list(_items(status_at(s, "gates", "entries")))
    out.gauge(
        "edgefleet_gate_recent_lateness_seconds",
        "Recent gate lateness quantiles (quantile 1: max).",
        ["entry", "quantile"],
        (((e, q), status_at(v, "lateness_us", key)) for e, v in entries for key, q in QUANTILES),
        scale=1e-6,
    )


def _recent_latency(s: Mapping[str, Any], out: _Out) -> None:
    # The top-level ``latency_us`` where the agent has it, else what the stages report.
    recent: dict[str, Any] = dict(_items(status_at(s, "reasoning", "latency_us")))
    if status_at(s, "memory", "latency_us") is not None:
        recent["memory"] = status_at(s, "memory", "latency_us")
    recent.update(_items(status_at(s, "latency_us")))
    out.gauge(
        "edgefleet_recent_latency_seconds",
        "Latency quantiles over the agent's recent windows (stage e2e: window close to "
        "decision; quantile 1: max).",
        ["stage", "quantile"],
        (((st, q), status_at(v, key)) for st, v in recent.items() for key, q in QUANTILES),
        scale=1e-6,
    )
    out.gauge(
        "edgefleet_recent_latency_samples",
        "Windows the recent latency quantiles are computed over.",
        ["stage"],
        (
            ((st,), status_at(v, "n") if status_at(v, "n") is not None else status_at(v, "count"))
            for st, v in recent.items()
        ),
    )


def _sources(s: Mapping[str, Any], out: _Out) -> None:
    sources = [(k, v) for k, v in _items(status_at(s, "sources")) if isinstance(v, Mapping)]
    out.gauge(
        "edgefleet_source_up",
        "1 while a source has its bus open, its device connected or data flowing.",
        ["source"],
        (((name,), _source_up(v)) for name, v in sources),
    )
    out.counter(
        "edgefleet_source_errors_total",
        "A source's errors: " + ", ".join(SOURCE_ERROR_KEYS) + " (whichever it counts).",
        ["source"],
        (((name,), _source_errors(v)) for name, v in sources),
    )


def _uplink_dropped(s: Mapping[str, Any], out: _Out) -> None:
    """Every data kind, 0 until the outbox drops one: a rate over a series that appears
    only with the first drop would miss it."""
    dropped = status_at(s, "uplink", "dropped")
    if isinstance(dropped, Mapping):
        out.counter(
            "edgefleet_uplink_dropped_total",
            "Messages the outbox dropped (over its cap or unstorable), by kind.",
            ["kind"],
            (((k,), dropped.get(k, 0)) for k in DATA_KINDS),
        )


Family = One | Fixed | Each | Info | Callable[[Mapping[str, Any], "_Out"], None]
_R = ("reasoning",)
_BREAKER = ("reasoning", "breaker")
_MEMORY = ("memory",)
_WRITER = ("memory", "writer")

#: Every family of the status, in exposition order.
FAMILIES: tuple[Family, ...] = (
    Info("edgefleet_agent", "Agent build and event loop.", ("agent",), ("version", "loop")),
    One("edgefleet_uptime_seconds", "Since the agent started.", "gauge", ("agent", "uptime_s")),
    _healthy,
    One("edgefleet_windows_total", "Windows perception emitted.", "counter", ("windows",)),
    One("edgefleet_samples_total", "Samples drained from the buffer.", "counter", ("samples",)),
    One(
        "edgefleet_window_completeness_mean",
        "Mean fraction of fresh cells per window since start.",
        "gauge",
        ("mean_completeness",),
    ),
    Each(
        "edgefleet_decisions_total",
        "Decisions by label (the instantaneous verdict).",
        "counter",
        "label",
        (*_R, "labels"),
    ),
    One("edgefleet_model_runs_total", "Windows the model scored.", "counter", (*_R, "model_runs")),
    One("edgefleet_alarms_raised_total", "Alarms raised.", "counter", (*_R, "alarms_raised")),
    One("edgefleet_alarms_cleared_total", "Alarms cleared.", "counter", (*_R, "alarms_cleared")),
    _alarms_active,
    Fixed(
        "edgefleet_model_swaps_total",
        "Hot swaps of the model, applied or refused.",
        "counter",
        "outcome",
        (("applied", (*_R, "swaps")), ("refused", (*_R, "swaps_refused"))),
    ),
    Info(
        "edgefleet_model",
        "The model serving now, the runtime and kernels it runs on and its known-answer "
        "self-test (passed, absent: no known answers in its manifest).",
        (*_R, "model"),
        ("name", "version", "sha256", "backend", "kernels", "selftest"),
    ),
    _model_health,
    _breaker_state,
    One(
        "edgefleet_breaker_trips_total",
        "Times the breaker opened.",
        "counter",
        (*_BREAKER, "trips"),
    ),
    One(
        "edgefleet_breaker_recoveries_total",
        "Times the breaker closed again.",
        "counter",
        (*_BREAKER, "recoveries"),
    ),
    Fixed(
        "edgefleet_drops_total",
        "What the agent dropped, by where: samples (buffer, late, unknown_signal, "
        "non_finite), windows (skipped_windows, memory_queue, reasoning_queue) and windows "
        "not stored (memory).",
        "counter",
        "where",
        (
            ("buffer", ("buffer", "dropped")),
            ("late", ("perception", "late_dropped")),
            ("unknown_signal", ("perception", "unknown_signal")),
            ("non_finite", ("perception", "non_finite")),
            ("skipped_windows", ("perception", "windows_skipped")),
            ("memory_queue", ("queues", "memory", "dropped")),
            ("reasoning_queue", ("queues", "reasoning", "dropped")),
            ("memory", (*_MEMORY, "dropped_windows")),
        ),
    ),
    _queue_gauges,
    Fixed(
        "edgefleet_budget_overruns_total",
        "Windows on which a stage went over its latency budget.",
        "counter",
        "stage",
        (
            ("perception", ("perception", "budget_overruns")),
            ("reasoning", (*_BREAKER, "overruns")),
        ),
    ),
    Each(
        "edgefleet_gate_runs_total",
        "Gate openings in which a stage ran.",
        "counter",
        "stage",
        ("gates", "stages"),
        ("runs",),
    ),
    Each(
        "edgefleet_gate_skipped_total",
        "Stage turns skipped because an earlier stage of the entry ran past the close.",
        "counter",
        "stage",
        ("gates", "stages"),
        ("skipped",),
    ),
    One("edgefleet_gate_cycles_total", "Gate cycles run.", "counter", ("gates", "cycles")),
    Each(
        "edgefleet_gate_overruns_total",
        "Stage runs that were still working when their gate closed.",
        "counter",
        "stage",
        ("gates", "stages"),
        ("overruns",),
    ),
    Each(
        "edgefleet_gate_openings_total",
        "Times a gate entry opened.",
        "counter",
        "entry",
        ("gates", "entries"),
        ("openings",),
    ),
    Each(
        "edgefleet_gate_missed_total",
        "Gate entries skipped because the scheduler woke up after they had closed.",
        "counter",
        "entry",
        ("gates", "entries"),
        ("missed",),
    ),
    _gate_lateness,
    Each(
        "edgefleet_stage_errors_total",
        "Gate runs of a stage that raised (logged; the stage carries on).",
        "counter",
        "stage",
        ("stages",),
        ("errors",),
    ),
    _recent_latency,
    One("edgefleet_memory_open", "1 while the memory store is open.", "gauge", (*_MEMORY, "open")),
    One(
        "edgefleet_memory_rows_total",
        "State-change rows memory handed to the store writer.",
        "counter",
        (*_MEMORY, "rows"),
    ),
    One(
        "edgefleet_memory_committed_rows_total",
        "Rows the store writer committed.",
        "counter",
        (*_WRITER, "committed_rows"),
    ),
    One(
        "edgefleet_memory_commit_errors_total",
        "Failed commits of the store writer.",
        "counter",
        (*_WRITER, "commit_errors"),
    ),
    One(
        "edgefleet_memory_writer_pending_rows",
        "Rows waiting for the store writer.",
        "gauge",
        (*_WRITER, "pending_rows"),
    ),
    One(
        "edgefleet_memory_writer_max_pending_rows",
        "Rows the writer holds before memory drops windows.",
        "gauge",
        (*_WRITER, "max_pending_rows"),
    ),
    One(
        "edgefleet_memory_ring_windows",
        "Windows in working memory.",
        "gauge",
        (*_MEMORY, "ring", "windows"),
    ),
    Fixed(
        "edgefleet_memory_store_bytes",
        "Memory store file sizes (db, used, free, wal).",
        "gauge",
        "kind",
        tuple((k, (*_MEMORY, "store", f"{k}_bytes")) for k in ("db", "used", "free", "wal")),
    ),
    Each(
        "edgefleet_memory_store_rows",
        "Rows per table of the memory store.",
        "gauge",
        "table",
        (*_MEMORY, "store", "rows"),
    ),
    One(
        "edgefleet_memory_snapshots_total",
        "Snapshots of the memory store taken.",
        "counter",
        (*_MEMORY, "snapshots", "taken"),
    ),
    One(
        "edgefleet_uplink_connected",
        "1 while the uplink is connected to the broker.",
        "gauge",
        ("uplink", "connected"),
    ),
    One(
        "edgefleet_uplink_outbox_rows",
        "Messages in the outbox (unacknowledged, or awaiting the fleet's confirmation).",
        "gauge",
        ("uplink", "outbox_rows"),
    ),
    One(
        "edgefleet_uplink_outbox_bytes", "Bytes in the outbox.", "gauge", ("uplink", "outbox_bytes")
    ),
    One(
        "edgefleet_uplink_inflight",
        "Messages sent, not yet acknowledged.",
        "gauge",
        ("uplink", "inflight"),
    ),
    One("edgefleet_uplink_sent_total", "Messages published.", "counter", ("uplink", "sent")),
    One(
        "edgefleet_uplink_acked_total",
        "Messages the broker acknowledged.",
        "counter",
        ("uplink", "acked"),
    ),
    One(
        "edgefleet_uplink_awaiting_confirmation",
        "Messages the broker acknowledged that the fleet has not confirmed stored yet.",
        "gauge",
        ("uplink", "awaiting_confirmation"),
    ),
    One(
        "edgefleet_uplink_confirmed_total",
        "Messages the fleet confirmed stored (cmd/stored), since start.",
        "counter",
        ("uplink", "confirmed"),
    ),
    One(
        "edgefleet_uplink_resent_total",
        "Messages sent again: acknowledged by the broker, never confirmed by the fleet.",
        "counter",
        ("uplink", "resent"),
    ),
    _uplink_dropped,
    _sources,
    Each(
        "edgefleet_source_restarts_total",
        "Times the agent restarted a failed source.",
        "counter",
        "source",
        ("sources",),
        ("restarts",),
    ),
)


def _with_reasoning_queue(s: Mapping[str, Any]) -> Mapping[str, Any]:
    """``s`` with ``queues.reasoning`` filled from ``reasoning.queue`` (the name the agent
    used before the gate scheduler) when only that is there."""
    if status_at(s, "queues", "reasoning") is not None:
        return s
    old = status_at(s, "reasoning", "queue")
    if old is None:
        return s
    queues = status_at(s, "queues")
    merged = {**(queues if isinstance(queues, Mapping) else {}), "reasoning": old}
    return {**s, "queues": merged}


def new_out() -> _Out:
    """An empty list of families for one scrape."""
    return _Out()


def families(s: Mapping[str, Any], out: _Out) -> None:
    """Every family of :data:`FAMILIES` the status ``s`` gives, in order, into ``out``."""
    s = _with_reasoning_queue(s)
    for fam in FAMILIES:
        if isinstance(fam, One | Fixed | Each | Info):
            fam.emit(s, out)
        else:
            fam(s, out)


__all__ = [
    "FAMILIES",
    "Each",
    "Fixed",
    "Info",
    "One",
    "families",
    "new_out",
    "status_at",
]
