"""The shape of the agent's status as the metrics read it (every key optional).

Based on :meth:`edge_agent.service.Agent.status`; :data:`edge_agent.metrics_status.FAMILIES`
says which family each key becomes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

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
#: Status quantile key -> the Prometheus ``quantile`` label.
QUANTILES = (("p50", "0.5"), ("p99", "0.99"), ("p999", "0.999"), ("max", "1"))
