"""Snapshots: manifest and checksum, pruning, offline and online restore, refusals."""

import asyncio
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from edge_agent.memory import MemoryStage, SnapshotChecksumError, SnapshotError
from edge_agent.memory.cli import memory_app
from edge_agent.memory.snapshots import (
    MANIFEST_FORMAT,
    list_snapshots,
    prune,
    restore_snapshot,
    take_snapshot,
    verify_snapshot,
)
from tests.support.memory import (
    POINTS,
    T0,
    S,
    config,
    count,
    feed,
    random_walk,
    run,
    stage,
)

SIG = ("a", "b")
SPAN = POINTS * 10_000_000
runner = CliRunner()


def build(tmp: Path, clock: list[int]) -> tuple[np.ndarray, str, int]:
    """Data A, a snapshot, then data B; returns (values, snapshot name, end of A)."""
    values = random_walk(np.random.default_rng(9), 20, 2)

    async def main() -> tuple[str, int]:
        st = stage(tmp, SIG, clock=clock)
        async with st:
            end_a = feed(st, values[: 10 * POINTS], SIG)
            assert await st.flush()
            info = await st.snapshot()
            feed(st, values[10 * POINTS :], SIG, start_ns=end_a, first_seq=11)
        return info.name, end_a

    name, end_a = run(main())
    return values, name, end_a


def test_snapshot_has_a_verified_manifest_and_old_ones_are_pruned(tmp_path: Path) -> None:
    clock = [T0]

    async def main() -> None:
        st = stage(tmp_path, SIG, clock=clock, snapshot_keep=2)
        async with st:
            feed(st, random_walk(np.random.default_rng(1), 5, 2), SIG)
            names = []
            for i in range(3):
                clock[0] = T0 + i * S
                names.append((await st.snapshot()).name)
            assert st.stats()["snapshots"]["taken"] == 3
        snaps = list_snapshots(tmp_path / "memory-snapshots")
        assert [s.name for s in snaps] == names[:0:-1]  # newest first, oldest pruned
        for info in snaps:
            verify_snapshot(info)
            raw = json.loads(info.manifest.read_text())
            assert raw["format"] == MANIFEST_FORMAT
            assert raw["file"] == info.path.name
            assert raw["rows"]["changes"] > 0
            conn = sqlite3.connect(info.path)
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            conn.close()
        leftovers = [p.name for p in (tmp_path / "memory-snapshots").iterdir()]
        assert sorted(leftovers) == sorted(
            [s.path.name for s in snaps] + [s.manifest.name for s in snaps]
        )

    run(main())


def test_offline_restore_rolls_back_and_keeps_the_previous_file(tmp_path: Path) -> None:
    values, name, end_a = build(tmp_path, [T0])
    db = tmp_path / "memory.db"
    rows_all = count(db, "changes")
    res = runner.invoke(memory_app, ["restore", name, "--yes", "--db", str(db)])
    assert res.exit_code == 0, res.stderr
    assert f"restored {db} from {name}" in res.stdout
    rows_now = count(db, "changes")
    assert 0 < rows_now < rows_all
    kept = list(tmp_path.glob("memory.db.before-restore-*"))
    assert len(kept) == 1
    assert count(kept[0], "changes") == rows_all

    async def check() -> None:
        st = stage(tmp_path, SIG)
        async with st:
            before = await st.state_at(end_a - 10_000_000)
            assert before["a"] == pytest.approx(float(values[10 * POINTS - 1, 0]))
            # B is gone: the last value of A holds (until the next window marks a gap).
            after = await st.state_at(end_a + 5 * SPAN)
            assert after["a"] == before["a"]
            h = await st.history("a", end_a - SPAN, end_a + 10 * SPAN)
            assert all(t < end_a for t, _ in h.changes)

    run(check())


def test_checksum_mismatch_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    _, name, _ = build(tmp_path, [T0])
    db = tmp_path / "memory.db"
    snap = tmp_path / "memory-snapshots" / f"{name}.db"
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snap.write_bytes(bytes(data))
    before = db.read_bytes()
    res = runner.invoke(memory_app, ["restore", name, "--yes", "--db", str(db)])
    assert res.exit_code == 1
    assert "does not match its manifest" in res.stderr
    assert db.read_bytes() == before
    listing = runner.invoke(memory_app, ["snapshots", "--verify", "--db", str(db)])
    assert listing.exit_code == 1
    assert "BAD" in listing.stdout
    (info,) = list_snapshots(tmp_path / "memory-snapshots")
    with pytest.raises(SnapshotChecksumError):
        restore_snapshot(info, db, now_ns=T0)


def test_restore_is_refused_while_the_agent_holds_the_store(tmp_path: Path) -> None:
    _, name, _ = build(tmp_path, [T0])

    async def main() -> None:
        async with stage(tmp_path, SIG):
            res = await asyncio.to_thread(
                runner.invoke,
                memory_app,
                ["restore", name, "--yes", "--db", str(tmp_path / "memory.db")],
            )
            assert res.exit_code == 1
            assert "in use by process" in res.stderr

    run(main())


