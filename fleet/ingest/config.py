"""What one ingest worker is configured with and what it counts; broker addresses."""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fleet.errors import IngestError
from wire import MAX_PAYLOAD_BYTES

#: Reason classes counted in :attr:`IngestStats.quarantined`.
REASON_CLASSES = (
    "topic",
    "schema",
    "device_mismatch",
    "site_mismatch",
    "unknown_device",
    "store",
    "internal",
)
#: Backoff between retries of a batch the store failed, seconds (jittered, capped).
_BACKOFF_MAX_S = 5.0
#: Consecutive failures of a batch before it is split to isolate a message the store refuses.
SPLIT_AFTER = 3
#: Failures in a row of a lone message, each with the store answering a ping, before it is
#: quarantined although the store never said it refuses it (see _quarantine_refused).
REFUSE_AFTER = 5


def backoff_s(failures: int) -> float:
    """Jittered exponential backoff after ``failures`` in a row, capped at _BACKOFF_MAX_S.

    The exponent is capped too: ``2 ** 1024`` overflows a float, and a store down for
    long enough would otherwise kill the writer thread (nothing stored or acked after).
    """
    return random.uniform(0, min(_BACKOFF_MAX_S, 0.1 * 2 ** min(failures, 16)))


#: The largest MQTT packet the worker accepts (CONNECT Maximum Packet Size).
MAX_PACKET_BYTES = 2 * MAX_PAYLOAD_BYTES
#: Acks not sent by paho's thread within this time are sent by the writer.
ACK_FALLBACK_S = 0.02


@dataclass(frozen=True, slots=True)
class IngestConfig:
    """Everything one worker needs; plain data so it crosses a process boundary."""

    store_url: str
    broker_host: str = "127.0.0.1"
    broker_port: int = 1883
    group: str = "ingest"
    client_id: str = ""
    auto_register: bool = True
    batch_max: int = 500
    batch_ms: int = 50
    #: Messages between paho's thread and the writer; also the MQTT 5 Receive Maximum.
    queue_max: int = 10_000
    #: Longest time paho's thread waits for room in a full queue before it drops a message
    #: (unacked, so redelivered after the reconnect the drop forces).
    full_wait_s: float = 10.0
    session_expiry_s: int = 3600
    keepalive_s: int = 30
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Run ``store.migrate()`` when the writer starts (``serve`` migrates once, then not).
    migrate: bool = True
    #: Write through a store process of its own (see :class:`StoreClient`); False writes
    #: from the writer thread (simpler, about half the throughput).
    store_process: bool = True
    #: A hole in a device's seqs is reported (WARNING, ``gaps``) once it is this old: until
    #: then the messages may still be on their way (see :mod:`fleet.ingest.gapwatch`).
    gap_grace_s: float = 30.0
    #: How often the worker audits the messages received since its last audit; 0: never.
    gap_check_s: float = 5.0
    #: Tell each device which of its seqs are committed (``cmd/stored``, QoS 0), so its
    #: outbox keeps a message until it is stored, not only until the broker has it.
    confirm: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.batch_max <= 100_000:
            raise IngestError(f"batch_max {self.batch_max}: expected 1..100000")
        if not 1 <= self.batch_ms <= 60_000:
            raise IngestError(f"batch_ms {self.batch_ms}: expected 1..60000")
        if not 1 <= self.queue_max <= 65_535:
            raise IngestError(f"queue_max {self.queue_max}: expected 1..65535 (MQTT limit)")
        if not 0 < self.full_wait_s <= 600:
            raise IngestError(f"full_wait_s {self.full_wait_s}: expected 0 < seconds <= 600")
        if not 0 < self.broker_port < 65_536:
            raise IngestError(f"broker port {self.broker_port}: expected 1..65535")
        if not 0 <= self.gap_grace_s <= 86_400:
            raise IngestError(f"gap_grace_s {self.gap_grace_s}: expected 0..86400 seconds")
        if not 0 <= self.gap_check_s <= 3_600:
            raise IngestError(f"gap_check_s {self.gap_check_s}: expected 0..3600 seconds")

    def __repr__(self) -> str:  # the password must never reach a log line
        shown = replace(self, password="***" if self.password else None)
        fields = ", ".join(f"{k}={v!r}" for k, v in asdict(shown).items())
        return f"IngestConfig({fields})"


