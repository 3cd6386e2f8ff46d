"""Stored seq runs (fleet.store.runs): the few rows per device boot the gap query reads.

The pure folds first; then both stores (SQLite and a private PostgreSQL schema) kept by
real ingest: runs extended across batches, rows left by late and concurrent writes and
folded by ``compact_runs`` with the gaps unchanged, runs rebuilt from the stored keys by
the v15 migration, and retention dropping what it cut.
"""

from __future__ import annotations

import itertools
import random
import threading

import pytest

from fleet.store import Gap, Row
from fleet.store.runs import merged, runs_of
from tests.support.fleet import decision, state, telemetry
from tests.support.stores import Backend
from wire import encode

BOOT = "a" * 32
T0 = 1_760_000_000_000_000_000
SEC = 1_000_000_000


def _row(device: str, seq: int, *, kind: str = "telemetry", t_ns: int | None = None) -> Row:
    t = T0 + seq * SEC if t_ns is None else t_ns
    msg = telemetry(device, BOOT, seq, t) if kind == "telemetry" else decision(device, BOOT, seq, t)
    return Row(device, "plant1", kind, BOOT, seq, t, encode(msg), t + 1)


def _key(r: Row) -> tuple[str, str, int, str, int]:
    return (r.device, r.boot_id, r.seq, r.kind, r.t_ns)


# -- the folds (pure) ------------------------------------------------------------------------


def test_runs_of_a_batch_are_its_new_consecutive_seqs_per_boot() -> None:
    rows = [_row("b", s) for s in (5, 1, 2, 3, 9)] + [_row("a", s) for s in (0, 1)]
    new = {(r.device, r.boot_id, r.seq) for r in rows if r.seq != 2}  # 2 was a duplicate
    assert runs_of([_key(r) for r in rows], new) == [
        ("a", BOOT, 0, 1, T0 + 1 * SEC),
        ("b", BOOT, 1, 1, T0 + 1 * SEC),
        ("b", BOOT, 3, 3, T0 + 3 * SEC),
        ("b", BOOT, 5, 5, T0 + 5 * SEC),
        ("b", BOOT, 9, 9, T0 + 9 * SEC),
    ]
    assert runs_of([_key(r) for r in rows], set()) == []


def test_merged_folds_overlapping_and_touching_rows_of_one_boot_only() -> None:
    rows = [
        ("d", "x", 10, 12, 12),
        ("d", "x", 0, 4, 4),
        ("d", "x", 5, 5, 5),  # touches 0..4
        ("d", "x", 2, 3, 3),  # inside 0..4
        ("d", "x", 12, 20, 20),  # overlaps 10..12
        ("d", "y", 5, 9, 9),  # another boot: never folded into x
        ("e", "x", 6, 7, 7),
    ]
    assert merged(rows) == [
        ("d", "x", 0, 5, 5),
        ("d", "x", 10, 20, 20),
        ("d", "y", 5, 9, 9),
        ("e", "x", 6, 7, 7),
    ]


def test_merged_keeps_the_union_of_seqs_on_random_rows() -> None:
    rng = random.Random(7)
    for _ in range(200):
        rows = []
        for _ in range(rng.randrange(1, 12)):
            low = rng.randrange(0, 40)
            high = low + rng.randrange(0, 6)
            rows.append(("d", "x", low, high, high))
        before = {s for _, _, lo, hi, _ in rows for s in range(lo, hi + 1)}
        out = merged(rows)
        assert {s for _, _, lo, hi, _ in out for s in range(lo, hi + 1)} == before
        for (_, _, _, hi, _), (_, _, lo, _, _) in itertools.pairwise(out):
            assert lo > hi + 1, "what is left neither overlaps nor touches"


# -- kept by the stores ----------------------------------------------------------------------


def _runs(backend: Backend, device: str | None = None) -> list[tuple[str, int, int]]:
    rows = backend.sql("SELECT device, low, high FROM seq_runs ORDER BY device, low")
    return [(str(d), int(lo), int(hi)) for d, lo, hi in rows if device in (None, d)]


@pytest.mark.peers
def test_in_order_batches_keep_one_row_per_boot_and_a_hole_splits_it(backend: Backend) -> None:
    store = backend.open()
    try:
        for first in range(0, 30, 4):
            store.ingest([_row("gw1", s) for s in range(first, min(first + 4, 30)) if s != 17])
        store.ingest([_row("gw1", 3)])  # a redelivery: nothing new
        assert _runs(backend) == [("gw1", 0, 16), ("gw1", 18, 29)]
        assert store.gaps("gw1") == [Gap("gw1", BOOT, 17, 17)]
    finally:
        store.close()


