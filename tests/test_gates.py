"""The gate scheduler on the real clock: windows, overruns, stalls, lateness, spin, sockets.

Timing assertions are sized for a noisy 2-core VM: each checks a property that a broken
scheduler fails by a wide margin (a call outside its window, a missed opening run late,
millisecond lateness from plain asyncio sleeping), not a figure at the edge of the noise.
"""

import asyncio
import contextlib
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from edge_agent.gates import (
    GateScheduler,
    PreciseWait,
    set_socket_priority,
    timerfd_available,
    uplink_priority,
)
from edge_agent.gcl import STAGES, GateControlList, ScheduleSection

pytestmark = pytest.mark.peers

MS = 1_000_000
Call = tuple[str, int, int]  # (stage, called at, close_ns it was given)


def gcl_of(entries: list[dict[str, Any]], *, spin_us: int = 200) -> GateControlList:
    section = ScheduleSection.model_validate(
        {"cycle_us": 10_000, "spin_us": spin_us, "entries": entries}
    )
    return GateControlList.from_section(section)


def three_windows() -> GateControlList:
    return gcl_of(
        [
            {"name": "sense", "duration_us": 3_000, "gates": ["perception", "best_effort"]},
            {"name": "store", "duration_us": 3_000, "gates": ["memory"]},
            {"name": "think", "duration_us": 4_000, "gates": ["reasoning", "uplink"]},
        ]
    )


def recorder(calls: list[Call], clock: Callable[[], int] = time.time_ns) -> dict[str, Any]:
    def handler(stage: str) -> Callable[[int], None]:
        return lambda close_ns: calls.append((stage, clock(), close_ns))

    return {s: handler(s) for s in STAGES}


def collect_into(seen: list[tuple[str, float]]) -> Callable[[str, float], None]:
    return lambda name, late_s: seen.append((name, late_s))


async def run_for(
    sched: GateScheduler, seconds: float, during: Callable[[], Awaitable[None]] | None = None
) -> None:
    task = asyncio.create_task(sched.run(), name="gates")
    try:
        if during is not None:
            await during()
        await asyncio.sleep(seconds)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        elapsed.append(time.time_ns() - (sched.stats.started_ns or 0))


#: Wall time of each run_for() (it may overshoot its seconds on a busy machine).
elapsed: list[int] = []


def assert_inside_windows(gcl: GateControlList, calls: list[Call]) -> None:
    """Every call happened while its own stage's gate was open, in the window it was told."""
    for stage, at, close_ns in calls:
        open_ns, close, entry = gcl.current(at)
        assert stage in entry.gates, (stage, entry.name)
        assert close == close_ns, (stage, at - open_ns)


def run(coro: Coroutine[Any, Any, None], loop: str) -> None:
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(coro)


def timerfds_open() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[timerfd]":
                count += 1
    return count


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_handlers_run_inside_their_windows_in_pipeline_order(loop: str) -> None:
    gcl = three_windows()
    calls: list[Call] = []
    sched = GateScheduler(gcl, recorder(calls))
    before = timerfds_open()
    run(run_for(sched, 0.5), loop)
    assert timerfds_open() == before  # the scheduler's timerfd is closed when run() ends

    assert_inside_windows(gcl, calls)
    closes = [c for _, _, c in calls]
    assert closes == sorted(set(closes))  # one call per window, in time order
    snap = sched.snapshot()
    missed = sum(e["missed"] for e in snap["entries"].values())
    for stage in STAGES:
        # 50 cycles in 0.5 s; a busy neighbour may cost some (missed, never run late).
        assert 25 <= snap["stages"][stage]["runs"] <= 51
        assert snap["stages"][stage]["overruns"] == 0
    if missed == 0:
        order = [s for s, _, _ in calls]
        start = STAGES.index(order[0])
        assert order == [STAGES[(start + i) % 3] for i in range(len(order))]
    assert snap["wait_mode"] == ("timerfd" if timerfd_available() else "sleep")
    cycles = elapsed[-1] / (10 * MS)
    assert cycles - 1 <= snap["cycles"] <= cycles + 2
    assert snap["stages"]["memory"]["runs"] + snap["entries"]["store"]["missed"] >= 49


