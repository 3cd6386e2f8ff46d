"""``fleet serve``'s ingest: N workers (one in this process, or each in a process of its own),
their stats, whether they reach the broker, and a status line now and then."""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from fleet.errors import FleetError, IngestError
from fleet.ingest.config import IngestConfig, IngestStats
from fleet.ingest.drain import QUIET_S
from fleet.ingest.keeper import SessionKeeper
from fleet.ingest.worker import IngestWorker
from fleet.store import open_store

log = logging.getLogger(__name__)

#: How often worker processes report their stats, and the serve loop looks at them.
TICK_S = 1.0
#: A worker process that died is started again, but not sooner than this after its last start.
RESTART_AFTER_S = 2.0
#: How long past ``connect_timeout`` a worker that has not tried to connect yet (its process
#: and store process still starting) is given to try once.
STARTUP_GRACE_S = 10.0

Report = tuple[int, dict[str, Any]]  # worker index, its stats


def _worker_process(
    config: IngestConfig,
    index: int,
    parent: int,
    reports: multiprocessing.Queue[Report],
    horizon: Any,
) -> None:
    # A spawned process starts without the parent's logging setup.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    worker = IngestWorker(config, horizon=lambda: int(horizon.value))
    try:
        try:
            worker.start()
        except FleetError as exc:  # the store: one line, and fleet serve starts it again
            log.error("ingest %s: cannot start: %s", config.client_id, exc)
            raise SystemExit(3) from None
        while not stop.wait(TICK_S):
            reports.put((index, worker.stats.as_dict()))
            if os.getppid() != parent:
                # fleet serve was killed: a worker left running would hold its session
                # against the next fleet serve (the broker hands a client id to the newest
                # connection, and the two would take it from each other every second).
                log.warning(
                    "ingest %s: fleet serve (pid %d) is gone; stopping", config.client_id, parent
                )
                reports.cancel_join_thread()  # nobody reads the queue any more
                break
    finally:
        worker.stop()
        reports.put((index, worker.stats.as_dict()))


class _Workers(Protocol):
    def poll(self) -> None: ...
    def stats(self) -> list[IngestStats]: ...
    def stop(self) -> list[IngestStats]: ...
    def set_horizon(self, ns: int) -> None: ...


def ingest_horizon(stats: list[IngestStats], draining: int) -> int:
    """What every worker's gap audit may look up to: the lowest worker horizon, 0 (hold)
    while one is not known or a session no worker reads is being drained."""
    if draining or not stats:
        return 0
    return min(s.horizon_ns for s in stats)


class _InProcess:
    """One worker in this process."""

    def __init__(self, config: IngestConfig) -> None:
        self._horizon = 0
        self._worker = IngestWorker(config, horizon=lambda: self._horizon)
        self._worker.start()

    def set_horizon(self, ns: int) -> None:
        self._horizon = ns

    def poll(self) -> None:
        pass

    def stats(self) -> list[IngestStats]:
        return [self._worker.stats]

    def stop(self) -> list[IngestStats]:
        self._worker.stop()
        return [self._worker.stats]


class _Processes:
    """One worker per process; each reports its stats every TICK_S. A worker process that
    dies (killed, out of memory) is started again on the same session: a session no worker
    reads keeps receiving its share of the group's messages."""

    def __init__(self, configs: list[IngestConfig]) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._reports: multiprocessing.Queue[Report] = self._ctx.Queue()
        self._configs = configs
        #: Shared with every worker process (see ingest_horizon); written here only.
        self._horizon = self._ctx.Value("q", 0, lock=False)
        self._latest = [IngestStats() for _ in configs]
        self._earlier = [IngestStats() for _ in configs]  # counters of processes that died
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._started = [0.0] * len(configs)
        for i in range(len(configs)):
            self._procs.append(self._start(i))

    def _start(self, i: int) -> multiprocessing.process.BaseProcess:
        proc = self._ctx.Process(
            target=_worker_process,
            args=(self._configs[i], i, os.getpid(), self._reports, self._horizon),
            name=f"ingest-{i}",
        )
        proc.start()
        self._started[i] = time.monotonic()
        return proc

    def set_horizon(self, ns: int) -> None:
        self._horizon.value = ns

    def _take_reports(self, timeout: float = 0.0) -> bool:
        try:
            i, d = self._reports.get(timeout=timeout) if timeout else self._reports.get_nowait()
        except queue.Empty:
            return False
        self._latest[i] = IngestStats(**d)
        return True

    def poll(self) -> None:
        while self._take_reports():
            pass
        for i, proc in enumerate(self._procs):
            if proc.exitcode is None or time.monotonic() - self._started[i] < RESTART_AFTER_S:
                continue
            log.warning(
                "ingest %s: its process exited (code %s); starting it again",
                self._configs[i].client_id,
                proc.exitcode,
            )
            self._earlier[i].add(self._latest[i])
            self._latest[i] = IngestStats()
            self._procs[i] = self._start(i)

    def stats(self) -> list[IngestStats]:
        out = []
        for earlier, latest in zip(self._earlier, self._latest, strict=True):
            total = replace(latest, quarantined=dict(latest.quarantined))
            total.add(earlier)
            out.append(total)
        return out

    def stop(self) -> list[IngestStats]:
        for p in self._procs:
            if p.exitcode is None:
                p.terminate()  # SIGTERM: the worker flushes, acks and disconnects
        # A worker's last report is in the pipe before its process exits (the queue's
        # feeder is joined at exit), so read while any runs, then what is left.
        deadline = time.monotonic() + 60
        while any(p.exitcode is None for p in self._procs) and time.monotonic() < deadline:
            self._take_reports(timeout=0.1)
        while self._take_reports():
            pass
        for p in self._procs:
            p.join(10)
        return self.stats()


