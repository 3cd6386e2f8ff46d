"""The fleet's error tree, drawn on its root :class:`FleetError`. Every error the ``fleet``
package raises derives from it.
"""

from __future__ import annotations


class FleetError(Exception):
    """Root of every error raised by the fleet manager.

    ::

        FleetError
         ├── FleetStoreError         the store cannot be opened, migrated or written
         │    ├── SchemaTooNew       the database was migrated by newer code than this
         │    └── StoreRefused       the database answers and refuses this data (not an outage)
         ├── PkiError                a CA or certificate file is missing, foreign or refused
         ├── FleetKeyError           a signing key or root.json is missing, unreadable or refused
         ├── BundleError             a bundle cannot be built, read, signed or inspected
         ├── IngestError             the ingest service cannot run (bad broker, bad options)
         ├── MessageRefused          one uplink message quarantined (bad topic, schema, device)
         ├── RolloutError            a rollout cannot be created or changed (bundle, plan, request)
         │    ├── PlanError          (also a ValueError) a selector, wave list or threshold that
         │    │                      cannot be planned; says what and where
         │    └── LeadershipLost     this node no longer leads: a save under its epoch refused
         ├── NodesRefused            the store cannot take another fleet serve node
         ├── ArtifactError           the artifact server cannot bind, read its folder or publish
         │    └── ArtifactPortInUse  its HTTP or CoAP port is taken by another process
         ├── AccessError             a user, token, password, role or session was refused
         └── RetentionError          a --retention spec that cannot be applied; says which part
    """


class FleetStoreError(FleetError):
    """The store failed: a bad URL, an unreachable database, a failed migration or write."""


class PkiError(FleetError):
    """A CA or certificate operation failed: a missing, unreadable or foreign file, a bad name,
    a wrong passphrase, or a refusal to overwrite. The message names the file and the fault."""


class FleetKeyError(FleetError):
    """A signing-key or trust-root operation failed: a missing or unreadable key, a wrong
    passphrase, a refusal to overwrite, a threshold that cannot be met, or a new root that
    devices would refuse. ``missing`` is true when a file or folder is simply not there."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


class BundleError(FleetError):
    """A bundle could not be built, read, signed or inspected: a bad source (model folder,
    config, wheel), a malformed or damaged bundle, or a key the root does not trust.
    ``missing`` is true when a file is simply not there."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


class StoreRefused(FleetStoreError):
    """The database refused the data itself (a constraint, a value it cannot hold): retrying
    the same rows cannot help, unlike an outage. The ingest quarantines such a message."""


class SchemaTooNew(FleetStoreError):
    """The database schema is newer than this code knows; running on it could corrupt it."""

    def __init__(self, url: str, found: int, known: int) -> None:
        super().__init__(
            f"store {url}: schema version {found} is newer than this fleet knows ({known}); "
            "upgrade the fleet package instead of running old code on a new database"
        )
        self.found = found
        self.known = known


class IngestError(FleetError):
    """The ingest service cannot run: a bad broker address or option (not bad messages)."""


class MessageRefused(FleetError):
    """One uplink message the ingest quarantines instead of storing.

    ``cls`` is the reason class counted in the ingest stats (``topic``, ``schema``,
    ``device_mismatch``, ``site_mismatch``, ``unknown_device``, ``store``, ``internal``);
    ``where`` is a JSON path into the payload; ``device`` is the topic's device when the
    topic parsed.
    """

    def __init__(self, cls: str, reason: str, where: str = "$", device: str | None = None):
        super().__init__(f"{reason} (at {where})" if where != "$" else reason)
        self.cls = cls
        self.reason = reason
        self.where = where
        self.device = device


class ArtifactError(FleetError):
    """The artifact server cannot serve: a missing directory, a port it cannot bind, a bundle
    it cannot publish. The message names the directory, address or file."""


class ArtifactPortInUse(ArtifactError):
    """The artifact server's HTTP or CoAP port (``transport``) is bound by another process;
    the CLI names the option that set it."""

    def __init__(self, transport: str, host: str, port: int) -> None:
        super().__init__(f"{transport} {host}:{port} is already in use")
        self.transport = transport
        self.host = host
        self.port = port


class RolloutError(FleetError):
    """A rollout cannot be created or changed: the bundle, the plan or the request."""


class LeadershipLost(RolloutError):
    """This node no longer leads the rollouts (another took the lead): it must send
    nothing more; what it decided last was not saved."""


class NodesRefused(FleetError):
    """This store cannot take another ``fleet serve`` node (SQLite holds one)."""


class PlanError(RolloutError, ValueError):
    """A selector, wave list or threshold that cannot be planned; says what and where."""


class AccessError(FleetError):
    """A user, token, password, role or session was refused (fleet.access, the API)."""


class RetentionError(FleetError):
    """A ``--retention`` spec that cannot be applied; says which part and why."""
