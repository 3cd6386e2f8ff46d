"""The memory stage of the pipeline: perception's window in, context for reasoning out.

Per window, on the event loop, :meth:`MemoryStage.process` pushes the window into working
memory and the baselines, delta-encodes it into the writer's bounded pending list, and
returns a :class:`MemoryContext` with its own latency. It does no I/O and never waits:
SQLite runs in the writer thread (:class:`~edge_agent.memory.store.StoreWriter`);
snapshots, restore, reads and opening the store run in worker threads. Bad input is
counted in :meth:`MemoryStage.stats`, never raised. The whole stage, its storage and its
counters: ``docs/MEMORY.md``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from edge_agent.memory.aging import AgingPolicy
from edge_agent.memory.baselines import Baselines
from edge_agent.memory.config import MemorySection
from edge_agent.memory.delta import DeltaEncoder
from edge_agent.memory.errors import MemoryStoreError, SnapshotError
from edge_agent.memory.ring import Decision, WorkingMemory
from edge_agent.memory.snapshots import (
    Recovery,
    SnapshotInfo,
    find_snapshot,
    prune,
    recover_if_corrupt,
    restore_snapshot,
    take_snapshot,
    verify_snapshot,
)
from edge_agent.memory.store import (
    History,
    MemoryStore,
    StoreLock,
    StoreWriter,
    WriteItem,
    baseline_rows,
    chunk_of,
    connect,
    migrate,
)
from edge_agent.perception import Window

log = logging.getLogger(__name__)

F64 = npt.NDArray[np.float64]

#: Consolidating baselines from the store replays at most this many rows at start.
_CONSOLIDATE_MAX_ROWS = 2_000_000
_WATCHDOG_S = 5.0


@dataclass(frozen=True, slots=True)
class MemoryContext:
    """What memory hands to reasoning with a window. Arrays follow ``signals`` (the
    configured order), not necessarily the window's own column order."""

    window: Window
    signals: tuple[str, ...]
    #: Working memory, oldest first, this window last.
    recent: tuple[Window, ...]
    #: The last decisions, oldest first.
    decisions: tuple[Decision, ...]
    baseline_mean: F64
    baseline_std: F64
    #: ``(fast mean - mean) / std`` per signal; NaN before any data.
    drift: F64
    #: The window's rows were accepted by the writer (False: not stored, see stats()).
    persisted: bool
    latency_ms: float

    def normalized(self) -> F64:
        """This window's values as ``(x - mean) / std`` (std floored, see baselines)."""
        std = np.maximum(self.baseline_std, 1e-6 * np.maximum(1.0, np.abs(self.baseline_mean)))
        return (_select(self.window, self.signals) - self.baseline_mean) / std


@dataclass(slots=True)
class StageStats:
    windows: int = 0
    cells: int = 0
    rows: int = 0
    keyframes: int = 0
    decisions: int = 0
    events: int = 0
    non_finite: int = 0
    unknown_signal: int = 0
    missing_signal: int = 0
    clock_backwards: int = 0
    dropped_windows: int = 0
    paused_windows: int = 0
    bad_decisions: int = 0
    not_open: int = 0
    snapshots: int = 0
    snapshot_failures: int = 0
    last_snapshot: str = ""
    last_snapshot_ns: int = 0
    unknown_names: set[str] = field(default_factory=set)


