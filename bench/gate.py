"""Gate scheduler lateness: how late each stage window really starts, against a bare loop.

A 10 ms cycle with three entries (perception 3 ms, memory 3 ms, reasoning 4 ms); each
handler does ~100 us of real numpy work on a 64x16 window. The scheduler under test waits
with :class:`edge_agent.gates.PreciseWait` (timerfd armed ``spin_us`` early, then a spin);
the baseline, in the same run, is a bare loop that ``await asyncio.sleep``\\ s until each
opening. Lateness is (time the stage starts) - (window opening), in microseconds.

    python -m bench.gate [--quick] [--json] [--uvloop]

Keys: late_p50_us, late_p99_us, late_max_us, spin_cpu_pct, bare_late_p50_us,
bare_late_p99_us, bare_late_max_us, cycles, missed, overruns, cpu_pct, bare_cpu_pct,
work_us, loop, wait_mode, load_1m. Target: late_p99_us <= 200 with spin_cpu_pct <= 10.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from edge_agent.gates import GateScheduler
from edge_agent.gcl import STAGES, GateControlList, ScheduleSection

WORK_US = 100.0


def schedule(spin_us: int) -> GateControlList:
    section = ScheduleSection.model_validate(
        {
            "cycle_us": 10_000,
            "spin_us": spin_us,
            "entries": [
                {
                    "name": "perception",
                    "duration_us": 3_000,
                    "gates": ["perception", "best_effort"],
                },
                {"name": "memory", "duration_us": 3_000, "gates": ["memory"]},
                {"name": "reasoning", "duration_us": 4_000, "gates": ["reasoning", "uplink"]},
            ],
        }
    )
    return GateControlList.from_section(section)


def make_work() -> tuple[Callable[[], float], float]:
    """A stage body of about WORK_US of numpy on a 64x16 window, and its measured cost."""
    rng = np.random.default_rng(7)
    window = rng.standard_normal((64, 16))
    weights = rng.standard_normal((16, 16))

    def once(reps: int) -> float:
        acc = 0.0
        for _ in range(reps):
            h = np.tanh(window @ weights)
            acc += float(np.abs(h - h.mean(axis=0)).sum())
        return acc

    once(200)  # warm up: the first numpy calls pay for dispatch caches
    t0 = time.perf_counter_ns()
    once(200)
    per_rep_us = (time.perf_counter_ns() - t0) / 1e3 / 200
    reps = max(1, round(WORK_US / per_rep_us))
    costs = []
    for _ in range(50):
        t0 = time.perf_counter_ns()
        once(reps)
        costs.append((time.perf_counter_ns() - t0) / 1e3)
    return (lambda: once(reps)), sorted(costs)[len(costs) // 2]


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


async def gated(gcl: GateControlList, work: Callable[[], float], seconds: float) -> dict[str, Any]:
    late_us: list[float] = []
    handlers = {s: (lambda close_ns: work()) for s in STAGES}
    sched = GateScheduler(gcl, handlers, on_gate=lambda _name, late_s: late_us.append(late_s * 1e6))
    c0 = time.process_time()
    task = asyncio.create_task(sched.run(), name="gates")
    await asyncio.sleep(seconds)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    cpu = time.process_time() - c0
    snap = sched.snapshot()
    return {
        "late_us": late_us,
        "snapshot": snap,
        "cpu_pct": 100.0 * cpu / seconds,
    }


async def bare(gcl: GateControlList, work: Callable[[], float], seconds: float) -> dict[str, Any]:
    """The baseline: await asyncio.sleep until each opening, no timerfd, no spin."""
    late_us: list[float] = []
    missed = 0
    c0 = time.process_time()
    cursor = time.time_ns()
    end = cursor + int(seconds * 1e9)
    while cursor < end:
        open_ns, close_ns, entry = gcl.next_opening(cursor)
        cursor = close_ns
        if not entry.stages:
            continue
        await asyncio.sleep(max(0, open_ns - time.time_ns()) / 1e9)
        now = time.time_ns()
        if now >= close_ns:
            missed += 1
            continue
        late_us.append((now - open_ns) / 1e3)
        for _ in entry.stages:
            work()
    return {
        "late_us": late_us,
        "missed": missed,
        "cpu_pct": 100.0 * (time.process_time() - c0) / seconds,
    }


async def both(spin_us: int, seconds: float) -> dict[str, Any]:
    gcl = schedule(spin_us)
    work, work_us = make_work()
    g = await gated(gcl, work, seconds)
    b = await bare(gcl, work, seconds)
    snap = g["snapshot"]
    return {
        "seconds": seconds,
        "spin_us": spin_us,
        "work_us": round(work_us, 1),
        "cycles": snap["cycles"],
        "wait_mode": snap["wait_mode"],
        "late_p50_us": round(pct(g["late_us"], 50), 1),
        "late_p99_us": round(pct(g["late_us"], 99), 1),
        "late_max_us": round(max(g["late_us"], default=0.0), 1),
        "spin_cpu_pct": snap["spin_cpu_pct"],
        "cpu_pct": round(g["cpu_pct"], 2),
        "missed": sum(e["missed"] for e in snap["entries"].values()),
        "overruns": sum(s["overruns"] for s in snap["stages"].values()),
        "bare_late_p50_us": round(pct(b["late_us"], 50), 1),
        "bare_late_p99_us": round(pct(b["late_us"], 99), 1),
        "bare_late_max_us": round(max(b["late_us"], default=0.0), 1),
        "bare_missed": b["missed"],
        "bare_cpu_pct": round(b["cpu_pct"], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~3 s in all instead of ~20 s")
    ap.add_argument("--json", action="store_true", help="print the JSON result as the last line")
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop instead of asyncio")
    ap.add_argument("--spin-us", type=int, default=200)
    args = ap.parse_args()
    seconds = 1.5 if args.quick else 10.0
    loop = "uvloop" if args.uvloop else "asyncio"
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    if args.uvloop:
        import uvloop  # noqa: PLC0415 -- only when asked for

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        result = {**runner.run(both(args.spin_us, seconds)), "loop": loop}
    # Neighbours on a small box show up in the tail; the load says how busy it was.
    result["load_1m"] = round(os.getloadavg()[0], 2)

    print(
        f"gate: 10 ms cycle, 3 stage windows, {result['work_us']} us of work per stage, "
        f"{loop}, {seconds:g} s per run, {result['cycles']} cycles, load {result['load_1m']}"
    )
    print(f"  {'lateness (us)':<30}{'p50':>9}{'p99':>9}{'max':>10}{'cpu %':>8}{'missed':>8}")
    print(
        f"  {'gates (' + result['wait_mode'] + ' + spin)':<30}{result['late_p50_us']:>9}"
        f"{result['late_p99_us']:>9}{result['late_max_us']:>10}{result['cpu_pct']:>8}"
        f"{result['missed']:>8}"
    )
    print(
        f"  {'bare asyncio.sleep':<30}{result['bare_late_p50_us']:>9}"
        f"{result['bare_late_p99_us']:>9}{result['bare_late_max_us']:>10}"
        f"{result['bare_cpu_pct']:>8}{result['bare_missed']:>8}"
    )
    ok = result["late_p99_us"] <= 200 and result["spin_cpu_pct"] <= 10
    print(
        f"  spin {result['spin_cpu_pct']}% of one core (spin_us={result['spin_us']}); "
        f"target p99 <= 200 us with spin <= 10%: {'met' if ok else 'NOT met'}"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