def serve(
    config: IngestConfig,
    *,
    workers: int = 1,
    duration: float | None = None,
    stop: threading.Event | None = None,
    on_stats: Callable[[IngestStats], None] | None = None,
    connect_timeout: float | None = 30.0,
    status_interval: float | None = 60.0,
    node: str | None = None,
    quiet_s: float = QUIET_S,
    on_workers: Callable[[list[IngestStats]], None] | None = None,
) -> list[IngestStats]:
    """Migrate once, then run ``workers`` ingest workers until ``duration`` or ``stop``.

    One worker runs in this process; more run as processes (one GIL each). Worker ``i``'s
    client id is ``{prefix}-{group}-{i}`` (prefix: ``config.client_id`` or
    ``fleet-ingest-{node}``, node: the host name), a persistent session that the store
    records; sessions of the prefix that no worker runs now are drained once the workers
    are connected (see :mod:`fleet.ingest.sessions`). Raises IngestError if a worker has not
    connected to the broker within ``connect_timeout`` seconds (None: wait for ever). Logs a
    status line every ``status_interval`` seconds. Every tick, ``on_stats`` gets the total
    and ``on_workers`` each worker's stats. Returns each worker's final stats.
    """
    stop = stop or threading.Event()
    started = time.monotonic()
    store = open_store(config.store_url)
    try:
        store.migrate()
        keeper = SessionKeeper(
            store,
            config,
            node=node or socket.gethostname(),
            workers=workers,
            broker=_broker(config),
            quiet_s=quiet_s,
        )
        configs = [replace(config, client_id=cid, migrate=False) for cid in keeper.worker_ids()]
        pool: _Workers = _InProcess(configs[0]) if workers <= 1 else _Processes(configs)
        try:
            return _run(
                pool,
                keeper,
                config=config,
                stop=stop,
                started=started,
                duration=duration,
                on_stats=on_stats,
                on_workers=on_workers,
                connect_timeout=connect_timeout,
                status_interval=status_interval,
            )
        finally:
            keeper.stop()
    finally:
        store.close()


def _run(
    pool: _Workers,
    keeper: SessionKeeper,
    *,
    config: IngestConfig,
    stop: threading.Event,
    started: float,
    duration: float | None,
    on_stats: Callable[[IngestStats], None] | None,
    on_workers: Callable[[list[IngestStats]], None] | None,
    connect_timeout: float | None,
    status_interval: float | None,
) -> list[IngestStats]:
    final: list[IngestStats] | None = None
    try:
        if not _connected_in_time(pool, connect_timeout, stop):
            # The workers' last word (their final stats) holds why they could not connect.
            final = pool.stop()
            raise IngestError(_not_connected(final, _broker(config), connect_timeout or 0))
        keeper.start_drains()
        next_status = time.monotonic() + (status_interval or 0)
        while not stop.is_set():
            left = (
                TICK_S if duration is None else min(TICK_S, started + duration - time.monotonic())
            )
            if left <= 0:
                break
            stop.wait(left)
            pool.poll()
            keeper.tick()
            stats = pool.stats()
            pool.set_horizon(ingest_horizon(stats, keeper.draining()))
            if on_stats is not None:
                on_stats(_total(stats))
            if on_workers is not None:
                on_workers(stats)
            if status_interval and time.monotonic() >= next_status:
                next_status += status_interval
                level, line = status_line(stats, _broker(config), keeper.draining())
                log.log(level, "%s", line)
    finally:
        if final is None:
            final = pool.stop()
    return final


def _broker(config: IngestConfig) -> str:
    host = config.broker_host
    return f"[{host}]:{config.broker_port}" if ":" in host else f"{host}:{config.broker_port}"


def _total(stats: list[IngestStats]) -> IngestStats:
    total = IngestStats()
    for s in stats:
        total.add(s)
    return total


def _connected_in_time(pool: _Workers, timeout: float | None, stop: threading.Event) -> bool:
    """True once every worker has connected once (or on ``stop``); False after ``timeout``,
    or, for a worker that has not tried yet (its process still starting), after its first
    failed attempt, STARTUP_GRACE_S at most: the line then says why."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not stop.is_set():
        pool.poll()
        stats = pool.stats()
        if all(s.connects > 0 for s in stats):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            tried = all(s.connects > 0 or s.connect_failures > 0 for s in stats)
            if tried or time.monotonic() >= deadline + STARTUP_GRACE_S:
                return False
        stop.wait(0.1)
    return True


def _not_connected(stats: list[IngestStats], broker: str, timeout: float) -> str:
    waiting = [s for s in stats if s.connects == 0]
    why = next((s.link_error for s in waiting if s.link_error), None)
    tries = max((s.connect_failures for s in waiting), default=0)
    return f"cannot connect to the MQTT broker {broker} within {timeout:g} s: " + (
        f"{why} ({tries} attempt(s))" if why else "no answer"
    )


def status_line(stats: list[IngestStats], broker: str, draining: int = 0) -> tuple[int, str]:
    """The periodic status line and its level: WARNING while a worker is not connected."""
    total = _total(stats)
    up = sum(1 for s in stats if s.connected)
    link = f"{up}/{len(stats)} worker(s) connected to {broker}"
    down = [s.link_error for s in stats if not s.connected and s.link_error]
    if down:
        link += f" (not connected: {down[0]})"
    q = sum(total.quarantined.values())
    line = (
        f"ingest: {link}; received {total.received}, stored {total.stored}, duplicates "
        f"{total.duplicates}, quarantined {q}, dropped {total.dropped}, store retries "
        f"{total.store_retries}"
    )
    if draining:
        line += f"; draining {draining} session(s) no worker reads"
    return (logging.INFO if up == len(stats) else logging.WARNING), line
