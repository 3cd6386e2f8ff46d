"""Processes a test or bench started, read from /proc: children by command line, alive."""

from __future__ import annotations

from pathlib import Path


def children(pid: int, marker: str) -> list[int]:
    """Pids of ``pid``'s child processes whose command line holds ``marker``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and marker in cmd:
            out.append(int(entry.name))
    return sorted(out)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
