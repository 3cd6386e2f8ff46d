"""One ingest worker: an MQTT 5 client in the shared-subscription group, a bounded inbox, a
writer thread that commits batches and acks them after the commit (see the package docstring)."""

from __future__ import annotations

import logging
import socket
import ssl
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from fleet.errors import IngestError, StoreRefused
from fleet.ingest.checks import Incoming
from fleet.ingest.config import (
    ACK_FALLBACK_S,
    MAX_PACKET_BYTES,
    REFUSE_AFTER,
    SPLIT_AFTER,
    IngestConfig,
    IngestStats,
    backoff_s,
)
from fleet.ingest.gapwatch import SETTLE_S, GapWatch, gap_lines, horizon_after
from fleet.ingest.link import Link, describe_connect_error
from fleet.ingest.storeproc import DirectStore, StoreClient, StoreOps
from fleet.store import Quarantined, open_store
from fleet.store.base import QUARANTINE_PAYLOAD_MAX
from wire.commands import stored_commands
from wire.topics import PREFIX, shared_subscription

log = logging.getLogger(__name__)

#: DISCONNECT reason: another connection took this client id (MQTT 5 "Session taken over").
TAKEN_OVER = 142


class IngestWorker:
    """One ingest client: paho's network thread, a writer thread, and (by default) a store
    process of its own (:class:`StoreClient`).

    ``start()`` returns once the writer thread runs; the MQTT connection is made and remade
    in the background (jittered backoff, each failure's reason logged: see :class:`Link`).
    ``stop()`` commits and acks what it holds, then disconnects; anything unacked is
    redelivered to the group later.
    """

    def __init__(self, config: IngestConfig, *, horizon: Callable[[], int] | None = None) -> None:
        self.config = config
        #: The ingest's horizon (fleet serve: the lowest of its workers'), bounding what the
        #: gap audit looks at (see fleet.ingest.gapwatch); None: only the grace does.
        self._horizon = horizon
        #: When this worker last connected and last committed (monotonic): is it settled?
        self._connected_at = self._committed_at = 0.0
        self.stats = IngestStats()
        self.client_id = config.client_id or f"fleet-ingest-{socket.gethostname()}"
        # A deque, not queue.Queue: append/popleft are atomic under the GIL and cost a
        # fraction of Queue's lock and condition per message. Bounded by the check in
        # _on_message (only paho's thread appends), woken through _wake.
        self._inbox: deque[Incoming] = deque()
        self._wake = threading.Event()
        self._space = threading.Event()
        #: Committed messages waiting for their PUBACK, and since when (monotonic).
        self._acks: deque[Incoming] = deque()
        self._acks_since = 0.0
        self._ack_lock = threading.Lock()
        self._epoch = 0
        self._stopping = threading.Event()
        #: The writer holds messages it took from the inbox (a batch not yet committed).
        self._busy = False
        #: Messages left unacked while stopping (came then, or the store failed them then):
        #: the session still owes them, so it must not be ended.
        self._held_back = 0
        self._resync = threading.Event()
        self._ready = threading.Event()
        self._subscribed = threading.Event()
        self._writer: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self._logged: set[str] = set()
        self._queue_max = config.queue_max
        self._grace_ns = int(config.gap_grace_s * 1e9)
        self._gaps = (
            GapWatch.starting(
                time.time_ns(), grace_s=config.gap_grace_s, check_s=config.gap_check_s
            )
            if config.gap_check_s > 0
            else None
        )
        #: The level of the "connected" line (a drain looking for old sessions lowers it).
        self.connect_log_level = logging.INFO
        host = config.broker_host
        self._link = Link(
            f"[{host}]:{config.broker_port}" if ":" in host else f"{host}:{config.broker_port}"
        )
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
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        # paho's own wait is none: ours (jittered, logged) runs in _retry_wait.
        client.reconnect_delay_set(min_delay=0, max_delay=0)
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
            # The broker closes the connection next: _on_disconnect waits before the retry.
            self._failed(f"the broker refused the connection: {reason_code}")
            return
        # Under the ack lock: the writer must never ack an old connection's mid on this one.
        # What still waits here from the old connection is stored all the same (never
        # acked: its mids died with that connection). A broker that resumed the session
        # resends it (MQTT 5 4.4.0-1; the store counts a duplicate), but one that crashed
        # and came back from a persistence file saved before those messages arrived has
        # the session without them, and never resends them.
        with self._ack_lock:
            self._epoch += 1
        self._connected_at = time.monotonic()
        self.stats.connects += 1
        if self._gaps is not None:
            self._gaps.connected(time.time_ns())
        back = self._link.up(time.monotonic())
        self.stats.connected, self.stats.link_error = True, None
        self._after_connect(client, flags.session_present)
        if back is not None:
            log.info("ingest %s: %s", self.client_id, back)
        log.log(
            self.connect_log_level,
            "ingest %s connected to %s (session present: %s)",
            self.client_id,
            self._link.broker,
            flags.session_present,
        )

    def _after_connect(self, client: mqtt.Client, session_present: bool) -> None:
        """Join the group (a drain leaves it instead: see fleet.ingest.drain)."""
        client.subscribe([(t, 1) for t in shared_subscription(self.config.group)])

    def _on_connect_fail(self, client: mqtt.Client, userdata: object) -> None:
        # paho calls this from inside its `except OSError` around the connect attempt, so
        # the exception being handled is the reason (paho passes none).
        self._failed(describe_connect_error(sys.exc_info()[1]))
        self._retry_wait()

    def _failed(self, reason: str) -> None:
        """An attempt to connect failed: count it, say why (see Link for how often)."""
        self.stats.connect_failures += 1
        line = self._link.failed(reason, time.monotonic())
        self.stats.connected, self.stats.link_error = False, reason
        self.stats.last_error = f"cannot connect to {self._link.broker}: {reason}"
        if line is not None and not self._stopping.is_set():
            log.warning("ingest %s: %s", self.client_id, line)

    def _retry_wait(self) -> None:
        """The jittered backoff before paho's next attempt (it waits for none itself); in
        paho's thread, which has nothing else to do while there is no connection."""
        if self._stopping.wait(self._link.retry_in()):
            # Stopping without a connection: no ack can be sent any more (what is unacked is
            # redelivered), so paho must not try again (its next attempt would not wait).
            self._client.disconnect()

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
        was_up = self._link.connected
        self._link.lost(str(reason_code), time.monotonic())
        self.stats.connected = False
        if self._stopping.is_set():
            self._client.disconnect()  # no socket: paho's loop ends instead of reconnecting
            return
        if reason_code.value == TAKEN_OVER:
            self._taken_over()
            self.stats.link_error = "session taken over by another client with this client id"
        elif was_up:
            self.stats.link_error = f"connection lost: {reason_code}"
            log.warning(
                "ingest %s: connection to %s lost: %s",
                self.client_id,
                self._link.broker,
                reason_code,
            )
        self._connection_lost()
        self._retry_wait()

    def _connection_lost(self) -> None:
        """A connection ended while running (a drain counts how short they were)."""

    def _taken_over(self) -> None:
        """The broker said it gave this client id to another connection (MQTT 5 reason 142;
        Mosquitto 2.0.11 just closes the socket): two processes share the id, each taking it
        from the other at every reconnect."""
        log.warning(
            "ingest %s: another client connected with this client id and took the session "
            "(a second fleet serve with the same --client-id or node?)",
            self.client_id,
        )

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        if self._stopping.is_set():
            # Left unacked: the broker keeps it for this session. Taking more while stopping
            # would keep the writer (and stop()) busy for as long as traffic flows.
            self._held_back += 1
            return
        # Every line here runs once per message in the thread that bounds the worker's
        # rate (see StoreClient): keep it to queueing.
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

    def stop(self, timeout: float = 30.0, *, end_session: bool = False) -> bool:
        """Flush and ack what is held, then disconnect: the session stays at the broker, or
        with ``end_session`` the broker deletes it (MQTT 5 Session Expiry 0 on DISCONNECT),
        but only if every message it delivered is stored and acked (else it stays, and
        what it holds is redelivered later). Returns whether the session was ended."""
        self._stopping.set()
        if self._writer is not None:
            self._writer.join(timeout)
        props = None
        end = end_session and self.stats.connected and self.idle() and self._held_back == 0
        if end:
            props = Properties(PacketTypes.DISCONNECT)  # type: ignore[no-untyped-call]
            props.SessionExpiryInterval = 0
        elif end_session:
            log.warning(
                "ingest %s: session kept (messages unstored or unacked, or no connection)",
                self.client_id,
            )
        self._client.disconnect(properties=props)
        self._client.loop_stop()
        return end

    def idle(self) -> bool:
        """Nothing held: no message waits in the inbox, in a batch or for its PUBACK."""
        # In this order: the writer sets _busy before it takes from the inbox and clears it
        # after it queued the batch's acks.
        return not self._inbox and not self._busy and not self._acks

    def __enter__(self) -> IngestWorker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- writer thread -------------------------------------------------------------------

    def _writer_main(self) -> None:
        store: StoreOps
        try:
            if self.config.store_process:
                store = StoreClient(self.config.store_url, migrate=self.config.migrate)
            else:
                direct = open_store(self.config.store_url)
                if self.config.migrate:
                    direct.migrate()
                store = DirectStore(direct)
        except BaseException as exc:  # noqa: BLE001 - re-raised by start() in its thread
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._writer_loop(store)
        finally:
            store.close()

    def _writer_loop(self, store: StoreOps) -> None:
        inbox = self._inbox
        batch_s = self.config.batch_ms / 1000
        batch_max = self.config.batch_max
        while True:
            if self._resync.is_set():
                self._do_resync()
            if self._gaps is not None:
                self._audit_gaps(store, self._gaps)
            if self._acks and time.monotonic() - self._acks_since > ACK_FALLBACK_S:
                self._flush_acks()
            if not inbox:
                self._wake.clear()
                if not inbox:  # re-check: paho may have appended before the clear
                    if self._stopping.is_set():
                        self._flush_acks()
                        return
                    self._idle_horizon()
                    self._wake.wait(ACK_FALLBACK_S if self._acks else 0.1)
                    continue
            # Group commit: take what is waiting (up to batch_max); linger up to batch_ms
            # for more only while the batch is small, so a trickle is stored at once and a
            # flood is stored in big transactions.
            self._busy = True
            batch: list[Incoming] = []
            deadline = time.monotonic() + batch_s
            while len(batch) < batch_max:
                try:
                    item = inbox.popleft()
                except IndexError:
                    pass
                else:
                    batch.append(item)
                    if item[0] != self._epoch:
                        self.stats.held_over += 1
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
            self._busy = False

    def _idle_horizon(self) -> None:
        """Nothing to store: once settled (connected, nothing for SETTLE_S), caught up."""
        now = time.monotonic()
        settled = (
            self.stats.connected
            and now - self._connected_at >= SETTLE_S
            and now - self._committed_at >= SETTLE_S
        )
        self.stats.horizon_ns = horizon_after(
            self.stats.horizon_ns, time.time_ns(), settled=settled, grace_ns=self._grace_ns
        )

    def _audit_gaps(self, store: StoreOps, watch: GapWatch) -> None:
        """Every ``gap_check_s``: ask the store for new holes behind the messages received
        since the last audit (up to ``gap_grace_s`` ago), log and count each (see
        :mod:`fleet.ingest.gapwatch`)."""
        now = time.time_ns()
        window = watch.due(now, None if self._horizon is None else self._horizon())
        if window is None:
            return
        try:
            found = store.new_gaps(*window, now)
        except Exception as exc:  # noqa: BLE001 - the store is down: the next period retries
            watch.audit_failed(now)
            self._note(f"gaps:{type(exc).__name__}", f"gap audit failed: {exc}")
            return
        watch.audited(window[1], now)
        if found:
            self.stats.gaps += len(found)
            self.stats.gap_seqs += sum(g.last_missing - g.first_missing + 1 for g in found)
            for line in gap_lines(found, now, watch.connected_ns):
                log.warning("ingest %s: %s", self.client_id, line)

    def _do_resync(self) -> None:
        self._resync.clear()
        self._note("dropped", "internal queue full: dropped unacked messages; reconnecting")
        # A forced reconnect makes the broker redeliver every unacked message (MQTT 5 4.4).
        sock = self._client.socket()
        if sock is not None:
            sock.close()

    def _commit_with_retry(self, store: StoreOps, batch: list[Incoming]) -> None:
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
                if self._gaps is not None:
                    self._gaps.store_failed(time.time_ns())
                self._note(f"store:{type(exc).__name__}", f"store failed a batch: {exc}")
                error = exc
            # A refusal is the data's, not the moment's: no point retrying the same rows.
            refused = isinstance(error, StoreRefused)
            if self._stopping.is_set() and failures >= SPLIT_AFTER:
                self._held_back += len(batch)
                return  # unacked: the broker redelivers to the group
            if refused or failures >= SPLIT_AFTER:
                if len(batch) > 1:
                    for item in batch:
                        self._commit_with_retry(store, [item])
                    return
                if not refused:
                    answered = answered + 1 if self._store_answers(store) else 0
                if (refused or answered >= REFUSE_AFTER) and self._quarantine_refused(
                    store, batch[0], error
                ):
                    return
            time.sleep(backoff_s(failures))

    def _store_answers(self, store: StoreOps) -> bool:
        try:
            store.ping()
        except Exception:  # noqa: BLE001 - the store is down: an outage, not this message
            return False
        return True

    def _quarantine_refused(self, store: StoreOps, item: Incoming, error: Exception) -> bool:
        """Quarantine a lone message the store refuses: it said so (:class:`StoreRefused`,
        a constraint or a value it cannot hold), or it kept failing this message
        ``REFUSE_AFTER`` times in a row while answering a ping each time (an error we do
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

    def _commit(self, store: StoreOps, batch: list[Incoming]) -> None:
        started = time.perf_counter()
        out = store.process(batch, auto_register=self.config.auto_register)
        stats = self.stats
        stats.observe_write(time.perf_counter() - started)
        stats.batches += 1
        stats.last_commit_ns = now = time.time_ns()
        stats.observe_lags(out.t_ns, now)
        if out.t_ns:
            self._committed_at = time.monotonic()
            stats.horizon_ns = horizon_after(
                stats.horizon_ns,
                now,
                stored_t_ns=out.t_ns,
                waiting=bool(self._inbox),
                grace_ns=self._grace_ns,
            )
        stats.queue_depth = len(self._inbox)
        stats.stored += out.inserted
        stats.duplicates += out.duplicates
        stats.conflicts += out.conflicts
        if out.conflicts:
            self._note("conflict", f"quarantined {out.conflicts} conflicting message(s)")
        stats.states += out.states
        for cls, n in out.refused.items():
            stats.quarantined[cls] = stats.quarantined.get(cls, 0) + n
        for kind, text in out.notes:
            self._note(kind, text)
        self._ack(batch)
        if self.config.confirm and out.stored:
            self._confirm(out.stored)

    def _confirm(self, stored: list[tuple[str, str, str, int]]) -> None:
        """Tell each device the seqs of this commit (``cmd/stored``): its outbox lets them
        go. QoS 0: a lost confirmation costs a duplicate (the device sends again), never
        a message."""
        by_boot: dict[tuple[str, str, str], list[int]] = {}
        for site, device, boot_id, seq in stored:
            by_boot.setdefault((site, device, boot_id), []).append(seq)
        client = self._client
        for (site, device, boot_id), seqs in by_boot.items():
            where = f"{PREFIX}/{site}/{device}/cmd/stored"  # names checked by the ingest
            for payload in stored_commands(boot_id, seqs):
                info = client.publish(where, payload, qos=0)
                if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
                    self.stats.confirms += 1
                else:
                    self.stats.confirm_errors += 1

    def _ack(self, batch: Iterable[Incoming]) -> None:
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
