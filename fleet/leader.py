"""Several ``fleet serve`` nodes on one store: which nodes run, and which one leads.

Every node ingests and serves the bundles; exactly one runs the rollout orchestrator. On
PostgreSQL the lead is an advisory lock whose taking bumps a fencing epoch
(:class:`PgLead`); SQLite holds one node and refuses a second (:func:`check_alone`).
Nodes record themselves in ``fleet_nodes`` every :data:`BEAT_S` (``fleet nodes list``).

Design: ``docs/ARCHITECTURE.md``, "Several nodes".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from typing import Any, Protocol

from fleet.errors import FleetStoreError, NodesRefused
from fleet.store import OperatorStore
from fleet.store.base import redact_url

log = logging.getLogger(__name__)

#: The advisory lock of the rollout lead ("EFRL").
LOCK_KEY = 0x4546524C
# Advisory locks are per database; the schema is the second key, so fleets kept in two
# schemas of one database (tests, staging beside production) each have their own lead.
_TRY_LOCK = "SELECT pg_try_advisory_lock(%s, hashtext(current_schema()))"
_UNLOCK = "SELECT pg_advisory_unlock(%s, hashtext(current_schema()))"
#: How often a node records that it runs.
BEAT_S = 2.0
#: A node not seen for this long is gone (a killed one leaves its row behind).
GONE_AFTER_S = 10.0
_S = 1_000_000_000


class Lead(Protocol):
    """The rollout lead as one node sees it."""

    def try_take(self, now_ns: int) -> int | None:
        """Take the lead if nobody holds it: the new epoch, or None. Raises
        ``FleetStoreError`` when the store cannot be asked."""
        ...

    def holds(self) -> bool:
        """Still the leader? False once the lock's connection is gone."""
        ...

    def release(self) -> None: ...


class SoloLead:
    """SQLite: one node (see :func:`check_alone`), which always leads."""

    def __init__(self, store: OperatorStore, node: str) -> None:
        self._store, self._node = store, node
        self._epoch: int | None = None

    def try_take(self, now_ns: int) -> int | None:
        self._epoch = self._store.take_lead(self._node, now_ns)
        return self._epoch

    def holds(self) -> bool:
        return self._epoch is not None

    def release(self) -> None:
        self._epoch = None


class PgLead:
    """PostgreSQL: the advisory lock :data:`LOCK_KEY` on a connection of this node's own.

    Every node ingests (the shared subscription spreads the devices over them) and serves the
    bundles; exactly one runs the rollout orchestrator. On PostgreSQL the lead is a
    session-level advisory lock (:data:`LOCK_KEY`) held on a connection of its own: the server
    lets go of it the moment that connection ends (the node was killed, or lost the server),
    and the next node to ask takes it. Taking the lead bumps ``fleet_leader.epoch``, the fencing
    token: every rollout save names the epoch it was decided under and is refused once another
    epoch leads (:class:`fleet.errors.LeadershipLost`), and commands go out only after their
    save, so a node that lost the lead sends nothing more. The leader checks its lock
    connection before every step: cut off from the server, it stops before the server notices
    and frees the lock for another. SQLite holds one node: a second is refused at start.
    """

    def __init__(self, url: str, store: OperatorStore, node: str) -> None:
        self._url, self._store, self._node = url, store, node
        self._db: Any = None

    def try_take(self, now_ns: int) -> int | None:
        import psycopg  # noqa: PLC0415 - PostgreSQL only

        try:
            if self._db is None or self._db.closed or self._db.broken:
                self._db = psycopg.connect(self._url, autocommit=True, connect_timeout=5)
            row = self._db.execute(_TRY_LOCK, (LOCK_KEY,)).fetchone()
        except psycopg.Error as exc:
            self._drop()
            raise FleetStoreError(
                f"store {redact_url(self._url)}: cannot ask for the rollout lead: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
            ) from None
        if not (row and row[0]):
            return None
        try:
            return self._store.take_lead(self._node, now_ns)
        except FleetStoreError:
            self.release()
            raise

    def holds(self) -> bool:
        import psycopg  # noqa: PLC0415

        if self._db is None or self._db.closed or self._db.broken:
            return False
        try:
            self._db.execute("SELECT 1").fetchone()
        except psycopg.Error:
            self._drop()
            return False
        return True

    def release(self) -> None:
        import psycopg  # noqa: PLC0415

        if self._db is not None and not self._db.closed and not self._db.broken:
            with contextlib.suppress(psycopg.Error):
                self._db.execute(_UNLOCK, (LOCK_KEY,))
        self._drop()

    def _drop(self) -> None:
        if self._db is not None:
            try:
                self._db.close()
            finally:
                self._db = None


