"""The chaos benchmark's pure parts: the seeded fault schedule and the accounting of what the
devices sent against what the store holds and what the fleet reported missing. No I/O: data
and times in, results out (``bench.chaos`` does the processes, the broker and the store).

Definitions (the same in ``bench.chaos`` and docs/ARCHITECTURE.md):

- ``sent``: distinct ``(device, boot_id, seq)`` the devices' outboxes numbered. The outbox
  numbers a boot's data messages gap-free from 0 in the transaction that stores each row,
  so a boot that numbered ``n`` created seqs ``0..n-1``; at the end every device has
  drained (outbox empty: each of them acked by the broker), so sent = created = acked.
- ``stored``: distinct sent keys in the store's ``messages`` table after the drain.
- ``lost``: ``sent - stored``.
- ``duplicate_rows``: rows beyond one per ``(device, boot_id, seq)``.
- ``gaps_reported``: ranges the fleet reported missing: the ``ingest_gaps`` rows ``fleet
  serve`` logged while it ran, plus what ``fleet gaps`` reads from the store at the end.
- ``false_gaps``: reported ranges that cover a seq that IS stored at the end, or one the
  device never numbered (beyond its boot's count, or a boot no device had).
- ``recovery_s`` of a fault: from the moment it was injected until the first message
  created after it (the row's ``t_ns``) by a device it touched (all of them, but for a
  device-host kill: that host's, i.e. their new boots) is stored (its ``received_ns``);
  ``max_recovery_s`` is the largest.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

#: Every kind of fault the schedule throws (each at least once in a schedule that has room).
BROKER_KILL = "broker_kill"
WORKER_KILL = "worker_kill"
SERVE_KILL = "serve_kill"
DEVICE_KILL = "device_kill"
WORKERS_CHANGE = "workers_change"
FAULT_KINDS = (BROKER_KILL, WORKER_KILL, SERVE_KILL, DEVICE_KILL, WORKERS_CHANGE)
#: Opt-in (``bench.chaos --kinds ...,broker_kill_in_outage``): ``fleet serve`` SIGKILLed, the broker
#: queues the devices' messages for its sessions (and acks them) for ``down_s``, then the
#: broker is SIGKILLed too before both start again. What the broker acked since its last
#: autosave is gone: this kind measures that risk rather than the fleet's own recovery.
OUTAGE_BROKER_KILL = "broker_kill_in_outage"

#: Worker counts ``fleet serve`` starts with and changes to.
START_WORKERS = 2
CHANGED_WORKERS = (1, 3)

_NS = 1_000_000_000


@dataclass(frozen=True)
class Fault:
    """One fault at ``at_s`` seconds into the chaos phase.

    ``target``: the worker index (``worker_kill``), the device host (``device_kill``) or the
    new worker count (``workers_change``); 0 otherwise. ``down_s``: how long what was
    killed stays down before the bench starts it again (the broker, ``fleet serve``, the
    device host); a killed worker is started again by ``fleet serve`` itself."""

    at_s: float
    kind: str
    target: int = 0
    down_s: float = 0.0


def schedule(
    seed: int,
    duration_s: float,
    *,
    hosts: int,
    every_s: float = 20.0,
    settle_s: float = 15.0,
    kinds: tuple[str, ...] = FAULT_KINDS,
) -> list[Fault]:
    """The faults of one run: one every ``every_s`` on average (jittered by a third), none
    in the first ``settle_s`` nor in the last ``settle_s`` (the fleet must be storing
    before the first and the last must leave time to recover within the phase). Kinds
    are drawn in shuffled rounds of all of ``kinds`` (default :data:`FAULT_KINDS`), so a
    schedule of at least ``len(kinds)`` faults exercises each. The worker count changes between 1, 2
    and 3 (never to the count it has); a worker kill targets a worker that exists.
    Deterministic for a seed."""
    if hosts < 1:
        raise ValueError(f"hosts must be at least 1, got {hosts}")
    rng = random.Random(seed)
    span = duration_s - 2 * settle_s
    n = max(len(kinds), int(span // every_s)) if span > 0 else 0
    if n == 0:
        return []
    step = span / n
    drawn: list[str] = []
    while len(drawn) < n:
        round_ = list(kinds)
        rng.shuffle(round_)
        drawn += round_
    out: list[Fault] = []
    workers = START_WORKERS
    for i, kind in enumerate(drawn[:n]):
        at = settle_s + i * step + rng.uniform(0, step / 3)
        target, down = 0, 0.0
        if kind == WORKER_KILL:
            target = rng.randrange(workers)
        elif kind == DEVICE_KILL:
            target = rng.randrange(hosts)
            down = round(rng.uniform(1.0, 4.0), 2)
        elif kind == WORKERS_CHANGE:
            target = rng.choice(sorted({*CHANGED_WORKERS, START_WORKERS} - {workers}))
            workers = target
        elif kind in (BROKER_KILL, SERVE_KILL):
            down = round(rng.uniform(1.0, 5.0), 2)
        elif kind == OUTAGE_BROKER_KILL:
            down = round(rng.uniform(8.0, 12.0), 2)
        out.append(Fault(round(at, 2), kind, target, down))
    return out


def kinds_of(faults: Iterable[Fault], kinds: tuple[str, ...] = FAULT_KINDS) -> dict[str, int]:
    """Faults by kind (every one of ``kinds`` present, zero if it never came)."""
    out = dict.fromkeys(kinds, 0)
    for f in faults:
        out[f.kind] += 1
    return out


@dataclass(frozen=True)
class GapRange:
    device: str
    boot_id: str
    first: int
    last: int


@dataclass
class Tally:
    """What one store's run came to (see the module docstring for each figure)."""

    devices: int
    sent: int
    stored: int
    lost: int
    duplicate_rows: int
    gaps_reported: int
    false_gaps: int
    #: Stored keys no device numbered (a bug or a forged device: never expected).
    unexpected: int
    #: Lost keys, a few of them, for the report: ``device/boot[:8]/first-last``.
    lost_examples: list[str] = field(default_factory=list)
    false_examples: list[str] = field(default_factory=list)


