"""Prometheus metrics of one agent: live latency histograms plus its status, read at scrape.

Two sources, never the same number twice:

* **Live histograms**, observed as things happen (the only way to get a distribution that a
  scrape every 15 s does not undersample): per-stage latency, end-to-end latency (window
  close -> decision) and gate lateness. The agent calls :meth:`AgentMetrics.observe_decision`
  and :meth:`AgentMetrics.observe_gate`.
* **Everything the agent already counts** (windows, decisions, drops, overruns, source
  errors, queue depths, memory store sizes, the breaker) is read from its status snapshot
  when Prometheus scrapes (:meth:`AgentMetrics.register_status`), so no counter is kept twice
  and none can drift from ``GET /v1/status``.

Each :class:`AgentMetrics` owns its registry (never the process-global one): tests and
benches run several agents in one process.

The status is read defensively: a key that is missing, or holds something that is not a
number, leaves its metric out; a scrape never fails because the status changed shape (and
if the status function itself raises, the scrape still serves the histograms and counts the
failure in ``edgefleet_status_errors_total``). :class:`StatusLike` lists every key read.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from edge_agent.metrics_health import health_families

log = logging.getLogger(__name__)

STAGES = ("perception", "memory", "reasoning")


def log_buckets(low: float, high: float, per_decade: int = 4) -> tuple[float, ...]:
    """``low`` .. ``high`` (powers of ten apart), ``per_decade`` log-spaced bounds a decade,
    rounded to 3 significant digits so the ``le`` labels stay readable."""
    decades = round(math.log10(high / low))
    return tuple(
        float(f"{low * 10 ** (k / per_decade):.3g}") for k in range(decades * per_decade + 1)
    )


#: 10 µs .. 100 ms: the reasoning budget is ~100 µs, a memory commit stall shows at ms.
STAGE_BUCKETS = log_buckets(10e-6, 100e-3)
#: 100 µs .. 1 s: one gate cycle (~10 ms) of waiting is normal; seconds mean falling behind.
E2E_BUCKETS = log_buckets(100e-6, 1.0)
#: 1 µs .. 10 ms: how late the scheduler opened a gate (event-loop wake-up jitter).
GATE_BUCKETS = log_buckets(1e-6, 10e-3)


# -- the status shape this module reads ------------------------------------------------------
# total=False throughout: every key is optional; what is missing is simply not exported.


class QueueStatus(TypedDict, total=False):
    depth: int
    max: int
    dropped: int
    high_water: int


class LatencyStatus(TypedDict, total=False):
    """Recent latencies in µs (``count`` is memory's name for ``n``)."""

    p50: float
    p99: float
    p999: float
    max: float
    n: int
    count: int


class PerceptionStatus(TypedDict, total=False):
    late_dropped: int
    unknown_signal: int
    non_finite: int
    windows_skipped: int
    budget_overruns: int


class BreakerStatus(TypedDict, total=False):
    state: str  # "closed" | "open"
    mode: str  # "full" | "every_k" | "rules_only"
    trips: int
    recoveries: int
    overruns: int


class ModelStatus(TypedDict, total=False):
    name: str
    version: str
    sha256: str
    backend: str
    kernels: str  # xnnpack | builtin
    selftest: str  # passed | absent | untested (models.selftest)


class ReasoningStatus(TypedDict, total=False):
    enabled: bool
    labels: Mapping[str, int]
    model_runs: int
    alarms_active: Sequence[str]
    alarms_raised: int
    alarms_cleared: int
    breaker: BreakerStatus
    model: ModelStatus
    swaps: int
    swaps_refused: int
    model_health: Mapping[str, Any]  # ood, alarm_storm, acquisition (metrics_health.py)
    queue: QueueStatus  # before the gate scheduler; now ``queues.reasoning``
    latency_us: Mapping[str, LatencyStatus]  # perception, reasoning


class WriterStatus(TypedDict, total=False):
    committed_rows: int
    pending_rows: int
    max_pending_rows: int
    dropped_rows: int
    commit_errors: int


class StoreSizes(TypedDict, total=False):
    """:meth:`edge_agent.memory.store.MemoryStore.sizes` (+ ``rows`` per table of ``stats``)."""

    db_bytes: int
    used_bytes: int
    free_bytes: int
    wal_bytes: int
    rows: Mapping[str, int]


class MemoryStatus(TypedDict, total=False):
    enabled: bool
    open: bool
    rows: int
    dropped_windows: int
    ring: Mapping[str, int]  # windows, capacity
    writer: WriterStatus
    store: StoreSizes  # not in the agent's status yet
    snapshots: Mapping[str, Any]  # taken, failures
    latency_us: LatencyStatus


class GateEntryStatus(TypedDict, total=False):
    openings: int
    missed: int
    lateness_us: LatencyStatus


class GateStageStatus(TypedDict, total=False):
    runs: int
    overruns: int
    skipped: int


class GatesStatus(TypedDict, total=False):
    """:meth:`edge_agent.gates.GateScheduler.snapshot`."""

    cycles: int
    entries: Mapping[str, GateEntryStatus]
    stages: Mapping[str, GateStageStatus]


class AgentInfo(TypedDict, total=False):
    version: str
    loop: str
    uptime_s: float
    health: str


class StatusLike(TypedDict, total=False):
    """The keys :meth:`AgentMetrics.register_status` reads from a status snapshot.

    Based on :meth:`edge_agent.service.Agent.status`. A source's entry is its driver's
    ``stats()`` plus the agent's ``up``/``restarts``; its error count is the sum of the
    counters in :data:`SOURCE_ERROR_KEYS` it has. ``up`` missing: derived from ``state``
    (``open``/``playing``) or ``connected``.
    """

    agent: AgentInfo
    windows: int
    samples: int
    mean_completeness: float
    buffer: QueueStatus
    perception: PerceptionStatus
    queues: Mapping[str, QueueStatus]  # memory, reasoning
    stages: Mapping[str, Mapping[str, int]]  # {stage: {"gate_runs", "errors"}}
    reasoning: ReasoningStatus
    memory: MemoryStatus
    gates: GatesStatus
    latency_us: Mapping[str, LatencyStatus]  # e2e, perception, memory, reasoning
    sources: Mapping[str, Mapping[str, Any]]


#: Counters of the drivers' ``stats()`` that are errors (CAN reader; Modbus poller).
SOURCE_ERROR_KEYS = (
    "bus_errors",
    "errors",
    "timeouts",
    "connection_errors",
    "exception_responses",
    "malformed_lines",
)
_QUANTILES = (("p50", "0.5"), ("p99", "0.99"), ("p999", "0.999"), ("max", "1"))


class AgentMetrics:
    """The agent's Prometheus registry: live histograms and the status collector."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.stage_latency = Histogram(
            "edgefleet_stage_latency_seconds",
            "Time a pipeline stage spent on one window.",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "edgefleet_e2e_latency_seconds",
            "From the instant a window can close (last grid point + lateness) to its decision.",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.gate_lateness = Histogram(
            "edgefleet_gate_lateness_seconds",
            "How late the scheduler opened a gate entry after its scheduled time.",
            ["entry"],
            buckets=GATE_BUCKETS,
            registry=self.registry,
        )
        self.last_label = Gauge(
            "edgefleet_last_decision_label",
            "1 for the label of the latest decision, 0 for labels seen before.",
            ["label"],
            registry=self.registry,
        )
        self.status_errors = Counter(
            "edgefleet_status_errors",
            "Scrapes whose status snapshot raised (the live histograms were still served).",
            registry=self.registry,
        )
        # Children looked up once: labels() takes a lock and a dict lookup per call.
        self._stage = {s: self.stage_latency.labels(stage=s) for s in STAGES}
        self._label: str | None = None
        self._collector: _StatusCollector | None = None

    def observe_decision(
        self, stage_latency_ms: Mapping[str, float], e2e_s: float, label: str
    ) -> None:
        """One decision: its stages' latencies (ms), its end-to-end latency (s), its label.

        A stage at 0.0 ms did not run for this window (disabled, or untimed at shutdown)
        and is not observed: a zero would drag the distribution toward nothing measured.
        A negative or non-finite e2e (the clock stepped back) is not a latency either.
        """
        for stage, child in self._stage.items():
            ms = stage_latency_ms.get(stage)
            if ms is not None and ms > 0.0 and math.isfinite(ms):
                child.observe(ms / 1000.0)
        if e2e_s >= 0.0 and math.isfinite(e2e_s):
            self.e2e_latency.observe(e2e_s)
        if label != self._label:
            if self._label is not None:
                self.last_label.labels(label=self._label).set(0)
            self.last_label.labels(label=label).set(1)
            self._label = label

    def observe_gate(self, entry: str, lateness_s: float) -> None:
        """A gate entry opened ``lateness_s`` after its scheduled time (early counts as 0)."""
        if math.isfinite(lateness_s):
            self.gate_lateness.labels(entry=entry).observe(max(0.0, lateness_s))

    def register_status(self, fn: Callable[[], Mapping[str, Any]]) -> None:
        """Export the status ``fn`` returns at every scrape (see :class:`StatusLike`).

        One status source per agent: a second call replaces the first rather than export
        every family twice.
        """
        if self._collector is not None:
            self.registry.unregister(self._collector)
        self._collector = _StatusCollector(fn, self.status_errors)
        self.registry.register(self._collector)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# -- the status collector ------------------------------------------------------------------


class _StatusCollector:
    def __init__(self, fn: Callable[[], Mapping[str, Any]], errors: Counter) -> None:
        self._fn = fn
        self._errors = errors
        self._logged: set[str] = set()

    def describe(self) -> Iterable[Metric]:
        # The families depend on the status's shape at scrape time; describing none also
        # keeps register() from calling the status function at registration.
        return ()

    def collect(self) -> Iterator[Metric]:
        out = _Out()
        try:
            status = self._fn()
            if isinstance(status, Mapping):
                _families(status, out)
        except Exception as exc:
            # A broken status must not take /metrics down; log each kind of failure once.
            self._errors.inc()
            kind = type(exc).__name__
            if kind not in self._logged:
                self._logged.add(kind)
                log.exception("metrics: the status snapshot failed; exporting what was read")
        yield from out


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


def _families(s: Mapping[str, Any], out: _Out) -> None:
    """Every family :class:`StatusLike` ``s`` gives, in a stable order."""
    agent = status_at(s, "agent")
    out.info("edgefleet_agent", "Agent build and event loop.", agent, ("version", "loop"))
    if isinstance(agent, Mapping):
        out.one_gauge(
            "edgefleet_uptime_seconds",
            "Since the agent started.",
            agent.get("uptime_s"),
        )
        health = agent.get("health")
        if isinstance(health, str):
            out.one_gauge("edgefleet_healthy", "1 when the agent says ok.", health == "ok")

    out.one_counter("edgefleet_windows_total", "Windows perception emitted.", s.get("windows"))
    out.one_counter(
        "edgefleet_samples_total",
        "Samples drained from the buffer.",
        s.get("samples"),
    )
    out.one_gauge(
        "edgefleet_window_completeness_mean",
        "Mean fraction of fresh cells per window since start.",
        s.get("mean_completeness"),
    )

    reasoning = status_at(s, "reasoning")
    out.counter(
        "edgefleet_decisions_total",
        "Decisions by label (the instantaneous verdict).",
        ["label"],
        (((label,), n) for label, n in _items(status_at(reasoning, "labels"))),
    )
    out.one_counter(
        "edgefleet_model_runs_total",
        "Windows the model scored.",
        status_at(reasoning, "model_runs"),
    )
    out.one_counter(
        "edgefleet_alarms_raised_total",
        "Alarms raised.",
        status_at(reasoning, "alarms_raised"),
    )
    out.one_counter(
        "edgefleet_alarms_cleared_total",
        "Alarms cleared.",
        status_at(reasoning, "alarms_cleared"),
    )
    active = status_at(reasoning, "alarms_active")
    if isinstance(active, Sequence) and not isinstance(active, str):
        out.gauge(
            "edgefleet_alarm_active",
            "1 for every alarm that is up.",
            ["label"],
            (((str(a),), 1) for a in active),
        )
    out.counter(
        "edgefleet_model_swaps_total",
        "Hot swaps of the model, applied or refused.",
        ["outcome"],
        [
            (("applied",), status_at(reasoning, "swaps")),
            (("refused",), status_at(reasoning, "swaps_refused")),
        ],
    )
    out.info(
        "edgefleet_model",
        "The model serving now, the runtime and kernels it runs on and its known-answer "
        "self-test (passed, absent: no known answers in its manifest).",
        status_at(reasoning, "model"),
        ("name", "version", "sha256", "backend", "kernels", "selftest"),
    )
    health_families(status_at(reasoning, "model_health"), out)

    breaker = status_at(reasoning, "breaker")
    state = status_at(breaker, "state")
    if isinstance(state, str):
        out.one_gauge(
            "edgefleet_breaker_open",
            "1 while the breaker is open.",
            state != "closed",
        )
    mode = status_at(breaker, "mode")
    if isinstance(mode, str):
        out.gauge(
            "edgefleet_reasoning_mode",
            "1 for the mode the breaker has reasoning in.",
            ["mode"],
            (((m,), m == mode) for m in sorted({"full", "every_k", "rules_only", mode})),
        )
    out.one_counter(
        "edgefleet_breaker_trips_total",
        "Times the breaker opened.",
        status_at(breaker, "trips"),
    )
    out.one_counter(
        "edgefleet_breaker_recoveries_total",
        "Times the breaker closed again.",
        status_at(breaker, "recoveries"),
    )

    queues = status_at(s, "queues")
    reasoning_q = status_at(queues, "reasoning") or status_at(reasoning, "queue")
    memory_q = status_at(queues, "memory")
    memory = status_at(s, "memory")
    out.counter(
        "edgefleet_drops_total",
        "What the agent dropped, by where: samples (buffer, late, unknown_signal, "
        "non_finite), windows (skipped_windows, memory_queue, reasoning_queue) and windows "
        "not stored (memory).",
        ["where"],
        [
            (("buffer",), status_at(s, "buffer", "dropped")),
            (("late",), status_at(s, "perception", "late_dropped")),
            (("unknown_signal",), status_at(s, "perception", "unknown_signal")),
            (("non_finite",), status_at(s, "perception", "non_finite")),
            (("skipped_windows",), status_at(s, "perception", "windows_skipped")),
            (("memory_queue",), status_at(memory_q, "dropped")),
            (("reasoning_queue",), status_at(reasoning_q, "dropped")),
            (("memory",), status_at(memory, "dropped_windows")),
        ],
    )
    queue_list = [
        ("buffer", status_at(s, "buffer")),
        ("memory", memory_q),
        ("reasoning", reasoning_q),
    ]
    for key, name, doc in (
        ("depth", "edgefleet_queue_depth", "Items waiting in a bounded queue."),
        ("max", "edgefleet_queue_capacity", "A bounded queue's size."),
        ("high_water", "edgefleet_queue_high_water", "Most items a queue ever held."),
    ):
        out.gauge(name, doc, ["queue"], (((q,), status_at(v, key)) for q, v in queue_list))

    out.counter(
        "edgefleet_budget_overruns_total",
        "Windows on which a stage went over its latency budget.",
        ["stage"],
        [
            (("perception",), status_at(s, "perception", "budget_overruns")),
            (("reasoning",), status_at(breaker, "overruns")),
        ],
    )
    gates = status_at(s, "gates")
    out.counter(
        "edgefleet_gate_runs_total",
        "Gate openings in which a stage ran.",
        ["stage"],
        (((st,), status_at(v, "runs")) for st, v in _items(status_at(gates, "stages"))),
    )
    out.counter(
        "edgefleet_gate_skipped_total",
        "Stage turns skipped because an earlier stage of the entry ran past the close.",
        ["stage"],
        (((st,), status_at(v, "skipped")) for st, v in _items(status_at(gates, "stages"))),
    )
    out.one_counter("edgefleet_gate_cycles_total", "Gate cycles run.", status_at(gates, "cycles"))
    out.counter(
        "edgefleet_gate_overruns_total",
        "Stage runs that were still working when their gate closed.",
        ["stage"],
        (((st,), status_at(v, "overruns")) for st, v in _items(status_at(gates, "stages"))),
    )
    entries = list(_items(status_at(gates, "entries")))
    out.counter(
        "edgefleet_gate_openings_total",
        "Times a gate entry opened.",
        ["entry"],
        (((e,), status_at(v, "openings")) for e, v in entries),
    )
    out.counter(
        "edgefleet_gate_missed_total",
        "Gate entries skipped because the scheduler woke up after they had closed.",
        ["entry"],
        (((e,), status_at(v, "missed")) for e, v in entries),
    )
    out.gauge(
        "edgefleet_gate_recent_lateness_seconds",
        "Recent gate lateness quantiles (quantile 1: max).",
        ["entry", "quantile"],
        (((e, q), status_at(v, "lateness_us", key)) for e, v in entries for key, q in _QUANTILES),
        scale=1e-6,
    )
    out.counter(
        "edgefleet_stage_errors_total",
        "Gate runs of a stage that raised (logged; the stage carries on).",
        ["stage"],
        (((st,), status_at(v, "errors")) for st, v in _items(status_at(s, "stages"))),
    )

    # Recent latency quantiles: the top-level ``latency_us`` where the agent has it, else
    # what the stages report themselves.
    recent: dict[str, Any] = {}
    for st, v in _items(status_at(reasoning, "latency_us")):
        recent[st] = v
    if status_at(memory, "latency_us") is not None:
        recent["memory"] = status_at(memory, "latency_us")
    recent.update(_items(status_at(s, "latency_us")))
    out.gauge(
        "edgefleet_recent_latency_seconds",
        "Latency quantiles over the agent's recent windows (stage e2e: window close to "
        "decision; quantile 1: max).",
        ["stage", "quantile"],
        (((st, q), status_at(v, key)) for st, v in recent.items() for key, q in _QUANTILES),
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

    out.one_gauge(
        "edgefleet_memory_open",
        "1 while the memory store is open.",
        status_at(memory, "open"),
    )
    out.one_counter(
        "edgefleet_memory_rows_total",
        "State-change rows memory handed to the store writer.",
        status_at(memory, "rows"),
    )
    writer = status_at(memory, "writer")
    out.one_counter(
        "edgefleet_memory_committed_rows_total",
        "Rows the store writer committed.",
        status_at(writer, "committed_rows"),
    )
    out.one_counter(
        "edgefleet_memory_commit_errors_total",
        "Failed commits of the store writer.",
        status_at(writer, "commit_errors"),
    )
    out.one_gauge(
        "edgefleet_memory_writer_pending_rows",
        "Rows waiting for the store writer.",
        status_at(writer, "pending_rows"),
    )
    out.one_gauge(
        "edgefleet_memory_writer_max_pending_rows",
        "Rows the writer holds before memory drops windows.",
        status_at(writer, "max_pending_rows"),
    )
    out.one_gauge(
        "edgefleet_memory_ring_windows",
        "Windows in working memory.",
        status_at(memory, "ring", "windows"),
    )
    store = status_at(memory, "store")
    out.gauge(
        "edgefleet_memory_store_bytes",
        "Memory store file sizes (db, used, free, wal).",
        ["kind"],
        (((k,), status_at(store, f"{k}_bytes")) for k in ("db", "used", "free", "wal")),
    )
    out.gauge(
        "edgefleet_memory_store_rows",
        "Rows per table of the memory store.",
        ["table"],
        (((t,), n) for t, n in _items(status_at(store, "rows"))),
    )
    out.one_counter(
        "edgefleet_memory_snapshots_total",
        "Snapshots of the memory store taken.",
        status_at(memory, "snapshots", "taken"),
    )

    sources = list(_items(status_at(s, "sources")))
    out.gauge(
        "edgefleet_source_up",
        "1 while a source has its bus open, its device connected or data flowing.",
        ["source"],
        (((name,), _source_up(v)) for name, v in sources if isinstance(v, Mapping)),
    )
    out.counter(
        "edgefleet_source_errors_total",
        "A source's errors: " + ", ".join(SOURCE_ERROR_KEYS) + " (whichever it counts).",
        ["source"],
        (((name,), _source_errors(v)) for name, v in sources if isinstance(v, Mapping)),
    )
    out.counter(
        "edgefleet_source_restarts_total",
        "Times the agent restarted a failed source.",
        ["source"],
        (((name,), status_at(v, "restarts")) for name, v in sources),
    )


__all__ = [
    "E2E_BUCKETS",
    "GATE_BUCKETS",
    "SOURCE_ERROR_KEYS",
    "STAGES",
    "STAGE_BUCKETS",
    "AgentMetrics",
    "StatusLike",
    "log_buckets",
]
