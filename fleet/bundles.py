"""Building, signing and inspecting ``.efb`` bundles (DESIGN.md section 5) on the fleet side.

The formats and the checks are ``ota``'s: manifest entries and bsdiff4 deltas come from
:mod:`ota.build`, the tar from :func:`ota.efb.write_bundle`, the schema from
:func:`ota.manifest.parse_signed` (run at build time, so a field a device would refuse is
refused here first), and ``inspect --root`` runs the device's gatekeeper,
:func:`ota.verify.verify_bundle`, into a throw-away content store.

A bundle is read whole into memory (:func:`read_bundle`): bundles are models, configs and
wheels of a few MB, and the device caps a bundle at :data:`ota.verify.MAX_BUNDLE_BYTES`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import tempfile
import tomllib
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

import fleet
from fleet import target as _target
from fleet.errors import BundleError
from ota import build as ota_build
from ota import keys as ota_keys
from ota import trust as ota_trust
from ota.canonical import canonical, loads_strict
from ota.efb import NOT_A_BUNDLE, BundleReader, write_bundle
from ota.errors import MalformedBundle, OtaError
from ota.fsutil import fsync_dir
from ota.manifest import DEFAULT_PROBATION_S, KINDS, Signed, parse_signed
from ota.probation import unreachable
from ota.store import ContentStore
from ota.verify import MAX_BUNDLE_BYTES, MAX_MANIFEST_BYTES, Policy, verify_bundle

CONFIG_PAYLOAD = "agent.toml"


# --- sources -----------------------------------------------------------------------------


def source_payloads(kind: str, source: Path) -> list[tuple[str, bytes]]:
    """The payloads of a ``kind`` bundle from its source: a model folder (``model.tflite``
    and ``model.json``), a config file (``agent.toml``, TOML-checked) or an agent wheel.
    Raises ``BundleError``."""
    if kind not in KINDS:
        raise BundleError(f"kind {kind!r}: expected one of {', '.join(KINDS)}")
    if not source.exists():
        raise BundleError(f"{source}: no such file or folder", missing=True)
    try:
        if kind == "model":
            return _model_payloads(source)
        data = source.read_bytes()
    except OSError as exc:
        raise BundleError(f"{source}: cannot read: {exc.strerror}") from None
    if kind == "config":
        try:
            tomllib.loads(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise BundleError(f"{source}: not UTF-8 (byte {exc.start})") from None
        except tomllib.TOMLDecodeError as exc:
            raise BundleError(f"{source}: not valid TOML: {exc}") from None
        return [(CONFIG_PAYLOAD, data)]
    if not zipfile.is_zipfile(source):
        raise BundleError(f"{source}: not a wheel (not a zip archive)")
    return [(source.name, data)]


def _model_payloads(model_dir: Path) -> list[tuple[str, bytes]]:
    if not (model_dir / "manifest.json").is_file():
        raise BundleError(f"{model_dir}: not a model folder (no manifest.json)", missing=True)
    try:
        payloads = ota_build.model_bundle_payloads(model_dir)
        card = json.loads(payloads[1][1])
    except ValueError as exc:
        raise BundleError(f"{model_dir}/manifest.json: not valid JSON: {exc}") from None
    # The device checks the model against its card when it loads it; a folder whose card
    # names other bytes would pass every signature check and then fail to activate.
    want = card.get("sha256") if isinstance(card, dict) else None
    got = hashlib.sha256(payloads[0][1]).hexdigest()
    if isinstance(want, str) and want != got:
        raise BundleError(
            f"{model_dir}: manifest.json says sha256 {want[:12]}; the model file is {got[:12]}"
        )
    if isinstance(card, dict) and "known_answers" not in card:
        payloads[1] = ("model.json", _with_known_answers(card, payloads[0][1]))
    return payloads


def _with_known_answers(card: dict[str, Any], tflite: bytes) -> bytes:
    """A card for a model trained elsewhere, without ``known_answers``: its golden windows
    run here, on this build machine's LiteRT (both kernel sets), and recorded, so that the
    device's self-test (models.selftest) has something to compare with."""
    # The model runtime (numpy, LiteRT) only for this: the fleet's other commands start fast.
    from models import known_answers, selftest  # noqa: PLC0415
    from models.errors import ModelError  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="efb-model-") as tmp:
        d = Path(tmp)
        name = Path(str(card.get("file", "model.tflite"))).name
        (d / name).write_bytes(tflite)
        (d / "manifest.json").write_text(json.dumps(card), encoding="utf-8")
        try:
            answers = selftest.record(d)
        except ModelError as exc:
            raise BundleError(f"cannot record the model's known answers here: {exc}") from None
    card = {**card, known_answers.KEY: answers.describe()}
    return (json.dumps(card, indent=2, allow_nan=False) + "\n").encode("utf-8")


