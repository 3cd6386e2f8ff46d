"""Stored seq runs: what ``fleet gaps`` reads instead of every stored key.

A device numbers its data messages per boot (``seq`` from 0). The gaps of a boot are the
seqs it assigned that the store does not hold, so finding them from the keys means reading
every key the store holds for the device: 8,640 a day at one message per 10 s, 260,000 with
30 days kept, about a second per device page. ``seq_runs`` holds the same knowledge in a
few rows per boot.

The one invariant: a row ``(device, boot_id, low, high, high_t)`` says every seq from
``low`` to ``high`` was stored (``high_t``: the ``t_ns`` of the highest). Rows may overlap
or touch: the union of a boot's rows is the set of its stored seqs, and the gap query
(:func:`gaps_sql`) works on that union. Correctness never depends on rows being merged;
merging only keeps them few.

- The ingest adds, in the transaction that inserts the messages, one row per run of the
  batch's new seqs (:func:`runs_of`). A run that starts right after a row the store holds
  (``high = low - 1``, the usual case: a device's next message) is written as that row
  extended (the same ``low``, a higher ``high``: an upsert on the primary key), so a boot
  that sends in order keeps one row. Each statement is true whatever another worker does
  meanwhile: an extension claims only seqs the extended row claimed plus the run's own, and
  an upsert only ever raises ``high``. Two workers storing one device's consecutive messages
  at the same moment leave two touching rows; a hole filled late leaves a row between two
  others.
- :func:`merged` folds such rows (``fleet serve``'s history loop, ``compact_runs`` on the
  store), one boot at a time, under the rows' locks taken in key order, the order the
  ingest's upsert locks them in; it deletes exactly the rows it read (by key), so a fold
  running beside another on a second node never removes a row it did not fold.
- Retention drops rows wholly older than the newest cut, which the gap query would not
  report from anyway (see :func:`gaps_sql`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

#: One run: device, boot_id, low, high, high_t.
Run = tuple[str, str, int, int, int]


def runs_of(messages: Iterable[Sequence[Any]], new: set[tuple[str, str, int]]) -> list[Run]:
    """The runs of consecutive seqs among the messages whose key is in ``new`` (the ones
    this batch inserted), per (device, boot_id), ordered by key. ``messages``: rows that
    start ``(device, boot_id, seq, kind, t_ns)``, as :class:`fleet.store._common.Batch`'s."""
    keyed = sorted(
        (str(m[0]), str(m[1]), int(m[2]), int(m[4])) for m in messages if (m[0], m[1], m[2]) in new
    )
    runs: list[Run] = []
    for device, boot, seq, t in keyed:
        if runs:
            d, b, low, high, _ = runs[-1]
            if d == device and b == boot and seq == high + 1:
                runs[-1] = (d, b, low, seq, t)
                continue
        runs.append((device, boot, seq, seq, t))
    return runs


def merged(rows: Iterable[Run]) -> list[Run]:
    """``rows`` with overlapping or touching rows of one boot folded into one: the same
    union of seqs in as few rows as it takes, ordered by key. The fold keeps the lowest
    ``low`` (so it lands on a row that was there) and the ``high_t`` of the highest ``high``."""
    out: list[Run] = []
    for device, boot, low, high, high_t in sorted(rows):
        if out:
            d, b, lo, hi, _ = out[-1]
            if d == device and b == boot and low <= hi + 1:
                if high > hi:
                    out[-1] = (d, b, lo, high, high_t)
                continue
        out.append((device, boot, low, high, high_t))
    return out


#: The ingest's upsert of one run, written with ``?`` (SQLite; PostgreSQL sends the batch's
#: runs as arrays, :data:`INSERT_RUNS_PG`). Arguments: device, boot_id, low, high, high_t.
#: The row it extends: one of the boot's rows ending right below ``low`` (the lowest such).
INSERT_RUN = """
INSERT INTO seq_runs (device, boot_id, low, high, high_t)
SELECT ?1, ?2, COALESCE((SELECT MIN(r.low) FROM seq_runs r
                         WHERE r.device = ?1 AND r.boot_id = ?2 AND r.high = ?3 - 1), ?3), ?4, ?5
WHERE true
ON CONFLICT (device, boot_id, low) DO UPDATE SET
    high_t = CASE WHEN excluded.high > seq_runs.high THEN excluded.high_t
             ELSE seq_runs.high_t END,
    high = MAX(seq_runs.high, excluded.high)
"""

#: The same for a whole batch in one statement: runs as five arrays. Two runs of a batch
#: can name the same row only when the store's rows are stale (a seq stored again after
#: retention cut it): they are grouped first, since an upsert may touch a row once. Sorted,
#: so that concurrent workers lock rows in one order.
INSERT_RUNS_PG = """
INSERT INTO seq_runs (device, boot_id, low, high, high_t)
SELECT device, boot_id, low, MAX(high), (ARRAY_AGG(high_t ORDER BY high DESC))[1]
FROM (
    SELECT b.device, b.boot_id, b.high, b.high_t,
           COALESCE((SELECT MIN(r.low) FROM seq_runs r WHERE r.device = b.device
                     AND r.boot_id = b.boot_id AND r.high = b.low - 1), b.low) AS low
    FROM unnest(%s::text[], %s::text[], %s::int8[], %s::int8[], %s::int8[])
         AS b (device, boot_id, low, high, high_t)
) AS runs
GROUP BY device, boot_id, low
ORDER BY device, boot_id, low
ON CONFLICT (device, boot_id, low) DO UPDATE SET
    high_t = CASE WHEN EXCLUDED.high > seq_runs.high THEN EXCLUDED.high_t
             ELSE seq_runs.high_t END,
    high = GREATEST(seq_runs.high, EXCLUDED.high)
"""

