"""Who is asking: a bearer token or a console session cookie, and what their role allows.

Tokens and session cookies are looked up by their hash and compared in constant time
(:mod:`fleet.access`); neither is ever logged. A change made with a session cookie must
carry the session's CSRF token in ``X-CSRF-Token`` (the cookie is also ``SameSite=Strict``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request

from fleet import access
from fleet.access import Principal, Role
from fleet.api.context import ApiContext
from fleet.api.problems import ApiProblem

COOKIE = "efsession"
CSRF_HEADER = "X-CSRF-Token"
_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})


def context(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ApiContext, Depends(context)]


def remote(request: Request) -> str:
    """The client's address as the audit log records it."""
    return request.client.host if request.client else "unknown"


def token_principal(ctx: ApiContext, value: str, where: str, via: str) -> Principal:
    """The principal of an API token (the API's bearer header and the console's sign-in);
    401 naming ``where`` for a malformed, unknown, wrong, revoked or expired one."""
    parts = access.split_token(value)
    if parts is None:
        raise ApiProblem(401, "malformed token (expected eft_<id>_<secret>)", where)
    token_id, secret = parts
    now = ctx.clock()
    with ctx.pool.store() as st:
        found = st.token(token_id)
        if found is None or not access.secret_matches(secret, found[1]):
            raise ApiProblem(401, "unknown or wrong token", where)
        info = found[0]
        if not info.usable(now):
            why = "revoked" if info.revoked_ns is not None else "expired"
            raise ApiProblem(401, f"token {info.name!r} is {why}", where)
        st.touch_token(token_id, now)
    return Principal(f"token:{info.name}", access.check_role(info.role), via)


def from_cookie(ctx: ApiContext, cookie: str) -> Principal | None:
    with ctx.pool.store() as st:
        found = st.session(access.session_hash(cookie), ctx.clock())
    if found is None:
        return None
    name, role, csrf = found
    return Principal(name, access.check_role(role), "console", csrf)


def principal(request: Request, ctx: Ctx) -> Principal:
    """The caller; 401 without valid credentials, and for a session-cookie change without
    its CSRF token."""
    header = request.headers.get("authorization")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise ApiProblem(401, "expected Authorization: Bearer TOKEN", "header.Authorization")
        return token_principal(ctx, value.strip(), "header.Authorization", "api")
    cookie = request.cookies.get(COOKIE)
    who = from_cookie(ctx, cookie) if cookie else None
    if who is None:
        raise ApiProblem(401, "sign in or send Authorization: Bearer TOKEN", "header.Authorization")
    if request.method not in _SAFE:
        sent = request.headers.get(CSRF_HEADER, "")
        if not sent or not access.secret_matches_plain(sent, who.csrf):
            raise ApiProblem(
                403,
                f"missing or wrong {CSRF_HEADER} for a change by session",
                f"header.{CSRF_HEADER}",
            )
    return who


Who = Annotated[Principal, Depends(principal)]


def require(role: Role) -> Callable[[Principal, Request, ApiContext], Principal]:
    """A dependency: the caller, if their role is at least ``role`` (else 403)."""

    def check(who: Who, request: Request, ctx: Ctx) -> Principal:
        if not access.allows(who.role, role):
            why = f"needs the {role} role ({who.name} is {who.role})"
            if request.method not in _SAFE:  # a change refused is a change attempted: record it
                entry = access.AuditEntry(
                    ctx.clock(), who.name, who.via, remote(request),
                    f"{request.method} {request.url.path}", "", f"forbidden: {why}",
                )  # fmt: skip
                with ctx.pool.store() as st:
                    st.audit(entry)
            raise ApiProblem(403, why, "role")
        return who

    return check


Viewer = Annotated[Principal, Depends(require("viewer"))]
Operator = Annotated[Principal, Depends(require("operator"))]
Admin = Annotated[Principal, Depends(require("admin"))]
