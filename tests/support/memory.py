"""Helpers for the memory tests: windows on a grid, a full-state record, stage factories."""

from __future__ import annotations

import asyncio
import math
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edge_agent.memory import MemorySection, MemoryStage
from edge_agent.perception import Window

MS = 1_000_000
S = 1_000_000_000
T0 = 1_700_000_000_000_000_000  # a multiple of 10 ms
PERIOD = 10 * MS
POINTS = 64


def window(
    seq: int,
    start_ns: int,
    values: npt.NDArray[Any],
    signals: Sequence[str],
    *,
    stale: Sequence[bool] | None = None,
    period_ns: int = PERIOD,
) -> Window:
    n = len(signals)
    return Window(
        seq=seq,
        start_ns=start_ns,
        period_ns=period_ns,
        signals=tuple(signals),
        values=np.asarray(values, dtype=np.float32),
        stale=np.asarray(stale if stale is not None else [False] * n, dtype=np.bool_),
        completeness=1.0,
        jitter_ms=np.zeros(n, dtype=np.float32),
    )


def random_walk(
    rng: np.random.Generator, windows: int, signals: int, *, hold: int = 4, nan_rate: float = 0.0
) -> npt.NDArray[np.float32]:
    """``(windows * POINTS, signals)``: a quantised random walk, held ``hold`` points at a
    time (like a field bus slower than the grid), with stretches of NaN and some +-inf."""
    n = windows * POINTS
    steps = rng.normal(0, 0.5, size=(n // hold + 1, signals)).round(2)
    walk = np.repeat(np.cumsum(steps, axis=0), hold, axis=0)[:n]
    out = walk.astype(np.float32)
    if nan_rate:
        starts = rng.random((n, signals)) < nan_rate
        for k, j in zip(*np.nonzero(starts), strict=True):
            out[k : k + int(rng.integers(1, 40)), j] = np.nan
        infs = rng.random((n, signals)) < nan_rate / 4
        out[infs] = np.where(rng.random(int(infs.sum())) < 0.5, np.inf, -np.inf)
    return out


def config(**kw: Any) -> MemorySection:
    base: dict[str, Any] = {
        "commit_interval_ms": 20,
        "snapshot_interval_s": 0.0,
        "aging_interval_s": 3600.0,
    }
    base.update(kw)
    return MemorySection(**base)


def stage(
    tmp: Path, signals: Sequence[str], clock: list[int] | None = None, **kw: Any
) -> MemoryStage:
    clk = clock if clock is not None else [T0]
    return MemoryStage(config(**kw), signals, state_dir=tmp, clock_ns=lambda: clk[0])


def feed(
    st: MemoryStage,
    values: npt.NDArray[Any],
    signals: Sequence[str],
    *,
    start_ns: int = T0,
    first_seq: int = 1,
) -> int:
    """Process ``values`` as consecutive windows; returns the next window start."""
    t = start_ns
    for i in range(values.shape[0] // POINTS):
        chunk = values[i * POINTS : (i + 1) * POINTS]
        st.process(window(first_seq + i, t, chunk, signals), now_ns=t + POINTS * PERIOD)
        t += POINTS * PERIOD
    return t


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def record_at(values: npt.NDArray[Any], t_ns: int, start_ns: int = T0) -> npt.NDArray[np.float32]:
    """The full-state record at ``t_ns``: the last grid row at or before it (inf -> NaN)."""
    k = (t_ns - start_ns) // PERIOD
    row = np.asarray(values[k], dtype=np.float32).copy()
    row[~np.isfinite(row)] = np.nan
    return row


def same(a: float | np.floating[Any], b: float | np.floating[Any]) -> bool:
    """Equal, or both NaN (unknown)."""
    return bool((math.isnan(a) and math.isnan(b)) or a == b)


def count(db: Path, table: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
    finally:
        conn.close()
