"""The folders and files the agent writes, and whether it can.

``edge-agent check-config`` asks :func:`path_problems`, which creates nothing; ``run``
calls :func:`prepare_state_paths`, which also creates the folders. Either way a problem is
one line that names the config key and the reason::

    agent.state_dir: cannot create /proc/x: /proc is on a proc filesystem, which holds no files
    memory.path: /var/lib/edge-agent/memory.db is a directory, not a file
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edge_agent.config import AgentConfig
from edge_agent.errors import StatePathError
from edge_agent.ota_config import ota_dir

#: Kernel filesystems that cannot hold the agent's folders and files.
PSEUDO_FILESYSTEMS = frozenset(
    {
        "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore",
        "bpf", "configfs", "efivarfs", "devpts", "fusectl", "binfmt_misc",
    }
)  # fmt: skip
MOUNTINFO = Path("/proc/self/mountinfo")


@dataclass(frozen=True, slots=True)
class StatePath:
    """One place the agent writes: ``key`` is the config key that sets ``path``."""

    key: str
    path: Path
    #: A folder the agent writes in; else a file (an SQLite database: its folder must be
    #: writable too, for the -wal and -shm files next to it).
    is_dir: bool
    #: Created at start (the folder itself, or the folder of the file); the others are made
    #: when first needed (snapshots, A/B slots) or not at all (state_dir, see state_paths).
    create: bool = True


def state_paths(cfg: AgentConfig) -> tuple[StatePath, ...]:
    """Every place ``cfg`` makes the agent write, parents before what they hold.

    ``state_dir`` itself is made only as the folder of something inside it: an agent with
    memory, uplink and OTA off writes nothing and creates nothing.
    """
    paths = [StatePath("agent.state_dir", cfg.state_dir, is_dir=True, create=False)]
    if cfg.memory.enabled:
        db, snapshots = cfg.memory.resolve(cfg.state_dir)
        paths.append(StatePath("memory.path", db, is_dir=False))
        paths.append(StatePath("memory.snapshot_dir", snapshots, is_dir=True, create=False))
    if cfg.uplink.enabled:
        outbox = cfg.uplink.resolve_outbox(cfg.state_dir)
        paths.append(StatePath("uplink.outbox.path", outbox, is_dir=False))
    if cfg.ota.enabled:
        # Not a key of its own: the OTA journal, trust root and content store live here.
        paths.append(StatePath("agent.state_dir", ota_dir(cfg.state_dir), is_dir=True))
        if "agent:replace" in cfg.ota.permissions:
            slots = cfg.ota.resolve_slots(cfg.state_dir, cfg.path.parent)
            key = "ota.slots_dir" if cfg.ota.slots_dir is not None else "agent.state_dir"
            paths.append(StatePath(key, slots, is_dir=True, create=False))
    return tuple(paths)


def path_problems(paths: Sequence[StatePath], mountinfo: str | None = None) -> list[str]:
    """One line per place the agent could not write; creates nothing.

    A place inside one already reported is not reported again (``/proc/x`` as state_dir
    would otherwise repeat for the memory store, the outbox and the OTA folder).
    ``mountinfo``: the text of ``/proc/self/mountinfo`` (read here when None).
    """
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text()
        except OSError:
            mountinfo = ""
    problems: list[str] = []
    failed: list[Path] = []
    for sp in paths:
        if any(sp.path.is_relative_to(f) for f in failed):
            continue
        why = _file_problem(sp.path) if not sp.is_dir else None
        if why is None:
            folder = sp.path if sp.is_dir else sp.path.parent
            why = _dir_problem(folder, mountinfo, wanted=sp.path)
        if why is not None:
            problems.append(f"{sp.key}: {why}")
            failed.append(sp.path)
    return problems


def prepare_state_paths(cfg: AgentConfig) -> None:
    """Check every place ``cfg`` writes and create the folders made at start.

    Raises :class:`StatePathError` with the first problem (one line, key first). A folder
    inside ``state_dir`` is made after ``state_dir``, so a failure there names that key.
    """
    paths = state_paths(cfg)
    problems = path_problems(paths)
    if problems:
        raise StatePathError(problems[0])
    made: set[Path] = set()

    def make(key: str, folder: Path) -> None:
        if folder in made:
            return
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o750)
        except OSError as exc:
            raise StatePathError(f"{key}: cannot create {folder}: {exc.strerror or exc}") from None
        made.add(folder)

    for sp in paths:
        if not sp.create:
            continue
        folder = sp.path if sp.is_dir else sp.path.parent
        if folder.is_relative_to(cfg.state_dir):
            make("agent.state_dir", cfg.state_dir)
        make(sp.key, folder)


def filesystem_of(path: Path, mountinfo: str) -> str | None:
    """The filesystem type ``path`` is on, from ``/proc/self/mountinfo`` text; None if the
    text names no mount above it. ``path`` should be absolute and free of symlinks.

    Root passes every permission check, so a path on a kernel filesystem (``/proc``, ``/sys``)
    is found by the filesystem type its nearest existing folder is mounted with.
    """
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) <= sep + 1:
            continue
        mount = Path(_unescape(fields[4]))
        if path == mount or path.is_relative_to(mount):
            depth = len(mount.parts)
            if best is None or depth >= best[0]:
                best = (depth, fields[sep + 1])
    return best[1] if best is not None else None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _file_problem(path: Path) -> str | None:
    try:
        st = path.stat()
    except OSError:
        return None  # missing (made at start) or below something missing: its folder says
    if stat.S_ISDIR(st.st_mode):
        return f"{path} is a directory, not a file"
    if not os.access(path, os.W_OK):
        return f"{path} is not writable ({_why_not_writable(path)})"
    return None


def _dir_problem(folder: Path, mountinfo: str, *, wanted: Path) -> str | None:
    """Why ``folder`` cannot be used or made (``wanted`` is what the key names)."""
    existing = folder
    while True:
        try:
            st = existing.stat()
            break
        except (FileNotFoundError, NotADirectoryError):
            if existing.parent == existing:
                return f"cannot create {wanted}: nothing of its path exists"
            existing = existing.parent
        except OSError as exc:
            return f"cannot use {wanted}: {existing}: {exc.strerror or exc}"
    made = existing == folder
    prefix = "" if made and wanted == folder else f"cannot create {wanted}: "
    if not stat.S_ISDIR(st.st_mode):
        return f"{prefix}{existing} exists and is not a directory"
    fs = filesystem_of(Path(os.path.realpath(existing)), mountinfo)
    if fs in PSEUDO_FILESYSTEMS:
        return f"{prefix}{existing} is on a {fs} filesystem, which holds no files"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{prefix}{existing} is not writable ({_why_not_writable(existing)})"
    return None


def _why_not_writable(path: Path) -> str:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "read-only filesystem"
    except OSError:
        pass
    return "permission denied"


__all__ = [
    "StatePath",
    "filesystem_of",
    "path_problems",
    "prepare_state_paths",
    "state_paths",
]
