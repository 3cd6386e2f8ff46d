"""Aging: TTL and the size cap (LRU of cold chunks), in small bounded steps."""

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent.memory.aging import Aging, AgingPolicy
from edge_agent.memory.store import MemoryStore, connect
from tests.support.memory import POINTS, T0, S, run, same, stage, window

SIG = ("a", "b", "c", "d")
PERIOD_1S = S  # 1 s grid: 64 s windows, hours of data in a few hundred windows
SPAN = POINTS * PERIOD_1S
HOUR = 3600 * S


def fill(tmp: Path, hours: float, *, seed: int = 0, **kw: Any) -> tuple[np.ndarray, int]:
    """Write ``hours`` of noisy data (1 s grid) with a decision per window; returns
    (values, end time)."""
    rng = np.random.default_rng(seed)
    n_win = int(hours * HOUR / SPAN)
    values = rng.normal(size=(n_win * POINTS, len(SIG))).astype(np.float32).round(2)

    async def main() -> int:
        st = stage(tmp, SIG, **kw)
        async with st:
            t = T0
            for i in range(n_win):
                w = window(i + 1, t, values[i * POINTS : (i + 1) * POINTS], SIG, period_ns=S)
                st.process(w, {"i": i}, now_ns=t + SPAN)
                t += SPAN
                if i % 50 == 0:
                    await st.flush()
            return t

    return values, run(main())


def policy(**kw: object) -> AgingPolicy:
    base: dict[str, object] = {
        "ttl_ns": 100 * HOUR,
        "max_bytes": 1 << 40,
        "chunk_ns": HOUR,
        "step_budget_s": 0.001,
        "interval_s": 3600.0,
    }
    base.update(kw)
    return AgingPolicy(**base)  # type: ignore[arg-type]


