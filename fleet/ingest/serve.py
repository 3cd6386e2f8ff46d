"""``fleet serve``'s ingest: N workers in processes of their own, their stats summed."""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fleet.ingest.config import IngestConfig, IngestStats
from fleet.ingest.worker import IngestWorker
from fleet.store import open_store


def _worker_process(
    config: IngestConfig, duration: float | None, results: multiprocessing.Queue[dict[str, Any]]
) -> None:
    # A spawned process starts without the parent's logging setup.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    worker = IngestWorker(config)
    try:
        worker.start()
        stop.wait(duration)
    finally:
        worker.stop()
        results.put(worker.stats.as_dict())


def _stats_from(d: dict[str, Any]) -> IngestStats:
    return IngestStats(**d)


def serve(
    config: IngestConfig,
    *,
    workers: int = 1,
    duration: float | None = None,
    stop: threading.Event | None = None,
    on_stats: Callable[[IngestStats], None] | None = None,
) -> list[IngestStats]:
    """Migrate once, then run ``workers`` ingest workers until ``duration`` or ``stop``.

    One worker runs in this process; more run as processes (one GIL each), with client ids
    ``{client_id}-{i}`` so each keeps its own persistent session across restarts.
    Returns each worker's final stats.
    """
    store = open_store(config.store_url)
    try:
        store.migrate()
    finally:
        store.close()
    base_id = config.client_id or f"fleet-ingest-{socket.gethostname()}"
    stop = stop or threading.Event()
    if workers <= 1:
        worker = IngestWorker(replace(config, client_id=base_id, migrate=False))
        worker.start()
        try:
            _wait(stop, duration, lambda: on_stats(worker.stats) if on_stats else None)
        finally:
            worker.stop()
        return [worker.stats]
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[dict[str, Any]] = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker_process,
            args=(replace(config, client_id=f"{base_id}-{i}", migrate=False), None, results),
            name=f"ingest-{i}",
        )
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        _wait(stop, duration, None)
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.terminate()  # SIGTERM: the worker flushes, acks and disconnects
        out = []
        for _ in procs:
            try:
                out.append(_stats_from(results.get(timeout=60)))
            except queue.Empty:
                break
        for p in procs:
            p.join(10)
    return out


def _wait(stop: threading.Event, duration: float | None, tick: Callable[[], None] | None) -> None:
    deadline = None if duration is None else time.monotonic() + duration
    while not stop.is_set():
        left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
        if left <= 0:
            return
        stop.wait(left)
        if tick is not None:
            tick()
