"""``fleet keys ...``: root keys, bundle-signing keys and the root.json devices trust.

``fleet.cli`` mounts ``keys_app`` as ``keys``. Exit codes (as ``fleet``): 0 done, 1 a file
or folder not found, 2 bad usage, 3 refused or failed (the message on stderr names the file
and why). A passphrase comes from ``--passphrase-file`` or the environment variable
``FLEET_KEY_PASSPHRASE``, never from a command-line value, where ``ps`` and shell history
would show it; it is never printed.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.table import Table

from edge_agent.console import make_console
from fleet import keys
from fleet.cli_common import EXIT_FAILURE, EXIT_NOT_FOUND, EXIT_USAGE, JsonOpt, fail
from fleet.errors import FleetKeyError

keys_app = typer.Typer(
    help="Signing keys and the trust root (root.json) devices trust.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DirOpt = Annotated[
    Path,
    typer.Option("--dir", envvar="FLEET_KEYS_DIR", file_okay=False, help="The keys folder."),
]
PassFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--passphrase-file",
        dir_okay=False,
        help=f"File holding the keys' passphrase (one line) \\[default: ${keys.ENV_PASSPHRASE}].",
    ),
]
ExpiresOpt = Annotated[
    int, typer.Option("--expires-days", min=1, help="The root's validity in days.")
]


_fail = fail


def _fail_key(exc: FleetKeyError) -> NoReturn:
    _fail(str(exc), EXIT_NOT_FOUND if exc.missing else EXIT_FAILURE)


def _passphrase(file: Path | None) -> bytes | None:
    try:
        return keys.read_passphrase(file, os.environ)
    except FleetKeyError as exc:
        _fail_key(exc)


def _now() -> datetime:
    return datetime.now(UTC)


@keys_app.command("init")
def init_cmd(
    keys_dir: DirOpt = Path("keys"),
    root_keys: Annotated[int, typer.Option("--root-keys", min=1, help="Root keys to make.")] = 1,
    root_threshold: Annotated[
        int, typer.Option("--root-threshold", min=1, help="Root signatures a new root needs.")
    ] = 1,
    bundle_keys: Annotated[
        int, typer.Option("--bundle-keys", min=1, help="Bundle-signing keys to make.")
    ] = 1,
    bundle_threshold: Annotated[
        int, typer.Option("--bundle-threshold", min=1, help="Signatures a bundle needs.")
    ] = 1,
    expires_days: ExpiresOpt = 365,
    passphrase_file: PassFileOpt = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Start a new key set over an existing one (the old files are moved to "
            "replaced-<time>/; devices trusting the old root will refuse the new keys).",
        ),
    ] = False,
) -> None:
    """Make root keys, bundle-signing keys and root.json version 1 in --dir."""
    for role, threshold, count in (
        ("root", root_threshold, root_keys),
        ("bundle", bundle_threshold, bundle_keys),
    ):
        if threshold > count:
            _fail(f"--{role}-threshold {threshold} exceeds --{role}-keys {count}", EXIT_USAGE)
    secret = _passphrase(passphrase_file)
    try:
        made = keys.init_keys(
            keys_dir,
            now=_now(),
            root_keys=root_keys,
            root_threshold=root_threshold,
            bundle_keys=bundle_keys,
            bundle_threshold=bundle_threshold,
            expires_days=expires_days,
            passphrase=secret,
            force=force,
        )
    except FleetKeyError as exc:
        _fail_key(exc)
    if made.replaced is not None:
        typer.echo(f"previous key set moved to {made.replaced}")
    for path in made.root_keys:
        typer.echo(f"root key   {path}")
    for path in made.bundle_keys:
        typer.echo(f"bundle key {path}")
    typer.echo(
        f"root.json  {made.root_json} (version 1, expires "
        f"{made.root.expires:%Y-%m-%dT%H:%M:%SZ}; give it to devices: fleet keys export-root)"
    )
    typer.echo(
        f"the root keys sign only new roots: move them offline now and bring "
        f"{made.root.roles['root'].threshold} back for each rotation"
        + ("" if secret else "; they are NOT passphrase-protected")
    )


@keys_app.command("rotate")
def rotate_cmd(
    keys_dir: DirOpt = Path("keys"),
    add_bundle_key: Annotated[
        bool, typer.Option("--add-bundle-key", help="Make a new bundle-signing key.")
    ] = False,
    revoke: Annotated[
        list[str] | None,
        typer.Option("--revoke", help="Drop this key id (or a unique prefix) (repeatable)."),
    ] = None,
    new_root_key: Annotated[
        bool, typer.Option("--new-root-key", help="Make a new root key (add it to the role).")
    ] = False,
    root_threshold: Annotated[
        int | None, typer.Option("--root-threshold", min=1, help="\\[default: unchanged]")
    ] = None,
    bundle_threshold: Annotated[
        int | None, typer.Option("--bundle-threshold", min=1, help="\\[default: unchanged]")
    ] = None,
    expires_days: ExpiresOpt = 365,
    passphrase_file: PassFileOpt = None,
) -> None:
    """Write root.json version N+1, signed by the old root keys and the new (TUF rule)."""
    secret = _passphrase(passphrase_file)
    try:
        rot = keys.rotate_keys(
            keys_dir,
            now=_now(),
            add_bundle_keys=int(add_bundle_key),
            new_root_keys=int(new_root_key),
            revoke=revoke or [],
            root_threshold=root_threshold,
            bundle_threshold=bundle_threshold,
            expires_days=expires_days,
            passphrase=secret,
        )
    except FleetKeyError as exc:
        _fail_key(exc)
    for path in rot.added:
        typer.echo(f"new key    {path}")
    for kid in rot.revoked:
        typer.echo(f"revoked    {kid}")
    for path in rot.moved:
        typer.echo(f"moved      {path}")
    typer.echo(f"kept       {rot.archived} (version {rot.old_version})")
    typer.echo(
        f"root.json  {keys_dir / keys.ROOT_JSON} (version {rot.new_version}, expires "
        f"{rot.root.expires:%Y-%m-%dT%H:%M:%SZ}); devices accept it from version "
        f"{rot.old_version}"
    )
    if any(p.name.startswith("root-") for p in rot.added):
        typer.echo("a new root key was made: move it offline with the others")


@keys_app.command("export-root")
def export_root_cmd(
    keys_dir: DirOpt = Path("keys"),
    out: Annotated[
        Path | None, typer.Option("--out", dir_okay=False, help="Write here \\[default: stdout].")
    ] = None,
) -> None:
    """Print (or write) the current root.json: the file devices trust."""
    try:
        data = keys.export_root(keys_dir, _now())
        if out is None:
            # The exact bytes (no newline added): ``> root.json`` must hash like the file.
            typer.echo(data.decode(), nl=False)
            return
        keys.write_file(out, data, mode=0o644, exclusive=False)
    except FleetKeyError as exc:
        _fail_key(exc)
    typer.echo(f"wrote {out}", err=True)


@keys_app.command("list")
def list_cmd(keys_dir: DirOpt = Path("keys"), as_json: JsonOpt = False) -> None:
    """The current root's keys: roles, expiry, and which private keys are here."""
    try:
        listing = keys.list_keys(keys_dir, _now())
    except FleetKeyError as exc:
        _fail_key(exc)
    if as_json:
        typer.echo(json.dumps(listing.to_json(), indent=2))
        return
    state = "EXPIRED" if listing.expired else "valid"
    typer.echo(
        f"root.json version {listing.version}, expires {listing.expires:%Y-%m-%dT%H:%M:%SZ} "
        f"({state}); thresholds: root {listing.thresholds['root']}, "
        f"bundles {listing.thresholds['bundles']}"
    )
    table = Table("key id", "roles", "expires (UTC)", "private key here")
    for k in listing.keys:
        where = "offline" if k.file is None else k.file.name
        if k.file is not None and k.encrypted:
            where += " (encrypted)"
        expires = f"{k.expires:%Y-%m-%d %H:%M}" if k.expires else "-"
        table.add_row(k.keyid[:16], ", ".join(k.roles), expires, where)
    make_console(highlight=False, soft_wrap=True).print(table)
    for path in listing.stray:
        typer.echo(f"note: {path.name} is not a key of the current root.json", err=True)
