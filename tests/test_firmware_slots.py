"""A/B slots with real wheels: the project's own wheel, built once, unpacked into slots.

Variants of that wheel (another version string, a changed ``edge_agent/cli.py``, a hostile
member) are made here with zipfile; the launcher runs as a real subprocess to show which
slot's code runs after each step, and SIGKILL lands in real child processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from pathlib import Path

import pytest

from firmware.errors import (
    RollbackUnavailable,
    SlotBusy,
    SlotError,
    SlotNotReady,
    StagingError,
    StateFileError,
    WheelRefused,
)
from firmware.slots import (
    ACTIVATE_STEPS,
    INSTALL_STEPS,
    STATE_STEP,
    Slots,
    WheelLimits,
)
from ota.errors import ActivationError, ApplyError, StorageError
from tests.support.firmware import (
    BASE_VERSION,
    expect_slot,
    install,
    ran,
    sha256_of,
    variant,
)

pytestmark = pytest.mark.peers

# --- the real wheel and its variants ------------------------------------------------------


def member(name: str, *, mode: int = stat.S_IFREG | 0o644) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, (2026, 1, 1, 0, 0, 0))
    info.external_attr = mode << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def tree_digest(path: Path) -> str:
    """Names, types and bytes of everything under ``path``: equal means untouched."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode() + b"\0")
        if p.is_symlink():
            h.update(b"L" + os.readlink(p).encode())
        elif p.is_file():
            h.update(b"F" + p.read_bytes())
        else:
            h.update(b"D")
    return h.hexdigest()


@pytest.fixture
def wheels(real_wheel: Path, tmp_path: Path) -> dict[str, Path]:
    d = tmp_path / "wheels"
    d.mkdir()
    return {
        "old": variant(real_wheel, d / "old.whl", version="0.1.1"),
        "new": variant(real_wheel, d / "new.whl", version="0.2.0"),
    }


@pytest.fixture
def good_a(tmp_path: Path, wheels: dict[str, Path]) -> Slots:
    """Slots with 0.1.1 active and good in slot a, slot b empty."""
    slots = Slots(tmp_path / "slots")
    assert install(slots, wheels["old"], "0.1.1") == "a"
    slots.activate("a")
    slots.mark_good()
    return slots


# --- the error tree -----------------------------------------------------------------------


def test_firmware_errors_are_leaves_of_ota_apply_error() -> None:
    storage: tuple[type[SlotError], ...] = (StagingError, WheelRefused, SlotBusy, StateFileError)
    for cls in storage:
        assert issubclass(cls, StorageError)
    for cls in (SlotNotReady, RollbackUnavailable):
        assert issubclass(cls, ActivationError)
    for cls in (*storage, SlotNotReady, RollbackUnavailable):
        assert issubclass(cls, SlotError)
    assert issubclass(SlotError, ApplyError)
    assert WheelRefused.permanent
    assert not StagingError.permanent
    assert len({c.code for c in (SlotError, StagingError, WheelRefused, SlotBusy)}) == 4


# --- install ------------------------------------------------------------------------------


def test_install_unpacks_the_real_wheel_into_slot_a(tmp_path: Path, real_wheel: Path) -> None:
    slots = Slots(tmp_path / "slots")
    assert install(slots, real_wheel, BASE_VERSION) == "a"
    with zipfile.ZipFile(real_wheel) as zf:
        for info in zf.infolist():
            assert (slots.slot_dir("a") / info.filename).read_bytes() == zf.read(info)
        names = {i.filename for i in zf.infolist()}
    on_disk = {
        str(p.relative_to(slots.slot_dir("a")))
        for p in slots.slot_dir("a").rglob("*")
        if p.is_file()
    }
    assert on_disk == names
    state = slots.load()
    assert state.active is None
    assert state.a.status == "installed"
    assert state.a.version == BASE_VERSION
    assert state.a.sha256 == sha256_of(real_wheel)
    assert slots.present() == {"a"}
    assert [p.name for p in slots.root.iterdir() if p.name.startswith(".")] == [".lock"]
    # Installed is not active: the launcher still runs the base install.
    assert ran(slots.root) == BASE_VERSION


