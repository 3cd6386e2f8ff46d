"""MQTT ingest: devices' uplink messages -> the fleet store, at least once, idempotently.

An :class:`IngestWorker` is one MQTT v5 client in the shared group
``$share/{group}/edgefleet/v1/+/+/{kind}`` with a persistent session; it batches raw
messages to its store process (checks, rows, one transaction) and PUBACKs a message only
after the transaction holding it committed, so a crash loses nothing and a redelivery is
counted as a duplicate. Bad input is quarantined with its reason and acked; a store outage
is retried, unacked. ``fleet serve`` runs N workers (:mod:`fleet.ingest.serve`) and drains
the sessions none reads any more (:mod:`fleet.ingest.sessions`).
Design: docs/ARCHITECTURE.md, "Uplink and fleet ingest".
"""

from fleet.ingest.checks import BatchOutcome, check_message, process_batch
from fleet.ingest.config import (
    MAX_PACKET_BYTES,
    REASON_CLASSES,
    IngestConfig,
    IngestStats,
    parse_broker,
)
from fleet.ingest.serve import serve
from fleet.ingest.worker import IngestWorker

__all__ = [
    "MAX_PACKET_BYTES",
    "REASON_CLASSES",
    "BatchOutcome",
    "IngestConfig",
    "IngestStats",
    "IngestWorker",
    "check_message",
    "parse_broker",
    "process_batch",
    "serve",
]
