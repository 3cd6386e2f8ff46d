"""Versioned schema migrations, one list for both backends.

Append only: a released migration is never edited; a change is a new entry. Each runs in
its own transaction with the ``schema_version`` row that records it, so a crash leaves the
database at a version boundary. Versions may be reserved ahead for parallel work, so what is
pending is every version not recorded (not "above the highest"), applied in order, and no
migration may depend on a higher one. SQLite text is split on ``;`` and run statement by
statement (``executescript`` would commit on its own): no ``;`` inside a literal. The
tables: ``docs/ARCHITECTURE.md``, "The fleet store's tables".
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from fleet.store.runs import fill_sql


class Migration(NamedTuple):
    version: int
    description: str
    sqlite_sql: str
    postgres_sql: str


_V1_SQLITE = """
CREATE TABLE devices (
    device TEXT PRIMARY KEY,
    site TEXT NOT NULL,
    device_type TEXT NOT NULL DEFAULT 'generic',
    first_seen_ns INTEGER NOT NULL,
    last_seen_ns INTEGER,
    online INTEGER NOT NULL DEFAULT 0,
    boot_id TEXT,
    state_t_ns INTEGER,
    agent_version TEXT NOT NULL DEFAULT '',
    model_sha256 TEXT NOT NULL DEFAULT '',
    latency_json TEXT NOT NULL DEFAULT '{}',
    latency_t_ns INTEGER
);
CREATE TABLE boots (
    device TEXT NOT NULL,
    boot_id TEXT NOT NULL,
    first_received_ns INTEGER NOT NULL,
    watermark INTEGER,
    PRIMARY KEY (device, boot_id)
);
CREATE TABLE messages (
    device TEXT NOT NULL,
    boot_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    kind TEXT NOT NULL,
    t_ns INTEGER NOT NULL,
    received_ns INTEGER NOT NULL,
    label TEXT,
    body BLOB NOT NULL,
    PRIMARY KEY (device, boot_id, seq)
);
CREATE INDEX messages_kind_t ON messages (kind, t_ns);
CREATE INDEX messages_device_kind_t ON messages (device, kind, t_ns);
CREATE TABLE quarantine (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    received_ns INTEGER NOT NULL,
    topic TEXT NOT NULL,
    device TEXT,
    reason TEXT NOT NULL,
    where_path TEXT NOT NULL,
    payload BLOB NOT NULL
);
CREATE INDEX quarantine_received ON quarantine (received_ns)
"""

_V1_POSTGRES = """
CREATE TABLE devices (
    device TEXT PRIMARY KEY,
    site TEXT NOT NULL,
    device_type TEXT NOT NULL DEFAULT 'generic',
    first_seen_ns BIGINT NOT NULL,
    last_seen_ns BIGINT,
    online BOOLEAN NOT NULL DEFAULT FALSE,
    boot_id TEXT,
    state_t_ns BIGINT,
    agent_version TEXT NOT NULL DEFAULT '',
    model_sha256 TEXT NOT NULL DEFAULT '',
    latency_json TEXT NOT NULL DEFAULT '{}',
    latency_t_ns BIGINT
);
CREATE TABLE boots (
    device TEXT NOT NULL,
    boot_id TEXT NOT NULL,
    first_received_ns BIGINT NOT NULL,
    watermark BIGINT,
    PRIMARY KEY (device, boot_id)
);
CREATE TABLE messages (
    device TEXT NOT NULL,
    boot_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    kind TEXT NOT NULL,
    t_ns BIGINT NOT NULL,
    received_ns BIGINT NOT NULL,
    label TEXT,
    body BYTEA NOT NULL,
    PRIMARY KEY (device, boot_id, seq)
);
CREATE INDEX messages_kind_t ON messages (kind, t_ns);
CREATE INDEX messages_device_kind_t ON messages (device, kind, t_ns);
CREATE TABLE quarantine (
    id BIGSERIAL PRIMARY KEY,
    received_ns BIGINT NOT NULL,
    topic TEXT NOT NULL,
    device TEXT,
    reason TEXT NOT NULL,
    where_path TEXT NOT NULL,
    payload BYTEA NOT NULL
);
CREATE INDEX quarantine_received ON quarantine (received_ns)
"""

_V2_SQLITE = """
ALTER TABLE devices ADD COLUMN group_name TEXT NOT NULL DEFAULT '';
ALTER TABLE devices ADD COLUMN tier TEXT NOT NULL DEFAULT 'normal';
CREATE TABLE rollouts (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    created_ns INTEGER NOT NULL,
    updated_ns INTEGER NOT NULL,
    doc TEXT NOT NULL
);
CREATE TABLE rollout_requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id TEXT NOT NULL,
    action TEXT NOT NULL,
    requested_ns INTEGER NOT NULL,
    done_ns INTEGER
);
CREATE INDEX messages_kind_received ON messages (kind, received_ns)
"""

_V2_POSTGRES = """
ALTER TABLE devices ADD COLUMN group_name TEXT NOT NULL DEFAULT '';
ALTER TABLE devices ADD COLUMN tier TEXT NOT NULL DEFAULT 'normal';
CREATE TABLE rollouts (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    created_ns BIGINT NOT NULL,
    updated_ns BIGINT NOT NULL,
    doc TEXT NOT NULL
);
CREATE TABLE rollout_requests (
    id BIGSERIAL PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    action TEXT NOT NULL,
    requested_ns BIGINT NOT NULL,
    done_ns BIGINT
);
CREATE INDEX messages_kind_received ON messages (kind, received_ns)
"""

_V3_SQLITE = """
CREATE TABLE ingest_sessions (
    client_id TEXT PRIMARY KEY,
    prefix TEXT NOT NULL,
    node TEXT NOT NULL,
    group_name TEXT NOT NULL,
    idx INTEGER NOT NULL,
    broker TEXT NOT NULL,
    state TEXT NOT NULL,
    created_ns INTEGER NOT NULL,
    last_seen_ns INTEGER NOT NULL,
    ended_ns INTEGER,
    drained INTEGER NOT NULL DEFAULT 0
)
"""

_V3_POSTGRES = """
CREATE TABLE ingest_sessions (
    client_id TEXT PRIMARY KEY,
    prefix TEXT NOT NULL,
    node TEXT NOT NULL,
    group_name TEXT NOT NULL,
    idx INTEGER NOT NULL,
    broker TEXT NOT NULL,
    state TEXT NOT NULL,
    created_ns BIGINT NOT NULL,
    last_seen_ns BIGINT NOT NULL,
    ended_ns BIGINT,
    drained BIGINT NOT NULL DEFAULT 0
)
"""

_V5_SQLITE = """
CREATE TABLE ingest_gaps (
    device TEXT NOT NULL,
    boot_id TEXT NOT NULL,
    first_missing INTEGER NOT NULL,
    last_missing INTEGER NOT NULL,
    found_ns INTEGER NOT NULL,
    PRIMARY KEY (device, boot_id, first_missing)
)
"""

_V5_POSTGRES = """
CREATE TABLE ingest_gaps (
    device TEXT NOT NULL,
    boot_id TEXT NOT NULL,
    first_missing BIGINT NOT NULL,
    last_missing BIGINT NOT NULL,
    found_ns BIGINT NOT NULL,
    PRIMARY KEY (device, boot_id, first_missing)
)
"""

_V6_SQLITE = """
ALTER TABLE devices ADD COLUMN model_health_json TEXT NOT NULL DEFAULT '{}'
"""

_V6_POSTGRES = """
ALTER TABLE devices ADD COLUMN model_health_json TEXT NOT NULL DEFAULT '{}'
"""

_V7_SQLITE = """
CREATE TABLE users (
    name TEXT PRIMARY KEY,
    role TEXT NOT NULL,
    password_hash TEXT NOT NULL,
    created_ns INTEGER NOT NULL,
    disabled INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE api_tokens (
    token_id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    role TEXT NOT NULL,
    secret_hash TEXT NOT NULL,
    created_ns INTEGER NOT NULL,
    created_by TEXT NOT NULL,
    expires_ns INTEGER,
    revoked_ns INTEGER,
    last_used_ns INTEGER
);
CREATE TABLE console_sessions (
    secret_hash TEXT PRIMARY KEY,
    principal TEXT NOT NULL,
    role TEXT NOT NULL,
    csrf TEXT NOT NULL,
    created_ns INTEGER NOT NULL,
    expires_ns INTEGER NOT NULL
);
CREATE TABLE audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    t_ns INTEGER NOT NULL,
    actor TEXT NOT NULL,
    via TEXT NOT NULL,
    remote TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    detail TEXT NOT NULL,
    result TEXT NOT NULL
);
CREATE INDEX audit_t ON audit (t_ns)
"""

_V7_POSTGRES = """
CREATE TABLE users (
    name TEXT PRIMARY KEY,
    role TEXT NOT NULL,
    password_hash TEXT NOT NULL,
    created_ns BIGINT NOT NULL,
    disabled BOOLEAN NOT NULL DEFAULT FALSE
);
CREATE TABLE api_tokens (
    token_id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    role TEXT NOT NULL,
    secret_hash TEXT NOT NULL,
    created_ns BIGINT NOT NULL,
    created_by TEXT NOT NULL,
    expires_ns BIGINT,
    revoked_ns BIGINT,
    last_used_ns BIGINT
);
CREATE TABLE console_sessions (
    secret_hash TEXT PRIMARY KEY,
    principal TEXT NOT NULL,
    role TEXT NOT NULL,
    csrf TEXT NOT NULL,
    created_ns BIGINT NOT NULL,
    expires_ns BIGINT NOT NULL
);
CREATE TABLE audit (
    id BIGSERIAL PRIMARY KEY,
    t_ns BIGINT NOT NULL,
    actor TEXT NOT NULL,
    via TEXT NOT NULL,
    remote TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    detail TEXT NOT NULL,
    result TEXT NOT NULL
);
CREATE INDEX audit_t ON audit (t_ns)
"""

_V8_SQLITE = """
CREATE TABLE signal_minutes (
    device TEXT NOT NULL,
    signal TEXT NOT NULL,
    minute INTEGER NOT NULL,
    min REAL NOT NULL,
    max REAL NOT NULL,
    sum_wmean REAL NOT NULL,
    sum_n INTEGER NOT NULL,
    sum_mean REAL NOT NULL,
    points INTEGER NOT NULL,
    PRIMARY KEY (device, signal, minute)
) WITHOUT ROWID
"""

_V8_POSTGRES = """
CREATE TABLE signal_minutes (
    device TEXT NOT NULL,
    signal TEXT NOT NULL,
    minute BIGINT NOT NULL,
    min DOUBLE PRECISION NOT NULL,
    max DOUBLE PRECISION NOT NULL,
    sum_wmean DOUBLE PRECISION NOT NULL,
    sum_n BIGINT NOT NULL,
    sum_mean DOUBLE PRECISION NOT NULL,
    points BIGINT NOT NULL,
    PRIMARY KEY (device, signal, minute)
)
"""

# v9: the fleet serve nodes on this store and which one leads the rollouts. The leader
# row's epoch is the fencing token: every save of a rollout names the epoch it was decided
# under, and a node that lost the lead can no longer save, so it sends nothing.
_V9 = """
CREATE TABLE fleet_nodes (
    node TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    pid BIGINT NOT NULL,
    started_ns BIGINT NOT NULL,
    seen_ns BIGINT NOT NULL,
    stats_json TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE fleet_leader (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    node TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    since_ns BIGINT NOT NULL
)
"""

# v10: the lowest seq a device still holds per boot (the state message's ``held``): a hole
# at or above it is on its way, not a gap (see fleet.store._common.gap_rows).
_V10_SQLITE = "ALTER TABLE boots ADD COLUMN held INTEGER"
_V10_POSTGRES = "ALTER TABLE boots ADD COLUMN held BIGINT"

# v11: published bundles, so that every fleet serve node can serve every bundle (each
# caches them in its artifact directory; see fleet.artifacts).
_V11_SQLITE = """
CREATE TABLE bundles (
    sha256 TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    created_ns INTEGER NOT NULL,
    data BLOB NOT NULL
)
"""
_V11_POSTGRES = """
CREATE TABLE bundles (
    sha256 TEXT PRIMARY KEY,
    size BIGINT NOT NULL,
    created_ns BIGINT NOT NULL,
    data BYTEA NOT NULL
)
"""

# v12: retention. How far back each message kind was cut (what is missing older than the
# newest cut is not a gap), and the index the minute rollups are cut by.
_V12 = """
CREATE TABLE history_floors (
    kind TEXT PRIMARY KEY,
    floor_ns BIGINT NOT NULL
);
CREATE INDEX signal_minutes_minute ON signal_minutes (minute)
"""

# v13 (PostgreSQL): messages partitioned by kind and day, so that retention drops whole
# days. Declarative partitioning wants the partition key in every unique key, so a
# message's key (device, boot_id, seq) is kept unique in message_keys, a narrow table that
# also says where the stored copy is (kind, t_ns): the ingest inserts a key first and the
# message only if the key was new (fleet.store.postgres). Rows of a kind and day with no
# partition (a device clock far off) land in the default partition; fleet_ensure_partition
# makes a day's partition and moves its rows out of the default. The rows of the table
# before are moved in the same transaction.
_V13_POSTGRES = """
ALTER TABLE messages RENAME TO messages_v12;
ALTER TABLE messages_v12 RENAME CONSTRAINT messages_pkey TO messages_v12_pkey;
DROP INDEX messages_kind_t;
DROP INDEX messages_device_kind_t;
DROP INDEX messages_kind_received;
CREATE TABLE messages (
    device TEXT NOT NULL,
    boot_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    kind TEXT NOT NULL,
    t_ns BIGINT NOT NULL,
    received_ns BIGINT NOT NULL,
    label TEXT,
    body BYTEA NOT NULL,
    PRIMARY KEY (device, boot_id, seq, kind, t_ns)
) PARTITION BY RANGE (kind, t_ns);
CREATE TABLE message_keys (
    device TEXT NOT NULL,
    boot_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    kind TEXT NOT NULL,
    t_ns BIGINT NOT NULL,
    PRIMARY KEY (device, boot_id, seq)
);
CREATE INDEX message_keys_kind_t ON message_keys (kind, t_ns);
CREATE TABLE messages_default PARTITION OF messages DEFAULT;
CREATE INDEX messages_kind_t ON messages (kind, t_ns);
CREATE INDEX messages_device_kind_t ON messages (device, kind, t_ns);
CREATE INDEX messages_kind_received ON messages (kind, received_ns);
CREATE FUNCTION fleet_partition_name(k TEXT, day BIGINT) RETURNS TEXT
LANGUAGE sql IMMUTABLE AS $$
    SELECT 'messages_' || regexp_replace(k, '[^a-z]', '_', 'g') || '_'
        || to_char(to_timestamp(day * 86400) AT TIME ZONE 'UTC', 'YYYYMMDD')
$$;
CREATE FUNCTION fleet_ensure_partition(k TEXT, day BIGINT) RETURNS BOOLEAN
LANGUAGE plpgsql AS $$
DECLARE
    part TEXT := fleet_partition_name(k, day);
    lo BIGINT := day * 86400000000000;
    hi BIGINT := (day + 1) * 86400000000000;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('fleet_partitions'));
    IF to_regclass(quote_ident(part)) IS NOT NULL THEN
        RETURN FALSE;
    END IF;
    EXECUTE format('CREATE TABLE %I (LIKE messages INCLUDING DEFAULTS)', part);
    EXECUTE format('WITH moved AS (DELETE FROM messages_default WHERE kind = $1 AND t_ns >= $2 '
                   'AND t_ns < $3 RETURNING *) INSERT INTO %I SELECT * FROM moved', part)
        USING k, lo, hi;
    EXECUTE format('ALTER TABLE messages ATTACH PARTITION %I FOR VALUES FROM (%L, %s) TO (%L, %s)',
                   part, k, lo, k, hi);
    RETURN TRUE;
