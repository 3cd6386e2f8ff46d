"""The FastAPI application: routers under ``/api/v1``, its OpenAPI document, ``/metrics``,
error mapping and per-route request metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.staticfiles import StaticFiles

from fleet import __version__, console
from fleet.api import events, problems, routes_admin, routes_fleet, routes_rollouts
from fleet.api.context import ApiContext

PREFIX = "/api/v1"


def _route_of(request: Request) -> str:
    """The matched route's template (never the raw path: device names are unbounded);
    ``unmatched`` for a path no route serves."""
    route = request.scope.get("route")
    path = getattr(route, "path", None)
    if not path:
        return "unmatched"
    # FastAPI hands the route as its router declared it, without the router's prefix.
    if request.url.path.startswith(PREFIX + "/") and not str(path).startswith(PREFIX):
        return PREFIX + str(path)
    return str(path)


def create_app(ctx: ApiContext) -> FastAPI:
    hub = events.EventHub(ctx.pool)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await hub.close()
            ctx.pool.close()

    app = FastAPI(
        title="EdgeFleet fleet API",
        version=__version__,
        openapi_url=f"{PREFIX}/openapi.json",
        # The interactive docs pages load their scripts from a CDN: a plant has no internet.
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    app.state.hub = hub
    problems.install(app)
    for router in (routes_fleet.router, routes_rollouts.router, routes_admin.router, events.router):
        app.include_router(router, prefix=PREFIX)
    app.include_router(console.router)
    app.mount("/static", StaticFiles(directory=console.STATIC_DIR), name="static")

    @app.get(f"{PREFIX}/health", summary="Liveness (no sign-in needed)")
    def health() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        if ctx.render_metrics is None:
            return Response("", media_type="text/plain; version=0.0.4")
        body, content_type = ctx.render_metrics()
        return Response(body, media_type=content_type)

    if ctx.metrics is not None:
        sink = ctx.metrics

        @app.middleware("http")
        async def count(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            started = time.perf_counter()
            status = 500
            try:
                response = await call_next(request)
                status = response.status_code
                return response
            finally:
                sink.observe_request(_route_of(request), status, time.perf_counter() - started)

    return app
