"""The agent's HTTP API on the gateway: health probes, status and Prometheus metrics.

``POST /v1/health``, ``GET /v1/status`` and ``GET /metrics`` (what each answers:
:class:`HealthApi`). Handlers run on the agent's event loop and call the agent synchronously,
so a probe runs between two windows and never races the live pipeline over the stages' state.

aiohttp is imported when the server starts, not with this module: the config loader
imports :class:`ApiSection`, and ``edge-agent check`` has no use for an HTTP server.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Protocol

import numpy as np
from pydantic import Field

from edge_agent._schema import StrictModel
from edge_agent.probe import Probe, ProbeError, ProbeResult, ProbeTooLarge, parse_probe

if TYPE_CHECKING:
    from aiohttp import web

    from edge_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)

#: Waiting for in-flight requests at stop; systemd allows the whole agent 10 s to stop.
SHUTDOWN_TIMEOUT_S = 2.0
_CHUNK = 16_384


class ApiSection(StrictModel):
    """The ``[api]`` section (see the module docstring). Strict, unknown keys rejected.

    The ``[api]`` section: every key with its default in ``examples/agent.toml``.
    """

    enabled: bool = True
    host: Annotated[str, Field(min_length=1, max_length=255)] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65_535)] = 8080
    #: A probe is a few numbers; the cap bounds what one request can make the agent hold.
    max_body_bytes: Annotated[int, Field(ge=128, le=1 << 20)] = 65_536
    access_log: bool = False


class AgentView(Protocol):
    """What the API needs of the agent (:class:`edge_agent.service.Agent` is one)."""

    @property
    def metrics(self) -> AgentMetrics: ...
    @property
    def signals(self) -> Sequence[str]: ...
    def status(self) -> Mapping[str, Any]: ...
    def probe(self, probe: Probe) -> ProbeResult:
        """Run a probe through the stages; synchronous, on the loop, between two windows."""
        ...

    def health_status(self) -> str:
        """``ok`` or ``degraded``: the agent's own judgement."""
        ...

    async def ota_request(self, action: str, arg: str) -> tuple[int, Mapping[str, Any]]:
        """``install`` a bundle file at path ``arg`` or ``rollback`` kind ``arg``: the HTTP
        status and the outcome (what ``edge-agent ota`` prints)."""
        ...


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]