def value_at(values: np.ndarray, t: int, j: int) -> float:
    return float(values[(t - T0) // S, j])


def test_ttl_deletes_old_data_in_small_steps_and_keeps_the_state_exact(tmp_path: Path) -> None:
    values, end = fill(tmp_path, 5.0, keyframe_interval_s=300.0)
    db = tmp_path / "memory.db"
    conn = connect(db)
    rows_before = conn.execute("SELECT count(*) FROM changes").fetchone()[0]
    aging = Aging(policy(ttl_ns=2 * HOUR))
    steps = aging.run_until_idle(conn, end)
    cutoff = end - 2 * HOUR
    stats = aging.stats_dict()
    assert stats["ttl_rows"] > rows_before / 2
    assert steps > 3  # incremental, not one big DELETE
    assert stats["errors"] == 0
    assert stats["p50_step_us"] < 1000
    oldest = conn.execute("SELECT min(t_ns) FROM changes").fetchone()[0]
    first_kf = conn.execute("SELECT min(t_ns) FROM keyframes").fetchone()[0]
    assert cutoff - 300 * S <= first_kf <= cutoff  # cut at the keyframe before the cutoff
    assert oldest == first_kf
    old_decisions = conn.execute(
        "SELECT count(*) FROM decisions WHERE t_ns < ?", (cutoff,)
    ).fetchone()[0]
    assert old_decisions == 0
    assert conn.execute("SELECT count(*) FROM decisions").fetchone()[0] > 0
    conn.close()
    store = MemoryStore.open_readonly(db)
    for t in (cutoff, cutoff + 17 * S, end - S):
        got = store.state_at(t)
        for j, name in enumerate(SIG):
            assert same(np.float32(got[name]), np.float32(value_at(values, t, j))), (t, name)
    assert all(math.isnan(v) for v in store.state_at(first_kf - S).values())
    store.close()


def test_size_cap_evicts_least_recently_used_cold_chunks(tmp_path: Path) -> None:
    chunk = 600 * S  # 10 min chunks, keyframe every minute
    values, end = fill(tmp_path, 2.0, keyframe_interval_s=60.0, aging_chunk_s=600.0, seed=1)
    db = tmp_path / "memory.db"

    # Someone (reasoning, an engineer) reads the OLDEST chunk: it becomes recently used.
    async def read_old() -> None:
        st = stage(tmp_path, SIG, [end], aging_chunk_s=600.0, keyframe_interval_s=60.0)
        async with st:
            await st.history("a", T0 + 60 * S, T0 + 120 * S)

    run(read_old())
    conn = connect(db)
    page = conn.execute("PRAGMA page_size").fetchone()[0]
    used = page * (
        conn.execute("PRAGMA page_count").fetchone()[0]
        - conn.execute("PRAGMA freelist_count").fetchone()[0]
    )
    cap = used // 2
    assert conn.execute("SELECT chunk, last_access_ns FROM chunk_access").fetchall() == [
        (T0 // chunk, end)
    ]
    aging = Aging(policy(max_bytes=cap, chunk_ns=chunk))
    aging.run_until_idle(conn, end)
    stats = aging.stats_dict()
    assert stats["evicted_chunks"] >= 2
    assert stats["cap_unreachable"] == 0
    assert stats["p50_step_us"] < 1000
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    assert (pages - free) * page <= cap
    assert pages * page <= cap  # incremental vacuum gave the space back
    gaps = conn.execute("SELECT start_ns, end_ns, reason FROM gaps ORDER BY start_ns").fetchall()
    conn.close()
    assert gaps
    assert {r for _, _, r in gaps} == {"evicted"}
    first_chunk_end = (T0 // chunk + 1) * chunk
    # The recently read oldest chunk survived; the evicted ones come right after it.
    assert gaps[0][0] >= first_chunk_end
    store = MemoryStore.open_readonly(db)
    t_old = T0 + 90 * S
    assert same(np.float32(store.state_at(t_old)["b"]), np.float32(value_at(values, t_old, 1)))
    t_gap = gaps[0][0] + 30 * S
    assert all(math.isnan(v) for v in store.state_at(t_gap).values())
    t_new = end - 10 * S
    assert same(np.float32(store.state_at(t_new)["c"]), np.float32(value_at(values, t_new, 2)))
    h = store.history("d", T0, end)
    assert any(r == "evicted" for _, _, r in h.gaps)
    store.close()


def test_cap_below_the_newest_chunk_is_reported_not_looped(tmp_path: Path) -> None:
    _, end = fill(tmp_path, 0.2, keyframe_interval_s=60.0, aging_chunk_s=3600.0)
    conn = connect(tmp_path / "memory.db")
    aging = Aging(policy(max_bytes=4096))
    aging.run_until_idle(conn, end)
    conn.close()
    assert aging.stats.cap_unreachable == 1
    assert aging.stats.evicted_chunks == 0


def test_aging_runs_by_itself_in_the_writer_thread(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)

    async def main() -> None:
        st = stage(
            tmp_path,
            SIG,
            ttl_h=0.05,  # 3 min
            aging_interval_s=0.05,
            keyframe_interval_s=60.0,
            aging_chunk_s=600.0,
        )
        async with st:
            t = T0
            for i in range(20):  # ~21 min of data
                v = rng.normal(size=(POINTS, len(SIG))).astype(np.float32)
                st.process(window(i + 1, t, v, SIG, period_ns=S), now_ns=t + SPAN)
                t += SPAN
            assert await st.flush()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                aging = st.stats()["writer"]["aging"]
                if aging["ttl_rows"] > 0 and aging["rounds"] > 1:
                    break
                await asyncio.sleep(0.05)
            aging = st.stats()["writer"]["aging"]
            assert aging["ttl_rows"] > 0, aging
            oldest = await st.history("a", T0, t)
            assert oldest.gaps == []
            state = await st.state_at(t - 4 * 60 * S)
            assert math.isnan(state["a"])  # older than the TTL (plus one keyframe interval)
            assert not math.isnan((await st.state_at(t - 60 * S))["a"])

    run(main())


@pytest.mark.parametrize("table", ["decisions", "events"])
def test_ttl_on_small_tables_uses_id_ranges(tmp_path: Path, table: str) -> None:
    db = tmp_path / "memory.db"
    _, end = fill(tmp_path, 0.5, keyframe_interval_s=60.0)
    conn = connect(db)
    n = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    aging = Aging(policy(ttl_ns=10 * 60 * S))
    aging.run_until_idle(conn, end)
    left = conn.execute(f"SELECT min(t_ns), count(*) FROM {table}").fetchone()
    conn.close()
    if table == "decisions":
        assert 0 < left[1] < n
        assert left[0] >= end - 10 * 60 * S
    else:
        assert left[1] <= n
