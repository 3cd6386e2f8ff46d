"""The fleet store: device registry, data messages, quarantine and gaps.

SQLite (embedded, the default) or PostgreSQL (many ingest workers), behind one
:class:`~fleet.store.base.Store` interface; :func:`open_store` picks by URL scheme.
"""

from fleet.errors import FleetStoreError, SchemaTooNew
from fleet.store.base import (
    DATA_KINDS,
    QUARANTINE_PAYLOAD_MAX,
    DeviceInfo,
    Gap,
    IngestResult,
    IngestSession,
    Quarantined,
    Row,
    Store,
    open_store,
    redact_url,
)

__all__ = [
    "DATA_KINDS",
    "QUARANTINE_PAYLOAD_MAX",
    "DeviceInfo",
    "FleetStoreError",
    "Gap",
    "IngestResult",
    "IngestSession",
    "Quarantined",
    "Row",
    "SchemaTooNew",
    "Store",
    "open_store",
    "redact_url",
]
