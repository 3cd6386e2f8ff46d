"""Making trust roots and bundles: what the fleet's ``keys`` and ``bundle`` commands and the
tests use. Everything here produces the documented formats (DESIGN.md section 5); the
device trusts none of it until :mod:`ota.verify` has checked it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import bsdiff4
from cryptography.hazmat.primitives.asymmetric import ec

from ota import keys as _keys
from ota.canonical import canonical
from ota.efb import write_bundle
from ota.manifest import DEFAULT_PROBATION_S, KIND_PERMISSION
from ota.timefmt import format_utc


def sign_envelope(
    signed: Mapping[str, Any], signers: Iterable[ec.EllipticCurvePrivateKey]
) -> bytes:
    """``{"signed", "signatures"}`` as JSON bytes, one signature per key."""
    body = canonical(signed)
    sigs = [{"keyid": _keys.keyid(k.public_key()), "sig": _keys.sign(k, body)} for k in signers]
    return json.dumps({"signed": signed, "signatures": sigs}, indent=1, sort_keys=True).encode()


def root_signed(
    *,
    version: int,
    expires: datetime,
    root_keys: Sequence[ec.EllipticCurvePublicKey],
    bundle_keys: Sequence[ec.EllipticCurvePublicKey],
    root_threshold: int = 1,
    bundle_threshold: int = 1,
    key_expires: Mapping[str, datetime] | None = None,
) -> dict[str, Any]:
    keys: dict[str, Any] = {}
    for k in (*root_keys, *bundle_keys):
        kid = _keys.keyid(k)
        entry: dict[str, Any] = {
            "keytype": "ecdsa",
            "scheme": "ecdsa-sha2-nistp256",
            "public": _keys.public_pem(k),
        }
        if key_expires and kid in key_expires:
            entry["expires"] = format_utc(key_expires[kid])
        keys[kid] = entry
    return {
        "_type": "root",
        "version": version,
        "expires": format_utc(expires),
        "keys": keys,
        "roles": {
            "root": {"keyids": [_keys.keyid(k) for k in root_keys], "threshold": root_threshold},
            "bundles": {
                "keyids": [_keys.keyid(k) for k in bundle_keys],
                "threshold": bundle_threshold,
            },
        },
    }


def payload_entry(
    name: str, data: bytes, *, base: bytes | None = None
) -> tuple[dict[str, Any], bytes]:
    """The manifest entry for one payload and the bytes its tar member holds.

    With ``base``, the member is a bsdiff4 patch from ``base`` to ``data``.
    """
    entry: dict[str, Any] = {
        "name": name,
        "length": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    if base is None:
        return entry, data
    patch = bsdiff4.diff(base, data)
    entry["delta_from"] = hashlib.sha256(base).hexdigest()
    entry["patch"] = {"length": len(patch), "sha256": hashlib.sha256(patch).hexdigest()}
    return entry, patch


def bundle_signed(
    *,
    bundle_id: str,
    kind: str,
    version: str,
    counter: int,
    expires: datetime,
    device_types: Sequence[str],
    payloads: Sequence[Mapping[str, Any]],
    agent: str = "",
    required_permissions: Sequence[str] = (),
    probation: Mapping[str, int] | None = None,
    description: str = "",
) -> dict[str, Any]:
    signed: dict[str, Any] = {
        "bundle_id": bundle_id,
        "kind": kind,
        "version": version,
        "counter": counter,
        "expires": format_utc(expires),
        "compat": {"device_types": list(device_types), "agent": agent},
        "required_permissions": list(required_permissions),
        "payloads": [dict(p) for p in payloads],
        "probation": dict(probation or {"seconds": DEFAULT_PROBATION_S}),
    }
    if description:
        signed["description"] = description
    return signed


def write(
    out: Path,
    signed: Mapping[str, Any],
    members: Sequence[tuple[str, bytes]],
    signers: Iterable[ec.EllipticCurvePrivateKey],
) -> Path:
    """Sign ``signed`` and write the bundle: the manifest, then ``members`` in order."""
    write_bundle(out, sign_envelope(signed, signers), list(members))
    return out


def default_permissions(kind: str) -> list[str]:
    """The permission a bundle of ``kind`` needs (the device requires it even if unlisted)."""
    return [KIND_PERMISSION[kind]]


def model_bundle_payloads(model_dir: Path) -> list[tuple[str, bytes]]:
    """``model.tflite`` and ``model.json`` (the model's manifest) from a model directory."""
    manifest = (model_dir / "manifest.json").read_bytes()
    name = json.loads(manifest).get("file", "model.tflite")
    return [("model.tflite", (model_dir / name).read_bytes()), ("model.json", manifest)]
