"""The running agent: sources -> perception -> memory -> reasoning, under a gate schedule.

This is the I/O shell around the pure parts: it owns the clock, the tasks, the API and the
logs. Every task runs in one ``TaskGroup`` and has a name; every queue is bounded and drops
its oldest window, counted, when the pipeline falls behind (memory waits while reasoning's
queue is full, so a window waits in one bounded place). Each stage works inside its gate of
the ``[schedule]`` gate control list (:mod:`edge_agent.gates`); the Decision goes to the
log, memory and the uplink's outbox from :meth:`Agent._decide`. On SIGTERM/SIGINT the
queued windows run through every stage regardless of gates and memory is flushed. How a
window travels: ``docs/ARCHITECTURE.md``, "Data flow on the device".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drivers.backoff import backoff_delay
from drivers.buffer import SampleBuffer
from drivers.errors import DriverError
from drivers.source import Source
from edge_agent.acquisition import contract_check
from edge_agent.agent_status import AgentReporting, RunReport, SourceHealth
from edge_agent.api import HealthApi
from edge_agent.config import AgentConfig
from edge_agent.errors import ModelMismatch, ReasoningError, SelfTestFailed, ServiceError
from edge_agent.gates import GateScheduler
from edge_agent.gcl import STAGES
from edge_agent.health_report import log_contract, report_notices, state_health
from edge_agent.looptrace import LoopTrace
from edge_agent.metrics import AgentMetrics
from edge_agent.parts import AgentParts
from edge_agent.perception import Aligner, Window
from edge_agent.probe import Probe, ProbeResult, run_probe
from edge_agent.reasoning import (
    DropOldestQueue,
    PreparedModel,
    ReasoningStage,
    Scorer,
)
from edge_agent.rules import Decision
from edge_agent.sdnotify import Notifier, watchdog_interval_s, watchdog_loop
from edge_agent.uplink.publisher import Uplink
from edge_agent.uplink.telemetry import (
    Aggregate,
    DeltaEncoder,
    TelemetryAggregator,
    telemetry_batch_msg,
)
from edge_agent.warm import load_kernels
from models import LoadedModel
from models.errors import ModelError
from models.kernels import pending as kernels_pending
from models.kernels import unavailable_reason
from models.selftest import KnownAnswersFailed, SelfTest, load_checked
from wire.messages import Message, SignalStats

log = logging.getLogger(__name__)

#: Windows waiting for memory. A gate normally sees one or two windows; after a stall
#: perception catches up with up to ``max_catch_up_windows`` at once, and beyond this the
#: oldest are dropped (counted).
MEMORY_QUEUE_DEPTH = 8
#: Windows waiting for reasoning. Two: one being decided about, one arriving meanwhile;
#: beyond that reasoning is behind and the oldest window is dropped (and counted).
REASONING_QUEUE_DEPTH = 2
#: Latencies kept for the percentiles in status(); 10,000 gives a meaningful P99.9.
LATENCY_HISTORY = 10_000
#: sys.setswitchinterval while the agent runs (see Agent.run).
GIL_SWITCH_INTERVAL_S = 0.0005
#: Send READY=1 even when a source is not up after this long: systemd would otherwise kill
#: and restart an agent whose PLC is simply switched off, which helps nobody.
READY_GRACE_S = 10.0


@dataclass(slots=True)
class _InFlight:
    """A window between stages, with what the stages before measured."""

    window: Window
    perception_ms: float
    memory_ms: float = 0.0


class Agent(AgentReporting):
    """Wires the configured sources through the stages and keeps them running.

    A source that fails is logged and restarted with jittered backoff; it never takes the
    agent or the other sources down. ``on_window`` (optional) sees every window, e.g. the
    demo printing them; ``on_decision`` every decision.

    Built by :func:`edge_agent.compose.build_agent` from a config: ``parts`` are its
    collaborators (stage, memory, sources, OTA, uplink), already made and checked.
    ``notifier`` is systemd's (default: from ``NOTIFY_SOCKET``, a no-op without it).
    """

    def __init__(
        self,
        parts: AgentParts,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
        on_window: Callable[[Window], None] | None = None,
        on_decision: Callable[[Decision], None] | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        config = parts.config
        self.config = config
        self.clock_ns = clock_ns
        self.started_mono = time.monotonic()
        self.buffer = SampleBuffer(config.queue_size)
        self.aligner = Aligner(config.perception)
        self.ota = parts.ota
        self.stage = parts.stage
        self.memory = parts.memory
        self.sources: list[Source] = parts.sources
        self.report = RunReport(sources={s.name: SourceHealth() for s in self.sources})
        self.memory_queue: DropOldestQueue[_InFlight] = DropOldestQueue(MEMORY_QUEUE_DEPTH)
        self.reasoning_queue: DropOldestQueue[_InFlight] = DropOldestQueue(REASONING_QUEUE_DEPTH)
        self.metrics = AgentMetrics()
        self.metrics.register_status(self.status)
        self.gcl = config.gate_control_list
        #: Reasoning may pull more windows through memory in its gate: only when every
        #: entry that opens reasoning's gate opens memory's too (the default schedule).
        self._catch_up = all("memory" in e.gates for e in self.gcl.gates_of("reasoning"))
        self.scheduler = GateScheduler(
            self.gcl,
            {
                "perception": self._gate_perception,
                "memory": self._gate_memory,
                "reasoning": self._gate_reasoning,
            },
            clock_ns=clock_ns,
            on_gate=self._on_gate,
        )
        #: Gate runs each stage completed: what the systemd watchdog checks.
        self.progress: dict[str, int] = dict.fromkeys(STAGES, 0)
        self.stage_errors: dict[str, int] = dict.fromkeys(STAGES, 0)
        self._failing: set[str] = set()
        self.e2e_us: deque[float] = deque(maxlen=LATENCY_HISTORY)
        self.memory_us: deque[float] = deque(maxlen=LATENCY_HISTORY)
        self.notifier = notifier if notifier is not None else Notifier.from_env()
        self.ready_s: float | None = None
        self._lateness_ns = round(config.perception.lateness_ms * 1e6)
        self._on_window_cb = on_window
        self._on_decision_cb = on_decision
        self._last_windows = 0
        self._last_time = 0.0
        self._last_label = "normal"
        self._mode = "full"
        self._budget_ms = config.reasoning.budget_ms
        self._api: HealthApi | None = None
        #: ``edge-agent run --trace``: every window's path to its decision (None: off).
        self.trace: LoopTrace | None = None
        self.last_swap_ns = 0
        #: Set when OTA needs this process replaced (a new agent build, or its rollback):
        #: the agent stops and the CLI exits with EXIT_RESTART for systemd to restart it.
        self.restart_requested: str | None = None
        #: Runs once the compiled kernels serve (loaded after READY: edge_agent.warm); the
        #: CLI keeps what numba built out of the garbage collector's scans.
        self.on_kernels_loaded: Callable[[], None] = lambda: None
        #: Set once the agent runs as it will from now on: READY, and the compiled kernels
        #: serving (or not to be loaded). Until then the stage is ``warming``.
        self.settled = asyncio.Event()
        if self.stage is not None and self._kernels_pending():
            self.stage.warming = True
        self._stop: asyncio.Event | None = None
        self.loop_name = "-"
        up = parts.uplink
        self.uplink: Uplink | None = up.uplink if up is not None else None
        self.telemetry: TelemetryAggregator | None = up.telemetry if up is not None else None
        self.delta: DeltaEncoder | None = up.delta if up is not None else None
        self._telemetry_batch: list[tuple[Aggregate, bool, Mapping[str, SignalStats]]] = []
        if self.ota is not None:
            # Last: OTA acts on the agent only once it is whole.
            self.ota.attach(self)

    def model_sha256(self) -> str:
        """The serving model's sha256 ("" with reasoning off)."""
        return self.stage.model.sha256 if self.stage is not None else ""

    def last_window(self) -> Window | None:
        """The latest window perception emitted (None before the first)."""
        return self.report.last_window

    @property
    def signals(self) -> Sequence[str]:
        return self.config.perception.signals

    @property
    def api_port(self) -> int | None:
        """The health API's bound port once it runs (useful with ``port = 0``)."""
        return self._api.port if self._api is not None else None

    def windows_per_s(self) -> float:
        """Windows scored per second: what an OTA bundle's probation may count on."""
        return self.config.perception.windows_per_s

    def rss_bytes(self) -> int | None:
        """This process's resident memory (the OTA probation's memory rule), or None."""
        try:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None

    def request_restart(self, why: str) -> None:
        """Stop as on SIGTERM, then have the CLI exit with :data:`EXIT_RESTART`. On the
        event loop: the stop is a timer there (a worker thread returns what to restart)."""
        self.restart_requested = why
        log.warning("restart requested: %s", why)
        if self._stop is not None:
            # A second for the OTA status to reach the outbox and the broker first.
            asyncio.get_running_loop().call_later(1.0, self._stop.set)

    async def run(self, stop: asyncio.Event) -> RunReport:
        """Run until ``stop`` is set; then stop sources and gates, drain and return."""
        self._stop = stop
        self.loop_name = type(asyncio.get_running_loop()).__module__.split(".")[0]
        # A thread that holds the GIL (the CAN readers, the memory writer) keeps the loop
        # waiting up to the switch interval before it must let go: 5 ms by default, half the
        # gate cycle. 0.5 ms bounds that wait; the extra switches cost little here.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        async with contextlib.AsyncExitStack() as stack:
            if self.memory is not None:
                # Closing it last flushes every batch and writes the final checkpoint.
                await stack.enter_async_context(self.memory)
            if self.config.api.enabled:
                api = self.config.api
                self._api = HealthApi(self, api)
                try:
                    await stack.enter_async_context(self._api)
                except OSError as exc:
                    if exc.errno == errno.EADDRINUSE:
                        raise ServiceError(
                            f"api.port: {api.host}:{api.port} is already in use (another "
                            "edge-agent?); set another [api] port, or [api] enabled = false"
                        ) from None
                    raise ServiceError(
                        f"api.host: the health API cannot listen on {api.host}:{api.port}: "
                        f"{exc.strerror or exc}"
                    ) from None
            if self.ota is not None:
                # Before any window is scored: finish or undo what a crash interrupted.
                await self.ota.start()
            # Two levels: the uplink outlives the other tasks, so that whatever way they end
            # (stop, or one of them crashing and the group cancelling the rest) the drain
            # still runs and its last windows, decisions and telemetry reach the outbox
            # before the uplink gets its last second to flush it.
            crashed: BaseExceptionGroup[BaseException] | None = None
            async with asyncio.TaskGroup() as outer:
                uplink_task = (
                    outer.create_task(self.uplink.run(), name="uplink")
                    if self.uplink is not None
                    else None
                )
                try:
                    async with asyncio.TaskGroup() as tg:
                        tasks = [
                            tg.create_task(self._keep_running(src), name=f"source:{src.name}")
                            for src in self.sources
                        ]
                        tasks.append(tg.create_task(self.scheduler.run(), name="gates"))
                        if self.memory is not None:
                            tasks.append(
                                tg.create_task(self.memory.run(), name="memory-maintenance")
                            )
                        tasks.append(tg.create_task(self._log_stats(), name="stats"))
                        tasks.append(tg.create_task(self._announce_ready(), name="ready"))
                        interval = watchdog_interval_s()
                        if interval is not None:
                            watchdog = watchdog_loop(
                                self.notifier, self._progress, self._watched_stages(), interval
                            )
                            tasks.append(tg.create_task(watchdog, name="watchdog"))
                        await stop.wait()
                        self.notifier.stopping()
                        await self._wind_down(tasks[: len(self.sources)], tasks)
                except BaseExceptionGroup as group:
                    # A task crashed and the group cancelled the others: drain, let the
                    # uplink flush, then raise the crash as it came (not nested in `outer`).
                    crashed = group
                    log.error(
                        "agent task failed (%s); draining what was accepted before stopping",
                        "; ".join(f"{type(e).__name__}: {e}" for e in group.exceptions),
                    )
                finally:
                    try:
                        self._drain()
                    except Exception:
                        # A crash already on its way out must not be masked by the drain's.
                        log.exception("the shutdown drain failed")
                    if uplink_task is not None:
                        uplink_task.cancel()
            self._log_line(final=True)
            if crashed is not None:
                raise crashed
        return self.report

    # -- readiness and liveness -------------------------------------------------------------

    def _progress(self) -> Mapping[str, int]:
        return self.progress

    def _watched_stages(self) -> tuple[str, ...]:
        return STAGES

    async def _announce_ready(self) -> None:
        """READY=1 once every source is up (or after :data:`READY_GRACE_S`, saying which not);
        then the compiled kernels that start-up left for later (:meth:`_kernels_after_ready`)."""
        deadline = time.monotonic() + READY_GRACE_S
        while True:
            up = self.sources_up()
            down = [name for name, ok in up.items() if not ok]
            if not down or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.02)
        self.ready_s = time.monotonic() - self.started_mono
        text = "running" if not down else f"running; not up yet: {', '.join(down)}"
        self.notifier.ready(status=text)
        if down:
            log.warning("ready after %.1f s with sources not up: %s", self.ready_s, ", ".join(down))
        else:
            log.info("ready: %d source(s) up after %.2f s", len(up), self.ready_s)
        await self._kernels_after_ready()

    def _kernels_pending(self) -> bool:
        stage = self.stage
        return stage is not None and self.config.reasoning.jit is None and not stage.model_jit

    async def _kernels_after_ready(self) -> None:
        """With ``jit = "auto"`` the model started on numpy (see :func:`build_stage`): load,
        check and switch to the compiled kernels now (:mod:`edge_agent.warm`); the agent
        is :attr:`settled` after that."""
        stage = self.stage
        try:
            if stage is not None and self._kernels_pending():
                await load_kernels(stage, self.on_kernels_loaded)
        except Exception:  # the numpy path serves on: a failed load must not stop it
            log.exception("reasoning: loading the compiled kernels failed; numpy serves")
        finally:
            if stage is not None:
                stage.warming = False
            self.settled.set()

    # -- sources ----------------------------------------------------------------------------

    @staticmethod
    async def _wind_down(sources: list[asyncio.Task[None]], tasks: list[asyncio.Task[Any]]) -> None:
        """Cancel the source tasks and wait for them while the gates go on deciding windows
        on time, then cancel every task: a CAN reader takes up to its recv timeout to stop,
        and the windows falling due meanwhile would otherwise all wait for the drain."""
        for task in sources:
            task.cancel()
        if sources:
            await asyncio.wait(sources)
        for task in tasks:
            task.cancel()

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

    # -- the stages, each called by the gate scheduler inside its gate ------------------------

    def _guarded(self, stage: str, work: Callable[[], int]) -> None:
        """Run one gate's work (which returns how many windows it handled).

        A bug in a stage is logged and counted, never fatal; the stage then counts as
        failing (no progress for the watchdog) until it handles a window successfully again.
        An empty gate keeps the stage's state: it proves the gate opens, not that the
        stage can do its work.
        """
        try:
            handled = work()
        except Exception:
            self._failing.add(stage)
            self.stage_errors[stage] += 1
            if self.stage_errors[stage] <= 10 or self.stage_errors[stage] % 1000 == 0:
                log.exception("%s failed (%d times)", stage, self.stage_errors[stage])
            return
        if handled:
            self._failing.discard(stage)
        if stage not in self._failing:
            self.progress[stage] += 1

    def _on_gate(self, entry: str, lateness_s: float) -> None:
        self.metrics.observe_gate(entry, lateness_s)
        if self.trace is not None:
            self.trace.gate(lateness_s)

    def _gate_perception(self, close_ns: int) -> None:
        self._guarded("perception", self._perceive)

    def _gate_memory(self, close_ns: int) -> None:
        self._guarded("memory", lambda: self._remember(close_ns))

    def _gate_reasoning(self, close_ns: int) -> None:
        self._guarded("reasoning", lambda: self._reason(close_ns))
        # After a stall perception hands on several windows at once, and memory passes on
        # only what reasoning's short queue holds: alone, the backlog would drain one
        # window per cycle, keeping the windows behind it late for as many cycles as the
        # stall lasted. While the gate is open, both stages go on until memory is empty.
        rounds = 0
        while (
            self._catch_up
            and len(self.memory_queue)
            and self.clock_ns() < close_ns
            and rounds <= MEMORY_QUEUE_DEPTH
        ):
            rounds += 1
            self._guarded("memory", lambda: self._remember(close_ns))
            self._guarded("reasoning", lambda: self._reason(close_ns))
        if self.trace is not None:
            self.trace.gate_done()

    def _perceive(self) -> int:
        t0 = time.perf_counter_ns()
        samples = self.buffer.drain()
        self.report.samples += len(samples)
        self.aligner.push_many(samples)
        windows = self.aligner.advance(self.clock_ns())
        if windows:
            # Perception's latency of a window: this gate's alignment work, shared by the
            # windows it produced (usually one).
            self._emit(windows, (time.perf_counter_ns() - t0) / 1e6 / len(windows))
        # Draining and advancing is the whole job; it succeeded even with no window due.
        return 1

    def _emit(self, windows: list[Window], perception_ms: float = 0.0) -> None:
        if perception_ms > self._budget_ms["perception"]:
            self.report.perception_overruns += len(windows)
        for w in windows:
            self.report.windows += 1
            self.report.completeness_sum += w.completeness
            self.report.max_jitter_ms = max(self.report.max_jitter_ms, w.max_jitter_ms)
            self.report.last_window = w
            if self._on_window_cb is not None:
                self._on_window_cb(w)
            if self.telemetry is not None:
                for agg in self.telemetry.add(w):
                    self._publish_telemetry(agg)
            if self.trace is not None:
                self.trace.emitted(w.seq)
            dropped = self.memory_queue.put_nowait(_InFlight(w, perception_ms))
            if dropped is not None:
                log.warning("pipeline behind: dropped window %d before memory", dropped.window.seq)

    def _remember(self, close_ns: int | None) -> int:
        """Store queued windows and pass them on, while the gate is open and reasoning has room."""
        q, out = self.memory_queue, self.reasoning_queue
        handled = 0
        while len(q) and (close_ns is None or self.clock_ns() < close_ns):
            if self.stage is not None and len(out) >= out.maxlen:
                break  # reasoning is behind: the window waits here (bounded) instead
            item = q.get_nowait()
            assert item is not None
            handled += 1
            if self.memory is not None:
                ctx = self.memory.process(item.window, now_ns=self.clock_ns())
                item.memory_ms = ctx.latency_ms
                self.memory_us.append(ctx.latency_ms * 1000.0)
                if item.memory_ms > self._budget_ms["memory"]:
                    self.report.memory_overruns += 1
            if self.stage is None:
                continue
            dropped = out.put_nowait(item)
            if dropped is not None:
                log.warning("reasoning is behind: dropped window %d", dropped.window.seq)
        return handled

    def _reason(self, close_ns: int | None) -> int:
        q = self.reasoning_queue
        handled = 0
        while len(q) and (close_ns is None or self.clock_ns() < close_ns):
            item = q.get_nowait()
            assert item is not None
            handled += 1
            self._decide(item)
        return handled

    def _drain(self) -> None:
        """At shutdown: every sample and window still in the agent goes through every stage."""
        self.aligner.push_many(self.buffer.drain())
        self._emit(self.aligner.advance(self.clock_ns()))
        while len(self.memory_queue) or len(self.reasoning_queue):
            # Guarded like the gates: a stage failing on one window must not turn a clean
            # stop into a crash or strand the windows behind it (each failure drops one).
            self._guarded("memory", lambda: self._remember(None))
            self._guarded("reasoning", lambda: self._reason(None))
        if self.telemetry is not None:
            for agg in self.telemetry.flush():
                self._publish_telemetry(agg)
            self._flush_telemetry()

    def _decide(self, item: _InFlight) -> None:
        stage = self.stage
        if stage is None:
            return
        window = item.window
        d = stage.process(window, self.clock_ns(), item.perception_ms, item.memory_ms)
        # The decision exists once process returns: the window's latency runs to here (its
        # t_ns, the instant it is about, is when reasoning took the window up).
        decided_ns = self.clock_ns()
        if d.notices:
            report_notices(d, self.memory, self.uplink)
        if self.memory is not None:
            self.memory.record_decision(d, now_ns=d.t_ns, window_seq=d.window_seq)
        if self.uplink is not None:
            self.uplink.publish_decision(d)
        if self.ota is not None:
            self.ota.on_decision(d)
        # End to end: from the instant the window could close (its last grid point plus
        # the lateness allowance) to its decision.
        due_ns = window.end_ns + self._lateness_ns
        e2e_ns = decided_ns - due_ns
        self.e2e_us.append(e2e_ns / 1000.0)
        if self.trace is not None:
            self.trace.decided(window.seq, due_ns, decided_ns)
        self.metrics.observe_decision(d.stage_latency_ms, e2e_ns / 1e9, d.label)
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

    def model_health(self) -> dict[str, object] | None:
        """The serving model's health for the retained state (None when all is well)."""
        return state_health(self.stage)

    def _publish_telemetry(self, agg: Aggregate) -> None:
        """One period's statistics (a keyframe, or only what moved) into the current batch;
        a full batch (``uplink.telemetry_batch`` periods) goes to the outbox as one message."""
        if self.delta is not None:
            keyframe, signals = self.delta.encode(agg)
            if keyframe or signals:  # else nothing moved past its deadband: nothing to send
                self._telemetry_batch.append((agg, keyframe, signals))
        else:
            signals = {name: SignalStats(*st) for name, st in agg.stats.items()}
            self._telemetry_batch.append((agg, True, signals))
        if len(self._telemetry_batch) >= self.config.uplink.telemetry_batch:
            self._flush_telemetry()

    def _flush_telemetry(self) -> None:
        batch, self._telemetry_batch = self._telemetry_batch, []
        if not batch or self.uplink is None:
            return
        device = self.config.agent.device

        def build(boot_id: str, seq: int) -> Message:
            return telemetry_batch_msg(batch, device=device, boot_id=boot_id, seq=seq)

        self.uplink.publish("telemetry", build)

    # -- the health API's view --------------------------------------------------------------

    def probe(self, probe: Probe) -> ProbeResult:
        """Push a probe through perception, memory and reasoning without touching their state."""
        return run_probe(
            probe,
            spec=self.config.perception,
            last=self.report.last_window,
            memory=self.memory,
            reasoning=self.stage,
            now_ns=self.clock_ns(),
        )

    async def ota_request(self, action: str, arg: str) -> tuple[int, Mapping[str, Any]]:
        if self.ota is None:
            return 409, {"result": "failed", "reason": "OTA is disabled ([ota] enabled = false)"}
        if action == "install":
            path = Path(arg)
            if not path.is_absolute():
                return 400, {"result": "failed", "reason": f"not an absolute path: {arg}"}
            outcome = await self.ota.install_file(path)
        else:
            if arg not in ("model", "config", "agent"):
                return 400, {"result": "failed", "reason": f"unknown kind {arg!r}"}
            outcome = await self.ota.updater.rollback(arg)
        done = "committed" if action == "install" else "rolled_back"
        code = {done: 200, "restart": 202, "busy": 409}.get(outcome.result, 422)
        return code, {"result": outcome.result, "reason": outcome.reason, "code": outcome.code}

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
            # Loaded, then its known answers checked (falling back to the builtin kernels
            # when the delegate's are wrong), all in this worker thread.
            model = load_tested(where, rc.backend, rc.threads, rc.jit)
            return stage.prepare(model)

        try:
            prepared = await asyncio.to_thread(load)
        except (ModelMismatch, SelfTestFailed) as exc:
            # Its rules or its input contract do not fit this config, or its arithmetic is
            # wrong here: the old model serves.
            stage.stats.swaps_refused += 1
            log.error("model swap refused, the serving model stays: %s", exc)
            raise
        log_contract(prepared.contract)
        log_selftest(prepared.model)
        t0 = time.perf_counter_ns()
        old = stage.swap(prepared)
        #: What the swap itself held the loop for, ns (bench.ota reports it).
        self.last_swap_ns = time.perf_counter_ns() - t0
        m = prepared.model.manifest
        log.info("model swapped: now %s %s sha256=%s", m.name, m.version, prepared.sha256[:12])
        return old

    # -- reporting --------------------------------------------------------------------------


