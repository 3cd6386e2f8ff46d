"""Rollouts: list, status with waves and per-device states, create from an uploaded signed
bundle or one already published (with a dry run that previews the waves), pause, resume,
abort. Every change goes through :class:`fleet.changes.Changes`, as the CLI's do."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Request, UploadFile

from fleet.api.auth import Ctx, Operator, Viewer, remote
from fleet.api.problems import ApiProblem
from fleet.artifacts import bundle_path
from fleet.changes import Changes, RolloutSpec
from fleet.errors import PlanError
from fleet.rollout import machine as m
from fleet.rollout.orchestrator import load
from fleet.rollout.plan import parse_fraction, parse_selector, parse_waves
from fleet.rollout.report import summary

router = APIRouter()
_CHUNK = 1 << 20


@router.get("/rollouts", summary="Every rollout, newest first")
def rollouts(ctx: Ctx, _who: Viewer) -> list[dict[str, Any]]:
    with ctx.pool.store() as st:
        rows = [load(doc)[0] for _, _, doc in st.rollouts()]
    return [{k: val for k, val in summary(r).items() if k != "devices"} for r in rows]


@router.get("/rollouts/{rollout_id}", summary="One rollout: waves, devices, history")
def rollout(ctx: Ctx, _who: Viewer, rollout_id: str) -> dict[str, Any]:
    with ctx.pool.store() as st:
        for rid, _, doc in st.rollouts():
            if rid == rollout_id:
                r, transport = load(doc)
                return {**summary(r), "transport": transport, "params": r.to_json()["params"]}
    raise ApiProblem(404, f"no rollout {rollout_id!r}", "path.rollout_id")


def _params(  # noqa: PLR0917 - the form's fields, in its order
    waves: str, max_failure: str, min_devices: int, success_gate: str,
    device_timeout: float, max_attempts: int,
) -> m.Params:  # fmt: skip
    try:
        return m.Params(
            waves=parse_waves(waves),
            max_failure=parse_fraction(max_failure, what="max_failure"),
            min_devices=min_devices,
            success_gate=parse_fraction(success_gate, what="success_gate"),
            device_timeout_s=device_timeout,
            max_attempts=max_attempts,
        )
    except PlanError as exc:
        raise ApiProblem(400, str(exc), "body") from None


def _too_big(limit: int) -> ApiProblem:
    return ApiProblem(413, f"bundle larger than {limit} bytes", "body.bundle")


async def _spool(upload: UploadFile, directory: Path, limit: int) -> Path:
    """The upload in a file of its own under ``directory``, at most ``limit`` bytes (413)."""
    if upload.size is not None and upload.size > limit:
        raise _too_big(limit)
    fd, name = await asyncio.to_thread(_temp_in, directory)
    size = 0
    try:
        with os.fdopen(fd, "wb") as out:
            while chunk := await upload.read(_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise _too_big(limit)  # noqa: TRY301 - the cleanup below is for it too
                out.write(chunk)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        raise
    return Path(name)


def _temp_in(directory: Path) -> tuple[int, str]:
    directory.mkdir(parents=True, exist_ok=True)
    return tempfile.mkstemp(dir=directory, prefix=".upload-", suffix=".efb")


@router.post("/rollouts", summary="Create a rollout (or preview its waves with dry_run)")
async def create(  # noqa: PLR0917 - form fields
    ctx: Ctx,
    who: Operator,
    request: Request,
    bundle: Annotated[UploadFile | None, File(description="A signed .efb bundle.")] = None,
    artifact: Annotated[
        str | None, Form(description="Or the sha256 of a bundle already published.")
    ] = None,
    select: Annotated[str, Form(description="site=..,device_type=..,group=..,tier=..")] = "",
    waves: Annotated[str, Form()] = "1%,10%,50%,100%",
    max_failure: Annotated[str, Form()] = "5%",
    min_devices: Annotated[int, Form(ge=1)] = 5,
    success_gate: Annotated[str, Form()] = "95%",
    device_timeout: Annotated[float, Form(ge=1)] = 300.0,
    max_attempts: Annotated[int, Form(ge=1, le=10)] = 3,
    transport: Annotated[str, Form()] = "http",
    dry_run: Annotated[bool, Form()] = False,
) -> dict[str, Any]:
    """The bundle is checked (signatures against the fleet's root.json when configured),
    the waves planned; unless ``dry_run`` it is published and the rollout stored, and
    ``fleet serve`` starts it."""
    if (bundle is None) == (artifact is None):
        raise ApiProblem(400, "give either a bundle file or an artifact sha256", "body.bundle")
    params = _params(waves, max_failure, min_devices, success_gate, device_timeout, max_attempts)
    try:
        selector = parse_selector(select)
    except PlanError as exc:
        raise ApiProblem(400, str(exc), "body.select") from None
    artifacts = ctx.config.artifacts
    spooled: Path | None = None
    if bundle is not None:
        spooled = await _spool(bundle, artifacts / ".incoming", ctx.config.max_upload_bytes)
        path = spooled
    else:
        try:
            path = bundle_path(artifacts, artifact or "")
        except ValueError as exc:
            raise ApiProblem(400, str(exc), "body.artifact") from None
        if not path.is_file():
            raise ApiProblem(404, f"no published bundle {artifact}", "body.artifact")
    name = (bundle.filename or "upload") if bundle is not None else f"artifact {artifact}"
    spec = RolloutSpec(
        path, artifacts, selector, params, transport, ctx.config.root_json, name=name[:200]
    )

    def run() -> m.Rollout:  # hashing and copying a bundle: off the event loop
        with ctx.pool.store() as st:
            changes = Changes(st, who, remote=remote(request), clock=ctx.clock)
            return changes.create_rollout(spec, dry_run=dry_run)

    try:
        r = await asyncio.to_thread(run)
    finally:
        if spooled is not None:
            spooled.unlink(missing_ok=True)
    doc = summary(r)
    if dry_run:
        return {**doc, "state": "planned", "history": [], "dry_run": True,
                "plan": [list(w) for w in r.waves]}  # fmt: skip
    return doc


def _act(ctx: Ctx, who: Operator, request: Request, rollout_id: str, action: str) -> dict[str, str]:
    with ctx.pool.store() as st:
        Changes(st, who, remote=remote(request), clock=ctx.clock).rollout_request(
            rollout_id, action
        )
    return {"rollout": rollout_id, "requested": action}


@router.post("/rollouts/{rollout_id}/pause", summary="Hold new offers and retries")
def pause(ctx: Ctx, who: Operator, request: Request, rollout_id: str) -> dict[str, str]:
    return _act(ctx, who, request, rollout_id, "pause")


@router.post("/rollouts/{rollout_id}/resume", summary="Continue a paused rollout")
def resume(ctx: Ctx, who: Operator, request: Request, rollout_id: str) -> dict[str, str]:
    return _act(ctx, who, request, rollout_id, "resume")


@router.post("/rollouts/{rollout_id}/abort", summary="Stop it and roll back devices in flight")
def abort(ctx: Ctx, who: Operator, request: Request, rollout_id: str) -> dict[str, str]:
    return _act(ctx, who, request, rollout_id, "abort")
