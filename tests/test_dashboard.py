"""The demo's live view and summary, fed with real decisions and real agent status.

Decisions come from the real reasoning stage and the committed model on windows of the
simulated plant (:func:`edge_agent.simwindows.plant_windows`), or from a real agent run
against the simulator; status snapshots from that run. The one stand-in is the clock: a
plain number the test moves (time is an argument), so a decision lands at a known second.
"""

import asyncio
import dataclasses
import io
import logging
import re
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from rich.console import Console
from rich.segment import Segment

from drivers.sim.plant import Anomaly, parse_anomaly
from drivers.sim.server import PlantSimulator
from edge_agent.compose import build_agent
from edge_agent.dashboard import (
    CATCH_GRACE_S,
    QUIET_AFTER_NS,
    SPARK_WINDOWS,
    Dashboard,
    model_description,
    next_quiet_ns,
    quiet_offset_ns,
)
from edge_agent.gcl import EntrySection, GateControlList, ScheduleSection
from edge_agent.reasoning import ReasoningStage
from edge_agent.rules import Decision, RuleSet
from edge_agent.simwindows import T0_NS, plant_windows
from models import LoadedModel, load_model
from tests.support.agent import example_config
from tests.support.ports import free_port

pytestmark = pytest.mark.peers

SPIKE = parse_anomaly("spike:current@20+8x8")


class Clock:
    """Monotonic seconds that only move when the test says so."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def plant_seconds(d: Decision) -> float:
    """When the decision was made, in plant seconds (what the dashboard's clock reads)."""
    return (d.t_ns - T0_NS) / 1e9


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return load_model()


def decide(model: LoadedModel, anomalies: list[Anomaly], seconds: float) -> list[Decision]:
    stage = ReasoningStage(model, RuleSet())
    windows = plant_windows(seed=1, anomalies=anomalies, seconds=seconds)
    return [stage.process(w, w.end_ns + 25_000_000, perception_ms=0.1) for w in windows]


@pytest.fixture(scope="module")
def spike_decisions(model: LoadedModel) -> list[Decision]:
    """40 s of plant with a current spike at 20-28 s: one spike alarm raised and cleared."""
    decisions = decide(model, [SPIKE], 40)
    assert len([d for d in decisions if "spike" in d.raised]) == 1
    return decisions


@pytest.fixture(scope="module")
def normal_decisions(model: LoadedModel) -> list[Decision]:
    decisions = decide(model, [], 40)
    assert not [d for d in decisions if d.raised]
    return decisions


@dataclasses.dataclass
class LiveRun:
    """A real agent against the simulator, watched by a dashboard on a non-terminal console."""

    output: str
    snapshots: list[tuple[float, Mapping[str, Any]]]
    decisions: list[Decision]
    status: Mapping[str, Any]
    dashboard: Dashboard
    gcl: GateControlList


@pytest.fixture(scope="module")
def live() -> LiveRun:
    port, channel = free_port(), f"dash-{uuid.uuid4().hex[:8]}"
    cfg = example_config(port, channel)
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=False)
    snapshots: list[tuple[float, Mapping[str, Any]]] = []
    decisions: list[Decision] = []

    async def main() -> LiveRun:
        dash: Dashboard | None = None

        def on_decision(d: Decision) -> None:
            decisions.append(d)
            assert dash is not None
            dash.on_decision(d)

        agent = build_agent(cfg, on_decision=on_decision)
        dash = Dashboard(
            cfg.agent.device, model_description(agent.status()), [], 3.0, console=console
        )

        def status_fn() -> Mapping[str, Any]:
            status = agent.status()
            snapshots.append((dash.clock(), status))
            return status

        stop, shown = asyncio.Event(), asyncio.Event()
        async with PlantSimulator(seed=3, modbus_port=port, can_channel=channel):
            asyncio.get_running_loop().call_later(3.0, stop.set)
            async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
                view = tg.create_task(
                    dash.run(shown, status_fn, 0.1, plain_every_s=0.5, gates=agent.gcl)
                )
                try:
                    await agent.run(stop)
                finally:
                    shown.set()
            assert view.done()
        return LiveRun(out.getvalue(), snapshots, decisions, agent.status(), dash, agent.gcl)

    return asyncio.run(main())


