"""Aging: TTL and a size cap, done incrementally in steps of one short transaction each.

Runs in the writer thread between commits (:class:`edge_agent.memory.store.StoreWriter`),
never on the event loop. Each step deletes a bounded row-id range (the tables are
append-only: the oldest rows have the lowest ids), its length halved when a step overran
``aging_step_ms`` and doubled when it took under a third of it. TTL cuts at the newest
keyframe at or before ``now - ttl``; the size cap evicts the least recently used cold
aging chunk first, recording an ``evicted`` gap before any row goes; ``incremental_vacuum``
steps give space back while the file is over the cap. The rules: ``docs/MEMORY.md``,
"Aging".
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_MIN_ROWS = 8
_MAX_ROWS = 1 << 16
_LOW_WATER = 0.9


@dataclass(frozen=True, slots=True)
class AgingPolicy:
    ttl_ns: int
    max_bytes: int
    chunk_ns: int
    step_budget_s: float = 0.001
    interval_s: float = 10.0


@dataclass(slots=True)
class AgingStats:
    rounds: int = 0
    steps: int = 0
    over_budget: int = 0
    max_step_us: float = 0.0
    total_step_us: float = 0.0
    ttl_rows: int = 0
    ttl_decisions: int = 0
    ttl_events: int = 0
    evicted_chunks: int = 0
    evicted_rows: int = 0
    vacuumed_pages: int = 0
    cap_unreachable: int = 0
    errors: int = 0


@dataclass(slots=True)
class _Eviction:
    chunk: int
    start_ns: int
    end_ns: int
    lo_id: int  # next row id to delete (starts at the chunk's first keyframe)
    next_id: int  # first row id of the next chunk: the chunk's rows are [lo_id, next_id)


class Aging:
    """Incremental aging over a writer connection. See the module docstring."""

    def __init__(self, policy: AgingPolicy) -> None:
        self.policy = policy
        self.stats = AgingStats()
        self.recent_us: deque[float] = deque(maxlen=1024)
        self._tasks: list[str] = []
        self._next_round = 0.0
        self._next_step = 0.0
        self._rows = 1024
        self._pages = 64
        self._evicting: _Eviction | None = None
        self._shrinking = False
        self._warned = False

    @property
    def busy(self) -> bool:
        """A round is in progress (more steps to do)."""
        return bool(self._tasks)

    def seconds_until_due(self, mono: float) -> float:
        return max(0.0, (self._next_step if self._tasks else self._next_round) - mono)

    def wants_step(self, mono: float) -> bool:
        return mono >= (self._next_step if self._tasks else self._next_round)

    # -- steps ---------------------------------------------------------------------------------

    def step(self, conn: sqlite3.Connection, now_ns: int, mono: float) -> bool:
        """Do at most one bounded step if one is due; True while the round has more to do."""
        if not self.wants_step(mono):
            return self.busy
        if not self._tasks:
            self._tasks = ["ttl_changes", "ttl_decisions", "ttl_events", "cap", "vacuum"]
            self._next_round = mono + self.policy.interval_s
            self.stats.rounds += 1
        task = self._tasks[0]
        started = time.perf_counter()
        try:
            more = self._run(task, conn, now_ns)
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            self.stats.errors += 1
            log.warning("memory aging step %s failed: %s", task, exc)
            more = False
        elapsed = time.perf_counter() - started
        self._account(elapsed)
        if not more:
            self._tasks.pop(0)
        # Leave the writer at least 3x the step's time for commits before the next step.
        self._next_step = time.monotonic() + max(3 * elapsed, 0.0002)
        return self.busy

    def run_until_idle(
        self, conn: sqlite3.Connection, now_ns: int, max_steps: int = 1_000_000
    ) -> int:
        """Run a whole round now, step after step (tests, tools). Returns the steps taken."""
        self._next_round = 0.0
        self._next_step = 0.0
        steps = 0
        self.step(conn, now_ns, time.monotonic())
        steps += 1
        while self._tasks and steps < max_steps:
            self._next_step = 0.0
            self.step(conn, now_ns, time.monotonic())
            steps += 1
        return steps

    def _account(self, elapsed: float) -> None:
        us = elapsed * 1e6
        self.recent_us.append(us)
        self.stats.steps += 1
        self.stats.total_step_us += us
        self.stats.max_step_us = max(self.stats.max_step_us, us)
        budget = self.policy.step_budget_s
        if elapsed > budget:
            self.stats.over_budget += 1
            self._rows = max(_MIN_ROWS, self._rows // 2)
            self._pages = max(1, self._pages // 2)
        elif elapsed < budget / 3:
            self._rows = min(_MAX_ROWS, self._rows * 2)
            self._pages = min(4096, self._pages * 2)

    def _run(self, task: str, conn: sqlite3.Connection, now_ns: int) -> bool:
        handlers: dict[str, Callable[[sqlite3.Connection, int], bool]] = {
            "ttl_changes": self._ttl_changes,
            "ttl_decisions": lambda c, n: self._ttl_table(c, n, "decisions"),
            "ttl_events": lambda c, n: self._ttl_table(c, n, "events"),
            "cap": self._cap,
            "vacuum": self._vacuum,
        }
        return handlers[task](conn, now_ns)

    # TTL

    def _ttl_changes(self, conn: sqlite3.Connection, now_ns: int) -> bool:
        if now_ns <= 0:
            return False
        cutoff = now_ns - self.policy.ttl_ns
        anchor = conn.execute(
            "SELECT t_ns, change_id FROM keyframes WHERE t_ns <= ? ORDER BY t_ns DESC LIMIT 1",
            (cutoff,),
        ).fetchone()
        if anchor is None:
            return False
        anchor_t, anchor_id = int(anchor[0]), int(anchor[1])
        lo = conn.execute("SELECT id FROM changes ORDER BY id LIMIT 1").fetchone()
        with _transaction(conn):
            if lo is not None and int(lo[0]) < anchor_id:
                hi = min(int(lo[0]) + self._rows, anchor_id)
                cur = conn.execute("DELETE FROM changes WHERE id < ?", (hi,))
                self.stats.ttl_rows += cur.rowcount
                return True
            # Rows are gone up to the anchor: now the small tables (bounded as well).
            cur = conn.execute(
                "DELETE FROM keyframes WHERE t_ns IN "
                "(SELECT t_ns FROM keyframes WHERE t_ns < ? ORDER BY t_ns LIMIT ?)",
                (anchor_t, self._rows),
            )
            more = cur.rowcount >= self._rows
            conn.execute("DELETE FROM gaps WHERE end_ns <= ?", (anchor_t,))
            conn.execute(
                "DELETE FROM chunk_access WHERE chunk < ?", (anchor_t // self.policy.chunk_ns,)
            )
        return more

    def _ttl_table(self, conn: sqlite3.Connection, now_ns: int, table: str) -> bool:
        if now_ns <= 0:
            return False
        cutoff = now_ns - self.policy.ttl_ns
        first = conn.execute(
            f"SELECT id, t_ns FROM {table} ORDER BY id LIMIT 1"  # noqa: S608 - fixed names
        ).fetchone()
        if first is None or int(first[1]) >= cutoff:
            return False
        with _transaction(conn):
            cur = conn.execute(
                f"DELETE FROM {table} WHERE id < ? AND t_ns < ?",  # noqa: S608
                (int(first[0]) + self._rows, cutoff),
            )
        if table == "decisions":
            self.stats.ttl_decisions += cur.rowcount
        else:
            self.stats.ttl_events += cur.rowcount
        return cur.rowcount > 0

    # size cap

    def _used_bytes(self, conn: sqlite3.Connection) -> tuple[int, int]:
        page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
        pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
        free = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
        return (pages - free) * page_size, pages * page_size

    def _cap(self, conn: sqlite3.Connection, now_ns: int) -> bool:
        if self._evicting is not None:
            return self._evict_rows(conn)
        used, _ = self._used_bytes(conn)
        cap = self.policy.max_bytes
        if used > cap:
            self._shrinking = True
        if not self._shrinking or used <= cap * _LOW_WATER:
            self._shrinking = False
            return False
        victim = self._pick(conn)
        if victim is None:
            self._shrinking = False
            self.stats.cap_unreachable += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "memory store uses %d bytes, over max_bytes=%d, and only the newest chunk "
                    "is left: raise max_bytes or lower aging_chunk_s",
                    used,
                    cap,
                )
            return False
        with _transaction(conn):
            conn.execute(
                "INSERT INTO gaps(start_ns, end_ns, reason) VALUES (?, ?, 'evicted')",
                (victim.start_ns, victim.end_ns),
            )
            conn.execute(
                "DELETE FROM keyframes WHERE t_ns >= ? AND t_ns < ?",
                (victim.start_ns, victim.end_ns),
            )
            conn.execute("DELETE FROM chunk_access WHERE chunk = ?", (victim.chunk,))
        self._evicting = victim
        self.stats.evicted_chunks += 1
        log.info(
            "memory size cap: evicting chunk %d (%d bytes used, cap %d)", victim.chunk, used, cap
        )
        return True

    def _pick(self, conn: sqlite3.Connection) -> _Eviction | None:
        chunk_ns = self.policy.chunk_ns
        chunks = conn.execute(
            "SELECT t_ns / ? AS c, min(t_ns), min(change_id) FROM keyframes GROUP BY c ORDER BY c",
            (chunk_ns,),
        ).fetchall()
        if len(chunks) < 2:
            return None
        access = dict(conn.execute("SELECT chunk, last_access_ns FROM chunk_access").fetchall())
        best: tuple[int, int] | None = None
        for i in range(len(chunks) - 1):  # never the newest: it is being written
            c = int(chunks[i][0])
            end_ns = int(chunks[i + 1][1])
            recency = max(end_ns, int(access.get(c, 0)))
            if best is None or recency < best[0]:
                best = (recency, i)
        assert best is not None
        i = best[1]
        return _Eviction(
            chunk=int(chunks[i][0]),
            start_ns=int(chunks[i][1]),
            end_ns=int(chunks[i + 1][1]),
            lo_id=int(chunks[i][2]),
            next_id=int(chunks[i + 1][2]),
        )

    def _evict_rows(self, conn: sqlite3.Connection) -> bool:
        ev = self._evicting
        assert ev is not None
        with _transaction(conn):
            if ev.lo_id < ev.next_id:
                hi = min(ev.lo_id + self._rows, ev.next_id)
                cur = conn.execute("DELETE FROM changes WHERE id >= ? AND id < ?", (ev.lo_id, hi))
                self.stats.evicted_rows += cur.rowcount
                ev.lo_id = hi
                return True
            deleted = 0
            for table in ("decisions", "events"):
                cur = conn.execute(
                    f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} "  # noqa: S608
                    "WHERE t_ns >= ? AND t_ns < ? LIMIT ?)",
                    (ev.start_ns, ev.end_ns, self._rows),
                )
                deleted += cur.rowcount
            if deleted:
                return True
        self._evicting = None
        return True  # look at the size again

    def _vacuum(self, conn: sqlite3.Connection, now_ns: int) -> bool:
        if int(conn.execute("PRAGMA auto_vacuum").fetchone()[0]) != 2:
            return False
        free = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
        _, file_bytes = self._used_bytes(conn)
        if free == 0 or file_bytes <= self.policy.max_bytes:
            return False
        n = min(free, self._pages)
        conn.execute(f"PRAGMA incremental_vacuum({n})").fetchall()
        self.stats.vacuumed_pages += n
        return True

    def stats_dict(self) -> dict[str, Any]:
        s = self.stats
        recent = sorted(self.recent_us)
        return {
            "rounds": s.rounds,
            "p50_step_us": round(recent[len(recent) // 2], 1) if recent else 0.0,
            "p99_step_us": round(recent[int(len(recent) * 0.99)], 1) if recent else 0.0,
            "steps": s.steps,
            "over_budget_steps": s.over_budget,
            "max_step_us": round(s.max_step_us, 1),
            "mean_step_us": round(s.total_step_us / s.steps, 1) if s.steps else 0.0,
            "ttl_rows": s.ttl_rows,
            "ttl_decisions": s.ttl_decisions,
            "ttl_events": s.ttl_events,
            "evicted_chunks": s.evicted_chunks,
            "evicted_rows": s.evicted_rows,
            "vacuumed_pages": s.vacuumed_pages,
            "cap_unreachable": s.cap_unreachable,
            "errors": s.errors,
            "rows_per_step": self._rows,
        }


class _transaction:  # noqa: N801 - used like a function: ``with _transaction(conn):``
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on error)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.conn.execute("COMMIT")
        else:
            self.conn.execute("ROLLBACK")


__all__ = ["Aging", "AgingPolicy", "AgingStats"]