# --- reading a bundle --------------------------------------------------------------------


@dataclass(frozen=True)
class BundleFile:
    """A bundle as found on disk, before (or without) any signature check."""

    path: Path
    size: int
    signed: dict[str, Any]
    signatures: list[dict[str, Any]]
    #: The typed manifest, or None when the schema check failed (``schema_error`` says why).
    manifest: Signed | None
    schema_error: str | None
    #: The members after manifest.json, in tar order.
    members: list[tuple[str, bytes]]
    #: Where the members differ from what the manifest lists (empty: consistent).
    problems: list[str] = field(default_factory=list)

    @property
    def manifest_sha256(self) -> str:
        """The bundle's identity on a device: sha256 of the canonical ``signed`` bytes."""
        return hashlib.sha256(canonical(self.signed)).hexdigest()

    def full_payloads(self) -> dict[str, bytes]:
        """Payload name -> bytes, for the payloads carried whole and intact (a delta's
        member is a patch, not the payload, so it cannot be a base)."""
        if self.manifest is None:
            return {}
        members = dict(self.members)
        out: dict[str, bytes] = {}
        for p in self.manifest.payloads:
            data = members.get(p.name)
            intact = data is not None and hashlib.sha256(data).hexdigest() == p.sha256
            if p.delta_from is None and data is not None and intact:
                out[p.name] = data
        return out


def read_bundle(path: Path) -> BundleFile:
    """Read ``path``: the manifest (strict JSON, envelope shape, schema) and every member.

    A file that is not a bundle at all raises BundleError; a manifest that fails the
    schema or members that differ from it are reported in the result (``inspect`` shows
    them, ``sign`` refuses them).
    """
    try:
        f = path.open("rb")
    except OSError as exc:
        raise BundleError(
            f"{path}: cannot read: {exc.strerror}", missing=isinstance(exc, FileNotFoundError)
        ) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_BUNDLE_BYTES:
            raise BundleError(f"{path}: {size} bytes; devices accept at most {MAX_BUNDLE_BYTES}")
        reader = BundleReader(f, size)
        try:
            first = reader.next_member()
            if first is None or first.name != "manifest.json":
                why = (
                    "an empty tar (no member)"
                    if first is None
                    else f"a tar whose first member is {first.name!r}, not manifest.json"
                )
                raise BundleError(f"{path}: {NOT_A_BUNDLE}: {why}")
            if first.size > MAX_MANIFEST_BYTES:
                raise BundleError(
                    f"{path}: manifest.json is {first.size} bytes; at most {MAX_MANIFEST_BYTES}"
                )
            raw = b"".join(bytes(c) for c in reader.read(first))
            doc = loads_strict(raw, what="manifest.json", max_bytes=MAX_MANIFEST_BYTES)
        except MalformedBundle as exc:
            raise BundleError(f"{path}: {exc}") from None
        signed, sigs = _envelope_parts(doc, path)
        manifest, schema_error = None, None
        try:
            manifest = parse_signed(signed)
        except MalformedBundle as exc:
            schema_error = str(exc)
        members: list[tuple[str, bytes]] = []
        problems: list[str] = []
        try:
            while (m := reader.next_member()) is not None:
                members.append((m.name, b"".join(bytes(c) for c in reader.read(m))))
        except MalformedBundle as exc:
            problems.append(str(exc))
    if manifest is not None:
        problems += _member_problems(manifest, members)
    return BundleFile(path, size, signed, sigs, manifest, schema_error, members, problems)


