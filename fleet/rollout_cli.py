"""``fleet rollout`` and ``fleet devices label``: plan, start, steer and watch rollouts.

``create`` needs only the store and the artifact directory: ``fleet serve`` (its
orchestrator) sends the offers and follows the devices. ``pause``, ``resume`` and ``abort``
are requests the orchestrator takes at its next step (within a second). Exit codes as the
rest of ``fleet``: 0 ok, 1 not found, 2 bad usage, 3 store failure.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fleet.changes import Changes, RolloutSpec
from fleet.cli_common import JsonOpt, StoreOpt, cli_principal, fail, open_cli_store, out
from fleet.errors import FleetError, PlanError, RolloutError
from fleet.rollout import machine as m
from fleet.rollout.orchestrator import (
    load,
)
from fleet.rollout.plan import (
    parse_fraction,
    parse_selector,
    parse_waves,
)
from fleet.rollout.report import summary
from fleet.store import Store

rollout_app = typer.Typer(help="OTA rollouts in waves that halt themselves.", no_args_is_help=True)
ArtifactsOpt = Annotated[
    Path,
    typer.Option(
        "--artifacts", envvar="FLEET_ARTIFACTS", help="Artifact directory of fleet serve."
    ),
]


_fail = fail
_open = open_cli_store


def _iso(t_ns: int) -> str:
    return datetime.fromtimestamp(t_ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S")


@rollout_app.command("create")
def create(
    bundle: Annotated[Path, typer.Argument(help="The signed .efb bundle.")],
    select: Annotated[str, typer.Option(help="site=..,device_type=..,group=..,tier=..")] = "",
    waves: Annotated[str, typer.Option(help="Cumulative percentages.")] = "1%,10%,50%,100%",
    max_failure: Annotated[str, typer.Option(help="Halt past this failure rate.")] = "5%",
    min_devices: Annotated[
        int, typer.Option(min=1, help="Finished devices before it may halt.")
    ] = 5,
    success_gate: Annotated[str, typer.Option(help="Committed share to start a wave.")] = "95%",
    device_timeout: Annotated[
        float, typer.Option(min=1, help="Seconds before a device times out.")
    ] = 300.0,
    max_attempts: Annotated[
        int, typer.Option(min=1, max=10, help="Offers per device (transient).")
    ] = 3,
    transport: Annotated[str, typer.Option(help="http or coap.")] = "http",
    root: Annotated[
        Path | None, typer.Option(help="Check the signatures against this root.json.")
    ] = None,
    artifacts: ArtifactsOpt = Path("artifacts"),
    store: StoreOpt = None,
    as_json: JsonOpt = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Check and plan, print the waves; publish and store nothing."
        ),
    ] = False,
) -> None:
    """Plan the waves and start a rollout of BUNDLE (fleet serve sends the offers)."""
    try:
        params = m.Params(
            waves=parse_waves(waves),
            max_failure=parse_fraction(max_failure, what="--max-failure"),
            min_devices=min_devices,
            success_gate=parse_fraction(success_gate, what="--success-gate"),
            device_timeout_s=device_timeout,
            max_attempts=max_attempts,
        )
        selector = parse_selector(select)
    except PlanError as exc:
        _fail(str(exc), 2)
    st = _open(store, migrate=not dry_run, create=not dry_run)
    spec = RolloutSpec(bundle, artifacts, selector, params, transport, root)
    try:
        r = Changes(st, cli_principal()).create_rollout(spec, dry_run=dry_run)
    except (RolloutError, PlanError) as exc:
        _fail(str(exc), 2)
    except FleetError as exc:
        _fail(str(exc), 3)
    finally:
        st.close()
    if dry_run:
        _print_plan(r, as_json)
        return
    if as_json:
        print(json.dumps(summary(r)))
        return
    sizes = ", ".join(str(len(w)) for w in r.waves)
    out.print(f"rollout {r.id}: {r.bundle_id} {r.version} to {len(r.devices)} device(s) in "
              f"{len(r.waves)} wave(s) ({sizes}); fleet serve starts it")  # fmt: skip


def _print_plan(r: m.Rollout, as_json: bool) -> None:
    """A dry run's plan: every wave with its devices, in offer order."""
    if as_json:
        # Nothing was created: no state, no history; the id is the one the rollout gets if
        # no other create comes first.
        doc = {**summary(r), "state": "planned", "history": [], "dry_run": True}
        print(json.dumps({**doc, "plan": [list(w) for w in r.waves]}))
        return
    out.print(f"dry run: {r.bundle_id} {r.version} to {len(r.devices)} device(s) in "
              f"{len(r.waves)} wave(s); nothing published or stored")  # fmt: skip
    table = Table("wave", "devices", "names")
    for k, names in enumerate(r.waves):
        shown = ", ".join(names[:8]) + (f", ... (+{len(names) - 8})" if len(names) > 8 else "")
        table.add_row(str(k + 1), str(len(names)), shown)
    out.print(table)


