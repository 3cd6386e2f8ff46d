"""fleet serve's sessions between the store and the broker: recorded before any worker
connects, drained when no worker will read them, seen every HEARTBEAT_S while they run,
``stopped`` on a clean stop. The decisions are :mod:`fleet.ingest.sessions`' (pure); the
drains are :mod:`fleet.ingest.drain`'s."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from fleet.errors import FleetError
from fleet.ingest.config import IngestConfig
from fleet.ingest.drain import QUIET_S, Drained, Drains
from fleet.ingest.sessions import (
    ACTIVE,
    DRAINING,
    ENDED,
    HEARTBEAT_S,
    ORPHANED,
    STOPPED,
    Plan,
    default_prefix,
    orphans,
    plan,
)
from fleet.store import Store

log = logging.getLogger(__name__)


class SessionKeeper:
    """The sessions of one fleet serve. Call from one thread: :meth:`start_drains` once the
    workers are connected (so the group always has a reader), :meth:`tick` now and then,
    :meth:`stop` at the end."""

    def __init__(
        self,
        store: Store,
        config: IngestConfig,
        *,
        node: str,
        workers: int,
        broker: str,
        quiet_s: float = QUIET_S,
    ) -> None:
        self._store = store
        self._node = node
        known = store.ingest_sessions()
        prefix = config.client_id or default_prefix(node)
        # An older fleet serve recorded no session; it can only have run on a store it
        # filled. Looked at once per prefix (later starts find its sessions recorded).
        used = not any(s.prefix == prefix for s in known) and bool(store.devices())
        self.plan: Plan = plan(
            known,
            prefix=prefix,
            node=node,
            group=config.group,
            workers=workers,
            broker=broker,
            now_ns=time.time_ns(),
            used_before=used,
        )
        # Before any connect: a crash after it leaves no session at the broker unrecorded.
        store.save_ingest_sessions([*self.plan.run, *self.plan.drain, *self.plan.legacy])
        log.info("%s", self.plan.describe())
        self._running = {s.client_id for s in self.plan.run}
        self._drains = Drains(config, quiet_s=quiet_s)
        self._next_beat = time.monotonic() + HEARTBEAT_S
        self._quiet_until = 0.0

    def worker_ids(self) -> list[str]:
        return [s.client_id for s in self.plan.run]

    def draining(self) -> int:
        return self._drains.pending()

    def start_drains(self) -> None:
        for s in (*self.plan.drain, *self.plan.legacy):
            self._drains.add(s)
        self._claim_orphans()

    def tick(self) -> None:
        """Record finished drains; every HEARTBEAT_S, mark the running sessions seen and take
        orphans that appeared (``fleet sessions retire``). A store that fails here is logged
        and tried again at the next tick: the workers go on regardless."""
        try:
            self._record(self._drains.done())
            if time.monotonic() < self._next_beat:
                return
            self._next_beat = time.monotonic() + HEARTBEAT_S
            now = time.time_ns()
            self._store.save_ingest_sessions([replace(s, last_seen_ns=now) for s in self.plan.run])
            self._claim_orphans()
        except FleetError as exc:
            self._store_failed(exc)

    def stop(self) -> None:
        """Stop the drains (unfinished ones stay ``draining``); mark the workers' sessions
        ``stopped``: they stay at the broker and hold what comes until the next start."""
        try:
            self._record(self._drains.stop())
            now = time.time_ns()
            self._store.save_ingest_sessions(
                [replace(s, state=STOPPED, last_seen_ns=now) for s in self.plan.run],
                if_state=ACTIVE,
            )
        except FleetError as exc:
            self._store_failed(exc)

    def _store_failed(self, exc: FleetError) -> None:
        if time.monotonic() >= self._quiet_until:
            self._quiet_until = time.monotonic() + HEARTBEAT_S * 6
            log.warning("ingest sessions: cannot record them in the store: %s", exc)

    def _claim_orphans(self) -> None:
        known = self._store.ingest_sessions()
        was = {s.client_id: s.node for s in known}
        for s in orphans(known, self._running, self._node, time.time_ns()):
            if self._store.save_ingest_sessions([s], if_state=ORPHANED):
                log.info(
                    "ingest sessions: draining %s of retired node %s", s.client_id, was[s.client_id]
                )
                self._drains.add(s)

    def _record(self, finished: list[Drained]) -> None:
        now = time.time_ns()
        for d in finished:
            s, st = d.session, d.stats
            if d.outcome != "ended":
                if d.outcome == "taken over" or st.received:
                    log.warning(
                        "ingest drain %s: %s after %d message(s); kept for the next start",
                        s.client_id, d.outcome, st.received,
                    )  # fmt: skip
                continue
            done = replace(
                s, state=ENDED, last_seen_ns=now, ended_ns=now, drained=s.drained + st.received
            )
            self._store.save_ingest_sessions([done], if_state=DRAINING)
            if d.present or st.received:
                q = sum(st.quarantined.values())
                log.info(
                    "ingest drain %s: %d message(s) (stored %d, duplicates %d, quarantined %d); "
                    "session ended",
                    s.client_id, st.received, st.stored, st.duplicates, q,
                )  # fmt: skip
