"""The running agent: sources -> bounded buffer -> perception, in one TaskGroup.

This is the I/O shell around the pure parts: it owns the clock, the tasks and the logs.
Later stages (memory, reasoning, uplink) plug in behind :meth:`Agent._on_window`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from drivers.backoff import backoff_delay
from drivers.buffer import SampleBuffer
from drivers.errors import DriverError
from drivers.source import Source, open_source
from edge_agent.config import AgentConfig
from edge_agent.perception import Aligner, Window

log = logging.getLogger(__name__)

#: How often perception drains the buffer and checks for due windows. A window is due
#: ``lateness_ms`` after its last point, so this adds at most one tick of delay.
PERCEPTION_TICK_S = 0.01


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
    demo printing them; later issues put memory and reasoning there.
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
        on_window: Callable[[Window], None] | None = None,
    ) -> None:
        self.config = config
        self.clock_ns = clock_ns
        self.buffer = SampleBuffer(config.queue_size)
        self.aligner = Aligner(config.perception)
        self.sources: list[Source] = [open_source(spec) for spec in config.sources]
        self.report = RunReport(sources={s.name: SourceHealth() for s in self.sources})
        self._on_window_cb = on_window
        self._last_windows = 0
        self._last_time = 0.0

    async def run(self, stop: asyncio.Event) -> RunReport:
        """Run until ``stop`` is set; then cancel sources, flush perception and return."""
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(self._keep_running(src), name=f"source:{src.name}")
                for src in self.sources
            ]
            tasks.append(tg.create_task(self._perceive(), name="perception"))
            tasks.append(tg.create_task(self._log_stats(), name="stats"))
            await stop.wait()
            for task in tasks:
                task.cancel()
        # Samples that arrived before the stop still count.
        self.aligner.push_many(self.buffer.drain())
        self._emit(self.aligner.advance(self.clock_ns()))
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
            samples = self.buffer.drain()
            self.report.samples += len(samples)
            self.aligner.push_many(samples)
            self._emit(self.aligner.advance(self.clock_ns()))

    def _emit(self, windows: list[Window]) -> None:
        for w in windows:
            self.report.windows += 1
            self.report.completeness_sum += w.completeness
            self.report.max_jitter_ms = max(self.report.max_jitter_ms, w.max_jitter_ms)
            self.report.last_window = w
            if self._on_window_cb is not None:
                self._on_window_cb(w)

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
        if w is not None:
            means = np.nanmean(w.values, axis=0) if not np.isnan(w.values).all() else None
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
        """A JSON-ready snapshot: counters of perception, buffer and every source."""
        st = self.aligner.stats
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
            },
            "sources": {
                s.name: {
                    **dict(s.stats()),
                    "restarts": self.report.sources[s.name].restarts,
                    "last_error": self.report.sources[s.name].last_error,
                }
                for s in self.sources
            },
        }


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
