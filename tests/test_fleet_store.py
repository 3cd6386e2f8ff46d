"""The fleet store on both backends: a real SQLite file and a real PostgreSQL.

Every store test runs twice through the ``backend`` fixture. The PostgreSQL case gets a fresh
schema per test (``search_path`` set through the URL's ``options``) and drops it afterwards,
so tests never see each other's rows. Without ``EDGEFLEET_TEST_PG_URL`` the PostgreSQL cases
skip, which CI (where it is always set) turns into failures: the store is proven on both.
"""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from fleet.errors import FleetStoreError, SchemaTooNew, StoreRefused
from fleet.store import (
    QUARANTINE_PAYLOAD_MAX,
    DeviceInfo,
    Gap,
    IngestResult,
    IngestSession,
    Quarantined,
    Row,
    Store,
    open_store,
)
from fleet.store.migrations import LATEST, MIGRATIONS, pending
from fleet.store.sqlite import SqliteStore
from tests.support.pg import pg_schema_url
from tests.support.stores import Backend
from tests.support.tcp_proxy import TcpProxy, target_of, via
from wire.messages import (
    DecisionMsg,
    ModelHealth,
    ModelRef,
    SignalStats,
    StateMsg,
    TelemetryMsg,
    WindowRef,
    decode,
    encode,
)

pytestmark = pytest.mark.peers

BOOT_A = "a" * 32
BOOT_B = "b" * 32
T0 = 1_760_000_000_000_000_000
SEC = 1_000_000_000


@pytest.fixture
def store(backend: Backend) -> Iterator[Store]:
    s = backend.open()
    try:
        yield s
    finally:
        s.close()


# -- message builders (real wire bodies, as ingest stores them) -------------------------------


def telemetry(device: str, seq: int, *, boot: str = BOOT_A, t_ns: int | None = None) -> Row:
    t = T0 + seq * SEC if t_ns is None else t_ns
    msg = TelemetryMsg(
        device=device,
        boot_id=boot,
        seq=seq,
        t_ns=t,
        period_ns=SEC,
        keyframe=seq % 10 == 0,
        signals={"rpm": SignalStats(1500.0, 1490.0, 1510.0, 1501.0, 100)},
    )
    return Row(device, "plant1", "telemetry", boot, seq, t, encode(msg), t + 5_000_000)


def decision(
    device: str,
    seq: int,
    *,
    label: str = "normal",
    boot: str = BOOT_A,
    latency: dict[str, float | None] | None = None,
) -> Row:
    t = T0 + seq * SEC
    msg = DecisionMsg(
        device=device,
        boot_id=boot,
        seq=seq,
        t_ns=t,
        trace_id="c" * 32,
        window=WindowRef(seq=seq, start_ns=t - SEC),
        model=ModelRef(sha256="d" * 64, version="1.0.0", ran=True),
        label=label,
        score=0.1,
        probabilities={label: 0.9},
        alarms=[],
        raised=[],
        cleared=[],
        rules_fired=[],
        top_signals=[],
        attribution="none",
        degraded=False,
        mode="normal",
        stage_latency_ms=latency if latency is not None else {"perception": 1.5, "model": 0.5},
    )
    return Row(device, "plant1", "decision", boot, seq, t, encode(msg), t + 5_000_000)


def state(
    device: str,
    what: str,
    *,
    boot: str = BOOT_A,
    seq: int = 0,
    t_ns: int = T0,
    clean: bool = True,
    version: str = "0.1.0",
    held: int | None = None,
) -> StateMsg:
    extra = {} if held is None else {"held": held}
    return StateMsg(
        **extra,  # type: ignore[arg-type]
        device=device,
        boot_id=boot,
        seq=seq,
        t_ns=t_ns,
        state=what,  # type: ignore[arg-type]
        clean=clean,
        site="plant1",
        device_type="gw-arm64",
        agent_version=version,
        model_sha256="e" * 64,
    )


# -- URLs and schema -------------------------------------------------------------------------


def test_open_store_rejects_unknown_scheme() -> None:
    with pytest.raises(FleetStoreError, match="'mysql' is not supported"):
        open_store("mysql://root@localhost/fleet")
    with pytest.raises(FleetStoreError, match="no scheme"):
        open_store("/var/lib/fleet.db")


def test_sqlite_url_must_be_absolute() -> None:
    with pytest.raises(FleetStoreError, match="absolute path"):
        open_store("sqlite://relative.db")


def test_postgres_connect_error_hides_the_password() -> None:
    with pytest.raises(FleetStoreError) as info:
        open_store("postgresql://fleet:s3cret-pw@127.0.0.1:1/fleet?connect_timeout=2")
    assert "s3cret-pw" not in str(info.value)
    assert "cannot connect" in str(info.value)


def test_migrate_is_idempotent(backend: Backend) -> None:
    first = open_store(backend.url)
    assert first.migrate() == LATEST
    assert first.migrate() == LATEST
    second = open_store(backend.url)
    assert second.migrate() == LATEST
    first.close()
    second.close()
    assert backend.sql("SELECT COUNT(*) FROM schema_version") == [(len(MIGRATIONS),)]


def test_migrate_refuses_a_newer_schema(backend: Backend) -> None:
    backend.open().close()
    backend.sql(
        "INSERT INTO schema_version (version, description) VALUES (%s, %s)",
        (LATEST + 1, "from the future"),
    )
    s = open_store(backend.url)
    with pytest.raises(SchemaTooNew, match=f"schema version {LATEST + 1} is newer"):
        s.migrate()
    s.close()


