"""``fleet``: the control-room CLI.

Every command reads the store named by ``--store`` or ``FLEET_STORE`` (default: the SQLite
file ``fleet.db`` here): ``sqlite:///abs/path.db``, ``postgresql://user@host:5432/db`` or a
bare path. Only ``fleet serve`` and ``rollout create`` make a SQLite file that does not
exist. Listings print a table, or with ``--json`` one JSON document (``telemetry tail
--follow --json``: one object per line). Diagnostics go to stderr. Exit codes: 0 ok,
1 not found / nothing to do, 2 bad usage, 3 store or broker failure.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from fleet import __version__
from fleet.access_cli import audit_app, tokens_app, users_app
from fleet.artifacts_cli import app as artifacts_app
from fleet.bundle_cli import bundle_app
from fleet.cli_common import (
    EXIT_FAILURE,
    EXIT_NOT_FOUND,
    JsonOpt,
    StoreOpt,
    fail,
    open_cli_store,
    out,
)
from fleet.errors import FleetError
from fleet.history_cli import history_app
from fleet.keys_cli import keys_app
from fleet.nodes_cli import nodes_app
from fleet.pki_cli import broker_config_cmd, pki_app
from fleet.rollout_cli import label as rollout_label
from fleet.rollout_cli import rollout_app
from fleet.serve_cli import serve
from fleet.sessions_cli import sessions_app
from fleet.store import DeviceInfo, Gap

app = typer.Typer(
    name="fleet",
    help="EdgeFleet control room: ingest, devices, keys, bundles and rollouts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
devices_app = typer.Typer(help="The device registry.", no_args_is_help=True)
telemetry_app = typer.Typer(help="Stored telemetry.", no_args_is_help=True)
decisions_app = typer.Typer(help="Stored decisions.", no_args_is_help=True)
quarantine_app = typer.Typer(help="Messages the ingest refused.", no_args_is_help=True)
app.add_typer(devices_app, name="devices")
app.add_typer(telemetry_app, name="telemetry")
app.add_typer(decisions_app, name="decisions")
app.add_typer(quarantine_app, name="quarantine")

_fail = fail
_open = open_cli_store
if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


_UNITS_NS = {"s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9, "d": 86400 * 10**9}
_AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def _in_range(text: str, t_ns: int) -> int:
    # Stored times are signed 64-bit ns since 1970: anything else matches nothing, and
    # SQLite cannot even bind it.
    if not 0 <= t_ns < 2**63:
        raise typer.BadParameter(f"{text!r}: before 1970 or after 2262")
    return t_ns


def parse_since(text: str, now_ns: int) -> int:
    """``10m`` / ``2h`` / ``1d`` / ``30s`` ago, an ISO 8601 time (naive = UTC) or UNIX ns."""
    text = text.strip()
    m = _AGO.match(text)
    if m:
        return _in_range(text, now_ns - int(float(m.group(1)) * _UNITS_NS[m.group(2)]))
    if text.isascii() and text.isdigit():
        return _in_range(text, int(text))
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(
            f"{text!r}: expected a duration ago (30s, 10m, 2h, 1d), an ISO 8601 time "
            "(2026-12-02T13:00:00Z) or UNIX nanoseconds"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return _in_range(text, int(when.timestamp()) * 10**9 + when.microsecond * 1000)


def _iso(t_ns: int | None) -> str:
    if t_ns is None:
        return "-"
    return datetime.fromtimestamp(t_ns / 1e9, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def _body(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


def _device_dict(d: DeviceInfo) -> dict[str, Any]:
    return {
        "device": d.device,
        "site": d.site,
        "device_type": d.device_type,
        "online": d.online,
        "last_seen_ns": d.last_seen_ns,
        "boot_id": d.boot_id,
        "agent_version": d.agent_version,
        "model_sha256": d.model_sha256,
        "first_seen_ns": d.first_seen_ns,
        "last_seq": d.last_seq,
        "latency_ms": d.latency_ms,
        "model_health": d.model_health,
    }


def model_health_text(health: dict[str, Any]) -> str:
    """The model column of ``fleet devices``: ``ok``, or what the device reports wrong."""
    parts = []
    if health.get("ood"):
        parts.append("out of distribution: " + ",".join(str(s) for s in health["ood"]))
    if health.get("alarm_storm"):
        parts.append("alarm storm")
    if health.get("acquisition_mismatch"):
        parts.append("acquisition mismatch accepted")
    return "; ".join(parts) or "ok"


def _print_json(value: Any) -> None:
    # print, not rich: a pipe must get the JSON verbatim (no wrapping, no markup).
    print(json.dumps(value, indent=None, separators=(",", ":")))


# --- devices -------------------------------------------------------------------------------


@devices_app.command("list")
def devices_list(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Every registered device with its online state and last contact."""
    st = _open(store)
    try:
        devs = st.devices()
    finally:
        st.close()
    if as_json:
        _print_json([_device_dict(d) for d in devs])
        return
    table = Table("device", "site", "type", "state", "last seen (UTC)", "boot", "last seq", "model")
    for d in devs:
        health = model_health_text(d.model_health) if d.online else "-"
        table.add_row(
            d.device,
            d.site,
            d.device_type,
            "[green]online[/]" if d.online else "[red]offline[/]",
            _iso(d.last_seen_ns),
            (d.boot_id or "-")[:8],
            "-" if d.last_seq is None else str(d.last_seq),
            health if health in ("ok", "-") else f"[yellow]{escape(health)}[/]",
        )
    out.print(table)


