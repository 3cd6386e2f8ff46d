"""The running agent: sources -> bounded buffer -> perception -> reasoning, in one TaskGroup.

This is the I/O shell around the pure parts: it owns the clock, the tasks and the logs.
Perception hands each window to reasoning through a depth-2 drop-oldest queue (a window
that waited behind a newer one is stale; drops are counted). Decisions go to the log for
now: INFO when an alarm rises or clears or the label changes, DEBUG otherwise; the MQTT
outbox (a later issue) takes them from :meth:`Agent._decide`. Memory plugs in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from drivers.backoff import backoff_delay
from drivers.buffer import SampleBuffer
from drivers.errors import DriverError
from drivers.source import Source, open_source
from edge_agent.config import AgentConfig
from edge_agent.errors import ModelMismatch, ReasoningError
from edge_agent.memory.stage import MemoryStage
from edge_agent.perception import Aligner, Window
from edge_agent.reasoning import DropOldestQueue, PreparedModel, ReasoningStage, Scorer
from edge_agent.rules import Decision
from models import load_model
from models.errors import ModelError

log = logging.getLogger(__name__)

#: How often perception drains the buffer and checks for due windows. A window is due
#: ``lateness_ms`` after its last point, so this adds at most one tick of delay.
PERCEPTION_TICK_S = 0.01
#: Windows waiting for reasoning. Two: one being decided about, one arriving meanwhile;
#: beyond that reasoning is behind and the oldest window is dropped (and counted).
REASONING_QUEUE_DEPTH = 2


@dataclass(slots=True)
class SourceHealth:
    """What the agent knows about one source beyond its own counters."""

    restarts: int = 0
    last_error: str = ""
    running: bool = False


@dataclass(slots=True)
class RunReport:
    """Totals at the end of a run (and what the periodic log line is made of)."""

    windows: int = 0
    samples: int = 0
    decisions: int = 0
    alarms_raised: int = 0
    perception_overruns: int = 0
    completeness_sum: float = 0.0
    max_jitter_ms: float = 0.0
    last_window: Window | None = None
    sources: dict[str, SourceHealth] = field(default_factory=dict)

    @property
    def mean_completeness(self) -> float:
        return self.completeness_sum / self.windows if self.windows else 0.0


class Agent:
    """Wires the configured sources into perception and keeps them running.

    A source that fails is logged and restarted with jittered backoff; it never takes the
    agent or the other sources down. ``on_window`` (optional) sees every window, e.g. the
    demo printing them; ``on_decision`` every decision.

    With ``[reasoning] enabled`` (the default) the model is loaded here, before anything
    runs: a model that cannot be loaded or does not fit the config raises
    :class:`ReasoningError`, which is fatal at start (the CLI prints it and exits).
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
        on_window: Callable[[Window], None] | None = None,
        on_decision: Callable[[Decision], None] | None = None,
    ) -> None:
        self.config = config
        self.clock_ns = clock_ns
        self.buffer = SampleBuffer(config.queue_size)
        self.aligner = Aligner(config.perception)
        self.stage = build_stage(config) if config.reasoning.enabled else None
        # Opening the store (lock, integrity check, migrations) happens in run().
        self.memory = (
            MemoryStage(
                config.memory,
                config.perception.signals,
                state_dir=config.state_dir,
                period_ns=config.perception.period_ns,
                clock_ns=clock_ns,
            )
            if config.memory.enabled
            else None
        )
        self.sources: list[Source] = [open_source(spec) for spec in config.sources]
        self.report = RunReport(sources={s.name: SourceHealth() for s in self.sources})
        self.reasoning_queue: DropOldestQueue[tuple[Window, float]] = DropOldestQueue(
            REASONING_QUEUE_DEPTH
        )
        self._on_window_cb = on_window
        self._on_decision_cb = on_decision
        self._last_windows = 0
        self._last_time = 0.0
        self._last_label = "normal"
        self._mode = "full"
        self._perception_budget_ms = config.reasoning.budget_ms["perception"]

    async def run(self, stop: asyncio.Event) -> RunReport:
        """Run until ``stop`` is set; then cancel sources, flush perception and return."""
        async with contextlib.AsyncExitStack() as stack:
            if self.memory is not None:
                # Closing it last flushes every batch and writes the final checkpoint.
                await stack.enter_async_context(self.memory)
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._keep_running(src), name=f"source:{src.name}")
                    for src in self.sources
                ]
                tasks.append(tg.create_task(self._perceive(), name="perception"))
                tasks.append(tg.create_task(self._reason(), name="memory+reasoning"))
                if self.memory is not None:
                    tasks.append(tg.create_task(self.memory.run(), name="memory-maintenance"))
                tasks.append(tg.create_task(self._log_stats(), name="stats"))
                await stop.wait()
                for task in tasks:
                    task.cancel()
            # Samples that arrived before the stop still count, and so do their windows.
            self.aligner.push_many(self.buffer.drain())
            self._emit(self.aligner.advance(self.clock_ns()))
            while (item := self.reasoning_queue.get_nowait()) is not None:
                self._decide(*item)
            self._log_line(final=True)
        return self.report

    async def _keep_running(self, source: Source) -> None:
        health = self.report.sources[source.name]
        attempt = 0
        while True:
            health.running = True
            started = time.monotonic()
            try:
                await source.run(self.buffer)
                return
            except DriverError as exc:
                health.last_error = str(exc)
                log.error("source %s failed: %s", source.name, exc)
            except Exception as exc:  # a bug in a driver must not stop the other sources
                health.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("source %s crashed", source.name)
            finally:
                health.running = False
            if time.monotonic() - started > 60:
                attempt = 0
            health.restarts += 1
            delay = backoff_delay(attempt, base_s=0.5, max_s=30.0)
            attempt += 1
            log.info("restarting source %s in %.1f s", source.name, delay)
            await asyncio.sleep(delay)

    async def _perceive(self) -> None:
        while True:
            await asyncio.sleep(PERCEPTION_TICK_S)
            t0 = time.perf_counter_ns()
            samples = self.buffer.drain()
            self.report.samples += len(samples)
            self.aligner.push_many(samples)
            windows = self.aligner.advance(self.clock_ns())
            # Perception's latency of a window: this tick's alignment work, shared by the
            # windows it produced (usually one).
            if windows:
                elapsed_ms = (time.perf_counter_ns() - t0) / 1e6
                self._emit(windows, elapsed_ms / len(windows))

    def _emit(self, windows: list[Window], perception_ms: float = 0.0) -> None:
        if perception_ms > self._perception_budget_ms:
            self.report.perception_overruns += len(windows)
        for w in windows:
            self.report.windows += 1
            self.report.completeness_sum += w.completeness
            self.report.max_jitter_ms = max(self.report.max_jitter_ms, w.max_jitter_ms)
            self.report.last_window = w
            if self._on_window_cb is not None:
                self._on_window_cb(w)
            dropped = self.reasoning_queue.put_nowait((w, perception_ms))
            if dropped is not None:
                log.warning("memory/reasoning is behind: dropped window %d", dropped[0].seq)

    async def _reason(self) -> None:
        while True:
            window, perception_ms = await self.reasoning_queue.get()
            # Inline on the loop, on purpose: memory only appends to its writer's batch (the
            # commit runs in its own thread) and the model's invoke() takes tens of µs; a
            # thread hop would cost more than either.
            self._decide(window, perception_ms)

    def _decide(self, window: Window, perception_ms: float) -> None:
        memory_ms = 0.0
        if self.memory is not None:
            memory_ms = self.memory.process(window, now_ns=self.clock_ns()).latency_ms
        stage = self.stage
        if stage is None:
            return
        d = stage.process(window, self.clock_ns(), perception_ms, memory_ms)
        if self.memory is not None:
            self.memory.record_decision(d, now_ns=d.t_ns, window_seq=d.window_seq)
        mode = stage.breaker.mode  # the mode for the next window
        if mode != self._mode:
            b = stage.breaker
            if mode == "full":
                log.info(
                    "reasoning back to full: model on every window (recovery %d)", b.recoveries
                )
            else:
                log.warning(
                    "reasoning over its %.0f µs budget %d windows in a row: degraded to %s",
                    b.spec.budget_us,
                    b.spec.trip_after,
                    mode,
                )
            self._mode = mode
        self.report.decisions += 1
        self.report.alarms_raised += len(d.raised)
        notable = bool(d.raised or d.cleared) or d.label != self._last_label
        self._last_label = d.label
        level = logging.INFO if notable else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(level, "%s", describe(d))
        if self._on_decision_cb is not None:
            self._on_decision_cb(d)

    async def reload_model(self, model_dir: Path | None = None) -> Scorer:
        """Load, check and serve the model in ``model_dir`` (default: the configured one).

        Reading, hashing and checking the file and compiling the rules run in a thread; the
        loop only does the swap itself, one assignment between two windows. Raises
        :class:`ReasoningError` (the old model keeps serving) when it cannot be loaded or
        does not fit. Returns the model it replaced.
        """
        stage = self.stage
        if stage is None:
            raise ReasoningError("reasoning is disabled in the config")
        rc = self.config.reasoning
        where = model_dir if model_dir is not None else rc.model_dir

        def load() -> PreparedModel:
            try:
                model = load_model(where, backend=rc.backend, threads=rc.threads)
            except ModelError as exc:
                raise ReasoningError(f"reasoning: cannot load {where}: {exc}") from None
            return stage.prepare(model)

        prepared = await asyncio.to_thread(load)
        old = stage.swap(prepared)
        m = prepared.model.manifest
        log.info("model swapped: now %s %s sha256=%s", m.name, m.version, prepared.sha256[:12])
        return old

    async def _log_stats(self) -> None:
        interval = self.config.agent.stats_interval_s
        while True:
            await asyncio.sleep(interval)
            self._log_line()

    def _log_line(self, *, final: bool = False) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time if self._last_time else self.config.agent.stats_interval_s
        rate = (self.report.windows - self._last_windows) / max(elapsed, 1e-9)
        self._last_windows, self._last_time = self.report.windows, now
        st = self.aligner.stats
        w = self.report.last_window
        log.info(
            "%swindows=%d (%.2f/s) completeness=%.3f jitter_ms=%.2f samples=%d "
            "drops: buffer=%d late=%d not_in_window=%d skipped_windows=%d | %s",
            "final: " if final else "",
            self.report.windows,
            rate,
            w.completeness if w is not None else 0.0,
            w.max_jitter_ms if w is not None else 0.0,
            self.report.samples,
            self.buffer.dropped,
            st.late_dropped,
            st.unknown_signal,
            st.windows_skipped,
            "; ".join(f"{s.name}: {_brief(s.stats())}" for s in self.sources),
        )
        if self.stage is not None:
            snap = self.stage.snapshot()
            lat = snap["latency_us"]
            assert isinstance(lat, dict)
            log.info(
                "reasoning: decisions=%d labels=%s alarms=%s mode=%s queue_drops=%d p99_us=%.0f",
                self.report.decisions,
                snap["labels"],
                ",".join(self.stage.tracker.active()) or "-",
                self.stage.breaker.mode,
                self.reasoning_queue.dropped,
                lat["reasoning"]["p99"],
            )
        if self.memory is not None:
            ms = self.memory.stats()
            log.info(
                "memory: windows=%d rows=%d keyframes=%d decisions=%d dropped_windows=%d "
                "snapshots=%d last_snapshot=%s",
                ms["windows"],
                ms["rows"],
                ms["keyframes"],
                ms["decisions"],
                ms["dropped_windows"],
                ms["snapshots"]["taken"],
                ms["snapshots"]["last"] or "-",
            )
        if w is not None:
            means = None
            if not np.isnan(w.values).all():
                with warnings.catch_warnings():
                    # A signal never seen (all NaN) shows as nan; numpy would warn about it.
                    warnings.simplefilter("ignore", RuntimeWarning)
                    means = np.nanmean(w.values, axis=0)
            if means is not None:
                log.info(
                    "last window %s: %s",
                    w.seq,
                    " ".join(
                        f"{name}={m:.2f}{'(stale)' if stale else ''}"
                        for name, m, stale in zip(w.signals, means, w.stale, strict=True)
                    ),
                )

    def status(self) -> dict[str, object]:
        """A JSON-ready snapshot: counters of perception, reasoning, buffer and every source."""
        st = self.aligner.stats
        reasoning: dict[str, object] = {"enabled": self.stage is not None}
        if self.stage is not None:
            q = self.reasoning_queue
            reasoning.update(self.stage.snapshot())
            reasoning["queue"] = {
                "depth": len(q),
                "max": q.maxlen,
                "dropped": q.dropped,
                "high_water": q.high_water,
            }
        return {
            "windows": self.report.windows,
            "mean_completeness": round(self.report.mean_completeness, 4),
            "max_jitter_ms": round(self.report.max_jitter_ms, 3),
            "samples": self.report.samples,
            "buffer": {
                "depth": len(self.buffer),
                "max": self.buffer.maxlen,
                "dropped": self.buffer.dropped,
                "high_water": self.buffer.high_water,
            },
            "perception": {
                "late_dropped": st.late_dropped,
                "unknown_signal": st.unknown_signal,
                "non_finite": st.non_finite,
                "windows_skipped": st.windows_skipped,
                "budget_overruns": self.report.perception_overruns,
            },
            "reasoning": reasoning,
            "memory": self.memory.stats() if self.memory is not None else {"enabled": False},
            "sources": {
                s.name: {
                    **dict(s.stats()),
                    "restarts": self.report.sources[s.name].restarts,
                    "last_error": self.report.sources[s.name].last_error,
                }
                for s in self.sources
            },
        }