#: Boots whose rows could be fewer: a row that starts at or below one more than the
#: highest ``high`` before it. Bind the number of boots wanted.
FOLDABLE = """
SELECT DISTINCT device, boot_id FROM (
    SELECT device, boot_id, low,
           MAX(high) OVER (PARTITION BY device, boot_id ORDER BY low
                           ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
    FROM seq_runs
) AS r WHERE low <= before + 1
LIMIT ?
"""

#: One boot's rows, to fold (PostgreSQL appends ``FOR UPDATE``: locked in key order).
BOOT_RUNS = (
    "SELECT device, boot_id, low, high, high_t FROM seq_runs "
    "WHERE device = ? AND boot_id = ? ORDER BY low"
)
#: Exactly the rows read, by key: a row another fold wrote meanwhile is not this fold's.
DELETE_RUN = "DELETE FROM seq_runs WHERE device = ? AND boot_id = ? AND low = ?"
PUT_RUN = "INSERT INTO seq_runs (device, boot_id, low, high, high_t) VALUES (?, ?, ?, ?, ?)"

#: Rows wholly older than the newest cut of any kind (see :func:`gaps_sql`).
EXPIRE_RUNS = (
    "DELETE FROM seq_runs WHERE high_t < (SELECT COALESCE(MAX(floor_ns), 0) FROM history_floors)"
)


def fill_sql(keys: str) -> str:
    """The migration's first fill of ``seq_runs`` from the stored keys (``keys``:
    ``messages`` on SQLite, ``message_keys`` on PostgreSQL): one row per run of consecutive
    seqs (a seq minus its rank is the same along a run). ``high_t`` is the run's latest
    ``t_ns``, which is its highest seq's unless a device clock went back."""
    return f"""
INSERT INTO seq_runs (device, boot_id, low, high, high_t)
SELECT device, boot_id, MIN(seq), MAX(seq), MAX(t_ns) FROM (
    SELECT device, boot_id, seq, t_ns,
           seq - ROW_NUMBER() OVER (PARTITION BY device, boot_id ORDER BY seq) AS island
    FROM {keys}
) AS k GROUP BY device, boot_id, island
"""  # noqa: S608 - a table name of ours


def gaps_sql(by_device: bool) -> str:
    """Gap detection in one query over ``seq_runs``, per (device, boot): the head (seqs
    start at 0), the holes between the union of its runs (each run against the highest
    ``high`` before it), and the tail up to the boot's watermark (the number of seqs the
    device had assigned when it last sent a state message; see :mod:`wire.messages`),
    including a boot of which nothing arrived. Each with the boot's ``held`` for
    :func:`fleet.store._common.gap_rows`. Nothing retention may have cut is reported: no
    hole above runs all older than the newest cut (``history_floors``), no head or empty boot
    first heard of before it, no tail after a last message older than it. Written with
    ``?`` (see :meth:`fleet.store.sql.SqlStore._sql`).
    """
    where = "WHERE device = ?" if by_device else ""
    bwhere = "AND b.device = ?" if by_device else ""
    return f"""
WITH cut AS (
    SELECT COALESCE(MAX(floor_ns), 0) AS f FROM history_floors
),
ordered AS (
    SELECT device, boot_id, low, high, high_t,
           MAX(high) OVER w AS prev,
           MAX(high_t) OVER w AS prev_t
    FROM seq_runs {where}
    WINDOW w AS (PARTITION BY device, boot_id ORDER BY low, high
                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
),
holes AS (
    SELECT device, boot_id, prev + 1 AS first_missing, low - 1 AS last_missing
    FROM ordered WHERE prev IS NOT NULL AND low > prev + 1
      AND prev_t >= (SELECT f FROM cut)
),
spans AS (
    SELECT device, boot_id, MIN(low) AS low, MAX(high) AS top, MAX(high_t) AS top_t
    FROM ordered GROUP BY device, boot_id
),
heads AS (
    SELECT s.device, s.boot_id, 0 AS first_missing, s.low - 1 AS last_missing
    FROM spans s LEFT JOIN boots b ON b.device = s.device AND b.boot_id = s.boot_id
    WHERE s.low > 0 AND COALESCE(b.first_received_ns, 0) >= (SELECT f FROM cut)
),
tails AS (
    SELECT t.device, t.boot_id, t.top + 1 AS first_missing, b.watermark - 1 AS last_missing
    FROM spans t JOIN boots b ON b.device = t.device AND b.boot_id = t.boot_id
    WHERE b.watermark IS NOT NULL AND b.watermark - 1 > t.top
      AND t.top_t >= (SELECT f FROM cut)
),
empties AS (
    SELECT b.device, b.boot_id, 0 AS first_missing, b.watermark - 1 AS last_missing
    FROM boots b
    WHERE b.watermark IS NOT NULL AND b.watermark > 0 {bwhere}
      AND b.first_received_ns >= (SELECT f FROM cut)
      AND NOT EXISTS (SELECT 1 FROM spans s WHERE s.device = b.device AND s.boot_id = b.boot_id)
),
found AS (
    SELECT * FROM heads UNION ALL SELECT * FROM holes
    UNION ALL SELECT * FROM tails UNION ALL SELECT * FROM empties
)
SELECT f.device, f.boot_id, f.first_missing, f.last_missing, b.held
FROM found f LEFT JOIN boots b ON b.device = f.device AND b.boot_id = f.boot_id
ORDER BY f.device, b.first_received_ns, f.boot_id, f.first_missing
"""  # noqa: S608 - constant fragments; values are bound parameters
