"""The durable outbox every uplink data message passes through, and the boot session.

A message gets its ``(boot_id, seq)`` when it enters the outbox and keeps them, so a replay
after a restart keeps its numbers and the fleet sees one gap-free stream per boot. SQLite
WAL, one short transaction per put, bounded by bytes with every drop counted per kind; how
rows leave it and what is kept: :class:`Outbox`.

Design: ``docs/ARCHITECTURE.md``, "Uplink and fleet ingest" (*Stored, not just delivered*).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from edge_agent.memory._fs import fsync_dir, sidecars, utc_stamp
from edge_agent.uplink.errors import OutboxError

log = logging.getLogger(__name__)

_SCHEMA_VERSION = 3
#: Previous boots kept for their epitaph (see :meth:`Outbox.previous_boots`).
MAX_PREVIOUS_BOOTS = 16
_BUSY_TIMEOUT_S = 5.0
#: The kind dropped first when the outbox is over ``max_bytes``.
DROPPABLE = "telemetry"


_NUMBERED = "UPDATE boots SET next_seq = MAX(next_seq, ?) WHERE boot_id = ?"
_COUNTS = (
    "SELECT COUNT(*), COALESCE(SUM(bytes), 0), "
    "COALESCE(SUM(CASE WHEN kind = ? THEN bytes ELSE 0 END), 0), "
    "COUNT(acked_ns) FROM outbox"
)


class OutboxRow(NamedTuple):
    id: int
    kind: str
    topic: str
    payload: bytes
    boot_id: str
    seq: int
    bytes: int
    t_ns: int


@dataclass(slots=True)
class _Counts:
    """The outbox's running totals while a transaction changes them."""

    rows: int
    total: int
    droppable: int
    awaiting: int


class Session:
    """The numbers of this boot: a fresh ``boot_id`` (uuid4 hex) and a gap-free ``seq``.

    ``seq`` counts data messages (telemetry, decision, ota/status) from 0. State messages
    use :attr:`watermark` instead (see :mod:`wire.messages`).
    """

    def __init__(self, boot_id: str | None = None) -> None:
        self.boot_id = boot_id if boot_id is not None else uuid.uuid4().hex
        #: The seq the next data message gets.
        self.next_seq = 0

    def take(self) -> int:
        """Assign the next seq (call only once the message is built: seqs must not skip)."""
        seq = self.next_seq
        self.next_seq += 1
        return seq

    @property
    def watermark(self) -> int:
        """How many seqs were assigned (the next one): what state messages carry."""
        return self.next_seq