def build_stage(config: AgentConfig) -> ReasoningStage:
    """Load the configured model and build the stage. Raises :class:`ReasoningError`.

    Called once at start, before the event loop has other work: the file read and hash
    (a few ms) block nothing yet. Swaps later load in a thread (see :meth:`Agent.reload_model`).
    """
    rc = config.reasoning
    where = str(rc.model_dir) if rc.model_dir is not None else "the committed default model"
    try:
        model = load_model(rc.model_dir, backend=rc.backend, threads=rc.threads)
    except ModelError as exc:
        raise ReasoningError(f"reasoning: cannot load {where}: {exc}") from None
    try:
        stage = ReasoningStage(model, rc.rules, perception=config.perception, breaker=rc.breaker)
    except ModelMismatch as exc:
        raise ModelMismatch(f"reasoning: {where} does not fit this config: {exc}") from None
    m = model.manifest
    log.info(
        "reasoning: model %s %s sha256=%s backend=%s threads=%d",
        m.name,
        m.version,
        model.sha256[:12],
        model.backend,
        rc.threads,
    )
    return stage


def describe(d: Decision) -> str:
    """One log line for a decision."""
    parts = [f"decision window={d.window_seq} label={d.label}"]
    if d.score == d.score:  # not NaN
        parts.append(f"score={d.score:.3f}")
    parts.append(f"alarms={','.join(sorted(d.alarms)) or '-'}")
    if d.raised:
        parts.append(f"RAISED={','.join(d.raised)}")
    if d.cleared:
        parts.append(f"cleared={','.join(d.cleared)}")
    if d.top_signals:
        parts.append("top=" + ",".join(f"{s}:{c:.2f}" for s, c in d.top_signals))
    if d.rules_fired:
        parts.append("rules=" + "; ".join(f"{r.rule}: {r.reason}" for r in d.rules_fired))
    if d.degraded:
        parts.append(f"mode={d.mode}")
    lat = d.stage_latency_ms
    parts.append(
        f"model={d.model_sha256[:12]}{'' if d.model_ran else '(held)'} "
        f"ms=p{lat['perception']:.3f}/m{lat['memory']:.3f}/r{lat['reasoning']:.3f}"
    )
    return " ".join(parts)


def _brief(stats: Mapping[str, int | float | str]) -> str:
    keys = ("state", "frames", "replies", "samples", "timeouts", "reconnects", "unknown_frames")
    return " ".join(f"{k}={stats[k]}" for k in keys if k in stats)


async def run_until_signalled(agent: Agent, duration_s: float | None = None) -> RunReport:
    """Run ``agent`` until SIGINT/SIGTERM (or ``duration_s``), for the CLI."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    if duration_s is not None:
        loop.call_later(duration_s, stop.set)
    return await agent.run(stop)