# -- ingest ----------------------------------------------------------------------------------


def test_ingest_counts_duplicates_within_and_across_batches(store: Store) -> None:
    rows = [telemetry("gw1", s) for s in (1, 2, 3)]
    assert store.ingest(rows) == IngestResult(inserted=3, duplicates=0)
    assert store.ingest(rows) == IngestResult(inserted=0, duplicates=3)
    # seq 4 twice in one batch, seq 3 already stored, seq 5 new.
    mixed = [telemetry("gw1", 4), telemetry("gw1", 4), telemetry("gw1", 3), telemetry("gw1", 5)]
    assert store.ingest(mixed) == IngestResult(inserted=2, duplicates=2)
    # Same seq, another boot or another device: distinct messages.
    other = [telemetry("gw1", 1, boot=BOOT_B), telemetry("gw2", 1)]
    assert store.ingest(other) == IngestResult(inserted=2, duplicates=0)
    assert store.ingest([]) == IngestResult(0, 0)
    assert store.counts()["telemetry"] == 7
    got = store.telemetry("gw1", limit=10)
    # Oldest first by t_ns; the two seq 1 messages share a t_ns, so compare as a set there.
    assert sorted((seq, boot) for _, seq, boot, _ in got) == [
        (1, BOOT_A),
        (1, BOOT_B),
        (2, BOOT_A),
        (3, BOOT_A),
        (4, BOOT_A),
        (5, BOOT_A),
    ]
    assert [seq for _, seq, _, _ in got][2:] == [2, 3, 4, 5]
    # Bodies come back byte for byte and still decode.
    assert got[-1][3] == telemetry("gw1", 5).body
    assert decode("telemetry", got[-1][3]).seq == 5


def _other_body(row: Row, mean: float) -> Row:
    """``row`` with the same key and a different (valid) body: a conflicting message."""
    msg = decode("telemetry", row.body)
    assert isinstance(msg, TelemetryMsg)
    body = encode(
        TelemetryMsg(
            device=msg.device,
            boot_id=msg.boot_id,
            seq=msg.seq,
            t_ns=msg.t_ns,
            period_ns=msg.period_ns,
            keyframe=msg.keyframe,
            signals={"rpm": SignalStats(mean, 0.0, 9e9, mean, 1)},
        )
    )
    return Row(row.device, row.site, row.kind, row.boot_id, row.seq, row.t_ns, body, 7)


def _conflict_stores(backend: Backend) -> list[Store]:
    """The backend's store, and on PostgreSQL its ``executemany`` insert mode too (the
    conflict check differs: a join on the COPY's temp table, or arrays of keys and bodies)."""
    stores: list[Store] = [backend.open()]
    if backend.name == "postgresql":
        from fleet.store.postgres import PostgresStore  # noqa: PLC0415 - needs psycopg

        stores.append(PostgresStore(backend.url, insert_mode="executemany"))
    return stores


def test_another_body_under_a_stored_key_is_a_conflict_quarantined_first_kept(
    backend: Backend,
) -> None:
    # Before: counted as a duplicate and the second body dropped without a trace.
    for n, store in enumerate(_conflict_stores(backend)):
        dev = f"gw{n}"
        try:
            first = [telemetry(dev, s) for s in (1, 2, 3)]
            assert store.ingest(first) == IngestResult(inserted=3, duplicates=0)
            forged = _other_body(first[1], 42.0)
            # The same bytes again: a duplicate. Other bytes: a conflict. New seq: stored.
            result = store.ingest([first[0], forged, telemetry(dev, 4)])
            assert result == IngestResult(inserted=1, duplicates=1, conflicts=1)
            bodies = {seq: body for _, seq, _, body in store.telemetry(dev, limit=10)}
            assert bodies[2] == first[1].body, "the first body stays"
            held = [q for q in store.quarantined(limit=100) if q.device == dev]
            assert len(held) == 1
            q = held[0]
            assert q.reason.startswith("conflict: seq 2 of boot " + BOOT_A)
            assert q.payload == forged.body
            assert q.topic == f"edgefleet/v1/plant1/{dev}/telemetry"
            assert (q.where, q.received_ns) == ("$", 7)
        finally:
            store.close()


def test_two_bodies_of_one_key_in_one_batch_keep_the_first_and_quarantine_the_other(
    backend: Backend,
) -> None:
    for n, store in enumerate(_conflict_stores(backend)):
        dev = f"gw{n}"
        try:
            row = telemetry(dev, 5)
            other = _other_body(row, 1.0)
            batch = [row, other, row, telemetry(dev, 6), _other_body(row, 2.0)]
            assert store.ingest(batch) == IngestResult(inserted=2, duplicates=1, conflicts=2)
            assert [b for _, s, _, b in store.telemetry(dev) if s == 5] == [row.body]
            # Arrival order decides, not the bytes: the conflicting body first is kept.
            late = telemetry(dev, 7)
            assert store.ingest([_other_body(late, 3.0), late]) == IngestResult(1, 0, 1)
            assert [b for _, s, _, b in store.telemetry(dev) if s == 7] == [
                _other_body(late, 3.0).body
            ]
            held = [q for q in store.quarantined(limit=100) if q.device == dev]
            assert sorted(q.payload for q in held) == sorted(
                [other.body, _other_body(row, 2.0).body, late.body]
            )
        finally:
            store.close()


