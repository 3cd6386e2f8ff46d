"""What the slowest windows of a ``bench.e2e`` run waited for, from the agent's ``--trace``.

:func:`analyze` takes the trace file's object (:mod:`edge_agent.looptrace`) and the bench's
measured interval (UNIX ns) and returns the steady-state percentiles (windows decided in
the interval only: start-up is outside it) and, for the slowest 1 %, where their time went:

* ``schedule``: from the window's due instant to the first planned opening of a stage gate
  after it (the gate schedule's phase);
* ``missed``: from that opening to the planned opening of the gate that took it (openings
  the loop reached after they had closed, or where the window was not ready);
* ``gate_late``: from that planned opening to the loop running it: the loop was busy or
  not on a CPU; the sampler's stacks say what it was running;
* ``queued``: from that gate to the later one that decided it (memory or reasoning had
  no time left in the first);
* ``work_cpu`` / ``work_off_cpu``: from the deciding gate's start to the decision, split
  into the loop thread's CPU time and the rest (waiting for the GIL or for a core).

A window's cause is its largest part; a garbage collection overlapping the window is
named when it took more than half of the window's time.

    python -m bench.e2e_trace TRACE.json      # every window in the file
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

#: The slowest share of windows explained (at least one window).
SLOW_SHARE = 0.01
#: Slow windows listed one by one in the result.
LISTED = 5


def _pct(sorted_us: list[float], q: float) -> float | None:
    if not sorted_us:
        return None
    k = min(len(sorted_us) - 1, max(0, math.ceil(q * len(sorted_us)) - 1))
    return round(sorted_us[k], 1)


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def _parts(row: dict[str, int]) -> dict[str, float]:
    """A window's time split into its parts, µs."""
    due, first, opening = row["due_ns"], row["first_opening_ns"], row["opening_ns"]
    gate, deciding, decision = row["gate_ns"], row["decision_gate_ns"], row["decision_ns"]
    if not gate:  # the window was emitted before the trace knew a gate (start-up)
        return {"unknown": (decision - due) / 1e3}
    work = decision - deciding
    cpu = min(max(0, row["cpu_ns"]), work)
    return {
        "schedule": max(0, first - due) / 1e3,
        "missed": max(0, opening - max(first, due)) / 1e3,
        "gate_late": max(0, gate - max(opening, due)) / 1e3,
        "queued": max(0, deciding - gate) / 1e3,
        "work_cpu": cpu / 1e3,
        "work_off_cpu": (work - cpu) / 1e3,
    }


def analyze(
    doc: dict[str, Any], start_ns: int | None = None, end_ns: int | None = None
) -> dict[str, Any]:
    """Steady percentiles over ``[start_ns, end_ns]`` and the causes of the slowest windows."""
    fields = doc["fields"]
    rows = [dict(zip(fields, w, strict=True)) for w in doc["windows"]]
    lo = start_ns if start_ns is not None else -1
    hi = end_ns if end_ns is not None else 1 << 62
    rows = [r for r in rows if lo <= r["decision_ns"] <= hi]
    if not rows:
        return {"n": 0}
    for r in rows:
        r["e2e_us"] = (r["decision_ns"] - r["due_ns"]) / 1e3
    e2e = sorted(r["e2e_us"] for r in rows)
    slow = sorted(rows, key=lambda r: r["e2e_us"], reverse=True)[
        : max(1, round(len(rows) * SLOW_SHARE))
    ]
    stalls = {s["opening_ns"]: s for s in doc.get("stalls", [])}
    collections = doc.get("gc", [])
    causes: Counter[str] = Counter()
    held_by: Counter[str] = Counter()
    listed: list[dict[str, Any]] = []
    totals: Counter[str] = Counter()
    for r in slow:
        parts = _parts(r)
        totals.update(parts)
        gc_ns, gen = 0, -1
        for c in collections:
            o = _overlap(r["due_ns"], r["decision_ns"], c["start_ns"], c["start_ns"] + c["took_ns"])
            if o:
                gc_ns += o
                gen = max(gen, c["generation"])
        cause = max(parts, key=lambda k: parts[k])
        if gc_ns * 2 > (r["decision_ns"] - r["due_ns"]):
            cause = f"gc generation {gen}"
        # What the loop ran: before the gate it missed or came late to, inside it otherwise.
        at = r["first_opening_ns"] if cause == "missed" else r["opening_ns"]
        key = "before_gate" if cause in ("missed", "gate_late") else "in_gate"
        stall = stalls.get(at)
        top = None
        if stall is not None and stall.get(key):
            top = stall[key][0][0]
            held_by[f"{key}: {top}"] += 1
        causes[cause] += 1
        if len(listed) < LISTED:
            listed.append(
                {
                    "seq": r["seq"],
                    "e2e_us": round(r["e2e_us"], 1),
                    **{k: round(v, 1) for k, v in parts.items()},
                    "gc_us": round(gc_ns / 1e3, 1),
                    "loop_was_in": top,
                }
            )
    return {
        "n": len(rows),
        "p50_us": _pct(e2e, 0.50),
        "p99_us": _pct(e2e, 0.99),
        "p999_us": _pct(e2e, 0.999),
        "max_us": _pct(e2e, 1.0),
        "slow_n": len(slow),
        "slow_causes": dict(causes.most_common()),
        "slow_mean_parts_us": {k: round(v / len(slow), 1) for k, v in totals.items()},
        "slow_loop_held_by": held_by.most_common(5),
        "slowest": listed,
        "stalls": len(stalls),
        "gc_over_1ms": sum(1 for c in collections if c["took_ns"] > 1_000_000),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.e2e_trace", description=__doc__)
    ap.add_argument("path", type=Path, help="a file written by edge-agent run --trace")
    args = ap.parse_args(argv)
    print(json.dumps(analyze(json.loads(args.path.read_text())), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
