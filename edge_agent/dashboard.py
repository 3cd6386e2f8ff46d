"""The live terminal view of the demo: what the agent reads, decides, and how fast.

:class:`Dashboard` keeps a small, bounded picture of a running agent, fed from two sides:

* :meth:`Dashboard.on_decision`, the agent's ``on_decision`` callback, called on the event
  loop for every decision: O(1) bookkeeping only (counters, bounded deques), never rendering;
* :meth:`Dashboard.update`, the latest :meth:`Agent.status` snapshot, a few times a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, Literal, NamedTuple

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from edge_agent.console import make_console
from edge_agent.metrics_status import status_at
from edge_agent.rules import NORMAL, Decision

if TYPE_CHECKING:
    from drivers.sim.plant import Anomaly
    from edge_agent.gcl import GateControlList

#: Windows of probability history in each label's sparkline.
SPARK_WINDOWS = 60
#: Notable decisions (alarm raised or cleared, label changed) listed on screen.
NOTABLE_ROWS = 8
#: Alarm events kept for the summary. Hysteresis makes them rare; the bound is for safety,
#: and the caught/false-alarm verdicts are counted as they happen, so nothing is lost.
ALARM_LOG = 256
#: How long after an anomaly ends a matching alarm still counts as catching it.
CATCH_GRACE_S = 3.0
#: Windows/s is measured over the snapshots of this many recent seconds: at ~1.5 windows/s
#: a shorter span makes the rate jump with the phase of the last window.
RATE_HORIZON_S = 10.0
#: Below this span between the oldest and newest snapshot there is no rate yet.
RATE_MIN_SPAN_S = 1.0
#: Seconds between the plain status lines printed when the console is not a terminal.
PLAIN_EVERY_S = 2.0
#: A tick (a status snapshot, ~1 ms, and a render, ~3 ms) needs this much room before the
#: next gate that runs pipeline stages, or aligning it with the gate cycle buys nothing.
TICK_BUDGET_NS = 5_000_000
#: Start a tick this long after a stage gate opens: the stages' handlers are done by then
#: (microseconds per window), and a sleep's wake-up is up to 1 ms late anyway.
QUIET_AFTER_NS = 500_000
#: Stages shown in the latency table, in pipeline order; ``e2e`` only when the status has it.
STAGES = ("perception", "memory", "reasoning", "e2e")

# Layout: the screen is 100 columns (fewer on a narrower terminal, down to 60); the pipeline
# box takes 60 % of the middle row and the sources the rest; the notable decisions'
# columns are time, event, score, top signals, rules (the last is cut to what is left).
_SCREEN_WIDTH = 100
_MIN_WIDTH = 60
_LEFT_PERCENT = 60
_NOTABLE_WIDTHS = (7, 22, 5, 26, 28)

_BLOCKS = "▁▂▃▄▅▆▇█"
_SOURCE_ERROR_KEYS = (
    "bus_errors",
    "decode_errors",
    "error_frames",
    "timeouts",
    "errors",
    "connection_errors",
    "exception_responses",
)


class _Notable(NamedTuple):
    t_s: float
    previous: str
    decision: Decision


class _AlarmEvent(NamedTuple):
    t_s: float
    kind: Literal["raised", "cleared"]
    label: str
    verdict: str  # for a raise: "caught ...", "false alarm" or "during <anomaly>"


class Dashboard:
    """The live view and the end-of-run summary of one agent (see the module docstring).

    ``model`` describes the serving model until a status snapshot names one (see
    :func:`model_description`); ``anomalies`` is the simulator's schedule in plant seconds;
    ``duration_s`` the planned run length (None: until stopped). ``clock`` is monotonic
    seconds; tests pass their own to place decisions in time.

    :meth:`Dashboard.render` and :meth:`Dashboard.summary` are pure functions of that picture
    (and of the injected clock, for the elapsed time), so tests render them into a recording
    ``Console`` and read the text. :meth:`Dashboard.run` is the only I/O: a ``rich`` Live view on
    a terminal, or one plain line every few seconds on a pipe or in CI, then the summary.

    Elapsed time starts when the dashboard is built; build it when the simulator starts, so
    the anomaly schedule (plant seconds) lines up with what is on screen.

    An injected anomaly counts as *caught* when an alarm of the same kind (``spike`` for a
    spike, ``dropout`` for a dropout ...) is raised while it is active or at most
    :data:`CATCH_GRACE_S` after it ends: a window closes 0.64 s after its first sample and the
    alarm needs consecutive windows to rise, so a fast detection still lands after the fact.
    Any alarm raised outside every anomaly (plus that grace) is a false alarm.
    """

    def __init__(
        self,
        device: str,
        model: str,
        anomalies: Sequence[Anomaly],
        duration_s: float | None,
        *,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device = device
        self.model = model
        self.anomalies: tuple[Anomaly, ...] = tuple(anomalies)
        self.duration_s = duration_s
        self.console = console if console is not None else make_console()
        self.clock = clock
        self.t0 = clock()
        #: Set by :meth:`run` when told to stop: the summary's duration.
        self.stopped_at: float | None = None
        self.decisions = 0
        self.model_runs = 0
        self.labels: Counter[str] = Counter()
        self.alarms_raised = 0
        self.alarms_cleared = 0
        self.false_alarms = 0
        #: Alarms raised during an anomaly but of another kind (a spike called ``stuck``).
        self.wrong_kind_alarms = 0
        #: Per anomaly: seconds from its start to the first matching alarm, or None.
        self.caught_after_s: list[float | None] = [None] * len(self.anomalies)
        self.last: Decision | None = None
        self.status: Mapping[str, Any] = {}
        self.windows_per_s: float | None = None
        self._last_label = NORMAL
        self._label_order: dict[str, None] = {}  # an ordered set: the model's label order
        self._probs: deque[Mapping[str, float]] = deque(maxlen=SPARK_WINDOWS)
        self._notable: deque[_Notable] = deque(maxlen=NOTABLE_ROWS)
        self._notable_total = 0
        self._notable_printed = 0
        self._alarm_log: deque[_AlarmEvent] = deque(maxlen=ALARM_LOG)
        self._rate_samples: deque[tuple[float, int]] = deque(maxlen=256)

    # -- input ------------------------------------------------------------------------------

    def on_decision(self, d: Decision) -> None:
        """Take one decision (the agent's ``on_decision``). Cheap: no formatting here."""
        t = self.clock() - self.t0
        self.decisions += 1
        self.labels[d.label] += 1
        if d.model_ran:
            self.model_runs += 1
        for label in d.probabilities:  # a handful of labels; a swap may bring new ones
            if label not in self._label_order:
                self._label_order[label] = None
        # A decision without a model run has no probabilities: a gap in the sparkline.
        self._probs.append(d.probabilities)
        for label in d.raised:
            self._raised(label, t)
        for label in d.cleared:
            self.alarms_cleared += 1
            self._alarm_log.append(_AlarmEvent(t, "cleared", label, ""))
        if d.raised or d.cleared or d.label != self._last_label:
            self._notable.append(_Notable(t, self._last_label, d))
            self._notable_total += 1
        self._last_label = d.label
        self.last = d

    def _raised(self, label: str, t: float) -> None:
        self.alarms_raised += 1
        during: list[str] = []
        verdict = ""
        for i, a in enumerate(self.anomalies):
            if not a.start_s <= t <= a.end_s + CATCH_GRACE_S:
                continue
            during.append(_anomaly_name(a))
            if label == a.kind:
                after = t - a.start_s
                if self.caught_after_s[i] is None:
                    self.caught_after_s[i] = after
                verdict = f"caught {_anomaly_name(a)} {after:.1f} s after injection"
        if not during:
            self.false_alarms += 1
            verdict = "false alarm"
        elif not verdict:
            self.wrong_kind_alarms += 1
            verdict = f"during {', '.join(during)}: wrong kind"
        self._alarm_log.append(_AlarmEvent(t, "raised", label, verdict))

    def update(self, status: Mapping[str, Any]) -> None:
        """Take the latest :meth:`Agent.status` snapshot; windows/s comes from successive ones."""
        now = self.clock()
        self.status = status
        windows = _int(status.get("windows"))
        if windows is None:
            return
        samples = self._rate_samples
        if samples and windows < samples[-1][1]:
            samples.clear()  # counters went backwards: a new agent, start over
        samples.append((now, windows))
        while len(samples) > 2 and now - samples[0][0] > RATE_HORIZON_S:
            samples.popleft()
        t_first, w_first = samples[0]
        span = now - t_first
        if span >= RATE_MIN_SPAN_S:
            self.windows_per_s = (windows - w_first) / span

    # -- derived state ----------------------------------------------------------------------

    def elapsed(self) -> float:
        """Seconds since the dashboard was built (frozen once :meth:`run` has stopped)."""
        end = self.stopped_at if self.stopped_at is not None else self.clock()
        return end - self.t0

    def anomaly_state(self, i: int, elapsed: float | None = None) -> str:
        """``scheduled``, ``ACTIVE`` or ``over`` for anomaly ``i`` at ``elapsed`` (default: now)."""
        a = self.anomalies[i]
        t = self.elapsed() if elapsed is None else elapsed
        if t < a.start_s:
            return "scheduled"
        return "ACTIVE" if t < a.end_s else "over"

    def _model(self) -> str:
        model = status_at(self.status, "reasoning", "model")
        return model_description(self.status) if isinstance(model, Mapping) else self.model

    # -- the live view ----------------------------------------------------------------------

    def render(self, width: int | None = None) -> RenderableType:
        """One screen (fits 100 x 32): header, pipeline | sources, decisions.

        ``width`` defaults to the dashboard's console's (at most 100, at least 60 columns).
        The result is a finished snapshot, not a view of live state: Live draws it again
        whenever a log line arrives, possibly from a driver's thread, while the loop keeps
        changing the state.
        """
        # One Text with hand-drawn boxes rather than Panels and Tables: rich lays those out
        # cell by cell (~5 ms for this screen) and this runs on the agent's event loop,
        # where a stall shows up as gate lateness and end-to-end latency. This takes ~1 ms.
        width = max(_MIN_WIDTH, min(_SCREEN_WIDTH, width or self.console.width))
        left_w = width * _LEFT_PERCENT // 100
        left = self._pipeline_lines()
        right = self._sources_lines()
        height = max(len(left), len(right))
        rows = _box("EdgeFleet edge agent", self._header_lines(width - 4), width, "blue")
        middle = zip(
            _box("pipeline", _fill(left, height), left_w, "cyan"),
            _box("sources", _fill(right, height), width - left_w, "cyan"),
            strict=True,
        )
        rows += [a + b for a, b in middle]
        rows += _box("decisions", self._decision_lines(width - 4), width, "magenta")
        screen = Text("\n").join(rows)
        screen.no_wrap = True
        screen.overflow = "crop"
        return screen

    def _header_lines(self, width: int) -> list[Text]:
        elapsed = self.elapsed()
        left = Text.assemble((self.device, "bold cyan"), "  model ", (self._model(), "magenta"))
        health = status_at(self.status, "agent", "health")
        if isinstance(health, str):
            left.append("  health ")
            left.append(health, "green" if health == "ok" else "bold yellow")
        right = Text(f"{elapsed:5.1f} s")
        if self.duration_s is not None:
            right.append(f" / {self.duration_s:g} s")
        if self.stopped_at is not None:
            right.append("  stopped", "bold")
        gap = max(2, width - left.cell_len - right.cell_len)
        top = Text.assemble(left, " " * gap, right)
        line = Text()
        if not self.anomalies:
            line.append("no anomaly injected", "dim")
        for i, a in enumerate(self.anomalies):
            if i:
                line.append("   ")
            line.append(f"{_anomaly_name(a)} {_span(a)}: ")
            line.append_text(self._anomaly_verdict(i, elapsed))
        return [top, line]

    def _anomaly_verdict(self, i: int, elapsed: float) -> Text:
        a = self.anomalies[i]
        state = self.anomaly_state(i, elapsed)
        text = Text()
        if state == "scheduled":
            text.append(f"scheduled, in {a.start_s - elapsed:.0f} s", "yellow")
        elif state == "ACTIVE":
            text.append("ACTIVE", "bold white on red")
        else:
            text.append("over", "dim")
        caught = self.caught_after_s[i]
        if caught is not None:
            text.append(f"  caught after {caught:.1f} s", "bold green")
        elif elapsed > a.end_s + CATCH_GRACE_S:
            text.append("  MISSED", "bold red")
        return text

    def _pipeline_lines(self) -> list[Text]:
        st = self.status
        rate = self.windows_per_s
        head = Text.assemble(
            "windows ",
            (f"{_int(st.get('windows')) or 0:,}", "bold"),
            "  ",
            (f"{rate:.1f}/s" if rate is not None else "—/s", "bold cyan"),
            "  completeness ",
        )
        completeness = _num(st.get("mean_completeness"))
        head.append(
            f"{completeness:.3f}" if completeness is not None else "—",
            "green" if completeness is not None and completeness >= 0.99 else "yellow",
        )
        lines = [head, Text(f"{'latency':<11}{'p50 µs':>9}{'p99 µs':>9}", "dim")]
        budget = _num(status_at(st, "reasoning", "breaker", "budget_us"))
        for stage in STAGES:
            p50, p99 = stage_latency(st, stage)
            if stage == "e2e" and p50 is None:
                continue
            over = stage == "reasoning" and budget is not None and (p99 or 0.0) > budget
            row = Text.assemble((f"{stage:<11}", "dim"), f"{_us(p50):>9}")
            row.append(f"{_us(p99):>9}", "bold red" if over else "")
            lines.append(row)
        lines += [self._breaker_line(), self._drops_line()]
        gates = self._gates_line()
        if gates is not None:
            lines.append(gates)
        return lines

    def _breaker_line(self) -> Text:
        b = status_at(self.status, "reasoning", "breaker")
        text = Text("breaker ")
        if not isinstance(b, Mapping):
            return text.append("—", "dim")
        mode = str(b.get("mode", "—"))
        text.append(mode, "green" if mode == "full" else "bold yellow")
        text.append(f" · {b.get('state', '—')} · trips {b.get('trips', 0)}", "dim")
        return text

    def _drops_line(self) -> Text:
        text = Text("drops ")
        # Only what is not zero: the line must fit, and a zero is not news.
        nonzero = [(name, n) for name, n in drops(self.status) if n]
        if not nonzero:
            return text.append("none", "green")
        for i, (name, n) in enumerate(nonzero):
            if i:
                text.append(" · ", "dim")
            text.append(f"{name} ")
            text.append(f"{n:,}", "bold red")
        return text

    def _gates_line(self) -> Text | None:
        g = gate_stats(self.status)
        if g is None:
            return None
        openings, missed, overruns, late_p99 = g
        text = Text(f"gates {openings:,} · missed ")
        text.append(f"{missed:,}", "bold red" if missed else "green")
        text.append(" · overruns ")
        text.append(f"{overruns:,}", "bold yellow" if overruns else "green")
        text.append(f" · late p99 {_us(late_p99)} µs")
        return text

    def _sources_lines(self) -> list[Text]:
        sources = self.status.get("sources")
        lines: list[Text] = []
        if not isinstance(sources, Mapping) or not sources:
            lines.append(Text("no status yet", "dim"))
        else:
            for name, stats in sources.items():
                if isinstance(stats, Mapping):
                    lines += _source_lines(str(name), stats)
        return lines

    def _decision_lines(self, width: int) -> list[Text]:
        d = self.last
        active = d.alarms if d is not None else frozenset()
        now = Text("now ")
        if d is None:
            now.append("waiting for the first window", "dim")
        else:
            now.append(d.label, _label_style(d.label, active))
            now.append(f" {_score(d.score)}", "bold")
            now.append(f"  window {d.window_seq}", "dim")
            if not d.model_ran:
                now.append(f"  model held ({d.mode})", "yellow")
            now.append("   ")
            if active:
                now.append(f" ALARM {', '.join(sorted(active))} ", "bold white on red")
            else:
                now.append("no alarm", "green")
        lines = [now]
        for label in self._label_order:
            spark, latest = _sparkline(self._probs, label)
            style = "bold red" if label in active else "cyan" if label == NORMAL else "yellow"
            lines.append(
                Text.assemble((f"{label:<8.8}", style), f"{_score(latest):>6} ", (spark, style))
            )
        w = _NOTABLE_WIDTHS
        header = "  ".join(
            (f"{h:>{n}}" if h in {"time", "score"} else f"{h:<{n}}")
            for h, n in zip(("time", "event", "score", "top signals", "rules"), w, strict=True)
        )
        lines.append(Text(header.rstrip(), "dim bold"))
        for n in self._notable:
            nd = n.decision
            cells = (
                _cell(f"{n.t_s:.1f} s", w[0], right=True),
                _cell(_event_text(n), w[1]),
                _cell(_score(nd.score), w[2], right=True),
                _cell(_top(nd), w[3]),
                _cell(Text(_rules(nd), "dim"), w[4]),
            )
            line = Text("  ").join(cells)
            line.truncate(width, overflow="ellipsis")
            lines.append(line)
        return lines

    # -- plain output (pipes, CI) -----------------------------------------------------------

    def status_line(self) -> str:
        """One compact plain line: elapsed, windows/s, label, score, alarms, p99s, anomaly."""
        d = self.last
        rate = self.windows_per_s
        parts = [
            f"[{self.elapsed():6.1f} s]",
            f"windows {_int(self.status.get('windows')) or 0}",
            f"({rate:.1f}/s)" if rate is not None else "(—/s)",
            f"label {d.label} {_score(d.score)}" if d is not None else "label —",
            f"alarms {','.join(sorted(d.alarms)) if d is not None and d.alarms else '-'}",
        ]
        p99s = []
        for stage in STAGES:
            p99 = stage_latency(self.status, stage)[1]
            if p99 is not None:
                p99s.append(f"{stage} {_us(p99)}")
        if p99s:
            parts.append("| p99 µs " + " ".join(p99s))
        if self.anomalies:
            states = (
                f"{_anomaly_name(a)} {self.anomaly_state(i)}" for i, a in enumerate(self.anomalies)
            )
            parts.append("| " + ", ".join(states))
        return " ".join(parts)

    def _new_notable_lines(self) -> list[str]:
        """Notable decisions not printed yet (plain mode), oldest first."""
        fresh = self._notable_total - self._notable_printed
        self._notable_printed = self._notable_total
        if fresh <= 0:
            return []
        shown = list(self._notable)[-fresh:]
        lines = []
        if fresh > len(shown):
            lines.append(f"  ... {fresh - len(shown)} earlier notable decision(s) not shown")
        for n in shown:
            d = n.decision
            line = f"  {n.t_s:6.1f} s  {_event_text(n).plain}  score {_score(d.score)}"
            if d.top_signals:
                line += f"  top {_top(d)}"
            if d.rules_fired:
                line += f"  rules {_rules(d)}"
            lines.append(line)
        return lines

    # -- the summary ------------------------------------------------------------------------

    def summary(self) -> RenderableType:
        """What the run saw, for the screen (the same lines as :meth:`summary_text`)."""
        return Panel(
            Group(*self._summary_lines()),
            title=f"summary: {self.device}",
            border_style="blue",
            expand=False,
        )

    def summary_text(self) -> str:
        """What the run saw, as plain text."""
        lines = [f"summary: {self.device}, model {self._model()}"]
        lines += [t.plain for t in self._summary_lines()]
        return "\n".join(lines)

    def _summary_lines(self) -> list[Text]:  # noqa: PLR0915 - one screen of the live view, line by line
        elapsed = self.elapsed()
        windows = _int(self.status.get("windows"))
        lines = []
        ran = Text(f"ran {elapsed:.1f} s: ")
        if windows is not None:
            avg = windows / elapsed if elapsed > 0 else 0.0
            ran.append(f"{windows:,} windows ({avg:.2f}/s), ")
        ran.append(f"{self.decisions:,} decisions ({self.model_runs:,} model runs)")
        completeness = _num(self.status.get("mean_completeness"))
        if completeness is not None:
            ran.append(f", completeness {completeness:.3f}")
        lines.append(ran)
        counts = ", ".join(f"{label} {n:,}" for label, n in self.labels.most_common())
        lines.append(Text(f"labels: {counts or '-'}"))
        lines.append(Text(f"alarms: {self.alarms_raised} raised, {self.alarms_cleared} cleared"))
        events = list(self._alarm_log)
        shown = events[-20:]
        if len(events) > len(shown) or self.alarms_raised + self.alarms_cleared > len(events):
            hidden = self.alarms_raised + self.alarms_cleared - len(shown)
            lines.append(Text(f"  ... {hidden} earlier alarm event(s)", "dim"))
        for e in shown:
            if e.kind == "raised":
                style = "red" if e.verdict == "false alarm" else "bold"
                line = Text(f"  {e.t_s:6.1f} s  ")
                line.append(f"RAISED {e.label}", "bold red")
                line.append(f"  ({e.verdict})", style)
            else:
                line = Text(f"  {e.t_s:6.1f} s  ")
                line.append(f"cleared {e.label}", "green")
            lines.append(line)
        for i, a in enumerate(self.anomalies):
            line = Text(f"anomaly {_anomaly_name(a)} {_span(a)}: ")
            caught = self.caught_after_s[i]
            if caught is not None:
                line.append(f"caught {a.kind} {caught:.1f} s after injection", "bold green")
            elif elapsed < a.start_s:
                line.append("not reached (the run ended first)", "yellow")
            elif elapsed <= a.end_s + CATCH_GRACE_S:
                line.append("not caught before the run ended (it had not finished)", "yellow")
            else:
                line.append("MISSED", "bold red")
                if self._label_order and a.kind not in self._label_order and a.kind != "dropout":
                    line.append(f" (the model has no {a.kind!r} label)", "dim")
            lines.append(line)
        false = Text(f"false alarms (outside anomaly periods + {CATCH_GRACE_S:g} s): ")
        false.append(str(self.false_alarms), "bold red" if self.false_alarms else "green")
        lines.append(false)
        if self.wrong_kind_alarms:
            lines.append(
                Text(
                    f"alarms of the wrong kind during an anomaly: {self.wrong_kind_alarms}",
                    "yellow",
                )
            )
        lines.append(Text("latency µs, p50 / p99:"))
        for stage in STAGES:
            p50, p99 = stage_latency(self.status, stage)
            if p50 is not None or p99 is not None:
                lines.append(Text(f"  {stage:<11}{_us(p50):>8} / {_us(p99)}"))
        gates = gate_stats(self.status)
        if gates is not None:
            lines.append(
                Text(
                    f"gates: {gates[0]:,} openings, {gates[1]:,} missed, "
                    f"{gates[2]:,} overruns, lateness p99 {_us(gates[3])} µs"
                )
            )
        drop_parts = drops(self.status)
        text = Text("drops: ")
        text.append(
            " · ".join(f"{name} {n:,}" for name, n in drop_parts) or "-",
            "red" if any(n for _, n in drop_parts) else "",
        )
        lines.append(text)
        return lines

    # -- running ----------------------------------------------------------------------------

    async def run(
        self,
        stop: asyncio.Event,
        status_fn: Callable[[], Mapping[str, Any]],
        refresh_s: float = 0.25,
        *,
        plain_every_s: float = PLAIN_EVERY_S,
        gates: GateControlList | None = None,
    ) -> None:
        """Show the agent until ``stop`` is set, then print the summary.

        On a terminal: a ``rich`` Live view redrawn every ``refresh_s``, with stdout, stderr
        and the log handlers writing to them routed above it. Elsewhere (a pipe, CI): notable
        decisions as they come and :meth:`status_line` every ``plain_every_s``. Set ``stop``
        after the agent's ``run()`` has returned, so the summary includes its final flush.

        ``gates`` is the agent's gate control list (``agent.gcl``, on ``time.time_ns``). A
        tick (``status_fn()`` and a render) holds the event loop for a few ms; with the list,
        each tick starts just after a stage gate opens (see :func:`quiet_offset_ns`), so the
        view does not make the gates it reports on late.
        """
        offset = quiet_offset_ns(gates) if gates is not None else None

        async def settle() -> None:
            if gates is not None and offset is not None:
                now = time.time_ns()
                await asyncio.sleep((next_quiet_ns(gates, offset, now) - now) / 1e9)

        console = self.console
        if console.is_terminal and not console.is_dumb_terminal:
            await self._run_live(stop, status_fn, refresh_s, settle)
            console.print(self.summary())
        else:
            await self._run_plain(stop, status_fn, refresh_s, plain_every_s, settle)
            console.out(self.summary_text(), highlight=False)

    async def _run_live(
        self,
        stop: asyncio.Event,
        status_fn: Callable[[], Mapping[str, Any]],
        refresh_s: float,
        settle: Callable[[], Awaitable[None]],
    ) -> None:
        out, err = sys.stdout, sys.stderr
        # auto_refresh off: rich's refresh thread would build screens while the loop appends
        # to the deques ("deque mutated during iteration"); every screen is built here, on
        # the loop, between two decisions, at the quiet point settle() waits for.
        live = Live(
            self.render(),
            console=self.console,
            screen=False,
            transient=False,
            auto_refresh=False,
            redirect_stdout=True,
            redirect_stderr=True,
        )
        with live, _log_handlers_follow(out, err):
            while not stop.is_set():
                await settle()
                self.update(status_fn())
                live.update(self.render(), refresh=True)
                await _wait(stop, refresh_s)
            self.update(status_fn())
            self.stopped_at = self.clock()
            live.update(self.render(), refresh=True)

    async def _run_plain(
        self,
        stop: asyncio.Event,
        status_fn: Callable[[], Mapping[str, Any]],
        refresh_s: float,
        plain_every_s: float,
        settle: Callable[[], Awaitable[None]],
    ) -> None:
        console = self.console
        next_line = self.clock()
        while not stop.is_set():
            await settle()
            self.update(status_fn())
            for line in self._new_notable_lines():
                console.out(line, highlight=False)
            now = self.clock()
            if now >= next_line:
                console.out(self.status_line(), highlight=False)
                next_line = now + plain_every_s
            await _wait(stop, refresh_s)
        self.update(status_fn())
        self.stopped_at = self.clock()
        for line in self._new_notable_lines():
            console.out(line, highlight=False)
        console.out(self.status_line(), highlight=False)


# -- reading a status snapshot -----------------------------------------------------------------
#
# Agent.status() grows with the agent (gates, e2e latency, per-queue drops): every reader
# below tolerates a missing or differently shaped key and shows "—" rather than failing.


def model_description(status: Mapping[str, Any]) -> str:
    """``name version sha12`` of the model a status snapshot names."""
    m = status_at(status, "reasoning", "model")
    if not isinstance(m, Mapping):
        return "no model (reasoning disabled)"
    return f"{m.get('name', '?')} {m.get('version', '?')} {str(m.get('sha256', ''))[:12]}"


def stage_latency(status: Mapping[str, Any], stage: str) -> tuple[float | None, float | None]:
    """(p50, p99) in µs of one stage; None when unknown or nothing measured yet.

    :meth:`Agent.status` keeps every stage under ``latency_us``; the stages' own snapshots
    (``reasoning.latency_us``, ``memory.latency_us``) are the fallback.
    """
    for path in (("latency_us", stage), ("reasoning", "latency_us", stage), (stage, "latency_us")):
        p = status_at(status, *path)
        if not isinstance(p, Mapping):
            continue
        n = _int(p.get("n", p.get("count")))
        if n == 0:
            return None, None
        return _num(p.get("p50")), _num(p.get("p99"))
    return None, None


def drops(status: Mapping[str, Any]) -> list[tuple[str, int]]:
    """What the pipeline dropped, by place: buffer, queues, late samples, skipped windows."""
    out: list[tuple[str, int]] = []
    buffer = _int(status_at(status, "buffer", "dropped"))
    if buffer is not None:
        out.append(("buffer", buffer))
    queues = status.get("queues")
    if isinstance(queues, Mapping):
        total = sum(_int(status_at(q, "dropped")) or 0 for q in queues.values())
        out.append(("queues", total))
    else:
        queue = _int(status_at(status, "reasoning", "queue", "dropped"))
        if queue is not None:
            out.append(("queue", queue))
    for name, path in (
        ("late", ("perception", "late_dropped")),
        ("skipped", ("perception", "windows_skipped")),
        ("memory", ("memory", "dropped_windows")),
    ):
        n = _int(status_at(status, *path))
        if n is not None:
            out.append((name, n))
    return out


def gate_stats(status: Mapping[str, Any]) -> tuple[int, int, int, float | None] | None:
    """(openings, missed, overruns, worst lateness p99 µs) over every gate; None without gates."""
    g = status.get("gates")
    if not isinstance(g, Mapping):
        return None
    entries = g.get("entries")
    entries = entries if isinstance(entries, Mapping) else {}
    openings = missed = 0
    late: list[float] = []
    for e in entries.values():
        openings += _int(status_at(e, "openings")) or 0
        missed += _int(status_at(e, "missed")) or 0
        p99 = _num(status_at(e, "lateness_us", "p99"))
        if p99 is not None and (_int(status_at(e, "openings")) or 0) > 0:
            late.append(p99)
    stages = g.get("stages")
    overruns = 0
    if isinstance(stages, Mapping):
        overruns = sum(_int(status_at(s, "overruns")) or 0 for s in stages.values())
    return openings, missed, overruns, max(late) if late else None


def quiet_offset_ns(gcl: GateControlList) -> int | None:
    """Where in the gate cycle a dashboard tick disturbs no stage gate, or None if nowhere.

    The tick goes :data:`QUIET_AFTER_NS` after the opening of the stage entry followed by
    the longest stretch without a stage opening (with the example schedule: 0.5 ms into
    the 10 ms cycle, after the 6 ms compute entry opens). None when even that stretch,
    less the scheduler's spin before the next opening, is shorter than
    :data:`TICK_BUDGET_NS`, or when no entry runs a stage.
    """
    opens = [e.offset_ns for e in gcl.entries if e.stages]
    if not opens:
        return None
    gaps = [
        ((opens[i + 1] if i + 1 < len(opens) else opens[0] + gcl.cycle_ns) - off, off)
        for i, off in enumerate(opens)
    ]
    room, best = max(gaps)
    if room - gcl.spin_ns - QUIET_AFTER_NS < TICK_BUDGET_NS:
        return None
    return (best + QUIET_AFTER_NS) % gcl.cycle_ns


def next_quiet_ns(gcl: GateControlList, offset_ns: int, now_ns: int) -> int:
    """The first time after ``now_ns`` that is ``offset_ns`` into a cycle of ``gcl``."""
    t = gcl.cycle_start(now_ns) + offset_ns
    return t if t > now_ns else t + gcl.cycle_ns


def source_state(stats: Mapping[str, Any]) -> tuple[str, bool]:
    """A source's state in a word or two, and whether that is healthy."""
    state = stats.get("state")
    if isinstance(state, str):
        # The agent's own verdict ("up") when the status carries it: a replay source is
        # healthy while "playing", a bus while "open".
        ok = bool(stats["up"]) if "up" in stats else state == "open"
    elif "connected" in stats:
        connected = stats.get("connected") == 1
        # Connected is not up: the port may be open with no unit answering behind it.
        ok = bool(stats["up"]) if "up" in stats else connected
        state = "connected" if connected else "disconnected"
    elif "up" in stats:
        ok = bool(stats.get("up"))
        state = "up" if ok else "down"
    else:
        return "—", True
    backoff = [
        k.split(".")[1]
        for k, v in stats.items()
        if k.startswith("unit.") and k.endswith(".state") and v == "backoff"
    ]
    if backoff:
        state += f", unit {','.join(backoff)} backing off"
        ok = False
    elif not ok and state == "connected":
        state += ", no unit answers yet"
    return state, ok


def _source_lines(name: str, stats: Mapping[str, Any]) -> list[Text]:
    """Two lines per source (three with an error): state and errors, then traffic."""
    state, ok = source_state(stats)
    first = Text.assemble((name, "bold"), " ", (state, "green" if ok else "bold red"))
    errors = sum(_int(stats.get(k)) or 0 for k in _SOURCE_ERROR_KEYS)
    first.append(" · ")
    first.append(f"errors {errors:,}", "bold red" if errors else "green")
    restarts = _int(stats.get("restarts")) or 0
    if restarts:
        first.append(f" · restarts {restarts}", "bold yellow")
    traffic = Text("  ")
    if "frames" in stats:
        traffic.append(f"frames {_int(stats.get('frames')) or 0:,}")
    elif "replies" in stats:
        traffic.append(f"replies {_int(stats.get('replies')) or 0:,}")
    samples = _int(stats.get("samples"))
    if samples is not None:
        traffic.append(f" · samples {samples:,}")
    lines = [first, traffic]
    last_error = stats.get("last_error")
    if isinstance(last_error, str) and last_error:
        lines.append(Text(f"  {last_error}", "red"))
    return lines


def _box(title: str, lines: list[Text], width: int, border: str) -> list[Text]:
    """``lines`` in a rounded box ``width`` cells wide, each cut (ellipsis) or padded to fit."""
    inner = width - 4
    top = Text("╭─ ", border)
    top.append(title, f"bold {border}")
    top.append(" " + "─" * max(0, width - 5 - len(title)) + "╮", border)
    top.truncate(width)
    out = [top]
    for line in lines:
        row = Text("│ ", border)
        row.append_text(_cell(line, inner))
        row.append(" │", border)
        out.append(row)
    out.append(Text("╰" + "─" * (width - 2) + "╯", border))
    return out


def _fill(lines: list[Text], height: int) -> list[Text]:
    return lines + [Text() for _ in range(height - len(lines))]


def _cell(content: str | Text, width: int, *, right: bool = False) -> Text:
    """``content`` cut (with an ellipsis) or padded to exactly ``width`` cells."""
    text = content.copy() if isinstance(content, Text) else Text(content)
    text.truncate(width, overflow="ellipsis")
    pad = width - text.cell_len
    if pad > 0:
        if right:
            text.pad_left(pad)
        else:
            text.pad_right(pad)
    return text


# -- formatting helpers ------------------------------------------------------------------------


def _sparkline(history: Sequence[Mapping[str, float]], label: str) -> tuple[str, float]:
    """``label``'s probability over ``history`` in blocks, newest right; and its latest value."""
    chars = []
    latest = math.nan
    for probs in history:
        p = probs.get(label)
        if p is None or math.isnan(p):  # no model run on that window
            chars.append("·")
            continue
        latest = p
        chars.append(_BLOCKS[min(len(_BLOCKS) - 1, max(0, int(p * len(_BLOCKS))))])
    return "".join(chars).rjust(SPARK_WINDOWS), latest


def _event_text(n: _Notable) -> Text:
    d = n.decision
    text = Text()
    for label in d.raised:
        text.append(f"RAISED {label} ", "bold white on red")
    for label in d.cleared:
        text.append(f"cleared {label} ", "green")
    if not d.raised and not d.cleared:
        text.append(f"{n.previous} → {d.label}", "yellow" if d.label != NORMAL else "cyan")
    text.rstrip()
    return text


def _label_style(label: str, active: frozenset[str]) -> str:
    if label in active:
        return "bold red"
    return "bold green" if label == NORMAL else "bold yellow"


def _top(d: Decision) -> str:
    return ", ".join(f"{s} {c:.2f}" for s, c in d.top_signals) or "-"


def _rules(d: Decision) -> str:
    return "; ".join(f"{r.rule}: {r.reason}" for r in d.rules_fired) or "-"


def _anomaly_name(a: Anomaly) -> str:
    return f"{a.kind}:{a.signal}"


def _span(a: Anomaly) -> str:
    return f"{a.start_s:g}\N{EN DASH}{a.end_s:g} s"


def _score(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "—"


def _us(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.1f}" if x < 100 else f"{x:,.0f}"


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def _int(x: Any) -> int | None:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        return None
    return int(x)


async def _wait(stop: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await stop.wait()


def _stream_handlers() -> Iterator[logging.StreamHandler[Any]]:
    loggers: list[logging.Logger] = [logging.getLogger()]
    loggers += [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                yield h


@contextlib.contextmanager
def _log_handlers_follow(out: IO[str], err: IO[str]) -> Iterator[None]:
    """Point log handlers that wrote to ``out``/``err`` at the current sys.stdout/stderr.

    A handler keeps the stream it was given (``logging.basicConfig(stream=sys.stderr)``),
    so Live's redirection of sys.stderr alone misses it and every log line would tear the
    view; following the redirection prints them above it instead. Restored on exit.
    """
    moves = {id(err): sys.stderr, id(out): sys.stdout}
    moved: list[tuple[logging.StreamHandler[Any], Any]] = []
    for h in _stream_handlers():
        new = moves.get(id(h.stream))
        if new is not None and new is not h.stream:
            moved.append((h, h.setStream(new)))
    try:
        yield
    finally:
        for h, old in moved:
            h.setStream(old)


__all__ = [
    "CATCH_GRACE_S",
    "Dashboard",
    "drops",
    "gate_stats",
    "model_description",
    "next_quiet_ns",
    "quiet_offset_ns",
    "source_state",
    "stage_latency",
]
