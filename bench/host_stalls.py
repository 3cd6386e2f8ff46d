"""How often the host stalls a runnable process: the noise floor beside a latency bench.

A probe process (default priority, nothing else to do) sleeps 1 ms in a loop and counts
the wake-ups that come more than :data:`STALL_MS` late. On a quiet machine that is close
to none; when the hypervisor steals the vCPU, or another job wants both cores, it rises,
and so does every latency the bench measures beside it. ``bench.e2e`` reads it over the
same interval as the agent (``host_stalls_per_s``), so a slow run can be told from our
own stalls.

    python -m bench.host_stalls [--seconds S]      # alone: stalls/s of this host now
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO

#: A wake-up this much later than asked counts as a stall (the agent's P99 target is 2 ms).
STALL_MS = 1.0
SLEEP_S = 0.001


@dataclass(frozen=True)
class Stalls:
    wakeups: int
    stalls: int
    worst_ms: float
    mono: float

    def rate_since(self, before: Stalls) -> float:
        """Stalls per second between ``before`` and this reading."""
        wall = self.mono - before.mono
        return (self.stalls - before.stalls) / wall if wall > 0 else float("nan")


def _probe(out: IO[str]) -> None:
    """The probe's loop; ``count`` on stdin prints the counts so far as one JSON line."""
    counts = {"wakeups": 0, "stalls": 0, "worst_ms": 0.0}
    lock = threading.Lock()

    def answer() -> None:
        for line in sys.stdin:
            if line.strip() == "count":
                with lock:
                    snap = dict(counts)
                print(json.dumps({**snap, "mono": time.monotonic()}), file=out, flush=True)

    threading.Thread(target=answer, daemon=True).start()
    limit = SLEEP_S + STALL_MS / 1000
    while True:
        t0 = time.monotonic()
        time.sleep(SLEEP_S)
        took = time.monotonic() - t0
        with lock:
            counts["wakeups"] += 1
            if took > limit:
                counts["stalls"] += 1
                counts["worst_ms"] = max(counts["worst_ms"], (took - SLEEP_S) * 1000)


class HostStallProbe:
    """The probe as a child process; :meth:`read` asks for its counts."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.host_stalls", "--probe"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def read(self) -> Stalls:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        d = json.loads(self.proc.stdout.readline())
        return Stalls(int(d["wakeups"]), int(d["stalls"]), float(d["worst_ms"]), d["mono"])

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.host_stalls", description=__doc__)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args(argv)
    if args.probe:
        _probe(sys.stdout)
        return
    probe = HostStallProbe()
    try:
        time.sleep(0.5)
        before = probe.read()
        time.sleep(args.seconds)
        after = probe.read()
    finally:
        probe.close()
    print(
        json.dumps(
            {
                "seconds": args.seconds,
                "host_stalls_per_s": round(after.rate_since(before), 2),
                "host_worst_stall_ms": round(after.worst_ms, 2),
                "wakeups": after.wakeups - before.wakeups,
            }
        )
    )


if __name__ == "__main__":
    main()
