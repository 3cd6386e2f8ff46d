"""The fleet store's interface and the records that cross it.

One :class:`Store` per worker (thread or process): a store object owns one database
connection and is not shared between threads. Several stores on the same database are safe
together; ingest is idempotent on ``(device, boot_id, seq)``, so a message redelivered by the
broker, or handled by two workers, is stored once and counted as a duplicate.

Time values are UNIX nanoseconds (``*_ns``) and are always passed in by the caller (the
store never reads the clock), so tests need no sleeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from fleet.access import AuditEntry, TokenInfo, UserInfo
    from fleet.store.console_sql import Bucket, DeviceFilter
    from wire.messages import StateMsg

#: The data kinds a :class:`Row` may hold (the seq-numbered streams of the wire contract).
DATA_KINDS = ("telemetry", "decision", "ota/status")
#: What :meth:`Store.quarantine` keeps of a payload; the caller cuts it to this.
QUARANTINE_PAYLOAD_MAX = 4096


@dataclass(frozen=True, slots=True)
class Row:
    """One validated data message, ready to store. ``body`` is the payload exactly as received."""

    device: str
    site: str
    kind: str  # "telemetry" | "decision" | "ota/status"
    boot_id: str
    seq: int
    t_ns: int
    body: bytes
    received_ns: int


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A message the fleet refused, kept for a person to look at. ``where`` is a JSON path."""

    topic: str
    payload: bytes  # cut by the caller to QUARANTINE_PAYLOAD_MAX
    reason: str
    where: str
    received_ns: int
    device: str | None


