"""MQTT ingest: devices' uplink messages -> the fleet store, at least once, idempotently.

One :class:`IngestWorker` is one MQTT v5 client in the shared-subscription group
``$share/{group}/edgefleet/v1/+/+/{kind}`` with a persistent session (``clean_start=False``,
a session expiry and a stable client id), so messages published while it is down wait at the
broker. Several workers, in threads or processes, on one or many hosts, split the stream;
the store's idempotency on ``(device, boot_id, seq)`` makes any redelivery harmless.
``fleet serve`` records every session it opens and drains those no worker reads any more
(:mod:`fleet.ingest.sessions`, :mod:`fleet.ingest.drain`): the broker keeps handing an
unread session its share of the group's messages.

Delivery into the store::

    paho thread:   on_message -> bounded inbox (a deque; Receive Maximum = its size)
    writer thread: inbox -> batch (up to batch_max; lingers up to batch_ms while small)
                   -> store process: process_batch: check each (topic, schema, device)
                      -> store.ingest(rows), store.quarantine(refused)
    paho thread:   PUBACK each message of the committed batch

Everything per message that is not MQTT (decode, checks, rows, SQL) runs in the store
process, so the worker's own process, whose GIL paho's network thread needs for every
packet it parses, only queues raw payloads and sends them on in batches.

Acks are manual (paho ``manual_ack=True``): a PUBACK leaves only after the transaction that
holds the message committed, so a crash at any point loses nothing; the broker redelivers
what was not acked and the store counts the second copy as a duplicate. A mid is only valid
on its own connection: acks of a lost connection are skipped, but its messages still waiting
are stored: a broker that resumed the session resends them (duplicates), but one SIGKILLed
and restarted from a persistence file older than them has the session and not them.

The inbox is bounded and the broker's flow control (Receive Maximum = inbox size) keeps it
from filling with QoS 1 messages. QoS 0 messages (a device that publishes them) are outside
flow control, and Mosquitto 2.0.11 was seen to overshoot: if the inbox fills anyway, paho's
thread waits for room (TCP backpressure) for up to ``full_wait_s`` (10 s), then drops the
message WITHOUT an ack, counts it in ``dropped`` and reconnects: MQTT 5 redelivers unacked
QoS 1 messages of a persistent session only on a new connection, so a drop loses nothing
but a QoS 0 message (sent at most once by definition) and costs a resync.

Bad input never stops a worker: a message that does not parse, does not fit the schema,
names another device than its topic, comes under another site than the one its device is
registered at (``site mismatch``: a device's site is fixed, the first it was seen at or the
one an operator registered), comes from an unknown device (with auto-registration off) or
trips an unexpected exception is quarantined with its reason and acked. A store
failure (database down) is not bad input: the batch is retried with backoff, unacked, and the
broker keeps holding the messages; a batch that keeps failing is split to find a message the
store refuses, which is then quarantined alone: when the store says it refuses the data
(``StoreRefused``: a constraint, a value it cannot hold), or after it failed that message
five times in a row while answering a ping each time; never during an outage (a database
that is down, or coming back, must not make a good message look bad). Tested with
PostgreSQL cut off for 6 s mid-stream (tests/support/tcp_proxy.py).
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