def console100() -> Console:
    return Console(width=100, file=io.StringIO())


def text_of(renderable: Any, width: int = 100) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def segments(renderable: Any) -> list[Segment]:
    console = Console(width=100, file=io.StringIO())
    return list(console.render(renderable))


def us(x: float) -> str:
    """How the dashboard writes a latency in µs."""
    return f"{x:.1f}" if x < 100 else f"{x:,.0f}"


def feed(
    dash: Dashboard,
    clock: Clock,
    decisions: list[Decision],
    until_s: float,
    after_s: float = -1.0,
) -> None:
    """Hand the dashboard the decisions made in (``after_s``, ``until_s``], each on time."""
    for d in decisions:
        t = plant_seconds(d)
        if t <= after_s:
            continue
        if t > until_s:
            break
        clock.t = t
        dash.on_decision(d)
    clock.t = until_s


# -- the live view -----------------------------------------------------------------------------


def test_render_shows_label_score_rate_latencies_and_the_active_anomaly(
    spike_decisions: list[Decision], live: LiveRun
) -> None:
    clock = Clock()
    dash = Dashboard(
        "demo-gw-01", "motor 1.0.0 0123456789ab", [SPIKE], 60.0, console=console100(), clock=clock
    )
    # Two snapshots of the real run, as far apart as they were, the second at the raise.
    (first, t1), (second, t2) = live.snapshots[0], live.snapshots[-1]
    raise_at = next(plant_seconds(d) for d in spike_decisions if d.raised)
    before = raise_at - (second - first)
    feed(dash, clock, spike_decisions, before)
    dash.update(t1)
    feed(dash, clock, spike_decisions, raise_at, after_s=before)
    dash.update(t2)
    rate = (t2["windows"] - t1["windows"]) / (second - first)
    text = text_of(dash.render())
    lines = text.splitlines()
    assert len(lines) <= 32, text
    assert max(len(line) for line in lines) <= 100, text

    last = spike_decisions[[plant_seconds(d) for d in spike_decisions].index(raise_at)]
    assert last.label == "spike"
    assert "spike" in last.raised
    assert "demo-gw-01" in text
    assert model_description(t2) in text  # the serving model, as the status names it
    assert f"now spike {last.score:.3f}" in text
    assert "ALARM spike" in text
    assert f"{raise_at:.1f} s  RAISED spike" in text
    assert "current" in text  # the signal the spike is blamed on
    assert 1.0 < rate < 2.2, rate  # 100 Hz / 64-point windows: ~1.56/s
    assert f"{rate:.1f}/s" in text
    lat = t2["latency_us"]
    for stage in ("perception", "memory", "reasoning", "e2e"):
        row = re.search(rf"│ {stage} +(\S+) +(\S+) ", text)
        assert row is not None, (stage, text)
        assert row.groups() == (us(lat[stage]["p50"]), us(lat[stage]["p99"]))
    openings = sum(e["openings"] for e in t2["gates"]["entries"].values())
    gates_row = next(line for line in lines if f"gates {openings:,} · missed " in line)
    assert gates_row.rstrip(" │").endswith(" µs")  # fits: nothing cut off
    assert "drive-modbus" in text
    assert "drive-can" in text
    assert "spike:current 20\N{EN DASH}28 s: ACTIVE" in text
    # Each model label has a sparkline, newest on the right.
    spike_row = next(line for line in lines if line.startswith("│ spike "))
    assert spike_row.rstrip(" │").endswith("█")