class MemoryStage:
    """Working memory, episodic store, baselines, aging and snapshots behind one object.

    ``signals`` are the configured perception signals (the column order of the context);
    ``state_dir`` anchors the relative paths of ``config``; ``period_ns`` is the grid
    period (only used to weigh baselines rebuilt from the store at start); ``clock_ns``
    names snapshots and stamps recovery (tests pass a fake). ``db_path`` and
    ``snapshot_dir`` override the config's paths. ``delta_encoding=False`` stores every
    cell (the benchmark's "without delta encoding" reference; not a config option).

    Typical wiring (the service owns the TaskGroup)::

        stage = MemoryStage(cfg.memory, cfg.perception.signals, state_dir=cfg.agent.state_dir,
                            period_ns=cfg.perception.period_ns)
        async with stage:                                  # open/recover off the loop, start writer
            tg.create_task(stage.run(), name="memory")     # periodic snapshots, writer watchdog
            ctx = stage.process(window, now_ns=clock_ns()) # on the loop, per window
    """

    def __init__(
        self,
        config: MemorySection,
        signals: Sequence[str],
        *,
        state_dir: str | Path,
        period_ns: int = 10_000_000,
        clock_ns: Callable[[], int] = time.time_ns,
        db_path: Path | None = None,
        snapshot_dir: Path | None = None,
        delta_encoding: bool = True,
    ) -> None:
        if not signals or len(set(signals)) != len(signals):
            raise ValueError("memory needs at least one signal and unique names")
        self.config = config
        self.signals = tuple(signals)
        db, snaps = config.resolve(state_dir)
        self.db_path = db_path if db_path is not None else db
        self.snapshot_dir = snapshot_dir if snapshot_dir is not None else snaps
        self.period_ns = period_ns
        self._clock_ns = clock_ns
        self.ring = WorkingMemory(config.ring_windows)
        self.baselines = Baselines(
            len(self.signals),
            half_life_s=config.baseline_half_life_s,
            drift_half_life_s=config.drift_half_life_s,
        )
        self.recovery: Recovery | None = None
        self._deadbands = config.deadbands_for(self.signals)
        self._delta_encoding = delta_encoding
        self._stats = StageStats()
        self._latency_ns: deque[int] = deque(maxlen=4096)
        self._lock: StoreLock | None = None
        self._writer: StoreWriter | None = None
        self._reader: MemoryStore | None = None
        self._reader_lock = threading.Lock()
        self._encoder: DeltaEncoder | None = None
        self._ids: tuple[int, ...] = ()
        self._columns: dict[
            tuple[str, ...], tuple[npt.NDArray[np.intp], npt.NDArray[np.bool_]]
        ] = {}
        self._last_keyframe_ns: int | None = None
        self._gap: tuple[int, str] | None = None  # (start, reason) of a hole not yet recorded
        self._resume_ns: int | None = None  # newest stored time when the store was opened
        self._resume_reason = "offline"
        self._prev_stale: npt.NDArray[np.bool_] | None = None
        self._behind = False
        self._last_start_ns: int | None = None
        self._restoring = False
        self._watchdog_logged = False

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> MemoryStage:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Lock, check (recover a corrupt file), migrate and open the store; start the writer.

        Blocking work runs in a worker thread. With ``enabled = false`` nothing is opened and
        the stage keeps working memory and baselines only.
        """
        if not self.config.enabled or self._writer is not None:
            return
        await asyncio.to_thread(self._open)

    def _open(self) -> None:
        cfg = self.config
        lock = StoreLock(self.db_path).acquire()
        try:
            self.recovery = recover_if_corrupt(
                self.db_path, self.snapshot_dir, now_ns=self._clock_ns()
            )
            if self.snapshot_dir.is_dir():
                try:
                    prune(self.snapshot_dir, cfg.snapshot_keep)
                except SnapshotError as exc:
                    # Old snapshots left over are no reason not to start.
                    log.error("memory snapshots: %s", exc)
            conn = connect(self.db_path, journal_size_limit=cfg.journal_size_limit_bytes)
            try:
                migrate(conn)
                store = MemoryStore(conn, self.db_path, chunk_ns=cfg.aging_chunk_ns)
                ids = store.ensure_signals(self.signals)
                self._ids = tuple(ids[s] for s in self.signals)
                last_change, last_end = store.last_times()
                self._load_baselines(store, last_change, last_end)
            except BaseException:
                conn.close()
                raise
            writer = StoreWriter(
                conn,
                self.db_path,
                max_pending_rows=cfg.batch_max_rows,
                commit_interval_s=cfg.commit_interval_ms / 1000,
                checkpoint_interval_s=cfg.checkpoint_interval_s,
                journal_size_limit=cfg.journal_size_limit_bytes,
                aging=AgingPolicy(
                    ttl_ns=cfg.ttl_ns,
                    max_bytes=cfg.max_bytes,
                    chunk_ns=cfg.aging_chunk_ns,
                    step_budget_s=cfg.aging_step_ms / 1000,
                    interval_s=cfg.aging_interval_s,
                ),
            )
            reader = MemoryStore(
                connect(self.db_path, readonly=True),
                self.db_path,
                chunk_ns=cfg.aging_chunk_ns,
                on_read=writer.touch,
            )
        except BaseException:
            lock.release()
            raise
        self._lock, self._writer, self._reader = lock, writer, reader
        self._encoder = DeltaEncoder(self._ids, self._deadbands, enabled=self._delta_encoding)
        known = [t for t in (last_change, last_end) if t is not None]
        self._resume_ns = max(known) if known else None
        self._encoder.resume_after(self._resume_ns)
        now = self._clock_ns()
        start_event: list[tuple[int, str, int | None, str | None]] = [
            (now, "start", None, json.dumps({"signals": list(self.signals)}))
        ]
        if self.recovery is not None:
            start_event.append((now, "recovered", None, json.dumps(self.recovery.to_json())))
        writer.start()
        writer.submit(WriteItem(events=start_event, now_ns=now))
        log.info(
            "memory store %s open (%d signals, resume after %s)%s",
            self.db_path,
            len(self.signals),
            self._resume_ns,
            f"; RECOVERED from corruption: {self.recovery.to_json()}" if self.recovery else "",
        )

    def _load_baselines(
        self, store: MemoryStore, last_change: int | None, last_end: int | None
    ) -> None:
        saved = store.load_baselines()
        if saved:
            for j, name in enumerate(self.signals):
                if name in saved:
                    updated, b = saved[name]
                    self.baselines.set(j, b)
                    self.baselines.updated_ns = max(self.baselines.updated_ns, updated)
            return
        if last_change is None:
            return
        # No persisted baselines (new schema, lost table): consolidate from the episodic
        # store, weighing each stored value by how long it held.
        end = max(t for t in (last_change, last_end) if t is not None)
        since = end - int(3 * self.config.baseline_half_life_s * 1e9)
        column = {sid: j for j, sid in enumerate(self._ids)}
        held: dict[int, tuple[int, float]] = {}
        for n, (t, sid, value) in enumerate(store.replay(since)):
            if n >= _CONSOLIDATE_MAX_ROWS:
                break
            col = column.get(sid)
            if col is None:
                continue
            if col in held:
                t0, v0 = held[col]
                self.baselines.update_held(col, v0, t, t - t0, self.period_ns)
            held[col] = (t, math.nan if value is None else float(value))
        for col, (t0, v0) in held.items():
            self.baselines.update_held(col, v0, end, end - t0, self.period_ns)
        log.info("memory baselines consolidated from the episodic store since %d", since)

    async def close(self) -> None:
        """Commit what is pending, checkpoint, close, release the lock. Idempotent."""
        writer, reader, lock = self._writer, self._reader, self._lock
        self._writer = self._reader = self._lock = None
        if writer is not None:
            await asyncio.to_thread(writer.flush)
            final = WriteItem(
                events=[(self._clock_ns(), "stop", None, None)], baselines=self._baseline_rows()
            )
            encoder = self._encoder
            if self._gap is not None and encoder is not None and encoder.last_ns is not None:
                # Windows were dropped and none was stored since: close the hole now, or the
                # last stored values would seem to hold through it.
                final.gaps.append((self._gap[0], encoder.last_ns + self.period_ns, self._gap[1]))
                self._gap = None
            writer.submit(final)
            await asyncio.to_thread(writer.stop)
        if reader is not None:
            with self._reader_lock:
                reader.close()
        if lock is not None:
            lock.release()

    async def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything handed to the writer so far is committed."""
        if self._writer is None:
            return True
        return await asyncio.to_thread(self._writer.flush, timeout_s)

    async def run(self) -> None:
        """Periodic snapshots (``snapshot_interval_s``) and a writer watchdog, until cancelled."""
        interval = self.config.snapshot_interval_s
        next_snapshot = time.monotonic() + interval if interval > 0 else math.inf
        while True:
            await asyncio.sleep(min(_WATCHDOG_S, max(0.0, next_snapshot - time.monotonic())))
            writer = self._writer
            if writer is not None and not writer.alive and not self._watchdog_logged:
                self._watchdog_logged = True
                log.error(
                    "memory writer thread is not running (%s); windows are no longer stored",
                    writer.stats.last_error or "stopped",
                )
            if time.monotonic() >= next_snapshot:
                next_snapshot = time.monotonic() + interval
                if writer is not None and writer.alive:
                    # A failing snapshot is logged and counted, never fatal: this task runs
                    # in the agent's TaskGroup, and an exception here would stop the agent.
                    try:
                        await self.snapshot()
                    except MemoryStoreError as exc:
                        self._stats.snapshot_failures += 1
                        log.error("memory snapshot failed: %s", exc)
                    except Exception:
                        self._stats.snapshot_failures += 1
                        log.exception("memory snapshot failed unexpectedly")

    # -- snapshots and restore -----------------------------------------------------------------

    async def snapshot(self) -> SnapshotInfo:
        """Take a snapshot now (in a worker thread; the writer keeps going)."""
        if self._writer is None:
            raise MemoryStoreError("memory store is not open")
        # Semantic memory is persisted at keyframes; bring it up to date for the snapshot.
        self._writer.submit(WriteItem(baselines=self._baseline_rows(), now_ns=self._clock_ns()))
        await self.flush()
        info = await asyncio.to_thread(
            take_snapshot,
            self.db_path,
            self.snapshot_dir,
            keep=self.config.snapshot_keep,
            now_ns=self._clock_ns(),
        )
        self._stats.snapshots += 1
        self._stats.last_snapshot = info.name
        self._stats.last_snapshot_ns = info.created_ns
        log.info("memory snapshot %s (%d bytes)", info.name, info.bytes)
        return info

    async def restore(self, ref: str) -> SnapshotInfo:
        """Online restore: verify, pause the writer, roll the file back, resume.

        Windows arriving during the pause reach working memory and baselines but are not
        stored (``paused_windows``); a ``restored`` gap covers them. Baselines roll back
        with the store. Raises :class:`SnapshotChecksumError` (nothing touched) and
        :class:`SnapshotError`.
        """
        writer = self._writer
        if writer is None:
            raise MemoryStoreError("memory store is not open")

        def verify() -> SnapshotInfo:
            info = find_snapshot(self.snapshot_dir, ref)
            verify_snapshot(info)
            return info

        info = await asyncio.to_thread(verify)
        self._restoring = True
        restored = False
        try:
            await asyncio.to_thread(writer.pause)
            with self._reader_lock:
                if self._reader is not None:
                    self._reader.close()
            await asyncio.to_thread(restore_snapshot, info, self.db_path, now_ns=self._clock_ns())
            restored = True
        finally:
            await asyncio.to_thread(writer.resume, discard_pending=restored)
            reader = await asyncio.to_thread(self._reopen_reader, writer)
            self._restoring = False
        assert self._encoder is not None
        self._encoder.invalidate()
        last_change, last_end = reader.last_times()
        known = [t for t in (last_change, last_end) if t is not None]
        self._resume_ns = max(known) if known else None
        self._resume_reason = "restored"
        saved = await asyncio.to_thread(self._locked_baselines)
        for j, name in enumerate(self.signals):
            if name in saved:
                self.baselines.set(j, saved[name][1])
        writer.submit(
            WriteItem(
                events=[(self._clock_ns(), "restored", None, json.dumps(info.to_json()))],
                now_ns=self._clock_ns(),
            )
        )
        log.warning("memory store rolled back online to snapshot %s", info.name)
        return info

    def _reopen_reader(self, writer: StoreWriter) -> MemoryStore:
        with self._reader_lock:
            self._reader = MemoryStore(
                connect(self.db_path, readonly=True),
                self.db_path,
                chunk_ns=self.config.aging_chunk_ns,
                on_read=writer.touch,
            )
            return self._reader

    def _locked_baselines(self) -> dict[str, Any]:
        with self._reader_lock:
            return dict(self._reader.load_baselines()) if self._reader is not None else {}

    # -- reads --------------------------------------------------------------------------------

    async def history(self, signal: str, since_ns: int, until_ns: int) -> History:
        """A signal's stored history (worker thread; counts as a use of those chunks)."""
        return await asyncio.to_thread(self._read, lambda r: r.history(signal, since_ns, until_ns))

    async def state_at(self, t_ns: int) -> dict[str, float]:
        """The stored state of every signal at ``t_ns`` (NaN: unknown)."""
        return await asyncio.to_thread(self._read, lambda r: r.state_at(t_ns, self.signals))

    def _read(self, fn: Callable[[MemoryStore], Any]) -> Any:
        with self._reader_lock:
            if self._reader is None:
                raise MemoryStoreError("memory store is not open")
            return fn(self._reader)

    # -- the per-window path (event loop) ---------------------------------------------------------

    def process(
        self, window: Window, decision: Decision | None = None, *, now_ns: int
    ) -> MemoryContext:
        """Take one window (and optionally the latest decision). Never blocks; see module doc."""
        started = time.perf_counter_ns()
        st = self._stats
        st.windows += 1
        values, stale = self._select_columns(window)
        self.ring.push_window(window)
        self.baselines.update(values, window.start_ns, window.period_ns)
        persisted = False
        if self._writer is not None and self._encoder is not None:
            if self._restoring:
                st.paused_windows += 1
            else:
                persisted = self._persist(window, values, stale, decision, now_ns)
        elif self.config.enabled:
            st.not_open += 1
            if st.not_open == 1:
                log.warning("memory: window before start() (or after close()); not stored")
        if decision is not None:
            self.ring.push_decision(decision)
            st.decisions += 1
        mean, std, drift = self.baselines.summary()
        elapsed = time.perf_counter_ns() - started
        self._latency_ns.append(elapsed)
        return MemoryContext(
            window=window,
            signals=self.signals,
            recent=self.ring.windows(),
            decisions=self.ring.decisions(),
            baseline_mean=mean,
            baseline_std=std,
            drift=drift,
            persisted=persisted,
            latency_ms=elapsed / 1e6,
        )

    def probe(self, window: Window, *, now_ns: int) -> MemoryContext:
        """The context :meth:`process` would return for ``window``, changing nothing.

        For health probes: the window is not pushed into working memory, not folded into
        the baselines (a copy is), not stored, not counted; ``persisted`` is False.
        ``recent`` is working memory with ``window`` appended as process() would have it.
        ``now_ns`` is the caller's clock, as for process(); nothing here is stamped with it.
        """
        del now_ns  # same signature as process(); a probe writes nothing to stamp
        started = time.perf_counter_ns()
        values, _ = self._select_columns(window, count=False)
        baselines = self.baselines.copy()
        baselines.update(values, window.start_ns, window.period_ns)
        mean, std, drift = baselines.summary()
        recent = (*self.ring.windows(), window)[-self.ring.capacity :]
        return MemoryContext(
            window=window,
            signals=self.signals,
            recent=recent,
            decisions=self.ring.decisions(),
            baseline_mean=mean,
            baseline_std=std,
            drift=drift,
            persisted=False,
            latency_ms=(time.perf_counter_ns() - started) / 1e6,
        )

    def record_decision(
        self, decision: Decision, *, now_ns: int, window_seq: int | None = None
    ) -> bool:
        """Store a decision that arrives after its window (reasoning runs after memory)."""
        self.ring.push_decision(decision)
        self._stats.decisions += 1
        if self._writer is None or self._restoring:
            return False
        body = self._decision_json(decision)
        return self._writer.submit(WriteItem(decisions=[(now_ns, window_seq, body)], now_ns=now_ns))

    def record_event(
        self,
        kind: str,
        *,
        t_ns: int,
        signal: str | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> bool:
        """Store an event (e.g. a rule firing) with the episodic data."""
        if self._writer is None or self._restoring:
            return False
        sid = self._ids[self.signals.index(signal)] if signal in self.signals else None
        text = json.dumps(dict(detail), default=_json_default) if detail is not None else None
        self._stats.events += 1
        return self._writer.submit(WriteItem(events=[(t_ns, kind, sid, text)], now_ns=t_ns))

    def _select_columns(
        self, window: Window, *, count: bool = True
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_]]:
        """The window's columns in :attr:`signals` order. ``count=False`` (probes) leaves
        the counters and the layout cache alone: a probe must not hide an unknown layout
        from the next real window's counts."""
        if window.signals is self.signals or window.signals == self.signals:
            return window.values, window.stale
        cached = self._columns.get(window.signals)
        if cached is None:
            where = {name: i for i, name in enumerate(window.signals)}
            idx = np.array([where.get(s, -1) for s in self.signals], dtype=np.intp)
            cached = (idx, idx < 0)
            if count:
                unknown = [s for s in window.signals if s not in set(self.signals)]
                names = self._stats.unknown_names
                names.update(unknown[: max(0, 64 - len(names))])
                if len(self._columns) < 64:
                    self._columns[window.signals] = cached
        idx, missing = cached
        if count:
            st = self._stats
            st.unknown_signal += len(window.signals) - int(np.count_nonzero(~missing))
            st.missing_signal += int(np.count_nonzero(missing))
        values = window.values[:, np.where(missing, 0, idx)]
        stale = (
            window.stale[np.where(missing, 0, idx)]
            if window.stale.size
            else np.ones(len(idx), np.bool_)
        )
        if missing.any():
            values = values.copy()
            values[:, missing] = np.nan
            stale = stale.copy()
            stale[missing] = True
        return values, stale

    def _persist(  # noqa: PLR0915 - one window's write item, built in the order the store needs
        self,
        window: Window,
        values: npt.NDArray[np.float32],
        stale: npt.NDArray[np.bool_],
        decision: Decision | None,
        now_ns: int,
    ) -> bool:
        writer, encoder, st = self._writer, self._encoder, self._stats
        assert writer is not None
        assert encoder is not None
        loss = writer.take_loss()
        if loss is not None:
            encoder.invalidate()
            if self._gap is None or loss < self._gap[0]:
                self._gap = (loss, "dropped")
        keyframe = (
            self._last_keyframe_ns is None
            or window.start_ns - self._last_keyframe_ns >= self.config.keyframe_interval_ns
            or chunk_of(window.start_ns, self.config.aging_chunk_ns)
            != chunk_of(self._last_keyframe_ns, self.config.aging_chunk_ns)
        )
        last_stored = encoder.last_ns
        res = encoder.encode(window.start_ns, window.period_ns, values, keyframe=keyframe)
        # Windows that overlap (perception hop < window) repeat points already stored: that
        # is not the clock going backwards, as long as each window starts after the last.
        overlap = self._last_start_ns is not None and window.start_ns > self._last_start_ns
        self._last_start_ns = (
            window.start_ns
            if self._last_start_ns is None
            else max(self._last_start_ns, window.start_ns)
        )
        st.cells += res.cells
        st.non_finite += res.non_finite
        item = WriteItem(
            rows=res.block,
            keyframe_ns=res.first_ns if res.keyframe else None,
            window_end_ns=res.last_ns,
            now_ns=now_ns,
        )
        if res.behind and not overlap:
            st.clock_backwards += res.behind
            if not self._behind:
                self._behind = True
                detail = {"window_start_ns": window.start_ns, "last_stored_ns": last_stored}
                item.events.append((now_ns, "clock_backwards", None, json.dumps(detail)))
                log.warning(
                    "memory: window %d starts at or before the last stored point; "
                    "points behind it are not stored",
                    window.seq,
                )
        elif self._behind:
            self._behind = False
        if res.first_ns is not None:
            if self._resume_ns is not None:
                if res.first_ns > self._resume_ns + window.period_ns:
                    item.gaps.append(
                        (self._resume_ns + window.period_ns, res.first_ns, self._resume_reason)
                    )
                self._resume_ns = None
            if self._gap is not None:
                item.gaps.append((self._gap[0], res.first_ns, self._gap[1]))
            self._stale_events(item, stale, window.end_ns)
        if decision is not None:
            item.decisions.append((now_ns, window.seq, self._decision_json(decision)))
        if res.keyframe:
            item.baselines = self._baseline_rows()
        # Submitted even when empty: the writer learns how far the windows went.
        if writer.submit(item):
            self._gap = None
            st.rows += len(res.block)
            st.events += len(item.events)
            if res.keyframe:
                st.keyframes += 1
                self._last_keyframe_ns = res.first_ns
            return True
        st.dropped_windows += 1
        encoder.invalidate()
        first = min(item.gaps) if item.gaps else None
        start = first[0] if first else (res.first_ns or window.start_ns)
        reason = first[2] if first else "dropped"
        if self._gap is None or start < self._gap[0]:
            self._gap = (start, reason)
        return False

    def _baseline_rows(self) -> list[tuple[Any, ...]]:
        b = self.baselines
        return baseline_rows(self._ids, b.updated_ns, {j: b.get(j) for j in range(b.n)})

    def _stale_events(self, item: WriteItem, stale: npt.NDArray[np.bool_], t_ns: int) -> None:
        prev = self._prev_stale
        self._prev_stale = stale.copy()
        changed = np.flatnonzero(stale) if prev is None else np.flatnonzero(stale != prev)
        for j in changed.tolist():
            item.events.append((t_ns, "stale" if stale[j] else "fresh", self._ids[j], None))

    def _decision_json(self, decision: Decision) -> str:
        try:
            obj: Any
            # A JsonRecord is anything with to_json(): asked directly, not by isinstance on
            # a runtime-checkable Protocol (~15 µs a window in bench.e2e).
            to_json = getattr(decision, "to_json", None)
            if callable(to_json):
                obj = to_json()
            elif dataclasses.is_dataclass(decision) and not isinstance(decision, type):
                obj = dataclasses.asdict(decision)
            else:
                obj = dict(cast("Mapping[str, Any]", decision))
            return json.dumps(obj, separators=(",", ":"), default=_json_default)
        except (TypeError, ValueError) as exc:
            self._stats.bad_decisions += 1
            return json.dumps({"unserializable": repr(decision)[:1000], "error": str(exc)})

    # -- reporting --------------------------------------------------------------------------

    def latency_us(self) -> dict[str, float]:
        """Per-window ``process`` latency over the last 4096 windows (µs)."""
        if not self._latency_ns:
            return {"count": 0, "p50": 0.0, "p99": 0.0, "max": 0.0}
        arr = np.fromiter(self._latency_ns, dtype=np.int64) / 1e3
        return {
            "count": len(arr),
            "p50": round(float(np.percentile(arr, 50)), 1),
            "p99": round(float(np.percentile(arr, 99)), 1),
            "max": round(float(arr.max()), 1),
        }

    def stats(self) -> dict[str, Any]:
        """JSON-ready counters for the status API and the periodic log line."""
        st = self._stats
        out: dict[str, Any] = {
            "enabled": self.config.enabled,
            "open": self._writer is not None,
            "db_path": str(self.db_path),
            "windows": st.windows,
            "cells": st.cells,
            "rows": st.rows,
            "keyframes": st.keyframes,
            "decisions": st.decisions,
            "events": st.events,
            "non_finite": st.non_finite,
            "unknown_signal": st.unknown_signal,
            "unknown_names": sorted(st.unknown_names),
            "missing_signal": st.missing_signal,
            "clock_backwards": st.clock_backwards,
            "dropped_windows": st.dropped_windows,
            "paused_windows": st.paused_windows,
            "bad_decisions": st.bad_decisions,
            "not_open": st.not_open,
            "ring": {"windows": len(self.ring), "capacity": self.ring.capacity},
            "latency_us": self.latency_us(),
            "snapshots": {
                "taken": st.snapshots,
                "failures": st.snapshot_failures,
                "last": st.last_snapshot or None,
                "last_ns": st.last_snapshot_ns or None,
            },
            "recovery": self.recovery.to_json() if self.recovery is not None else None,
        }
        if self._writer is not None:
            out["writer"] = self._writer.stats_dict()
        return out


def _select(window: Window, signals: tuple[str, ...]) -> F64:
    if window.signals == signals:
        return window.values.astype(np.float64)
    where = {name: i for i, name in enumerate(window.signals)}
    out = np.full((window.values.shape[0], len(signals)), np.nan)
    for j, s in enumerate(signals):
        if s in where:
            out[:, j] = window.values[:, where[s]]
    return out


def _json_default(obj: object) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    return repr(obj)


__all__ = ["MemoryContext", "MemoryStage", "StageStats"]