def test_install_goes_to_the_inactive_slot_and_never_touches_the_active_one(
    good_a: Slots, wheels: dict[str, Path]
) -> None:
    before = tree_digest(good_a.slot_dir("a"))
    assert install(good_a, wheels["new"], "0.2.0") == "b"
    assert tree_digest(good_a.slot_dir("a")) == before
    state = good_a.load()
    assert (state.active, state.a.status, state.b.status) == ("a", "good", "installed")
    expect_slot(good_a.root, "a", "0.1.1")


def test_activate_mark_good_and_a_new_install_replacing_the_previous(
    good_a: Slots, wheels: dict[str, Path], real_wheel: Path, tmp_path: Path
) -> None:
    install(good_a, wheels["new"], "0.2.0")
    state = good_a.activate("b")
    assert (state.active, state.previous, state.boot_count) == ("b", "a", 0)
    assert state.b.status == "trying"
    expect_slot(good_a.root, "b", "0.2.0")
    assert good_a.load().boot_count == 1
    state = good_a.mark_good()
    assert (state.b.status, state.boot_count, state.previous) == ("good", 0, "a")
    assert good_a.mark_good() == state  # idempotent
    # The next build lands in a, the previous: it stops being a rollback target at once.
    third = variant(real_wheel, tmp_path / "third.whl", version="0.3.0")
    assert install(good_a, third, "0.3.0") == "a"
    state = good_a.load()
    assert (state.active, state.previous, state.a.status, state.a.version) == (
        "b",
        None,
        "installed",
        "0.3.0",
    )
    expect_slot(good_a.root, "b", "0.2.0")


def test_mark_good_of_a_build_the_launcher_gave_up_on_is_refused(
    good_a: Slots, wheels: dict[str, Path]
) -> None:
    install(good_a, wheels["new"], "0.2.0")
    good_a.activate("b")
    # Its probation passed, but before it was marked good its boots ran out: the real
    # launcher goes back to slot a (0.1.1), which is good already.
    for _ in range(good_a.max_boots):
        expect_slot(good_a.root, "b", "0.2.0")
    expect_slot(good_a.root, "a", "0.1.1")
    before = good_a.state_path.read_bytes()
    with pytest.raises(SlotNotReady, match=r"0\.2\.0 is not the active build: slot a \(0\.1\.1\)"):
        good_a.mark_good("0.2.0")
    assert good_a.state_path.read_bytes() == before
    state = good_a.mark_good("0.1.1")  # the build that runs: good already, unchanged
    assert (state.active, state.a.status, state.b.status) == ("a", "good", "bad")
    assert good_a.state_path.read_bytes() == before


def test_install_is_refused_while_the_active_build_is_on_probation(
    good_a: Slots, wheels: dict[str, Path], real_wheel: Path, tmp_path: Path
) -> None:
    install(good_a, wheels["new"], "0.2.0")
    good_a.activate("b")
    before = good_a.state_path.read_bytes()
    third = variant(real_wheel, tmp_path / "third.whl", version="0.3.0")
    with pytest.raises(SlotBusy, match=r"b \(0\.2\.0\) is on probation"):
        install(good_a, third, "0.3.0")
    assert good_a.state_path.read_bytes() == before


def test_activate_refuses_empty_bad_active_and_damaged_slots(
    good_a: Slots, wheels: dict[str, Path]
) -> None:
    with pytest.raises(SlotNotReady, match="slot b is empty"):
        good_a.activate("b")
    with pytest.raises(SlotNotReady, match="already active"):
        good_a.activate("a")
    install(good_a, wheels["new"], "0.2.0")
    (good_a.slot_dir("b") / "edge_agent" / "cli.py").unlink()
    with pytest.raises(SlotNotReady, match="damaged"):
        good_a.activate("b")
    assert good_a.load().active == "a"


def test_rollback_returns_to_the_previous_slot_and_records_why(
    good_a: Slots, wheels: dict[str, Path]
) -> None:
    install(good_a, wheels["new"], "0.2.0")
    good_a.activate("b")
    state = good_a.rollback("probation: p99 4.1 ms over the 2 ms budget", now=1234.5)
    assert (state.active, state.previous, state.a.status, state.b.status) == (
        "a",
        None,
        "good",
        "bad",
    )
    event = state.last_event
    assert event is not None
    assert (event.kind, event.failed_slot, event.failed_version, event.running, event.t) == (
        "rolled_back",
        "b",
        "0.2.0",
        "a 0.1.1",
        1234.5,
    )
    assert "p99 4.1 ms" in event.reason
    expect_slot(good_a.root, "a", "0.1.1")
    # A bad slot cannot be activated again without a fresh install.
    with pytest.raises(SlotNotReady, match="slot b is bad"):
        good_a.activate("b")


