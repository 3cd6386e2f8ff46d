"""Perception cost: 16 signals at 100 Hz into 64-step windows, as the agent drives it.

Samples for ``--seconds`` of plant time are generated first (arrival jitter +-2 ms, one
signal at 10 Hz to exercise holding). The timed loop then does what the agent's perception
task does every 10 ms tick: push the samples that arrived in the tick, ``advance(now)``.
CPU time of that loop divided by the plant time it covered is the share of one core the
stage needs in real time. The bare baseline is the same loop appending samples to a list.

    python -m bench.perception [--quick] [--json]

Keys: signals, rate_hz, cpu_pct, windows_per_s (real time), max_windows_per_s (flat out),
bare_cpu_pct. Target: cpu_pct < 2.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from drivers.sample import Sample
from edge_agent.perception import Aligner, PerceptionSpec

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


def make_ticks(signals: int, rate_hz: float, seconds: float, seed: int) -> list[list[Sample]]:
    rng = random.Random(seed)
    period = int(1e9 / rate_hz)
    tick_ns = 10 * MS
    n_ticks = int(seconds * 1e9 / tick_ns)
    ticks: list[list[Sample]] = [[] for _ in range(n_ticks + 1)]
    names = [f"s{i:02d}" for i in range(signals)]
    for i, name in enumerate(names):
        step = period * (10 if i == signals - 1 else 1)
        t = T0
        while t < T0 + int(seconds * 1e9):
            arrival = t + rng.randint(-2 * MS, 2 * MS)
            k = max(0, (arrival - T0) // tick_ns)
            if k <= n_ticks:
                ticks[k].append(Sample(name, rng.gauss(0.0, 1.0), arrival))
            t += step
    return ticks


def run(signals: int, rate_hz: float, seconds: float) -> dict[str, float | int]:
    ticks = make_ticks(signals, rate_hz, seconds, seed=7)
    spec = PerceptionSpec(signals=tuple(f"s{i:02d}" for i in range(signals)), rate_hz=rate_hz)

    sink: list[Sample] = []
    c0 = time.process_time()
    for batch in ticks:
        sink.extend(batch)
    bare_cpu = time.process_time() - c0

    aligner = Aligner(spec)
    windows = 0
    c0 = time.process_time()
    for k, batch in enumerate(ticks):
        aligner.push_many(batch)
        windows += len(aligner.advance(T0 + (k + 1) * 10 * MS))
    cpu = time.process_time() - c0
    return {
        "signals": signals,
        "rate_hz": rate_hz,
        "seconds": seconds,
        "samples": sum(len(b) for b in ticks),
        "windows": windows,
        "cpu_pct": round(100.0 * cpu / seconds, 3),
        "bare_cpu_pct": round(100.0 * bare_cpu / seconds, 3),
        "windows_per_s": round(windows / seconds, 3),
        "max_windows_per_s": round(windows / cpu, 1) if cpu > 0 else 0.0,
        "late_dropped": aligner.stats.late_dropped,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="60 s of plant time instead of 600 s")
    ap.add_argument("--json", action="store_true", help="print the JSON result as the last line")
    ap.add_argument("--signals", type=int, default=16)
    ap.add_argument("--rate-hz", type=float, default=100.0)
    args = ap.parse_args()
    result = run(args.signals, args.rate_hz, 60.0 if args.quick else 600.0)
    print(
        f"perception: {result['signals']} signals @ {result['rate_hz']:g} Hz, "
        f"{result['seconds']:g} s of data, {result['samples']} samples, "
        f"{result['windows']} windows"
    )
    print(
        f"  cpu {result['cpu_pct']}% of one core in real time "
        f"(bare loop {result['bare_cpu_pct']}%), target < 2%"
    )
    print(
        f"  {result['windows_per_s']} windows/s real time, "
        f"{result['max_windows_per_s']} windows/s flat out"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