def _envelope_parts(doc: dict[str, Any], path: Path) -> tuple[dict[str, Any], list[Any]]:
    # Not ota.trust.split_envelope: that one refuses an unsigned manifest, which is what
    # ``build`` writes before ``sign``.
    extra = set(doc) - {"signed", "signatures"}
    signed, sigs = doc.get("signed"), doc.get("signatures")
    if extra or not isinstance(signed, dict) or not isinstance(sigs, list):
        raise BundleError(
            f"{path}: manifest.json: expected {{'signed': {{...}}, 'signatures': [...]}}"
            + (f"; unexpected key(s) {sorted(extra)}" if extra else "")
        )
    for i, s in enumerate(sigs):
        if not isinstance(s, dict) or set(s) != {"keyid", "sig"}:
            raise BundleError(f"{path}: manifest.json: signatures[{i}]: expected {{keyid, sig}}")
    return signed, sigs


def _member_problems(m: Signed, members: Sequence[tuple[str, bytes]]) -> list[str]:
    problems: list[str] = []
    names = [n for n, _ in members]
    listed = [p.name for p in m.payloads]
    if names != listed:
        problems.append(f"members are {names}; the manifest lists {listed} (in that order)")
    found = dict(members)
    for p in m.payloads:
        data = found.get(p.name)
        if data is None:
            continue
        what = "patch" if p.delta_from is not None else "payload"
        if len(data) != p.member_length:
            problems.append(
                f"payload {p.name!r}: {len(data)} bytes in the bundle; "
                f"the manifest declares {p.member_length} ({what})"
            )
        elif hashlib.sha256(data).hexdigest() != p.member_sha256:
            problems.append(f"payload {p.name!r}: sha256 differs from the manifest ({what})")
    return problems


def _manifest_bytes(signed: Mapping[str, Any], sigs: Sequence[Mapping[str, Any]]) -> bytes:
    # The layout ota.build.sign_envelope writes, so a re-signed bundle looks like a built one.
    data = json.dumps({"signed": signed, "signatures": list(sigs)}, indent=1, sort_keys=True)
    if len(data) > MAX_MANIFEST_BYTES:
        raise BundleError(f"manifest.json would be {len(data)} bytes; at most {MAX_MANIFEST_BYTES}")
    return data.encode()