def test_ping_answers_on_both_backends_and_fails_on_a_closed_sqlite(store: Store) -> None:
    store.ping()
    if isinstance(store, SqliteStore):
        store.close()
        with pytest.raises(FleetStoreError, match="ping"):
            store.ping()


def test_ping_answers_while_the_database_does_and_raises_while_it_is_gone() -> None:
    # PostgreSQL through a link the test cuts: the store reconnects once it is back.
    with pg_schema_url() as url, TcpProxy(*target_of(url)) as proxy:
        store = open_store(via(url, proxy.port))
        try:
            store.ping()
            proxy.cut()
            with pytest.raises(FleetStoreError, match=r"ping failed|cannot connect"):
                store.ping()
            proxy.restore()
            store.ping()
        finally:
            store.close()


def test_ping_fails_while_a_write_could_not_start(backend: Backend) -> None:
    """A SELECT answers while no write can land (SQLite: another connection holds the write
    lock, e.g. a VACUUM; PostgreSQL: a read-only server, e.g. a standby after a failover).
    The ingest reads a ping as "the store is fine, so it is this message" and would
    quarantine good messages: a ping must say whether a write could start."""
    store = backend.open()
    try:
        if backend.name == "sqlite":
            other = sqlite3.connect(backend.url.removeprefix("sqlite://"), isolation_level=None)
            other.execute("BEGIN IMMEDIATE")
            try:
                t0 = time.monotonic()
                with pytest.raises(FleetStoreError, match="ping failed: database is locked"):
                    store.ping()
                assert time.monotonic() - t0 < 5  # PING_WAIT_MS, not the 15 s busy timeout
            finally:
                other.execute("ROLLBACK")
                other.close()
            store.ping()
            store.ingest([telemetry("gw1", 1)])  # the ping left no transaction open
        else:
            read_only = open_store(backend.url + "&options=-c%20default_transaction_read_only%3Don")
            try:
                with pytest.raises(FleetStoreError, match="read-only"):
                    read_only.ping()
            finally:
                read_only.close()
            store.ping()
    finally:
        store.close()


def test_sqlite_commits_are_synced_before_the_ingest_acks_them(tmp_path: Path) -> None:
    # The ingest PUBACKs after the commit returns and the broker forgets the message: a WAL
    # commit must be on disk by then (synchronous=FULL is 2; NORMAL, 1, would not sync it).
    store = SqliteStore(f"sqlite://{tmp_path / 'fleet.db'}")
    try:
        assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        store.close()


def test_sqlite_url_busy_timeout_option(tmp_path: Path) -> None:
    db = tmp_path / "fleet.db"
    assert SqliteStore(f"sqlite://{db}?busy_timeout_ms=250").busy_timeout_ms == 250
    assert SqliteStore(f"sqlite://{db}").busy_timeout_ms == 15_000
    for query, error in (
        ("busy_timeout_ms=soon", "busy_timeout_ms='soon': expected milliseconds"),
        ("busy_timeout_ms=0", "busy_timeout_ms='0': expected milliseconds"),
        ("timeout=5", r"unknown option\(s\) timeout"),
        ("busy_timeout_ms", "cannot parse its query"),
    ):
        with pytest.raises(FleetStoreError, match=error):
            SqliteStore(f"sqlite://{db}?{query}")


def test_ingest_rejects_a_non_data_kind_and_stores_nothing(store: Store) -> None:
    bad = Row("gw1", "plant1", "state", BOOT_A, 9, T0, b"{}", T0)
    with pytest.raises(FleetStoreError, match=r"kind 'state' is not a data kind"):
        store.ingest([telemetry("gw1", 1), bad])
    assert store.counts()["telemetry"] == 0


def test_a_value_the_database_cannot_hold_is_a_refusal_and_stores_nothing(store: Store) -> None:
    too_big = Row("gw1", "plant1", "telemetry", BOOT_A, 2**63, T0, b"{}", T0)
    with pytest.raises(StoreRefused, match="refused"):
        store.ingest([telemetry("gw1", 1), too_big])
    assert store.counts()["telemetry"] == 0
    store.ping()  # and the store goes on


