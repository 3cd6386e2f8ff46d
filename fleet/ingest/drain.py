"""Emptying an ingest session no worker will read into the store, then ending it.

A drain takes over the session's client id, leaves the group, stores what the broker still
queued for the session by the worker's own path (acked only after the commit), then ends
the session; it gives way to any other client with that id, and a session it could not
finish is drained at the next start. How and why: :class:`SessionDrainer`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, replace

import paho.mqtt.client as mqtt
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from fleet.ingest.config import IngestConfig, IngestStats
from fleet.ingest.worker import IngestWorker
from fleet.store import IngestSession
from wire.topics import shared_subscription

log = logging.getLogger(__name__)

#: No message for this long, nothing held: the session is empty.
QUIET_S = 2.0
#: Drains at once (each is one MQTT connection and one store connection).
PARALLEL = 4
#: A drain whose connection is lost SHORT_LIMIT times in a row, each within SHORT_S of being
#: made, gives way (another client holds the client id: see _connection_lost).
SHORT_S = 5.0
SHORT_LIMIT = 3


@dataclass(frozen=True)
class Drained:
    """How a drain ended: ``ended`` (the broker deleted the session), ``taken over`` (another
    client holds the client id) or ``stopped`` (fleet serve stopped first)."""

    session: IngestSession
    outcome: str
    #: The broker had the session when the drain connected.
    present: bool
    stats: IngestStats


class SessionDrainer(IngestWorker):
    """One drain: an ingest worker that leaves the group instead of joining it.

    A drain connects with the session's client id and ``clean_start=False``, and leaves the
    group (UNSUBSCRIBE): the broker routes no new message to the session, but still delivers
    those it queued for it (Mosquitto 2.0.11, tested). Each message takes the worker's own
    path: checks, one transaction per batch, the PUBACK only after the commit. Once the
    unsubscribe is confirmed, nothing is held unstored or unacked, and no message has come for
    ``quiet_s``, the broker has nothing left for the session (it sends the next queued message
    as soon as an ack frees a slot), and the drain disconnects with Session Expiry 0: the
    broker deletes the session. A session the broker does not have (``session present`` 0) is
    ended at once. A message delivered while the drain stops is left unacked and the session
    kept: it is never acked without being stored, and never ended while it owes one.

    A drain gives way when another client holds the client id (a fleet serve still running
    with it: the broker's "session taken over", or with Mosquitto, which closes the socket
    without saying why, the connection lost three times in a row within 5 s of being made),
    and when fleet serve stops: the session stays ``draining`` in the store and the next start
    drains it.
    """

    def __init__(self, config: IngestConfig, *, quiet_s: float = QUIET_S) -> None:
        # In the writer's thread, not a store process: a drain is short, and a process
        # per drain would cost more than its messages (most sessions found are empty).
        super().__init__(replace(config, migrate=False, store_process=False))
        self.quiet_s = quiet_s
        #: The first CONNACK's "session present" (None until then).
        self.present: bool | None = None
        self._left = threading.Event()  # the group is left (or there was nothing to leave)
        self._gone = threading.Event()  # another client took the session
        self._connected_at = 0.0
        self._short = 0  # connections in a row that lasted less than SHORT_S
        self._client.on_unsubscribe = self._on_unsubscribe

    def _after_connect(self, client: mqtt.Client, session_present: bool) -> None:
        self._connected_at = time.monotonic()
        if self.present is None:
            self.present = session_present
        self._left.clear()
        if not session_present:
            # A new session (the broker had none, or lost it): it is in no group and holds
            # nothing. The drain ends it.
            self._left.set()
            return
        client.unsubscribe(shared_subscription(self.config.group))

    def _on_unsubscribe(
        self,
        client: mqtt.Client,
        userdata: object,
        mid: int,
        reason_codes: list[ReasonCode],
        properties: Properties | None,
    ) -> None:
        # "No subscription existed" is fine: Mosquitto forgets shared subscriptions of
        # persistent sessions over a restart, and keeps the queued messages.
        self._left.set()

    def _taken_over(self) -> None:
        log.warning(
            "ingest drain %s: another client took the session (a fleet serve running with "
            "this client id?); leaving it to that client",
            self.client_id,
        )
        self._gone.set()

    def _connection_lost(self) -> None:
        # Mosquitto 2.0.11 closes the socket of a client whose id another connection took,
        # without the DISCONNECT that says so: two clients of one id take it from each other
        # at every reconnect. A connection lost again and again right after it was made is
        # that fight (or a broker too sick to drain into): give way.
        self._short = self._short + 1 if time.monotonic() - self._connected_at < SHORT_S else 0
        if self._short >= SHORT_LIMIT:
            self._taken_over()

    def drain(self, stop: threading.Event) -> str:
        """Run until the session is empty and ended, taken over, or ``stop``: the outcome."""
        self.start()
        seen, quiet_since = -1, time.monotonic()
        outcome = "stopped"
        while not stop.wait(0.05):
            if self._gone.is_set():
                outcome = "taken over"
                break
            if not (self.stats.connected and self._left.is_set()):
                seen = -1
                continue
            received = self.stats.received
            if received != seen or not self.idle():
                seen, quiet_since = received, time.monotonic()
            elif self.present is False or time.monotonic() - quiet_since >= self.quiet_s:
                outcome = "ended"
                break
        ended = self.stop(end_session=outcome == "ended")
        if outcome == "ended" and not ended:
            outcome = "stopped"  # kept: it still owes a message (see stop); drained again later
        return outcome


class Drains:
    """The drains of one fleet serve: up to PARALLEL at once, each session once; what each
    did is collected by :meth:`done` (the caller records it in the store)."""

    def __init__(self, config: IngestConfig, *, quiet_s: float = QUIET_S) -> None:
        self._config = config
        self._quiet_s = quiet_s
        self._todo: queue.Queue[IngestSession] = queue.Queue()
        self._done: queue.Queue[Drained] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._pending: set[str] = set()

    def add(self, session: IngestSession) -> bool:
        """Drain ``session`` (False if it is already being drained)."""
        with self._lock:
            if session.client_id in self._pending:
                return False
            self._pending.add(session.client_id)
            self._todo.put(session)
            if len(self._threads) < PARALLEL:
                t = threading.Thread(target=self._run, name=f"drain-{len(self._threads)}")
                self._threads.append(t)
                t.start()
        return True

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                session = self._todo.get(timeout=0.2)
            except queue.Empty:
                continue
            cfg = replace(self._config, client_id=session.client_id, group=session.group)
            drainer = SessionDrainer(cfg, quiet_s=self._quiet_s)
            if session.index < 0:  # a name an older version may have used: mostly absent
                drainer.connect_log_level = logging.DEBUG
            try:
                outcome = drainer.drain(self._stop)
            except Exception as exc:  # one session's failure must not end the others
                log.exception("ingest drain %s failed; kept for the next start", session.client_id)
                drainer.stats.last_error = f"{type(exc).__name__}: {exc}"
                outcome = "stopped"
            self._done.put(Drained(session, outcome, bool(drainer.present), drainer.stats))
            with self._lock:
                self._pending.discard(session.client_id)

    def done(self) -> list[Drained]:
        """The drains finished since the last call."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def stop(self) -> list[Drained]:
        """Stop every drain (their sessions are kept); the last results."""
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return self.done()