def test_a_shifted_clock_is_honoured() -> None:
    gcl = three_windows()
    shift = 3_700_000  # not a whole number of cycles: windows move against CLOCK_REALTIME

    def clock() -> int:
        return time.time_ns() + shift

    calls: list[Call] = []
    sched = GateScheduler(gcl, recorder(calls, clock), clock_ns=clock)
    asyncio.run(run_for(sched, 0.2))
    assert len(calls) >= 45
    assert_inside_windows(gcl, calls)


def test_a_slow_stage_counts_overruns() -> None:
    gcl = three_windows()
    calls: list[Call] = []
    handlers = recorder(calls)

    def slow_perception(close_ns: int) -> None:
        calls.append(("perception", time.time_ns(), close_ns))
        while time.time_ns() < close_ns + MS:
            time.sleep(0.0002)

    handlers["perception"] = slow_perception
    sched = GateScheduler(gcl, handlers)
    asyncio.run(run_for(sched, 0.3))
    snap = sched.snapshot()
    stages = snap["stages"]
    assert stages["perception"]["runs"] >= 20
    assert stages["perception"]["overruns"] == stages["perception"]["runs"]
    # memory opened while perception overran: it still ran, late but inside its own window.
    # Every cycle it ran or, on a machine too loaded to wake the loop within the store
    # window, that opening was missed (counted); perception's overrun never cost it a turn.
    missed = snap["entries"]["store"]["missed"]
    assert stages["memory"]["runs"] + missed >= stages["perception"]["runs"] - 1
    assert stages["memory"]["runs"] >= stages["perception"]["runs"] // 3
    assert stages["memory"]["overruns"] == 0
    assert_inside_windows(gcl, calls)


def test_a_stage_whose_turn_comes_after_the_close_is_skipped() -> None:
    gcl = gcl_of(
        [
            {"name": "front", "duration_us": 5_000, "gates": ["perception", "memory"]},
            {"name": "back", "duration_us": 5_000, "gates": ["reasoning", "uplink", "best_effort"]},
        ]
    )
    calls: list[Call] = []
    handlers = recorder(calls)

    def slow_perception(close_ns: int) -> None:
        while time.time_ns() < close_ns + 200_000:
            time.sleep(0.0002)

    handlers["perception"] = slow_perception
    sched = GateScheduler(gcl, handlers)
    asyncio.run(run_for(sched, 0.2))
    stages = sched.snapshot()["stages"]
    assert stages["perception"]["runs"] >= 15
    assert stages["memory"]["runs"] == 0
    assert stages["memory"]["skipped"] == stages["perception"]["runs"]
    assert all(stage != "memory" for stage, _, _ in calls)


def test_a_stalled_loop_misses_openings_and_does_not_run_them_late() -> None:
    gcl = three_windows()
    calls: list[Call] = []
    sched = GateScheduler(gcl, recorder(calls))
    stall: list[int] = []

    async def stall_the_loop() -> None:
        await asyncio.sleep(0.1)
        stall.append(time.time_ns())
        time.sleep(0.035)  # noqa: ASYNC251 -- a 35 ms hiccup (3.5 cycles) on purpose
        stall.append(time.time_ns())

    asyncio.run(run_for(sched, 0.1, during=stall_the_loop))
    stall_start, stall_end = stall
    entries = sched.snapshot()["entries"]
    missed = sum(e["missed"] for e in entries.values())
    # Every opening that closed during the stall is missed: at least 9 in 35 ms.
    assert missed >= 9, entries
    assert all(e["missed"] >= 2 for e in entries.values()), entries
    assert_inside_windows(gcl, calls)
    # Nothing ran after the stall for a window that closed during it (no catch-up).
    assert not [c for c in calls if c[1] >= stall_start and c[2] <= stall_end]
    after = [c for c in calls if c[1] >= stall_end]
    assert len(after) >= 20
    # The first call after the stall is in the window open when the loop came back.
    assert after[0][2] == gcl.current(after[0][1])[1]
    assert after[0][1] - stall_end < 4 * MS