def _numpy_reason(jit: bool | None, configured: bool | None) -> str:
    """Why the features run on numpy: the config first, then what stopped the kernels."""
    if configured is False:
        return "reasoning.jit = off"
    if jit is False:
        return "compiled kernels load after ready"
    return unavailable_reason() or "compiled kernels unavailable"


def build_stage(config: AgentConfig, *, contract: bool = True) -> ReasoningStage:
    """Load the configured model and build the stage. Raises :class:`ReasoningError`.

    Called once at start, before the event loop has other work: the file read and hash
    (a few ms) block nothing yet. Swaps later load in a thread (see :meth:`Agent.reload_model`).
    With ``contract`` (the agent always), every model the stage prepares is checked against
    the config's acquisition (:mod:`edge_agent.acquisition`): a mismatch is a
    :class:`ModelMismatch` unless ``[reasoning] acquisition = "accept-mismatch"``, which
    is logged once here. ``check-config`` passes False and reports the findings itself.
    """
    rc = config.reasoning
    where = str(rc.model_dir) if rc.model_dir is not None else "the committed default model"
    # "auto" starts on numpy when the kernels are not loaded yet: the agent loads them
    # after READY (edge_agent.warm), ~0.7 s of a start.
    jit = False if rc.jit is None and kernels_pending() else rc.jit
    model = load_tested(rc.model_dir, rc.backend, rc.threads, jit)
    try:
        stage = ReasoningStage(
            model,
            rc.rules,
            perception=config.perception,
            breaker=rc.breaker,
            contract=contract_check(config) if contract else None,
        )
    except ModelMismatch as exc:
        raise ModelMismatch(f"reasoning: {where} does not fit this config: {exc}") from None
    m = model.manifest
    log.info(
        "reasoning: model %s %s sha256=%s backend=%s threads=%d features=%s",
        m.name,
        m.version,
        model.sha256[:12],
        model.backend,
        rc.threads,
        "compiled" if model.jit else f"numpy ({_numpy_reason(jit, rc.jit)})",
    )
    log_contract(stage.prepared.contract)
    log_selftest(model)
    return stage


