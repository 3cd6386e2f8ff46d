"""The fleet API served for real: uvicorn on a loopback socket in a thread of its own, with
the store, artifact folder and clock a test gives, and tokens per role made through
:class:`fleet.changes.Changes` as ``fleet tokens create`` makes them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fleet.access import Principal
from fleet.api import ApiConfig, ApiContext, create_app
from fleet.api.context import StorePool
from fleet.api.server import HttpListen, bind, serve_api
from fleet.changes import Changes
from fleet.store import OperatorStore, open_store

ROLES = ("viewer", "operator", "admin")


@dataclass
class Clock:
    """A settable clock for token expiry and audit times (starts at the wall clock)."""

    now_ns: int = field(default_factory=time.time_ns)

    def __call__(self) -> int:
        return self.now_ns


@dataclass
class Api:
    base: str
    store_url: str
    tokens: dict[str, str]
    clock: Clock

    def client(self, role: str | None = "admin", **kw: object) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.tokens[role]}"} if role else {}
        return httpx.Client(base_url=self.base, headers=headers, timeout=30, **kw)  # type: ignore[arg-type]

    def store(self) -> OperatorStore:
        st = open_store(self.store_url)
        st.migrate()
        return st


def make_tokens(url: str) -> dict[str, str]:
    """One token per role, made as the CLI makes them."""
    st = open_store(url)
    try:
        st.migrate()
        changes = Changes(st, Principal("cli:test", "admin", "cli"))
        return {role: changes.create_token(f"t-{role}", role).text for role in ROLES}
    finally:
        st.close()


@contextmanager
def running_api(
    store_url: str,
    artifacts: Path,
    *,
    root_json: Path | None = None,
    clock: Clock | None = None,
    render_metrics: Callable[[], tuple[bytes, str]] | None = None,
) -> Iterator[Api]:
    clock = clock or Clock()
    tokens = make_tokens(store_url)
    listen = HttpListen("127.0.0.1", 0)
    sock = bind(listen)
    port = sock.getsockname()[1]
    ctx = ApiContext(
        ApiConfig(store_url=store_url, artifacts=artifacts, root_json=root_json),
        StorePool(store_url),
        clock=clock,
        render_metrics=render_metrics,
    )
    app = create_app(ctx)
    stop = threading.Event()
    thread = threading.Thread(
        target=lambda: asyncio.run(serve_api(app, sock, listen, stop)), name="api", daemon=True
    )
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            httpx.get(f"{base}/api/v1/health", timeout=2).raise_for_status()
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        yield Api(base, store_url, tokens, clock)
    finally:
        stop.set()
        thread.join(15)
