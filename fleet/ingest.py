"""MQTT ingest: devices' uplink messages -> the fleet store, at least once, idempotently.

One :class:`IngestWorker` is one MQTT v5 client in the shared-subscription group
``$share/{group}/edgefleet/v1/+/+/{kind}`` with a persistent session (``clean_start=False``,
a session expiry and a stable client id), so messages published while it is down wait at the
broker. Several workers, in threads or processes, on one or many hosts, split the stream;
the store's idempotency on ``(device, boot_id, seq)`` makes any redelivery harmless.

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
on its own connection: acks of a lost connection are skipped (and, when the broker resumed
the session, its unprocessed messages are discarded: the broker resends them all).

The inbox is bounded and the broker's flow control (Receive Maximum = inbox size) keeps it
from filling with QoS 1 messages. QoS 0 messages (a device that publishes them) are outside
flow control, and Mosquitto 2.0.11 was seen to overshoot: if the inbox fills anyway, paho's
thread waits for room (TCP backpressure) for up to ``full_wait_s`` (10 s), then drops the
message WITHOUT an ack, counts it in ``dropped`` and reconnects: MQTT 5 redelivers unacked
QoS 1 messages of a persistent session only on a new connection, so a drop loses nothing
but a QoS 0 message (sent at most once by definition) and costs a resync.

Bad input never stops a worker: a message that does not parse, does not fit the schema,
names another device than its topic, comes from an unknown device (with auto-registration
off) or trips an unexpected exception is quarantined with its reason and acked. A store
failure (database down) is not bad input: the batch is retried with backoff, unacked, and the
broker keeps holding the messages; a batch that keeps failing is split to find a message the
store refuses, which is then quarantined alone: when the store says it refuses the data
(``StoreRefused``: a constraint, a value it cannot hold), or after it failed that message
five times in a row while answering a ping each time; never during an outage (a database
that is down, or coming back, must not make a good message look bad). Tested with
PostgreSQL cut off for 6 s mid-stream (tests/tcp_proxy.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import queue
import random
import signal
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any, Protocol

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from fleet.errors import FleetStoreError, IngestError, MessageRefused, StoreRefused
from fleet.store import IngestResult, Quarantined, Row, Store, open_store, redact_url
from fleet.store.base import QUARANTINE_PAYLOAD_MAX
from wire import MAX_PAYLOAD_BYTES, Message, StateMsg, Topic, WireError, decode, parse_topic
from wire.topics import UPLINK_KINDS, shared_subscription

log = logging.getLogger(__name__)

#: Reason classes counted in :attr:`IngestStats.quarantined`.
REASON_CLASSES = ("topic", "schema", "device_mismatch", "unknown_device", "store", "internal")
#: Backoff between retries of a batch the store failed, seconds (jittered, capped).
_BACKOFF_MAX_S = 5.0
#: Consecutive failures of a batch before it is split to isolate a message the store refuses.
_SPLIT_AFTER = 3
#: Failures in a row of a lone message, each with the store answering a ping, before it is
#: quarantined although the store never said it refuses it (see _quarantine_refused).
_REFUSE_AFTER = 5


def _backoff_s(failures: int) -> float:
    """Jittered exponential backoff after ``failures`` in a row, capped at _BACKOFF_MAX_S.

    The exponent is capped too: ``2 ** 1024`` overflows a float, and a store down for
    long enough would otherwise kill the writer thread (nothing stored or acked after).
    """
    return random.uniform(0, min(_BACKOFF_MAX_S, 0.1 * 2 ** min(failures, 16)))


#: The largest MQTT packet the worker accepts (CONNECT Maximum Packet Size).
MAX_PACKET_BYTES = 2 * MAX_PAYLOAD_BYTES
#: Acks not sent by paho's thread within this time are sent by the writer.
_ACK_FALLBACK_S = 0.02


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
    #: Write through a store process of its own (see :class:`_StoreClient`); False writes
    #: from the writer thread (simpler, about half the throughput).
    store_process: bool = True

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

    def __repr__(self) -> str:  # the password must never reach a log line
        shown = replace(self, password="***" if self.password else None)
        fields = ", ".join(f"{k}={v!r}" for k, v in asdict(shown).items())
        return f"IngestConfig({fields})"


@dataclass
class IngestStats:
    """Counters of one worker. Written by its threads, read by anyone (ints are atomic)."""

    received: int = 0
    stored: int = 0
    duplicates: int = 0
    quarantined: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASON_CLASSES, 0))
    states: int = 0
    batches: int = 0
    acked: int = 0
    #: Dropped by the full queue (unacked, redelivered after a reconnect).
    dropped: int = 0
    #: QoS 0 messages dropped by the full queue: lost (a device sent them at most once).
    dropped_qos0: int = 0
    #: Unprocessed messages of a lost connection discarded on reconnect (the broker resends).
    discarded: int = 0
    store_retries: int = 0
    connects: int = 0
    last_error: str | None = None
    #: UNIX ns of the first message received and of the last batch committed (rates).
    first_received_ns: int | None = None
    last_commit_ns: int | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["quarantined"] = dict(self.quarantined)
        return d

    def add(self, other: IngestStats) -> None:
        for name in ("received", "stored", "duplicates", "states", "batches", "acked"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("dropped", "dropped_qos0", "discarded", "store_retries", "connects"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.quarantined.items():
            self.quarantined[k] = self.quarantined.get(k, 0) + v
        self.last_error = other.last_error or self.last_error
        firsts = [t for t in (self.first_received_ns, other.first_received_ns) if t is not None]
        lasts = [t for t in (self.last_commit_ns, other.last_commit_ns) if t is not None]
        self.first_received_ns = min(firsts) if firsts else None
        self.last_commit_ns = max(lasts) if lasts else None


#: One received message as paho's thread queues it: ``(epoch, mid, qos, topic, payload,
#: received_ns)``; ``epoch`` is the connection the mid belongs to (a mid is only valid on its
#: own connection). A plain tuple, not a dataclass: it is built in paho's thread, the one
#: every other cost of the worker's process competes with for the GIL, and a tuple literal
#: is the cheapest object there is (a frozen dataclass costs ~10 times as much).
_Incoming = tuple[int, int, int, str, bytes, int]


@dataclass(slots=True)
class BatchOutcome:
    """What :func:`process_batch` did with one batch (all of it committed)."""

    inserted: int = 0
    duplicates: int = 0
    states: int = 0
    #: Reason class -> messages quarantined.
    refused: dict[str, int] = field(default_factory=dict)
    #: ``(kind, text)`` of unexpected errors, for the worker to log (once per kind).
    notes: list[tuple[str, str]] = field(default_factory=list)


# Topics repeat (a few per device): caching the parse saves two regex matches per message.
_parse_topic = functools.lru_cache(maxsize=65_536)(parse_topic)


def check_message(topic: str, payload: bytes) -> tuple[Topic, Message]:
    """Parse an uplink message and check topic and payload against each other.

    Pure (no store, no clock). Raises :class:`MessageRefused` naming why and where.
    """
    parsed = _parse_topic(topic)
    if parsed is None or parsed.kind not in UPLINK_KINDS:
        raise MessageRefused("topic", f"topic {topic!r} is not an uplink topic")
    try:
        msg = decode(parsed.kind, payload)
    except WireError as e:
        raise MessageRefused("schema", e.reason, e.where, parsed.device) from None
    if msg.device != parsed.device:
        raise MessageRefused(
            "device_mismatch",
            f"device in payload {msg.device!r} does not match topic device {parsed.device!r}",
            "$.device",
            parsed.device,
        )
    if isinstance(msg, StateMsg) and msg.site != parsed.site:
        raise MessageRefused(
            "device_mismatch",
            f"site in payload {msg.site!r} does not match topic site {parsed.site!r}",
            "$.site",
            parsed.device,
        )
    return parsed, msg


class _Backend(Protocol):
    """The part of :class:`fleet.store.Store` that :func:`process_batch` uses."""

    def ingest(self, rows: Sequence[Row]) -> IngestResult: ...
    def quarantine(self, items: Sequence[Quarantined]) -> None: ...
    def record_state(self, device: str, site: str, state: StateMsg, received_ns: int) -> None: ...
    def ensure_device(
        self, device: str, site: str, received_ns: int, *, auto_register: bool
    ) -> bool: ...


def _classify(
    store: _Backend,
    item: _Incoming,
    known: set[str],
    auto_register: bool,
    notes: list[tuple[str, str]],
) -> Row | None:
    """The Row of a data message, ``None`` for a state message already recorded.

    Raises MessageRefused for anything to quarantine. Store errors propagate (retry the batch).
    """
    _, _, _, topic, payload, received_ns = item
    try:
        parsed, msg = check_message(topic, payload)
    except MessageRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - a bug of ours must not stop ingest
        notes.append((f"internal:{type(exc).__name__}", f"unexpected error on {topic}"))
        found = parse_topic(topic) if isinstance(topic, str) else None
        raise MessageRefused(
            "internal",
            f"internal error: {type(exc).__name__}",
            "$",
            found.device if found else None,
        ) from None
    # With auto-registration on, the batch's own upsert (ingest or record_state) registers a
    # new device in the same transaction: no separate write per new device. Off, a device
    # must exist: looked up once, then remembered.
    if not auto_register and parsed.device not in known:
        if not store.ensure_device(parsed.device, parsed.site, received_ns, auto_register=False):
            raise MessageRefused(
                "unknown_device",
                f"unknown device {parsed.device!r} (auto-registration is off)",
                "$",
                parsed.device,
            )
        known.add(parsed.device)
    if isinstance(msg, StateMsg):
        store.record_state(parsed.device, parsed.site, msg, received_ns)
        return None
    return Row(
        msg.device, parsed.site, parsed.kind, msg.boot_id, msg.seq, msg.t_ns, payload, received_ns
    )


def process_batch(
    store: _Backend, items: Sequence[_Incoming], known: set[str], *, auto_register: bool
) -> BatchOutcome:
    """Check every message of a batch, store the good ones in one transaction, quarantine the
    rest. Returns once all of it is committed; a store failure raises (nothing to ack).

    ``known`` holds devices already found registered (only consulted with auto-registration
    off); the caller keeps it between batches.
    """
    out = BatchOutcome()
    rows: list[Row] = []
    refused: list[Quarantined] = []
    for item in items:
        try:
            row = _classify(store, item, known, auto_register, out.notes)
        except MessageRefused as r:
            refused.append(
                Quarantined(
                    item[3], item[4][:QUARANTINE_PAYLOAD_MAX], r.reason, r.where, item[5], r.device
                )
            )
            out.refused[r.cls] = out.refused.get(r.cls, 0) + 1
            continue
        if row is None:
            out.states += 1
        else:
            rows.append(row)
    if rows:
        result = store.ingest(rows)
        out.inserted, out.duplicates = result.inserted, result.duplicates
    if refused:
        store.quarantine(refused)
    return out


class _StoreOps(Protocol):
    """What the writer thread uses: a :class:`_StoreClient` or a :class:`_DirectStore`."""

    def process(self, items: Sequence[_Incoming], *, auto_register: bool) -> BatchOutcome: ...
    def quarantine(self, items: Sequence[Quarantined]) -> None: ...
    def ping(self) -> None: ...
    def close(self) -> None: ...


class _DirectStore:
    """:func:`process_batch` on a store in the writer's own thread (``store_process=False``)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._known: set[str] = set()

    def process(self, items: Sequence[_Incoming], *, auto_register: bool) -> BatchOutcome:
        return process_batch(self._store, items, self._known, auto_register=auto_register)

    def quarantine(self, items: Sequence[Quarantined]) -> None:
        self._store.quarantine(items)

    def ping(self) -> None:
        self._store.ping()

    def close(self) -> None:
        self._store.close()


