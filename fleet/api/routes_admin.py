"""Signing in and out of the console, the audit log, users and API tokens."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from fleet import access
from fleet.access import Principal
from fleet.api import views as v
from fleet.api.auth import COOKIE, Admin, Ctx, Operator, Viewer, remote, token_principal
from fleet.api.problems import ApiProblem
from fleet.changes import Changes

router = APIRouter()


class SignIn(BaseModel):
    """A user's name and password, or an API token."""

    user: str | None = Field(default=None, max_length=64)
    password: str | None = Field(default=None, max_length=1024)
    token: str | None = Field(default=None, max_length=256)


class Session(BaseModel):
    name: str
    role: str
    via: str
    csrf: str = Field(description="Send it back as X-CSRF-Token with every change.")


def _principal_of(ctx: Ctx, body: SignIn) -> Principal:
    if body.token:
        return token_principal(ctx, body.token, "body.token", "console")
    if not body.user or body.password is None:
        raise ApiProblem(400, "give user and password, or token", "body")
    with ctx.pool.store() as st:
        found_user = st.user_password(body.user)
    # A hash is computed even for an unknown user, so timing does not tell who exists.
    stored = found_user[1] if found_user else access.hash_password("x" * access.MIN_PASSWORD)
    if not access.password_matches(body.password, stored) or found_user is None:
        raise ApiProblem(401, "wrong user name or password", "body.password")
    return Principal(body.user, access.check_role(found_user[0]), "console")


def start_session(ctx: Ctx, request: Request, response: Response, body: SignIn) -> Session:
    """Check the credentials, store a new session, set its cookie on ``response`` and audit
    the sign-in (the API's and the console's sign-in both)."""
    who = _principal_of(ctx, body)
    now = ctx.clock()
    made = access.new_session(now)
    with ctx.pool.store() as st:
        st.add_session(
            made.secret_hash, who.name, who.role, made.csrf, now_ns=now, expires_ns=made.expires_ns
        )
        st.audit(
            access.AuditEntry(
                now, who.name, "console", remote(request), "session.sign_in", who.name, "ok"
            )
        )
    response.set_cookie(
        COOKIE, made.cookie, max_age=access.SESSION_NS // 1_000_000_000, httponly=True,
        secure=ctx.config.secure_cookies, samesite="strict", path="/",
    )  # fmt: skip
    return Session(name=who.name, role=who.role, via="console", csrf=made.csrf)


@router.post("/session", response_model=Session, summary="Sign in (sets the session cookie)")
def sign_in(ctx: Ctx, request: Request, response: Response, body: SignIn) -> Session:
    return start_session(ctx, request, response, body)


@router.get("/session", response_model=Session, summary="Who is signed in")
def whoami(who: Viewer) -> Session:
    return Session(name=who.name, role=who.role, via=who.via, csrf=who.csrf)


@router.delete("/session", summary="Sign out")
def sign_out(ctx: Ctx, request: Request, response: Response, _who: Viewer) -> dict[str, bool]:
    cookie = request.cookies.get(COOKIE)
    if cookie:
        with ctx.pool.store() as st:
            st.drop_session(access.session_hash(cookie))
    response.delete_cookie(COOKIE, path="/")
    return {"signed_out": True}


@router.get("/audit", response_model=v.AuditPage, summary="Every change: who, when, what")
def audit(
    ctx: Ctx,
    _who: Operator,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: str | None = None,
) -> v.AuditPage:
    before = v.id_cursor(cursor)
    with ctx.pool.store() as st:
        rows = st.audit_log(before_id=before, limit=limit + 1)
    page = rows[:limit]
    nxt = v.encode_cursor([page[-1].id]) if len(rows) > limit else None
    return v.AuditPage(items=[v.audit_view(e) for e in page], next=nxt)


class NewUser(BaseModel):
    name: str = Field(max_length=64)
    role: str
    password: str = Field(max_length=1024)


@router.get("/users", summary="Users of the console")
def users(ctx: Ctx, _who: Admin) -> list[dict[str, Any]]:
    with ctx.pool.store() as st:
        return [
            {"name": u.name, "role": u.role, "created": v.iso(u.created_ns), "disabled": u.disabled}
            for u in st.users()
        ]


@router.post("/users", status_code=201, summary="Add a user")
def add_user(ctx: Ctx, who: Admin, request: Request, body: NewUser) -> dict[str, str]:
    with ctx.pool.store() as st:
        Changes(st, who, remote=remote(request), clock=ctx.clock).add_user(
            body.name, body.role, body.password
        )
    return {"name": body.name, "role": body.role}


class NewToken(BaseModel):
    name: str = Field(max_length=64)
    role: str
    expires: str | None = Field(default=None, description="e.g. 30d, 12h; none: never.")


@router.get("/tokens", summary="API tokens (never their secrets)")
def tokens(ctx: Ctx, _who: Admin) -> list[dict[str, Any]]:
    now = ctx.clock()
    with ctx.pool.store() as st:
        return [
            {
                "id": t.token_id,
                "name": t.name,
                "role": t.role,
                "created": v.iso(t.created_ns),
                "created_by": t.created_by,
                "expires": v.iso(t.expires_ns),
                "revoked": v.iso(t.revoked_ns),
                "last_used": v.iso(t.last_used_ns),
                "usable": t.usable(now),
            }
            for t in st.tokens()
        ]


@router.post("/tokens", status_code=201, summary="Create a token (its text is shown once)")
def create_token(ctx: Ctx, who: Admin, request: Request, body: NewToken) -> dict[str, str]:
    expires = access.parse_duration_ns(body.expires) if body.expires else None
    with ctx.pool.store() as st:
        made = Changes(st, who, remote=remote(request), clock=ctx.clock).create_token(
            body.name, body.role, expires_in_ns=expires
        )
    return {"name": body.name, "role": body.role, "id": made.token_id, "token": made.text}


@router.delete("/tokens/{name}", summary="Revoke a token")
def revoke_token(ctx: Ctx, who: Admin, request: Request, name: str) -> dict[str, str]:
    with ctx.pool.store() as st:
        Changes(st, who, remote=remote(request), clock=ctx.clock).revoke_token(name)
    return {"revoked": name}