END
$$;
SELECT fleet_ensure_partition(kind, day) FROM (
    SELECT DISTINCT kind, t_ns / 86400000000000 AS day FROM messages_v12
    WHERE t_ns >= 946684800000000000 AND t_ns < 4102444800000000000
) AS days;
INSERT INTO messages (device, boot_id, seq, kind, t_ns, received_ns, label, body)
SELECT device, boot_id, seq, kind, t_ns, received_ns, label, body FROM messages_v12;
INSERT INTO message_keys (device, boot_id, seq, kind, t_ns)
SELECT device, boot_id, seq, kind, t_ns FROM messages_v12;
DROP TABLE messages_v12
"""

# v14 (PostgreSQL): message_keys' primary key carries t_ns, so the gap queries (a device's
# keys in seq order, each with its time) read the index alone once the rows are all-visible.
# Keys arrive interleaved across the fleet: a day of one device's keys sits on about as many
# heap pages as it has keys, and next to each other in the index.
_V14_POSTGRES = """
CREATE UNIQUE INDEX message_keys_covering ON message_keys (device, boot_id, seq) INCLUDE (t_ns);
ALTER TABLE message_keys DROP CONSTRAINT message_keys_pkey;
ALTER TABLE message_keys
    ADD CONSTRAINT message_keys_pkey PRIMARY KEY USING INDEX message_keys_covering