@pytest.mark.parametrize("damage", ["no_previous", "previous_dir_gone"])
def test_rollback_without_a_target_stays_reports_and_does_not_loop(
    tmp_path: Path, wheels: dict[str, Path], damage: str
) -> None:
    slots = Slots(tmp_path / "slots")
    if damage == "no_previous":
        install(slots, wheels["new"], "0.2.0")  # from the base install: nothing to go back to
        slots.activate("a")
        current = "a"
    else:
        install(slots, wheels["old"], "0.1.1")
        slots.activate("a")
        slots.mark_good()
        install(slots, wheels["new"], "0.2.0")
        slots.activate("b")
        current = "b"
        (slots.slot_dir("a") / "edge_agent" / "cli.py").unlink()
    with pytest.raises(RollbackUnavailable) as caught:
        slots.rollback("probation: no heartbeat", now=99.0)
    assert "probation: no heartbeat" in caught.value.reason
    assert ("no previous slot" if damage == "no_previous" else "damaged") in caught.value.reason
    state = slots.load()
    assert state.active == current
    assert state.slot(current).status == "bad"
    assert state.last_event is not None
    assert state.last_event.kind == "rollback_unavailable"
    assert slots.status()["last_event"]["reason"] == caught.value.reason
    # No loop: boots run the same build, uncounted, and the state stays put.
    for _ in range(2):
        expect_slot(slots.root, current, "0.2.0")
    assert slots.load() == state


# --- hostile wheels -----------------------------------------------------------------------


def patch_declared_size(wheel: Path, name: str, size: int, crc: int) -> None:
    """Rewrite the uncompressed size and CRC-32 of ``name`` in its local and central headers."""
    data = bytearray(wheel.read_bytes())
    encoded = name.encode()
    # (signature, offset of the CRC-32, of the name length, of the name); the uncompressed
    # size sits 8 bytes after the CRC-32, behind the compressed size.
    for magic, at_crc, at_len, at_name in (
        (b"PK\x03\x04", 14, 26, 30),
        (b"PK\x01\x02", 16, 28, 46),
    ):
        pos = data.find(magic)
        hits = 0
        while pos != -1:
            (name_len,) = struct.unpack_from("<H", data, pos + at_len)
            if data[pos + at_name : pos + at_name + name_len] == encoded:
                struct.pack_into("<I", data, pos + at_crc, crc)
                struct.pack_into("<I", data, pos + at_crc + 8, size)
                hits += 1
            pos = data.find(magic, pos + 4)
        assert hits == 1, (magic, name)
    wheel.write_bytes(bytes(data))