#: Upper bounds (s) of the ingest lag histogram: a message's time to its commit.
LAG_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0)
#: Upper bounds (s) of the store write histogram: one batch's check and commit.
WRITE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class IngestStats:
    """Counters of one worker. Written by its threads, read by anyone (ints are atomic)."""

    received: int = 0
    stored: int = 0
    #: The same bytes under a key already stored (a redelivery): dropped.
    duplicates: int = 0
    #: Other bytes under a key already stored: quarantined (reason ``conflict: ...``), the
    #: first body kept. Not in ``quarantined``, which counts the checks' refusals.
    conflicts: int = 0
    quarantined: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASON_CLASSES, 0))
    states: int = 0
    batches: int = 0
    acked: int = 0
    #: Dropped by the full queue (unacked, redelivered after a reconnect).
    dropped: int = 0
    #: QoS 0 messages dropped by the full queue: lost (a device sent them at most once).
    dropped_qos0: int = 0
    #: Messages of a lost connection stored after the reconnect, without a PUBACK (their mids
    #: died with it): resent as duplicates by a broker that kept them, kept by the store
    #: when the broker lost them (a crash since its last save).
    held_over: int = 0
    store_retries: int = 0
    #: ``cmd/stored`` messages published to devices after a commit (and failed to publish:
    #: the connection was down; the device sends those rows again).
    confirms: int = 0
    confirm_errors: int = 0
    #: UNIX ns before which this worker has stored what its session held (0: not yet known;
    #: see fleet.ingest.gapwatch). Not summed: fleet serve takes the lowest.
    horizon_ns: int = 0
    connects: int = 0
    #: Holes found in devices' seqs while running (each logged at WARNING), and the seqs
    #: they miss: messages a broker dropped for the ingest (or a device never sent).
    gaps: int = 0
    gap_seqs: int = 0
    #: Attempts to connect to the broker that failed (refused, unresolvable, TLS, CONNACK).
    connect_failures: int = 0
    #: Connected to the broker now (per worker; :meth:`add` leaves it alone).
    connected: bool = False
    #: Why the worker is not connected (the last attempt's failure); None while connected.
    link_error: str | None = None
    last_error: str | None = None
    #: UNIX ns of the first message received and of the last batch committed (rates).
    first_received_ns: int | None = None
    last_commit_ns: int | None = None
    #: Messages waiting in the worker's inbox at its last batch (a gauge: not summed).
    queue_depth: int = 0
    #: Histograms, as counts per bucket of LAG_BUCKETS_S / WRITE_BUCKETS_S (the last is
    #: +Inf) and the sum: a message's lag (stored - its own time) and a batch's commit time.
    lag_counts: list[int] = field(default_factory=lambda: [0] * (len(LAG_BUCKETS_S) + 1))
    lag_sum_s: float = 0.0
    write_counts: list[int] = field(default_factory=lambda: [0] * (len(WRITE_BUCKETS_S) + 1))
    write_sum_s: float = 0.0

    def observe_lags(self, t_ns: Sequence[int], now_ns: int) -> None:
        counts = self.lag_counts
        for t in t_ns:
            lag = max(0.0, (now_ns - t) / 1e9)
            counts[bisect.bisect_left(LAG_BUCKETS_S, lag)] += 1
            self.lag_sum_s += lag

    def observe_write(self, seconds: float) -> None:
        self.write_counts[bisect.bisect_left(WRITE_BUCKETS_S, seconds)] += 1
        self.write_sum_s += seconds

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["quarantined"] = dict(self.quarantined)
        return d

    def add(self, other: IngestStats) -> None:
        for name in ("received", "stored", "duplicates", "conflicts", "states", "batches"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("acked", "dropped", "dropped_qos0", "held_over", "store_retries", "connects"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("gaps", "gap_seqs", "confirms", "confirm_errors"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.connect_failures += other.connect_failures
        self.queue_depth += other.queue_depth
        self.lag_counts = [a + b for a, b in zip(self.lag_counts, other.lag_counts, strict=True)]
        self.lag_sum_s += other.lag_sum_s
        self.write_counts = [
            a + b for a, b in zip(self.write_counts, other.write_counts, strict=True)
        ]
        self.write_sum_s += other.write_sum_s
        for k, v in other.quarantined.items():
            self.quarantined[k] = self.quarantined.get(k, 0) + v
        self.last_error = other.last_error or self.last_error
        firsts = [t for t in (self.first_received_ns, other.first_received_ns) if t is not None]
        lasts = [t for t in (self.last_commit_ns, other.last_commit_ns) if t is not None]
        self.first_received_ns = min(firsts) if firsts else None
        self.last_commit_ns = max(lasts) if lasts else None


def parse_broker(text: str, default_port: int = 1883) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` -> ``(host, port)``. Raises IngestError."""
    host, port_text = text, ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    if not host:
        raise IngestError(f"broker {text!r}: expected host or host:port")
    if not port_text:
        return host, default_port
    try:
        port = int(port_text)
    except ValueError:
        raise IngestError(f"broker {text!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65_536:
        raise IngestError(f"broker {text!r}: port {port} is out of range 1..65535")
    return host, port
