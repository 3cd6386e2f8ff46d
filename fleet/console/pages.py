"""The console's pages: sign-in, overview, devices, a device, rollouts, a rollout,
quarantine and audit. Each page is the store read the matching API route makes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import jinja2
from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from fleet import access
from fleet.access import Principal
from fleet.api import views as v
from fleet.api.auth import COOKIE, Ctx, from_cookie
from fleet.api.problems import ApiProblem
from fleet.api.routes_admin import SignIn, start_session
from fleet.rollout.orchestrator import load
from fleet.rollout.report import summary
from fleet.store.console_sql import DeviceFilter

HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"),
    autoescape=True,  # every page: device names, labels, reasons are untrusted text
    undefined=jinja2.StrictUndefined,
)
_SORTS = ("device", "site", "last_seen", "version")
_HOUR_NS = 3600 * 1_000_000_000

#: Scripts only from this server (no inline script, so an injected one would not run), no
#: framing (clickjacking); inline styles are allowed (progress bars, uPlot's layout).
_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}

router = APIRouter(include_in_schema=False)


def _render(name: str, who: Principal | None, **ctx: Any) -> HTMLResponse:
    html = _ENV.get_template(name).render(
        who=who, can_change=who is not None and access.allows(who.role, "operator"), **ctx
    )
    return HTMLResponse(html, headers=_HEADERS)


def _who(ctx: Ctx, request: Request) -> Principal | None:
    cookie = request.cookies.get(COOKIE)
    return from_cookie(ctx, cookie) if cookie else None


def _to_signin(request: Request) -> RedirectResponse:
    target = quote(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
    return RedirectResponse(f"/signin?next={target}", status_code=303)


@router.get("/signin")
def signin_page(error: str = "", next: str = "/") -> HTMLResponse:
    return _render("signin.html", None, error=error, next=_safe_next(next))


def _safe_next(target: str) -> str:
    """Only a path on this site: never an open redirect to another host."""
    return target if target.startswith("/") and not target.startswith("//") else "/"


@router.post("/signin")
def signin(  # noqa: PLR0917 - the form's fields
    ctx: Ctx,
    request: Request,
    user: Annotated[str, Form()] = "",
    password: Annotated[str, Form()] = "",
    token: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/",
) -> Response:
    body = SignIn(token=token) if token else SignIn(user=user, password=password)
    response = RedirectResponse(_safe_next(next), status_code=303)
    try:
        start_session(ctx, request, response, body)
    except ApiProblem as exc:
        return _render("signin.html", None, error=exc.error, next=_safe_next(next))
    return response


@router.post("/signout")
def signout(ctx: Ctx, request: Request) -> Response:
    cookie = request.cookies.get(COOKIE)
    if cookie:
        with ctx.pool.store() as st:
            st.drop_session(access.session_hash(cookie))
    response = RedirectResponse("/signin", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


@router.get("/")
def overview(ctx: Ctx, request: Request) -> Response:
    who = _who(ctx, request)
    if who is None:
        return _to_signin(request)
    now = ctx.clock()
    with ctx.pool.store() as st:
        online, offline, _ = st.fleet_state()
        rollouts = [load(doc)[0] for _, _, doc in st.rollouts(active_only=True)]
        alarms = [
            v.decision_view(*r) for r in st.decisions_page(since_ns=now - _HOUR_NS, limit=1000)
        ]
    alarms = [d for d in alarms if d.alarm]
    failing = sum(
        1
        for r in rollouts
        for d in r.devices.values()
        if d.state in ("failed", "rolled_back", "timed_out")
    )
    return _render(
        "overview.html", who, online=online, offline=offline, failing=failing,
        alarms=alarms[:20], alarm_count=len(alarms), rollouts=[summary(r) for r in rollouts],
    )  # fmt: skip


@router.get("/devices")
def devices(  # noqa: PLR0917 - the filters
    ctx: Ctx,
    request: Request,
    site: str = "",
    tier: str = "",
    type: str = "",
    online: str = "",
    version: str = "",
    label: str = "",
    q: str = "",
    sort: str = "device",
) -> Response:
    who = _who(ctx, request)
    if who is None:
        return _to_signin(request)
    key = sort.lstrip("-") if sort.lstrip("-") in _SORTS else "device"
    f = DeviceFilter(
        site=site or None, tier=tier or None, device_type=type or None,
        online={"yes": True, "no": False}.get(online), version=version or None,
        group=label or None, q=q or None, sort=key, desc=sort.startswith("-"),
    )  # fmt: skip
    with ctx.pool.store() as st:
        rows = st.devices_page(f, limit=1000)
    filters = {"site": site, "tier": tier, "type": type, "online": online, "version": version,
               "label": label, "q": q}  # fmt: skip
    return _render(
        "devices.html", who, devices=[v.device_view(d, (g, t)) for d, g, t in rows],
        filters=filters, sort=sort, now_ns=time.time_ns(),
    )  # fmt: skip


@router.get("/devices/{device}")
def device(ctx: Ctx, request: Request, device: str) -> Response:
    who = _who(ctx, request)
    if who is None:
        return _to_signin(request)
    with ctx.pool.store() as st:
        d = st.device(device)
        if d is None:
            return _render("missing.html", who, what=f"device {device}")
        labels = st.labels().get(device, ("", "normal"))
        gaps = st.gaps(device)
        ota = st.ota_history(device, limit=20)
        signals = st.signals(device)
        decisions = st.decisions_page(device=device, limit=30)
    return _render(
        "device.html", who, d=v.device_view(d, labels), gaps=[v.gap_view(g) for g in gaps],
        ota=[v.ota_view(*o) for o in ota], signals=signals,
        decisions=[v.decision_view(*r) for r in decisions],
    )  # fmt: skip


@router.get("/rollouts")
def rollouts(ctx: Ctx, request: Request) -> Response:
    who = _who(ctx, request)
    if who is None:
        return _to_signin(request)
    with ctx.pool.store() as st:
        rows = [summary(load(doc)[0]) for _, _, doc in st.rollouts()]
    return _render("rollouts.html", who, rollouts=rows)


@router.get("/rollouts/{rollout_id}")
def rollout(ctx: Ctx, request: Request, rollout_id: str) -> Response:
    who = _who(ctx, request)
    if who is None:
        return _to_signin(request)
    with ctx.pool.store() as st:
        found = [load(doc)[0] for rid, _, doc in st.rollouts() if rid == rollout_id]
    if not found:
        return _render("missing.html", who, what=f"rollout {rollout_id}")
    return _render("rollout.html", who, r=summary(found[0]))


@router.get("/quarantine")
def quarantine(ctx: Ctx, request: Request) -> Response:
    who = _who(ctx, request)
    if who is None:
        return _to_signin(request)
    with ctx.pool.store() as st:
        rows = st.quarantine_page(limit=200)
    return _render("quarantine.html", who, items=[v.quarantine_view(i, q) for i, q in rows])


@router.get("/audit")
def audit(ctx: Ctx, request: Request) -> Response:
    who = _who(ctx, request)
    if who is None:
        return _to_signin(request)
    if not access.allows(who.role, "operator"):
        return _render("missing.html", who, what="the audit log (operators and admins)")
    with ctx.pool.store() as st:
        rows = st.audit_log(limit=200)
    return _render("audit.html", who, items=[v.audit_view(e) for e in rows])
