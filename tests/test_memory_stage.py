"""The memory stage on the pipeline path: context, bad input, drops, restarts, decisions."""

import json
import math
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from edge_agent.memory import MemorySection, MemoryStage, SchemaVersionError, StoreLocked
from edge_agent.memory.store import SCHEMA_VERSION
from tests.support.memory import (
    PERIOD,
    POINTS,
    T0,
    count,
    feed,
    random_walk,
    record_at,
    run,
    same,
    stage,
    window,
)

SIG = ("a", "b", "c")
SPAN = POINTS * PERIOD


def test_process_returns_context_and_latency(tmp_path: Path) -> None:
    async def main() -> None:
        st = stage(tmp_path, SIG, ring_windows=4)
        async with st:
            ctx = None
            for i in range(6):
                w = window(i + 1, T0 + i * SPAN, np.full((POINTS, 3), float(i)), SIG)
                ctx = st.process(w, {"score": i / 10, "label": "ok"}, now_ns=T0 + (i + 1) * SPAN)
            assert ctx is not None
            assert [w.seq for w in ctx.recent] == [3, 4, 5, 6]
            assert [d["score"] for d in ctx.decisions if isinstance(d, dict)] == [
                0.2,
                0.3,
                0.4,
                0.5,
            ]
            assert ctx.signals == SIG
            assert ctx.baseline_mean.shape == (3,)
            assert np.all(ctx.baseline_mean > 0)
            assert ctx.persisted
            assert ctx.latency_ms > 0
            assert ctx.normalized().shape == (POINTS, 3)
            assert st.ring.values(2).shape == (2 * POINTS, 3)
            lat = st.stats()["latency_us"]
            assert lat["count"] == 6
            assert 0 < lat["p50"] <= lat["p99"] <= lat["max"]
            assert await st.flush()
        db = tmp_path / "memory.db"
        assert count(db, "decisions") == 6
        conn = sqlite3.connect(db)
        body, seq = conn.execute(
            "SELECT body, window_seq FROM decisions ORDER BY id DESC LIMIT 1"
        ).fetchone()
        conn.close()
        assert json.loads(body) == {"score": 0.5, "label": "ok"}
        assert seq == 6

    run(main())