def _store_server(url: str, migrate: bool, conn: Connection) -> None:
    """The store process: one Store, requests over ``conn``, one reply per request."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    try:
        store = open_store(url)
        if migrate:
            store.migrate()
    except Exception as exc:  # noqa: BLE001 - sent to the parent, which raises it
        conn.send(("err", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", None))
    known: set[str] = set()
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            if request is None:
                return
            method, args = request
            if method not in ("batch", "quarantine", "ping"):
                conn.send(("err", f"unknown store request {method!r}"))
                continue
            try:
                result: object = None
                if method == "batch":
                    items, auto = args
                    out = process_batch(store, items, known, auto_register=auto)
                    result = (out.inserted, out.duplicates, out.states, out.refused, out.notes)
                elif method == "ping":
                    store.ping()
                else:
                    store.quarantine([Quarantined(*t) for t in args])
            except StoreRefused as exc:  # the parent raises it again as a refusal
                conn.send(("refused", str(exc)))
            except Exception as exc:  # noqa: BLE001 - every failure goes back as text
                conn.send(("err", f"{type(exc).__name__}: {exc}"))
            else:
                conn.send(("ok", result))
    finally:
        store.close()


class _StoreClient:
    """The store, run in a process of its own, called synchronously over a pipe; the checks
    of every message (:func:`process_batch`) run there too.

    Why: the worker's process is bound by one GIL, and paho's network thread needs it for
    every packet it parses. Written from that process, the SQLite and PostgreSQL drivers
    release the GIL around every row and then wait to take it back (a row cost ~100 us
    instead of ~10 us); decoding and checking payloads there took the GIL from paho for
    about half as long again as paho itself held it. Over the pipe, the writer thread only
    pickles the raw tuples (a few us per batch of bytes) and sleeps, GIL released, while
    the store process decodes, checks and writes on the other core.

    A failed call raises FleetStoreError (the batch is retried); a dead store process is
    started again on the next call.
    """

    def __init__(self, url: str, *, migrate: bool) -> None:
        self._url = url
        self._migrate = migrate
        self._ctx = multiprocessing.get_context("spawn")
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._start()

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_store_server, args=(self._url, self._migrate, child), daemon=True
        )
        proc.start()
        child.close()
        status, detail = parent.recv() if parent.poll(60) else ("err", "no answer in 60 s")
        if status != "ok":
            proc.kill()
            parent.close()
            raise FleetStoreError(f"store process for {redact_url(self._url)}: {detail}")
        self._proc, self._conn = proc, parent
        self._migrate = False  # migrated once; a restart need not

    def _call(self, method: str, args: object) -> object:
        if self._conn is None:
            self._start()
        assert self._conn is not None
        try:
            self._conn.send((method, args))
            status, result = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._drop()
            raise FleetStoreError(f"store process died during {method}: {exc}") from None
        if status == "refused":
            raise StoreRefused(str(result))
        if status != "ok":
            raise FleetStoreError(str(result))
        return result

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        self._conn = self._proc = None

    def process(self, items: Sequence[_Incoming], *, auto_register: bool) -> BatchOutcome:
        result = self._call("batch", (items, auto_register))
        assert isinstance(result, tuple)
        inserted, duplicates, states, refused, notes = result
        return BatchOutcome(int(inserted), int(duplicates), int(states), refused, notes)

    def quarantine(self, items: Sequence[Quarantined]) -> None:
        self._call(
            "quarantine",
            [(q.topic, q.payload, q.reason, q.where, q.received_ns, q.device) for q in items],
        )

    def ping(self) -> None:
        self._call("ping", None)

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            if self._proc is not None:
                self._proc.join(10)
        self._drop()


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


class IngestWorker:
    """One ingest client: paho's network thread, a writer thread, and (by default) a store
    process of its own (:class:`_StoreClient`).

    ``start()`` returns once the writer thread runs; the MQTT connection is made and remade
    in the background (jittered backoff). ``stop()`` commits and acks what it holds, then
    disconnects; anything unacked is redelivered to the group later.
    """

    def __init__(self, config: IngestConfig) -> None:
        self.config = config
        self.stats = IngestStats()
        self.client_id = config.client_id or f"fleet-ingest-{socket.gethostname()}"
        # A deque, not queue.Queue: append/popleft are atomic under the GIL and cost a
        # fraction of Queue's lock and condition per message. Bounded by the check in
        # _on_message (only paho's thread appends), woken through _wake.
        self._inbox: deque[_Incoming] = deque()
        self._wake = threading.Event()
        self._space = threading.Event()
        #: Committed messages waiting for their PUBACK, and since when (monotonic).
        self._acks: deque[_Incoming] = deque()
        self._acks_since = 0.0
        self._ack_lock = threading.Lock()
        self._epoch = 0
        #: Messages of connections before this one are skipped by the writer (resent).
        self._discard_before = 0
        self._stopping = threading.Event()
        self._resync = threading.Event()
        self._ready = threading.Event()
        self._subscribed = threading.Event()
        self._writer: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self._logged: set[str] = set()
        self._queue_max = config.queue_max
        self._client = self._make_client()

    # --- MQTT side (paho's thread) -------------------------------------------------------

    def _make_client(self) -> mqtt.Client:
        cfg = self.config
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=mqtt.MQTTv5,
            manual_ack=True,
        )
        if cfg.username is not None:
            client.username_pw_set(cfg.username, cfg.password)
        if cfg.tls_ca or cfg.tls_cert:
            client.tls_set(
                ca_certs=cfg.tls_ca,
                certfile=cfg.tls_cert,
                keyfile=cfg.tls_key,
                tls_version=ssl.PROTOCOL_TLS_CLIENT,
            )
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        # Retry every second, no growing backoff: Mosquitto (2.0.11 tested) restores a
        # persistent session after a restart but NOT its shared subscriptions, so until we
        # resubscribe, messages published to the group are routed to nobody and lost. The
        # ingest must be back before the devices are (they back off for longer).
        client.reconnect_delay_set(min_delay=1, max_delay=1)
        return client

    def _connect_properties(self) -> Properties:
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = self.config.session_expiry_s
        # Flow control: the broker never has more unacked messages out to us than the queue
        # holds, so the queue cannot overflow while the writer is slow or the store is down.
        props.ReceiveMaximum = self.config.queue_max
        # Memory: the queue counts messages, not bytes, and a broker may allow far larger
        # packets (Mosquitto: 256 MB). Up to twice the contract's limit still reaches us and
        # is quarantined with its size; beyond, the broker drops it for this client.
        props.MaximumPacketSize = MAX_PACKET_BYTES
        return props

    def _on_connect(
        self,
        client: mqtt.Client,
        userdata: object,
        flags: mqtt.ConnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if reason_code.is_failure:
            self._note("connect", f"broker refused the connection: {reason_code}")
            return
        # Under the ack lock: the writer must never ack an old connection's mid on this one.
        with self._ack_lock:
            self._epoch += 1
            if flags.session_present:
                # The broker resends every unacked message of the session (MQTT 5 4.4.0-1):
                # what still waits here from the old connection would only be stored twice.
                self._discard_before = self._epoch
        self.stats.connects += 1
        client.subscribe([(t, 1) for t in shared_subscription(self.config.group)])
        log.info(
            "ingest %s connected to %s:%d (session present: %s)",
            self.client_id,
            self.config.broker_host,
            self.config.broker_port,
            flags.session_present,
        )

    def _on_subscribe(
        self,
        client: mqtt.Client,
        userdata: object,
        mid: int,
        reason_codes: list[ReasonCode],
        properties: Properties | None,
    ) -> None:
        refused = [str(rc) for rc in reason_codes if rc.is_failure]
        if refused:
            self._note("subscribe", f"broker refused the subscriptions: {', '.join(refused)}")
        else:
            self._subscribed.set()

    def wait_ready(self, timeout: float) -> bool:
        """True once the broker granted the group subscriptions (first connection)."""
        return self._subscribed.wait(timeout)

    def _on_disconnect(
        self,
        client: mqtt.Client,
        userdata: object,
        flags: mqtt.DisconnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        # Acks for messages of the lost connection would name mids of the next one: bump the
        # epoch so the writer skips them (the broker redelivers them instead).
        with self._ack_lock:
            self._epoch += 1
        if not self._stopping.is_set():
            log.warning("ingest %s disconnected: %s", self.client_id, reason_code)

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        if self._stopping.is_set():
            # Left unacked: the broker keeps it for this session. Taking more while stopping
            # would keep the writer (and stop()) busy for as long as traffic flows.
            return
        # Every line here runs once per message in the thread that bounds the worker's
        # rate (see _StoreClient): keep it to queueing.
        stats = self.stats
        now = time.time_ns()
        stats.received += 1
        if stats.first_received_ns is None:
            stats.first_received_ns = now
        if self._acks:
            self._flush_acks()
        try:
            topic = msg.topic
        except UnicodeDecodeError:
            topic = repr(msg._topic)  # paho refuses to decode it for us
        item = (self._epoch, msg.mid, msg.qos, topic, bytes(msg.payload), now)
        if len(self._inbox) >= self._queue_max and not self._wait_for_space():
            if msg.qos == 0:
                # Sent at most once: no reconnect brings it back, so none is forced.
                self.stats.dropped_qos0 += 1
                return
            # Unacked, so the broker still owes it to us: it is redelivered after the
            # reconnect that _do_resync forces.
            self.stats.dropped += 1
            self._resync.set()
            return
        self._inbox.append(item)
        if not self._wake.is_set():
            self._wake.set()

    def _wait_for_space(self) -> bool:
        """Backpressure: hold paho's thread (so it stops reading the socket and TCP holds the
        broker) until the writer frees room, for at most ``config.full_wait_s``.

        Receive Maximum keeps QoS 1 messages from filling the inbox (Mosquitto 2.0.11 was
        seen to send past it); QoS 0 messages are outside its count. Cannot deadlock: the
        writer frees room by taking messages, which does not need paho's thread (acks are
        only queued for it)."""
        deadline = time.monotonic() + self.config.full_wait_s
        while len(self._inbox) >= self.config.queue_max:
            if time.monotonic() > deadline or self._stopping.is_set():
                return False
            self._space.wait(0.01)
            self._space.clear()
        return True

    # --- lifecycle -----------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Open and migrate the store, start the writer, start connecting to the broker."""
        self._writer = threading.Thread(
            target=self._writer_main, name=f"ingest-writer-{self.client_id}", daemon=True
        )
        self._writer.start()
        if not self._ready.wait(timeout):
            raise IngestError(f"ingest {self.client_id}: store did not open within {timeout} s")
        if self._start_error is not None:
            raise self._start_error
        self._client.connect_async(
            self.config.broker_host,
            self.config.broker_port,
            keepalive=self.config.keepalive_s,
            clean_start=False,
            properties=self._connect_properties(),
        )
        self._client.loop_start()

    def stop(self, timeout: float = 30.0) -> None:
        """Flush and ack what is held, then disconnect (the session stays at the broker)."""
        self._stopping.set()
        if self._writer is not None:
            self._writer.join(timeout)
        self._client.disconnect()
        self._client.loop_stop()

    def __enter__(self) -> IngestWorker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- writer thread -------------------------------------------------------------------

    def _writer_main(self) -> None:
        store: _StoreOps
        try:
            if self.config.store_process:
                store = _StoreClient(self.config.store_url, migrate=self.config.migrate)
            else:
                direct = open_store(self.config.store_url)
                if self.config.migrate:
                    direct.migrate()
                store = _DirectStore(direct)
        except BaseException as exc:  # noqa: BLE001 - re-raised by start() in its thread
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._writer_loop(store)
        finally:
            store.close()

    def _writer_loop(self, store: _StoreOps) -> None:
        inbox = self._inbox
        batch_s = self.config.batch_ms / 1000
        batch_max = self.config.batch_max
        while True:
            if self._resync.is_set():
                self._do_resync()
            if self._acks and time.monotonic() - self._acks_since > _ACK_FALLBACK_S:
                self._flush_acks()
            if not inbox:
                self._wake.clear()
                if not inbox:  # re-check: paho may have appended before the clear
                    if self._stopping.is_set():
                        self._flush_acks()
                        return
                    self._wake.wait(_ACK_FALLBACK_S if self._acks else 0.1)
                    continue
            # Group commit: take what is waiting (up to batch_max); linger up to batch_ms
            # for more only while the batch is small, so a trickle is stored at once and a
            # flood is stored in big transactions.
            batch: list[_Incoming] = []
            deadline = time.monotonic() + batch_s
            while len(batch) < batch_max:
                try:
                    item = inbox.popleft()
                except IndexError:
                    pass
                else:
                    if item[0] >= self._discard_before:
                        batch.append(item)
                    else:
                        self.stats.discarded += 1
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or len(batch) >= batch_max // 10 or self._stopping.is_set():
                    break
                self._wake.clear()
                if not inbox:
                    self._wake.wait(min(left, 0.005))
            self._space.set()
            if batch:
                self._commit_with_retry(store, batch)

    def _do_resync(self) -> None:
        self._resync.clear()
        self._note("dropped", "internal queue full: dropped unacked messages; reconnecting")
        # A forced reconnect makes the broker redeliver every unacked message (MQTT 5 4.4).
        sock = self._client.socket()
        if sock is not None:
            sock.close()

    def _commit_with_retry(self, store: _StoreOps, batch: list[_Incoming]) -> None:
        """Commit ``batch``, retrying with backoff until it is stored (or, stopping, left
        unacked for the broker to redeliver). After a few failures a batch is split and
        each message retried alone, so one bad message cannot hold the others back; a lone
        message is quarantined only when the store refuses it (``_quarantine_refused``)."""
        failures = answered = 0
        while True:
            try:
                self._commit(store, batch)
                return
            except Exception as exc:  # noqa: BLE001 - any store failure: retry, then split
                failures += 1
                self.stats.store_retries += 1
                self._note(f"store:{type(exc).__name__}", f"store failed a batch: {exc}")
                error = exc
            # A refusal is the data's, not the moment's: no point retrying the same rows.
            refused = isinstance(error, StoreRefused)
            if self._stopping.is_set() and failures >= _SPLIT_AFTER:
                return  # unacked: the broker redelivers to the group
            if refused or failures >= _SPLIT_AFTER:
                if len(batch) > 1:
                    for item in batch:
                        self._commit_with_retry(store, [item])
                    return
                if not refused:
                    answered = answered + 1 if self._store_answers(store) else 0
                if (refused or answered >= _REFUSE_AFTER) and self._quarantine_refused(
                    store, batch[0], error
                ):
                    return
            time.sleep(_backoff_s(failures))

    def _store_answers(self, store: _StoreOps) -> bool:
        try:
            store.ping()
        except Exception:  # noqa: BLE001 - the store is down: an outage, not this message
            return False
        return True

    def _quarantine_refused(self, store: _StoreOps, item: _Incoming, error: Exception) -> bool:
        """Quarantine a lone message the store refuses: it said so (:class:`StoreRefused`,
        a constraint or a value it cannot hold), or it kept failing this message
        ``_REFUSE_AFTER`` times in a row while answering a ping each time (an error we do
        not know, which must not stall ingest for every device). Never during an outage: a
        database that is down, or coming back, must not make a good message look bad.
        False if the quarantine itself could not be written (retry)."""
        self._note("store-refused", f"store refused a message on {item[3]}: {error}")
        try:
            store.quarantine(
                [
                    Quarantined(
                        item[3],
                        item[4][:QUARANTINE_PAYLOAD_MAX],
                        f"store refused the message: {error}",
                        "$",
                        item[5],
                        None,
                    )
                ]
            )
        except Exception:  # noqa: BLE001
            return False  # the store is down after all: keep retrying
        self.stats.quarantined["store"] += 1
        self._ack([item])
        return True

    def _commit(self, store: _StoreOps, batch: list[_Incoming]) -> None:
        out = store.process(batch, auto_register=self.config.auto_register)
        stats = self.stats
        stats.batches += 1
        stats.last_commit_ns = time.time_ns()
        stats.stored += out.inserted
        stats.duplicates += out.duplicates
        stats.states += out.states
        for cls, n in out.refused.items():
            stats.quarantined[cls] = stats.quarantined.get(cls, 0) + n
        for kind, text in out.notes:
            self._note(kind, text)
        self._ack(batch)

    def _ack(self, batch: Iterable[_Incoming]) -> None:
        """Hand committed messages to paho's thread to PUBACK (see _flush_acks)."""
        if not self._acks:
            self._acks_since = time.monotonic()
        self._acks.extend(batch)

    def _flush_acks(self) -> None:
        """PUBACK what is committed. Called by paho's thread on each message (the usual
        path: each ack costs a socket write, and from the writer thread every one of them
        waited to get the GIL back from paho's thread) and by the writer when acks have
        waited 20 ms (the broker stops sending once Receive Maximum messages are unacked,
        so no new message may come to flush them)."""
        with self._ack_lock:
            epoch = self._epoch
            acks = self._acks
            while acks:
                item = acks.popleft()
                if item[2] > 0 and item[0] == epoch:  # qos, the connection of its mid
                    rc = self._client.ack(item[1], item[2])
                    if rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
                        self.stats.acked += 1

    def _note(self, kind: str, text: str) -> None:
        """Record the last error; log each kind of failure once (not once per message)."""
        self.stats.last_error = text
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("ingest %s: %s", self.client_id, text)


