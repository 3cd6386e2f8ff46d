"""Memory stage: working memory (RAM ring), episodic store (SQLite WAL, delta-encoded state
changes, decisions, events), semantic memory (per-signal baselines), aging, snapshots.

Public API::

    MemorySection          the ``[memory]`` config section (edge_agent.memory.config)
    MemoryStage            process(window, decision, now_ns) -> MemoryContext; start/run/flush/close
    MemoryContext          what reasoning gets with each window
    memory_app             the ``edge-agent memory`` typer sub-app (edge_agent.memory.cli)

See ``docs/ARCHITECTURE.md`` ("Memory") for the storage layout and the policies.
"""

from edge_agent.memory.config import MemorySection
from edge_agent.memory.errors import (
    MemoryStoreError,
    SchemaVersionError,
    SnapshotChecksumError,
    SnapshotError,
    StoreLocked,
)
from edge_agent.memory.stage import MemoryContext, MemoryStage

__all__ = [
    "MemoryContext",
    "MemorySection",
    "MemoryStage",
    "MemoryStoreError",
    "SchemaVersionError",
    "SnapshotChecksumError",
    "SnapshotError",
    "StoreLocked",
]