@dataclass(frozen=True, slots=True)
class IngestResult:
    """Rows stored, rows already stored with the same bytes (a redelivery: dropped), and
    rows whose key was stored with another body (quarantined as ``conflict``)."""

    inserted: int
    duplicates: int
    conflicts: int = 0


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """The registry's view of one device.

    ``online``, ``boot_id`` and the versions come from the newest boot's state messages;
    ``last_seen_ns`` is the latest receive time of any message from the device;
    ``last_seq`` is the highest data seq stored for the current boot; ``latency_ms`` is the
    ``stage_latency_ms`` of the device's most recent decision (null stages left out);
    ``model_health`` what its newest ``online`` state says about the serving model
    (``ood``: signals out of the training distribution, ``alarm_storm``,
    ``acquisition_mismatch``), empty when nothing is wrong (or the device is offline).
    """

    device: str
    site: str
    device_type: str
    online: bool
    last_seen_ns: int | None
    boot_id: str | None
    agent_version: str
    model_sha256: str
    first_seen_ns: int
    last_seq: int | None
    latency_ms: dict[str, float] = field(default_factory=dict)
    model_health: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One ``fleet serve`` node on the store (schema v9): who, since when, last seen, its
    ingest figures (``stats``) and whether it leads the rollouts (and under which epoch)."""

    node: str
    host: str
    pid: int
    started_ns: int
    seen_ns: int
    stats: dict[str, object]
    leader: bool
    epoch: int | None


@dataclass(frozen=True, slots=True)
class IngestSession:
    """One MQTT session of the ingest at the broker, as ``fleet serve`` records it (schema v3).

    ``state``: ``active`` (a running fleet serve's worker reads it), ``stopped`` (its fleet
    serve stopped cleanly; messages wait in it for the next start), ``draining`` (no worker
    will read it: being emptied into the store), ``orphaned`` (its node is gone: any fleet
    serve drains it), ``ended`` (drained and deleted at the broker).
    """

    client_id: str
    #: The client id prefix of the fleet serve that owns it (``fleet-ingest-{node}``).
    prefix: str
    node: str
    group: str
    #: The worker index; -1 for a session named by an older version (no index).
    index: int
    broker: str
    state: str
    created_ns: int
    last_seen_ns: int
    ended_ns: int | None = None
    #: Messages its drain stored.
    drained: int = 0


@dataclass(frozen=True, slots=True)
class Gap:
    """Seqs ``first_missing..last_missing`` (inclusive) of one boot that were never stored."""

    device: str
    boot_id: str
    first_missing: int
    last_missing: int


class Store(Protocol):
    """What the ingest workers, the registry and the CLI need from a database.

    Every method raises :class:`fleet.errors.FleetStoreError` (never a driver exception).
    """

    #: The store's URL with any password replaced by ``***`` (safe to log).
    url: str

    def migrate(self) -> int:
        """Apply pending migrations (each in its own transaction); return the schema version.

        Raises :class:`fleet.errors.SchemaTooNew` if the database is newer than this code.
        """
        ...

    def ingest(self, rows: Sequence[Row]) -> IngestResult:
        """Store ``rows`` in ONE transaction. A row whose ``(device, boot_id, seq)`` is already
        stored (or repeated inside ``rows``) with the same body is counted as a duplicate,
        not an error; with another body it is a conflict: the first body stays and the row
        goes to the quarantine (reason ``conflict: ...``) in the same transaction.

        Also updates the registry's ``last_seen_ns`` and, for decisions, the latest stage
        latencies. Devices not yet in the registry are added (the caller decides beforehand,
        with :meth:`ensure_device`, whether a device is welcome).
        """
        ...

    def quarantine(self, items: Sequence[Quarantined]) -> None:
        """Keep refused messages (one transaction); payloads beyond 4 KiB are cut."""
        ...

    def record_state(self, device: str, site: str, state: StateMsg, received_ns: int) -> None:
        """Update the registry from a state message (birth, clean offline or Last Will).

        A state of an OLDER boot than the one the registry holds (by ``t_ns``) only raises the
        watermark of that old boot; it never marks the newer boot offline. The state's ``seq``
        (the device's data watermark) and its ``held`` (only ever raised) feed :meth:`gaps`.
        Adds the device (at ``site``) if missing: apply the registration policy first. Never
        changes a registered device's site: a message cannot move a device (the ingest
        refuses one whose topic names another site, see :meth:`device_site`).
        """
        ...

    def ensure_device(
        self, device: str, site: str, received_ns: int, *, auto_register: bool
    ) -> bool:
        """True if ``device`` is registered (adding it when ``auto_register``); False means
        unknown and not added: the caller quarantines its messages."""
        ...

    def device_site(self, device: str) -> str | None:
        """The site ``device`` is registered at (the first it was seen at, or the one
        :meth:`register_device` set), or None if it is not registered."""
        ...

    def register_device(self, device: str, site: str, device_type: str = "generic") -> None:
        """Add ``device`` to the registry, or update its site and type if already there (an
        operator moving a device; messages never do).

        ``first_seen_ns`` stays 0 until the device's first message."""
        ...

    def devices(self) -> list[DeviceInfo]:
        """Every registered device, ordered by name."""
        ...

    def device(self, name: str) -> DeviceInfo | None: ...

    def telemetry(
        self, device: str, *, since_ns: int | None = None, limit: int = 100
    ) -> list[tuple[int, int, str, bytes]]:
        """``(t_ns, seq, boot_id, body)`` of the newest ``limit`` telemetry messages with
        ``t_ns >= since_ns``, oldest first (newest last)."""
        ...

    def decisions(
        self,
        *,
        since_ns: int | None = None,
        device: str | None = None,
        label: str | None = None,
        limit: int = 100,
    ) -> list[tuple[str, int, int, bytes]]:
        """``(device, t_ns, seq, body)`` of the newest ``limit`` decisions matching the
        filters, oldest first (newest last)."""
        ...

    def gaps(self, device: str | None = None) -> list[Gap]:
        """Seq holes per ``(device, boot_id)`` between the lowest and highest seq stored, plus
        the tail from the highest stored seq up to the boot's state watermark when known.

        A boot with a watermark but no stored data reports ``0..watermark``. Nothing at or
        above the boot's ``held`` (the lowest seq its device still holds, from its state
        messages) is reported: that is on its way. Ordered by device, boot's first receive
        time, first_missing.
        """
        ...

    def compact_runs(self, limit: int = 10_000) -> int:
        """Fold the runs of stored seqs that :meth:`gaps` reads where they overlap or touch
        (two workers storing one device's messages at once, a hole filled late), up to
        ``limit`` device boots, one short transaction each; how many rows went. The gaps
        are the same before and after (:mod:`fleet.store.runs`). Raises ``FleetStoreError``."""
        ...

    def record_new_gaps(self, since_ns: int, until_ns: int, found_ns: int) -> list[Gap]:
        """Find the holes behind the data messages received in ``[since_ns, until_ns)``,
        record those still open in ``ingest_gaps`` and return the ones no one had recorded
        (several workers may audit the same window: each hole is returned to one of them).

        A hole is keyed by its first missing seq: one that shrank from below since it was
        recorded (some of it arrived late) is a new hole. A hole at or above the boot's
        ``held`` is not one (see :meth:`gaps`).
        """
        ...

    def quarantined(self, *, limit: int = 100) -> list[Quarantined]:
        """The newest ``limit`` quarantined messages, newest first."""
        ...

    def counts(self) -> dict[str, int]:
        """``{"telemetry": n, "decision": n, "ota/status": n, "quarantined": n, "devices": n}``."""
        ...

    # -- rollouts (schema v2) -------------------------------------------------------------

    def set_labels(self, device: str, *, group: str | None, tier: str | None) -> bool:
        """Set a device's rollout group and/or tier; False if the device is unknown."""
        ...

    def labels(self) -> dict[str, tuple[str, str]]:
        """``device -> (group, tier)`` for every registered device."""
        ...

    def expire(self, kind: str, before_ns: int, limit: int) -> int:
        """Delete up to ``limit`` rows of ``kind`` older than ``before_ns`` (one short
        transaction; call again until it returns less than ``limit``); how many went.
        Kinds: a message kind (by its ``t_ns``; the cut is recorded, so :meth:`gaps` does
        not report what it removed), ``quarantine`` (by ``received_ns``) or ``minutes``
        (the rollups, by their minute). Raises ``FleetStoreError``.

        On PostgreSQL a message kind goes by whole days: each day's partition wholly older
        than ``before_ns`` is dropped at once (its rows count, whatever ``limit``), and only
        rows outside every partition (a device clock far off) are deleted one by one; the
        day that straddles ``before_ns`` stays until it is wholly older."""
        ...

    def prepare_history(self, now_ns: int) -> int:
        """Make ready what the history of the coming days needs: on PostgreSQL each message
        kind's day partitions from the day before ``now_ns`` (UTC) to a week after it; how
        many were new. Nothing on SQLite. Raises ``FleetStoreError``."""
        ...

    def put_bundle(self, sha256: str, data: bytes, now_ns: int) -> None:
        """Keep a published bundle's bytes (once per sha256; the caller checked the hash),
        so every ``fleet serve`` node on this store can serve it."""
        ...

    def bundle(self, sha256: str) -> bytes | None:
        """A published bundle's bytes as kept by :meth:`put_bundle`, or None."""
        ...

    def insert_rollout(self, rollout_id: str, state: str, doc: str, now_ns: int) -> bool:
        """Create a rollout; False (nothing written) when the id exists already."""
        ...

    def save_rollout(
        self, rollout_id: str, state: str, doc: str, now_ns: int, *, epoch: int | None = None
    ) -> None:
        """Insert or replace a rollout's whole state (one JSON document); with ``epoch``,
        only while that epoch leads the rollouts (else ``LeadershipLost``)."""
        ...

    def node_seen(
        self, node: str, *, host: str, pid: int, started_ns: int, now_ns: int, stats_json: str
    ) -> None:
        """A ``fleet serve`` node's heartbeat (schema v9)."""
        ...

    def node_gone(self, node: str) -> None: ...

    def nodes(self) -> list[NodeInfo]:
        """Every node recorded, the leader marked."""
        ...

    def take_lead(self, node: str, now_ns: int) -> int:
        """``node`` leads the rollouts from now: the new epoch (fencing token)."""
        ...

    def rollouts(self, *, active_only: bool = False) -> list[tuple[str, str, str]]:
        """``(id, state, doc)`` newest first; active = running or paused."""
        ...

    def add_rollout_request(self, rollout_id: str, action: str, now_ns: int) -> None: ...

    def pending_rollout_requests(self) -> list[tuple[int, str, str]]:
        """``(id, rollout_id, action)`` of the requests not yet applied, in the order made.

        Reading marks nothing: the orchestrator marks them with
        :meth:`finish_rollout_requests` once the rollouts they changed are saved, so a
        crash in between applies them again (every action is idempotent) instead of
        losing them.
        """
        ...

    def finish_rollout_requests(self, ids: Sequence[int], now_ns: int) -> None:
        """Mark requests applied (their rollouts' new state is saved)."""
        ...

    def ota_status_since(
        self, received_ns: int, *, limit: int = 10_000, after: bytes | None = None
    ) -> list[tuple[int, bytes]]:
        """``(received_ns, body)`` of stored ``ota/status`` messages, at most ``limit``, in
        ``(received_ns, body)`` order: those that arrived after ``received_ns``, or with
        ``after``, those after the row ``(received_ns, after)`` in that order.

        A page of ``limit`` rows may end inside a run of rows stored at the same nanosecond:
        read the next page with the last row's ``(received_ns, body)`` as ``(received_ns,
        after)`` until a page is shorter than ``limit``. The body breaks ties because it
        holds the message's device, boot id and seq (the row's key): two rows never have
        the same, and if they did they would be the same report."""
        ...

    # -- ingest sessions (schema v3) ------------------------------------------------------

    def ingest_sessions(self) -> list[IngestSession]:
        """Every recorded ingest session, by client id."""
        ...

    def save_ingest_sessions(
        self, sessions: Sequence[IngestSession], *, if_state: str | None = None
    ) -> int:
        """Write ``sessions`` in one transaction (by client id; a known session keeps its
        ``created_ns``); return how many were written. With ``if_state``, only sessions
        recorded in that state are changed (a claim: of two fleet serves taking the same
        orphan, one gets it)."""
        ...

    def ping(self) -> None:
        """Return if the database answers now and a write could start (SQLite: its write
        lock is free), else raise FleetStoreError."""
        ...

    def close(self) -> None: ...


