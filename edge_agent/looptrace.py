"""`edge-agent run --trace FILE`: every window's path from its close to its decision.

A diagnostic, off by default. Per window it keeps when the window was due, when its gate
actually opened, when perception emitted it and when its decision came, and how much of
that the event loop's thread spent on the CPU; beside that, the garbage collections and,
for every gate opening the loop came to late, what the loop's thread was running then.
``bench.e2e --trace`` reads the file and names the causes of the slowest windows
(``docs/ARCHITECTURE.md``, "The real-time path").
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path
from types import FrameType
from typing import Any

from drivers.osthread import name_os_thread
from edge_agent.gcl import GateControlList

#: Windows kept (the most recent): ten minutes at 100 windows/s.
WINDOWS_KEPT = 60_000
#: A gate opening whose stages have not all run this long after it is sampled: the P99
#: target of the window -> decision latency (below it the sampler would follow half the
#: openings and cost the agent ~2 % of a core).
STALL_AFTER_NS = 2_000_000
#: Sampling period of a stalled loop's stack, and the longest a stall is followed.
SAMPLE_EVERY_S = 0.0005
MAX_STALL_NS = 200_000_000
#: Stalls and collections kept (the most recent).
EVENTS_KEPT = 5_000
#: A collection shorter than this is not kept.
GC_KEPT_NS = 100_000
#: Frames of a stack kept, innermost first.
STACK_DEPTH = 8

#: One window's record, in this order (all UNIX ns except ``cpu_ns``, ``seq``):
#: when it was due; the first planned opening of a stage gate at or after that; the planned
#: opening and the actual start of the gate whose perception
#: emitted it; when it was emitted; the start of the gate that decided it (later than the
#: first when it waited in a queue); its decision; the loop thread's CPU time from that
#: gate's start to the decision.
WINDOW_FIELDS = (
    "seq",
    "due_ns",
    "first_opening_ns",
    "opening_ns",
    "gate_ns",
    "emitted_ns",
    "decision_gate_ns",
    "decision_ns",
    "cpu_ns",
)


def _stack(frame: FrameType | None) -> str:
    parts: list[str] = []
    while frame is not None and len(parts) < STACK_DEPTH:
        code = frame.f_code
        parts.append(f"{code.co_name} ({Path(code.co_filename).name}:{frame.f_lineno})")
        frame = frame.f_back
    return " <- ".join(parts) or "?"


class LoopTrace:
    """Records windows, garbage collections and late gate openings; :meth:`dump` writes them.

    The agent calls :meth:`gate` at every gate opening (on the loop's thread), :meth:`emitted`
    when perception hands a window on and :meth:`decided` at its decision. A sampler thread
    walks the gate schedule: when an opening of an entry that runs stages is
    ``STALL_AFTER_NS`` past and its stages have not all run (:meth:`gate_done`), it reads
    the loop thread's stack every ``SAMPLE_EVERY_S`` until they have, apart before and
    inside the gate (so it costs nothing while the loop is on time, and holds the GIL
    briefly while it is not).
    """

    def __init__(self, gcl: GateControlList) -> None:
        self._gcl = gcl
        self.windows: deque[tuple[int, ...]] = deque(maxlen=WINDOWS_KEPT)
        self.stalls: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self.collections: deque[tuple[int, int, int]] = deque(maxlen=EVENTS_KEPT)
        self._pending: dict[int, tuple[int, int, int]] = {}
        self._gate_ns = 0
        self._opening_ns = 0
        self._gate_cpu_ns = 0
        self._done_ns = 0
        self._gc_start: tuple[int, int] | None = None
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    # -- on the loop's thread ------------------------------------------------------------

    def gate(self, lateness_s: float) -> None:
        """A gate opened ``lateness_s`` after its planned time."""
        now = time.time_ns()
        self._gate_ns = now
        self._opening_ns = now - round(lateness_s * 1e9)
        self._gate_cpu_ns = time.thread_time_ns()

    def gate_done(self) -> None:
        """The last stage of the gate that opened last has run."""
        self._done_ns = time.time_ns()

    def emitted(self, seq: int) -> None:
        """Perception handed window ``seq`` on, inside the gate that opened last."""
        self._pending[seq] = (self._opening_ns, self._gate_ns, time.time_ns())
        if len(self._pending) > 1_000:  # windows dropped before a decision
            self._pending.pop(next(iter(self._pending)))

    def decided(self, seq: int, due: int, decision_ns: int) -> None:
        """Window ``seq``, due at ``due`` (its last grid point plus the lateness allowance),
        got its decision at ``decision_ns``."""
        opening, gate, emitted = self._pending.pop(seq, (0, 0, 0))
        cpu = time.thread_time_ns() - self._gate_cpu_ns
        first = self._first_opening(due)
        row = (seq, due, first, opening, gate, emitted, self._gate_ns, decision_ns, cpu)
        self.windows.append(row)

    def _first_opening(self, at_ns: int) -> int:
        cursor = at_ns
        for _ in range(len(self._gcl.entries) + 1):
            open_ns, close_ns, entry = self._gcl.next_opening(cursor)
            if entry.stages:
                return open_ns
            cursor = close_ns
        return at_ns

    # -- garbage collections (on whatever thread collects) ---------------------------------

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.time_ns()
        if phase == "start":
            self._gc_start = (now, info.get("generation", -1))
        elif self._gc_start is not None:
            start, generation = self._gc_start
            self._gc_start = None
            if now - start >= GC_KEPT_NS:
                self.collections.append((start, now - start, generation))

    # -- the sampler thread ------------------------------------------------------------------

    def start(self) -> None:
        """Start following garbage collections and the loop's gate openings (call on the loop)."""
        self._loop_thread = threading.get_ident()
        gc.callbacks.append(self._on_gc)
        self._sampler = threading.Thread(target=self._sample, name="loop-trace", daemon=True)
        self._sampler.start()

    def stop(self) -> None:
        self._stop.set()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._sampler is not None:
            self._sampler.join(timeout=1.0)

    def _sample(self) -> None:
        name_os_thread("loop-trace")
        gcl = self._gcl
        cursor = time.time_ns()
        while not self._stop.is_set():
            open_ns, close_ns, entry = gcl.next_opening(cursor)
            cursor = close_ns
            if not entry.stages:
                continue
            check_at = open_ns + STALL_AFTER_NS
            now = time.time_ns()
            if check_at < now - gcl.cycle_ns:
                cursor = now  # fell behind (a long stall just followed): catch up
                continue
            if check_at > now:
                time.sleep((check_at - now) / 1e9)
            if self._done_ns >= open_ns:
                continue
            self._follow(open_ns)

    def _follow(self, open_ns: int) -> None:
        frames = sys._current_frames  # the documented way to read another thread's stack
        before: Counter[str] = Counter()
        inside: Counter[str] = Counter()
        first = time.time_ns()
        now = first
        while self._done_ns < open_ns and now - first < MAX_STALL_NS and not self._stop.is_set():
            stack = _stack(frames().get(self._loop_thread))
            (inside if self._gate_ns >= open_ns else before)[stack] += 1
            time.sleep(SAMPLE_EVERY_S)
            now = time.time_ns()
        self.stalls.append(
            {
                "opening_ns": open_ns,
                "first_sample_ns": first,
                "reached_ns": self._gate_ns if self._gate_ns >= open_ns else None,
                "done_ns": self._done_ns if self._done_ns >= open_ns else None,
                "before_gate": before.most_common(5),
                "in_gate": inside.most_common(5),
            }
        )

    # -- the file ----------------------------------------------------------------------------

    def dump(self, path: Path) -> None:
        """Write everything kept as one JSON object (``windows`` rows: ``WINDOW_FIELDS``)."""
        doc = {
            "fields": list(WINDOW_FIELDS),
            "windows": list(self.windows),
            "stalls": list(self.stalls),
            "gc": [{"start_ns": s, "took_ns": d, "generation": g} for s, d, g in self.collections],
            "stall_after_ns": STALL_AFTER_NS,
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
