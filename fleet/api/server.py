"""Serving the API on ``fleet serve``'s event loop: uvicorn on a socket bound here (so a
port in use is one clear error, not uvicorn's exit), TLS when a certificate is given."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from fleet.errors import FleetError

log = logging.getLogger(__name__)


class ApiPortInUse(FleetError):
    """The API's address is taken (another fleet serve?)."""


@dataclass(frozen=True)
class HttpListen:
    host: str
    port: int
    cert: Path | None = None
    key: Path | None = None

    @property
    def tls(self) -> bool:
        return self.cert is not None


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``; raises FleetError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise FleetError(f"--http {text!r}: expected HOST:PORT (e.g. 127.0.0.1:8780)")
    return host, int(port)


def bind(listen: HttpListen) -> socket.socket:
    family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it a response written in two parts waits for the client's delayed ACK (~40 ms
    # per request on a kept-alive connection).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((listen.host, listen.port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ApiPortInUse(
                f"--http: {listen.host}:{listen.port} is already in use (another fleet serve?); "
                "choose another port"
            ) from None
        raise FleetError(
            f"--http: cannot listen on {listen.host}:{listen.port}: {exc.strerror}"
        ) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def serve_api(
    app: FastAPI, sock: socket.socket, listen: HttpListen, stop: threading.Event
) -> None:
    """Serve ``app`` on ``sock`` until ``stop`` is set."""
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        ssl_certfile=str(listen.cert) if listen.cert else None,
        ssl_keyfile=str(listen.key) if listen.key else None,
        timeout_graceful_shutdown=3,
    )
    server = uvicorn.Server(config)
    # Run on fleet serve's service thread: uvicorn installs no signal handlers off the main
    # thread, so SIGTERM stays fleet serve's.

    async def watch() -> None:
        await asyncio.to_thread(stop.wait)
        server.should_exit = True

    watcher = asyncio.create_task(watch())
    try:
        host, port = sock.getsockname()[:2]
        log.info(
            "api: %s://%s:%d/ (API under /api/v1)", "https" if listen.tls else "http", host, port
        )
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