def _get(st: Store, rollout_id: str) -> m.Rollout:
    for rid, _, doc in st.rollouts():
        if rid == rollout_id:
            return load(doc)[0]
    _fail(f"no rollout {rollout_id!r}", 1)


@rollout_app.command("status")
def status(
    rollout_id: Annotated[str, typer.Argument(help="The rollout id (r1, r2, ...).")],
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """One rollout: its state, each wave, each device, what happened."""
    st = _open(store)
    try:
        r = _get(st, rollout_id)
    finally:
        st.close()
    if as_json:
        print(json.dumps(summary(r)))
        return
    out.print(f"rollout {r.id}: [bold]{r.state}[/bold]  {r.bundle_id} {r.version} ({r.kind})")
    if r.reason:
        out.print(f"  reason: {r.reason}")
    table = Table("wave", "devices", "committed", "in flight", "failed", "timed out")
    for k, names in enumerate(r.waves):
        c = r.counts(k)
        marker = " <" if k == r.wave and r.state in ("running", "paused") else ""
        table.add_row(
            f"{k + 1}{marker}", str(len(names)), str(c.get("committed", 0)),
            str(c.get("offered", 0) + c.get("in_progress", 0)),
            str(c.get("failed", 0) + c.get("rolled_back", 0)), str(c.get("timed_out", 0)),
        )  # fmt: skip
    out.print(table)
    bad = [d for d in r.devices.values() if d.state in ("failed", "rolled_back", "timed_out")]
    for d in sorted(bad, key=lambda d: d.device)[:20]:
        out.print(f"  {d.device}: {d.state} {d.code} {d.reason}".rstrip(), markup=False)
    for t, event in r.history[-8:]:
        out.print(f"  {_iso(t)}  {event}", markup=False)


@rollout_app.command("list")
def list_(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Every rollout, newest first."""
    st = _open(store)
    try:
        rows = [load(doc)[0] for _, _, doc in st.rollouts()]
    finally:
        st.close()
    if as_json:
        print(json.dumps([{k: v for k, v in summary(r).items() if k not in ("devices", "history")}
                          for r in rows]))  # fmt: skip
        return
    table = Table("id", "state", "bundle", "version", "wave", "committed", "failed", "created")
    for r in rows:
        c = r.counts()
        table.add_row(
            r.id, r.state, r.bundle_id, r.version, f"{r.wave + 1}/{len(r.waves)}",
            f"{c.get('committed', 0)}/{len(r.devices)}",
            str(c.get("failed", 0) + c.get("rolled_back", 0)), _iso(r.created_ns),
        )  # fmt: skip
    out.print(table)


def _request(rollout_id: str, action: str, store: str | None) -> None:
    st = _open(store)
    try:
        Changes(st, cli_principal()).rollout_request(rollout_id, action)
    except RolloutError as exc:
        _fail(str(exc), 1 if "no rollout" in str(exc) else 2)
    finally:
        st.close()
    out.print(f"rollout {rollout_id}: {action} requested (fleet serve applies it)")


@rollout_app.command("pause")
def pause(rollout_id: str, store: StoreOpt = None) -> None:
    """Hold new offers and retries; devices in flight carry on."""
    _request(rollout_id, "pause", store)


@rollout_app.command("resume")
def resume(rollout_id: str, store: StoreOpt = None) -> None:
    """Continue a paused rollout."""
    _request(rollout_id, "resume", store)


@rollout_app.command("abort")
def abort(rollout_id: str, store: StoreOpt = None) -> None:
    """Stop the rollout and send rollback to every device still in flight."""
    _request(rollout_id, "abort", store)


def label(
    device: Annotated[str, typer.Argument(help="The device.")],
    group: Annotated[str | None, typer.Option(help="Rollout group (e.g. line-1).")] = None,
    tier: Annotated[str | None, typer.Option(help="canary, normal or critical.")] = None,
    store: StoreOpt = None,
) -> None:
    """Set a device's rollout group and tier (canary first, critical last)."""
    st = _open(store)
    try:
        Changes(st, cli_principal()).set_labels(device, group=group, tier=tier)
    except RolloutError as exc:
        text = str(exc)
        _fail(
            text if text.startswith("no device") else f"--{text}",
            1 if text.startswith("no device") else 2,
        )
    finally:
        st.close()
    out.print(f"{device}: group={group if group is not None else '(unchanged)'} "
              f"tier={tier if tier is not None else '(unchanged)'}")  # fmt: skip