HOSTILE: dict[str, tuple[list[tuple[zipfile.ZipInfo, bytes]], str]] = {
    "dotdot": ([(member("../x"), b"escape")], r"'\.\.' path component"),
    "nested_dotdot": ([(member("edge_agent/../../x"), b"escape")], r"'\.\.' path component"),
    "absolute": ([(member("/abs"), b"root")], "absolute name"),
    "backslash": ([(member("..\\x"), b"win")], "backslash"),
    "symlink": (
        [(member("edge_agent/link", mode=stat.S_IFLNK | 0o777), b"/etc/passwd")],
        "is a symlink",
    ),
    "fifo": ([(member("edge_agent/pipe", mode=stat.S_IFIFO | 0o644), b"")], "special file"),
    "device": ([(member("edge_agent/sda", mode=stat.S_IFBLK | 0o600), b"")], "special file"),
    "duplicate": ([(member("edge_agent/cli.py"), b"raise SystemExit(3)\n")], "duplicate"),
    "file_and_dir": ([(member("edge_agent/cli.py/x"), b"")], "both a file and a directory"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_member_is_refused_before_anything_is_written(
    good_a: Slots, real_wheel: Path, tmp_path: Path, case: str
) -> None:
    extra, message = HOSTILE[case]
    wheel = variant(real_wheel, tmp_path / f"{case}.whl", version="0.2.0", extra=extra)
    with zipfile.ZipFile(wheel) as zf:
        assert extra[0][0].filename in zf.namelist()  # zipfile wrote the name as given
    assert_refused(good_a, wheel, "0.2.0", message)


def assert_refused(slots: Slots, wheel: Path, version: str, message: str) -> None:
    state_before = slots.state_path.read_bytes()
    active_before = tree_digest(slots.slot_dir("a"))
    with pytest.raises(WheelRefused, match=message):
        install(slots, wheel, version)
    assert slots.state_path.read_bytes() == state_before
    assert tree_digest(slots.slot_dir("a")) == active_before
    assert not slots.slot_dir("b").exists()
    assert sorted(p.name for p in slots.root.iterdir()) == [".lock", "a", "state.json"]
    assert not (slots.root.parent / "x").exists()
    assert not Path("/abs").exists()


def test_oversized_declared_member_is_refused_before_reading(
    good_a: Slots, real_wheel: Path, tmp_path: Path
) -> None:
    big = [(member("models/big.bin"), bytes(3 << 20))]
    wheel = variant(real_wheel, tmp_path / "big.whl", version="0.2.0", extra=big)
    capped = Slots(good_a.root, limits=WheelLimits(max_file_bytes=2 << 20))
    assert_refused(capped, wheel, "0.2.0", r"declares 3145728 bytes, over the 2097152 cap")
    total = Slots(good_a.root, limits=WheelLimits(max_total_bytes=3 << 20))
    assert_refused(total, wheel, "0.2.0", "in total")


def test_zip_bomb_declared_small_inflating_big_is_refused(
    good_a: Slots, real_wheel: Path, tmp_path: Path
) -> None:
    # 64 MiB of zeros deflate to ~64 KiB; the headers then claim 1000 bytes, with the CRC-32
    # of the first 1000 so that the lie is consistent.
    bomb = [(member("models/bomb.bin"), bytes(64 << 20))]
    wheel = variant(real_wheel, tmp_path / "bomb.whl", version="0.2.0", extra=bomb)
    patch_declared_size(wheel, "models/bomb.bin", 1000, zlib.crc32(bytes(1000)))
    with zipfile.ZipFile(wheel) as zf:
        assert zf.getinfo("models/bomb.bin").file_size == 1000
        # zipfile's own reader stops at the declared size and says nothing: why we inflate.
        assert zf.read("models/bomb.bin") == bytes(1000)
    assert_refused(good_a, wheel, "0.2.0", r"inflates past its declared 1000 bytes")
    assert not list(good_a.root.glob(".staging-*"))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("sha256", "sha256 is"),
        ("version", "METADATA Version is '0.2.0', the bundle says '0.3.0'"),
        ("no_cli", "not an agent build"),
        ("not_zip", "not a zip archive"),
    ],
)
def test_a_wheel_that_is_not_the_announced_agent_build_is_refused(
    good_a: Slots, real_wheel: Path, tmp_path: Path, case: str, message: str
) -> None:
    path = tmp_path / f"{case}.whl"
    if case == "no_cli":
        wheel = variant(real_wheel, path, version="0.2.0", drop=("edge_agent/cli.py",))
    elif case == "not_zip":
        path.write_bytes(b"not a zip at all" * 100)
        wheel = path
    else:
        wheel = variant(real_wheel, path, version="0.2.0")
    before = good_a.state_path.read_bytes()
    with pytest.raises(WheelRefused, match=message):
        good_a.install_wheel(
            wheel,
            version="0.3.0" if case == "version" else "0.2.0",
            sha256="0" * 64 if case == "sha256" else sha256_of(wheel),
        )
    assert good_a.state_path.read_bytes() == before
    assert sorted(p.name for p in good_a.root.iterdir()) == [".lock", "a", "state.json"]


# --- disk full ----------------------------------------------------------------------------