"""

# v15: the runs of stored seqs per device boot (fleet.store.runs), so that a device's gaps
# read a few rows instead of every key stored for it; filled from the keys stored so far.
_V15_TABLE = """
CREATE TABLE seq_runs (
    device TEXT NOT NULL,
    boot_id TEXT NOT NULL,
    low BIGINT NOT NULL,
    high BIGINT NOT NULL,
    high_t BIGINT NOT NULL,
    PRIMARY KEY (device, boot_id, low)
);
"""
_V15_SQLITE = _V15_TABLE + fill_sql("messages")
_V15_POSTGRES = _V15_TABLE + fill_sql("message_keys")

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "registry, boots, messages, quarantine", _V1_SQLITE, _V1_POSTGRES),
    Migration(2, "rollouts, rollout requests, device labels", _V2_SQLITE, _V2_POSTGRES),
    Migration(3, "ingest sessions", _V3_SQLITE, _V3_POSTGRES),
    Migration(5, "gaps the ingest found while it ran", _V5_SQLITE, _V5_POSTGRES),
    Migration(6, "the serving model's health per device", _V6_SQLITE, _V6_POSTGRES),
    Migration(7, "users, API tokens, console sessions, audit log", _V7_SQLITE, _V7_POSTGRES),
    Migration(8, "per-signal telemetry by minute", _V8_SQLITE, _V8_POSTGRES),
    Migration(9, "fleet serve nodes and the rollout leader", _V9, _V9),
    Migration(10, "the seq each device boot still holds", _V10_SQLITE, _V10_POSTGRES),
    Migration(11, "published bundles, for every node to serve", _V11_SQLITE, _V11_POSTGRES),
    Migration(12, "retention: how far back history was cut", _V12, _V12),
    Migration(13, "messages partitioned by kind and day (PostgreSQL)", "", _V13_POSTGRES),
    Migration(14, "message keys with their time in the index (PostgreSQL)", "", _V14_POSTGRES),
    Migration(15, "runs of stored seqs per device boot, for gaps", _V15_SQLITE, _V15_POSTGRES),
)

#: The schema version this code writes and reads.
LATEST = MIGRATIONS[-1].version


def _check_order() -> None:
    versions = [m.version for m in MIGRATIONS]
    if versions[:1] != [1] or any(b <= a for a, b in itertools.pairwise(versions)):
        raise RuntimeError(f"fleet store migrations are not numbered 1, then upwards: {versions}")


_check_order()


def pending(applied: set[int]) -> list[Migration]:
    """The migrations a database that recorded ``applied`` still needs, in order."""
    return [m for m in MIGRATIONS if m.version not in applied]


def sqlite_statements(sql: str) -> list[str]:
    """The statements of a migration's SQLite text (see the module docstring)."""
    return [s.strip() for s in sql.split(";") if s.strip()]
