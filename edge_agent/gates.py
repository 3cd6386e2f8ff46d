"""Run the pipeline stages inside their gate windows (the asyncio edge of :mod:`edge_agent.gcl`).

:class:`GateScheduler` walks the openings of a :class:`~edge_agent.gcl.GateControlList`,
waits for each one with :class:`PreciseWait` and calls the handlers of the stages whose gate
is open, in pipeline order. Handlers are synchronous and receive the window's close time
(UNIX ns); they stop taking new work at that time.

Design: ``docs/ARCHITECTURE.md``, "The real-time path".
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import math
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from edge_agent.gcl import STAGES, GateControlList

log = logging.getLogger(__name__)

WaitMode = Literal["timerfd", "sleep"]

#: Lateness and busy samples kept for the percentiles (per entry / per stage).
SAMPLES = 4096

_CLOCK_REALTIME = 0
_TFD_TIMER_ABSTIME = 1
_PR_SET_TIMERSLACK = 29
#: The fallback sleeps this much less than needed: epoll rounding makes a sleep up to 1 ms
#: late, so waking 1.5 ms early leaves the spin to absorb the rest.
_SLEEP_MARGIN_NS = 1_500_000
#: How far past its expected end (monotonic) a wait may run before it counts as a wall-clock
#: step back and returns early.
_STEP_MARGIN_NS = 5_000_000


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _Itimerspec(ctypes.Structure):
    _fields_ = (("it_interval", _Timespec), ("it_value", _Timespec))


@functools.cache
def _libc() -> Any:
    # dlopen(NULL): libc is already in the process; find_library() would spawn ldconfig.
    lib = ctypes.CDLL(None, use_errno=True)
    lib.timerfd_create.argtypes = (ctypes.c_int, ctypes.c_int)
    lib.timerfd_create.restype = ctypes.c_int
    lib.timerfd_settime.argtypes = (
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(_Itimerspec),
        ctypes.c_void_p,
    )
    lib.timerfd_settime.restype = ctypes.c_int
    return lib


def _ctypes_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


class _Timerfd:
    """An absolute CLOCK_REALTIME timer as a non-blocking fd (os.timerfd_* from 3.13)."""

    def __init__(self) -> None:
        if sys.version_info >= (3, 13):
            self.fd = os.timerfd_create(time.CLOCK_REALTIME, flags=os.TFD_NONBLOCK | os.TFD_CLOEXEC)
        else:
            fd = _libc().timerfd_create(_CLOCK_REALTIME, os.O_NONBLOCK | os.O_CLOEXEC)
            if fd < 0:
                raise _ctypes_error("timerfd_create")
            self.fd = int(fd)

    def arm(self, deadline_ns: int) -> None:
        if sys.version_info >= (3, 13):
            os.timerfd_settime_ns(self.fd, flags=os.TFD_TIMER_ABSTIME, initial=deadline_ns)
            return
        spec = _Itimerspec()
        spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(deadline_ns, 1_000_000_000)
        if _libc().timerfd_settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) < 0:
            raise _ctypes_error("timerfd_settime")

    def drain(self) -> bool:
        """Consume the expirations; False if the timer had not expired (nothing to read)."""
        try:
            return len(os.read(self.fd, 8)) == 8
        except BlockingIOError:
            return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@functools.cache
def timerfd_available() -> bool:
    """Whether this system can create a CLOCK_REALTIME timerfd (Linux)."""
    try:
        _Timerfd().close()
    except (OSError, AttributeError):
        return False
    return True


_slack = threading.local()


def lower_timer_slack(slack_ns: int = 1_000) -> bool:
    """Set this thread's timer slack to ``slack_ns`` (once per thread; best effort).

    The default slack of 50 us lets the kernel coalesce our wake-ups that much late.
    """
    if getattr(_slack, "done", False):
        return bool(_slack.ok)
    _slack.done = True
    try:
        _slack.ok = _libc().prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(slack_ns), 0, 0, 0) == 0
    except (OSError, AttributeError):
        _slack.ok = False
    return bool(_slack.ok)


def _wake(fut: asyncio.Future[None], timer: _Timerfd) -> None:
    # Only a real expiration ends the wait: a spurious readiness would start the spin early.
    if timer.drain() and not fut.done():
        fut.set_result(None)


def _release(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class PreciseWait:
    """Await absolute CLOCK_REALTIME deadlines (UNIX ns) with microsecond lateness.

    Use from one event loop at a time. ``spin_ns`` is both the busy-wait per deadline and
    what :attr:`spin_total_ns` accounts. ``use_timerfd=False`` (or no timerfd on this system)
    sleeps with asyncio until 1.5 ms before the deadline and spins from there.

    Why not ``asyncio.sleep``: asyncio and uvloop round their epoll timeouts *up* to whole
    milliseconds, so a sleep ends up to ~1 ms late, a tenth of a 10 ms cycle. :class:`PreciseWait`
    arms a timerfd (a kernel hrtimer, no rounding) a little before the deadline, lets the loop
    wait for it like any other file descriptor (so asyncio and uvloop both work), then spins on
    the clock for the last ``spin_ns``.
    """

    def __init__(self, *, spin_ns: int = 200_000, use_timerfd: bool = True) -> None:
        if spin_ns < 0:
            raise ValueError(f"spin_ns: expected >= 0; got {spin_ns}")
        self.spin_ns = spin_ns
        #: CPU time spent spinning (thread CPU clock), all waits together.
        self.spin_total_ns = 0
        self.waits = 0
        self._timer = _Timerfd() if use_timerfd and timerfd_available() else None
        self.mode: WaitMode = "timerfd" if self._timer is not None else "sleep"

    @property
    def fd(self) -> int | None:
        """The timerfd, or None in sleep mode or once closed."""
        return self._timer.fd if self._timer is not None and self._timer.fd >= 0 else None

    async def wait_until(self, deadline_ns: int) -> int:
        """Return at ``deadline_ns`` or just after; the result is ``time.time_ns()`` then.

        Always yields to the loop at least once, even for a deadline already past, so a
        caller that is always late cannot starve the other tasks.
        """
        lower_timer_slack()
        self.waits += 1
        now = time.time_ns()
        # The deadline is on CLOCK_REALTIME; if the clock steps back meanwhile, it moves away
        # by the size of the step. The monotonic clock bounds the wait to what it was when
        # it began (plus a little): the caller then sees the clock short of the deadline.
        mono_end = time.monotonic_ns() + max(0, deadline_ns - now) + _STEP_MARGIN_NS
        if self._timer is not None and self._timer.fd >= 0:
            wake_ns = deadline_ns - self.spin_ns
            if now < wake_ns:
                await self._wait_fd(wake_ns, (wake_ns - now + _STEP_MARGIN_NS) / 1e9)
            else:
                await asyncio.sleep(0)
        else:
            ahead_ns = deadline_ns - now - max(self.spin_ns, _SLEEP_MARGIN_NS)
            await asyncio.sleep(ahead_ns / 1e9 if ahead_ns > 0 else 0)
        # CPU time, not wall time: a spin the kernel preempts burns nothing meanwhile.
        cpu0 = time.thread_time_ns()
        now = time.time_ns()
        while now < deadline_ns and time.monotonic_ns() < mono_end:
            now = time.time_ns()
        self.spin_total_ns += time.thread_time_ns() - cpu0
        return now

    async def _wait_fd(self, wake_ns: int, backstop_s: float) -> None:
        assert self._timer is not None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._timer.drain()
        self._timer.arm(wake_ns)
        loop.add_reader(self._timer.fd, _wake, fut, self._timer)
        backstop = loop.call_later(backstop_s, _release, fut)
        try:
            await fut
        finally:
            backstop.cancel()
            loop.remove_reader(self._timer.fd)

    def close(self) -> None:
        """Close the timerfd (idempotent); later waits fall back to sleeping."""
        if self._timer is not None:
            self._timer.close()
        self.mode = "sleep"

    def __enter__(self) -> PreciseWait:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# -- statistics ------------------------------------------------------------------------------


def _percentile(values: deque[int], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no samples."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


@dataclass(slots=True)
class EntryStats:
    openings: int = 0
    missed: int = 0
    lateness_ns: deque[int] = field(default_factory=lambda: deque(maxlen=SAMPLES))


@dataclass(slots=True)
class StageStats:
    runs: int = 0
    overruns: int = 0
    skipped: int = 0
    busy_ns: deque[int] = field(default_factory=lambda: deque(maxlen=SAMPLES))


@dataclass(slots=True)
class GateStats:
    """Counters of one scheduler. ``entries`` holds only the entries with a stage gate
    (the others are not waited for); ``cycles`` counts the cycles the scheduler went
    through, missed openings included; ``spin_ns`` is CPU time spent spinning; ``clock_steps``
    counts wall-clock steps the scheduler resynced after."""

    wait_mode: WaitMode
    entries: dict[str, EntryStats]
    stages: dict[str, StageStats]
    cycles: int = 0
    spin_ns: int = 0
    #: Wall-clock steps (NTP/RTC corrections) the schedule was resynced after.
    clock_steps: int = 0
    started_ns: int | None = None

    def snapshot(self, now_ns: int) -> dict[str, Any]:
        """JSON-ready figures; ``spin_cpu_pct`` is the CPU time spent spinning over the wall
        time since start (the share of one core the precision costs)."""
        wall = now_ns - self.started_ns if self.started_ns is not None else 0
        return {
            "cycles": self.cycles,
            "clock_steps": self.clock_steps,
            "wait_mode": self.wait_mode,
            "spin_cpu_pct": round(100.0 * self.spin_ns / wall, 3) if wall > 0 else 0.0,
            "entries": {
                name: {
                    "openings": e.openings,
                    "missed": e.missed,
                    "lateness_us": {
                        "p50": round(_percentile(e.lateness_ns, 50) / 1e3, 1),
                        "p99": round(_percentile(e.lateness_ns, 99) / 1e3, 1),
                        "max": round(max(e.lateness_ns, default=0) / 1e3, 1),
                    },
                }
                for name, e in self.entries.items()
            },
            "stages": {
                name: {
                    "runs": s.runs,
                    "overruns": s.overruns,
                    "skipped": s.skipped,
                    "busy_us": {"p99": round(_percentile(s.busy_ns, 99) / 1e3, 1)},
                }
                for name, s in self.stages.items()
            },
        }

    def lateness_ns(self) -> list[int]:
        """Every lateness sample still kept, all entries together."""
        return [x for e in self.entries.values() for x in e.lateness_ns]


# -- the scheduler ---------------------------------------------------------------------------


class GateScheduler:
    """Open each stage's gate on time and call its handler inside the window.

    ``handlers`` maps stage names (a subset of :data:`~edge_agent.gcl.STAGES`) to sync
    callables taking the window's close time; a stage without a handler is not run. An
    exception from a handler ends :meth:`run` (handlers own their error policy).
    ``clock_ns`` must tick like CLOCK_REALTIME (it may be shifted: deadlines are
    translated); ``on_gate(entry_name, lateness_s)`` is called at every opening run.

    Policy when the loop falls behind: an opening whose window has already closed when the
    scheduler gets to it is counted as *missed* and skipped; nothing runs after its window, and
    there is no back-to-back catch-up. A stage whose handler returns after the close counts an
    *overrun*; a stage whose turn comes after the close (an earlier stage of the same entry
    overran) is *skipped*.
    """

    def __init__(
        self,
        gcl: GateControlList,
        handlers: Mapping[str, Callable[[int], object]],
        *,
        clock_ns: Callable[[], int] = time.time_ns,
        spin_ns: int | None = None,
        on_gate: Callable[[str, float], None] | None = None,
        use_timerfd: bool = True,
    ) -> None:
        unknown = sorted(set(handlers) - set(STAGES))
        if unknown:
            raise ValueError(
                f"handlers for unknown stages {', '.join(unknown)}; expected {', '.join(STAGES)}"
            )
        self.gcl = gcl
        self._handlers = dict(handlers)
        self._clock = clock_ns
        self._spin_ns = gcl.spin_ns if spin_ns is None else spin_ns
        self._on_gate = on_gate
        self._use_timerfd = use_timerfd and timerfd_available()
        self._stages = {e.name: e.stages for e in gcl.entries}
        self.stats = GateStats(
            wait_mode="timerfd" if self._use_timerfd else "sleep",
            entries={e.name: EntryStats() for e in gcl.entries if e.stages},
            stages={s: StageStats() for s in STAGES if gcl.gates_of(s)},
        )

    def snapshot(self) -> dict[str, Any]:
        return self.stats.snapshot(self._clock())

    async def run(self) -> None:  # noqa: PLR0915 - the scheduler's hot loop; every split is a call per gate opening
        """Run until cancelled."""
        gcl, stats, clock = self.gcl, self.stats, self._clock
        shifted = clock is not time.time_ns
        with PreciseWait(spin_ns=self._spin_ns, use_timerfd=self._use_timerfd) as waiter:
            if stats.started_ns is None:
                stats.started_ns = clock()
            cursor = clock()
            last_cycle: int | None = None
            skew = cursor - time.monotonic_ns()
            while True:
                now = clock()
                if abs(now - cursor) > gcl.cycle_ns:
                    # The cursor is more than a cycle from the clock: the wall clock stepped
                    # (NTP, RTC), or the loop stalled. Walking every opening in between would
                    # block the loop (a +1 day step is 8.6 M cycles), or, after a step back,
                    # wait out the step with every gate shut: resync to the entry open now.
                    cursor, last_cycle = self._resync(cursor, now, last_cycle)
                    new_skew = now - time.monotonic_ns()
                    if abs(new_skew - skew) > gcl.cycle_ns:
                        self._clock_stepped(new_skew - skew)
                    skew = new_skew
                else:
                    skew = now - time.monotonic_ns()
                open_ns, close_ns, entry = gcl.next_opening(cursor)
                # Entries tile the cycle: the next one opens when this one closes.
                cursor = close_ns
                stages = self._stages[entry.name]
                if not stages:
                    continue
                cycle = open_ns - entry.offset_ns
                if cycle != last_cycle:
                    stats.cycles += 1
                    last_cycle = cycle
                es = stats.entries[entry.name]
                if clock() >= close_ns:
                    es.missed += 1
                    continue
                deadline = open_ns - (clock() - time.time_ns()) if shifted else open_ns
                spun = waiter.spin_total_ns
                await waiter.wait_until(deadline)
                stats.spin_ns += waiter.spin_total_ns - spun
                now = clock()
                if now >= close_ns:
                    es.missed += 1
                    continue
                if now < open_ns:
                    # The wait ended before the opening by the clock: it stepped back while
                    # we waited. Look again from this opening (the top resyncs a big step).
                    cursor = open_ns
                    continue
                lateness = now - open_ns
                es.openings += 1
                es.lateness_ns.append(lateness)
                if self._on_gate is not None:
                    self._on_gate(entry.name, lateness / 1e9)
                for stage in stages:
                    handler = self._handlers.get(stage)
                    if handler is None:
                        continue
                    ss = stats.stages[stage]
                    t0 = clock()
                    if t0 >= close_ns:
                        ss.skipped += 1
                        continue
                    # Handlers are short and sync by contract (microseconds to a few ms of
                    # CPU); running them inline is what keeps them inside the window.
                    handler(close_ns)
                    t1 = clock()
                    ss.runs += 1
                    ss.busy_ns.append(t1 - t0)
                    if t1 > close_ns:
                        ss.overruns += 1

    def _resync(self, cursor: int, now: int, last_cycle: int | None) -> tuple[int, int | None]:
        """Move the cursor to the opening of the entry open at ``now``; the openings skipped
        on the way forward (ones that closed before ``now``) are counted missed, by
        arithmetic, not one by one. Returns the new cursor and ``last_cycle``."""
        gcl, stats = self.gcl, self.stats
        target, _, _ = gcl.current(now)
        if target > cursor:
            for entry in gcl.entries:
                es = stats.entries.get(entry.name)
                if es is None:
                    continue
                es.missed += _openings(
                    cursor, target, gcl.base_time_ns + entry.offset_ns, gcl.cycle_ns
                )
            first = gcl.cycle_start(cursor)
            if first == last_cycle:
                first += gcl.cycle_ns  # that cycle is counted already
            stats.cycles += max(0, (gcl.cycle_start(target) - first) // gcl.cycle_ns)
            last_cycle = gcl.cycle_start(target) - gcl.cycle_ns  # so its entries count it
        return target, last_cycle

    def _clock_stepped(self, step_ns: int) -> None:
        self.stats.clock_steps += 1
        log.warning(
            "wall clock stepped %+.3f s: gate schedule resynced to the clock (%d steps so far)",
            step_ns / 1e9,
            self.stats.clock_steps,
        )


def _openings(start_ns: int, end_ns: int, phase_ns: int, cycle_ns: int) -> int:
    """How many of ``phase_ns + k * cycle_ns`` (any integer ``k``) lie in ``[start, end)``."""
    return max(0, -((phase_ns - end_ns) // cycle_ns) - -((phase_ns - start_ns) // cycle_ns))


# -- sockets ---------------------------------------------------------------------------------


def set_socket_priority(sock: socket.socket, priority: int) -> None:
    """Set ``SO_PRIORITY`` (Linux): the priority taprio's ``map`` turns into a traffic class.

    Priorities above 6 need CAP_NET_ADMIN.
    """
    if not 0 <= priority <= 15:
        raise ValueError(f"priority: expected 0..15; got {priority}")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, priority)


def uplink_priority(gcl: GateControlList, class_name: str = "uplink") -> int:
    """The socket priority for the uplink's traffic class."""
    return gcl.priority(class_name)


__all__ = [
    "GateScheduler",
    "GateStats",
    "PreciseWait",
    "set_socket_priority",
    "timerfd_available",
    "uplink_priority",
]