def load_tested(
    where: Path | None, backend: str | None, threads: int, jit: bool | None
) -> LoadedModel:
    """Load the model in ``where`` (None: the committed default) and run its known-answer
    self-test (:func:`models.selftest.load_checked`). Raises :class:`SelfTestFailed` when
    no kernel set gives the known answers, :class:`ReasoningError` when it cannot load.
    File I/O and a few ms of invokes: call it from a thread once the loop runs."""
    name = str(where) if where is not None else "the committed default model"
    try:
        return load_checked(where, backend=backend, threads=threads, jit=jit)
    except KnownAnswersFailed as exc:
        raise SelfTestFailed(f"reasoning: {name} is not served: {exc}") from None
    except ModelError as exc:
        raise ReasoningError(f"reasoning: cannot load {name}: {exc}") from None


def log_selftest(model: object) -> None:
    """The self-test's verdict for the model now serving, one line (WARNING when it fell
    back to the builtin kernels or had no known answers)."""
    result = getattr(model, "selftest", None)
    if not isinstance(result, SelfTest):
        return
    worse = result.fallback is not None or result.result != "passed"
    log.log(logging.WARNING if worse else logging.INFO, "reasoning: %s", result.line())


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


async def run_until_signalled(
    agent: Agent,
    duration_s: float | None = None,
    *,
    alongside: Callable[[asyncio.Event], Coroutine[Any, Any, None]] | None = None,
) -> RunReport:
    """Run ``agent`` until SIGINT/SIGTERM (or ``duration_s``), for the CLI.

    ``alongside`` (e.g. the demo's live view) runs next to the agent and is told, through
    the event it gets, when the agent has finished (its final flush included).
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    if duration_s is not None:
        loop.call_later(duration_s, stop.set)
    if alongside is None:
        return await agent.run(stop)
    done = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(alongside(done), name="alongside")
        try:
            report = await agent.run(stop)
        finally:
            done.set()
    return report