@devices_app.command("show")
def devices_show(device: str, store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """One device in detail: versions, boot, stage latencies, gaps."""
    st = _open(store)
    try:
        d = st.device(device)
        gaps = st.gaps(device) if d is not None else []
    finally:
        st.close()
    if d is None:
        _fail(f"no device {device!r} in the registry", EXIT_NOT_FOUND)
    info = _device_dict(d)
    info["gaps"] = [_gap_dict(g) for g in gaps]
    if as_json:
        _print_json(info)
        return
    table = Table(show_header=False)
    for key in ("device", "site", "device_type", "agent_version", "model_sha256", "boot_id"):
        table.add_row(key, str(info[key] or "-"))
    table.add_row("state", "online" if d.online else "offline")
    table.add_row("model health", model_health_text(d.model_health) if d.online else "-")
    table.add_row("first seen (UTC)", _iso(d.first_seen_ns))
    table.add_row("last seen (UTC)", _iso(d.last_seen_ns))
    table.add_row("last seq", "-" if d.last_seq is None else str(d.last_seq))
    for stage, ms in sorted(d.latency_ms.items()):
        table.add_row(f"latency {stage}", f"{ms:.2f} ms")
    table.add_row("gaps", ", ".join(f"{g.first_missing}..{g.last_missing}" for g in gaps) or "-")
    out.print(table)


# --- telemetry -----------------------------------------------------------------------------


def _telemetry_table(rows: list[tuple[int, int, str, bytes]]) -> Table:
    table = Table("t (UTC)", "seq", "boot", "signals (last)")
    for t_ns, seq, boot_id, body in rows:
        parsed = _body(body)
        signals = parsed.get("signals", {}) if isinstance(parsed, dict) else {}
        text = " ".join(
            f"{name}={stats[3]:g}"
            for name, stats in sorted(signals.items())
            if isinstance(stats, list) and len(stats) == 5
        )
        table.add_row(_iso(t_ns), str(seq), boot_id[:8], text)
    return table


@telemetry_app.command("tail")
def telemetry_tail(
    device: str,
    store: StoreOpt = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="Messages to show.")] = 20,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new ones.")] = (
        False
    ),
    interval: Annotated[
        float, typer.Option(min=0.05, max=3600, help="Poll interval with --follow (s).")
    ] = 1.0,
    follow_for: Annotated[
        float | None, typer.Option(help="Stop following after this many seconds.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """The newest telemetry of DEVICE, oldest first; --follow polls for more."""
    st = _open(store)
    try:
        if st.device(device) is None:
            _fail(f"no device {device!r} in the registry", EXIT_NOT_FOUND)
        rows = st.telemetry(device, limit=limit)
        if as_json and not follow:
            _print_json(
                [{"t_ns": t, "seq": s, "boot_id": b, "body": _body(body)} for t, s, b, body in rows]
            )
            return
        _emit_telemetry(rows, as_json)
        if not follow:
            return
        seen = {(b, s) for _, s, b, _ in rows}
        since = rows[-1][0] if rows else None
        deadline = None if follow_for is None else time.monotonic() + follow_for
        while deadline is None or time.monotonic() < deadline:
            time.sleep(interval)
            fresh = [
                r
                for r in st.telemetry(device, since_ns=since, limit=10_000)
                if (r[2], r[1]) not in seen
            ]
            if fresh:
                seen.update((b, s) for _, s, b, _ in fresh)
                since = max(since or 0, fresh[-1][0])
                _emit_telemetry(fresh, as_json)
    except KeyboardInterrupt:
        pass
    finally:
        st.close()


def _emit_telemetry(rows: list[tuple[int, int, str, bytes]], as_json: bool) -> None:
    if as_json:
        for t, s, b, body in rows:
            _print_json({"t_ns": t, "seq": s, "boot_id": b, "body": _body(body)})
    elif rows:
        out.print(_telemetry_table(rows))


# --- decisions -----------------------------------------------------------------------------


@decisions_app.command("list")
def decisions_list(
    store: StoreOpt = None,
    since: Annotated[
        str | None, typer.Option(help="10m, 2h, 1d ago; an ISO 8601 time; or UNIX ns.")
    ] = None,
    device: Annotated[str | None, typer.Option(help="Only this device.")] = None,
    label: Annotated[str | None, typer.Option(help="Only this label.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000)] = 100,
    as_json: JsonOpt = False,
) -> None:
    """Stored decisions, oldest first."""
    since_ns = parse_since(since, time.time_ns()) if since else None
    st = _open(store)
    try:
        rows = st.decisions(since_ns=since_ns, device=device, label=label, limit=limit)
    finally:
        st.close()
    if as_json:
        _print_json(
            [{"device": d, "t_ns": t, "seq": s, "body": _body(body)} for d, t, s, body in rows]
        )
        return
    table = Table("t (UTC)", "device", "seq", "label", "score", "alarms", "rules")
    for d, t, s, body in rows:
        b = _body(body)
        b = b if isinstance(b, dict) else {}
        score = b.get("score")
        table.add_row(
            _iso(t),
            d,
            str(s),
            str(b.get("label", "?")),
            "-" if score is None else f"{score:.3f}",
            ",".join(b.get("alarms", [])) or "-",
            ",".join(r.get("rule", "?") for r in b.get("rules_fired", [])) or "-",
        )
    out.print(table)


# --- gaps, quarantine ----------------------------------------------------------------------


def _gap_dict(g: Gap) -> dict[str, Any]:
    return {
        "device": g.device,
        "boot_id": g.boot_id,
        "first_missing": g.first_missing,
        "last_missing": g.last_missing,
        "missing": g.last_missing - g.first_missing + 1,
    }


@app.command()
def gaps(
    store: StoreOpt = None,
    device: Annotated[str | None, typer.Option(help="Only this device.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Seq ranges never stored, per device and boot."""
    st = _open(store)
    try:
        found = st.gaps(device)
    finally:
        st.close()
    if as_json:
        _print_json([_gap_dict(g) for g in found])
        return
    table = Table("device", "boot", "first missing", "last missing", "missing")
    for g in found:
        table.add_row(
            g.device,
            g.boot_id[:8],
            str(g.first_missing),
            str(g.last_missing),
            str(g.last_missing - g.first_missing + 1),
        )
    out.print(table)


@quarantine_app.command("list")
def quarantine_list(
    store: StoreOpt = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000)] = 100,
    as_json: JsonOpt = False,
) -> None:
    """The newest refused messages, newest first, with why and where."""
    st = _open(store)
    try:
        items = st.quarantined(limit=limit)
    finally:
        st.close()
    if as_json:
        _print_json(
            [
                {
                    "topic": q.topic,
                    "device": q.device,
                    "reason": q.reason,
                    "where": q.where,
                    "received_ns": q.received_ns,
                    "payload": q.payload.decode("utf-8", "backslashreplace"),
                    "payload_bytes": len(q.payload),
                }
                for q in items
            ]
        )
        return
    table = Table("received (UTC)", "topic", "reason", "where", "payload")
    for q in items:
        preview = q.payload[:60].decode("utf-8", "backslashreplace")
        table.add_row(_iso(q.received_ns), q.topic, q.reason, q.where, preview)
    out.print(table)


@app.command()
def version() -> None:
    """Print the fleet tools' version."""
    typer.echo(__version__)


@app.callback()
def _root() -> None:
    """EdgeFleet control room."""


# Certificates and the broker's TLS config (fleet/pki_cli.py).
app.add_typer(pki_app, name="pki")
app.add_typer(rollout_app, name="rollout")
app.add_typer(artifacts_app, name="artifacts")
app.add_typer(users_app, name="users")
app.add_typer(tokens_app, name="tokens")
app.add_typer(audit_app, name="audit")
devices_app.command("label")(rollout_label)
app.command("broker-config")(broker_config_cmd)
app.command()(serve)
app.add_typer(keys_app, name="keys")
app.add_typer(bundle_app, name="bundle")
app.add_typer(sessions_app, name="sessions")
app.add_typer(nodes_app, name="nodes")
app.add_typer(history_app, name="history")


def main() -> None:
    """Console-script entry point. A store that fails after it opened (a table gone, the
    server down mid-command) ends the command with its one-line message, never a trace."""
    try:
        app()
    except FleetError as exc:
        typer.echo(f"fleet: {exc}", err=True)
        sys.exit(EXIT_FAILURE)


if __name__ == "__main__":
    main()