def test_raised_alarm_and_active_anomaly_are_red(spike_decisions: list[Decision]) -> None:
    clock = Clock()
    dash = Dashboard("gw", "m", [SPIKE], 60.0, console=console100(), clock=clock)
    feed(dash, clock, spike_decisions, next(plant_seconds(d) for d in spike_decisions if d.raised))
    backgrounds = [s for s in segments(dash.render()) if s.style and s.style.bgcolor]
    assert {s.style.bgcolor.name for s in backgrounds if s.style and s.style.bgcolor} == {"red"}
    red = [s.text for s in backgrounds]
    assert "RAISED spike" in "".join(red)
    assert " ALARM spike " in red
    assert "ACTIVE" in red


def test_anomaly_state_follows_the_elapsed_time() -> None:
    clock = Clock()
    dash = Dashboard("gw", "m", [SPIKE], 60.0, console=console100(), clock=clock)
    states = {}
    for t in (5.0, 19.9, 20.0, 27.9, 28.0, 45.0):
        clock.t = t
        states[t] = dash.anomaly_state(0)
    assert states == {
        5.0: "scheduled",
        19.9: "scheduled",
        20.0: "ACTIVE",
        27.9: "ACTIVE",
        28.0: "over",
        45.0: "over",
    }
    clock.t = 5.0
    assert "spike:current 20\N{EN DASH}28 s: scheduled, in 15 s" in text_of(dash.render())
    clock.t = 45.0
    assert "over  MISSED" in text_of(dash.render())


def test_a_held_verdict_leaves_a_gap_and_says_so(spike_decisions: list[Decision]) -> None:
    clock = Clock()
    dash = Dashboard("gw", "m", [], None, console=console100(), clock=clock)
    for d in spike_decisions[:10]:
        dash.on_decision(d)
    held = dataclasses.replace(
        spike_decisions[10], model_ran=False, probabilities={}, mode="every_k"
    )
    dash.on_decision(held)
    text = text_of(dash.render())
    assert "model held (every_k)" in text
    normal_row = next(line for line in text.splitlines() if line.startswith("│ normal "))
    assert normal_row.rstrip(" │").endswith("·")
    assert dash.model_runs == 10
    assert dash.decisions == 11


def test_history_on_screen_is_bounded(spike_decisions: list[Decision]) -> None:
    clock = Clock()
    dash = Dashboard("gw", "m", [SPIKE], None, console=console100(), clock=clock)
    for _ in range(5):  # five passes: five raises, five clears, many label changes
        feed(dash, clock, spike_decisions, 40.0)
    text = text_of(dash.render())
    spark = next(line for line in text.splitlines() if line.startswith("│ spike "))
    assert sum(spark.count(c) for c in "▁▂▃▄▅▆▇█·") == SPARK_WINDOWS
    notable = [line for line in text.splitlines() if re.match(r"│ +\d+\.\d s  ", line)]
    assert len(notable) == 8
    assert len(text.splitlines()) <= 32


# -- the summary -------------------------------------------------------------------------------


def test_summary_says_caught_with_the_delay(spike_decisions: list[Decision]) -> None:
    clock = Clock()
    dash = Dashboard("gw", "m", [SPIKE], 40.0, console=console100(), clock=clock)
    feed(dash, clock, spike_decisions, 40.0)
    raise_at = next(plant_seconds(d) for d in spike_decisions if d.raised)
    clear_at = next(plant_seconds(d) for d in spike_decisions if d.cleared)
    summary = dash.summary_text()
    assert f"caught spike {raise_at - 20:.1f} s after injection" in summary
    assert "MISSED" not in summary
    assert "alarms: 1 raised, 1 cleared" in summary
    assert f"{raise_at:.1f} s  RAISED spike" in summary
    assert f"{clear_at:.1f} s  cleared spike" in summary
    assert "false alarms (outside anomaly periods + 3 s): 0" in summary
    labels = {d.label for d in spike_decisions}
    assert {"normal", "spike"} <= labels
    assert f"{len(spike_decisions)} decisions" in summary
    # The rich summary says the same.
    rich = text_of(dash.summary())
    assert f"caught spike {raise_at - 20:.1f} s after injection" in rich