@pytest.mark.peers
def test_late_and_out_of_order_seqs_leave_rows_that_compact_folds(backend: Backend) -> None:
    store = backend.open()
    try:
        seqs = list(range(60))
        random.Random(3).shuffle(seqs)
        missing = {13, 14, 40}
        for i in range(0, 60, 5):
            store.ingest([_row("gw1", s) for s in seqs[i : i + 5] if s not in missing])
        want = [Gap("gw1", BOOT, 13, 14), Gap("gw1", BOOT, 40, 40)]
        assert store.gaps("gw1") == want
        assert len(_runs(backend)) > 3, "shuffled seqs leave more rows than runs"
        folded = store.compact_runs()
        assert folded > 0
        assert _runs(backend) == [("gw1", 0, 12), ("gw1", 15, 39), ("gw1", 41, 59)]
        assert store.gaps("gw1") == want
        assert store.compact_runs() == 0, "nothing left to fold"
        store.ingest([_row("gw1", s) for s in (13, 14)])  # the hole fills late
        assert store.gaps("gw1") == [Gap("gw1", BOOT, 40, 40)]
        store.compact_runs()
        assert _runs(backend) == [("gw1", 0, 39), ("gw1", 41, 59)]
    finally:
        store.close()


@pytest.mark.peers
def test_workers_storing_one_device_at_once_lose_no_seq(backend: Backend) -> None:
    # Four handles (as four ingest workers) store interleaved seqs of the same devices at
    # the same time while two more (two nodes' history loops) fold the rows: whatever rows
    # that leaves, no seq is a gap, and the last fold leaves one per boot.
    devices = [f"gw{i}" for i in range(5)]
    stores = [backend.open() for _ in range(4)]
    folders = [backend.open() for _ in range(2)]
    errors: list[BaseException] = []
    done = threading.Event()

    def fold(k: int) -> None:
        try:
            while not done.is_set():
                folders[k].compact_runs()
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    def work(k: int) -> None:
        try:
            for first in range(0, 200, 8):
                seqs = [s for s in range(first, first + 8) if s % 4 == k]
                stores[k].ingest([_row(d, s) for s in seqs for d in devices])
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    folding = [threading.Thread(target=fold, args=(k,)) for k in range(2)]
    try:
        for t in threads + folding:
            t.start()
        for t in threads:
            t.join()
        done.set()
        for t in folding:
            t.join()
        assert errors == []
        store = stores[0]
        for d in devices:
            store.record_state(d, "plant1", state(d, BOOT, 200), T0)
        assert store.gaps() == []
        store.compact_runs()
        assert _runs(backend) == [(d, 0, 199) for d in devices]
        assert store.gaps() == []
    finally:
        done.set()
        for s in stores + folders:
            s.close()


@pytest.mark.peers
def test_the_v15_migration_builds_the_runs_from_the_stored_keys(backend: Backend) -> None:
    store = backend.open()
    try:
        rows = [_row("gw1", s) for s in range(50) if s not in (0, 7, 8, 30)]
        rows += [_row("gw2", s, kind="decision") for s in range(3, 9)]
        store.ingest(rows)
        store.record_state("gw1", "plant1", state("gw1", BOOT, 55), T0)
        before = store.gaps()
        assert before == [
            Gap("gw1", BOOT, 0, 0),
            Gap("gw1", BOOT, 7, 8),
            Gap("gw1", BOOT, 30, 30),
            Gap("gw1", BOOT, 50, 54),
            Gap("gw2", BOOT, 0, 2),
        ]
    finally:
        store.close()
    # The database as v14 left it: no runs, v15 not applied.
    backend.sql("DROP TABLE seq_runs")
    backend.sql("DELETE FROM schema_version WHERE version = 15")
    store = backend.open()  # migrates
    try:
        assert _runs(backend) == [
            ("gw1", 1, 6),
            ("gw1", 9, 29),
            ("gw1", 31, 49),
            ("gw2", 3, 8),
        ]
        assert store.gaps() == before
    finally:
        store.close()


@pytest.mark.peers
def test_retention_drops_the_runs_it_cut_and_a_seq_stored_again_is_kept(
    backend: Backend,
) -> None:
    store = backend.open()
    try:
        # Two runs, 0..9 and 12..19 (10 and 11 never came), telemetry and decisions mixed.
        kinds = ("telemetry", "decision")
        store.ingest([_row("gw1", s, kind=kinds[s % 2]) for s in range(20) if s not in (10, 11)])
        assert store.gaps("gw1") == [Gap("gw1", BOOT, 10, 11)]
        store.expire("telemetry", T0 + 13 * SEC, 100)  # 12 goes too
        # 0..9 is wholly older than the cut: its row goes; the hole above it is no gap.
        assert _runs(backend) == [("gw1", 12, 19)]
        assert store.gaps("gw1") == []
        # Telemetry cut from 12..19 comes again (a late copy) with a new seq after the run:
        # one batch that names the run twice (its low again, and right after its high).
        store.ingest([_row("gw1", 12), _row("gw1", 20)])
        assert _runs(backend) == [("gw1", 12, 20)]
        assert store.gaps("gw1") == []
    finally:
        store.close()