def test_restore_asks_unless_yes_and_unknown_names_are_bad_input(tmp_path: Path) -> None:
    _, name, _ = build(tmp_path, [T0])
    db = str(tmp_path / "memory.db")
    declined = runner.invoke(memory_app, ["restore", name, "--db", db], input="n\n")
    assert declined.exit_code == 1
    assert "cancelled" in declined.stderr
    unknown = runner.invoke(memory_app, ["restore", "memory-nope", "--yes", "--db", db])
    assert unknown.exit_code == 2
    assert name in unknown.stderr  # lists what is available


def test_online_restore_pauses_rolls_back_and_continues(tmp_path: Path) -> None:
    values = random_walk(np.random.default_rng(5), 30, 2)
    clock = [T0]

    async def main() -> None:
        st = stage(tmp_path, SIG, clock=clock)
        async with st:
            end_a = feed(st, values[: 10 * POINTS], SIG)
            assert await st.flush()
            mean_a = float(st.baselines.means()[0])
            info = await st.snapshot()
            end_b = feed(st, values[10 * POINTS : 20 * POINTS] + 100, SIG, start_ns=end_a)
            assert await st.flush()
            restored = await st.restore(info.name)
            assert restored.name == info.name
            assert float(st.baselines.means()[0]) == pytest.approx(mean_a, rel=1e-3)
            # B (values + 100) is gone; A's last value holds until the next window.
            held = (await st.state_at(end_a + SPAN))["a"]
            assert held == pytest.approx(float(values[10 * POINTS - 1, 0]))
            end_c = feed(st, values[20 * POINTS :], SIG, start_ns=end_b, first_seq=21)
            assert await st.flush()
            h = await st.history("a", T0, end_c)
            assert [(r, a, b) for a, b, r in h.gaps] == [("restored", end_a, end_b)]
            last = await st.state_at(end_c - 10_000_000)
            assert last["a"] == pytest.approx(float(values[-1, 0]))
            assert st.stats()["writer"]["alive"]

    run(main())
    conn = sqlite3.connect(tmp_path / "memory.db")
    kinds = [k for (k,) in conn.execute("SELECT kind FROM events ORDER BY id")]
    conn.close()
    assert "restored" in kinds


def test_run_takes_periodic_snapshots(tmp_path: Path) -> None:
    async def main() -> None:
        st = stage(tmp_path, SIG, snapshot_interval_s=0.2, snapshot_keep=2)
        async with st:
            feed(st, random_walk(np.random.default_rng(2), 3, 2), SIG)
            task = asyncio.create_task(st.run(), name="memory")
            await asyncio.sleep(0.9)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert st.stats()["snapshots"]["taken"] >= 2
        assert len(list_snapshots(tmp_path / "memory-snapshots")) == 2

    run(main())


def test_take_snapshot_without_a_store_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="no memory store"):
        take_snapshot(tmp_path / "none.db", tmp_path / "snaps", keep=1, now_ns=T0)


def test_an_unusable_snapshot_dir_or_a_failing_prune_is_a_snapshot_error(tmp_path: Path) -> None:
    clock = [T0]

    async def main() -> None:
        st = stage(tmp_path, SIG, clock=clock)
        async with st:
            feed(st, random_walk(np.random.default_rng(4), 2, 2), SIG)
            assert await st.flush()

    run(main())
    db = tmp_path / "memory.db"
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("x")
    with pytest.raises(SnapshotError, match="not usable"):
        take_snapshot(db, blocked, keep=1, now_ns=T0)
    # A leftover that cannot be unlinked (a directory named like a snapshot file).
    snaps = tmp_path / "snaps"
    (snaps / "memory-leftover.db").mkdir(parents=True)
    with pytest.raises(SnapshotError, match="pruning"):
        prune(snaps, 1)
    with pytest.raises(SnapshotError, match="was written, but pruning"):
        take_snapshot(db, snaps, keep=1, now_ns=T0)


def test_run_survives_failing_snapshots_and_counts_them(tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    snaps.write_text("a stray file where the snapshot directory should be")

    async def main() -> None:
        st = MemoryStage(
            config(snapshot_interval_s=0.2),
            SIG,
            state_dir=tmp_path,
            snapshot_dir=snaps,
            clock_ns=lambda: T0,
        )
        async with st:
            feed(st, random_walk(np.random.default_rng(2), 3, 2), SIG)
            task = asyncio.create_task(st.run(), name="memory")
            await asyncio.sleep(0.9)
            assert not task.done(), "a failing snapshot must not end the maintenance task"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert st.stats()["snapshots"]["failures"] >= 2
            assert st.stats()["snapshots"]["taken"] == 0

    run(main())