def test_concurrent_ingest_stores_each_row_once(backend: Backend) -> None:
    backend.open().close()
    # Two workers, batches of 50, overlapping on seqs 101..200 and in opposite order.
    first = [telemetry("gw1", s) for s in range(1, 201)]
    second = [telemetry("gw1", s) for s in range(300, 100, -1)]
    results: dict[str, list[IngestResult]] = {"a": [], "b": []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(name: str, rows: list[Row]) -> None:
        s = open_store(backend.url)
        try:
            start.wait()
            for i in range(0, len(rows), 50):
                results[name].append(s.ingest(rows[i : i + 50]))
        except BaseException as exc:
            errors.append(exc)
        finally:
            s.close()

    threads = [
        threading.Thread(target=work, args=("a", first)),
        threading.Thread(target=work, args=("b", second)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    inserted = sum(r.inserted for rs in results.values() for r in rs)
    duplicates = sum(r.duplicates for rs in results.values() for r in rs)
    assert inserted == 300
    assert duplicates == 100
    s = backend.open()
    assert s.counts()["telemetry"] == 300
    # These seqs start at 1, so only the head (seq 0) is missing.
    assert {(g.first_missing, g.last_missing) for g in s.gaps()} <= {(0, 0)}
    s.close()


def _ingest_in_process(url: str, first: int, last: int) -> tuple[int, int]:
    """One ingest worker process: its own store, batches of 100."""
    s = open_store(url)
    try:
        s.migrate()
        got = [
            s.ingest([telemetry("gw1", q) for q in range(i, min(i + 100, last + 1))])
            for i in range(first, last + 1, 100)
        ]
        return sum(r.inserted for r in got), sum(r.duplicates for r in got)
    finally:
        s.close()


def test_concurrent_ingest_from_processes(backend: Backend) -> None:
    # Three worker processes migrate the same fresh database at once, then ingest
    # overlapping ranges: 1..600, 301..900, 1..900.
    ranges = [(1, 600), (301, 900), (1, 900)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        results = pool.starmap(_ingest_in_process, [(backend.url, a, b) for a, b in ranges])
    assert sum(i for i, _ in results) == 900
    assert sum(d for _, d in results) == 600 + 600 + 900 - 900
    s = backend.open()
    assert s.counts()["telemetry"] == 900
    assert {(g.first_missing, g.last_missing) for g in s.gaps()} <= {(0, 0)}
    s.close()


# -- quarantine ------------------------------------------------------------------------------


def test_quarantine_round_trip(store: Store) -> None:
    items = [
        Quarantined(
            "edgefleet/v1/p/gw1/telemetry", b'{"seq": "x"}', "bad type", "$.seq", T0, "gw1"
        ),
        Quarantined(
            "edgefleet/v1/p/gw9/decision", b"\xff\x00binary", "unknown device", "$", T0 + 1, None
        ),
        Quarantined("junk/topic", b"", "not our topic", "$", T0 + 2, None),
    ]
    store.quarantine(items)
    store.quarantine([])
    got = store.quarantined()
    assert got == list(reversed(items))  # newest first, payload bytes as given
    assert store.quarantined(limit=1) == [items[2]]
    assert store.counts()["quarantined"] == 3
    # A caller that forgot to cut a payload does not grow the table without bound.
    store.quarantine([Quarantined("t", b"x" * 100_000, "too big", "$", T0 + 3, None)])
    assert store.quarantined(limit=1)[0].payload == b"x" * QUARANTINE_PAYLOAD_MAX


# -- registry --------------------------------------------------------------------------------


def test_state_online_offline_and_versions(store: Store) -> None:
    store.record_state("gw1", "plant1", state("gw1", "online", t_ns=T0), T0 + 10)
    info = store.device("gw1")
    assert info is not None
    assert info.online
    assert (info.boot_id, info.agent_version, info.device_type) == (BOOT_A, "0.1.0", "gw-arm64")
    assert info.model_sha256 == "e" * 64
    assert (info.site, info.first_seen_ns, info.last_seen_ns) == ("plant1", T0 + 10, T0 + 10)
    # The Last Will of the same boot was composed at connect time: older t_ns, still applies.
    store.record_state("gw1", "plant1", state("gw1", "offline", t_ns=T0, clean=False), T0 + 99)
    info = store.device("gw1")
    assert info is not None
    assert not info.online
    assert info.last_seen_ns == T0 + 99


def test_the_model_health_a_state_reports_is_the_device_record_until_the_next(
    store: Store,
) -> None:
    """An online state carrying ``model_health`` (schema v6) fills the record; the next one
    without it (the model is fine again, or an older agent) empties it; offline: empty."""
    sick = msgspec.structs.replace(
        state("gw1", "online", t_ns=T0),
        model_health=ModelHealth(ood=["current", "speed"], alarm_storm=True),
    )
    store.record_state("gw1", "plant1", sick, T0 + 10)
    info = store.device("gw1")
    assert info is not None
    assert info.model_health == {
        "ood": ["current", "speed"],
        "alarm_storm": True,
        "acquisition_mismatch": False,
    }
    store.record_state("gw1", "plant1", state("gw1", "online", t_ns=T0 + SEC), T0 + SEC)
    info = store.device("gw1")
    assert info is not None
    assert info.model_health == {}
    store.record_state("gw1", "plant1", sick, T0 + 2 * SEC)
    store.record_state("gw1", "plant1", state("gw1", "offline", clean=False), T0 + 3 * SEC)
    info = store.device("gw1")
    assert info is not None
    assert info.model_health == {}  # an offline device serves no model


def test_late_offline_of_an_old_boot_does_not_mark_the_new_boot_offline(store: Store) -> None:
    store.record_state("gw1", "plant1", state("gw1", "online", boot=BOOT_A, t_ns=T0), T0)
    # The device restarts: new boot online, with a new version.
    new_t = T0 + 60 * SEC
    birth = state("gw1", "online", boot=BOOT_B, t_ns=new_t, version="0.2.0")
    store.record_state("gw1", "plant1", birth, new_t)
    # Then the broker delivers the old boot's Last Will (composed at the old connect).
    will = state("gw1", "offline", boot=BOOT_A, t_ns=T0, clean=False, seq=8)
    store.record_state("gw1", "plant1", will, new_t + SEC)
    info = store.device("gw1")
    assert info is not None
    assert (info.online, info.boot_id, info.agent_version) == (True, BOOT_B, "0.2.0")
    assert info.last_seen_ns == new_t + SEC
    # The stale state still taught the old boot's watermark (8 numbered: 0..7): all but 2
    # of boot A are missing.
    store.ingest([telemetry("gw1", 2, boot=BOOT_A)])
    assert store.gaps("gw1") == [Gap("gw1", BOOT_A, 0, 1), Gap("gw1", BOOT_A, 3, 7)]
    # A clean offline of the new boot does apply.
    bye = state("gw1", "offline", boot=BOOT_B, t_ns=new_t + 5 * SEC)
    store.record_state("gw1", "plant1", bye, new_t + 5 * SEC)
    info = store.device("gw1")
    assert info is not None
    assert not info.online
    assert info.boot_id == BOOT_B


def test_a_state_message_never_moves_a_device_to_another_site(store: Store) -> None:
    store.record_state("gw1", "plant1", state("gw1", "online", t_ns=T0), T0)
    # A newer birth naming another site (the ingest refuses those; the store holds anyway):
    # the state applies, the site stays. Before, the row moved to the state's site.
    moved = state("gw1", "online", boot=BOOT_B, t_ns=T0 + SEC, version="9.9.9")
    store.record_state("gw1", "other-site", moved, T0 + SEC)
    info = store.device("gw1")
    assert info is not None
    assert (info.site, info.boot_id, info.agent_version) == ("plant1", BOOT_B, "9.9.9")
    assert store.device_site("gw1") == "plant1"
    assert store.device_site("gw9") is None
    # Data rows of a known device do not move it either; an operator does.
    store.ingest([Row("gw1", "other-site", "telemetry", BOOT_B, 0, T0, b"{}", T0)])
    assert store.device_site("gw1") == "plant1"
    store.register_device("gw1", "plant2")
    assert store.device_site("gw1") == "plant2"


def test_ensure_device_with_and_without_auto_register(store: Store) -> None:
    assert store.ensure_device("gw1", "plant1", T0, auto_register=False) is False
    assert store.device("gw1") is None
    assert store.devices() == []
    assert store.ensure_device("gw1", "plant1", T0, auto_register=True) is True
    assert store.ensure_device("gw1", "plant1", T0 + 5, auto_register=False) is True
    info = store.device("gw1")
    assert info == DeviceInfo(
        device="gw1",
        site="plant1",
        device_type="generic",
        online=False,
        last_seen_ns=None,
        boot_id=None,
        agent_version="",
        model_sha256="",
        first_seen_ns=T0,
        last_seq=None,
        latency_ms={},
    )
    store.register_device("gw2", "plant2", "gw-x86")
    assert store.ensure_device("gw2", "plant2", T0, auto_register=False) is True
    store.register_device("gw2", "plant3", "gw-arm64")
    assert [(d.device, d.site, d.device_type) for d in store.devices()] == [
        ("gw1", "plant1", "generic"),
        ("gw2", "plant3", "gw-arm64"),
    ]
    # Registered ahead of time: first seen when its first message arrives, not before.
    gw2 = store.device("gw2")
    assert gw2 is not None
    assert gw2.first_seen_ns == 0
    store.ingest([telemetry("gw2", 1)])
    gw2 = store.device("gw2")
    assert gw2 is not None
    assert gw2.first_seen_ns == telemetry("gw2", 1).received_ns
    assert (gw2.site, gw2.device_type) == ("plant3", "gw-arm64")


def test_device_info_tracks_last_seq_seen_and_latest_latency(store: Store) -> None:
    store.record_state("gw1", "plant1", state("gw1", "online", t_ns=T0), T0)
    store.ingest([telemetry("gw1", 1), decision("gw1", 2, latency={"a": 1.0, "b": None})])
    store.ingest([decision("gw1", 4, latency={"a": 2.0, "m": 0.25}), telemetry("gw1", 3)])
    # An older decision arriving late does not replace the latest latencies.
    store.ingest([decision("gw1", 0, latency={"a": 9.0})])
    info = store.device("gw1")
    assert info is not None
    assert info.latency_ms == {"a": 2.0, "m": 0.25}
    assert info.last_seq == 4
    assert info.last_seen_ns == decision("gw1", 4).received_ns  # the latest receive time


def test_one_batch_of_many_devices_and_boots_keeps_first_and_last_seen(store: Store) -> None:
    # A batch holds several devices and boots, in no order; a later batch holds older
    # messages. A device was first seen in the first batch that named it and last seen at
    # the latest receive time; a boot keeps its earliest (gap reports order boots by it).
    late = [
        telemetry(f"gw{d}", seq, boot=boot)
        for d in (3, 1, 2)
        for seq in (5, 6)
        for boot in (BOOT_B, BOOT_A)
    ]
    assert store.ingest(late).inserted == 12
    early = [telemetry(f"gw{d}", seq, boot=BOOT_A) for d in (2, 1, 3) for seq in (1, 0)]
    assert store.ingest(early).inserted == 6
    for d in (1, 2, 3):
        info = store.device(f"gw{d}")
        assert info is not None
        assert info.first_seen_ns == telemetry(f"gw{d}", 5).received_ns
        assert info.last_seen_ns == telemetry(f"gw{d}", 6).received_ns
    gaps = store.gaps("gw1")
    # Boot A (first received earlier, with seq 0) comes before boot B in the report.
    assert [(g.boot_id, g.first_missing, g.last_missing) for g in gaps] == [
        (BOOT_A, 2, 4),
        (BOOT_B, 0, 4),
    ]


# -- gaps ------------------------------------------------------------------------------------


def test_gaps_head_holes_tail_and_new_boot(store: Store) -> None:
    # Seqs start at 0 at every boot: 0 is missing (the head), then 3-4 and 7-8.
    store.ingest([telemetry("gw1", s) for s in (1, 2, 5, 6, 9)])
    assert store.gaps() == [
        Gap("gw1", BOOT_A, 0, 0),
        Gap("gw1", BOOT_A, 3, 4),
        Gap("gw1", BOOT_A, 7, 8),
    ]
    # The device says it numbered 13 messages (0..12): 10..12 are missing (or on their way).
    store.record_state("gw1", "plant1", state("gw1", "online", seq=13, t_ns=T0), T0 + 1)
    assert store.gaps("gw1")[-1] == Gap("gw1", BOOT_A, 10, 12)
    # A lower watermark later (an old Last Will) never lowers it.
    store.record_state("gw1", "plant1", state("gw1", "offline", seq=3, clean=False), T0 + 2)
    assert store.gaps("gw1")[-1] == Gap("gw1", BOOT_A, 10, 12)
    store.ingest([telemetry("gw1", s) for s in (0, 3, 4, 10, 11, 12)])
    assert store.gaps() == [Gap("gw1", BOOT_A, 7, 8)]
    # A new boot starts its seqs again: no gap against the old boot.
    b_birth = state("gw1", "online", boot=BOOT_B, seq=0, t_ns=T0 + 100 * SEC)
    store.record_state("gw1", "plant1", b_birth, T0 + 100 * SEC)
    store.ingest([telemetry("gw1", s, boot=BOOT_B) for s in (0, 1, 2, 4)])
    store.ingest([telemetry("gw2", s) for s in (0, 1, 3)])
    assert store.gaps() == [
        Gap("gw1", BOOT_A, 7, 8),
        Gap("gw1", BOOT_B, 3, 3),
        Gap("gw2", BOOT_A, 2, 2),
    ]
    assert store.gaps("gw2") == [Gap("gw2", BOOT_A, 2, 2)]
    assert store.gaps("nobody") == []


def test_a_boot_of_which_nothing_arrived_is_one_gap(store: Store) -> None:
    # Its Last Will says 4 messages were numbered; none reached the store.
    store.record_state("gw3", "plant1", state("gw3", "offline", seq=4, clean=False), T0)
    assert store.gaps("gw3") == [Gap("gw3", BOOT_A, 0, 3)]
    store.record_state("gw4", "plant1", state("gw4", "online", seq=0), T0)
    assert store.gaps("gw4") == []


def test_what_the_device_still_holds_is_on_its_way_not_a_gap(store: Store) -> None:
    # The device numbered 0..19 and still holds 8 and up (kept for the fleet's
    # confirmation): of the holes 2..3, 8..9 and the tail 15..19 only 2..3 is lost.
    store.ingest([telemetry("gw1", s) for s in (0, 1, 4, 5, 6, 7, 10, 11, 12, 13, 14)])
    store.record_state("gw1", "plant1", state("gw1", "online", seq=20, held=8), T0 + 1)
    assert store.gaps() == [Gap("gw1", BOOT_A, 2, 3)]
    # A hole that straddles it is cut below it.
    store.record_state("gw1", "plant1", state("gw1", "online", seq=20, held=3), T0 + 2)
    assert store.gaps() == [Gap("gw1", BOOT_A, 2, 3)], "held only rises"
    store.record_state("gw1", "plant1", state("gw1", "online", seq=20, t_ns=T0 + 5), T0 + 3)
    assert store.gaps() == [Gap("gw1", BOOT_A, 2, 3)], "a state without held keeps it"
    store.record_state("gw1", "plant1", state("gw1", "online", seq=20, held=9), T0 + 4)
    assert store.gaps() == [Gap("gw1", BOOT_A, 2, 3), Gap("gw1", BOOT_A, 8, 8)]
    # Nothing held any more (held = the watermark): every hole and the tail are lost.
    store.record_state("gw1", "plant1", state("gw1", "online", seq=20, held=20), T0 + 5)
    assert store.gaps("gw1") == [
        Gap("gw1", BOOT_A, 2, 3),
        Gap("gw1", BOOT_A, 8, 9),
        Gap("gw1", BOOT_A, 15, 19),
    ]


def test_the_audit_passes_over_holes_the_device_still_holds(store: Store) -> None:
    store.record_state("gw1", "plant1", state("gw1", "online", seq=0, held=0), 50)
    store.ingest([_received_at(telemetry("gw1", s), 100 + s) for s in (0, 1, 2, 9, 10)])
    store.record_state("gw1", "plant1", state("gw1", "online", seq=11, held=5), 120)
    # 3..8 is missing; the device still holds 5 and up: 3..4 is a gap, 5..8 on its way.
    assert store.record_new_gaps(0, 200, found_ns=1) == [Gap("gw1", BOOT_A, 3, 4)]


def test_an_online_made_before_the_offline_that_followed_does_not_revive_a_device(
    store: Store,
) -> None:
    # Two workers: the device's last periodic online (t0 + 5 s) is stored after its clean
    # offline at stop (t0 + 6 s). The device stays offline; a later birth brings it back.
    store.record_state("gw1", "plant1", state("gw1", "online", t_ns=T0), T0)
    store.record_state("gw1", "plant1", state("gw1", "offline", t_ns=T0 + 6 * SEC), T0 + 1)
    store.record_state("gw1", "plant1", state("gw1", "online", t_ns=T0 + 5 * SEC), T0 + 2)
    info = store.device("gw1")
    assert info is not None
    assert not info.online
    store.record_state("gw1", "plant1", state("gw1", "online", t_ns=T0 + 9 * SEC), T0 + 3)
    info = store.device("gw1")
    assert info is not None
    assert info.online


def test_retention_deletes_old_history_by_kind_in_batches(backend: Backend) -> None:
    store = backend.open()
    try:
        # One boot: telemetry on even seqs, decisions on odd ones, one second apart.
        store.ingest([telemetry("gw1", s) if s % 2 == 0 else decision("gw1", s) for s in range(40)])
        store.quarantine(
            [Quarantined("t", b"x", "junk", "$", T0 + i * SEC, None) for i in range(5)]
        )
        # Telemetry made before T0 + 20 s goes, 4 rows per transaction: 10 rows.
        assert [store.expire("telemetry", T0 + 20 * SEC, 4) for _ in range(4)] == [4, 4, 2, 0]
        assert store.counts()["telemetry"] == 10
        assert store.counts()["decision"] == 20  # another kind: untouched
        assert store.expire("quarantine", T0 + 3 * SEC, 100) == 3
        assert store.counts()["quarantined"] == 2
        assert store.expire("minutes", T0 + 3600 * SEC, 100) == 1  # the rollup of that minute
        assert backend.sql("SELECT kind, floor_ns FROM history_floors") == [
            ("telemetry", T0 + 20 * SEC)
        ]
        with pytest.raises(FleetStoreError, match="cannot expire 'state'"):
            store.expire("state", T0, 1)
    finally:
        store.close()


def test_what_retention_cut_is_no_gap_but_a_later_hole_is(store: Store) -> None:
    store.ingest([telemetry("gw1", s) if s % 2 == 0 else decision("gw1", s) for s in range(40)])
    store.ingest([decision("gw1", s) for s in (41, 42)])  # 40 never came
    store.record_state("gw1", "plant1", state("gw1", "online", seq=43), T0)
    assert store.gaps() == [Gap("gw1", BOOT_A, 40, 40)]
    # Telemetry before T0 + 20 s is cut: seqs 0, 2, ..., 18 are gone, and a hole among
    # them is not a gap; a seq never stored after the cut still is.
    assert store.expire("telemetry", T0 + 20 * SEC, 100) == 10
    assert store.gaps() == [Gap("gw1", BOOT_A, 40, 40)]
    # A boot first heard of before the cut, whose head is missing, is not reported either.
    store.ingest([telemetry("gw2", s) for s in (0, 1, 2)])
    store.expire("telemetry", T0 + 2 * SEC, 100)  # an older cut does not lower it
    assert store.gaps("gw2") == []


def _received_at(row: Row, received_ns: int) -> Row:
    return Row(
        row.device, row.site, row.kind, row.boot_id, row.seq, row.t_ns, row.body, received_ns
    )


def test_new_gaps_are_the_holes_behind_messages_received_in_the_window(
    backend: Backend,
) -> None:
    store, other = backend.open(), backend.open()
    try:
        store.ingest([_received_at(telemetry("gw1", s), 100 + s) for s in range(5)])
        store.ingest([_received_at(telemetry("gw1", s), 200 + s) for s in (10, 11, 12)])
        # A head: a boot whose first messages never came.
        store.ingest([_received_at(telemetry("gw2", s, boot=BOOT_B), 210) for s in (3, 4)])
        assert store.record_new_gaps(0, 150, found_ns=1) == [], "nothing missing before 150"
        found = store.record_new_gaps(150, 250, found_ns=2)
        assert found == [Gap("gw1", BOOT_A, 5, 9), Gap("gw2", BOOT_B, 0, 2)]
        # Recorded once: the same window again, or another worker's store, finds no news.
        assert store.record_new_gaps(150, 250, found_ns=3) == []
        assert other.record_new_gaps(0, 1_000, found_ns=3) == []
        assert backend.sql("SELECT COUNT(*) FROM ingest_gaps") == [(2,)]
        # A hole that filled before the audit is no gap; one behind a later message is.
        store.ingest([_received_at(telemetry("gw1", 20), 300)])
        store.ingest([_received_at(telemetry("gw1", s), 310) for s in range(13, 20)])
        store.ingest([_received_at(telemetry("gw1", 30), 320)])
        assert store.record_new_gaps(250, 400, found_ns=4) == [Gap("gw1", BOOT_A, 21, 29)]
        # fleet gaps (the messages themselves) agrees.
        assert store.gaps("gw1") == [Gap("gw1", BOOT_A, 5, 9), Gap("gw1", BOOT_A, 21, 29)]
    finally:
        store.close()
        other.close()


def test_migrations_pending_are_those_not_recorded_whatever_their_number() -> None:
    # Versions are reserved ahead per branch: a database may hold 1, 2 and 5 before 3 lands.
    assert [m.version for m in pending({1, 5})] == [
        m.version for m in MIGRATIONS if m.version != 1 and m.version != 5
    ]
    assert pending({m.version for m in MIGRATIONS}) == []
    assert [m.version for m in pending(set())] == [m.version for m in MIGRATIONS]


# -- queries ---------------------------------------------------------------------------------


def test_telemetry_since_and_limit_newest_last(store: Store) -> None:
    store.ingest([telemetry("gw1", s) for s in range(1, 21)] + [telemetry("gw2", 1)])
    store.ingest([decision("gw1", 21)])
    got = store.telemetry("gw1", limit=5)
    assert [seq for _, seq, _, _ in got] == [16, 17, 18, 19, 20]
    assert [t for t, _, _, _ in got] == [T0 + s * SEC for s in range(16, 21)]
    since = store.telemetry("gw1", since_ns=T0 + 18 * SEC)
    assert [seq for _, seq, _, _ in since] == [18, 19, 20]
    assert len(store.telemetry("gw1")) == 20
    assert store.telemetry("gw1", limit=0) == []
    assert store.telemetry("nobody") == []
    with pytest.raises(FleetStoreError, match="limit"):
        store.telemetry("gw1", limit=-1)


def test_decisions_filters(store: Store) -> None:
    store.ingest(
        [
            decision("gw1", 1, label="normal"),
            decision("gw1", 2, label="bearing_fault"),
            decision("gw2", 3, label="bearing_fault"),
            decision("gw2", 4, label="normal"),
            telemetry("gw1", 5),
        ]
    )
    every = store.decisions()
    assert [(d, s) for d, _, s, _ in every] == [("gw1", 1), ("gw1", 2), ("gw2", 3), ("gw2", 4)]
    assert every[1][3] == decision("gw1", 2, label="bearing_fault").body
    faults = store.decisions(label="bearing_fault")
    assert [(d, s) for d, _, s, _ in faults] == [("gw1", 2), ("gw2", 3)]
    assert [s for _, _, s, _ in store.decisions(device="gw2")] == [3, 4]
    assert [s for _, _, s, _ in store.decisions(device="gw2", label="normal")] == [4]
    assert [s for _, _, s, _ in store.decisions(since_ns=T0 + 3 * SEC)] == [3, 4]
    assert [s for _, _, s, _ in store.decisions(limit=2)] == [3, 4]
    assert store.decisions(label="nothing") == []


def test_counts(store: Store) -> None:
    assert store.counts() == {
        "telemetry": 0,
        "decision": 0,
        "ota/status": 0,
        "quarantined": 0,
        "devices": 0,
    }
    ota = Row("gw1", "plant1", "ota/status", BOOT_A, 9, T0, b'{"state":"staged"}', T0)
    store.ingest([telemetry("gw1", 1), telemetry("gw1", 2), decision("gw1", 3), ota])
    store.ingest([telemetry("gw2", 1)])
    store.register_device("gw3", "plant1")
    store.quarantine([Quarantined("t", b"x", "r", "$", T0, None)])
    assert store.counts() == {
        "telemetry": 3,
        "decision": 1,
        "ota/status": 1,
        "quarantined": 1,
        "devices": 3,
    }


def test_rollout_requests_stay_pending_until_finished(store: Store) -> None:
    store.add_rollout_request("r1", "pause", 10)
    store.add_rollout_request("r2", "abort", 11)
    store.add_rollout_request("r1", "resume", 12)
    pending = store.pending_rollout_requests()
    assert [(r, a) for _, r, a in pending] == [("r1", "pause"), ("r2", "abort"), ("r1", "resume")]
    assert store.pending_rollout_requests() == pending  # reading marks nothing
    store.finish_rollout_requests([pending[0][0], pending[1][0]], 20)
    assert store.pending_rollout_requests() == [pending[2]]
    store.finish_rollout_requests([pending[0][0]], 30)  # again: harmless
    store.add_rollout_request("r2", "pause", 40)
    assert [(r, a) for _, r, a in store.pending_rollout_requests()] == [
        ("r1", "resume"),
        ("r2", "pause"),
    ]


def test_ingest_sessions_are_recorded_kept_and_claimed_once(store: Store) -> None:
    a0 = IngestSession("fi-h-ingest-0", "fi-h", "h", "ingest", 0, "b:1883", "active", T0, T0)
    a1 = IngestSession("fi-h-ingest-1", "fi-h", "h", "ingest", 1, "b:1883", "active", T0, T0)
    assert store.ingest_sessions() == []
    assert store.save_ingest_sessions([a1, a0]) == 2
    assert store.ingest_sessions() == [a0, a1]  # by client id
    # A later write changes everything but the client id and when it was first recorded.
    later = IngestSession(
        "fi-h-ingest-1", "fi-h", "h2", "g", 1, "b2:1", "ended", T0 + SEC, T0 + 2 * SEC,
        ended_ns=T0 + 2 * SEC, drained=42,
    )  # fmt: skip
    assert store.save_ingest_sessions([later]) == 1
    assert store.ingest_sessions() == [a0, replace(later, created_ns=T0)]
    # A claim changes a session only in the state it expects: one of two claims wins.
    draining = replace(a0, state="draining", last_seen_ns=T0 + 3 * SEC)
    assert store.save_ingest_sessions([draining], if_state="active") == 1
    assert store.save_ingest_sessions([draining], if_state="active") == 0
    unknown = replace(a0, client_id="nobody")
    assert store.save_ingest_sessions([unknown], if_state="active") == 0
    assert store.ingest_sessions()[0] == draining
    assert [s.client_id for s in store.ingest_sessions()] == ["fi-h-ingest-0", "fi-h-ingest-1"]


def test_postgres_store_reconnects_after_the_connection_drops(backend: Backend) -> None:
    if backend.name != "postgresql":
        # SQLite has no connection to lose; the same calls must simply keep working.
        s = backend.open()
        assert s.ingest([telemetry("gw1", 1)]).inserted == 1
        s.close()
        return
    s = backend.open()
    assert s.ingest([telemetry("gw1", 1)]).inserted == 1
    killed = backend.sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE application_name = %s AND pid <> pg_backend_pid()",
        (backend.app,),
    )
    assert killed == [(True,)]
    # The idle connection died: the next call reconnects on its own and succeeds.
    assert s.ingest([telemetry("gw1", 1), telemetry("gw1", 2)]) == IngestResult(1, 1)
    assert s.counts()["telemetry"] == 2
    s.close()