class Outbox:
    """SQLite outbox (one writer: the agent's event loop thread). Raises :class:`OutboxError`
    only from the constructor; :meth:`put` and :meth:`ack` log, count and carry on.

    A message gets its ``(boot_id, seq)`` when it enters the outbox and keeps them, so a replay
    after a restart keeps its numbers and the fleet's idempotent ingest sees one gap-free stream
    per boot. SQLite WAL (``synchronous=NORMAL``), one short transaction per put, inline on the
    loop. Bounded by bytes (telemetry goes first; decisions and OTA status have a reserve),
    every drop counted per kind (:meth:`Outbox.stats`); a corrupt file is moved aside; the
    ``boots`` table keeps each boot's final count for the epitaph. A row the broker acknowledged
    is deleted then, or, once the fleet confirms what it stores, kept (``acked_ns`` set) until
    the fleet's ``cmd/stored`` names it (:meth:`Outbox.confirm`). The policy and why:
    ``docs/ARCHITECTURE.md``, sections "Uplink and fleet ingest" and "Stored, not just
    delivered".
    """

    def __init__(
        self,
        path: str | Path,
        *,
        boot_id: str,
        max_bytes: int = 64 << 20,
        reserve_bytes: int = 16 << 20,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.path = Path(path)
        self.boot_id = boot_id
        self.max_bytes = max_bytes
        self.hard_cap = max_bytes + reserve_bytes
        self._clock_ns = clock_ns
        self.dropped: dict[str, int] = {}
        self.put_errors = 0
        self.last_error: str | None = None
        #: Where a corrupt outbox found at start was moved (it was then started empty).
        self.corrupt_moved_to: Path | None = None
        self.corrupt_recoveries = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                row = self._open()
            except sqlite3.OperationalError:
                raise  # locked, I/O, permissions: not the file's content; leave it be
            except sqlite3.DatabaseError as exc:
                # "file is not a database", "database disk image is malformed": as the
                # memory store does, keep the file aside for a post-mortem and start empty
                # (its undelivered rows are lost, which the fleet sees as a seq gap).
                conn = getattr(self, "_conn", None)
                if conn is not None:
                    conn.close()
                self.corrupt_moved_to = self._move_aside(exc)
                self.corrupt_recoveries += 1
                row = self._open()
        except sqlite3.Error as exc:
            raise OutboxError(f"{self.path}: cannot open the outbox: {exc}") from exc
        except OSError as exc:
            raise OutboxError(f"{self.path}: cannot open the outbox: {exc}") from exc
        self._rows, self._bytes, self._droppable_bytes = int(row[0]), int(row[1]), int(row[2])
        #: Rows the broker acknowledged that wait for the fleet's confirmation.
        self._awaiting = int(row[3])
        #: Rows the fleet's ``cmd/stored`` confirmed (deleted), since start.
        self.confirmed = 0
        #: Whether a fleet ever confirmed a row of this outbox: from then on, in the ``auto``
        #: delivery mode, rows are kept after their PUBACK. Remembered in ``meta``.
        self.fleet_confirms = self._flag("fleet_confirms")
        try:
            self._start_boot()
        except sqlite3.Error as exc:
            raise OutboxError(f"{self.path}: cannot record this boot: {exc}") from exc

    def _start_boot(self) -> None:
        """Record this boot; forget earlier ones that numbered nothing (no tail to lose)
        and all but the newest MAX_PREVIOUS_BOOTS others."""
        with self._tx():
            self._conn.execute("DELETE FROM boots WHERE next_seq = 0")
            self._conn.execute(
                "DELETE FROM boots WHERE boot_id NOT IN "
                "(SELECT boot_id FROM boots ORDER BY started_ns DESC LIMIT ?)",
                (MAX_PREVIOUS_BOOTS,),
            )
            self._conn.execute(
                "INSERT OR IGNORE INTO boots (boot_id, next_seq, started_ns) VALUES (?, 0, ?)",
                (self.boot_id, self._clock_ns()),
            )

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        """One write transaction (``BEGIN IMMEDIATE``), rolled back on any exception."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._conn.execute("COMMIT")
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise

    def _open(self) -> tuple[int, int, int, int]:
        # check_same_thread=False: the uplink closes it from a worker thread at exit.
        self._conn = sqlite3.connect(
            self.path, isolation_level=None, timeout=_BUSY_TIMEOUT_S, check_same_thread=False
        )
        mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise OutboxError(f"{self.path}: cannot switch to WAL (journal_mode={mode})")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA journal_size_limit=4194304")
        self._migrate()
        row = self._conn.execute(_COUNTS, (DROPPABLE,)).fetchone()
        return int(row[0]), int(row[1]), int(row[2]), int(row[3])

    def _move_aside(self, problem: Exception) -> Path:
        """``outbox.db`` -> ``outbox.db.corrupt-<stamp>`` with its -wal/-shm; fsync the dir."""
        stamp = utc_stamp(self._clock_ns())
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        os.replace(self.path, aside)
        for side in sidecars(self.path):
            if side.exists():
                os.replace(side, side.with_name(f"{side.name}.corrupt-{stamp}"))
        fsync_dir(self.path.parent)
        log.error(
            "uplink outbox %s is corrupt (%s); moved aside to %s, starting empty",
            self.path,
            problem,
            aside,
        )
        return aside

    def _migrate(self) -> None:
        found = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
        if found > _SCHEMA_VERSION:
            raise OutboxError(
                f"{self.path}: schema version {found} is newer than this build "
                f"({_SCHEMA_VERSION}); left alone"
            )
        if found == _SCHEMA_VERSION:
            return
        self._conn.execute("BEGIN IMMEDIATE")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS outbox ("
            " id INTEGER PRIMARY KEY AUTOINCREMENT,"
            " kind TEXT NOT NULL, topic TEXT NOT NULL, payload BLOB NOT NULL,"
            " boot_id TEXT NOT NULL, seq INTEGER NOT NULL,"
            " bytes INTEGER NOT NULL, t_ns INTEGER NOT NULL, acked_ns INTEGER)"
        )
        # v3: when the broker acknowledged a row kept for the fleet's confirmation.
        columns = {r[1] for r in self._conn.execute("PRAGMA table_info(outbox)")}
        if "acked_ns" not in columns:
            self._conn.execute("ALTER TABLE outbox ADD COLUMN acked_ns INTEGER")
        self._conn.execute("CREATE INDEX IF NOT EXISTS outbox_seq ON outbox (boot_id, seq)")
        self._conn.execute(
            "CREATE INDEX IF NOT EXISTS outbox_acked ON outbox (acked_ns)"
            " WHERE acked_ns IS NOT NULL"
        )
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
        )
        # The telemetry trim walks this index instead of the whole table.
        self._conn.execute("CREATE INDEX IF NOT EXISTS outbox_kind ON outbox (kind, id)")
        # v2: how many seqs each boot numbered, until the fleet was told (the epitaph).
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS boots ("
            " boot_id TEXT PRIMARY KEY, next_seq INTEGER NOT NULL,"
            " clean INTEGER NOT NULL DEFAULT 0, started_ns INTEGER NOT NULL)"
        )
        self._conn.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        self._conn.execute("COMMIT")

    # -- writing ----------------------------------------------------------------------------

    def put(self, kind: str, topic: str, payload: bytes, seq: int) -> bool:
        """Store one message of this boot; ``False`` if it was dropped (cap or I/O error).

        A message bigger than its own cap (``max_bytes`` for telemetry, the hard cap for the
        other kinds) could never be kept: it is refused before the insert, so it cannot trim
        the backlog away on its way out.
        """
        size = len(payload) + len(topic)
        cap = self.max_bytes if kind == DROPPABLE else self.hard_cap
        if size > cap:
            self._numbered(seq)
            self.dropped[kind] = self.dropped.get(kind, 0) + 1
            self.last_error = f"outbox put: a {kind} message of {size} bytes is over its cap"
            log.error(
                "uplink outbox %s: dropped a %s message of %d bytes: over its cap of %d bytes"
                " (backlog left alone)",
                self.path,
                kind,
                size,
                cap,
            )
            return False
        try:
            with self._tx():
                cur = self._conn.execute(
                    "INSERT INTO outbox (kind, topic, payload, boot_id, seq, bytes, t_ns)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (kind, topic, payload, self.boot_id, seq, size, self._clock_ns()),
                )
                new_id = cur.lastrowid
                self._conn.execute(_NUMBERED, (seq + 1, self.boot_id))
                counts = _Counts(
                    self._rows + 1,
                    self._bytes + size,
                    self._droppable_bytes + (size if kind == DROPPABLE else 0),
                    self._awaiting,
                )
                gone: dict[str, int] = {}
                kept = self._trim(counts, gone, new_id)
        except sqlite3.Error as exc:
            self.put_errors += 1
            self.dropped[kind] = self.dropped.get(kind, 0) + 1
            self.last_error = f"outbox put: {exc}"
            log.error("uplink outbox %s: cannot store a %s message: %s", self.path, kind, exc)
            return False
        self._rows, self._bytes = counts.rows, counts.total
        self._droppable_bytes, self._awaiting = counts.droppable, counts.awaiting
        for k, n in gone.items():
            self.dropped[k] = self.dropped.get(k, 0) + n
        if gone:
            log.warning(
                "uplink outbox over its cap: dropped %s (oldest first)",
                ", ".join(f"{n} {k}" for k, n in sorted(gone.items())),
            )
        return kept

    def _trim(self, c: _Counts, gone: dict[str, int], new_id: int | None) -> bool:
        """Delete the oldest telemetry while over ``max_bytes``, then the oldest of any kind
        while over the hard cap (in the caller's transaction), counting each in ``gone``
        and out of ``c``. False if the row ``new_id`` itself went."""
        kept = True
        for kind, cap in ((DROPPABLE, self.max_bytes), (None, self.hard_cap)):
            if c.total <= cap or (kind is not None and c.droppable <= 0):
                continue
            for rid, rkind, rbytes, acked in self._oldest(kind):
                if c.total <= cap:
                    break
                self._conn.execute("DELETE FROM outbox WHERE id = ?", (rid,))
                c.rows, c.total, c.awaiting = c.rows - 1, c.total - rbytes, c.awaiting - acked
                if rkind == DROPPABLE:
                    c.droppable -= rbytes
                gone[rkind] = gone.get(rkind, 0) + 1
                kept = kept and rid != new_id
        return kept

    def _numbered(self, seq: int) -> None:
        """Record that this boot numbered ``seq`` although the message was not stored."""
        try:
            self._conn.execute(_NUMBERED, (seq + 1, self.boot_id))
        except sqlite3.Error as exc:
            self.last_error = f"outbox boots: {exc}"

    def previous_boots(self) -> list[tuple[str, int, bool]]:
        """``(boot_id, seqs numbered, stopped cleanly)`` of earlier boots the fleet may not
        know the end of, oldest first. The uplink tells the fleet (an epitaph: a state
        message of that boot with its final watermark) and then :meth:`forget_boot`.

        A boot killed or cut off from the broker ends with a Last Will made at its last
        connect, or with nothing; what it numbered after that, if the broker dropped it on
        the way to the ingest, would be a hole no one could see: the tail of that boot.
        ``[]`` on an I/O error (the epitaph waits for the next start)."""
        try:
            rows = self._conn.execute(
                "SELECT boot_id, next_seq, clean FROM boots WHERE boot_id != ? AND next_seq > 0"
                " ORDER BY started_ns",
                (self.boot_id,),
            ).fetchall()
        except sqlite3.Error as exc:
            self.last_error = f"outbox boots: {exc}"
            return []
        return [(str(b), int(n), bool(c)) for b, n, c in rows]

    def forget_boot(self, boot_id: str) -> None:
        """The fleet has the epitaph of ``boot_id`` (its broker acknowledged it)."""
        try:
            self._conn.execute("DELETE FROM boots WHERE boot_id = ?", (boot_id,))
        except sqlite3.Error as exc:
            self.last_error = f"outbox boots: {exc}"

    def held(self, boot_id: str) -> int | None:
        """The lowest seq of ``boot_id`` still in the outbox (None: none is, or an I/O
        error; the caller then reports the boot's count)."""
        try:
            row = self._conn.execute(
                "SELECT MIN(seq) FROM outbox WHERE boot_id = ?", (boot_id,)
            ).fetchone()
        except sqlite3.Error as exc:
            self.last_error = f"outbox held: {exc}"
            return None
        return None if row is None or row[0] is None else int(row[0])

    def stopped_clean(self) -> None:
        """This boot stops cleanly (its epitaph will say ``clean``)."""
        try:
            self._conn.execute("UPDATE boots SET clean = 1 WHERE boot_id = ?", (self.boot_id,))
        except sqlite3.Error as exc:
            self.last_error = f"outbox boots: {exc}"

    def _oldest(self, kind: str | None) -> Iterable[tuple[int, str, int, int]]:
        """Oldest rows (of ``kind``, or of any kind), in pages, for the trim loops:
        ``(id, kind, bytes, 1 if it waits for the fleet's confirmation else 0)``."""
        after = 0
        while True:
            if kind is None:
                page = self._conn.execute(
                    "SELECT id, kind, bytes, acked_ns IS NOT NULL FROM outbox WHERE id > ?"
                    " ORDER BY id LIMIT 256",
                    (after,),
                ).fetchall()
            else:
                page = self._conn.execute(
                    "SELECT id, kind, bytes, acked_ns IS NOT NULL FROM outbox"
                    " WHERE kind = ? AND id > ? ORDER BY id LIMIT 256",
                    (kind, after),
                ).fetchall()
            if not page:
                return
            for rid, rkind, rbytes, acked in page:
                yield int(rid), str(rkind), int(rbytes), int(acked)
            after = int(page[-1][0])

    def ack(self, ids: Iterable[int]) -> int:
        """Delete delivered rows (their PUBACK arrived); returns how many were still there."""
        wanted = list(ids)
        if not wanted:
            return 0
        deleted = 0
        try:
            with self._tx():
                for rid in wanted:
                    row = self._conn.execute(
                        "DELETE FROM outbox WHERE id = ? RETURNING kind, bytes, acked_ns", (rid,)
                    ).fetchone()
                    if row is not None:
                        deleted += 1
                        self._forget(row)
        except sqlite3.Error as exc:
            # The rows stay and are sent again after the next reconnect: a duplicate, which
            # the fleet's idempotent ingest absorbs, rather than a loss.
            self.last_error = f"outbox ack: {exc}"
            log.error("uplink outbox %s: cannot delete acked rows: %s", self.path, exc)
            self._recount()
            return 0
        return deleted

    def _forget(self, row: tuple[str, int, int | None]) -> None:
        """Count out a deleted row (its ``kind, bytes, acked_ns``)."""
        self._rows -= 1
        self._bytes -= int(row[1])
        if row[0] == DROPPABLE:
            self._droppable_bytes -= int(row[1])
        if row[2] is not None:
            self._awaiting -= 1

    def mark_acked(self, ids: Iterable[int]) -> int:
        """The broker acknowledged these rows: keep them until the fleet confirms them
        (:meth:`confirm`), stamped with now. Returns how many were still there."""
        wanted = [(self._clock_ns(), rid) for rid in ids]
        if not wanted:
            return 0
        marked = newly = 0
        try:
            with self._tx():
                for now, rid in wanted:
                    cur = self._conn.execute(
                        "UPDATE outbox SET acked_ns = ? WHERE id = ? AND acked_ns IS NULL",
                        (now, rid),
                    )
                    if cur.rowcount == 1:
                        newly += 1
                    else:  # sent again (stale): its wait starts over
                        cur = self._conn.execute(
                            "UPDATE outbox SET acked_ns = ? WHERE id = ?", (now, rid)
                        )
                    marked += cur.rowcount
        except sqlite3.Error as exc:
            self.last_error = f"outbox ack: {exc}"
            log.error("uplink outbox %s: cannot mark acked rows: %s", self.path, exc)
            self._recount()
            return 0
        self._awaiting += newly
        return marked

    def confirm(self, boot_id: str, ranges: Iterable[tuple[int, int]]) -> tuple[int, int]:
        """The fleet stored seqs ``first..last`` of ``boot_id``: delete those rows, acked or
        not. Returns ``(rows deleted, the latest acked_ns among them or 0)``."""
        deleted = latest = 0
        try:
            with self._tx():
                for first, last in ranges:
                    for row in self._conn.execute(
                        "DELETE FROM outbox WHERE boot_id = ? AND seq BETWEEN ? AND ?"
                        " RETURNING kind, bytes, acked_ns",
                        (boot_id, first, last),
                    ).fetchall():
                        deleted += 1
                        self._forget(row)
                        if row[2] is not None:
                            latest = max(latest, int(row[2]))
                if not self.fleet_confirms:
                    self._conn.execute(
                        "INSERT OR REPLACE INTO meta (key, value) VALUES ('fleet_confirms', '1')"
                    )
        except sqlite3.Error as exc:
            # The rows stay and are sent again later: a duplicate, not a loss.
            self.last_error = f"outbox confirm: {exc}"
            log.error("uplink outbox %s: cannot delete confirmed rows: %s", self.path, exc)
            self._recount()
            return 0, 0
        self.fleet_confirms = True
        self.confirmed += deleted
        return deleted, latest

    def _flag(self, key: str) -> bool:
        """Whether ``meta`` holds ``key`` (False on an I/O error)."""
        try:
            return (
                self._conn.execute("SELECT 1 FROM meta WHERE key = ?", (key,)).fetchone()
                is not None
            )
        except sqlite3.Error:
            return False

    def stale(self, acked_before_ns: int, limit: int) -> list[OutboxRow]:
        """Up to ``limit`` rows, oldest first, that the broker acknowledged before
        ``acked_before_ns`` and the fleet has not confirmed: to send again. Each is stamped
        with now, so it is not picked again before its new acknowledgement ages too."""
        try:
            with self._tx():
                rows = self._conn.execute(
                    "SELECT id, kind, topic, payload, boot_id, seq, bytes, t_ns FROM outbox"
                    " WHERE acked_ns < ? ORDER BY id LIMIT ?",
                    (acked_before_ns, limit),
                ).fetchall()
                now = self._clock_ns()
                self._conn.executemany(
                    "UPDATE outbox SET acked_ns = ? WHERE id = ?", [(now, r[0]) for r in rows]
                )
        except sqlite3.Error as exc:
            self.last_error = f"outbox stale: {exc}"
            return []
        return [_row(r) for r in rows]

    def resume_after(self) -> int:
        """Where sending starts on a new connection when acked rows are kept: just before
        the oldest row the broker never acknowledged (or past every row), so rows waiting
        for the fleet's confirmation are not all sent again at every reconnect (they are
        sent again by :meth:`stale` when the fleet shows it lost them). 0 on an I/O error."""
        try:
            row = self._conn.execute(
                "SELECT COALESCE(MIN(CASE WHEN acked_ns IS NULL THEN id END) - 1, MAX(id), 0)"
                " FROM outbox"
            ).fetchone()
        except sqlite3.Error as exc:
            self.last_error = f"outbox resume: {exc}"
            return 0
        return int(row[0])

    @property
    def awaiting(self) -> int:
        """Rows the broker acknowledged that wait for the fleet's confirmation."""
        return self._awaiting

    def _recount(self) -> None:
        try:
            row = self._conn.execute(_COUNTS, (DROPPABLE,)).fetchone()
        except sqlite3.Error:
            return
        self._rows, self._bytes, self._droppable_bytes = int(row[0]), int(row[1]), int(row[2])
        self._awaiting = int(row[3])

    # -- reading ----------------------------------------------------------------------------

    def peek(self, after_id: int = 0, limit: int = 32) -> list[OutboxRow]:
        """Up to ``limit`` rows with ``id > after_id``, oldest first. ``[]`` on an I/O error."""
        try:
            rows = self._conn.execute(
                "SELECT id, kind, topic, payload, boot_id, seq, bytes, t_ns FROM outbox"
                " WHERE id > ? ORDER BY id LIMIT ?",
                (after_id, limit),
            ).fetchall()
        except sqlite3.Error as exc:
            self.last_error = f"outbox peek: {exc}"
            log.error("uplink outbox %s: cannot read: %s", self.path, exc)
            return []
        return [_row(r) for r in rows]

    def __len__(self) -> int:
        return self._rows

    def stats(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "rows": self._rows,
            "bytes": self._bytes,
            "telemetry_bytes": self._droppable_bytes,
            "awaiting_confirmation": self._awaiting,
            "confirmed": self.confirmed,
            "max_bytes": self.max_bytes,
            "hard_cap_bytes": self.hard_cap,
            "dropped": dict(self.dropped),
            "put_errors": self.put_errors,
            "last_error": self.last_error,
            "corrupt_recoveries": self.corrupt_recoveries,
            "corrupt_moved_to": str(self.corrupt_moved_to) if self.corrupt_moved_to else None,
        }

    def close(self) -> None:
        try:
            self._conn.close()
        except sqlite3.Error as exc:
            log.warning("uplink outbox %s: close failed: %s", self.path, exc)


def _row(r: tuple[object, ...]) -> OutboxRow:
    return OutboxRow(
        int(r[0]),  # type: ignore[call-overload]
        str(r[1]),
        str(r[2]),
        bytes(r[3]),  # type: ignore[call-overload]
        str(r[4]),
        int(r[5]),  # type: ignore[call-overload]
        int(r[6]),  # type: ignore[call-overload]
        int(r[7]),  # type: ignore[call-overload]
    )


__all__ = ["DROPPABLE", "Outbox", "OutboxRow", "Session"]
