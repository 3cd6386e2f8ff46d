"""Reads of the fleet: devices, a device, its telemetry series, decisions, gaps, quarantine;
and the one device change, its labels."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel

from fleet.api import views as v
from fleet.api.auth import Ctx, Operator, Viewer, remote
from fleet.api.problems import ApiProblem
from fleet.changes import Changes
from fleet.rollout.orchestrator import load
from fleet.store import DeviceInfo
from fleet.store.console_sql import DeviceFilter, bucket_of

router = APIRouter()

#: The most points a series answer holds (buckets are widened to fit).
MAX_POINTS = 2000
_MAX_RANGE_NS = 366 * 86_400 * 1_000_000_000
_HOUR_NS = 3600 * 1_000_000_000

DeviceName = Annotated[str, Path(min_length=1, max_length=128)]
Limit = Annotated[int, Query(ge=1, le=1000)]
SortKey = Literal[
    "device", "site", "last_seen", "version", "-device", "-site", "-last_seen", "-version"
]


@router.get("/devices", response_model=v.DevicePage, summary="List devices")
def devices(  # noqa: PLR0917 - query parameters
    ctx: Ctx,
    _who: Viewer,
    site: str | None = None,
    tier: str | None = None,
    type: Annotated[str | None, Query(alias="type")] = None,
    online: bool | None = None,
    version: str | None = None,
    label: Annotated[str | None, Query(description="The rollout group.")] = None,
    q: Annotated[str | None, Query(max_length=128, description="Part of the device name.")] = None,
    sort: SortKey = "device",
    limit: Limit = 100,
    cursor: str | None = None,
) -> v.DevicePage:
    """Registered devices matching every filter given, sorted, a page at a time."""
    f = DeviceFilter(
        site=site, tier=tier, device_type=type, online=online, version=version, group=label,
        q=q, sort=sort.lstrip("-"), desc=sort.startswith("-"),
    )  # fmt: skip
    after = None
    if cursor is not None:
        value, name = v.decode_cursor(cursor, 2)
        if not isinstance(name, str):
            raise ApiProblem(400, "malformed cursor", "query.cursor")
        after = (value, name)
    with ctx.pool.store() as st:
        rows = st.devices_page(f, after=after, limit=limit + 1)
    page = rows[:limit]
    nxt = None
    if len(rows) > limit:
        last = page[-1][0]
        nxt = v.encode_cursor([_sort_value(last, f.sort), last.device])
    return v.DevicePage(items=[v.device_view(d, (g, t)) for d, g, t in page], next=nxt)


def _sort_value(d: DeviceInfo, key: str) -> Any:
    if key == "site":
        return d.site
    if key == "last_seen":
        return d.last_seen_ns or 0
    if key == "version":
        return d.agent_version
    return d.device


@router.get("/devices/{device}", response_model=v.DeviceDetail, summary="One device")
def device(ctx: Ctx, _who: Viewer, device: DeviceName) -> v.DeviceDetail:
    """A device with its labels, gaps, OTA history, signals and the rollouts it is in."""
    with ctx.pool.store() as st:
        d = st.device(device)
        if d is None:
            raise ApiProblem(404, f"no device {device!r} in the registry", "path.device")
        labels = st.labels().get(device, ("", "normal"))
        gaps = st.gaps(device)
        ota = st.ota_history(device, limit=50)
        signals = st.signals(device)
        rollouts = [rid for rid, _, doc in st.rollouts() if device in load(doc)[0].devices]
    base = v.device_view(d, labels)
    return v.DeviceDetail(
        **base.model_dump(),
        first_seen=v.iso(d.first_seen_ns),
        gaps=[v.gap_view(g) for g in gaps],
        ota_history=[v.ota_view(*o) for o in ota],
        signals=signals,
        rollouts=rollouts,
    )


class Labels(BaseModel):
    group: str | None = None
    tier: str | None = None


@router.put("/devices/{device}/labels", summary="Set a device's rollout group and tier")
def set_labels(
    ctx: Ctx, who: Operator, request: Request, device: DeviceName, body: Labels
) -> dict[str, Any]:
    with ctx.pool.store() as st:
        Changes(st, who, remote=remote(request), clock=ctx.clock).set_labels(
            device, group=body.group, tier=body.tier
        )
        group, tier = st.labels().get(device, ("", "normal"))
    return {"device": device, "group": group, "tier": tier}


def _range(since: datetime | None, until: datetime | None, now_ns: int) -> tuple[int, int]:
    end = int(until.timestamp() * 1e9) if until is not None else now_ns
    start = int(since.timestamp() * 1e9) if since is not None else end - _HOUR_NS
    if start >= end:
        raise ApiProblem(400, "since must be before until", "query.since")
    if end - start > _MAX_RANGE_NS:
        raise ApiProblem(400, "a range of at most 366 days", "query.since")
    return start, end


@router.get("/devices/{device}/telemetry", response_model=v.Series, summary="A signal's series")
def telemetry(  # noqa: PLR0917 - query parameters
    ctx: Ctx,
    _who: Viewer,
    device: DeviceName,
    signal: Annotated[str, Query(min_length=1, max_length=128)],
    since: datetime | None = None,
    until: datetime | None = None,
    points: Annotated[int, Query(ge=1, le=MAX_POINTS)] = 500,
) -> v.Series:
    """``signal`` of ``device`` over ``[since, until)`` (default: the last hour), cut into
    at most ``points`` buckets, each with min, max and mean (weighted by samples)."""
    start, end = _range(since, until, ctx.clock())
    bucket = bucket_of(max(1, -(-(end - start) // points)))
    with ctx.pool.store() as st:
        if st.device(device) is None:
            raise ApiProblem(404, f"no device {device!r} in the registry", "path.device")
        rows = st.series(device, signal, since_ns=start, until_ns=end, bucket_ns=bucket)
    return v.Series(
        device=device,
        signal=signal,
        since=v.iso(start),
        until=v.iso(end),
        bucket_ns=bucket,
        points=[v.series_point(b) for b in rows],
    )


@router.get("/decisions", response_model=v.DecisionPage, summary="Decisions, newest first")
def decisions(  # noqa: PLR0917 - query parameters
    ctx: Ctx,
    _who: Viewer,
    device: str | None = None,
    label: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: Limit = 100,
    cursor: str | None = None,
) -> v.DecisionPage:
    """Decisions with their explanation (label, score, top signals, model, rules)."""
    start = int(since.timestamp() * 1e9) if since is not None else 0
    end = int(until.timestamp() * 1e9) if until is not None else 2**63 - 1
    before = None
    if cursor is not None:
        t, d, s = v.decode_cursor(cursor, 3)
        if not (isinstance(t, int) and isinstance(d, str) and isinstance(s, int)):
            raise ApiProblem(400, "malformed cursor", "query.cursor")
        before = (t, d, s)
    with ctx.pool.store() as st:
        rows = st.decisions_page(
            device=device, label=label, since_ns=start, until_ns=end, before=before, limit=limit + 1
        )
    page = rows[:limit]
    nxt = v.encode_cursor([page[-1][1], page[-1][0], page[-1][2]]) if len(rows) > limit else None
    return v.DecisionPage(items=[v.decision_view(*r) for r in page], next=nxt)


@router.get("/gaps", response_model=list[v.GapView], summary="Seqs that never arrived")
def gaps(ctx: Ctx, _who: Viewer, device: str | None = None) -> list[v.GapView]:
    with ctx.pool.store() as st:
        return [v.gap_view(g) for g in st.gaps(device)]


@router.get("/quarantine", response_model=v.QuarantinePage, summary="Refused messages")
def quarantine(
    ctx: Ctx, _who: Viewer, limit: Limit = 100, cursor: str | None = None
) -> v.QuarantinePage:
    """Refused messages with the reason and where in the payload, newest first."""
    before = v.id_cursor(cursor)
    with ctx.pool.store() as st:
        rows = st.quarantine_page(before_id=before, limit=limit + 1)
    page = rows[:limit]
    nxt = v.encode_cursor([page[-1][0]]) if len(rows) > limit else None
    return v.QuarantinePage(items=[v.quarantine_view(i, q) for i, q in page], next=nxt)
