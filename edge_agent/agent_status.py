"""What the agent tells about itself: ``/v1/status``, the health verdict and the log lines.

:class:`AgentReporting` is a part of :class:`edge_agent.service.Agent` (a mixin): it reads
the agent's parts, declared below with their types, and changes nothing but the log line's
rate bookkeeping. The status keys are described in ``docs/ARCHITECTURE.md`` and read by
:mod:`edge_agent.metrics_status`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_agent import __version__
from edge_agent.gcl import STAGES
from edge_agent.reasoning import percentiles

if TYPE_CHECKING:
    from drivers.buffer import SampleBuffer
    from drivers.source import Source
    from edge_agent.config import AgentConfig
    from edge_agent.gates import GateScheduler
    from edge_agent.memory.stage import MemoryStage
    from edge_agent.ota import AgentOta
    from edge_agent.perception import Aligner, Window
    from edge_agent.reasoning import DropOldestQueue, ReasoningStage
    from edge_agent.uplink.publisher import Uplink

log = logging.getLogger("edge_agent.service")


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
    memory_overruns: int = 0
    completeness_sum: float = 0.0
    max_jitter_ms: float = 0.0
    last_window: Window | None = None
    sources: dict[str, SourceHealth] = field(default_factory=dict)

    @property
    def mean_completeness(self) -> float:
        return self.completeness_sum / self.windows if self.windows else 0.0


def _is_up(stats: Mapping[str, int | float | str]) -> bool:
    """The source's own verdict (``up``, see :class:`drivers.source.Source`): a bus open, a
    unit answering. Data that came in earlier does not count: the device may be gone."""
    return stats.get("up") == 1


def _brief(stats: Mapping[str, int | float | str]) -> str:
    keys = (
        "up",
        "state",
        "frames",
        "replies",
        "samples",
        "timeouts",
        "reconnects",
        "unknown_frames",
    )
    return " ".join(f"{k}={stats[k]}" for k in keys if k in stats)


class AgentReporting:
    """Status, health and log lines of the agent (see the module docstring)."""

    config: AgentConfig
    aligner: Aligner
    report: RunReport
    buffer: SampleBuffer
    memory_queue: DropOldestQueue[Any]
    reasoning_queue: DropOldestQueue[Any]
    progress: dict[str, int]
    stage_errors: dict[str, int]
    e2e_us: deque[float]
    memory_us: deque[float]
    stage: ReasoningStage | None
    memory: MemoryStage | None
    scheduler: GateScheduler
    uplink: Uplink | None
    ota: AgentOta | None
    sources: list[Source]
    started_mono: float
    ready_s: float | None
    loop_name: str
    restart_requested: str | None
    _last_windows: int
    _last_time: float

    def sources_up(self) -> dict[str, bool]:
        """Whether each source runs and reaches what it reads (its own ``up``)."""
        return {
            s.name: self.report.sources[s.name].running and _is_up(s.stats()) for s in self.sources
        }

    def health_status(self) -> str:
        """``ok``, or ``degraded`` when a source is down, reasoning degraded, the model's
        inputs out of distribution or its alarms a storm, or a stage failing."""
        if not all(self.sources_up().values()):
            return "degraded"
        if self.stage is not None and self.stage.breaker.mode != "full":
            return "degraded"
        if self.stage is not None and (
            self.stage.health.ood.active or self.stage.health.storm.active
        ):
            return "degraded"  # the model's verdicts cannot be trusted (edge_agent.ood)
        if self.uplink is not None and not self.uplink.stats().get("connected"):
            return "degraded"
        if any(
            self.report.sources[s.name].last_error and not self.report.sources[s.name].running
            for s in self.sources
        ):
            return "degraded"
        return "ok"

    async def _log_stats(self) -> None:
        interval = self.config.agent.stats_interval_s
        while True:
            await asyncio.sleep(interval)
            self._log_line()

    def _log_line(self, *, final: bool = False) -> None:
        if not log.isEnabledFor(logging.INFO):
            return  # the percentiles below cost ms on the loop; nobody would read them
        now = time.monotonic()
        elapsed = now - self._last_time if self._last_time else self.config.agent.stats_interval_s
        rate = (self.report.windows - self._last_windows) / max(elapsed, 1e-9)
        self._last_windows, self._last_time = self.report.windows, now
        st = self.aligner.stats
        w = self.report.last_window
        log.info(
            "%swindows=%d (%.2f/s) completeness=%.3f jitter_ms=%.2f samples=%d "
            "drops: buffer=%d late=%d unknown_signal=%d skipped_windows=%d | %s",
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
                self.reasoning_queue.dropped + self.memory_queue.dropped,
                lat["reasoning"]["p99"],
            )
        g = self.scheduler.snapshot()
        log.info(
            "gates: e2e_p99_us=%.0f %s",
            percentiles(self.e2e_us)["p99"],
            " ".join(
                f"{name}:late_p99_us={e['lateness_us']['p99']:.0f},missed={e['missed']}"
                for name, e in g.get("entries", {}).items()
                if e.get("openings")
            )
            + " overruns="
            + ",".join(f"{k}:{v['overruns']}" for k, v in g.get("stages", {}).items()),
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

    def _source_status(self, source: Source, up: bool) -> dict[str, object]:
        """A source's counters, ``up`` and ``restarts``; ``last_error`` is why it failed
        while it waits to be restarted, else the driver's latest fault (else the last
        failure, once it runs again)."""
        stats = dict(source.stats())
        health = self.report.sources[source.name]
        own = stats.get("last_error")
        crashed = bool(health.last_error) and not health.running
        last_error = health.last_error if crashed or not own else own
        return {**stats, "up": up, "restarts": health.restarts, "last_error": last_error}

    def status(self) -> dict[str, Any]:
        """A JSON-ready snapshot: versions, model, sources, stages, queues, gates, latencies."""
        st = self.aligner.stats
        reasoning: dict[str, object] = {"enabled": self.stage is not None}
        if self.stage is not None:
            reasoning.update(self.stage.snapshot())
        up = self.sources_up()
        latency: dict[str, object] = {
            "e2e": percentiles(self.e2e_us),
            "memory": percentiles(self.memory_us),
        }
        if self.stage is not None:
            lat = self.stage.stats
            latency["perception"] = percentiles(lat.perception_us)
            latency["reasoning"] = percentiles(lat.reasoning_us)
        return {
            "agent": {
                "device": self.config.agent.device,
                "site": self.config.agent.site,
                "device_type": self.config.agent.device_type,
                "version": __version__,
                "loop": self.loop_name,
                "pid": os.getpid(),
                "uptime_s": round(time.monotonic() - self.started_mono, 3),
                "ready_s": None if self.ready_s is None else round(self.ready_s, 3),
                "health": self.health_status(),
            },
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
                "clock_steps": st.clock_steps,
                "budget_overruns": self.report.perception_overruns,
            },
            "queues": {
                name: {
                    "depth": len(q),
                    "max": q.maxlen,
                    "dropped": q.dropped,
                    "high_water": q.high_water,
                }
                for name, q in (("memory", self.memory_queue), ("reasoning", self.reasoning_queue))
            },
            "stages": {
                stage: {"gate_runs": self.progress[stage], "errors": self.stage_errors[stage]}
                for stage in STAGES
            },
            "reasoning": reasoning,
            "memory": self.memory.stats() if self.memory is not None else {"enabled": False},
            "gates": self.scheduler.snapshot(),
            "uplink": self.uplink.stats() if self.uplink is not None else {"enabled": False},
            "ota": self.ota.status() if self.ota is not None else {"enabled": False},
            "restart_requested": self.restart_requested,
            "latency_us": latency,
            "sources": {s.name: self._source_status(s, up[s.name]) for s in self.sources},
        }
