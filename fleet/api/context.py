"""What every request handler shares: the configuration, a pool of store connections, the
clock, the events hub and the request metrics."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from fleet.store import OperatorStore, open_store

#: Store connections the API keeps open (each a SQLite or PostgreSQL connection).
POOL_SIZE = 4
#: The largest bundle the API takes in an upload (the agent's own limit).
MAX_UPLOAD_BYTES = 1024 * 1024 * 1024


class RequestMetrics(Protocol):
    """Where the API counts its requests (``fleet.metrics.FleetMetrics`` is one)."""

    def observe_request(self, route: str, status: int, seconds: float) -> None: ...


@dataclass(frozen=True)
class ApiConfig:
    store_url: str
    #: Where ``fleet serve`` publishes bundles (``<sha256>.efb``).
    artifacts: Path
    #: Check uploaded bundles' signatures against this root.json (None: count them only).
    root_json: Path | None = None
    #: Mark the session cookie ``Secure`` (the API is served over TLS).
    secure_cookies: bool = False
    max_upload_bytes: int = MAX_UPLOAD_BYTES


class StorePool:
    """Up to ``size`` open stores handed to one request at a time (a store is one
    connection and serves one thread at a time). Opened on first use, closed by
    :meth:`close`."""

    def __init__(self, url: str, size: int = POOL_SIZE) -> None:
        self._url = url
        self._idle: queue.LifoQueue[OperatorStore] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(size)
        self._all: list[OperatorStore] = []
        self._lock = threading.Lock()

    @contextmanager
    def store(self) -> Iterator[OperatorStore]:
        """A store for this request; raises FleetStoreError if none can be opened."""
        self._slots.acquire()
        try:
            try:
                st = self._idle.get_nowait()
            except queue.Empty:
                st = open_store(self._url)
                with self._lock:
                    self._all.append(st)
            yield st
            self._idle.put(st)
        finally:
            self._slots.release()

    def close(self) -> None:
        with self._lock:
            stores, self._all = self._all, []
        for st in stores:
            st.close()


@dataclass
class ApiContext:
    config: ApiConfig
    pool: StorePool
    clock: Callable[[], int] = time.time_ns
    metrics: RequestMetrics | None = None
    #: ``fleet serve``'s metrics text, served at ``/metrics`` (body, content type).
    render_metrics: Callable[[], tuple[bytes, str]] | None = None
    started_ns: int = field(default_factory=time.time_ns)