@pytest.mark.parametrize("step_s", [-5, 86_400])
def test_a_wall_clock_step_resyncs_the_schedule(step_s: int) -> None:
    gcl = three_windows()
    shift = [0]

    def clock() -> int:
        return time.time_ns() + shift[0]

    calls: list[Call] = []
    sched = GateScheduler(gcl, recorder(calls, clock), clock_ns=clock)
    marks: list[int] = []
    lags: list[float] = []

    async def step_then_watch() -> None:
        await asyncio.sleep(0.2)
        missed_before = sum(e.missed for e in sched.stats.entries.values())
        marks.append(missed_before)
        shift[0] += step_s * 1_000_000_000  # NTP/RTC steps the wall clock
        marks.append(len(calls))
        for _ in range(20):  # how long the loop is kept from other tasks
            t0 = time.monotonic()
            await asyncio.sleep(0.02)
            lags.append(time.monotonic() - t0 - 0.02)

    asyncio.run(run_for(sched, 0.0, during=step_then_watch))
    missed_before, calls_at_step = marks
    after = calls[calls_at_step:]
    # The gates keep opening on the new clock: ~40 cycles x 3 stages in the 0.4 s after.
    assert len(after) >= 45, (len(after), sched.snapshot())
    assert_inside_windows(gcl, calls)
    assert max(lags) < 0.25, f"the loop was blocked {max(lags):.3f} s"
    assert sched.stats.clock_steps == 1
    missed = sum(e.missed for e in sched.stats.entries.values()) - missed_before
    if step_s > 0:
        # A day of openings skipped, counted without walking them: 3 entries x 8.64 M cycles.
        assert 3 * 8_640_000 - 10 <= missed <= 3 * 8_640_000 + 10, missed
        assert sched.stats.cycles >= 8_640_000
    else:
        # Back 5 s: nothing was skipped, so no 5 s of openings (1,500) may be counted as
        # missed; a loaded machine misses a few of the ~120 openings watched on its own.
        assert missed <= 120, missed


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_lateness_stays_far_below_a_millisecond_sleep(loop: str) -> None:
    # Up to three 1 s runs, for passing noise. A scheduler that waits with plain asyncio
    # sleeps is ~0.5-1 ms late at the median, so it fails every run: that is the behaviour
    # under test (the timerfd wait and the final spin). The tail is the machine's: with both
    # vCPUs busy, ~1-3 % of SCHED_OTHER wake-ups wait for the next tick (4 ms at HZ=250), so
    # the P99 is bench.gate's figure (target 200 µs), not an assertion here.
    runs: list[tuple[int, float, float]] = []
    for _ in range(3):
        gcl = three_windows()
        seen: list[tuple[str, float]] = []
        sched = GateScheduler(gcl, recorder([]), on_gate=collect_into(seen))
        run(run_for(sched, 1.0), loop)
        lateness_us = sorted(late * 1e6 for _, late in seen)
        assert lateness_us, "no opening ran in 1 s"
        assert min(lateness_us) >= 0  # never early
        snap = sched.snapshot()
        assert {name for name, _ in seen} == {"sense", "store", "think"}
        assert sum(e["openings"] for e in snap["entries"].values()) == len(seen)
        for figures in snap["entries"].values():
            late = figures["lateness_us"]
            assert late["p50"] <= late["p99"] <= late["max"]
        n = len(lateness_us)
        runs.append((n, lateness_us[n // 2], lateness_us[math.ceil(n * 0.99) - 1]))
        # 3 openings per 10 ms cycle: 300 in 1 s.
        if n >= 270 and runs[-1][1] < 200:
            break
    else:
        pytest.fail(f"(openings, p50 us, p99 us) of each run: {runs}")


def test_spin_time_is_accounted() -> None:
    gcl = three_windows()
    spin = 300_000
    sched = GateScheduler(gcl, recorder([]), spin_ns=spin)
    asyncio.run(run_for(sched, 0.5))
    snap = sched.snapshot()
    openings = sum(e["openings"] for e in snap["entries"].values())
    missed = sum(e["missed"] for e in snap["entries"].values())
    # A wait spins from its wake-up (>= deadline - spin_ns) until the clock passes the
    # deadline, so at most spin_ns + that opening's lateness; a missed opening may have
    # waited too (at most its window).
    late_ns = sum(sched.stats.lateness_ns())
    assert 0 < sched.stats.spin_ns <= (openings + missed) * spin + late_ns + missed * 4 * MS
    # Nominally at most 3 * 0.3 ms per 10 ms cycle: 9 %.
    assert 0 < snap["spin_cpu_pct"] <= 12
    assert snap["spin_cpu_pct"] == pytest.approx(100 * sched.stats.spin_ns / elapsed[-1], rel=0.05)


def test_precise_wait_never_returns_early_and_spins_at_most_spin_ns() -> None:
    spin = 300_000

    async def main(waiter: PreciseWait) -> list[int]:
        late = []
        for _ in range(20):
            offset = time.time_ns() - time.monotonic_ns()
            deadline = time.time_ns() + 3 * MS
            woke = await waiter.wait_until(deadline)
            # A wall clock stepped back during the wait (the VM's clock discipline on a
            # loaded host) ends the wait short on purpose (bounded by the monotonic clock):
            # such a wait says nothing about returning early, so it is left out.
            if abs(time.time_ns() - time.monotonic_ns() - offset) < 500_000:
                late.append(woke - deadline)
        return late

    with PreciseWait(spin_ns=spin) as waiter:
        late = asyncio.run(main(waiter))
        assert waiter.mode == "timerfd"
        assert waiter.waits == 20
        assert len(late) >= 15, "the wall clock stepped during most waits"
        assert min(late) >= 0
        # Spinning is thread CPU time, so it cannot exceed the wall time from wake-up to
        # return; how much of the spin window is left after a late wake-up depends on the
        # machine's load, so the lower bound is only that it spun at all.
        assert 0 < waiter.spin_total_ns <= 20 * spin + sum(late)
    with PreciseWait(spin_ns=spin, use_timerfd=False) as sleeper:
        late = asyncio.run(main(sleeper))
        assert sleeper.mode == "sleep"
        assert sleeper.fd is None
        assert len(late) >= 15, "the wall clock stepped during most waits"
        assert min(late) >= 0
        assert sleeper.spin_total_ns > 0


def test_precise_wait_closes_its_timerfd() -> None:
    waiter = PreciseWait()
    fd = waiter.fd
    assert fd is not None
    assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[timerfd]"
    waiter.close()
    assert waiter.fd is None
    assert waiter.mode == "sleep"
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)
    waiter.close()  # idempotent

    async def after_close() -> int:
        deadline = time.time_ns() + 2 * MS
        return await waiter.wait_until(deadline) - deadline

    assert asyncio.run(after_close()) >= 0  # falls back to sleeping


def test_a_past_deadline_still_yields_to_the_loop() -> None:
    async def main() -> bool:
        ran = asyncio.Event()
        asyncio.get_running_loop().call_soon(ran.set)
        with PreciseWait() as waiter:
            await waiter.wait_until(time.time_ns() - MS)
        return ran.is_set()

    assert asyncio.run(main())


def test_handlers_for_unknown_stages_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown stages uplink"):
        GateScheduler(three_windows(), {"uplink": lambda close_ns: None})


def test_so_priority_on_a_real_udp_socket() -> None:
    gcl = GateControlList.from_section(ScheduleSection())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        set_socket_priority(sock, uplink_priority(gcl))
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY) == 3
        set_socket_priority(sock, 0)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY) == 0
        with pytest.raises(ValueError, match=r"expected 0\.\.15; got 16"):
            set_socket_priority(sock, 16)
    with pytest.raises(KeyError):
        uplink_priority(gcl, "video")
