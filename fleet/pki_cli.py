"""``fleet pki ...`` and ``fleet broker-config``: the CA, certificates and the broker's config.

``fleet.cli`` mounts ``pki_app`` as ``pki`` and ``broker_config_cmd`` as ``broker-config``.
Exit codes: 0 done, 1 refused or failed (the message on stderr names the file and why),
2 bad usage (typer). Passphrases are read from files, never from the command line, where
``ps`` and shell history would show them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from datetime import UTC
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from edge_agent.console import make_console
from fleet import pki
from fleet.broker_config import (
    DEFAULT_SERVER_NAME,
    Access,
    fleet_identity_of,
    refresh_access,
    write_broker_config,
)
from fleet.broker_reload import Reload, prepare_reload, reload_broker
from fleet.broker_sizing import DEFAULT_MSG_BYTES, Sizing, default_agent_msgs_per_min
from fleet.cli_common import ENV_STORE, EXIT_FAILURE, fail, open_cli_store
from fleet.errors import FleetStoreError, PkiError
from fleet.registry_sync import sync_registry

pki_app = typer.Typer(
    help="The fleet's private CA: device, service and broker certificates.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_ENV_DIR = "EDGEFLEET_PKI_DIR"
DirOpt = Annotated[
    Path, typer.Option("--dir", envvar=_ENV_DIR, help="The CA folder.", file_okay=False)
]
PassFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--passphrase-file",
        help="File holding the CA key's passphrase (one line).",
        dir_okay=False,
    ),
]


BrokerDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--broker-dir",
        file_okay=False,
        help="A folder `fleet broker-config` wrote: rewrite its ACL and revocation list now.",
    ),
]
ReloadOpt = Annotated[
    str | None,
    typer.Option(
        "--reload",
        help="Then reload the broker: pid:PID, pidfile:PATH or systemd:UNIT (needs --broker-dir).",
    ),
]


class KindChoice(StrEnum):
    device = "device"
    service = "service"
    server = "server"


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(1)


def _passphrase(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        # One trailing newline is the editor's, not the passphrase's.
        secret = path.read_bytes().removesuffix(b"\n").removesuffix(b"\r")
    except OSError as exc:
        raise PkiError(f"{path}: cannot read passphrase file: {exc.strerror}") from exc
    if not secret:
        raise PkiError(f"{path}: the passphrase file is empty")
    return secret


@pki_app.command("init")
def init_cmd(
    ca_dir: DirOpt = Path("pki"),
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing CA (orphans its certificates).")
    ] = False,
    passphrase_file: PassFileOpt = None,
    name: Annotated[str, typer.Option("--name", help="The CA's Common Name.")] = "EdgeFleet CA",
    days: Annotated[int, typer.Option("--days", min=1, help="CA validity in days.")] = 3650,
) -> None:
    """Create the CA (EC P-256 key, self-signed certificate) in --dir."""
    try:
        paths = pki.init_ca(
            ca_dir, name=name, days=days, passphrase=_passphrase(passphrase_file), force=force
        )
    except PkiError as exc:
        raise _fail(exc) from None
    typer.echo(f"CA certificate {paths.cert}")
    typer.echo(f"CA key         {paths.key} (keep it offline; fingerprint below)")
    typer.echo(pki.fingerprint(paths.cert))


@pki_app.command("issue")
def issue_cmd(
    name: Annotated[str, typer.Argument(help="Device or service name: the certificate CN.")],
    ca_dir: DirOpt = Path("pki"),
    out: Annotated[
        Path | None,
        typer.Option("--out", file_okay=False, help="Output folder \\[default: DIR/issued/NAME]."),
    ] = None,
    kind: Annotated[KindChoice, typer.Option("--kind")] = KindChoice.device,
    host: Annotated[
        list[str] | None,
        typer.Option("--host", help="Server certificates: a DNS name or IP (repeatable)."),
    ] = None,
    site: Annotated[
        str | None,
        typer.Option(
            "--site", help="Devices: the site it publishes under (fixed in the certificate)."
        ),
    ] = None,
    days: Annotated[int, typer.Option("--days", min=1)] = 825,
    passphrase_file: PassFileOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Re-issue an existing name.")] = False,
    broker_dir: BrokerDirOpt = None,
    reload: ReloadOpt = None,
) -> None:
    """Issue a certificate and key for NAME into --out, with the CA certificate beside them.

    A device may publish only once the broker's ACL names it: pass --broker-dir (and
    --reload), or run `fleet broker-config` again and reload the broker.
    """
    try:
        target = _reload_target(broker_dir, reload)
        passphrase = _passphrase(passphrase_file)
        paths = pki.issue(
            ca_dir,
            name,
            out if out is not None else ca_dir / "issued" / name,
            kind=kind.value,
            days=days,
            hosts=host or [],
            site=site,
            passphrase=passphrase,
            force=force,
        )
    except PkiError as exc:
        raise _fail(exc) from None
    typer.echo(f"{paths.kind} certificate {paths.cert}")
    typer.echo(f"key                {paths.key}")
    typer.echo(f"CA certificate     {paths.ca_cert}")
    if site is not None:
        typer.echo(f"site               {site} (edgefleet/v1/{site}/{name}/...)")
    if paths.kind != "device":
        if broker_dir is not None:
            typer.echo(f"broker  nothing to change for a {paths.kind} certificate")
        return
    if broker_dir is None:
        typer.echo(
            f"next: the broker grants {name} nothing until its ACL names it: "
            "`fleet broker-config` again (or --broker-dir), then reload the broker"
        )
        return
    _apply(ca_dir, broker_dir, target, passphrase, lambda _: f"{name} may publish under {site}")


def _reload_target(broker_dir: Path | None, reload: str | None) -> Reload | None:
    """The broker folder and the broker to reload, checked before anything is changed."""
    if reload is not None and broker_dir is None:
        raise PkiError("--reload needs --broker-dir (the folder whose ACL the broker reads)")
    if broker_dir is not None:
        fleet_identity_of(broker_dir)
    return prepare_reload(reload) if reload is not None else None


def _granted(n: int) -> str:
    return f"{n} device{'' if n == 1 else 's'} granted their topics"


def _apply(
    ca_dir: Path,
    broker_dir: Path,
    reload: Reload | None,
    passphrase: bytes | None,
    effect: Callable[[Access], str],
) -> Access:
    """Rewrite the broker's ACL and list in ``broker_dir``, reload it if asked, and say so
    (``effect``: what the reload did, given what the ACL grants now)."""
    try:
        access = refresh_access(ca_dir, broker_dir, passphrase=passphrase)
    except PkiError as exc:
        raise _fail(exc) from None
    typer.echo(
        f"broker  {access.acl}: {_granted(len(access.devices))}; "
        f"{access.crl}: {access.revoked} revoked"
    )
    for name in access.siteless:
        typer.echo(
            f"warning: {name}: its certificate names no site; it may publish nothing", err=True
        )
    if reload is None:
        typer.echo(
            "next: reload the broker (SIGHUP, e.g. `systemctl reload mosquitto`); "
            "until then the old ACL holds"
        )
        return access
    try:
        done = reload_broker(reload)
    except PkiError as exc:
        raise _fail(exc) from None
    typer.echo(f"reload  {done}")
    typer.echo(f"effect  {effect(access)}")
    return access


def _revoke_effect(name: str, access: Access) -> str:
    if name == access.fleet_identity:
        return (
            f"{name} is the fleet identity: the ACL keeps its rights for the certificate that "
            "replaces it, so its open connections keep working; each is refused at its next "
            "TLS handshake"
        )
    return (
        f"{name}'s open connection gets PUBACK 135 (not authorized) for every publish and "
        "reads nothing; its next TLS handshake is refused; other devices are not disturbed"
    )


@pki_app.command("list")
def list_cmd(
    ca_dir: DirOpt = Path("pki"),
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array on stdout.")] = False,
) -> None:
    """Certificates this CA issued: name, kind, fingerprint and expiry."""
    try:
        issued = pki.list_issued(ca_dir)
    except PkiError as exc:
        raise _fail(exc) from None
    if as_json:
        typer.echo(
            json.dumps(
                [
                    {
                        "name": c.name,
                        "kind": c.kind,
                        "fingerprint": c.fingerprint,
                        "serial": f"{c.serial:x}",
                        "not_after": c.not_after.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                        "revoked": c.revoked,
                        "site": c.site,
                    }
                    for c in issued
                ],
                indent=2,
            )
        )
        return
    table = Table("name", "kind", "site", "expires (UTC)", "status", "SHA-256 fingerprint")
    for c in issued:
        status = "[red]revoked[/red]" if c.revoked else "valid"
        site = c.site or ("[red]none[/red]" if c.kind == "device" else "")
        table.add_row(c.name, c.kind, site, f"{c.not_after:%Y-%m-%d %H:%M}", status, c.fingerprint)
    make_console().print(table)


@pki_app.command("revoke")
def revoke_cmd(
    name: Annotated[str, typer.Argument(help="The device or service whose certificates go.")],
    ca_dir: DirOpt = Path("pki"),
    passphrase_file: PassFileOpt = None,
    broker_dir: BrokerDirOpt = None,
    reload: ReloadOpt = None,
) -> None:
    """Put every certificate issued for NAME on the CA's revocation list (crl.pem).

    With --broker-dir and --reload it takes effect at once: the broker's ACL no longer
    names NAME and the broker reloads it (SIGHUP), so a connection NAME has open gets
    PUBACK 135 (not authorized) for every publish from then on, its next TLS handshake is
    refused, and no other device is disturbed. Without them: run `fleet broker-config`
    again (or this with --broker-dir), then reload Mosquitto (`systemctl reload mosquitto`).
    The broker checks the list for client certificates only; a revoked broker certificate
    is replaced by the next `fleet broker-config`.
    """
    try:
        target = _reload_target(broker_dir, reload)
        passphrase = _passphrase(passphrase_file)
        done = pki.revoke(ca_dir, name, passphrase=passphrase)
    except PkiError as exc:
        raise _fail(exc) from None
    serials = ", ".join(f"{s:x}" for s in done.serials)
    typer.echo(f"revoked {done.name} (serial {serials})")
    typer.echo(f"crl     {done.crl} ({done.entries} revoked in all)")
    if broker_dir is None:
        typer.echo(
            f"next: the broker still admits {name}, and a connection it has open keeps "
            "publishing: `fleet broker-config` again (or --broker-dir), then reload the broker"
        )
        return
    _apply(ca_dir, broker_dir, target, passphrase, lambda a: _revoke_effect(name, a))


@pki_app.command("sync-registry")
def sync_registry_cmd(
    store: Annotated[
        str,
        typer.Option(
            "--store",
            envvar=ENV_STORE,
            help="The fleet store (sqlite:///abs/path.db, postgresql://...) to write.",
        ),
    ],
    ca_dir: DirOpt = Path("pki"),
) -> None:
    """Register every valid device certificate in the fleet store at the site it names, and
    move a registered device whose site differs: the certificate decides. Needed with
    `fleet serve --no-auto-register`, and to correct rows an older fleet let a message move."""
    try:
        issued = pki.list_issued(ca_dir)  # a CA problem is found before the store is opened
    except PkiError as exc:
        raise _fail(exc) from None
    st = open_cli_store(store)
    try:
        changes, unchanged = sync_registry(ca_dir, st)
    except (PkiError, FleetStoreError) as exc:
        fail(str(exc), EXIT_FAILURE)
    finally:
        st.close()
    for ch in changes:
        what = "registered" if ch.before is None else f"moved from {ch.before}"
        typer.echo(f"{ch.device:<20} {ch.site:<20} {what}")
    skipped = sum(1 for c in issued if c.kind == "device" and (c.revoked or c.site is None))
    typer.echo(
        f"{len(changes)} changed, {unchanged} already at their certificate's site, "
        f"{skipped} revoked or without a site left alone"
    )


def broker_config_cmd(
    pki_dir: Annotated[
        Path, typer.Option("--pki-dir", envvar=_ENV_DIR, file_okay=False, help="The CA folder.")
    ] = Path("pki"),
    out_dir: Annotated[
        Path, typer.Option("--out-dir", file_okay=False, help="Where the broker's files go.")
    ] = Path("broker"),
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 8883,
    fleet_identity: Annotated[
        str, typer.Option("--fleet-identity", help="CN of the fleet service certificate.")
    ] = "fleet",
    host: Annotated[
        list[str] | None,
        typer.Option(
            "--host",
            help="Broker DNS name or IP for its certificate (repeatable) "
            "\\[default: localhost, 127.0.0.1, ::1].",
        ),
    ] = None,
    bind: Annotated[str, typer.Option("--bind", help="Address the TLS listener binds.")] = (
        "0.0.0.0"  # noqa: S104 - gateways connect over the site network
    ),
    plain_port: Annotated[
        int | None,
        typer.Option("--plain-port", help="Also a loopback-only, $SYS-only plain listener."),
    ] = None,
    persistence_dir: Annotated[
        Path | None,
        typer.Option(
            "--persistence-dir",
            file_okay=False,
            help="Where Mosquitto keeps queued messages \\[default: OUT_DIR/data].",
        ),
    ] = None,
    log_file: Annotated[
        Path | None, typer.Option("--log-file", dir_okay=False, help="\\[default: stderr]")
    ] = None,
    run_as: Annotated[
        str | None, typer.Option("--run-as", help="User Mosquitto switches to when root.")
    ] = None,
    server_name: Annotated[
        str, typer.Option("--server-name", help="CN of the broker's certificate.")
    ] = DEFAULT_SERVER_NAME,
    devices: Annotated[
        int, typer.Option("--devices", min=1, help="Devices the queues are sized for.")
    ] = 1000,
    msgs_per_min: Annotated[
        float | None,
        typer.Option(
            "--msgs-per-min",
            help="Uplink messages per device and minute \\[default: an agent on its defaults, "
            "154: 1 s telemetry, a decision per 64-point window at 100 Hz].",
        ),
    ] = None,
    outage_min: Annotated[
        float,
        typer.Option("--outage-min", help="Minutes without `fleet serve` the queues must hold."),
    ] = 30.0,
    msg_bytes: Annotated[
        int, typer.Option("--msg-bytes", min=1, help="Average payload bytes per message.")
    ] = DEFAULT_MSG_BYTES,
    autosave_s: Annotated[
        int,
        typer.Option(
            "--autosave-s", min=1, help="Seconds between saves of the broker's persistence file."
        ),
    ] = 60,
    passphrase_file: PassFileOpt = None,
) -> None:
    """Write mosquitto.conf and its ACL (mutual TLS, certificate CN as username, each device
    confined to its own topics under its certificate's site), with queues and persistence
    sized to hold --outage-min of the fleet's uplink while `fleet serve` is down, issuing
    the broker's certificate if it has none."""
    try:
        rate = msgs_per_min if msgs_per_min is not None else math.ceil(default_agent_msgs_per_min())
        sizing = Sizing(
            devices=devices,
            msgs_per_min=rate,
            outage_min=outage_min,
            msg_bytes=msg_bytes,
            autosave_s=autosave_s,
        )
        files = write_broker_config(
            pki_dir,
            out_dir,
            port=port,
            fleet_identity=fleet_identity,
            server_name=server_name,
            hosts=host or None,
            bind=bind,
            persistence_dir=persistence_dir,
            sizing=sizing,
            plain_port=plain_port,
            log_file=log_file,
            run_as=run_as,
            passphrase=_passphrase(passphrase_file),
        )
    except PkiError as exc:
        raise _fail(exc) from None
    access = files.access
    typer.echo(f"config  {files.conf}")
    typer.echo(f"acl     {files.acl} ({_granted(len(access.devices))})")
    typer.echo(f"crl     {files.crl} ({access.revoked} revoked)")
    verb = "issued" if files.issued_server_cert else "kept"
    typer.echo(f"server  {files.server_cert} ({verb})")
    owner = f", handed to {files.data_owner}" if files.data_owner else ""
    typer.echo(f"data    {files.persistence_dir} (persistence{owner})")
    first, cost = sizing.summary()
    typer.echo(f"sized   {first}")
    typer.echo(f"memory  {cost}")
    for name in access.siteless:
        typer.echo(
            f"warning: {name}: its certificate names no site, so it may publish nothing; "
            f"re-issue it: fleet pki issue {name} --site SITE --force",
            err=True,
        )
    typer.echo(f"run: mosquitto -c {files.conf}")
    user = run_as or "mosquitto"
    if os.geteuid() == 0 and user != "root":
        # Mosquitto started as root switches user before it reads the key; 0600 root-owned
        # would stop it at start with only "Unable to load server key file".
        typer.echo(
            f"note: mosquitto switches to user {user!r} before reading {files.server_key}; "
            f"make it that user's (chown {user} {files.server_key}), keeping mode 0600",
            err=True,
        )
