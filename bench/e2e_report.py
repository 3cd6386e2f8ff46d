"""The table ``bench.e2e`` prints: each figure beside its target (keys: :mod:`bench.e2e`)."""

import math
from collections.abc import Callable, Mapping
from typing import Any

TARGET_P99_US = 2000.0
TARGET_P999_US = 5000.0
TARGET_CPU_PCT = 40.0
TARGET_CPU_VS_BARE = 1.5
TARGET_READY_S = 1.5


def _fmt(value: Any, spec: str = ".0f") -> str:
    if value is None:
        return "null"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return format(value, spec) if isinstance(value, int | float) else str(value)


def _verdict(value: Any, ok: Callable[[float], bool]) -> str:
    if value is None:
        return "n/a"
    return "ok" if ok(float(value)) else "MISS"


def report(fig: Mapping[str, Any], say: Callable[..., None]) -> None:
    rows: list[tuple[str, str, str, str]] = [
        ("e2e latency p50 µs", _fmt(fig["p50_us"]), "", ""),
        (
            "e2e latency p99 µs",
            _fmt(fig["p99_us"]),
            f"<= {TARGET_P99_US:,.0f}",
            _verdict(fig["p99_us"], lambda v: v <= TARGET_P99_US),
        ),
        (
            "e2e latency p99.9 µs",
            _fmt(fig["p999_us"]),
            f"<= {TARGET_P999_US:,.0f}",
            _verdict(fig["p999_us"], lambda v: v <= TARGET_P999_US),
        ),
        ("e2e latency max µs (n)", f"{_fmt(fig['e2e_max_us'])} ({_fmt(fig['e2e_n'])})", "", ""),
        (
            "agent CPU % of one core",
            _fmt(fig["cpu_pct"], ".1f"),
            f"< {TARGET_CPU_PCT:.0f}",
            _verdict(fig["cpu_pct"], lambda v: v < TARGET_CPU_PCT),
        ),
        ("bare baseline CPU %", _fmt(fig["bare_cpu_pct"], ".1f"), "", ""),
        (
            "agent CPU / bare CPU",
            _fmt(fig["cpu_vs_bare"], ".2f"),
            f"<= {TARGET_CPU_VS_BARE:g}",
            _verdict(fig["cpu_vs_bare"], lambda v: v <= TARGET_CPU_VS_BARE),
        ),
        (
            "host stalls/s > 1 ms (bare phase)",
            f"{_fmt(fig['host_stalls_per_s'], '.2f')} "
            f"({_fmt(fig['bare_host_stalls_per_s'], '.2f')})",
            "~0 when quiet",
            "",
        ),
        (
            "READY s (spawn -> READY=1)",
            _fmt(fig["ready_s"], ".3f"),
            f"<= {TARGET_READY_S:g}",
            _verdict(fig["ready_s"], lambda v: v <= TARGET_READY_S),
        ),
        ("windows / decisions", f"{_fmt(fig['windows'])} / {_fmt(fig['decisions'])}", "", ""),
        ("drops (all counters)", _fmt(fig["drops"]), "", ""),
        (
            "CAN frames/s received (sent)",
            f"{_fmt(fig['frames_per_s'])} ({_fmt(fig['sent_frames_per_s'])})",
            "",
            "",
        ),
        (
            "CAN frames lost (kernel drops)",
            f"{_fmt(fig['lost_frames'])} ({_fmt(fig['udp_kernel_drops'])})",
            "",
            "",
        ),
        (
            "Modbus reads/s (status)",
            f"{_fmt(fig['modbus_reads_per_s'], '.1f')} "
            f"({_fmt(fig['status_modbus_reads_per_s'], '.1f')})",
            "",
            "",
        ),
        ("Modbus late polls", _fmt(fig["modbus_late_polls"]), "", ""),
        (
            "bare: frames/s, reads/s",
            f"{_fmt(fig['bare_frames_per_s'])}, {_fmt(fig['bare_modbus_reads_per_s'], '.1f')}",
            "",
            "",
        ),
        ("event loop", _fmt(fig["loop"]), "", ""),
    ]
    width = max(len(r[0]) for r in rows)
    say(f"{'figure':<{width}}  {'value':>16}  {'target':>8}")
    for name, value, target, verdict in rows:
        say(f"{name:<{width}}  {value:>16}  {target:>8}  {verdict}".rstrip())
    nonzero = {k: v for k, v in fig["drops_detail"].items() if v}
    if nonzero:
        say("drops by counter: " + ", ".join(f"{k}={v}" for k, v in nonzero.items()))
    blocks = fig["modbus_reads_per_s_by_block"]
    if blocks:
        say("Modbus reads/s by block: " + ", ".join(f"{k} {v:g}" for k, v in blocks.items()))
    if fig["labels"]:
        say(f"model labels: {fig['labels']}")
    for key, who in (("cpu_by_thread_pct", "agent"), ("bare_cpu_by_thread_pct", "bare")):
        if fig.get(key):
            say(f"{who} CPU % by thread: " + ", ".join(f"{k} {v:g}" for k, v in fig[key].items()))
    trace = fig.get("trace")
    if trace and trace.get("n"):
        say(
            f"steady state ({trace['n']} windows decided in the measured interval): p50 "
            f"{_fmt(trace['p50_us'])}, p99 {_fmt(trace['p99_us'])}, p99.9 "
            f"{_fmt(trace['p999_us'])}, max {_fmt(trace['max_us'])} µs"
        )
        say(
            f"slowest {trace['slow_n']}: causes {trace['slow_causes']}; mean parts µs "
            f"{trace['slow_mean_parts_us']}"
        )
        for where, n in trace["slow_loop_held_by"]:
            say(f"  loop was in ({n}x): {where}")
    say(
        f"quiet run: {'yes' if fig['quiet'] else 'NO'} (load before {fig['load1_before']}, "
        f"bare-phase host stalls {fig['bare_host_stalls_per_s']}/s)"
    )
    for note in fig["notes"]:
        say(f"note: {note}")