# --- running several workers -------------------------------------------------------------


def _worker_process(
    config: IngestConfig, duration: float | None, results: multiprocessing.Queue[dict[str, Any]]
) -> None:
    # A spawned process starts without the parent's logging setup.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    worker = IngestWorker(config)
    try:
        worker.start()
        stop.wait(duration)
    finally:
        worker.stop()
        results.put(worker.stats.as_dict())


def _stats_from(d: dict[str, Any]) -> IngestStats:
    return IngestStats(**d)


def serve(
    config: IngestConfig,
    *,
    workers: int = 1,
    duration: float | None = None,
    stop: threading.Event | None = None,
    on_stats: Callable[[IngestStats], None] | None = None,
) -> list[IngestStats]:
    """Migrate once, then run ``workers`` ingest workers until ``duration`` or ``stop``.

    One worker runs in this process; more run as processes (one GIL each), with client ids
    ``{client_id}-{i}`` so each keeps its own persistent session across restarts.
    Returns each worker's final stats.
    """
    store = open_store(config.store_url)
    try:
        store.migrate()
    finally:
        store.close()
    base_id = config.client_id or f"fleet-ingest-{socket.gethostname()}"
    stop = stop or threading.Event()
    if workers <= 1:
        worker = IngestWorker(replace(config, client_id=base_id, migrate=False))
        worker.start()
        try:
            _wait(stop, duration, lambda: on_stats(worker.stats) if on_stats else None)
        finally:
            worker.stop()
        return [worker.stats]
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[dict[str, Any]] = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker_process,
            args=(replace(config, client_id=f"{base_id}-{i}", migrate=False), None, results),
            name=f"ingest-{i}",
        )
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        _wait(stop, duration, None)
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.terminate()  # SIGTERM: the worker flushes, acks and disconnects
        out = []
        for _ in procs:
            try:
                out.append(_stats_from(results.get(timeout=60)))
            except queue.Empty:
                break
        for p in procs:
            p.join(10)
    return out


def _wait(stop: threading.Event, duration: float | None, tick: Callable[[], None] | None) -> None:
    deadline = None if duration is None else time.monotonic() + duration
    while not stop.is_set():
        left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
        if left <= 0:
            return
        stop.wait(left)
        if tick is not None:
            tick()
