"""The chaos benchmark's plan and accounting (pure), and one tiny real run of it: a real
Mosquitto on the config ``fleet broker-config`` writes, ``fleet serve`` as a process on
SQLite, devices on the real agent uplink, every fault kind once."""

from __future__ import annotations

import pytest

from bench import chaos
from bench.chaos_plan import (
    DEVICE_KILL,
    FAULT_KINDS,
    OUTAGE_BROKER_KILL,
    START_WORKERS,
    WORKER_KILL,
    WORKERS_CHANGE,
    GapRange,
    Injected,
    kinds_of,
    recovery_s,
    schedule,
    tally,
    worst,
)

S = 1_000_000_000


@pytest.mark.parametrize("seed", range(20))
def test_a_seeded_schedule_exercises_every_fault_kind_in_its_window(seed: int) -> None:
    plan = schedule(seed, 180, hosts=2)
    assert plan == schedule(seed, 180, hosts=2)  # deterministic for a seed
    assert all(n > 0 for n in kinds_of(plan).values()), kinds_of(plan)
    assert len(plan) == (180 - 2 * 15) // 20
    times = [f.at_s for f in plan]
    assert times == sorted(times)
    assert times[0] >= 15
    assert times[-1] <= 180 - 15
    workers = START_WORKERS
    for f in plan:
        if f.kind == WORKERS_CHANGE:
            assert f.target in (1, 2, 3)
            assert f.target != workers
            workers = f.target
        elif f.kind == WORKER_KILL:
            assert 0 <= f.target < workers
        elif f.kind == DEVICE_KILL:
            assert 0 <= f.target < 2
            assert 1 <= f.down_s <= 4


def test_a_short_schedule_still_has_every_kind_and_other_seeds_differ() -> None:
    plan = schedule(1, 30, hosts=1, settle_s=5)
    assert sorted(f.kind for f in plan) == sorted(FAULT_KINDS)
    assert schedule(1, 900, hosts=5) != schedule(2, 900, hosts=5)
    assert schedule(1, 10, hosts=1, settle_s=5) == []
    extra = schedule(1, 40, hosts=1, settle_s=5, kinds=(*FAULT_KINDS, OUTAGE_BROKER_KILL))
    assert kinds_of(extra, (*FAULT_KINDS, OUTAGE_BROKER_KILL))[OUTAGE_BROKER_KILL] == 1
    (outage,) = [f for f in extra if f.kind == OUTAGE_BROKER_KILL]
    assert 8 <= outage.down_s <= 12


def test_tally_counts_lost_duplicate_rows_and_false_gaps() -> None:
    numbered = {("a", "b1"): 5, ("a", "b2"): 3, ("c", "b3"): 2}
    rows = [("a", "b1", s) for s in (0, 1, 2, 4)]  # seq 3 lost
    rows += [("a", "b2", s) for s in (0, 1, 2, 2)]  # one duplicate row
    rows += [("c", "b3", 0), ("c", "b3", 1), ("c", "b3", 7)]  # 7 never numbered
    gaps = [
        GapRange("a", "b1", 3, 3),  # true: seq 3 is missing
        GapRange("a", "b1", 2, 3),  # false: 2 is stored
        GapRange("a", "b2", 3, 4),  # false: b2 numbered 3 seqs
        GapRange("x", "b9", 0, 0),  # false: no such boot
    ]
    t = tally(numbered, rows, gaps, devices=2)
    assert (t.sent, t.stored, t.lost) == (10, 9, 1)
    assert t.duplicate_rows == 1
    assert t.unexpected == 1
    assert (t.gaps_reported, t.false_gaps) == (4, 3)
    assert t.lost_examples == ["a/b1/3-3"]
    assert t.false_examples[0] == "a/b1/2-3 (stored)"
    assert "never numbered" in t.false_examples[1]
    clean = tally(numbered, [(d, b, s) for (d, b), n in numbered.items() for s in range(n)], [],
                  devices=2)  # fmt: skip
    assert (clean.lost, clean.duplicate_rows, clean.false_gaps) == (0, 0, 0)


def test_recovery_is_until_a_message_made_after_the_fault_is_stored() -> None:
    # (created, received) per device
    rows = {"a": [(1 * S, 2 * S), (4 * S, 8 * S), (6 * S, 7 * S)], "b": [(2 * S, 5 * S)]}
    faults = [
        Injected("broker_kill", 3 * S),  # a's made at 4 and 6: the one at 6 came first (7)
        Injected("device_kill", 1 * S, frozenset({"b"})),  # b's own, made at 2: stored at 5
        Injected("serve_kill", 6 * S),  # nothing made after it
        Injected("worker_kill", 1 * S),  # made at 2 (b, 5), 4 (a, 8), 6 (a, 7): 5
    ]
    assert recovery_s(faults, rows) == [4.0, 4.0, None, 4.0]
    # b made a message before the kill that arrived after it: not a recovery
    assert recovery_s([Injected("device_kill", 3 * S, frozenset({"b"}))], rows) == [None]
    assert worst([2.0, 1.0]) == 2.0
    assert worst([2.0, None]) is None


@pytest.mark.peers
@pytest.mark.timeout(300)
def test_a_tiny_chaos_run_loses_nothing() -> None:
    """4 devices, ~25 s of faults (each kind once) on SQLite: every message numbered is
    stored once. The gap grace is cut to 5 s to fit the test's time, so a hole that takes
    longer to fill (a killed worker's session, fleet serve restarting) is reported as a
    gap here: false gaps are the full benchmark's to judge, not this test's."""
    args = chaos.parse(["--devices", "4", "--duration", "25", "--every", "4", "--rate", "2",
                        "--stores", "sqlite", "--gap-grace", "5", "--seed", "7"])  # fmt: skip
    summary = chaos.run(args, quiet=True)
    run = summary["stores"]["sqlite"]
    assert run["drained"], run
    assert summary["faults"] == dict.fromkeys(FAULT_KINDS, 1)
    assert summary["sent"] > 100, summary
    assert summary["lost"] == 0, run["lost_examples"]
    assert summary["duplicate_rows"] == 0
    assert summary["stored"] == summary["sent"]
    assert run["boots"] >= 4 + 2  # a device host was killed: its devices started new boots
    assert run["max_recovery_s"] is not None
