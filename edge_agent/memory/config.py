"""The ``[memory]`` section of the agent's TOML config.

Same rules as :mod:`edge_agent.config`: strict types, unknown keys rejected, frozen. Relative
paths (``path``, ``snapshot_dir``) are relative to ``agent.state_dir``; see
:meth:`MemorySection.resolve`. Sizes are bytes, times carry their unit in the key name.
Every key, with its default and what it does: ``examples/agent.toml`` (the commented
``[memory]`` section; what the stage does with them: ``docs/MEMORY.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

from pydantic import Field, model_validator

from edge_agent._schema import Name, StrictModel

_MIB = 1 << 20


class MemorySection(StrictModel):
    """Working memory, episodic store, baselines, aging and snapshots (field docs above)."""

    enabled: bool = True
    path: Annotated[str, Field(min_length=1)] = "memory.db"
    ring_windows: Annotated[int, Field(ge=1, le=100_000)] = 64
    default_deadband: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    deadband: dict[Name, Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        default_factory=dict
    )
    keyframe_interval_s: Annotated[float, Field(gt=0, le=86_400)] = 60.0
    batch_max_rows: Annotated[int, Field(ge=1_000, le=100_000_000)] = 200_000
    commit_interval_ms: Annotated[int, Field(ge=10, le=600_000)] = 1_000
    checkpoint_interval_s: Annotated[float, Field(gt=0, le=86_400)] = 300.0
    journal_size_limit_bytes: Annotated[int, Field(ge=0, le=1 << 40)] = 16 * _MIB
    ttl_h: Annotated[float, Field(gt=0, le=24 * 3660)] = 72.0
    max_bytes: Annotated[int, Field(ge=64 * 1024, le=1 << 50)] = 256 * _MIB
    aging_interval_s: Annotated[float, Field(gt=0, le=86_400)] = 10.0
    aging_step_ms: Annotated[float, Field(gt=0, le=1_000)] = 1.0
    aging_chunk_s: Annotated[float, Field(gt=0, le=30 * 86_400)] = 3600.0
    snapshot_interval_s: Annotated[float, Field(ge=0, le=30 * 86_400)] = 900.0
    snapshot_dir: Annotated[str, Field(min_length=1)] = "memory-snapshots"
    snapshot_keep: Annotated[int, Field(ge=1, le=1_000)] = 4
    baseline_half_life_s: Annotated[float, Field(gt=0, le=365 * 86_400)] = 3600.0
    drift_half_life_s: Annotated[float, Field(gt=0, le=365 * 86_400)] = 60.0

    @model_validator(mode="after")
    def _consistent(self) -> MemorySection:
        if self.aging_chunk_s < self.keyframe_interval_s:
            raise ValueError(
                f"aging_chunk_s ({self.aging_chunk_s:g}) must be at least keyframe_interval_s "
                f"({self.keyframe_interval_s:g}): a chunk starts at a keyframe"
            )
        if self.drift_half_life_s > self.baseline_half_life_s:
            raise ValueError(
                f"drift_half_life_s ({self.drift_half_life_s:g}) must be at most "
                f"baseline_half_life_s ({self.baseline_half_life_s:g})"
            )
        return self

    def resolve(self, state_dir: str | Path) -> tuple[Path, Path]:
        """``(database path, snapshot directory)``; relative paths are under ``state_dir``."""
        base = Path(state_dir).expanduser()
        db = Path(self.path).expanduser()
        snaps = Path(self.snapshot_dir).expanduser()
        return (
            db if db.is_absolute() else base / db,
            snaps if snaps.is_absolute() else base / snaps,
        )

    def deadbands_for(self, signals: Sequence[str]) -> tuple[float, ...]:
        """The deadband of each signal, in order: its own entry or ``default_deadband``."""
        return tuple(float(self.deadband.get(s, self.default_deadband)) for s in signals)

    def check(self, signals: Sequence[str]) -> list[str]:
        """Cross-section errors (for the config loader): deadbands of signals nobody perceives."""
        known = set(signals)
        return [
            f"memory.deadband.{name}: {name!r} is not a perception signal; "
            f"known: {', '.join(signals) or 'none'}"
            for name in self.deadband
            if name not in known
        ]

    @property
    def ttl_ns(self) -> int:
        return int(self.ttl_h * 3600e9)

    @property
    def keyframe_interval_ns(self) -> int:
        return int(self.keyframe_interval_s * 1e9)

    @property
    def aging_chunk_ns(self) -> int:
        return int(self.aging_chunk_s * 1e9)


__all__ = ["MemorySection"]
