"""Crash safety: kill -9 during heavy writes, and a corrupt file found at start."""

import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge_agent.memory.snapshots import check_database, list_snapshots
from tests.support.memory import POINTS, T0, count, feed, random_walk, run, stage

pytestmark = pytest.mark.peers

ROOT = Path(__file__).parents[1]
SIG = ("a", "b")
SPAN = POINTS * 10_000_000


def kill_while_writing(state: Path, start_ns: int, min_rows: int) -> tuple[int, int]:
    """Run the writer process until it reports ``min_rows`` committed, then SIGKILL it.
    Returns (last committed rows it reported, last enqueued rows it reported)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.memory_writer_proc", str(state), str(start_ns)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    committed = enqueued = 0
    deadline = time.monotonic() + 30
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            committed, enqueued, _ = (int(x) for x in line.split())
            if committed >= min_rows or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGKILL)  # in the middle of writing: more is pending
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    assert committed >= min_rows, f"writer reached only {committed} rows"
    return committed, enqueued


def test_kill_9_during_heavy_writes_loses_at_most_the_uncommitted_batch(tmp_path: Path) -> None:
    db = tmp_path / "memory.db"
    start = T0
    before = 0
    for _ in range(2):  # the second run resumes the store the first one left
        committed, enqueued = kill_while_writing(tmp_path, start, min_rows=150_000)
        assert check_database(db) is None
        conn = sqlite3.connect(db)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        n, lo, hi = conn.execute("SELECT count(*), min(id), max(id) FROM changes").fetchone()
        # Everything it reported committed is there; nothing it never handed over is.
        assert committed <= n - before <= enqueued + 100_000
        assert hi - lo + 1 == n  # whole transactions only: no holes in the row ids
        # Every keyframe points at rows that exist; the newest one reconstructs.
        (kf_id,) = conn.execute(
            "SELECT change_id FROM keyframes ORDER BY t_ns DESC LIMIT 1"
        ).fetchone()
        assert lo <= kf_id <= hi
        signals = conn.execute(
            "SELECT count(DISTINCT signal) FROM changes WHERE id >= ? AND id < ? + 16",
            (kf_id, kf_id),
        ).fetchone()[0]
        assert signals == 16
        decisions = conn.execute("SELECT count(*) FROM decisions").fetchone()[0]
        conn.close()
        assert decisions >= (n // (POINTS * 16)) // 2
        before = n
        start = (
            int(sqlite3.connect(db).execute("SELECT max(t_ns) FROM changes").fetchone()[0])
            + POINTS * 10_000_000
        )


def build(tmp: Path) -> tuple[np.ndarray, str, int]:
    """Data A, snapshot, data B, clean stop."""
    values = random_walk(np.random.default_rng(1), 20, 2)

    async def main() -> tuple[str, int]:
        st = stage(tmp, SIG)
        async with st:
            end_a = feed(st, values[: 10 * POINTS], SIG)
            info = await st.snapshot()
            feed(st, values[10 * POINTS :], SIG, start_ns=end_a, first_seq=11)
        return info.name, end_a

    name, end_a = run(main())
    return values, name, end_a


def corrupt_header(db: Path) -> None:
    with db.open("r+b") as f:
        f.write(b"this is not an SQLite file at all" * 3)


def corrupt_page(db: Path) -> None:
    conn = sqlite3.connect(db)
    page = conn.execute("PRAGMA page_size").fetchone()[0]
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'changes'").fetchone()[0]
    conn.close()
    with db.open("r+b") as f:
        f.seek((root - 1) * page)
        f.write(os.urandom(page))


@pytest.mark.parametrize("damage", [corrupt_header, corrupt_page])
def test_corrupt_file_at_start_is_moved_aside_and_the_newest_snapshot_restored(
    tmp_path: Path, damage: object, caplog: pytest.LogCaptureFixture
) -> None:
    values, name, end_a = build(tmp_path)
    db = tmp_path / "memory.db"
    rows_with_b = count(db, "changes")
    damage(db)  # type: ignore[operator]
    assert check_database(db) is not None
    caplog.set_level(logging.ERROR, logger="edge_agent.memory")

    async def main() -> None:
        st = stage(tmp_path, SIG)
        async with st:
            rec = st.recovery
            assert rec is not None
            assert rec.restored_from == name
            assert rec.moved_to.exists()
            assert rec.moved_to.name.startswith("memory.db.corrupt-")
            assert st.stats()["recovery"]["restored_from"] == name
            got = await st.state_at(end_a - 10_000_000)
            assert got["a"] == pytest.approx(float(values[10 * POINTS - 1, 0]))
            # It keeps working after recovery.
            feed(st, values[10 * POINTS :], SIG, start_ns=end_a + 100 * SPAN, first_seq=50)

    run(main())
    assert check_database(db) is None
    assert 0 < count(db, "changes") < rows_with_b + 10 * POINTS * 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("is corrupt" in m and "moved aside" in m for m in errors)
    assert any(f"restored from snapshot {name}" in m for m in errors)
    conn = sqlite3.connect(db)
    kinds = [k for (k,) in conn.execute("SELECT kind FROM events")]
    conn.close()
    assert "recovered" in kinds


def test_a_bad_newest_snapshot_is_skipped_for_an_older_good_one(tmp_path: Path) -> None:
    clock = [T0]

    async def main() -> list[str]:
        st = stage(tmp_path, SIG, clock=clock)
        names = []
        async with st:
            feed(st, random_walk(np.random.default_rng(2), 4, 2), SIG)
            for i in range(2):
                clock[0] = T0 + i * 10**9
                names.append((await st.snapshot()).name)
        return names

    older, newer = run(main())
    newest = list_snapshots(tmp_path / "memory-snapshots")[0]
    assert newest.name == newer
    newest.path.write_bytes(b"\0" * newest.bytes)  # same size, wrong bytes
    corrupt_header(tmp_path / "memory.db")

    async def reopen() -> None:
        async with stage(tmp_path, SIG) as st:
            assert st.recovery is not None
            assert st.recovery.restored_from == older

    run(reopen())


def test_no_snapshot_means_an_empty_store_and_a_loud_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def first() -> None:
        async with stage(tmp_path, SIG) as st:
            feed(st, random_walk(np.random.default_rng(3), 3, 2), SIG)

    run(first())
    corrupt_header(tmp_path / "memory.db")
    caplog.set_level(logging.ERROR, logger="edge_agent.memory")

    async def reopen() -> None:
        async with stage(tmp_path, SIG) as st:
            assert st.recovery is not None
            assert st.recovery.restored_from is None
            assert st.stats()["open"]

    run(reopen())
    assert any("no good snapshot" in r.getMessage() for r in caplog.records)
    assert count(tmp_path / "memory.db", "changes") == 0