def test_disk_full_while_staging_aborts_cleanly(
    tiny_fs: Path, wheels: dict[str, Path], real_wheel: Path, tmp_path: Path
) -> None:
    slots = Slots(tiny_fs / "slots")
    install(slots, wheels["old"], "0.1.1")  # ~2 MiB unpacked: fits
    slots.activate("a")
    slots.mark_good()
    state_before = slots.state_path.read_bytes()
    active_before = tree_digest(slots.slot_dir("a"))
    # 10 MiB that do not compress: more than the whole filesystem.
    noise = [(member("models/noise.bin"), os.urandom(10 << 20))]
    big = variant(real_wheel, tmp_path / "big.whl", version="0.2.0", extra=noise)
    with pytest.raises(StagingError, match=r"disk full.*No space left on device") as caught:
        install(slots, big, "0.2.0")
    assert not isinstance(caught.value, WheelRefused)  # transient: a retry may succeed
    assert slots.state_path.read_bytes() == state_before
    assert tree_digest(slots.slot_dir("a")) == active_before
    assert sorted(p.name for p in slots.root.iterdir()) == [".lock", "a", "state.json"]
    expect_slot(slots.root, "a", "0.1.1")
    # The space came back: a build that fits installs fine afterwards.
    assert install(slots, wheels["new"], "0.2.0") == "b"


# --- SIGKILL at every step ----------------------------------------------------------------

CHILD = """
import os, signal, sys, time
from pathlib import Path
from firmware.slots import Slots

root, op, arg, version, sha, step = sys.argv[1:]
def hook(name):
    if name == step:
        os.kill(os.getpid(), signal.SIGKILL)
    if step == "slow" and name == "install:extracting":
        time.sleep(0.05)
slots = Slots(Path(root), step_hook=hook)
if op == "install":
    slots.install_wheel(Path(arg), version=version, sha256=sha)
else:
    slots.activate(arg)
print("finished")
"""


def child(
    slots: Slots, op: str, arg: str, version: str, sha: str, step: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(slots.root), op, arg, version, sha, step],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def assert_one_consistent_version(slots: Slots, slot: str, version: str) -> None:
    """state.json valid, one slot active with that version, and that code is what boots."""
    state = slots.load()
    assert state.active == slot
    info = state.slot(slot)
    assert info.version == version
    assert info.status in ("trying", "good")
    assert state.previous in (None, "a" if slot == "b" else "b")
    expect_slot(slots.root, slot, version)
    # The launcher swept what the kill left behind.
    assert not [p for p in slots.root.iterdir() if p.name.startswith((".staging-", ".trash-"))]
    assert not list(slots.root.glob(".state.json.*"))


@pytest.mark.parametrize("step", [*INSTALL_STEPS, STATE_STEP])
def test_sigkill_at_each_install_step_leaves_the_old_version(
    good_a: Slots, wheels: dict[str, Path], step: str
) -> None:
    wheel = wheels["new"]
    proc = child(good_a, "install", str(wheel), "0.2.0", sha256_of(wheel), step)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    assert_one_consistent_version(good_a, "a", "0.1.1")
    state = good_a.load()
    # Either b was never vouched for, or it is fully recorded; never half of it.
    if step == "install:recorded":
        assert (state.b.status, state.b.version) == ("installed", "0.2.0")
        good_a.activate("b")
        assert_one_consistent_version(good_a, "b", "0.2.0")
    else:
        assert state.b.status == "empty"
        # And the interrupted install can simply be done again.
        assert install(good_a, wheel, "0.2.0") == "b"


def holds(slot_dir: Path, wheel: Path) -> bool:
    """The directory holds exactly the wheel's files, byte for byte."""
    with zipfile.ZipFile(wheel) as zf:
        want = {i.filename: zf.read(i) for i in zf.infolist() if not i.is_dir()}
    got = {str(p.relative_to(slot_dir)): p.read_bytes() for p in slot_dir.rglob("*") if p.is_file()}
    return got == want


