"""The boot launcher: ``decide_boot`` as a table, then the real launcher in real processes.

The crash-loop tests play systemd's ``Restart=on-failure``: they run the launcher again
after every non-zero exit, as systemd would, and look at what each boot ran.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from firmware.boot import BootDecision, decide_boot, parse_slot_env, slot_env
from firmware.slots import Event, SlotInfo, SlotName, Slots, SlotState
from tests.support.firmware import (
    BASE_VERSION,
    crashing_cli,
    expect_slot,
    install,
    launch,
    ran,
    variant,
)

pytestmark = pytest.mark.peers

SHA = "ab" * 32
NOW = 1_760_000_000.0
GOOD_A = SlotInfo("good", "0.1.1", SHA)
TRY_B = SlotInfo("trying", "0.2.0", SHA)
BOTH: frozenset[SlotName] = frozenset({"a", "b"})


def trying_b(boot_count: int, *, previous: SlotName | None = "a", max_boots: int = 3) -> SlotState:
    return SlotState(
        active="b", previous=previous, boot_count=boot_count, max_boots=max_boots, a=GOOD_A, b=TRY_B
    )


# (case, state, present slots, slot that runs, new active, failed status, event kind, reason)
CASES: list[tuple[str, SlotState, frozenset[SlotName], SlotName | None, str | None, str]] = [
    ("fresh device", SlotState(), frozenset(), None, None, "base install"),
    ("good slot", SlotState(active="a", a=GOOD_A), BOTH, "a", None, "slot a (0.1.1) (good)"),
    ("first boot on probation", trying_b(0), BOTH, "b", None, "boot 1 of 3"),
    ("last boot on probation", trying_b(2), BOTH, "b", None, "boot 3 of 3"),
    ("boots used up", trying_b(3), BOTH, "a", "rolled_back", "did not become healthy in 3 boots"),
    ("over the count", trying_b(7), BOTH, "a", "rolled_back", "in 7 boots"),
    ("no previous", trying_b(3, previous=None), BOTH, None, "fell_back_to_base", "no previous"),
    (
        "previous damaged",
        trying_b(3),
        frozenset({"b"}),
        None,
        "fell_back_to_base",
        "previous slot a (0.1.1) is damaged",
    ),
    (
        "active damaged",
        trying_b(0),
        frozenset({"a"}),
        "a",
        "rolled_back",
        "slot b (0.2.0) is damaged",
    ),
    ("max_boots 1, first", trying_b(0, max_boots=1), BOTH, "b", None, "boot 1 of 1"),
    ("max_boots 1, second", trying_b(1, max_boots=1), BOTH, "a", "rolled_back", "in 1 boots"),
    (
        "bad, stayed after a rollback with nowhere to go",
        SlotState(active="b", b=dataclasses.replace(TRY_B, status="bad")),
        BOTH,
        "b",
        None,
        "(bad)",
    ),
]


@pytest.mark.parametrize(
    ("state", "present", "runs", "event", "reason"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_decide_boot(
    state: SlotState,
    present: frozenset[SlotName],
    runs: SlotName | None,
    event: str | None,
    reason: str,
) -> None:
    decision = decide_boot(state, now=NOW, present=present)
    assert decision.slot == runs
    assert reason in decision.reason
    assert decision == decide_boot(state, now=NOW, present=present)  # pure: same in, same out
    new = decision.state
    assert new.active == runs
    if event is None:
        assert decision.event is None
        expected = (
            state.boot_count + 1
            if state.active and state.slot(state.active).status == "trying"
            else state.boot_count
        )
        assert new.boot_count == expected
        assert dataclasses.replace(new, boot_count=state.boot_count) == state
        return
    # A failed build: marked bad, nothing to go back to twice, the reason kept for the report.
    assert decision.event == new.last_event
    assert isinstance(new.last_event, Event)
    assert (new.last_event.kind, new.last_event.t, new.last_event.failed_slot) == (event, NOW, "b")
    assert reason in new.last_event.reason
    assert new.b.status == "bad"
    assert (new.previous, new.boot_count) == (None, 0)
    assert new.last_event.running == ("a 0.1.1" if runs == "a" else "base")
    # The next boot of the new state is settled: no further flip.
    again = decide_boot(new, now=NOW + 5, present=present)
    assert (again.slot, again.event, again.state) == (runs, None, new)


def test_slot_env_round_trips() -> None:
    state = trying_b(0)
    assert slot_env("b", state) == "b:0.2.0"
    assert slot_env(None, state) == "base"
    assert parse_slot_env("b:0.2.0") == ("b", "0.2.0")
    assert parse_slot_env("base") == ("base", None)
    assert parse_slot_env(None) == ("base", None)


def test_boot_decision_is_frozen() -> None:
    decision = BootDecision(None, SlotState(), "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.slot = "a"  # type: ignore[misc]


# --- the real launcher --------------------------------------------------------------------


@pytest.fixture
def slots(tmp_path: Path) -> Slots:
    return Slots(tmp_path / "slots")


@pytest.fixture
def good_old(slots: Slots, real_wheel: Path, tmp_path: Path) -> Slots:
    install(slots, variant(real_wheel, tmp_path / "old.whl", version="0.1.1"), "0.1.1")
    slots.activate("a")
    slots.mark_good()
    return slots


def test_fresh_device_runs_the_base_install_and_creates_nothing(tmp_path: Path) -> None:
    root = tmp_path / "none"
    proc = launch(root, "version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == BASE_VERSION
    assert "the base install" in proc.stderr
    assert not root.exists()


def test_the_slots_code_runs_not_the_base_installs(
    slots: Slots, real_wheel: Path, tmp_path: Path
) -> None:
    install(slots, variant(real_wheel, tmp_path / "new.whl", version="0.2.0"), "0.2.0")
    slots.activate("a")
    # The marker build prints EDGEFLEET_SLOT and the cli.py it runs from: slot a's, 0.2.0,
    # although the base install (0.1.0, editable) is importable in the same interpreter.
    expect_slot(slots.root, "a", "0.2.0")
    state = slots.load()
    assert (state.active, state.a.status, state.boot_count) == ("a", "trying", 1)


def test_exit_codes_pass_through_the_launcher(good_old: Slots) -> None:
    # exec, not a child: the agent's own status is the service's (2 = bad config, no restart).
    proc = launch(good_old.root, "check-config", "/nonexistent/agent.toml")
    assert proc.returncode == 2
    assert "file not found" in proc.stderr


def systemd(root: Path, *, max_starts: int) -> Iterator[subprocess.CompletedProcess[str]]:
    """Restart=on-failure: start again after each exit that is neither 0 nor 2."""
    for _ in range(max_starts):
        proc = launch(root, "version")
        yield proc
        if proc.returncode in (0, 2):
            return


def test_crash_looping_build_gives_way_to_the_old_slot_after_max_boots(
    good_old: Slots, real_wheel: Path, tmp_path: Path
) -> None:
    crash = variant(real_wheel, tmp_path / "crash.whl", version="0.2.0", cli=crashing_cli)
    install(good_old, crash, "0.2.0")
    good_old.activate("b")
    runs = list(systemd(good_old.root, max_starts=10))
    assert [p.returncode for p in runs] == [1, 1, 1, 0]
    for n, proc in enumerate(runs[:3], start=1):
        assert f"slot b (0.2.0) on probation: boot {n} of 3" in proc.stderr
        assert proc.stdout == ""
    last = runs[3]
    assert "did not become healthy in 3 boots: back to slot a (0.1.1)" in last.stderr
    assert last.stdout.strip() == f"0.1.1 a:0.1.1 {good_old.root / 'a' / 'edge_agent' / 'cli.py'}"
    doc = json.loads(good_old.state_path.read_text())
    assert (doc["active"], doc["previous"], doc["boot_count"]) == ("a", None, 0)
    assert (doc["slots"]["a"]["status"], doc["slots"]["b"]["status"]) == ("good", "bad")
    event = doc["last_event"]
    assert (event["kind"], event["failed_slot"], event["failed_version"], event["running"]) == (
        "rolled_back",
        "b",
        "0.2.0",
        "a 0.1.1",
    )
    assert "did not become healthy in 3 boots" in event["reason"]
    # Settled: the old slot keeps running, nothing counts any more.
    expect_slot(good_old.root, "a", "0.1.1")
    assert good_old.load().boot_count == 0


@pytest.mark.parametrize("missing", ["no_previous", "previous_damaged"])
def test_crash_loop_with_no_rollback_target_ends_on_the_base_install(
    slots: Slots, real_wheel: Path, tmp_path: Path, missing: str
) -> None:
    if missing == "previous_damaged":
        install(slots, variant(real_wheel, tmp_path / "old.whl", version="0.1.1"), "0.1.1")
        slots.activate("a")
        slots.mark_good()
    crash = variant(real_wheel, tmp_path / "crash.whl", version="0.2.0", cli=crashing_cli)
    slot = install(slots, crash, "0.2.0")
    slots.activate(slot)
    if missing == "previous_damaged":
        (slots.slot_dir("a") / "edge_agent" / "cli.py").unlink()
    runs = list(systemd(slots.root, max_starts=10))
    assert [p.returncode for p in runs] == [1, 1, 1, 0]
    assert runs[3].stdout.strip() == BASE_VERSION
    assert "running the base install" in runs[3].stderr
    state = slots.load()
    assert (state.active, state.previous, state.slot(slot).status) == (None, None, "bad")
    assert state.last_event is not None
    assert state.last_event.kind == "fell_back_to_base"
    assert state.last_event.running == "base"
    expected = (
        "no previous slot" if missing == "no_previous" else "previous slot a (0.1.1) is damaged"
    )
    assert expected in state.last_event.reason
    assert slots.status()["last_event"]["reason"] == state.last_event.reason
    # No loop: the base install runs from now on and the state does not move.
    assert ran(slots.root) == BASE_VERSION
    assert slots.load() == state


def test_mark_good_stops_the_count(good_old: Slots, real_wheel: Path, tmp_path: Path) -> None:
    install(good_old, variant(real_wheel, tmp_path / "new.whl", version="0.2.0"), "0.2.0")
    good_old.activate("b")
    expect_slot(good_old.root, "b", "0.2.0")
    expect_slot(good_old.root, "b", "0.2.0")
    assert good_old.load().boot_count == 2
    good_old.mark_good()
    for _ in range(2):  # more than max_boots - 2 boots: it would have rolled back by now
        expect_slot(good_old.root, "b", "0.2.0")
    state = good_old.load()
    assert (state.b.status, state.boot_count, state.previous) == ("good", 0, "a")


def test_corrupt_state_is_moved_aside_and_the_base_install_runs(good_old: Slots) -> None:
    good_old.state_path.write_text('{"format": 1, "active": "a"')
    proc = launch(good_old.root, "version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == BASE_VERSION
    assert "not valid JSON" in proc.stderr
    assert (good_old.root / "state.json.corrupt").read_text() == '{"format": 1, "active": "a"'
    state = good_old.load()
    assert state.active is None
    assert state.last_event is not None
    assert state.last_event.kind == "state_reset"
    assert "not valid JSON" in state.last_event.reason
    # Reported once; the next boot is an ordinary base boot.
    again = launch(good_old.root, "version")
    assert "moving it aside" not in again.stderr
    assert good_old.load() == state


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs for the slots that the test can remount read-only."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_boot_that_cannot_be_counted_does_not_run_the_unproven_build(
    read_only: Path, real_wheel: Path, tmp_path: Path
) -> None:
    slots = Slots(read_only / "slots")
    install(slots, variant(real_wheel, tmp_path / "old.whl", version="0.1.1"), "0.1.1")
    slots.activate("a")
    slots.mark_good()
    install(slots, variant(real_wheel, tmp_path / "new.whl", version="0.2.0"), "0.2.0")
    slots.activate("b")
    subprocess.run(["mount", "-o", "remount,ro", str(read_only)], check=True)
    proc = launch(slots.root, "version")
    assert proc.returncode == 0, proc.stderr
    assert "boot not counted, running a:0.1.1" in proc.stderr
    assert proc.stdout.strip().startswith("0.1.1 a:0.1.1 ")
    assert slots.load().boot_count == 0  # unchanged: nothing could be written
    subprocess.run(["mount", "-o", "remount,rw", str(read_only)], check=True)
    expect_slot(slots.root, "b", "0.2.0")
    assert slots.load().boot_count == 1
