"""Errors as the agent's API gives them: ``{"error": "...", "where": "..."}`` with a status
that says whose fault it is. Every exception a handler lets out is mapped here."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from fleet.changes import Forbidden
from fleet.errors import AccessError, FleetError, FleetStoreError, RolloutError

log = logging.getLogger(__name__)


class ApiProblem(Exception):
    """A request refused with ``status``: ``error`` says what, ``where`` names the field."""

    def __init__(self, status: int, error: str, where: str) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.where = where


def _body(
    status: int, error: str, where: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": error, "where": where}, status_code=status, headers=dict(headers or {})
    )


def _where(loc: Sequence[object]) -> str:
    return ".".join(str(p) for p in loc)


def install(app: FastAPI) -> None:
    """Map every error to ``{"error", "where"}``."""

    @app.exception_handler(ApiProblem)
    async def problem(_r: Request, exc: ApiProblem) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _body(exc.status, exc.error, exc.where, headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_r: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        return _body(422, str(first.get("msg", "invalid")), _where(first.get("loc", ())))

    @app.exception_handler(HTTPException)
    async def http(r: Request, exc: HTTPException) -> JSONResponse:
        return _body(exc.status_code, str(exc.detail), r.url.path, exc.headers)

    @app.exception_handler(FleetError)
    async def fleet(r: Request, exc: FleetError) -> JSONResponse:
        text = str(exc)
        if isinstance(exc, Forbidden):
            return _body(403, text, "role")
        if isinstance(exc, FleetStoreError):
            log.error("api %s %s: %s", r.method, r.url.path, text)
            return _body(503, f"store unavailable: {text}", "store")
        if isinstance(exc, RolloutError) and text.startswith("no rollout"):
            return _body(404, text, r.url.path)
        if isinstance(exc, RolloutError | AccessError):
            return _body(
                409 if "exists already" in text or "active rollout" in text else 400, text, "body"
            )
        log.error("api %s %s: %s", r.method, r.url.path, text)
        return _body(500, text, r.url.path)
