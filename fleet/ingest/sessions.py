"""The ingest's MQTT sessions: their names, and which to run, keep or drain. Pure: it takes
the sessions recorded in the store and ``now``, and returns what to record and do.

A worker's client id is ``{prefix}-{group}-{index}`` (prefix: ``--client-id`` or
``fleet-ingest-{node}``), recorded before it connects. A session no worker of this start
will read is drained (:mod:`fleet.ingest.drain`): Mosquitto keeps handing a persistent
session of a shared subscription its share of the messages while nobody reads it, so left
alone it would hide them until it expired and then lose them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from fleet.store import IngestSession

ACTIVE = "active"
STOPPED = "stopped"
DRAINING = "draining"
ORPHANED = "orphaned"
ENDED = "ended"
STATES = (ACTIVE, STOPPED, DRAINING, ORPHANED, ENDED)
#: ``fleet serve --workers`` at most; also how many worker ids of an older version are looked
#: for at the broker.
MAX_WORKERS = 64
#: How often a running fleet serve writes ``last_seen_ns`` of its sessions and looks for
#: orphans to drain.
HEARTBEAT_S = 10.0
#: ``fleet sessions retire`` refuses a node whose sessions were seen this recently (its
#: fleet serve looks alive) unless forced.
ALIVE_WITHIN_NS = int(3 * HEARTBEAT_S * 1e9)


def default_prefix(node: str) -> str:
    return f"fleet-ingest-{node}"


def session_id(prefix: str, group: str, index: int) -> str:
    """The client id of worker ``index`` of ``group``."""
    return f"{prefix}-{group}-{index}"


def legacy_ids(prefix: str) -> list[str]:
    """Client ids an older fleet serve used with this prefix: ``{prefix}`` alone for one
    worker, ``{prefix}-{i}`` for several."""
    return [prefix] + [f"{prefix}-{i}" for i in range(MAX_WORKERS)]


@dataclass(frozen=True)
class Plan:
    """What one start of fleet serve records and does."""

    #: The workers' sessions (``active``), worker 0 first.
    run: tuple[IngestSession, ...]
    #: This prefix's sessions no worker will read, and orphans this node claimed and did not
    #: finish (``draining``): drain each.
    drain: tuple[IngestSession, ...]
    #: Sessions an older version may have left at the broker (``draining``, index -1): drain
    #: each that exists. Only at the first start of a prefix on a store used before.
    legacy: tuple[IngestSession, ...]

    def describe(self) -> str:
        def names(sessions: Sequence[IngestSession]) -> str:
            return ", ".join(f"{s.client_id} ({s.state})" for s in sessions)

        line = f"ingest sessions: running {', '.join(s.client_id for s in self.run)}"
        if self.drain:
            line += f"; draining {names(self.drain)}"
        if self.legacy:
            line += f"; looking for {len(self.legacy)} session name(s) of an older version"
        return line


def plan(
    known: Sequence[IngestSession],
    *,
    prefix: str,
    node: str,
    group: str,
    workers: int,
    broker: str,
    now_ns: int,
    used_before: bool = True,
) -> Plan:
    """The sessions to run for ``workers`` workers and those of ``prefix`` to drain.

    ``used_before``: the store holds data (devices), so an older fleet serve, which recorded
    no sessions, may have run on it with this prefix."""
    by_id = {s.client_id: s for s in known}
    run = []
    for i in range(workers):
        cid = session_id(prefix, group, i)
        created = by_id[cid].created_ns if cid in by_id else now_ns
        run.append(IngestSession(cid, prefix, node, group, i, broker, ACTIVE, created, now_ns))
    running = {s.client_id for s in run}
    drain = tuple(
        replace(s, state=DRAINING)
        for s in known
        if s.client_id not in running
        and s.state != ENDED
        and (s.prefix == prefix or (s.state == DRAINING and s.node == node))
    )
    legacy: tuple[IngestSession, ...] = ()
    if used_before and not any(s.prefix == prefix for s in known):
        legacy = tuple(
            IngestSession(cid, prefix, node, group, -1, broker, DRAINING, now_ns, now_ns)
            for cid in legacy_ids(prefix)
        )
    return Plan(tuple(run), drain, legacy)


def orphans(
    known: Sequence[IngestSession], running: set[str], node: str, now_ns: int
) -> list[IngestSession]:
    """Sessions of retired nodes that no worker here runs, as this node's drains: for this
    fleet serve to claim (``store.save_ingest_sessions(..., if_state=ORPHANED)``: one node
    wins) and drain. A claimed session belongs to its drainer's node, whose next start
    resumes a drain cut short (see :func:`plan`)."""
    return [
        replace(s, state=DRAINING, node=node, last_seen_ns=now_ns)
        for s in known
        if s.state == ORPHANED and s.client_id not in running
    ]


def retire(
    known: Sequence[IngestSession], node: str, now_ns: int, *, force: bool = False
) -> tuple[list[IngestSession], list[IngestSession]]:
    """``(to orphan, seen lately)`` for ``fleet sessions retire NODE``: every session of
    ``node`` not yet ended (its workers' and the drains it claimed), unless one was seen
    within ALIVE_WITHIN_NS (its fleet serve looks alive: then nothing, unless ``force``)."""
    mine = [s for s in known if s.node == node and s.state not in (ENDED, ORPHANED)]
    lately = [
        s
        for s in mine
        if s.state in (ACTIVE, DRAINING) and now_ns - s.last_seen_ns < ALIVE_WITHIN_NS
    ]
    if lately and not force:
        return [], lately
    return [replace(s, state=ORPHANED) for s in mine], lately
