"""When the ingest audits the store for gaps, and how it says what it found. Pure: data and
``now`` in, decisions and lines out; the worker's writer thread does the I/O.

Every ``check_s`` a worker asks the store for holes behind the messages received since its
last audit, logs each new one at WARNING and counts it. A hole is a gap only once it is
``grace_s`` old and, under ``fleet serve``, once every worker has caught up
(:func:`horizon_after`). Why, and what each wait covers: ``docs/ARCHITECTURE.md``,
"Uplink and fleet ingest", *Gaps while running*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleet.store import Gap

_SEC = 1_000_000_000
#: Ranges shown per (device, boot) in one log line; the rest are counted.
SHOWN_RANGES = 5
#: (device, boot) lines one audit logs; the rest share one summary line. A broker outage
#: leaves a gap in every device at once: 10,000 lines would bury the log, not inform it.
SHOWN_BOOTS = 20
#: Longest an audit waits for the ingest's horizon beyond the grace.
HOLD_MAX_S = 600.0
#: A worker connected this long with nothing to store has caught up.
SETTLE_S = 2.0


@dataclass(slots=True)
class GapWatch:
    """The audit cursor and clock of one worker (see the module docstring)."""

    grace_ns: int
    check_ns: int
    #: Messages received at or after this (UNIX ns) are not audited yet.
    cursor_ns: int
    #: No audit before this: the next period, or ``grace`` after a store failure.
    next_ns: int = 0
    #: When this worker last (re)connected, for the log line; None before the first.
    connected_ns: int | None = None

    @classmethod
    def starting(cls, now_ns: int, *, grace_s: float, check_s: float) -> GapWatch:
        grace, check = int(grace_s * _SEC), int(check_s * _SEC)
        return cls(grace_ns=grace, check_ns=check, cursor_ns=now_ns - grace - check)

    def due(self, now_ns: int, horizon_ns: int | None = None) -> tuple[int, int] | None:
        """``(since_ns, until_ns)`` to audit now, or None. ``horizon_ns``: the ingest has
        stored everything sent before it (None: not known, only the grace applies)."""
        until = now_ns - self.grace_ns
        if horizon_ns is not None:
            until = min(until, max(horizon_ns, until - int(HOLD_MAX_S * _SEC)))
        if now_ns < self.next_ns or until <= self.cursor_ns:
            return None
        return self.cursor_ns, until

    def audited(self, until_ns: int, now_ns: int) -> None:
        self.cursor_ns = max(self.cursor_ns, until_ns)
        self.next_ns = now_ns + self.check_ns

    def audit_failed(self, now_ns: int) -> None:
        """The store could not answer: the same window again next period."""
        self.next_ns = now_ns + self.check_ns

    def store_failed(self, now_ns: int) -> None:
        """A batch failed: other workers' older messages may be pending; wait ``grace``."""
        self.next_ns = max(self.next_ns, now_ns + self.grace_ns)

    def connected(self, now_ns: int) -> None:
        self.connected_ns = now_ns


def horizon_after(
    previous_ns: int,
    now_ns: int,
    *,
    stored_t_ns: Sequence[int] = (),
    waiting: bool = False,
    settled: bool = False,
    grace_ns: int,
) -> int:
    """A worker's horizon (see the module docstring) after it committed messages of these
    device times (``stored_t_ns``): now if they were fresh and nothing is ``waiting`` in
    its queue, else their time. With nothing stored, when idle: now once ``settled``
    (connected, and nothing committed, for ``SETTLE_S``: what the broker had for it would
    have come), else the previous horizon."""
    if stored_t_ns:
        # The middle one: a device whose clock is off cannot hold the whole ingest.
        middle = sorted(stored_t_ns)[len(stored_t_ns) // 2]
        if waiting or middle < now_ns - grace_ns:
            return min(middle, now_ns)  # more to store, or a backlog (its queue may refill)
        return now_ns
    return now_ns if settled and not waiting else previous_ns


def gap_lines(gaps: Sequence[Gap], now_ns: int, connected_ns: int | None) -> list[str]:
    """One WARNING line per (device, boot): its missing seq ranges and how many seqs; past
    :data:`SHOWN_BOOTS` of them, one line that counts the rest (``fleet gaps`` lists all)."""
    by_boot: dict[tuple[str, str], list[Gap]] = {}
    for g in gaps:
        by_boot.setdefault((g.device, g.boot_id), []).append(g)
    since = ""
    if connected_ns is not None:
        since = f"; this worker (re)connected {(now_ns - connected_ns) / _SEC:.0f} s ago"
    lines = []
    for (device, boot), found in list(by_boot.items())[:SHOWN_BOOTS]:
        found.sort(key=lambda g: g.first_missing)
        missing = sum(g.last_missing - g.first_missing + 1 for g in found)
        ranges = ", ".join(f"{g.first_missing}..{g.last_missing}" for g in found[:SHOWN_RANGES])
        if len(found) > SHOWN_RANGES:
            ranges += f" and {len(found) - SHOWN_RANGES} more ranges"
        lines.append(
            f"ingest gap: device {device} boot {boot} seqs {ranges} never arrived "
            f"({missing} messages; a broker drops what it cannot queue for the ingest"
            f"{since}); see fleet gaps"
        )
    rest = list(by_boot.values())[SHOWN_BOOTS:]
    if rest:
        devices = len({found[0].device for found in rest})
        missing = sum(g.last_missing - g.first_missing + 1 for found in rest for g in found)
        lines.append(
            f"ingest gap: {len(rest)} more boots of {devices} devices have seqs that never "
            f"arrived ({missing} messages{since}); see fleet gaps"
        )
    return lines
