"""A/B slots for agent builds: two unpacked wheels, a slot pointer and a boot counter.

``state.json`` under ``root`` (``/var/lib/edge-agent/slots`` on a device) is the only
source of truth: a slot is trusted only as far as it says (``empty`` is never run, whatever
the directory holds). Every write is durable (temp file, fsync, ``os.replace``, fsync the
directory) under ``.lock``, so a kill leaves the old or the new state, never a torn one. A
missing state.json is a fresh device; a corrupt one raises :class:`StateFileError` and the
launcher falls back to the base install. Layout, statuses and why:
``docs/ARCHITECTURE.md``, "A/B slots".
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
import struct
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, cast

from firmware.errors import (
    RollbackUnavailable,
    SlotBusy,
    SlotNotReady,
    StagingError,
    StateFileError,
    WheelRefused,
)
from ota.fsutil import fsync_dir

if TYPE_CHECKING:
    import zipfile

SlotName = Literal["a", "b"]
Status = Literal["empty", "installed", "trying", "good", "bad"]
SLOT_NAMES: tuple[SlotName, SlotName] = ("a", "b")
STATUSES: frozenset[str] = frozenset({"empty", "installed", "trying", "good", "bad"})
STATE_FORMAT = 1
STATE_FILE = "state.json"
# The file whose presence makes a slot directory runnable (the launcher imports it).
ENTRY_POINT = ("edge_agent", "cli.py")

# Checkpoints passed to ``step_hook``, in order (tests SIGKILL the process at each).
INSTALL_STEPS = (
    "install:extracting",  # after each member is written into the staging dir
    "install:staged",  # staging complete and fsynced; nothing else touched yet
    "install:released",  # state.json says the target slot is empty
    "install:moved_aside",  # the old slot dir renamed to .trash-*
    "install:swapped",  # the staging dir renamed to the slot dir, parent fsynced
    "install:recorded",  # state.json says the slot is installed
)
ACTIVATE_STEPS = ("activate:begin", "activate:saved")
STATE_STEP = "state:tmp_synced"  # inside every state write, before os.replace

_CHUNK = 1 << 16
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_LOCAL_MAGIC = b"PK\x03\x04"


def other(slot: SlotName) -> SlotName:
    return "b" if slot == "a" else "a"


@dataclass(frozen=True)
class SlotInfo:
    status: Status = "empty"
    version: str | None = None
    sha256: str | None = None

    def label(self, name: str) -> str:
        return f"{name} ({self.version})" if self.version else name


@dataclass(frozen=True)
class Event:
    """Something the agent must report (over MQTT, in ``ota status``): a rollback, a reset."""

    kind: str  # rolled_back | fell_back_to_base | rollback_unavailable | state_reset
    reason: str
    t: float  # UNIX seconds
    failed_slot: str | None = None
    failed_version: str | None = None
    running: str = "base"  # what runs after the event: "a 0.1.0" or "base"


@dataclass(frozen=True)
class SlotState:
    active: SlotName | None = None
    previous: SlotName | None = None
    boot_count: int = 0
    max_boots: int = 3
    a: SlotInfo = SlotInfo()
    b: SlotInfo = SlotInfo()
    last_event: Event | None = None

    def slot(self, name: SlotName) -> SlotInfo:
        return self.a if name == "a" else self.b

    def with_slot(self, name: SlotName, info: SlotInfo) -> SlotState:
        return (
            dataclasses.replace(self, a=info) if name == "a" else dataclasses.replace(self, b=info)
        )

    def running(self) -> str:
        """What the launcher runs for this state: ``"a 0.1.0"`` or ``"base"``."""
        if self.active is None:
            return "base"
        return f"{self.active} {self.slot(self.active).version}"

    def to_json(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "active": self.active,
            "previous": self.previous,
            "boot_count": self.boot_count,
            "max_boots": self.max_boots,
            "slots": {n: dataclasses.asdict(self.slot(n)) for n in SLOT_NAMES},
            "last_event": None if self.last_event is None else dataclasses.asdict(self.last_event),
        }

    @classmethod
    def from_json(cls, doc: object, where: str) -> SlotState:
        """Parse and check a decoded state.json; :class:`StateFileError` names the fault."""

        def fail(what: str) -> StateFileError:
            return StateFileError(f"{where}: {what}")

        if not isinstance(doc, dict):
            raise fail(f"expected a JSON object, got {type(doc).__name__}")
        if doc.get("format") != STATE_FORMAT:
            raise fail(f"format: expected {STATE_FORMAT}, got {doc.get('format')!r}")
        expected = {"format", "active", "previous", "boot_count", "max_boots", "slots"}
        missing = expected - doc.keys()
        if missing:
            raise fail(f"missing keys {sorted(missing)}")
        for key in ("active", "previous"):
            if doc[key] not in (None, *SLOT_NAMES):
                raise fail(f"{key}: expected 'a', 'b' or null, got {doc[key]!r}")
        for key, low in (("boot_count", 0), ("max_boots", 1)):
            value = doc[key]
            if type(value) is not int or value < low:
                raise fail(f"{key}: expected an integer >= {low}, got {value!r}")
        raw_slots = doc["slots"]
        if not isinstance(raw_slots, dict) or set(raw_slots) != set(SLOT_NAMES):
            raise fail(f"slots: expected an object with keys 'a' and 'b', got {raw_slots!r}")
        infos: dict[str, SlotInfo] = {}
        for name in SLOT_NAMES:
            raw = raw_slots[name]
            if not isinstance(raw, dict) or raw.get("status") not in STATUSES:
                raise fail(f"slots.{name}.status: expected one of {sorted(STATUSES)}, got {raw!r}")
            version, sha = raw.get("version"), raw.get("sha256")
            if raw["status"] != "empty" and not (
                isinstance(version, str) and version and isinstance(sha, str) and len(sha) == 64
            ):
                raise fail(f"slots.{name}: a {raw['status']} slot needs a version and a sha256")
            infos[name] = SlotInfo(
                status=cast(Status, raw["status"]),
                version=version if isinstance(version, str) else None,
                sha256=sha if isinstance(sha, str) else None,
            )
        state = cls(
            active=doc["active"],
            previous=doc["previous"],
            boot_count=doc["boot_count"],
            max_boots=doc["max_boots"],
            a=infos["a"],
            b=infos["b"],
            last_event=_event_from_json(doc.get("last_event"), fail),
        )
        # The invariants every writer keeps; a file breaking them was not written by us.
        if state.active is not None:
            status = state.slot(state.active).status
            if status not in ("trying", "good", "bad"):
                raise fail(f"active: slot {state.active} is {status}, not trying, good or bad")
        if state.previous is not None:
            if state.previous == state.active:
                raise fail(f"previous: equals active ({state.active})")
            if state.slot(state.previous).status != "good":
                raise fail(f"previous: slot {state.previous} is not good")
        return state


def _event_from_json(raw: object, fail: Callable[[str], StateFileError]) -> Event | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fail(f"last_event: expected an object or null, got {raw!r}")
    try:
        event = Event(**raw)
    except TypeError as exc:
        raise fail(f"last_event: {exc}") from None
    if not (
        isinstance(event.kind, str)
        and isinstance(event.reason, str)
        and isinstance(event.t, int | float)
        and isinstance(event.running, str)
    ):
        raise fail(f"last_event: wrong field types in {raw!r}")
    return event


@dataclass(frozen=True)
class WheelLimits:
    """Caps checked on a wheel's declared sizes before reading and on the actual bytes."""

    max_members: int = 20_000
    max_file_bytes: int = 64 << 20
    max_total_bytes: int = 512 << 20
    max_name_bytes: int = 512