@pytest.mark.parametrize("step", [*INSTALL_STEPS, STATE_STEP])
def test_sigkill_while_replacing_the_previous_slot_never_leaves_it_vouched_for(
    good_a: Slots, wheels: dict[str, Path], real_wheel: Path, tmp_path: Path, step: str
) -> None:
    """b active, a its previous (good, 0.1.1); the next build goes into a and is killed."""
    install(good_a, wheels["new"], "0.2.0")
    good_a.activate("b")
    good_a.mark_good()
    third = variant(real_wheel, tmp_path / "third.whl", version="0.3.0")
    proc = child(good_a, "install", str(third), "0.3.0", sha256_of(third), step)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    state = good_a.load()
    assert (state.active, state.b.status) == ("b", "good")
    assert holds(good_a.slot_dir("b"), wheels["new"])
    # Whatever state.json says of a is what a's directory holds: the old build while it is
    # still the rollback target, the new one once recorded, nothing trusted in between.
    a = state.a
    if a.status == "good":
        assert state.previous == "a"
        assert holds(good_a.slot_dir("a"), wheels["old"])
    elif a.status == "installed":
        assert (state.previous, a.version) == (None, "0.3.0")
        assert holds(good_a.slot_dir("a"), third)
    else:
        assert (a.status, state.previous) == ("empty", None)
    expected = {
        "install:extracting": "good",
        "install:staged": "good",
        STATE_STEP: "good",  # the first state write is the release of a: killed before it
        "install:recorded": "installed",
    }
    assert a.status == expected.get(step, "empty")


@pytest.mark.parametrize("step", [*ACTIVATE_STEPS, STATE_STEP])
def test_sigkill_at_each_activate_step_gives_old_or_new_never_both(
    good_a: Slots, wheels: dict[str, Path], step: str
) -> None:
    install(good_a, wheels["new"], "0.2.0")
    proc = child(good_a, "activate", "b", "", "", step)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    if step == "activate:saved":
        assert_one_consistent_version(good_a, "b", "0.2.0")
        assert good_a.load().previous == "a"
    else:
        assert_one_consistent_version(good_a, "a", "0.1.1")
        assert good_a.load().b.status == "installed"


def test_sigkill_mid_extraction_by_the_clock(
    good_a: Slots, wheels: dict[str, Path], tmp_path: Path
) -> None:
    """Killed from outside as soon as its staging dir has files, not at a chosen step."""
    wheel = wheels["new"]
    proc = child(good_a, "install", str(wheel), "0.2.0", sha256_of(wheel), "slow")
    deadline = time.monotonic() + 30
    staged: list[Path] = []
    while time.monotonic() < deadline and not staged:
        staged = [p for d in good_a.root.glob(".staging-*") for p in d.rglob("*") if p.is_file()]
        time.sleep(0.005)
    assert staged, "the child never started staging"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert list(good_a.root.glob(".staging-*"))  # killed mid-way: its staging dir is left
    assert good_a.load().b.status == "empty"
    assert_one_consistent_version(good_a, "a", "0.1.1")


# --- state.json ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "expected a JSON object"),
        (b'{"format": 2}', "format: expected 1"),
        (
            json.dumps(
                {
                    "format": 1,
                    "active": "a",
                    "previous": None,
                    "boot_count": 0,
                    "max_boots": 3,
                    "slots": {"a": {"status": "empty"}, "b": {"status": "empty"}},
                }
            ).encode(),
            "active: slot a is empty",
        ),
        (
            json.dumps(
                {
                    "format": 1,
                    "active": None,
                    "previous": None,
                    "boot_count": True,
                    "max_boots": 3,
                    "slots": {"a": {"status": "empty"}, "b": {"status": "empty"}},
                }
            ).encode(),
            "boot_count: expected an integer",
        ),
    ],
)
def test_corrupt_state_is_reported_with_the_file_and_the_fault(
    tmp_path: Path, content: bytes, message: str
) -> None:
    slots = Slots(tmp_path / "slots")
    slots.root.mkdir()
    slots.state_path.write_bytes(content)
    with pytest.raises(StateFileError, match=message) as caught:
        slots.load()
    assert str(slots.state_path) in str(caught.value)
    status = slots.status()
    assert status["state_file"] == "corrupt"
    assert message in status["error"]


def test_missing_state_is_a_fresh_device_and_writes_are_atomic_files(
    tmp_path: Path, wheels: dict[str, Path]
) -> None:
    slots = Slots(tmp_path / "slots", max_boots=5)
    assert slots.status()["state_file"] == "missing"
    state = slots.load()
    assert (state.active, state.a.status, state.b.status, state.max_boots) == (
        None,
        "empty",
        "empty",
        5,
    )
    install(slots, wheels["new"], "0.2.0")
    doc = json.loads(slots.state_path.read_text())
    assert doc["max_boots"] == 5
    assert doc["slots"]["a"]["status"] == "installed"
    assert stat.S_IMODE(slots.state_path.stat().st_mode) == 0o640
