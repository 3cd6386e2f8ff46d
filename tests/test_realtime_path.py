"""The real-time path: catching up after a stall, the window trace, named threads.

The agent is built from the example config with the committed model and a real SQLite
memory store; its gate handlers are driven with an injected clock, so what a stall
leaves behind is exact, not timed. ``edge-agent run --trace`` runs as a process against
the plant simulator.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from bench.e2e_trace import analyze
from bench.profile import summarize
from drivers.osthread import name_os_thread
from drivers.sample import Sample
from edge_agent.compose import build_agent
from edge_agent.config import parse_config
from tests.support.agent import example_text
from tests.support.ports import free_port

ROOT = Path(__file__).parents[1]
STEP_NS = 10_000_000  # the example's 100 Hz grid


class Clock:
    def __init__(self, t_ns: int) -> None:
        self.t_ns = t_ns

    def __call__(self) -> int:
        return self.t_ns


def _samples(signals: list[str], start_ns: int, points: int) -> list[Sample]:
    return [
        Sample(name, 100.0 + (i % 7) + k, start_ns + i * STEP_NS)
        for i in range(points)
        for k, name in enumerate(signals)
    ]


def test_after_a_stall_one_open_gate_decides_every_window_it_has_time_for() -> None:
    """A stall of 60 ms leaves 6 windows due at once; before, memory passed on only what
    reasoning's queue of 2 held and the backlog drained one window per cycle."""
    cfg = parse_config(
        example_text().replace("# hop = 64 ", "hop = 1 #"), base_dir=ROOT / "examples"
    )
    start = 1_800_000_000 * 10**9
    clock = Clock(start)
    agent = build_agent(cfg, clock_ns=clock)
    signals = list(cfg.perception.signals)
    lateness = round(cfg.perception.lateness_ms * 1e6)
    # 64 points make the first window; then 6 more points: 7 windows, all due once the
    # clock is past the last point plus the lateness.
    agent.buffer.put_many(_samples(signals, start, 70))
    clock.t_ns = start + 69 * STEP_NS + lateness + 1
    close = clock.t_ns + 6_000_000  # the compute entry's 6 ms; the clock stands still

    async def one_opening() -> None:
        assert agent.memory is not None
        async with agent.memory:
            agent._gate_perception(close)
            agent._gate_memory(close)
            agent._gate_reasoning(close)

    asyncio.run(one_opening())
    assert agent.report.windows == 7
    assert agent.report.decisions == 7, "windows left for a later gate after one opening"
    assert len(agent.memory_queue) == 0
    assert len(agent.reasoning_queue) == 0


def test_with_the_gate_closed_the_backlog_waits_for_the_next_opening() -> None:
    cfg = parse_config(
        example_text().replace("# hop = 64 ", "hop = 1 #"), base_dir=ROOT / "examples"
    )
    start = 1_800_000_000 * 10**9
    clock = Clock(start)
    agent = build_agent(cfg, clock_ns=clock)
    lateness = round(cfg.perception.lateness_ms * 1e6)
    agent.buffer.put_many(_samples(list(cfg.perception.signals), start, 70))
    clock.t_ns = start + 69 * STEP_NS + lateness + 1

    async def one_opening() -> None:
        assert agent.memory is not None
        async with agent.memory:
            agent._gate_perception(clock.t_ns + 6_000_000)
            # The entry closed while perception ran: memory and reasoning take no more.
            agent._gate_memory(clock.t_ns)
            agent._gate_reasoning(clock.t_ns)

    asyncio.run(one_opening())
    assert agent.report.decisions == 0
    assert len(agent.memory_queue) == 7


def test_a_windows_latency_runs_to_its_decision_not_to_when_reasoning_took_it_up() -> None:
    """The e2e latency (status, metrics, trace) ends when the decision exists: a reasoning
    stage that takes 6 ms by the agent's clock adds those 6 ms (before, it added nothing:
    the latency stopped at the decision's t_ns, taken before the stage ran)."""
    cfg = parse_config(example_text(), base_dir=ROOT / "examples")
    start = 1_800_000_000 * 10**9
    clock = Clock(start)
    agent = build_agent(cfg, clock_ns=clock)
    assert agent.stage is not None

    def reasoning_takes_3_ms_a_look() -> int:  # the stage reads its timer twice
        clock.t_ns += 3_000_000
        return clock.t_ns

    agent.stage.timer = reasoning_takes_3_ms_a_look
    lateness = round(cfg.perception.lateness_ms * 1e6)
    agent.buffer.put_many(_samples(list(cfg.perception.signals), start, 64))
    due = start + 63 * STEP_NS + lateness
    clock.t_ns = opened = due + 1_000

    async def one_opening() -> None:
        assert agent.memory is not None
        async with agent.memory:
            agent._gate_perception(opened + 60_000_000)
            agent._gate_memory(opened + 60_000_000)
            agent._gate_reasoning(opened + 60_000_000)

    asyncio.run(one_opening())
    assert agent.report.decisions == 1
    assert list(agent.e2e_us) == [pytest.approx((opened + 6_000_000 - due) / 1000.0)]


# -- edge-agent run --trace ---------------------------------------------------------------------


def _config_file(tmp_path: Path) -> Path:
    port = free_port()
    text = example_text().replace("port = 15020", f"port = {port}")
    text = text.replace('channel = "edgefleet-demo"', f'channel = "trace-{port}"')
    text = text.replace("# hop = 64 ", "hop = 4 #")
    text = text.replace(
        'dbc = "../drivers/sim/motor_drive.dbc"', f'dbc = "{ROOT}/drivers/sim/motor_drive.dbc"'
    )
    cfg = tmp_path / "agent.toml"
    cfg.write_text(text)
    return cfg


