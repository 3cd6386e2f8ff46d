"""The fleet store: device registry, data messages, quarantine and gaps.

SQLite (embedded, the default) or PostgreSQL (many ingest workers), behind one
:class:`~fleet.store.base.Store` interface; :func:`open_store` picks the backend by URL
scheme from :data:`BACKENDS`. Both backends share their queries through
:class:`fleet.store.sql.SqlStore`.
"""

from __future__ import annotations

import importlib

from fleet.errors import FleetStoreError, SchemaTooNew
from fleet.store.base import (
    DATA_KINDS,
    QUARANTINE_PAYLOAD_MAX,
    DeviceInfo,
    Gap,
    IngestResult,
    IngestSession,
    OperatorStore,
    Quarantined,
    Row,
    Store,
    redact_url,
)

#: URL scheme -> (module, class). Imported on use: the SQLite-only edge never needs psycopg.
BACKENDS: dict[str, tuple[str, str]] = {
    "sqlite": ("fleet.store.sqlite", "SqliteStore"),
    "postgresql": ("fleet.store.postgres", "PostgresStore"),
    "postgres": ("fleet.store.postgres", "PostgresStore"),
}


def open_store(url: str) -> OperatorStore:
    """Open the store at ``url``: ``sqlite:///abs/path.db`` or ``postgresql://...``.

    Does not migrate; call :meth:`Store.migrate` (the ingest service does at start).
    Raises :class:`fleet.errors.FleetStoreError` for any other scheme or an unreachable store.
    """
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise FleetStoreError(
            f"store URL {redact_url(url)!r} has no scheme; "
            "expected sqlite:///abs/path.db or postgresql://..."
        )
    backend = BACKENDS.get(scheme.lower())
    if backend is None:
        raise FleetStoreError(
            f"store URL scheme {scheme.lower()!r} is not supported (in {redact_url(url)!r}); "
            "expected 'sqlite' or 'postgresql'"
        )
    module, name = backend
    store: OperatorStore = getattr(importlib.import_module(module), name)(url)
    return store


__all__ = [
    "BACKENDS",
    "DATA_KINDS",
    "QUARANTINE_PAYLOAD_MAX",
    "DeviceInfo",
    "FleetStoreError",
    "Gap",
    "IngestResult",
    "IngestSession",
    "OperatorStore",
    "Quarantined",
    "Row",
    "SchemaTooNew",
    "Store",
    "open_store",
    "redact_url",
]
