"""``fleet bundle ...``: build, sign and inspect ``.efb`` bundles.

``fleet.cli`` mounts ``bundle_app`` as ``bundle``. Exit codes (as ``fleet``): 0 done (for
``inspect --root``: the bundle verifies), 1 a file not found, 2 bad usage, 3 refused or
failed, and for ``inspect``: the bundle is damaged or, with ``--root``, a device would
refuse it (the report says why). Key passphrases come from ``--passphrase-file`` or
``FLEET_KEY_PASSPHRASE``, never from a command-line value.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from cryptography.hazmat.primitives.asymmetric import ec
from rich.table import Table

from edge_agent.console import make_console
from fleet import bundles, keys, target
from fleet.cli_common import EXIT_FAILURE, EXIT_NOT_FOUND, EXIT_USAGE, fail
from fleet.errors import BundleError, FleetError, FleetKeyError
from ota import trust as ota_trust
from ota.errors import TrustError
from ota.manifest import DEFAULT_PROBATION_S

bundle_app = typer.Typer(
    help="OTA bundles (.efb): build, sign, inspect.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class KindChoice(StrEnum):
    model = "model"
    config = "config"
    agent = "agent"


PassFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--passphrase-file",
        dir_okay=False,
        help=f"File holding the keys' passphrase (one line) \\[default: ${keys.ENV_PASSPHRASE}].",
    ),
]
RootOpt = Annotated[
    Path | None,
    typer.Option("--root", dir_okay=False, help="root.json to check keys or the bundle against."),
]


_fail = fail


def _fail_err(exc: FleetError) -> NoReturn:
    missing = isinstance(exc, BundleError | FleetKeyError) and exc.missing
    _fail(str(exc), EXIT_NOT_FOUND if missing else EXIT_FAILURE)


def _now() -> datetime:
    return datetime.now(UTC)


def _passphrase(file: Path | None) -> bytes | None:
    try:
        return keys.read_passphrase(file, os.environ)
    except FleetKeyError as exc:
        _fail_err(exc)


def _load_root(path: Path, now: datetime) -> ota_trust.TrustRoot:
    try:
        data = path.read_bytes()
    except OSError as exc:
        _fail(f"{path}: cannot read: {exc.strerror}", EXIT_NOT_FOUND)
    try:
        return ota_trust.load_root(data, now)
    except TrustError as exc:
        _fail(f"{path}: {exc}", EXIT_FAILURE)


def _signers(
    values: list[Path], passphrase: bytes | None, now: datetime
) -> tuple[list[ec.EllipticCurvePrivateKey], ota_trust.TrustRoot | None]:
    """Keys from key files and keys folders (a folder: its root's bundle keys present)."""
    found: list[ec.EllipticCurvePrivateKey] = []
    root = None
    try:
        for value in values:
            if value.is_dir():
                root, dir_keys = keys.bundle_signers(value, passphrase, now)
                found += dir_keys
            else:
                found.append(keys.load_key(value, passphrase))
    except FleetKeyError as exc:
        _fail_err(exc)
    return found, root


def _threshold_note(valid: int | None, threshold: int | None) -> None:
    if valid is None or threshold is None:
        return
    if valid < threshold:
        typer.echo(
            f"note: {valid} of the {threshold} bundle signature(s) devices need; "
            "sign again with more bundle keys (fleet bundle sign)",
            err=True,
        )


@bundle_app.command("build")
def build_cmd(
    kind: Annotated[KindChoice, typer.Option("--kind", help="What the bundle carries.")],
    version: Annotated[str, typer.Option("--version", help="Semantic version (1.2.0).")],
    counter: Annotated[
        int, typer.Option("--counter", min=0, help="Anti-rollback counter (per kind).")
    ],
    device_type: Annotated[
        list[str], typer.Option("--device-type", help="A device type it is for (repeatable).")
    ],
    out: Annotated[Path, typer.Option("--out", dir_okay=False, help="The .efb to write.")],
    model_dir: Annotated[
        Path | None, typer.Option("--model-dir", file_okay=False, help="--kind model: folder.")
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", dir_okay=False, help="--kind config: agent.toml.")
    ] = None,
    wheel: Annotated[
        Path | None, typer.Option("--wheel", dir_okay=False, help="--kind agent: the wheel.")
    ] = None,
    agent_range: Annotated[
        str, typer.Option("--agent-range", help="PEP 440 agent versions (>=0.1,<1).")
    ] = "",
    expires_days: Annotated[int, typer.Option("--expires-days", min=1)] = 30,
    probation_seconds: Annotated[
        int | None,
        typer.Option(
            "--probation-seconds",
            min=0,
            help=f"How long devices watch the new version \\[default: {DEFAULT_PROBATION_S}].",
        ),
    ] = None,
    probation_p99_us: Annotated[int | None, typer.Option("--probation-p99-us", min=0)] = None,
    target_config: Annotated[
        list[Path] | None,
        typer.Option(
            "--target-config",
            dir_okay=False,
            help="A target device's agent.toml: refuse a probation too short for its window "
            "rate (\\[perception] rate_hz / hop). Repeatable.",
        ),
    ] = None,
    window_rate: Annotated[
        list[float] | None,
        typer.Option(
            "--window-rate",
            help="Windows per second a target device scores, checked like --target-config. "
            "Repeatable.",
        ),
    ] = None,
    delta_from: Annotated[
        Path | None,
        typer.Option("--delta-from", dir_okay=False, help="Old bundle: payloads as patches."),
    ] = None,
    bundle_id: Annotated[
        str | None, typer.Option("--bundle-id", help="\\[default: KIND-VERSION]")
    ] = None,
    description: Annotated[str, typer.Option("--description")] = "",
    sign_with: Annotated[
        list[Path] | None,
        typer.Option("--sign-with", help="A keys folder or a bundle key file (repeatable)."),
    ] = None,
    passphrase_file: PassFileOpt = None,
) -> None:
    """Build a bundle from a model folder, a config file or an agent wheel.

    Its probation must be able to score its minimum of windows (10) on the devices it is
    for: with --target-config or --window-rate (and always for a config bundle, from the
    config it carries) a shorter one is refused here, as devices refuse it before staging.
    """
    sources = {"model": model_dir, "config": config, "agent": wheel}
    flags = {"model": "--model-dir", "config": "--config", "agent": "--wheel"}
    source = sources[kind.value]
    if source is None:
        _fail(f"--kind {kind.value} needs {flags[kind.value]}", EXIT_USAGE)
    others = [flags[k] for k, v in sources.items() if v is not None and k != kind.value]
    if others:
        _fail(f"--kind {kind.value} takes {flags[kind.value]}, not {others[0]}", EXIT_USAGE)
    try:
        targets = [target.from_config_file(p) for p in target_config or []]
        targets += [target.from_rate(r) for r in window_rate or []]
    except BundleError as exc:
        _fail_err(exc)
    now = _now()
    signers, root = _signers(sign_with or [], _passphrase(passphrase_file), now)
    spec = bundles.BuildSpec(
        kind=kind.value,
        version=version,
        counter=counter,
        device_types=tuple(device_type),
        agent_range=agent_range,
        expires_days=expires_days,
        probation_seconds=probation_seconds,
        probation_p99_us=probation_p99_us,
        bundle_id=bundle_id,
        description=description,
        targets=tuple(targets),
    )
    try:
        payloads = bundles.source_payloads(kind.value, source)
        built = bundles.build_bundle(out, spec, payloads, now, base=delta_from, signers=signers)
    except BundleError as exc:
        _fail_err(exc)
    for (name, member), entry in zip(built.members, built.signed["payloads"], strict=True):
        how = f"delta, {len(member)}-byte patch" if name in built.deltas else "whole"
        typer.echo(f"payload {name}: {entry['length']} bytes ({how})")
    state = f"signed by {len(signers)} key(s)" if signers else "unsigned (fleet bundle sign)"
    typer.echo(f"wrote {out} ({built.signed['bundle_id']} {version}, {state})")
    if built.probation_checked:
        typer.echo(built.probation_note)
    else:
        typer.echo(f"note: {built.probation_note}", err=True)
    if root is not None:
        _threshold_note(len(signers), root.roles["bundles"].threshold)


@bundle_app.command("sign")
def sign_cmd(
    bundle: Annotated[Path, typer.Argument(dir_okay=False, help="The .efb to sign in place.")],
    key: Annotated[
        list[Path], typer.Option("--key", dir_okay=False, help="A bundle key file (repeatable).")
    ],
    root_path: RootOpt = None,
    passphrase_file: PassFileOpt = None,
) -> None:
    """Add signatures to a bundle (rewritten durably); with --root, only its bundle keys."""
    now = _now()
    root = _load_root(root_path, now) if root_path is not None else None
    signers, _ = _signers(key, _passphrase(passphrase_file), now)
    try:
        res = bundles.sign_bundle(bundle, signers, now, root)
    except BundleError as exc:
        _fail_err(exc)
    for kid in res.added:
        typer.echo(f"signed by {kid[:16]}")
    if root is None:
        typer.echo("note: no --root given; the keys were not checked against one", err=True)
    _threshold_note(res.valid, res.threshold)


def _print_report(r: dict[str, Any]) -> None:
    # ``signed`` is shown even when it failed the schema: nothing in it is assumed.
    s = r["signed"]
    compat = s.get("compat") if isinstance(s.get("compat"), dict) else {}
    typer.echo(f"bundle   {r['file']} ({r['bytes']} bytes)")
    typer.echo(
        f"id       {s.get('bundle_id')}  kind {s.get('kind')}  version {s.get('version')}  "
        f"counter {s.get('counter')}"
    )
    typer.echo(
        f"for      device types {', '.join(map(str, compat.get('device_types') or []))}; "
        f"agent {compat.get('agent') or 'any'}; expires {s.get('expires')}"
    )
    perms = s.get("required_permissions")
    shown = ", ".join(map(str, perms)) if isinstance(perms, list) else ""
    typer.echo(f"needs    {shown or '-'}")
    typer.echo(f"probation {json.dumps(s.get('probation'), sort_keys=True)}")
    typer.echo(f"manifest sha256 {r['manifest_sha256']}")
    table = Table("payload", "bytes", "sha256", "carried as")
    payloads = s.get("payloads") if isinstance(s.get("payloads"), list) else []
    for p in payloads:
        if not isinstance(p, dict):
            continue
        patch = p.get("patch")
        how = (
            f"patch of {patch.get('length')} B from {str(p.get('delta_from'))[:12]}"
            if isinstance(patch, dict)
            else "whole"
        )
        table.add_row(str(p.get("name")), str(p.get("length")), str(p.get("sha256"))[:16], how)
    make_console(highlight=False, soft_wrap=True).print(table)
    if not r["signatures"]:
        typer.echo("signatures: none (unsigned)")
    for sig in r["signatures"]:
        state = {True: "counts", False: "does not count", None: "not checked (no --root)"}
        why = f": {sig['reason']}" if sig["reason"] else ""
        typer.echo(f"signature {str(sig['keyid'])[:16]}: {state[sig['counts']]}{why}")
    if r["schema_error"]:
        typer.echo(f"schema: {r['schema_error']}")
    for problem in r["problems"]:
        typer.echo(f"damaged: {problem}")
    v = r["verification"]
    if v is None:
        return
    as_ = v["checked_as"]
    if v["ok"]:
        typer.echo(
            f"verifies against root.json version {v['root_version']} "
            f"({v['valid_signatures']} of {v['threshold']} signature(s); as a "
            f"{as_['device_type']} device, agent {as_['agent_version']})"
        )
    else:
        typer.echo(f"REFUSED ({v['code']}): {v['reason']}")


@bundle_app.command("inspect")
def inspect_cmd(
    bundle: Annotated[Path, typer.Argument(dir_okay=False, help="The .efb to inspect.")],
    root_path: RootOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    device_type: Annotated[
        str | None,
        typer.Option("--device-type", help="Check as this device type \\[default: its first]."),
    ] = None,
    agent_version: Annotated[
        str | None,
        typer.Option("--agent-version", help="Check as this agent \\[default: this release]."),
    ] = None,
    base: Annotated[
        list[Path] | None,
        typer.Option("--base", dir_okay=False, help="A delta's base bundle (repeatable)."),
    ] = None,
) -> None:
    """Show a bundle's manifest, payloads and signatures; with --root, whether it verifies."""
    now = _now()
    root = _load_root(root_path, now) if root_path is not None else None
    try:
        report = bundles.inspect_bundle(
            bundle,
            now,
            root=root,
            device_type=device_type,
            agent_version=agent_version,
            bases=base or [],
        )
    except BundleError as exc:
        _fail_err(exc)
    if as_json:
        typer.echo(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print_report(report)
    v = report["verification"]
    if report["problems"] or report["schema_error"] or (v is not None and not v["ok"]):
        raise typer.Exit(EXIT_FAILURE)