class OperatorStore(Store, Protocol):
    """A :class:`Store` with what operators' tools need: users, API tokens, console sessions
    and the audit log (schema v7, :mod:`fleet.store.access_sql`; ``AccessError`` for a taken
    or unknown name) and the console's reads (:mod:`fleet.store.console_sql`)."""

    def devices_page(
        self, f: DeviceFilter, *, after: tuple[Any, str] | None = None, limit: int = 100
    ) -> list[tuple[DeviceInfo, str, str]]: ...
    def signals(self, device: str) -> list[str]: ...
    def fleet_state(self) -> tuple[int, int, dict[str, int]]: ...
    def series(
        self, device: str, signal: str, *, since_ns: int, until_ns: int, bucket_ns: int
    ) -> list[Bucket]: ...
    def decisions_page(
        self,
        *,
        device: str | None = None,
        label: str | None = None,
        since_ns: int = 0,
        until_ns: int = 2**63 - 1,
        before: tuple[int, str, int] | None = None,
        limit: int = 100,
    ) -> list[tuple[str, int, int, str, bytes]]: ...
    def ota_history(self, device: str, *, limit: int = 100) -> list[tuple[int, int, bytes]]: ...
    def decisions_received(
        self, after: tuple[int, str, str, int] | None, *, limit: int = 1000
    ) -> list[tuple[int, str, str, int, int, bytes]]: ...
    def newest_received(self, kind: str) -> tuple[int, str, str, int] | None: ...
    def quarantine_page(
        self, *, before_id: int | None = None, limit: int = 100
    ) -> list[tuple[int, Quarantined]]: ...

    def add_user(self, name: str, role: str, password_hash: str, now_ns: int) -> None: ...
    def update_user(
        self,
        name: str,
        *,
        role: str | None = None,
        password_hash: str | None = None,
        disabled: bool | None = None,
    ) -> None: ...
    def users(self) -> list[UserInfo]: ...
    def user_password(self, name: str) -> tuple[str, str] | None: ...
    def add_token(self, info: TokenInfo, secret_hash: str) -> None: ...
    def tokens(self) -> list[TokenInfo]: ...
    def token(self, token_id: str) -> tuple[TokenInfo, str] | None: ...
    def touch_token(self, token_id: str, now_ns: int) -> None: ...
    def revoke_token(self, name: str, now_ns: int) -> None: ...
    def add_session(
        self,
        secret_hash: str,
        principal: str,
        role: str,
        csrf: str,
        *,
        now_ns: int,
        expires_ns: int,
    ) -> None: ...
    def session(self, secret_hash: str, now_ns: int) -> tuple[str, str, str] | None: ...
    def drop_session(self, secret_hash: str) -> None: ...
    def audit(self, entry: AuditEntry) -> int: ...
    def audit_log(self, *, before_id: int | None = None, limit: int = 100) -> list[AuditEntry]: ...


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{user}:***@{host}" + (f":{port}" if port is not None else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
