"""Prometheus metrics of one agent: live latency histograms plus its status, read at scrape.

Two sources, never the same number twice: histograms observed as things happen (latencies a
scrape every 15 s would undersample), and every count the agent already keeps, read from its
status snapshot when Prometheus scrapes, so none can drift from ``GET /v1/status``. Each
:class:`AgentMetrics` owns its registry; how a status is read defensively: there.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from edge_agent.metrics_shape import SOURCE_ERROR_KEYS, StatusLike
from edge_agent.metrics_status import families, new_out

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


class AgentMetrics:
    """The agent's Prometheus registry: live histograms and the status collector.

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
    failure in ``edgefleet_status_errors_total``). :class:`StatusLike` lists every key read;
    :data:`edge_agent.metrics_status.FAMILIES` says which family each becomes.
    """

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
        out = new_out()
        try:
            status = self._fn()
            if isinstance(status, Mapping):
                families(status, out)
        except Exception as exc:
            # A broken status must not take /metrics down; log each kind of failure once.
            self._errors.inc()
            kind = type(exc).__name__
            if kind not in self._logged:
                self._logged.add(kind)
                log.exception("metrics: the status snapshot failed; exporting what was read")
        yield from out


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
