"""The PostgreSQL store's history by day: the move of a v12 database onto partitions, the
partitions made ahead (taking their rows out of the default partition), ingest on them,
and retention dropping whole days. Against a real PostgreSQL, in a schema of its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from fleet.store.base import IngestResult, Quarantined, Row
from fleet.store.migrations import MIGRATIONS
from fleet.store.postgres import DAY_NS, PARTITION_DAYS_AHEAD, PostgresStore
from tests.support.fleet import decision, telemetry
from tests.support.pg import pg_schema_url
from wire import encode

pytestmark = pytest.mark.peers

#: A day boundary (2025-10-09 00:00 UTC) and an hour.
D0 = (1_760_000_000 * 10**9 // DAY_NS) * DAY_NS
HOUR = 3600 * 10**9
BOOT = "b" * 32


@pytest.fixture
def url() -> Iterator[str]:
    with pg_schema_url() as u:
        yield u


def _sql(url: str, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as db:
        cur = db.execute(statement.encode() if not params else statement, params)
        return cur.fetchall() if cur.description else []


def _row(kind: str, seq: int, t_ns: int, device: str = "gw1") -> Row:
    msg = (
        telemetry(device, BOOT, seq, t_ns)
        if kind == "telemetry"
        else decision(device, BOOT, seq, t_ns)
    )
    return Row(device, "plant1", kind, BOOT, seq, t_ns, encode(msg), t_ns + 1)


def _partitions(url: str) -> set[str]:
    rows = _sql(
        url,
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'messages'::regclass",
    )
    return {r[0] for r in rows}


def _in(url: str, table: str) -> int:
    return int(_sql(url, f"SELECT count(*) FROM {table}")[0][0])


def test_a_v12_database_moves_onto_day_partitions_without_losing_a_row(url: str) -> None:
    # The schema as v12 left it, with rows on three days, two kinds, and one far off.
    for m in MIGRATIONS:
        if m.version <= 12:
            _sql(url, m.postgres_sql)
    _sql(url, "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, description TEXT)")
    for m in MIGRATIONS:
        if m.version <= 12:
            _sql(url, "INSERT INTO schema_version VALUES (%s, %s)", (m.version, m.description))
    rows = [_row("telemetry", s, D0 + s * HOUR) for s in range(0, 60, 2)]
    rows += [_row("decision", s, D0 + s * HOUR) for s in range(1, 60, 2)]
    rows.append(_row("telemetry", 99, 631_152_000 * 10**9))  # 1990: a clock far off
    with psycopg.connect(url, autocommit=True) as db:
        db.cursor().executemany(
            "INSERT INTO messages (device, boot_id, seq, kind, t_ns, received_ns, label, body) "
            "VALUES (%s, %s, %s, %s, %s, %s, NULL, %s)",
            [(r.device, r.boot_id, r.seq, r.kind, r.t_ns, r.received_ns, r.body) for r in rows],
        )
    before = _sql(url, "SELECT device, boot_id, seq, kind, t_ns, received_ns, body FROM messages")

    store = PostgresStore(url)
    try:
        assert store.migrate() == MIGRATIONS[-1].version
        after = _sql(
            url, "SELECT device, boot_id, seq, kind, t_ns, received_ns, body FROM messages"
        )
        assert sorted(after) == sorted(before)
        # 60 hours from D0: days D0, D0 + 1, D0 + 2, for both kinds; 1990 in the default.
        assert _partitions(url) == {
            "messages_default",
            *(f"messages_{k}_2025100{d}" for k in ("telemetry", "decision") for d in (9,)),
            *(f"messages_{k}_202510{d}" for k in ("telemetry", "decision") for d in (10, 11)),
        }
        assert _in(url, "messages_default") == 1
        assert _in(url, "message_keys") == len(rows)
        assert _in(url, "messages_telemetry_20251009") == 12  # seqs 0, 2, ..., 22
        # The store works on the new layout: a redelivery is a duplicate, a new seq is not.
        assert store.ingest([rows[0], _row("telemetry", 100, D0 + 61 * HOUR)]) == IngestResult(
            inserted=1, duplicates=1
        )
    finally:
        store.close()


def test_partitions_are_made_ahead_and_take_their_rows_out_of_the_default(url: str) -> None:
    store = PostgresStore(url)
    try:
        store.migrate()
        # Before any partition: the rows land in the default partition, nothing is refused.
        early = [_row("telemetry", s, D0 + s * HOUR) for s in range(3)]
        assert store.ingest(early) == IngestResult(inserted=3, duplicates=0)
        assert _in(url, "messages_default") == 3
        made = store.prepare_history(D0 + HOUR)
        assert made == 3 * (PARTITION_DAYS_AHEAD + 2)  # three kinds, the day before to a week on
        assert store.prepare_history(D0 + HOUR) == 0
        assert "messages_ota_status_20251016" in _partitions(url)
        assert (_in(url, "messages_default"), _in(url, "messages_telemetry_20251009")) == (0, 3)
        # A redelivery is found in its partition; another body under a key is a conflict.
        forged = _row("telemetry", 1, D0 + HOUR)
        forged = Row(forged.device, forged.site, forged.kind, forged.boot_id, forged.seq,
                     forged.t_ns, early[2].body, 7)  # fmt: skip
        got = store.ingest([early[0], forged, _row("telemetry", 3, D0 + 3 * HOUR)])
        assert got == IngestResult(inserted=1, duplicates=1, conflicts=1)
        # Under the same key with another time (a day later: another partition) and kind.
        moved = _row("decision", 2, D0 + DAY_NS + 5)
        assert store.ingest([moved]) == IngestResult(inserted=0, duplicates=0, conflicts=1)
        assert [q.reason.split(":")[0] for q in store.quarantined()] == ["conflict"] * 2
        assert len(store.telemetry("gw1", since_ns=D0, limit=10)) == 4
        assert store.counts()["decision"] == 0
    finally:
        store.close()


def test_retention_drops_whole_days_and_deletes_only_what_lies_outside_them(url: str) -> None:
    store = PostgresStore(url)
    try:
        store.migrate()
        store.prepare_history(D0 + 2 * DAY_NS)  # partitions for D0 + 1 day onwards
        rows = [_row("telemetry", s, D0 + DAY_NS + s * HOUR) for s in range(48)]  # two days
        rows += [_row("decision", 48 + s, D0 + DAY_NS + s * HOUR) for s in range(3)]
        rows += [_row("telemetry", 51 + s, D0 - DAY_NS + s) for s in range(5)]  # default
        store.ingest(rows)
        store.quarantine([Quarantined("t", b"x", "junk", "$", D0, None)])
        assert _in(url, "messages_default") == 5
        # Cut at noon of the second day: the first day goes whole, the second stays whole,
        # the default partition's older rows go one by one (two per call here).
        cut = D0 + 2 * DAY_NS + 12 * HOUR
        assert store.expire("telemetry", cut, 2) == 24 + 2
        assert "messages_telemetry_20251010" not in _partitions(url)
        assert "messages_decision_20251010" in _partitions(url)
        assert [store.expire("telemetry", cut, 2) for _ in range(3)] == [2, 1, 0]
        assert store.counts()["telemetry"] == 24
        assert _in(url, "message_keys") == 24 + 3  # the keys of what went went with it
        assert store.counts()["decision"] == 3
        assert _sql(url, "SELECT kind, floor_ns FROM history_floors") == [("telemetry", cut)]
        # Nothing cut is reported missing; the rows kept are still read.
        assert store.gaps("gw1") == []
        assert len(store.telemetry("gw1", since_ns=D0, limit=100)) == 24
        # A key whose message was cut is free again: a late copy is stored, not refused
        # (into the default partition: its day's is gone), and goes at the next cut.
        assert store.ingest([rows[0]]) == IngestResult(inserted=1, duplicates=0)
        assert _in(url, "messages_default") == 1
        assert store.expire("telemetry", cut, 2) == 1
    finally:
        store.close()


def test_the_gap_query_reads_a_devices_runs_not_its_keys(url: str) -> None:
    """Schema v15: a device's gaps come from its runs of stored seqs (fleet.store.runs), a
    few rows per boot whatever the history kept, not from its keys (8,640 a day at one
    message per 10 s); the query does not touch message_keys or the partitions."""
    from fleet.store import runs  # noqa: PLC0415

    store = PostgresStore(url)
    try:
        store.migrate()
        # Three devices, 40 seqs each, interleaved as they arrive; device b misses 20..24.
        rows = [
            _row("telemetry", s, D0 + s * HOUR, device=d)
            for s in range(40)
            for d in "abc"
            if not (d == "b" and 20 <= s < 25)
        ]
        for i in range(0, len(rows), 7):  # batches of 7: runs are extended across batches
            store.ingest(rows[i : i + 7])
        gaps = store.gaps("b")
    finally:
        store.close()
    assert [(g.device, g.first_missing, g.last_missing) for g in gaps] == [("b", 20, 24)]
    assert _sql(url, "SELECT device, low, high FROM seq_runs ORDER BY 1, 2") == [
        ("a", 0, 39),
        ("b", 0, 19),
        ("b", 25, 39),
        ("c", 0, 39),
    ]
    sql = runs.gaps_sql(True).replace("?", "%s")
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("SET enable_seqscan = off")  # a 4-row table: as it would plan a big one
        plan = "\n".join(r[0] for r in db.execute("EXPLAIN " + sql, ["b"] * sql.count("%s")))
    assert "seq_runs_pkey" in plan, plan
    assert "message_keys" not in plan, plan
    assert "messages" not in plan.replace("message_keys", ""), plan
