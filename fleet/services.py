"""``fleet serve``'s service thread: the rollout service (artifact server and orchestrator)
and the HTTP API (:mod:`fleet.api`) on one event loop, beside the ingest workers.

What ends a service with an exception is appended to ``errors`` and sets ``stop``: an
ingest running on with no orchestrator or API looks healthy while rollouts stand still
and operators are locked out. The API's socket is bound before the thread starts, so a
port in use is reported at once. Design: docs/ARCHITECTURE.md, "The fleet API".
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.errors import ArtifactPortInUse, FleetError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from fleet.api.server import HttpListen
    from fleet.rollout.service import RolloutService

log = logging.getLogger(__name__)

#: How long the other services get to stop when one failed, before they are cancelled.
STOP_GRACE_S = 10.0


@dataclass
class ApiService:
    app: FastAPI
    sock: socket.socket
    listen: HttpListen


def build_api(
    store_url: str,
    listen: HttpListen,
    *,
    artifacts: Path,
    root_json: Path | None,
    metrics: Any = None,
    render_metrics: Callable[[], tuple[bytes, str]] | None = None,
) -> ApiService:
    """The API app on a bound socket. Raises FleetError (``ApiPortInUse``) if it cannot bind."""
    from fleet.api import ApiConfig, ApiContext, create_app  # noqa: PLC0415 - on use
    from fleet.api.context import StorePool  # noqa: PLC0415
    from fleet.api.server import bind  # noqa: PLC0415

    sock = bind(listen)
    config = ApiConfig(
        store_url=store_url, artifacts=artifacts, root_json=root_json, secure_cookies=listen.tls
    )
    ctx = ApiContext(config, StorePool(store_url), metrics=metrics, render_metrics=render_metrics)
    return ApiService(create_app(ctx), sock, listen)


def start_services(
    stop: threading.Event,
    errors: list[BaseException],
    *,
    rollouts: RolloutService | None,
    api: ApiService | None,
) -> threading.Thread | None:
    """Run the services given on a thread of their own until ``stop``; None if none given."""
    if rollouts is None and api is None:
        return None

    async def main() -> None:
        jobs: list[Coroutine[Any, Any, None]] = []
        if rollouts is not None:
            from fleet.rollout.service import run_rollouts  # noqa: PLC0415

            jobs.append(run_rollouts(rollouts, stop))
        if api is not None:
            from fleet.api.server import serve_api  # noqa: PLC0415

            jobs.append(serve_api(api.app, api.sock, api.listen, stop))
        tasks = [asyncio.create_task(j) for j in jobs]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        # One service failed (or all stopped): the others stop on ``stop`` and are given
        # the time to close their connections before they are cancelled.
        stop.set()
        if pending:
            _, late = await asyncio.wait(pending, timeout=STOP_GRACE_S)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for t in done:
            t.result()  # the failure, if any, to services_main

    def services_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # its one line is printed by fleet serve
            errors.append(exc)
            if not isinstance(exc, FleetError):  # a bug: the trace is worth having
                log.exception("a fleet serve service failed; stopping fleet serve")
            stop.set()

    thread = threading.Thread(target=services_main, name="services", daemon=True)
    thread.start()
    return thread


def service_failure(failure: BaseException) -> str:
    """The one line ``fleet serve`` ends with when a service failed."""
    if isinstance(failure, ArtifactPortInUse):
        option = "--artifact-port" if failure.transport == "HTTP" else "--coap-port"
        return (
            f"{option}: {failure.host}:{failure.port} is already in use (another fleet "
            "serve?); choose another port"
        )
    return f"service failed: {failure}"