def test_bad_input_is_handled_and_counted(tmp_path: Path) -> None:
    async def main() -> None:
        st = stage(tmp_path, SIG)
        async with st:
            v = np.ones((POINTS, 3))
            v[10, 0] = np.nan
            v[11, 1] = np.inf
            v[12, 2] = -np.inf
            st.process(window(1, T0, v, SIG), now_ns=T0 + SPAN)
            # Columns in another order, one unknown signal, one configured signal missing.
            other = ("c", "zzz", "a")
            w2 = window(2, T0 + SPAN, np.full((POINTS, 3), 7.0), other)
            ctx = st.process(w2, now_ns=T0 + 2 * SPAN)
            assert ctx.signals == SIG
            # The clock went backwards: this window starts before the last stored point.
            back = window(3, T0 + SPAN // 2, np.full((POINTS, 3), 3.0), SIG)
            st.process(back, now_ns=T0 + 3 * SPAN)
            st.process(back, now_ns=T0 + 3 * SPAN)  # same episode: one event
            assert await st.flush()
            stats = st.stats()
            assert stats["non_finite"] >= 3
            assert stats["unknown_signal"] == 1
            assert stats["unknown_names"] == ["zzz"]
            assert stats["missing_signal"] == 1
            assert stats["clock_backwards"] == 2 * POINTS  # both windows entirely behind
            state = await st.state_at(T0 + 10 * PERIOD)
            assert math.isnan(state["a"])
            assert state["b"] == 1.0
            state = await st.state_at(T0 + 11 * PERIOD)
            assert math.isnan(state["b"])  # inf is stored as unknown
            state = await st.state_at(T0 + SPAN + 5 * PERIOD)
            assert state["a"] == 7.0
            assert state["c"] == 7.0
            assert math.isnan(state["b"])  # missing from that window
            # Points behind were not stored: the later windows' value never shows.
            last = await st.state_at(T0 + 3 * SPAN)
            assert last["a"] == 7.0
        conn = sqlite3.connect(tmp_path / "memory.db")
        kinds = [k for (k,) in conn.execute("SELECT kind FROM events ORDER BY id")]
        conn.close()
        assert kinds.count("clock_backwards") == 1

    run(main())


def test_overlapping_windows_are_not_a_clock_step(tmp_path: Path) -> None:
    values = random_walk(np.random.default_rng(12), 10, 3)
    hop = POINTS // 2

    async def main() -> None:
        async with stage(tmp_path, SIG) as st:
            for i in range(values.shape[0] // hop - 1):
                chunk = values[i * hop : i * hop + POINTS]
                st.process(window(i + 1, T0 + i * hop * PERIOD, chunk, SIG), now_ns=T0)
            assert st.stats()["clock_backwards"] == 0
            assert await st.flush()
            for k in range(0, values.shape[0] - hop, 3):
                got = (await st.state_at(T0 + k * PERIOD))["c"]
                assert same(np.float32(got), record_at(values, T0 + k * PERIOD)[2]), k

    run(main())


def test_a_full_batch_drops_counts_and_leaves_an_exact_gap(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    values = rng.normal(size=(45 * POINTS, 3)).astype(np.float32)  # every cell changes

    def win(i: int) -> tuple[int, np.ndarray]:
        return T0 + i * SPAN, values[i * POINTS : (i + 1) * POINTS]

    async def main() -> None:
        st = stage(tmp_path, SIG, batch_max_rows=1000)
        async with st:
            writer = st._writer
            assert writer is not None
            for i in range(2):
                st.process(window(i + 1, *win(i), SIG), now_ns=T0)
            assert await st.flush()
            writer.pause()  # the writer stalls (a slow disk): the batch fills up
            for i in range(2, 20):
                st.process(window(i + 1, *win(i), SIG), now_ns=T0)
            writer.resume()
            # The backlog is written before the next window: on a loaded machine the niced
            # writer thread may not have taken it yet, and window 20 would not fit either.
            assert await st.flush()
            for i in range(20, 36):
                st.process(window(i + 1, *win(i), SIG), now_ns=T0)
                assert await st.flush()
            stats = st.stats()
            assert stats["dropped_windows"] == 20 - 2 - 1000 // (POINTS * 3)
            assert stats["writer"]["dropped_rows"] > 0
            assert stats["writer"]["high_water_rows"] <= 1000
            h = await st.history("a", T0, T0 + 36 * SPAN)
            assert [(a, b, r) for a, b, r in h.gaps] == [(T0 + 7 * SPAN, T0 + 20 * SPAN, "dropped")]
            for k in range(0, 36 * POINTS, 5):
                t = T0 + k * PERIOD
                got = (await st.state_at(t))["b"]
                if T0 + 7 * SPAN <= t < T0 + 20 * SPAN:
                    assert math.isnan(got), k  # inside the gap: unknown, not a stale value
                else:
                    assert same(np.float32(got), record_at(values, t)[1]), k
            # Dropped at the very end, then stopped: the hole is closed at stop.
            writer.pause()
            for i in range(36, 45):  # 5 fit, 4 are dropped
                st.process(window(i + 1, *win(i), SIG), now_ns=T0)
            writer.resume()

        async def reopen() -> None:
            async with stage(tmp_path, SIG) as again:
                assert not math.isnan((await again.state_at(T0 + 40 * SPAN))["b"])
                assert math.isnan((await again.state_at(T0 + 41 * SPAN))["b"])
                assert math.isnan((await again.state_at(T0 + 45 * SPAN - PERIOD))["b"])

        await reopen()

    run(main())


def test_restart_resumes_and_marks_the_offline_time_as_a_gap(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    values = random_walk(rng, 10, 3)
    clock = [T0]

    async def session(start: int, seq: int) -> int:
        st = stage(tmp_path, SIG, clock=clock)
        async with st:
            return feed(st, values, SIG, start_ns=start, first_seq=seq)

    end1 = run(session(T0, 1))
    later = end1 + 120 * SPAN
    run(session(later, 100))

    async def check() -> None:
        st = stage(tmp_path, SIG, clock=clock)
        async with st:
            mid = (await st.state_at(end1 + 60 * SPAN))["a"]
            assert math.isnan(mid)
            assert same(np.float32((await st.state_at(end1 - PERIOD))["a"]), values[-1, 0])
            assert same(np.float32((await st.state_at(later))["a"]), values[0, 0])
            # A window from before the restart is behind what is stored: not stored again.
            st.process(window(1, T0, values[:POINTS], SIG), now_ns=later)
            assert st.stats()["clock_backwards"] == POINTS

    run(check())
    conn = sqlite3.connect(tmp_path / "memory.db")
    gaps = conn.execute("SELECT start_ns, end_ns, reason FROM gaps").fetchall()
    conn.close()
    assert gaps == [(end1, later, "offline")]


def test_record_decision_and_event_after_the_window(tmp_path: Path) -> None:
    async def main() -> None:
        st = stage(tmp_path, SIG)
        async with st:
            st.process(window(1, T0, np.zeros((POINTS, 3)), SIG), now_ns=T0 + SPAN)
            assert st.record_decision(
                {"score": np.float32(0.25), "top": np.array([1, 2])}, now_ns=T0 + SPAN, window_seq=1
            )
            assert st.record_event("rule", t_ns=T0 + SPAN, signal="b", detail={"why": "hot"})
            assert len(st.ring.decisions()) == 1
        conn = sqlite3.connect(tmp_path / "memory.db")
        body = conn.execute("SELECT body FROM decisions").fetchone()[0]
        ev = conn.execute("SELECT kind, signal, detail FROM events WHERE kind='rule'").fetchone()
        conn.close()
        assert json.loads(body) == {"score": 0.25, "top": [1, 2]}
        assert ev == ("rule", 2, '{"why": "hot"}')

    run(main())


@dataclass(frozen=True)
class FakeDecision:
    """Shaped like reasoning's Decision: a frozen dataclass with to_json()."""

    label: str
    alarms: frozenset[str]

    def to_json(self) -> dict[str, object]:
        return {"label": self.label, "alarms": sorted(self.alarms)}


def test_decision_objects_with_to_json_are_stored_as_their_json(tmp_path: Path) -> None:
    async def main() -> None:
        async with stage(tmp_path, SIG) as st:
            d = FakeDecision("spike", frozenset({"spike"}))
            ctx = st.process(window(1, T0, np.zeros((POINTS, 3)), SIG), d, now_ns=T0)
            assert ctx.decisions == (d,)  # working memory keeps the object itself

    run(main())
    conn = sqlite3.connect(tmp_path / "memory.db")
    body = conn.execute("SELECT body FROM decisions").fetchone()[0]
    conn.close()
    assert json.loads(body) == {"label": "spike", "alarms": ["spike"]}


def test_stale_transitions_become_events(tmp_path: Path) -> None:
    async def main() -> None:
        st = stage(tmp_path, SIG)
        async with st:
            z = np.zeros((POINTS, 3))
            st.process(window(1, T0, z, SIG, stale=[False, True, False]), now_ns=T0)
            st.process(window(2, T0 + SPAN, z, SIG, stale=[False, True, False]), now_ns=T0)
            st.process(window(3, T0 + 2 * SPAN, z, SIG, stale=[True, False, False]), now_ns=T0)
        conn = sqlite3.connect(tmp_path / "memory.db")
        rows = conn.execute(
            "SELECT kind, signal FROM events WHERE kind IN ('stale', 'fresh') ORDER BY id"
        ).fetchall()
        conn.close()
        assert rows == [("stale", 2), ("stale", 1), ("fresh", 2)]

    run(main())


def test_disabled_memory_keeps_ram_only(tmp_path: Path) -> None:
    async def main() -> None:
        st = MemoryStage(MemorySection(enabled=False), SIG, state_dir=tmp_path)
        async with st:
            ctx = st.process(window(1, T0, np.ones((POINTS, 3)), SIG), now_ns=T0)
            assert not ctx.persisted
            assert len(ctx.recent) == 1
            assert await st.flush()
            assert st.stats()["open"] is False

    run(main())
    assert not (tmp_path / "memory.db").exists()


def test_one_writer_per_store_and_newer_schema_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with stage(tmp_path, SIG):
            other = stage(tmp_path, SIG)
            with pytest.raises(StoreLocked, match="in use by process"):
                await other.start()

    run(main())
    conn = sqlite3.connect(tmp_path / "memory.db")
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(SchemaVersionError, match="newer"):
        run(stage(tmp_path, SIG).start())
    # The lock was released after the failure: a fixed file opens again.
    conn = sqlite3.connect(tmp_path / "memory.db")
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    conn.commit()
    conn.close()

    async def again() -> None:
        async with stage(tmp_path, SIG) as st:
            assert st.stats()["open"]

    run(again())


def test_signals_must_be_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        MemoryStage(MemorySection(), ("a", "a"), state_dir="/tmp")