class Slots:
    """The A/B slots under ``root``. Not thread-safe; process-safe through ``.lock``.

    ``step_hook`` is called with each name of :data:`INSTALL_STEPS`, :data:`ACTIVATE_STEPS`
    and :data:`STATE_STEP` as the step is reached (the crash tests SIGKILL there).
    """

    def __init__(
        self,
        root: Path,
        *,
        max_boots: int = 3,
        limits: WheelLimits | None = None,
        step_hook: Callable[[str], None] | None = None,
    ) -> None:
        if max_boots < 1:
            raise ValueError(f"max_boots: expected >= 1, got {max_boots}")
        self.root = root
        self.max_boots = max_boots
        self.limits = limits or WheelLimits()
        self._hook = step_hook or (lambda _step: None)

    # --- state ---------------------------------------------------------------------------

    @property
    def state_path(self) -> Path:
        return self.root / STATE_FILE

    def slot_dir(self, name: SlotName) -> Path:
        return self.root / name

    def load(self) -> SlotState:
        """The current state; a fresh one when state.json is missing.

        Raises :class:`StateFileError` when it cannot be read or is corrupt.
        """
        try:
            raw = self.state_path.read_bytes()
        except FileNotFoundError:
            return SlotState(max_boots=self.max_boots)
        except OSError as exc:
            raise StateFileError(f"{self.state_path}: cannot read: {exc.strerror}") from exc
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StateFileError(f"{self.state_path}: not valid JSON: {exc}") from None
        return SlotState.from_json(doc, str(self.state_path))

    def save(self, state: SlotState) -> None:
        """Write state.json durably (temp file, fsync, os.replace, fsync the directory)."""
        data = (json.dumps(state.to_json(), indent=1, sort_keys=True) + "\n").encode()
        tmp: str | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{STATE_FILE}.", suffix=".tmp", dir=self.root)
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), 0o640)  # mkstemp's 0600 would hide it from `ota status`
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            self._hook(STATE_STEP)
            os.replace(tmp, self.state_path)
            tmp = None
            fsync_dir(self.root)
        except OSError as exc:
            raise StateFileError(f"{self.state_path}: cannot write: {exc.strerror}") from exc
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def reset_state(self, reason: str, *, now: float | None = None) -> SlotState:
        """Move a corrupt state.json aside to ``state.json.corrupt``, write a fresh state.

        The fresh state runs the base install and records ``reason`` as a ``state_reset``.
        """
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.state_path, self.root / f"{STATE_FILE}.corrupt")
        event = Event("state_reset", reason, time.time() if now is None else now)
        state = SlotState(max_boots=self.max_boots, last_event=event)
        self.save(state)
        return state

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the slots' flock(2) lock (blocking) for a read-modify-write of the state."""
        lock = self.root / ".lock"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
            except OSError as exc:
                if exc.errno != errno.EROFS:
                    raise
                # A read-only state dir: flock works on a read-only descriptor, and the
                # launcher must still boot a good slot (only writes fail, each on its own).
                fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise StateFileError(f"{lock}: cannot open the lock: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def present(self) -> frozenset[SlotName]:
        """The slots whose directory holds a runnable agent (its entry point exists)."""
        return frozenset(n for n in SLOT_NAMES if self.slot_dir(n).joinpath(*ENTRY_POINT).is_file())

    def sweep(self) -> list[Path]:
        """Remove what a killed install or state write left behind; returns what it removed.

        Call only under :meth:`locked` (an install in progress owns its staging dir).
        """
        removed: list[Path] = []
        if not self.root.is_dir():
            return removed
        for entry in self.root.iterdir():
            name = entry.name
            if name.startswith((".staging-", ".trash-")):
                shutil.rmtree(entry, ignore_errors=True)
            elif name.startswith(f".{STATE_FILE}.") and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    entry.unlink()
            else:
                continue
            removed.append(entry)
        return removed

    def status(self) -> dict[str, Any]:
        """A JSON-able summary for ``edge-agent ota status``; never raises on a bad state."""
        out: dict[str, Any] = {"root": str(self.root), "state_file": "ok", "error": None}
        try:
            if not self.state_path.exists():
                out["state_file"] = "missing"
            state = self.load()
        except StateFileError as exc:
            out.update(state_file="corrupt", error=str(exc))
            return out
        out.update(state.to_json())
        del out["format"]
        present = self.present()
        for name in SLOT_NAMES:
            out["slots"][name]["present"] = name in present
        out["running"] = state.running()
        return out

    # --- install -------------------------------------------------------------------------

    def install_wheel(self, wheel: Path, *, version: str, sha256: str) -> SlotName:
        """Unpack an agent wheel into the inactive slot; returns that slot's name.

        Every member is checked before anything is written (names, types, declared sizes);
        the actual bytes are inflated here and counted against the declared sizes and
        caps. The active slot is never touched. On any failure the staging directory is
        removed and :class:`StagingError` (or a subclass) is raised; state.json is
        untouched unless staging had completed (then the target slot may read ``empty``).
        """
        import zipfile  # noqa: PLC0415  (kept out of the launcher's import path)

        with self.locked():
            state = self.load()
            if state.active is not None and state.slot(state.active).status == "trying":
                raise SlotBusy(
                    f"{self.root}: slot {state.slot(state.active).label(state.active)} is on "
                    "probation; its rollback target is the inactive slot: mark it good or "
                    "roll back first"
                )
            target: SlotName = other(state.active) if state.active is not None else "a"
            self.sweep()
            try:
                staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root))
            except OSError as exc:
                raise StagingError(
                    f"{self.root}: cannot create a staging directory: {exc.strerror}"
                ) from exc
            try:
                try:
                    with wheel.open("rb") as fh:
                        self._check_sha256(fh, wheel, sha256)
                        try:
                            zf = zipfile.ZipFile(fh)
                        except (zipfile.BadZipFile, OSError) as exc:
                            raise WheelRefused(f"{wheel}: not a zip archive: {exc}") from None
                        with zf:
                            members = _check_members(zf, wheel, self.limits)
                            _check_metadata(zf, fh, wheel, version, self.limits)
                            self._extract(zf, fh, wheel, members, staging)
                except OSError as exc:
                    hint = " (disk full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
                    raise StagingError(
                        f"staging {wheel} into slot {target} under {self.root} failed{hint}: "
                        f"{exc.strerror or exc}; the active slot is untouched"
                    ) from exc
                self._hook("install:staged")
                return self._swap_in(state, target, staging, version, sha256.lower())
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise

    def _check_sha256(self, fh: IO[bytes], wheel: Path, expected: str) -> None:
        digest = hashlib.sha256()
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
        fh.seek(0)
        if digest.hexdigest() != expected.lower():
            raise WheelRefused(f"{wheel}: sha256 is {digest.hexdigest()}, expected {expected}")

    def _extract(
        self,
        zf: zipfile.ZipFile,
        fh: IO[bytes],
        wheel: Path,
        members: list[tuple[zipfile.ZipInfo, tuple[str, ...]]],
        staging: Path,
    ) -> None:
        budget = [self.limits.max_total_bytes]
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for info, parts in members:
            dest = staging.joinpath(*parts)
            if info.is_dir():
                dest.mkdir(mode=0o755, parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            fd = os.open(dest, flags, 0o644)
            try:
                for chunk in _inflate(fh, info, wheel, budget):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            self._hook("install:extracting")
        # Directories last, deepest first: their entries are what makes the files findable.
        for dirpath, _dirs, _files in os.walk(staging, topdown=False):
            fsync_dir(Path(dirpath))
        os.chmod(staging, 0o750)  # noqa: S103  (mkdtemp made it 0700; other dirs follow the umask)
        fsync_dir(self.root)

    def _swap_in(
        self, state: SlotState, target: SlotName, staging: Path, version: str, sha256: str
    ) -> SlotName:
        slot_dir = self.slot_dir(target)
        # Before the old directory changes, state.json must stop vouching for it: a crash
        # between the renames must never leave a "good" previous slot holding other code.
        released = state.with_slot(target, SlotInfo())
        if state.previous == target:
            released = dataclasses.replace(released, previous=None)
        released = dataclasses.replace(released, max_boots=self.max_boots)
        if released != state:
            self.save(released)
        self._hook("install:released")
        trash: Path | None = None
        try:
            if os.path.lexists(slot_dir):
                trash = self.root / f".trash-{target}-{secrets.token_hex(4)}"
                os.rename(slot_dir, trash)
            self._hook("install:moved_aside")
            os.rename(staging, slot_dir)
            fsync_dir(self.root)
        except OSError as exc:
            raise StagingError(
                f"swapping the staged build into {slot_dir} failed: {exc.strerror}; "
                f"slot {target} is now empty, the active slot is untouched"
            ) from exc
        self._hook("install:swapped")
        self.save(released.with_slot(target, SlotInfo("installed", version, sha256)))
        self._hook("install:recorded")
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return target

    # --- pointer -------------------------------------------------------------------------

    def activate(self, slot: SlotName) -> SlotState:
        """Point at ``slot`` (status ``trying``, boot_count 0); the old active becomes previous.

        The caller then restarts the agent through systemd (a non-zero exit: the unit has
        ``Restart=on-failure``); the launcher counts the boots from there.
        """
        with self.locked():
            state = self.load()
            info = state.slot(slot)
            if state.active == slot:
                raise SlotNotReady(f"{self.root}: slot {slot} is already active")
            if info.status != "installed":
                raise SlotNotReady(
                    f"{self.root}: slot {slot} is {info.status}; only an installed slot "
                    "can be activated"
                )
            if slot not in self.present():
                raise SlotNotReady(
                    f"{self.slot_dir(slot)}: damaged, {'/'.join(ENTRY_POINT)} missing"
                )
            old = state.active
            keep = old is not None and state.slot(old).status == "good"
            new = dataclasses.replace(
                state.with_slot(slot, dataclasses.replace(info, status="trying")),
                active=slot,
                previous=old if keep else None,
                boot_count=0,
                max_boots=self.max_boots,
            )
            self._hook("activate:begin")
            self.save(new)
            self._hook("activate:saved")
            return new

    def mark_good(self, version: str | None = None) -> SlotState:
        """The active build passed probation: ``trying`` -> ``good``, boot_count reset.

        ``version`` is the build the caller means (the one whose probation passed): when
        the active slot holds another, the launcher has gone back to the previous slot
        since, and :class:`SlotNotReady` says so instead of vouching for the wrong build
        (without it, an already good slot would be returned as if it were the new one)."""
        with self.locked():
            state = self.load()
            if state.active is None:
                raise SlotNotReady(f"{self.root}: no active slot (the base install runs)")
            info = state.slot(state.active)
            if version is not None and info.version != version:
                raise SlotNotReady(
                    f"{self.root}: {version} is not the active build: slot "
                    f"{info.label(state.active)} is ({info.status})"
                )
            if info.status == "good":
                return state
            if info.status != "trying":
                raise SlotNotReady(
                    f"{self.root}: slot {info.label(state.active)} is {info.status}, not trying"
                )
            new = dataclasses.replace(
                state.with_slot(state.active, dataclasses.replace(info, status="good")),
                boot_count=0,
            )
            self.save(new)
            return new

    def fall_back_to_base(self, reason: str, *, now: float | None = None) -> SlotState:
        """The active build failed and came from the base install: mark it ``bad`` and let
        the base install run again (the launcher runs it when no slot is active)."""
        t = time.time() if now is None else now
        with self.locked():
            state = self.load()
            cur = state.active
            if cur is None:
                return state
            failed = state.slot(cur)
            bad = state.with_slot(cur, dataclasses.replace(failed, status="bad"))
            new = dataclasses.replace(
                bad,
                active=None,
                previous=None,
                boot_count=0,
                last_event=_base_event(reason, t, cur, failed.version),
            )
            self.save(new)
            return new

    def rollback(self, reason: str, *, now: float | None = None) -> SlotState:
        """Make ``previous`` active again and mark the failed slot ``bad``.

        When ``previous`` is missing, not good or its directory is damaged, the device stays
        on the current slot, now marked ``bad`` so no probation re-runs it and no later
        boot flips it, records ``reason`` as a ``rollback_unavailable`` event and raises
        :class:`RollbackUnavailable` for the caller to report; nothing loops.
        """
        t = time.time() if now is None else now
        with self.locked():
            state = self.load()
            cur = state.active
            if cur is None:
                raise SlotNotReady(f"{self.root}: no active slot to roll back from")
            failed = state.slot(cur)
            prev = state.previous
            why_not = why_unusable(state, prev, self.present())
            bad = state.with_slot(cur, dataclasses.replace(failed, status="bad"))
            if why_not is None and prev is not None:
                event = Event(
                    "rolled_back",
                    reason,
                    t,
                    cur,
                    failed.version,
                    f"{prev} {state.slot(prev).version}",
                )
                new = dataclasses.replace(
                    bad, active=prev, previous=None, boot_count=0, last_event=event
                )
                self.save(new)
                return new
            event = Event(
                "rollback_unavailable",
                f"{reason}; cannot roll back: {why_not}",
                t,
                cur,
                failed.version,
                f"{cur} {failed.version}",
            )
            self.save(dataclasses.replace(bad, boot_count=0, last_event=event))
            raise RollbackUnavailable(
                f"{self.root}: rollback from {failed.label(cur)} impossible ({why_not}); "
                f"staying on it, marked bad",
                reason=event.reason,
            )


def _base_event(reason: str, t: float, cur: SlotName, version: str | None) -> Event:
    return Event("fell_back_to_base", reason, t, cur, version, "base")


def why_unusable(
    state: SlotState, prev: SlotName | None, present: frozenset[SlotName]
) -> str | None:
    """Why ``prev`` cannot be returned to, or None when it can."""
    if prev is None:
        return "no previous slot"
    info = state.slot(prev)
    if info.status != "good":
        return f"previous slot {prev} is {info.status}"
    if prev not in present:
        return f"previous slot {info.label(prev)} is damaged ({'/'.join(ENTRY_POINT)} missing)"
    return None


# --- wheel checks -------------------------------------------------------------------------


def _check_members(  # noqa: PLR0915 - every check a wheel member passes before extraction, in one place to audit
    zf: zipfile.ZipFile, wheel: Path, limits: WheelLimits
) -> list[tuple[zipfile.ZipInfo, tuple[str, ...]]]:
    """Check every member's name, type and declared size; nothing is written before this."""
    import zipfile  # noqa: PLC0415

    infos = zf.infolist()
    if len(infos) > limits.max_members:
        raise WheelRefused(f"{wheel}: {len(infos)} members, more than {limits.max_members}")
    out: list[tuple[zipfile.ZipInfo, tuple[str, ...]]] = []
    files: set[tuple[str, ...]] = set()
    dirs: set[tuple[str, ...]] = set()
    declared = 0
    for info in infos:
        name = info.filename

        def refuse(what: str, name: str = name) -> WheelRefused:
            return WheelRefused(f"{wheel}: member {name!r}: {what}")

        if info.orig_filename != name or "\x00" in info.orig_filename:
            raise refuse("name contains a NUL byte")
        if len(name.encode()) > limits.max_name_bytes:
            raise refuse(f"name longer than {limits.max_name_bytes} bytes")
        if name.startswith("/") or "\\" in name:
            raise refuse("absolute name or backslash")
        is_dir = name.endswith("/")
        parts = tuple(name.rstrip("/").split("/"))
        if any(p in ("", ".", "..") for p in parts):
            raise refuse("empty, '.' or '..' path component")
        ftype = stat.S_IFMT(info.external_attr >> 16)
        if ftype == stat.S_IFLNK:
            raise refuse("is a symlink")
        if ftype not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise refuse(f"is a special file (mode {info.external_attr >> 16:o})")
        if (ftype == stat.S_IFDIR) != is_dir and ftype != 0:
            raise refuse("type bits and name disagree on file or directory")
        if info.flag_bits & 0x1:
            raise refuse("is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise refuse(f"compression method {info.compress_type} (only stored or deflated)")
        if is_dir and info.file_size:
            raise refuse("a directory with content")
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise refuse("stored with a compressed size unlike its size")
        if info.file_size > limits.max_file_bytes:
            raise refuse(f"declares {info.file_size} bytes, over the {limits.max_file_bytes} cap")
        declared += info.file_size
        if declared > limits.max_total_bytes:
            raise refuse(f"members declare over {limits.max_total_bytes} bytes in total")
        if parts in files or (parts in dirs and not is_dir):
            raise refuse("duplicate name")
        if is_dir:
            if parts in dirs:
                continue  # a repeated directory entry creates nothing twice
            dirs.add(parts)
        else:
            files.add(parts)
        dirs.update(parts[:i] for i in range(1, len(parts)))
        out.append((info, parts))
    clash = files & dirs
    if clash:
        raise WheelRefused(f"{wheel}: {'/'.join(min(clash))!r} is both a file and a directory")
    if tuple(ENTRY_POINT) not in files:
        raise WheelRefused(f"{wheel}: no {'/'.join(ENTRY_POINT)}: not an agent build")
    return out


def _inflate(
    fh: IO[bytes], info: zipfile.ZipInfo, wheel: Path, budget: list[int]
) -> Iterator[bytes]:
    """Yield a member's bytes, inflated here so the output is counted as it is produced.

    zipfile's reader stops at the declared size without saying whether more would come, so
    a member that inflates past its declaration (a zip bomb) would pass silently truncated.
    ``budget`` holds the bytes left under the total cap, shared by all members.
    """

    def refuse(what: str) -> WheelRefused:
        return WheelRefused(f"{wheel}: member {info.filename!r}: {what}")

    fh.seek(info.header_offset)
    magic, name_len, extra_len = _LOCAL_HEADER.unpack(fh.read(_LOCAL_HEADER.size).ljust(30, b"\0"))
    if magic != _LOCAL_MAGIC:
        raise refuse("local header missing")
    fh.seek(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len)
    inflater = None if info.compress_type == 0 else zlib.decompressobj(-zlib.MAX_WBITS)
    left = info.compress_size
    produced = 0
    crc = 0
    while left > 0:
        raw = fh.read(min(_CHUNK, left))
        if not raw:
            raise refuse("archive ends inside the member")
        left -= len(raw)
        for out in [raw] if inflater is None else _drain(inflater, raw, refuse):
            produced += len(out)
            budget[0] -= len(out)
            if produced > info.file_size:
                raise refuse(f"inflates past its declared {info.file_size} bytes (a zip bomb?)")
            if budget[0] < 0:
                raise refuse("the wheel inflates past the total size cap")
            crc = zlib.crc32(out, crc)
            yield out
    if inflater is not None and not inflater.eof:
        raise refuse("deflate stream truncated")
    if produced != info.file_size:
        raise refuse(f"holds {produced} bytes, declared {info.file_size}")
    if crc != info.CRC:
        raise refuse("CRC-32 mismatch")


def _drain(
    inflater: zlib._Decompress, data: bytes, refuse: Callable[[str], WheelRefused]
) -> Iterator[bytes]:
    """Inflate ``data`` in chunks of at most _CHUNK bytes, never more at once."""
    while True:
        if inflater.eof:
            if data or inflater.unused_data:
                raise refuse("bytes after the end of its deflate stream")
            return
        try:
            out = inflater.decompress(data, _CHUNK)
        except zlib.error as exc:
            raise refuse(f"corrupt deflate data: {exc}") from None
        data = inflater.unconsumed_tail
        if out:
            yield out
        # A full chunk with no input left may mean more pending output: ask again with b"".
        if not data and len(out) < _CHUNK and not inflater.eof:
            return


def _check_metadata(
    zf: zipfile.ZipFile, fh: IO[bytes], wheel: Path, version: str, limits: WheelLimits
) -> None:
    """The wheel must be an ``edgefleet`` build of exactly the version the bundle names."""
    from email.parser import HeaderParser  # noqa: PLC0415

    from packaging.version import InvalidVersion, Version  # noqa: PLC0415

    metas = [
        i
        for i in zf.infolist()
        if i.filename.count("/") == 1
        and i.filename.endswith(".dist-info/METADATA")
        and not i.is_dir()
    ]
    if len(metas) != 1:
        raise WheelRefused(f"{wheel}: expected one *.dist-info/METADATA, found {len(metas)}")
    raw = b"".join(_inflate(fh, metas[0], wheel, [limits.max_file_bytes]))
    headers = HeaderParser().parsestr(raw.decode("utf-8", "replace"))
    name, found = headers.get("Name", ""), headers.get("Version", "")
    if name.lower().replace("_", "-") != "edgefleet":
        raise WheelRefused(f"{wheel}: METADATA Name is {name!r}, not edgefleet")
    try:
        same = Version(found) == Version(version)
    except InvalidVersion as exc:
        raise WheelRefused(f"{wheel}: {exc}") from None
    if not same:
        raise WheelRefused(f"{wheel}: METADATA Version is {found!r}, the bundle says {version!r}")
