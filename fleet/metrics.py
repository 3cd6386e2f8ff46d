"""``fleet serve``'s Prometheus metrics, served at ``/metrics`` by the API.

The ingest's counts come from its workers' stats (summed across worker processes, which
report every second; their histograms travel as counts per fixed bucket, see
:class:`fleet.ingest.config.IngestStats`), the fleet's state (devices online, rollouts by
state) from the store at scrape time, at most every ``STORE_EVERY_S``, and the API's
requests from :meth:`FleetMetrics.observe_request`. Its own registry: nothing global.
Design: docs/ARCHITECTURE.md, "Fleet metrics".
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from fleet.errors import FleetError
from fleet.ingest.config import LAG_BUCKETS_S, WRITE_BUCKETS_S, IngestStats

log = logging.getLogger(__name__)

#: The store is read for the fleet's state at most this often (a scrape every few seconds
#: by several Prometheus servers must not load it).
STORE_EVERY_S = 5.0
_API_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


@dataclass(frozen=True)
class FleetState:
    """What the store says about the fleet now."""

    devices_online: int = 0
    devices_offline: int = 0
    rollouts: dict[str, int] = field(default_factory=dict)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _histogram(
    name: str, doc: str, bounds: tuple[float, ...], counts: list[int], total: float
) -> HistogramMetricFamily:
    cumulative = list(itertools.accumulate(counts))
    buckets = [(repr(b), c) for b, c in zip(bounds, cumulative, strict=False)]
    buckets.append(("+Inf", cumulative[-1]))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class _Collector(Collector):
    def __init__(self, owner: FleetMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        yield from self._owner.ingest_families()
        yield from self._owner.state_families()


class FleetMetrics:
    """The families ``fleet serve`` exports. ``read_state`` reads the store (None: the
    fleet's state is not exported); ``clock`` is monotonic seconds."""

    def __init__(
        self,
        read_state: Callable[[], FleetState] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._read_state = read_state
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: list[IngestStats] = []
        self._configured = 0
        self._state: FleetState | None = None
        self._state_at = float("-inf")
        self._state_errors = 0
        self.api_requests = Counter(
            "fleet_api_requests",
            "API requests answered, by route template and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.api_seconds = Histogram(
            "fleet_api_request_seconds",
            "Time to answer an API request, by route template.",
            ["route"],
            buckets=_API_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_Collector(self))

    # -- inputs ------------------------------------------------------------------------------

    def update_ingest(self, workers: list[IngestStats]) -> None:
        """The latest stats of every ingest worker (fleet serve's loop, each second)."""
        with self._lock:
            self._workers = list(workers)
            self._configured = len(workers)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.api_requests.labels(route, str(status)).inc()
        self.api_seconds.labels(route).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # -- families ----------------------------------------------------------------------------

    def ingest_families(self) -> Iterator[Metric]:
        with self._lock:
            workers, configured = list(self._workers), self._configured
        t = IngestStats()
        for w in workers:
            t.add(w)
        yield _counter(
            "fleet_messages_received", "Uplink messages the ingest received.", t.received
        )
        yield _counter("fleet_messages_stored", "Data messages stored (new rows).", t.stored)
        yield _counter(
            "fleet_messages_duplicate", "Redelivered messages already stored.", t.duplicates
        )
        yield _counter(
            "fleet_messages_conflicts",
            "Messages whose key was stored with another body (quarantined).",
            t.conflicts,
        )
        q = CounterMetricFamily(
            "fleet_messages_quarantined", "Messages refused, by reason.", labels=["reason"]
        )
        for reason, n in sorted(t.quarantined.items()):
            q.add_metric([reason], n)
        yield q
        yield _counter(
            "fleet_messages_dropped",
            "Messages dropped by a full worker queue (unacknowledged: redelivered).",
            t.dropped,
        )
        yield _counter(
            "fleet_messages_dropped_qos0",
            "QoS 0 messages dropped by a full worker queue (lost).",
            t.dropped_qos0,
        )
        yield _counter("fleet_ingest_gaps", "Holes found in devices' seqs.", t.gaps)
        yield _counter(
            "fleet_ingest_gap_messages", "Seqs in the holes found (never arrived).", t.gap_seqs
        )
        yield _counter(
            "fleet_store_retries", "Store batches retried after a failure.", t.store_retries
        )
        yield _counter("fleet_store_batches", "Store transactions committed.", t.batches)
        yield _counter(
            "fleet_ingest_confirms",
            "cmd/stored messages published to devices after a commit.",
            t.confirms,
        )
        yield _histogram(
            "fleet_ingest_lag_seconds",
            "A data message's age when it was stored (now - its own time).",
            LAG_BUCKETS_S,
            t.lag_counts,
            t.lag_sum_s,
        )
        yield _histogram(
            "fleet_store_write_seconds",
            "Time to check and commit one batch.",
            WRITE_BUCKETS_S,
            t.write_counts,
            t.write_sum_s,
        )
        yield GaugeMetricFamily(
            "fleet_ingest_queue_depth", "Messages waiting in the workers' inboxes.", t.queue_depth
        )
        gauge = GaugeMetricFamily(
            "fleet_ingest_workers", "Ingest workers, configured and connected.", labels=["state"]
        )
        gauge.add_metric(["configured"], configured)
        gauge.add_metric(["connected"], sum(1 for s in workers if s.connected))
        yield gauge

    def _fleet_state(self) -> FleetState | None:
        if self._read_state is None:
            return None
        now = self._clock()
        with self._lock:
            if now - self._state_at < STORE_EVERY_S:
                return self._state
            self._state_at = now
        try:
            state = self._read_state()
        except FleetError as exc:
            log.warning("metrics: cannot read the fleet's state: %s", exc)
            with self._lock:
                self._state_errors += 1
                self._state = None
            return None
        with self._lock:
            self._state = state
        return state

    def state_families(self) -> Iterator[Metric]:
        state = self._fleet_state()
        yield _counter(
            "fleet_store_read_errors",
            "Scrapes that could not read the fleet's state from the store.",
            self._state_errors,
        )
        if state is None:
            return
        d = GaugeMetricFamily("fleet_devices", "Registered devices, by state.", labels=["state"])
        d.add_metric(["online"], state.devices_online)
        d.add_metric(["offline"], state.devices_offline)
        yield d
        r = GaugeMetricFamily("fleet_rollouts", "Rollouts, by state.", labels=["state"])
        for name in ("running", "paused", "completed", "halted", "aborted"):
            r.add_metric([name], state.rollouts.get(name, 0))
        yield r


def store_state(url: str) -> Callable[[], FleetState]:
    """A ``read_state`` on the store at ``url`` (its own connection, opened on first use)."""
    from fleet.store import OperatorStore, open_store  # noqa: PLC0415 - drivers on use

    held: list[OperatorStore] = []
    lock = threading.Lock()

    def read() -> FleetState:
        with lock:
            if not held:
                held.append(open_store(url))
            online, offline, rollouts = held[0].fleet_state()
        return FleetState(online, offline, rollouts)

    return read
