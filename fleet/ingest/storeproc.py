"""Where a worker's batches are written: the store in a process of its own (:class:`StoreClient`,
the default) or in the writer thread (:class:`DirectStore`)."""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Protocol

from fleet.errors import FleetStoreError, StoreRefused
from fleet.ingest.checks import BatchOutcome, Incoming, Sites, process_batch
from fleet.store import Gap, Quarantined, Store, open_store, redact_url


class StoreOps(Protocol):
    """What the writer thread uses: a :class:`StoreClient` or a :class:`DirectStore`."""

    def process(self, items: Sequence[Incoming], *, auto_register: bool) -> BatchOutcome: ...
    def quarantine(self, items: Sequence[Quarantined]) -> None: ...
    def new_gaps(self, since_ns: int, until_ns: int, now_ns: int) -> list[Gap]: ...
    def ping(self) -> None: ...
    def close(self) -> None: ...


class DirectStore:
    """:func:`process_batch` on a store in the writer's own thread (``store_process=False``)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._known: Sites = {}

    def process(self, items: Sequence[Incoming], *, auto_register: bool) -> BatchOutcome:
        return process_batch(self._store, items, self._known, auto_register=auto_register)

    def quarantine(self, items: Sequence[Quarantined]) -> None:
        self._store.quarantine(items)

    def new_gaps(self, since_ns: int, until_ns: int, now_ns: int) -> list[Gap]:
        return self._store.record_new_gaps(since_ns, until_ns, now_ns)

    def ping(self) -> None:
        self._store.ping()

    def close(self) -> None:
        self._store.close()


def _store_server(url: str, migrate: bool, conn: Connection) -> None:
    """The store process: one Store, requests over ``conn``, one reply per request."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    try:
        store = open_store(url)
        if migrate:
            store.migrate()
    except Exception as exc:  # noqa: BLE001 - sent to the parent, which raises it
        conn.send(("err", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", None))
    known: Sites = {}
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            if request is None:
                return
            method, args = request
            if method not in ("batch", "quarantine", "gaps", "ping"):
                conn.send(("err", f"unknown store request {method!r}"))
                continue
            try:
                result: object = None
                if method == "batch":
                    items, auto = args
                    out = process_batch(store, items, known, auto_register=auto)
                    result = (
                        out.inserted,
                        out.duplicates,
                        out.conflicts,
                        out.states,
                        out.refused,
                        out.notes,
                        out.t_ns,
                        out.stored,
                    )
                elif method == "ping":
                    store.ping()
                elif method == "gaps":
                    found = store.record_new_gaps(*args)
                    result = [(g.device, g.boot_id, g.first_missing, g.last_missing) for g in found]
                else:
                    store.quarantine([Quarantined(*t) for t in args])
            except StoreRefused as exc:  # the parent raises it again as a refusal
                conn.send(("refused", str(exc)))
            except Exception as exc:  # noqa: BLE001 - every failure goes back as text
                conn.send(("err", f"{type(exc).__name__}: {exc}"))
            else:
                conn.send(("ok", result))
    finally:
        store.close()


class StoreClient:
    """The store, run in a process of its own, called synchronously over a pipe; the checks
    of every message (:func:`process_batch`) run there too.

    Why: the worker's process is bound by one GIL, and paho's network thread needs it for
    every packet it parses. Written from that process, the SQLite and PostgreSQL drivers
    release the GIL around every row and then wait to take it back (a row cost ~100 us
    instead of ~10 us); decoding and checking payloads there took the GIL from paho for
    about half as long again as paho itself held it. Over the pipe, the writer thread only
    pickles the raw tuples (a few us per batch of bytes) and sleeps, GIL released, while
    the store process decodes, checks and writes on the other core.

    A failed call raises FleetStoreError (the batch is retried); a dead store process is
    started again on the next call.
    """

    def __init__(self, url: str, *, migrate: bool) -> None:
        self._url = url
        self._migrate = migrate
        self._ctx = multiprocessing.get_context("spawn")
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._start()

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_store_server, args=(self._url, self._migrate, child), daemon=True
        )
        proc.start()
        child.close()
        status, detail = parent.recv() if parent.poll(60) else ("err", "no answer in 60 s")
        if status != "ok":
            proc.kill()
            parent.close()
            raise FleetStoreError(f"store process for {redact_url(self._url)}: {detail}")
        self._proc, self._conn = proc, parent
        self._migrate = False  # migrated once; a restart need not

    def _call(self, method: str, args: object) -> object:
        if self._conn is None:
            self._start()
        assert self._conn is not None
        try:
            self._conn.send((method, args))
            status, result = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._drop()
            raise FleetStoreError(f"store process died during {method}: {exc}") from None
        if status == "refused":
            raise StoreRefused(str(result))
        if status != "ok":
            raise FleetStoreError(str(result))
        return result

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        self._conn = self._proc = None

    def process(self, items: Sequence[Incoming], *, auto_register: bool) -> BatchOutcome:
        result = self._call("batch", (items, auto_register))
        assert isinstance(result, tuple)
        inserted, duplicates, conflicts, states, refused, notes, t_ns, stored = result
        return BatchOutcome(
            int(inserted),
            int(duplicates),
            int(conflicts),
            int(states),
            refused,
            notes,
            t_ns,
            stored,
        )

    def quarantine(self, items: Sequence[Quarantined]) -> None:
        self._call(
            "quarantine",
            [(q.topic, q.payload, q.reason, q.where, q.received_ns, q.device) for q in items],
        )

    def new_gaps(self, since_ns: int, until_ns: int, now_ns: int) -> list[Gap]:
        result = self._call("gaps", (since_ns, until_ns, now_ns))
        assert isinstance(result, list)
        return [Gap(*g) for g in result]

    def ping(self) -> None:
        self._call("ping", None)

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            if self._proc is not None:
                self._proc.join(10)
        self._drop()
