"""Perception cost: 16 signals at 100 Hz into 64-step windows, as the agent drives it.

Samples for ``--seconds`` of plant time are generated first (arrival jitter +-2 ms, one
signal at a tenth of the grid rate to exercise holding). The timed loop then does what the
agent's perception task does every 10 ms tick: push the samples that arrived in the tick,
``advance(now)``. CPU time of that loop divided by the plant time it covered is the share of
one core the stage needs in real time. The bare baseline is the same loop appending samples
to a list.

A second pass over the same ticks times every ``push_many`` and every ``advance`` that
emitted a window on the wall clock, for the per-window latency the agent's budget sees
(the first pass stays untimed so ``cpu_pct`` is not inflated by the clock reads).

    python -m bench.perception [--quick] [--json] [--signals N] [--hop N] [--rate S]

``--rate S`` spreads S samples/s over the signals (the slow one keeps a tenth of the grid
rate, the others share the rest equally) instead of every signal at the grid rate. The
agent's case: ``--hop 1 --signals 16 --rate 8000``.

Keys: signals, rate_hz, hop, sample_rate, cpu_pct, windows_per_s (real time),
max_windows_per_s (flat out), bare_cpu_pct, advance_p50_us / advance_p99_us (one
``advance`` that emitted windows), push_per_sample_us. Target: cpu_pct < 2.
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


def make_ticks(
    signals: int, rate_hz: float, seconds: float, seed: int, sample_rate: float | None = None
) -> list[list[Sample]]:
    rng = random.Random(seed)
    period = int(1e9 / rate_hz)
    tick_ns = 10 * MS
    n_ticks = int(seconds * 1e9 / tick_ns)
    ticks: list[list[Sample]] = [[] for _ in range(n_ticks + 1)]
    names = [f"s{i:02d}" for i in range(signals)]
    slow = period * 10  # the last signal, to exercise holding
    if sample_rate is None:
        fast = period
    elif signals == 1:
        fast = slow = int(1e9 / sample_rate)
    else:
        fast = int(1e9 * (signals - 1) / max(sample_rate - 1e9 / slow, 1.0))
    for i, name in enumerate(names):
        step = slow if i == signals - 1 else fast
        t = T0
        while t < T0 + int(seconds * 1e9):
            arrival = t + rng.randint(-2 * MS, 2 * MS)
            k = max(0, (arrival - T0) // tick_ns)
            if k <= n_ticks:
                ticks[k].append(Sample(name, rng.gauss(0.0, 1.0), arrival))
            t += step
    return ticks


def _percentile(sorted_ns: list[int], q: float) -> float:
    if not sorted_ns:
        return 0.0
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1000.0


def run(
    signals: int,
    rate_hz: float,
    seconds: float,
    hop: int | None = None,
    sample_rate: float | None = None,
) -> dict[str, float | int]:
    ticks = make_ticks(signals, rate_hz, seconds, seed=7, sample_rate=sample_rate)
    names = tuple(f"s{i:02d}" for i in range(signals))
    spec = (
        PerceptionSpec(signals=names, rate_hz=rate_hz)
        if hop is None
        else PerceptionSpec(signals=names, rate_hz=rate_hz, hop=hop)
    )

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

    timed = Aligner(spec)
    clock = time.perf_counter_ns
    push_ns = 0
    advance_ns: list[int] = []
    for k, batch in enumerate(ticks):
        t0 = clock()
        timed.push_many(batch)
        t1 = clock()
        out = timed.advance(T0 + (k + 1) * 10 * MS)
        t2 = clock()
        push_ns += t1 - t0
        if out:
            advance_ns.append(t2 - t1)
    advance_ns.sort()
    samples = sum(len(b) for b in ticks)
    return {
        "signals": signals,
        "rate_hz": rate_hz,
        "hop": spec.hop,
        "sample_rate": round(samples / seconds, 1),
        "seconds": seconds,
        "samples": samples,
        "windows": windows,
        "cpu_pct": round(100.0 * cpu / seconds, 3),
        "bare_cpu_pct": round(100.0 * bare_cpu / seconds, 3),
        "windows_per_s": round(windows / seconds, 3),
        "max_windows_per_s": round(windows / cpu, 1) if cpu > 0 else 0.0,
        "late_dropped": aligner.stats.late_dropped,
        "advance_p50_us": round(_percentile(advance_ns, 0.50), 1),
        "advance_p99_us": round(_percentile(advance_ns, 0.99), 1),
        "push_per_sample_us": round(push_ns / 1000.0 / samples, 3) if samples else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="60 s of plant time instead of 600 s")
    ap.add_argument("--json", action="store_true", help="print the JSON result as the last line")
    ap.add_argument("--signals", type=int, default=16)
    ap.add_argument("--rate-hz", type=float, default=100.0, help="grid rate")
    ap.add_argument("--hop", type=int, default=None, help="grid steps between windows")
    ap.add_argument(
        "--rate", type=float, default=None, help="samples/s over all signals (default: grid rate)"
    )
    args = ap.parse_args()
    result = run(
        args.signals,
        args.rate_hz,
        60.0 if args.quick else 600.0,
        hop=args.hop,
        sample_rate=args.rate,
    )
    print(
        f"perception: {result['signals']} signals @ {result['rate_hz']:g} Hz, "
        f"hop {result['hop']}, {result['seconds']:g} s of data, {result['samples']} samples "
        f"({result['sample_rate']:g}/s), {result['windows']} windows"
    )
    print(
        f"  cpu {result['cpu_pct']}% of one core in real time "
        f"(bare loop {result['bare_cpu_pct']}%), target < 2%"
    )
    print(
        f"  {result['windows_per_s']} windows/s real time, "
        f"{result['max_windows_per_s']} windows/s flat out"
    )
    print(
        f"  advance p50 {result['advance_p50_us']} us, p99 {result['advance_p99_us']} us; "
        f"push {result['push_per_sample_us']} us/sample"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