def test_summary_says_missed_when_no_alarm_came(normal_decisions: list[Decision]) -> None:
    clock = Clock()
    dash = Dashboard("gw", "m", [SPIKE], 40.0, console=console100(), clock=clock)
    feed(dash, clock, normal_decisions, 40.0)
    summary = dash.summary_text()
    assert "anomaly spike:current 20\N{EN DASH}28 s: MISSED" in summary
    assert "caught" not in summary
    assert "false alarms (outside anomaly periods + 3 s): 0" in summary


def test_alarms_outside_the_anomaly_are_false_alarms(spike_decisions: list[Decision]) -> None:
    # The schedule says 50-55 s, but the plant spiked at 20 s: that alarm is false.
    late = parse_anomaly("spike:current@50+5x8")
    clock = Clock()
    dash = Dashboard("gw", "m", [late], 60.0, console=console100(), clock=clock)
    feed(dash, clock, spike_decisions, 60.0)
    summary = dash.summary_text()
    assert "false alarms (outside anomaly periods + 3 s): 1" in summary
    assert "(false alarm)" in summary
    assert "anomaly spike:current 50\N{EN DASH}55 s: MISSED" in summary
    assert dash.false_alarms == 1


def test_an_alarm_of_another_kind_does_not_catch_the_anomaly(
    spike_decisions: list[Decision],
) -> None:
    stuck = parse_anomaly("stuck:current@20+8")
    clock = Clock()
    dash = Dashboard("gw", "m", [stuck], 40.0, console=console100(), clock=clock)
    feed(dash, clock, spike_decisions, 40.0)
    summary = dash.summary_text()
    assert "anomaly stuck:current 20\N{EN DASH}28 s: MISSED" in summary
    assert "false alarms (outside anomaly periods + 3 s): 0" in summary
    assert "alarms of the wrong kind during an anomaly: 1" in summary


def test_grace_after_the_anomaly_still_catches(spike_decisions: list[Decision]) -> None:
    # The same alarm against a schedule that ended just before it: within the grace.
    raise_at = next(plant_seconds(d) for d in spike_decisions if d.raised)
    ended = Anomaly("spike", "current", start_s=raise_at - 4.0, duration_s=2.0, magnitude=8)
    assert ended.end_s < raise_at <= ended.end_s + CATCH_GRACE_S
    clock = Clock()
    dash = Dashboard("gw", "m", [ended], 40.0, console=console100(), clock=clock)
    feed(dash, clock, spike_decisions, 40.0)
    assert "caught spike 4.0 s after injection" in dash.summary_text()


def test_summary_of_a_real_run_has_latencies_and_drops(live: LiveRun) -> None:
    summary = live.dashboard.summary_text()
    lat = live.status["latency_us"]
    for stage in ("perception", "memory", "reasoning", "e2e"):
        row = re.search(rf"^  {stage} +(\S+) / (\S+)$", summary, re.MULTILINE)
        assert row is not None, (stage, summary)
        assert row.groups() == (us(lat[stage]["p50"]), us(lat[stage]["p99"]))
    assert f"{live.status['windows']} windows" in summary
    assert f"{len(live.decisions)} decisions" in summary
    assert "drops: buffer 0 · queues 0 · late 0 · skipped 0 · memory 0" in summary
    # Nothing was scheduled: no anomaly line at all.
    assert not [line for line in summary.splitlines() if line.startswith("anomaly ")]


# -- running -----------------------------------------------------------------------------------