def write_bundle_file(out: Path, manifest: bytes, members: Sequence[tuple[str, bytes]]) -> None:
    """Write the bundle durably: a temp file in the same folder, fsync, rename, fsync the
    folder. A crash leaves the old file (``sign`` rewrites in place) or the whole new one.
    Raises ``BundleError`` (nothing left behind)."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write_bundle(tmp, manifest, list(members))  # fsyncs the file
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise BundleError(f"{out}: cannot write: {exc.strerror}") from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


# --- build -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildSpec:
    kind: str
    version: str
    counter: int
    device_types: tuple[str, ...]
    agent_range: str = ""
    expires_days: int = 30
    probation_seconds: int | None = None
    probation_p99_us: int | None = None
    bundle_id: str | None = None
    description: str = ""
    #: Window rates of the devices it is for: its probation must be reachable on each.
    targets: tuple[_target.Target, ...] = ()


@dataclass(frozen=True)
class Built:
    signed: dict[str, Any]
    members: list[tuple[str, bytes]]
    #: Payload names carried as bsdiff4 patches.
    deltas: list[str]
    #: What the probation was checked against, or why it was not (``probation_checked``).
    probation_note: str = ""
    probation_checked: bool = False


def plan_bundle(
    spec: BuildSpec,
    payloads: Sequence[tuple[str, bytes]],
    now: datetime,
    base: Mapping[str, bytes] | None = None,
) -> Built:
    """The ``signed`` part and the tar members of a bundle; checked by the device's schema.

    With ``base`` (payload name -> the bytes a device already has), a payload becomes a
    bsdiff4 patch against the base of the same name when the patch is smaller.
    Raises ``BundleError``.
    """
    entries: list[dict[str, Any]] = []
    members: list[tuple[str, bytes]] = []
    deltas: list[str] = []
    for name, data in payloads:
        entry, member = ota_build.payload_entry(name, data)
        old = (base or {}).get(name)
        if old is not None:
            d_entry, patch = ota_build.payload_entry(name, data, base=old)
            if len(patch) < len(data):
                entry, member = d_entry, patch
                deltas.append(name)
        entries.append(entry)
        members.append((name, member))
    if spec.expires_days < 1:
        raise BundleError(f"--expires-days must be at least 1; got {spec.expires_days}")
    probation: dict[str, int] = {}
    if spec.probation_seconds is not None:
        probation["seconds"] = spec.probation_seconds
    if spec.probation_p99_us is not None:
        probation["p99_us"] = spec.probation_p99_us
    if probation and "seconds" not in probation:
        probation["seconds"] = DEFAULT_PROBATION_S  # as when no limit is given
    signed = ota_build.bundle_signed(
        bundle_id=spec.bundle_id or f"{spec.kind}-{spec.version}",
        kind=spec.kind,
        version=spec.version,
        counter=spec.counter,
        expires=now + timedelta(days=spec.expires_days),
        device_types=spec.device_types,
        payloads=entries,
        agent=spec.agent_range,
        required_permissions=ota_build.default_permissions(spec.kind),
        probation=probation or None,
        description=spec.description,
    )
    try:
        m = parse_signed(signed)
    except MalformedBundle as exc:
        raise BundleError(f"devices would refuse this bundle: {exc}") from None
    targets = list(spec.targets)
    if spec.kind == "config":
        # A config bundle may not change [perception]: its own rate is the device's.
        text = dict(payloads)[CONFIG_PAYLOAD].decode("utf-8", "replace")
        targets.append(_target.from_config_text(text, f"its {CONFIG_PAYLOAD}"))
    note, checked = _check_probation(m, targets)
    return Built(signed, members, deltas, note, checked)


def _check_probation(m: Signed, targets: Sequence[_target.Target]) -> tuple[str, bool]:
    """Refuse a probation a target cannot pass (DESIGN.md section 5); else say what was
    checked, or, with no target, what rate the probation needs."""
    p = m.probation
    for t in targets:
        why = unreachable(
            p, t.windows_per_s, where=f" ({t.source})", raise_what="--probation-seconds"
        )
        if why:
            raise BundleError(f"devices would refuse this bundle: {why}")
    if p.seconds == 0:
        raise BundleError(
            f"devices would refuse this bundle: probation 0 s scores no window; at least "
            f"{p.min_windows} needed: set --probation-seconds"
        )
    if not targets:
        need = p.min_windows / p.seconds
        return (
            f"probation {p.seconds} s needs devices that score >= {need:.3g} windows/s "
            f"({p.min_windows} windows); not checked: give --target-config or --window-rate",
            False,
        )
    shown = "; ".join(
        f"~{p.seconds * t.windows_per_s:.0f} windows at {t.windows_per_s:.3g} windows/s "
        f"({t.source})"
        for t in targets
    )
    return f"probation {p.seconds} s: {shown}; {p.min_windows} needed", True


def build_bundle(
    out: Path,
    spec: BuildSpec,
    payloads: Sequence[tuple[str, bytes]],
    now: datetime,
    *,
    base: Path | None = None,
    signers: Sequence[ec.EllipticCurvePrivateKey] = (),
) -> Built:
    """Plan and write the bundle; unsigned (``signatures: []``) without ``signers``.
    Raises ``BundleError`` (or ``FleetKeyError`` from the signing keys)."""
    base_payloads = None
    if base is not None:
        old = read_bundle(base)
        if old.manifest is None or old.problems:
            why = old.schema_error or "; ".join(old.problems)
            raise BundleError(f"{base}: cannot be a delta base: {why}")
        base_payloads = old.full_payloads()
        if not base_payloads:
            raise BundleError(f"{base}: carries no whole payload to be a delta base")
    built = plan_bundle(spec, payloads, now, base_payloads)
    manifest = ota_build.sign_envelope(built.signed, signers)
    if len(manifest) > MAX_MANIFEST_BYTES:
        raise BundleError(f"manifest.json is {len(manifest)} bytes; at most {MAX_MANIFEST_BYTES}")
    write_bundle_file(out, manifest, built.members)
    return built


# --- sign --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignResult:
    added: list[str]
    #: With a root: distinct valid bundle signatures now, and the threshold.
    valid: int | None
    threshold: int | None


def _valid_signers(
    bf: BundleFile, root: ota_trust.TrustRoot, now: datetime, why: list[str] | None = None
) -> set[str]:
    return ota_trust.signers(
        canonical(bf.signed),
        bf.signatures,
        root.roles["bundles"],
        root.keys,
        now,
        what="manifest.json",
        why=why,
    )


def sign_bundle(
    path: Path,
    keys: Sequence[ec.EllipticCurvePrivateKey],
    now: datetime,
    root: ota_trust.TrustRoot | None = None,
) -> SignResult:
    """Add one signature per key to the bundle at ``path`` and rewrite it durably.

    A signature by the same key replaces that key's old one. With ``root``, a key outside
    its ``bundles`` role (or expired there) is refused before anything is written. A bundle
    whose members differ from its manifest is refused: signing it would vouch for bytes
    no device will accept.
    """
    if not keys:
        raise BundleError("no key to sign with")
    bf = read_bundle(path)
    if bf.schema_error:
        raise BundleError(f"{path}: refusing to sign: {bf.schema_error}")
    if bf.problems:
        raise BundleError(f"{path}: refusing to sign: {'; '.join(bf.problems)}")
    if root is not None:
        role = root.roles["bundles"]
        for key in keys:
            kid = ota_keys.keyid(key.public_key())
            if kid not in role.keyids:
                raise BundleError(
                    f"key {kid[:16]} is not a bundle key of root.json version {root.version}; "
                    "refusing to sign with it (devices would not count its signature)"
                )
            if not root.keys[kid].valid_at(now):
                raise BundleError(f"key {kid[:16]} expired in root.json version {root.version}")
    fresh = json.loads(ota_build.sign_envelope(bf.signed, keys))["signatures"]
    added = [s["keyid"] for s in fresh]
    sigs = [s for s in bf.signatures if s["keyid"] not in added] + fresh
    write_bundle_file(path, _manifest_bytes(bf.signed, sigs), bf.members)
    if root is None:
        return SignResult(added, None, None)
    signed_now = BundleFile(
        path, bf.size, bf.signed, sigs, bf.manifest, None, bf.members, bf.problems
    )
    valid = _valid_signers(signed_now, root, now)
    return SignResult(added, len(valid), root.roles["bundles"].threshold)


# --- inspect -----------------------------------------------------------------------------


class _BaseRefused(Exception):
    """A ``--base`` bundle did not verify: the verdict is about the base, not the bundle."""


def inspect_bundle(
    path: Path,
    now: datetime,
    *,
    root: ota_trust.TrustRoot | None = None,
    device_type: str | None = None,
    agent_version: str | None = None,
    bases: Sequence[Path] = (),
) -> dict[str, Any]:
    """What the bundle holds and, with ``root``, whether a device would accept it.

    The verdict is the device's gatekeeper (:func:`ota.verify.verify_bundle`) run into a
    temporary content store, checked as a device of ``device_type`` (default: the first
    the bundle names) running agent ``agent_version`` (default: this release) that grants
    every permission the bundle asks for. A delta bundle needs its base: each of ``bases``
    is verified into the same store first, as a device that installed it would have it.
    """
    bf = read_bundle(path)
    report: dict[str, Any] = {
        "file": str(path),
        "bytes": bf.size,
        "manifest_sha256": bf.manifest_sha256,
        "signed": bf.signed,
        "schema_error": bf.schema_error,
        "problems": bf.problems,
        "members": [{"name": n, "bytes": len(d)} for n, d in bf.members],
        "signatures": [
            {"keyid": s["keyid"], "counts": None, "reason": None} for s in bf.signatures
        ],
        "verification": None,
    }
    if root is None:
        return report
    role = root.roles["bundles"]
    seen: set[str] = set()
    for entry, sig in zip(report["signatures"], bf.signatures, strict=True):
        why: list[str] = []
        one = BundleFile(path, bf.size, bf.signed, [sig], None, None, [], [])
        good = _valid_signers(one, root, now, why)
        if good and sig["keyid"] in seen:
            entry["counts"], entry["reason"] = False, "already counted (a key counts once)"
        elif good:
            entry["counts"] = True
            seen.add(sig["keyid"])
        else:
            entry["counts"] = False
            entry["reason"] = why[0].removeprefix("signatures[0]: ") if why else "not counted"
    if device_type is None:
        compat = bf.signed.get("compat")
        types = compat.get("device_types") if isinstance(compat, dict) else None
        first = types[0] if isinstance(types, list) and types else None
        device_type = first if isinstance(first, str) else "unknown"
    if agent_version is None:
        agent_version = fleet.__version__
    wanted = bf.signed.get("required_permissions")
    perms: frozenset[str] = frozenset()
    if isinstance(wanted, list):
        perms = frozenset(p for p in wanted if isinstance(p, str))
    verdict: dict[str, Any] = {
        "ok": False,
        "code": None,
        "reason": None,
        "root_version": root.version,
        "threshold": role.threshold,
        "valid_signatures": len(seen),
        "checked_as": {"device_type": device_type, "agent_version": agent_version},
    }
    with tempfile.TemporaryDirectory(prefix="fleet-inspect-") as tmp:
        store = ContentStore(Path(tmp) / "store")
        store.ensure()
        try:
            for base in bases:
                _verify_into(
                    base,
                    root=root,
                    now=now,
                    store=store,
                    device_type=device_type,
                    agent_version=agent_version,
                    perms=perms,
                )
            verify_bundle(
                path,
                root=root,
                policy=Policy(device_type, agent_version, perms),
                floors={},
                now=now,
                store=store,
                keep_source=True,
            )
            verdict["ok"] = True
        except _BaseRefused as exc:
            verdict["code"], verdict["reason"] = "base", str(exc)
        except OtaError as exc:
            verdict["code"], verdict["reason"] = exc.code, str(exc)
    report["verification"] = verdict
    return report


def _verify_into(
    base: Path,
    *,
    root: ota_trust.TrustRoot,
    now: datetime,
    store: ContentStore,
    device_type: str,
    agent_version: str,
    perms: frozenset[str],
) -> None:
    try:
        bf = read_bundle(base)
        wanted = bf.signed.get("required_permissions")
        extra = [p for p in wanted if isinstance(p, str)] if isinstance(wanted, list) else []
        verify_bundle(
            base,
            root=root,
            policy=Policy(device_type, agent_version, perms | frozenset(extra)),
            floors={},
            now=now,
            store=store,
            keep_source=True,
        )
    except (OtaError, BundleError) as exc:
        raise _BaseRefused(f"base {base}: {exc}") from None