def _postgres(url: str) -> bool:
    return url.lower().startswith(("postgresql://", "postgres://"))


def lead_for(url: str, store: OperatorStore, node: str) -> Lead:
    """The lead of the store at ``url``: PostgreSQL elects, SQLite has one node."""
    return PgLead(url, store, node) if _postgres(url) else SoloLead(store, node)


def default_node() -> str:
    return socket.gethostname()


def check_alone(store: OperatorStore, url: str, node: str, now_ns: int) -> None:
    """Refuse to start a node that would share the store wrongly: a second node on SQLite,
    or a node id another live process uses. One line naming the other node."""
    sqlite = not _postgres(url)
    for other in store.nodes():
        if now_ns - other.seen_ns > GONE_AFTER_S * _S or not _may_run(other.host, other.pid):
            continue  # gone: unseen for long, or its process on this host is no more
        ago = (now_ns - other.seen_ns) / _S
        where = f"{other.node} (host {other.host}, pid {other.pid}, seen {ago:.0f} s ago)"
        if other.node == node and (other.host, other.pid) != (socket.gethostname(), os.getpid()):
            raise NodesRefused(
                f"node id {node!r} is already running: {where}; give this one another "
                "--node-id, or stop that one"
            )
        if sqlite and other.node != node:
            raise NodesRefused(
                f"another fleet serve runs on this SQLite store: {where}; SQLite holds one "
                "node: stop it, or move the fleet to PostgreSQL for several"
            )


def _may_run(host: str, pid: int) -> bool:
    """False when ``pid`` on this host is no process (a node killed moments ago, restarted
    by systemd); True when it is, or on another host (its heartbeat decides)."""
    if host != socket.gethostname():
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NodeBeat:
    """This node's row in ``fleet_nodes``: recorded at start, every :data:`BEAT_S` with the
    ingest's figures (:meth:`beat`), removed at a clean stop (:meth:`gone`)."""

    def __init__(self, store: OperatorStore, node: str, now_ns: int) -> None:
        self._store, self.node = store, node
        self._host, self._pid, self._started = socket.gethostname(), os.getpid(), now_ns
        self._next = 0.0
        self._last: tuple[float, int] | None = None
        self._beat(now_ns, {})

    def beat(self, stored: int, received: int) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + BEAT_S
        rate = 0.0
        if self._last is not None and now > self._last[0]:
            rate = (stored - self._last[1]) / (now - self._last[0])
        self._last = (now, stored)
        stats: dict[str, object] = {
            "stored": stored,
            "received": received,
            "stored_per_s": round(rate, 1),
        }
        try:
            self._beat(time.time_ns(), stats)
        except FleetStoreError as exc:  # the store is down: the ingest says so already
            log.debug("node %s: heartbeat failed: %s", self.node, exc)

    def _beat(self, now_ns: int, stats: dict[str, object]) -> None:
        self._store.node_seen(
            self.node,
            host=self._host,
            pid=self._pid,
            started_ns=self._started,
            now_ns=now_ns,
            stats_json=json.dumps(stats),
        )

    def gone(self) -> None:
        try:
            self._store.node_gone(self.node)
        except FleetStoreError as exc:
            log.warning("node %s: cannot remove its row: %s", self.node, exc)


__all__ = [
    "BEAT_S",
    "GONE_AFTER_S",
    "LOCK_KEY",
    "Lead",
    "NodeBeat",
    "PgLead",
    "SoloLead",
    "check_alone",
    "default_node",
    "lead_for",
]