def test_run_on_a_pipe_prints_plain_lines_and_the_summary(live: LiveRun) -> None:
    out = live.output
    assert "\x1b[" not in out  # no colour, no cursor movement: fit for tee and CI logs
    lines = out.splitlines()
    status_lines = [line for line in lines if line.startswith("[")]
    assert len(status_lines) >= 4, out  # one every 0.5 s over 3 s, and a last one
    assert re.search(r"windows \d+ \(\d\.\d/s\) label normal \d\.\d{3} alarms -", out), out
    assert "p99 µs perception" in out
    assert "e2e" in out
    assert lines[-1].startswith("drops: ")
    assert out.index("summary: ") > out.index(status_lines[-1])
    assert live.decisions
    assert live.dashboard.decisions == len(live.decisions)
    assert live.dashboard.stopped_at is not None
    # The final snapshot was taken after the agent stopped: the summary counts every window.
    assert f"{live.status['windows']} windows" in out


def test_run_returns_when_stop_is_set(live: LiveRun) -> None:
    status = live.status
    out = io.StringIO()
    dash = Dashboard("gw", "m", [SPIKE], None, console=Console(file=out, force_terminal=False))

    async def main() -> float:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, stop.set)
        t0 = loop.time()
        async with asyncio.timeout(5):
            await dash.run(stop, lambda: status, 0.05, plain_every_s=0.1)
        return loop.time() - t0

    took = asyncio.run(main())
    assert 0.3 <= took < 2.0
    text = out.getvalue()
    assert len([line for line in text.splitlines() if line.startswith("[")]) >= 3
    assert "spike:current scheduled" in text
    assert "summary: gw" in text


def test_live_view_on_a_terminal_keeps_log_lines_above_it(live: LiveRun) -> None:
    status = live.status
    out = io.StringIO()
    console = Console(file=out, width=100, height=40, force_terminal=True)
    dash = Dashboard("gw", "m", [], None, console=console)
    handler = logging.StreamHandler(sys.stderr)  # as logging.basicConfig(stream=...) does
    logger = logging.getLogger("edge_agent.test_dashboard")
    logger.addHandler(handler)
    logger.propagate = False
    try:

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            loop.call_later(0.15, logger.warning, "a warning while the view is up")
            loop.call_later(0.3, stop.set)
            async with asyncio.timeout(5):
                await dash.run(stop, lambda: status, 0.05)

        asyncio.run(main())
        assert handler.stream is sys.stderr  # given back after the view
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    text = out.getvalue()
    # The warning went through the console (printed above the view), not around it.
    assert "a warning while the view is up" in text
    assert "EdgeFleet edge agent" in text
    assert "summary: gw" in text


# -- gate alignment ----------------------------------------------------------------------------


def test_ticks_go_in_the_quiet_part_of_the_example_gate_cycle(live: LiveRun) -> None:
    gcl = live.gcl
    offset = quiet_offset_ns(gcl)
    # compute (the stages) opens at 0 of the 10 ms cycle, uplink (no stage) at 6 ms.
    assert offset == QUIET_AFTER_NS
    now = 1_700_000_000_123_456_789
    t = next_quiet_ns(gcl, offset, now)
    assert now < t <= now + gcl.cycle_ns
    assert t - gcl.cycle_start(t) == offset


def test_ticks_go_after_the_stage_gate_with_the_most_room_after_it() -> None:
    # Stage gates open at 0 and 2 ms of a 10 ms cycle: the 8 ms after the second are the room.
    split = ScheduleSection(
        entries=[
            EntrySection(name="perceive", duration_us=2_000, gates=["perception"]),
            EntrySection(name="decide", duration_us=2_000, gates=["memory", "reasoning"]),
            EntrySection(name="net", duration_us=6_000, gates=["uplink", "best_effort"]),
        ]
    )
    assert quiet_offset_ns(GateControlList.from_section(split)) == 2_000_000 + QUIET_AFTER_NS


def test_no_alignment_when_the_cycle_has_no_room() -> None:
    gates = ["perception", "memory", "reasoning", "uplink", "best_effort"]
    tight = ScheduleSection(
        cycle_us=2_000, entries=[EntrySection(name="all", duration_us=2_000, gates=gates)]
    )
    assert quiet_offset_ns(GateControlList.from_section(tight)) is None