@pytest.mark.peers
def test_run_with_trace_writes_every_window_path_and_the_bench_reads_it(tmp_path: Path) -> None:
    cfg = _config_file(tmp_path)
    trace = tmp_path / "trace.json"
    argv = [sys.executable, "-m", "edge_agent.cli", "run", "-c", str(cfg), "--simulate"]
    proc = subprocess.run(
        [*argv, "--duration", "4", "--status-json", "--trace", str(trace)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    status = json.loads(proc.stdout)
    doc: dict[str, Any] = json.loads(trace.read_text())
    rows = [dict(zip(doc["fields"], w, strict=True)) for w in doc["windows"]]
    assert len(rows) == status["reasoning"]["decisions"] > 0
    for r in rows:
        # Each window: due, then its gate, then emitted, then decided, in that order.
        assert r["gate_ns"] <= r["emitted_ns"] <= r["decision_ns"]
        assert r["due_ns"] <= r["emitted_ns"]
        assert r["opening_ns"] <= r["gate_ns"]
        assert r["due_ns"] <= r["first_opening_ns"]
        assert r["gate_ns"] <= r["decision_gate_ns"] <= r["decision_ns"]
        assert r["cpu_ns"] >= 0
    got = analyze(doc)
    assert got["n"] == len(rows)
    assert got["slow_n"] >= 1
    assert sum(got["slow_causes"].values()) == got["slow_n"]
    e2e = sorted((r["decision_ns"] - r["due_ns"]) / 1e3 for r in rows)
    assert got["max_us"] == pytest.approx(e2e[-1], abs=0.1)


def test_run_with_trace_into_a_missing_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    cfg = _config_file(tmp_path)
    nowhere = tmp_path / "nowhere" / "trace.json"
    argv = [sys.executable, "-m", "edge_agent.cli", "run", "-c", str(cfg), "--duration", "1"]
    proc = subprocess.run(
        [*argv, "--trace", str(nowhere)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"edge-agent run: --trace {nowhere}: no folder {nowhere.parent}"


# -- what the bench makes of a trace and a profile (pure) ----------------------------------------


def _doc(rows: list[tuple[int, ...]], **extra: Any) -> dict[str, Any]:
    from edge_agent.looptrace import WINDOW_FIELDS  # noqa: PLC0415

    return {"fields": list(WINDOW_FIELDS), "windows": rows, "stalls": [], "gc": [], **extra}


def test_trace_analysis_names_the_part_that_made_a_window_slow() -> None:
    ms = 1_000_000
    t = [i * 10 * ms for i in range(1, 199)]
    fast = [(i, d, d, d, d + 10_000, d + 50_000, d + 10_000, d + 500_000, 400_000)
            for i, d in enumerate(t, 1)]  # fmt: skip
    base = 2000 * ms
    # Due at base; the first opening at base, missed; taken by the next one 10 ms later,
    # which started 3 ms late; decided 1 ms after that gate started.
    late = (199, base, base, base + 10 * ms, base + 13 * ms, base + 13 * ms + 100_000,
            base + 13 * ms, base + 14 * ms, 900_000)  # fmt: skip
    stall = {
        "opening_ns": base,
        "before_gate": [["flush (telemetry.py:10)", 12]],
        "in_gate": [],
    }
    got = analyze(_doc([*fast, late], stalls=[stall]))
    assert got["n"] == 199
    assert got["slow_n"] == 2
    worst = got["slowest"][0]
    assert worst["seq"] == 199
    assert worst["e2e_us"] == pytest.approx(14_000.0)
    assert worst["missed"] == pytest.approx(10_000.0)
    assert worst["gate_late"] == pytest.approx(3_000.0)
    assert worst["work_cpu"] == pytest.approx(900.0)
    assert worst["work_off_cpu"] == pytest.approx(100.0)
    assert worst["loop_was_in"] == "flush (telemetry.py:10)"
    assert got["slow_causes"]["missed"] >= 1
    # Only windows decided inside the interval count.
    assert analyze(_doc([*fast, late]), 0, base - 1)["n"] == 198


def test_trace_analysis_blames_a_collection_that_covers_most_of_a_window() -> None:
    ms = 1_000_000
    row = (1, 0, 0, 0, 5 * ms, 5 * ms, 5 * ms, 6 * ms, 200_000)
    gc_event = {"start_ns": 100_000, "took_ns": 4 * ms, "generation": 2}
    got = analyze(_doc([row], gc=[gc_event]))
    assert got["slow_causes"] == {"gc generation 2": 1}


def test_profile_summary_shares_per_thread_and_function(tmp_path: Path) -> None:
    folded = tmp_path / "p.folded"
    folded.write_text(
        "thread (0x1): MainThread;run (a.py:1);work (b.py:2) 30\n"
        "thread (0x2): can-reader;_pump (r.py:3);recv (bus.py:4) 60\n"
        "thread (0x2): can-reader;_pump (r.py:3);decode (dbc.py:5) 10\n"
        "garbage line\n"
    )
    got = summarize(folded)
    assert got["samples"] == 100
    assert dict(map(tuple, got["threads_pct"])) == {"can-reader": 70.0, "MainThread": 30.0}
    assert got["self_pct"][0] == ["recv (bus.py)", 60.0]
    assert ["_pump (r.py)", 70.0] in got["inclusive_pct"]


def test_threads_carry_their_name_into_the_kernel() -> None:
    seen: list[str] = []

    def body() -> None:
        name_os_thread("can-reader-a-very-long-name")
        tid = threading.get_native_id()
        seen.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == ["can-reader-a-ve"]  # the kernel keeps 15 bytes