class HealthApi:
    """The HTTP server of :mod:`edge_agent.api`; ``async with`` starts and stops it.

    With ``section.enabled`` false, :meth:`start` does nothing.

    Routes (JSON unless said otherwise; NaN/inf become ``null``):

    * ``POST /v1/health`` -- a probe ``{"sensor_id", "timestamp_ns", "payload": {signal: value}}``
      (see :func:`edge_agent.probe.parse_probe`) goes through perception, memory and reasoning
      without changing them; 200 ``{"status": "ok"|"degraded", "sensor_id", "label", "score",
      "stage_latency_ms": {"perception", "memory", "reasoning"}, ...}``. A malformed probe is
      400 ``{"error", "where"}``; a body over ``max_body_bytes`` is 413, refused before parsing
      (by its Content-Length when it has one, else while reading); a failure inside the agent
      is 500 with a message, logged, and the server carries on.
    * ``GET /v1/status`` -- the agent's status snapshot.
    * ``GET /metrics`` -- Prometheus text exposition (:class:`edge_agent.metrics.AgentMetrics`).

    Handlers run on the agent's event loop and call the agent synchronously, so a probe runs
    between two windows and never races the live pipeline over the stages' state. The access
    log is off by default: a probe every second would otherwise flood the journal.
    """

    def __init__(self, view: AgentView, section: ApiSection) -> None:
        self.view = view
        self.section = section
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> HealthApi:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        """The bound port (the real one when the config says 0). Only while listening."""
        if self._runner is None or not self._runner.addresses:
            raise RuntimeError("the health API is not listening")
        port: int = self._runner.addresses[0][1]
        return port

    async def start(self) -> None:
        """Bind ``host:port`` and serve. Raises ``OSError`` when the port cannot be bound."""
        if not self.section.enabled or self._runner is not None:
            return
        from aiohttp import web  # noqa: PLC0415 - on use, see the module docstring

        async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await self._errors(request, handler)

        # client_max_size guards every route that reads a body through aiohttp; /v1/health
        # reads its own, in chunks, to refuse an oversized one before holding all of it.
        app = web.Application(
            client_max_size=self.section.max_body_bytes, middlewares=[web.middleware(errors)]
        )
        app.router.add_post("/v1/health", self._health)
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/ota/{action:install|rollback}", self._ota)
        runner = web.AppRunner(
            app,
            access_log=logging.getLogger(f"{__name__}.access") if self.section.access_log else None,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, self.section.host, self.section.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        log.info("health API on http://%s:%d", self.section.host, self.port)

    async def stop(self) -> None:
        """Stop listening; requests in flight get :data:`SHUTDOWN_TIMEOUT_S`. Idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # -- handlers ---------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.StreamResponse:
        cap = self.section.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > cap:
            return _too_large(f"body is {declared} bytes; at most {cap}")
        body = bytearray()
        # Read in chunks and stop at the cap: a chunked body has no length to check first.
        async for chunk in request.content.iter_chunked(_CHUNK):
            body += chunk
            if len(body) > cap:
                return _too_large(f"body is over {cap} bytes")
        try:
            probe = parse_probe(bytes(body), self.view.signals, max_bytes=cap)
        except ProbeTooLarge as exc:
            return _too_large(exc.message)
        except ProbeError as exc:
            return _json({"error": exc.message, "where": exc.where}, status=400)
        try:
            result = self.view.probe(probe)
            health = self.view.health_status()
        except Exception as exc:
            log.exception("health probe from %s failed", probe.sensor_id)
            return _json({"error": f"probe failed: {type(exc).__name__}: {exc}"}, status=500)
        return _json({"status": health, **result.to_json()})

    async def _ota(self, request: web.Request) -> web.StreamResponse:
        """``{"path": FILE}`` to install (the bundle is verified like any other; the API only
        listens on loopback) or ``{"kind": "model"}`` to roll back."""
        action = request.match_info["action"]
        if not _loopback(self.section.host):
            # Installing and rolling back have no authentication of their own: only a
            # process on the gateway may ask (the bundle is verified all the same).
            return _json({"error": "OTA requests need [api] host on loopback"}, status=403)
        if request.content_type != "application/json":
            # A browser's cross-site form or text/plain post does not get this far.
            return _json({"error": "expected Content-Type application/json"}, status=415)
        try:
            body = await request.json()
        except ValueError:
            return _json({"error": "expected a JSON object", "where": "body"}, status=400)
        key = "path" if action == "install" else "kind"
        arg = body.get(key) if isinstance(body, dict) else None
        if not isinstance(arg, str) or not arg or len(arg) > 4096:
            return _json({"error": f"expected a string {key!r}", "where": key}, status=400)
        status, outcome = await self.view.ota_request(action, arg)
        return _json(outcome, status=status)

    async def _status(self, request: web.Request) -> web.StreamResponse:
        return _json(self.view.status())

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web  # noqa: PLC0415 - loaded by start() already

        body, content_type = self.view.metrics.render()
        # Set as a header: web.Response(content_type=...) refuses one with a charset.
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Any other failure is a 500 with a message, never a dead server."""
        from aiohttp import web  # noqa: PLC0415 - loaded by start() already

        try:
            return await handler(request)
        except web.HTTPException:
            raise  # 404, 405, ...: aiohttp's own answers
        except Exception as exc:
            log.exception("health API: %s %s failed", request.method, request.path)
            return _json({"error": f"{type(exc).__name__}: {exc}"}, status=500)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _too_large(message: str) -> web.Response:
    return _json({"error": message, "where": "body"}, status=413)


def _json(data: Any, *, status: int = 200) -> web.Response:
    from aiohttp import web  # noqa: PLC0415 - loaded by start() already

    text = json.dumps(jsonable(data), allow_nan=False, separators=(",", ":"))
    return web.Response(text=text, status=status, content_type="application/json")


def jsonable(obj: Any) -> Any:
    """``obj`` with NaN/inf as None, numpy scalars and arrays as Python, tuples and sets as
    lists and anything else unknown as its ``str``: strict JSON whatever the status holds."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, str | int):
        return obj
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic | np.ndarray):
        return jsonable(obj.tolist())
    return str(obj)


__all__ = ["SHUTDOWN_TIMEOUT_S", "AgentView", "ApiSection", "HealthApi", "jsonable"]
