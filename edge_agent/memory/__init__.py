"""Memory stage: working memory (RAM ring), episodic store (SQLite WAL, delta-encoded state
changes, decisions, events), semantic memory (per-signal baselines), aging, snapshots.

:class:`MemoryStage` (``process(window, decision, now_ns) -> MemoryContext``) is the stage,
:class:`MemorySection` its ``[memory]`` config section, :class:`MemoryContext` what reasoning
gets with each window, ``memory_app`` the ``edge-agent memory`` sub-app.
Storage layout and policies: ``docs/MEMORY.md``.
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