def _runs(seqs: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct ints as (first, last) runs."""
    out: list[tuple[int, int]] = []
    for s in seqs:
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def tally(
    numbered: Mapping[tuple[str, str], int],
    rows: Iterable[tuple[str, str, int]],
    gaps: Iterable[GapRange],
    *,
    devices: int,
    examples: int = 5,
) -> Tally:
    """Compare what the devices numbered (``(device, boot_id) -> count``) with the store's
    rows (``(device, boot_id, seq)``, one per row, duplicates included) and the ranges
    the fleet reported missing."""
    stored: dict[tuple[str, str], set[int]] = {}
    total_rows = 0
    for device, boot, seq in rows:
        total_rows += 1
        stored.setdefault((device, boot), set()).add(seq)
    distinct = sum(len(s) for s in stored.values())
    sent = sum(numbered.values())
    kept = 0
    unexpected = 0
    lost_examples: list[str] = []
    for key, seqs in stored.items():
        n = numbered.get(key, 0)
        inside = sum(1 for s in seqs if 0 <= s < n)
        kept += inside
        unexpected += len(seqs) - inside
    for key, n in sorted(numbered.items()):
        have = stored.get(key, set())
        missing = [s for s in range(n) if s not in have]
        for first, last in _runs(missing):
            if len(lost_examples) < examples:
                lost_examples.append(f"{key[0]}/{key[1][:8]}/{first}-{last}")
    ordered = {k: sorted(v) for k, v in stored.items()}
    reported = 0
    false = 0
    false_examples: list[str] = []
    for g in gaps:
        reported += 1
        key = (g.device, g.boot_id)
        have_sorted = ordered.get(key, [])
        i = bisect.bisect_left(have_sorted, g.first)
        covers_stored = i < len(have_sorted) and have_sorted[i] <= g.last
        never_numbered = key not in numbered or g.last >= numbered[key] or g.first < 0
        if covers_stored or never_numbered:
            false += 1
            if len(false_examples) < examples:
                why = "stored" if covers_stored else "never numbered"
                false_examples.append(f"{g.device}/{g.boot_id[:8]}/{g.first}-{g.last} ({why})")
    return Tally(
        devices=devices,
        sent=sent,
        stored=kept,
        lost=sent - kept,
        duplicate_rows=total_rows - distinct,
        gaps_reported=reported,
        false_gaps=false,
        unexpected=unexpected,
        lost_examples=lost_examples,
        false_examples=false_examples,
    )


@dataclass(frozen=True)
class Injected:
    """A fault as it happened: its kind, when (wall clock, ns) and the devices it touched
    (None: all of them)."""

    kind: str
    t_ns: int
    devices: frozenset[str] | None = None


class _Arrivals:
    """Rows of some devices by creation time, with the earliest arrival of every suffix: the
    first message created after ``t`` that was stored, in two lookups."""

    def __init__(self, rows: Iterable[tuple[int, int]]) -> None:
        ordered = sorted(rows)
        self.created = [c for c, _ in ordered]
        self.first_after: list[int] = [0] * len(ordered)
        low: int | None = None
        for i in range(len(ordered) - 1, -1, -1):
            got = ordered[i][1]
            low = got if low is None else min(low, got)
            self.first_after[i] = low

    def stored_after(self, t_ns: int) -> int | None:
        """Earliest ``received_ns`` of a message created after ``t_ns`` (None: none)."""
        i = bisect.bisect_right(self.created, t_ns)
        return self.first_after[i] if i < len(self.created) else None


def recovery_s(
    faults: Sequence[Injected], rows: Mapping[str, Sequence[tuple[int, int]]]
) -> list[float | None]:
    """For each fault, seconds from its injection until the first message CREATED after it
    by a device it touched was stored (``rows``: each device's ``(t_ns, received_ns)``, the
    device's and the fleet's wall clocks on one machine); None if none was. A message made
    before the fault and delivered after it does not count: it says nothing about whether
    the path works again."""
    everyone = _Arrivals(r for rs in rows.values() for r in rs)
    per = {d: _Arrivals(rs) for d, rs in rows.items()}
    out: list[float | None] = []
    for f in faults:
        groups = [everyone] if f.devices is None else [per[d] for d in f.devices if d in per]
        firsts = [t for g in groups if (t := g.stored_after(f.t_ns)) is not None]
        out.append((min(firsts) - f.t_ns) / _NS if firsts else None)
    return out


def worst(values: Iterable[float | None]) -> float | None:
    """The largest recovery (None: one never recovered, which is the worst)."""
    best: float | None = 0.0
    for v in values:
        if v is None:
            return None
        best = max(best or 0.0, v)
    return best
