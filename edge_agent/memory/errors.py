"""Errors of the memory stage, rooted in :class:`edge_agent.errors.AgentError`.

Corruption found at start is not raised: the file is moved aside and the newest good
snapshot restored (see :mod:`edge_agent.memory.snapshots`); the outcome is logged at ERROR
and reported in the stage's ``stats()["recovery"]``.
"""

from __future__ import annotations

from edge_agent.errors import AgentError


class MemoryStoreError(AgentError):
    """The memory store cannot be used (open, migrate, read or write).

    ::

        AgentError
        └── MemoryStoreError          the SQLite store cannot be opened, read or written
            ├── StoreLocked           another process (a running agent) holds the store
            ├── SchemaVersionError    the file was written by a newer build (user_version too high)
            └── SnapshotError         a snapshot cannot be taken, found, read or restored
                └── SnapshotChecksumError   its bytes do not match the manifest: refused
    """


class StoreLocked(MemoryStoreError):
    """Another process holds the store's writer lock (``<db>.lock``), e.g. a running agent."""


class SchemaVersionError(MemoryStoreError):
    """The database's ``PRAGMA user_version`` is newer than this build knows; it is left alone."""


class SnapshotError(MemoryStoreError):
    """A snapshot cannot be taken, listed, verified or restored."""


class SnapshotChecksumError(SnapshotError):
    """A snapshot's size or sha256 differs from its manifest; it is never restored."""


__all__ = [
    "MemoryStoreError",
    "SchemaVersionError",
    "SnapshotChecksumError",
    "SnapshotError",
    "StoreLocked",
]
