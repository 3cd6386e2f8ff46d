"""The bundle verifier against every way a bundle can be wrong (issue 7's matrix).

Each refusal asserts the exact error class, that the message names what and where, and that
the content store is exactly as it was: a refused bundle leaves nothing staged. Bundles are
made with the project's own builder, with Python's ``tarfile`` writing raw member types, and
with the ``openssl`` and ``tar`` command lines, as a fleet admin without our tools would.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import random
import subprocess
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import bsdiff4
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from ota import build, keys, trust
from ota.canonical import canonical
from ota.efb import BundleReader, write_bundle
from ota.errors import (
    AlreadyInstalled,
    BundleExpired,
    Incompatible,
    MalformedBundle,
    OtaError,
    PayloadMismatch,
    PermissionDenied,
    RollbackRejected,
    SignatureInvalid,
    StorageError,
    TrustError,
)
from ota.machine import Installed, Journal
from ota.store import ContentStore
from ota.trust import TrustRoot
from ota.verify import (
    MAX_DELTA_BYTES,
    MAX_MANIFEST_BYTES,
    Policy,
    VerifiedBundle,
    read_manifest,
    verify_bundle,
)

pytestmark = pytest.mark.peers

NOW = datetime(2026, 12, 3, 12, 0, 0, tzinfo=UTC)
TFLITE = bytes(range(256)) * 64
MODEL_JSON = b'{"name": "motor-drive", "file": "model.tflite"}\n'
POLICY = Policy("motor-drive", "0.1.0", frozenset({"model:swap"}))

PrivateKey = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class Keys:
    root: PrivateKey
    a: PrivateKey
    b: PrivateKey
    c: PrivateKey
    outsider: PrivateKey


@pytest.fixture(scope="module")
def k() -> Keys:
    return Keys(*(keys.generate() for _ in range(5)))


def make_root(
    root_keys: Sequence[PrivateKey],
    bundle_keys: Sequence[PrivateKey],
    *,
    version: int = 1,
    threshold: int = 1,
    expires: datetime = NOW + timedelta(days=365),
    key_expires: dict[str, datetime] | None = None,
    signers: Sequence[PrivateKey] | None = None,
) -> bytes:
    signed = build.root_signed(
        version=version,
        expires=expires,
        root_keys=[r.public_key() for r in root_keys],
        bundle_keys=[b.public_key() for b in bundle_keys],
        bundle_threshold=threshold,
        key_expires=key_expires,
    )
    return build.sign_envelope(signed, root_keys if signers is None else signers)


def members(tflite: bytes = TFLITE, model_json: bytes = MODEL_JSON) -> list[tuple[str, bytes]]:
    return [("model.tflite", tflite), ("model.json", model_json)]


def signed_for(payloads: Sequence[tuple[str, bytes]], **over: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "bundle_id": "motor-model-2",
        "kind": "model",
        "version": "1.1.0",
        "counter": 2,
        "expires": NOW + timedelta(days=30),
        "device_types": ["motor-drive"],
        "payloads": [build.payload_entry(n, b)[0] for n, b in payloads],
        "agent": ">=0.1,<1",
        "required_permissions": ["model:swap"],
    }
    args.update(over)
    return build.bundle_signed(**args)


@dataclass
class Env:
    cs: ContentStore
    root: TrustRoot | None
    keys: Keys
    floors: dict[str, int] = field(default_factory=lambda: {"model": 1})

    def verify(self, path: Path, **kw: Any) -> VerifiedBundle:
        args: dict[str, Any] = {
            "root": self.root,
            "policy": POLICY,
            "floors": self.floors,
            "now": NOW,
            "store": self.cs,
        }
        args.update(kw)
        return verify_bundle(path, **args)

    def snapshot(self) -> dict[str, int]:
        """Every file and directory under store/ with its size: what staging would change."""
        return {
            str(p.relative_to(self.cs.root)): p.stat().st_size if p.is_file() else -1
            for p in self.cs.root.rglob("*")
        }

    def bundle(
        self,
        name: str = "b.efb",
        *,
        payloads: Sequence[tuple[str, bytes]] | None = None,
        signed: dict[str, Any] | None = None,
        signers: Sequence[PrivateKey] | None = None,
        manifest: bytes | None = None,
        tar_members: Sequence[tuple[str, bytes]] | None = None,
    ) -> Path:
        """A bundle in ``incoming/``: ``payloads`` listed and signed, ``tar_members`` written."""
        payloads = members() if payloads is None else payloads
        signed = signed_for(payloads) if signed is None else signed
        if manifest is None:
            manifest = build.sign_envelope(signed, [self.keys.a] if signers is None else signers)
        path = self.cs.incoming / name
        write_bundle(path, manifest, list(payloads if tar_members is None else tar_members))
        return path


@pytest.fixture
def env(tmp_path: Path, k: Keys) -> Env:
    cs = ContentStore(tmp_path / "ota" / "store")
    cs.ensure()
    return Env(cs, trust.load_root(make_root([k.root], [k.a]), NOW), k)


def refused(env: Env, path: Path, cls: type[OtaError], *fragments: str, **kw: Any) -> OtaError:
    """Verify ``path``: it must raise exactly ``cls``, say each fragment, stage nothing."""
    before = env.snapshot()
    with pytest.raises(OtaError) as info:
        env.verify(path, **kw)
    err = info.value
    assert type(err) is cls, f"{type(err).__name__}: {err}"
    for fragment in fragments:
        assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"
    assert env.snapshot() == before
    return err


def manifest_doc(signed: dict[str, Any], sigs: list[dict[str, str]]) -> bytes:
    return json.dumps({"signed": signed, "signatures": sigs}, indent=1).encode()


def raw_sig(key: PrivateKey, signed: dict[str, Any]) -> bytes:
    return key.sign(canonical(signed), ec.ECDSA(hashes.SHA256()))


def entry(keyid: str, der: bytes) -> dict[str, str]:
    return {"keyid": keyid, "sig": base64.b64encode(der).decode()}


def kid(key: PrivateKey) -> str:
    return keys.keyid(key.public_key())


# -- success --------------------------------------------------------------------------------


def test_model_bundle_verifies_and_stages_zero_copy(env: Env) -> None:
    path = env.bundle()
    inode = path.stat().st_ino
    vb = env.verify(path)
    assert (vb.kind, vb.version, vb.signed.counter) == ("model", "1.1.0", 2)
    tflite_sha = hashlib.sha256(TFLITE).hexdigest()
    assert vb.payloads == {
        "model.tflite": tflite_sha,
        "model.json": hashlib.sha256(MODEL_JSON).hexdigest(),
    }
    # Renamed out of incoming/, not copied: the same inode is now the kept bundle.
    assert not path.exists()
    assert vb.path.parent == env.cs.bundles
    assert vb.path.stat().st_ino == inode
    assert vb.path.name.startswith(f"{vb.manifest_sha256}-")
    for sha in vb.payloads.values():
        ref = json.loads((env.cs.root / f"{sha}.ref").read_bytes())
        assert ref["bundle"] == vb.path.name
        assert not (env.cs.root / sha).exists()  # no payload byte written a second time
    assert env.cs.read(tflite_sha, max_bytes=1 << 20) == TFLITE
    assert env.cs.read(vb.payloads["model.json"], max_bytes=1 << 20) == MODEL_JSON
    assert vb.manifest_sha256 == hashlib.sha256(canonical(signed_for(members()))).hexdigest()


def test_a_bundle_from_elsewhere_is_copied_and_the_source_kept(env: Env, tmp_path: Path) -> None:
    src = tmp_path / "usb" / "b.efb"
    src.parent.mkdir()
    os.replace(env.bundle(), src)
    original = src.read_bytes()
    vb = env.verify(src, keep_source=True)
    assert src.read_bytes() == original
    assert vb.path.read_bytes() == original
    assert vb.path.stat().st_ino != src.stat().st_ino
    assert env.cs.read(vb.payloads["model.tflite"], max_bytes=1 << 20) == TFLITE


def test_keep_source_copies_even_from_incoming(env: Env) -> None:
    path = env.bundle()
    vb = env.verify(path, keep_source=True)
    assert path.exists()
    assert vb.path.stat().st_ino != path.stat().st_ino


def test_the_real_motor_drive_model_verifies(env: Env) -> None:
    payloads = build.model_bundle_payloads(Path(__file__).parent.parent / "models" / "motor_drive")
    vb = env.verify(env.bundle(payloads=payloads))
    assert env.cs.read(vb.payloads["model.tflite"], max_bytes=1 << 24) == payloads[0][1]


def test_verified_bundle_cannot_be_made_outside_the_verifier(env: Env) -> None:
    vb = env.verify(env.bundle())
    with pytest.raises(TypeError, match=r"only ota\.verify\.verify_bundle"):
        VerifiedBundle(vb.signed, vb.manifest_sha256, vb.payloads, vb.path, object())


# -- trust root and signatures --------------------------------------------------------------


def test_no_trust_root_refuses_everything(env: Env) -> None:
    env.root = None
    refused(env, env.bundle(), TrustError, "no trust root")


def test_an_expired_root_refuses_every_bundle(env: Env, k: Keys) -> None:
    env.root = trust.load_root(make_root([k.root], [k.a], expires=NOW - timedelta(seconds=1)), NOW)
    refused(env, env.bundle(), TrustError, "trust root version 1 expired at")


def test_an_expired_root_refuses_before_reading_the_bundle(env: Env, k: Keys) -> None:
    env.root = trust.load_root(make_root([k.root], [k.a], expires=NOW), NOW)
    for path in (env.bundle(), env.cs.incoming / "absent.efb"):
        refused(env, path, TrustError, "install a newer root.json")


def test_unsigned_bundle(env: Env) -> None:
    signed = signed_for(members())
    refused(env, env.bundle(manifest=manifest_doc(signed, [])), SignatureInvalid, "unsigned")


def test_manifest_without_signatures_key(env: Env) -> None:
    doc = json.dumps({"signed": signed_for(members())}).encode()
    refused(env, env.bundle(manifest=doc), SignatureInvalid, "manifest.json.signatures")


def test_one_byte_flipped_in_the_signed_manifest(env: Env) -> None:
    good = build.sign_envelope(signed_for(members()), [env.keys.a])
    assert good.count(b'"counter": 2') == 1
    bad = good.replace(b'"counter": 2', b'"counter": 3')
    refused(
        env,
        env.bundle(manifest=bad),
        SignatureInvalid,
        "manifest.json",
        "0 valid signature(s)",
        "signatures[0]",
        "does not verify",
    )


def test_signed_by_a_key_not_in_the_root(env: Env) -> None:
    err = refused(env, env.bundle(signers=[env.keys.outsider]), SignatureInvalid, "threshold is 1")
    assert kid(env.keys.outsider)[:16] in str(err)
    assert "not a bundles key" in str(err)


def test_a_root_key_cannot_sign_bundles(env: Env) -> None:
    refused(env, env.bundle(signers=[env.keys.root]), SignatureInvalid, "not a bundles key")


def _der_variants(key: PrivateKey, signed: dict[str, Any]) -> dict[str, bytes]:
    good = raw_sig(key, signed)
    r, s = decode_dss_signature(good)
    p384 = ec.generate_private_key(ec.SECP384R1())
    return {
        "truncated": good[:-5],
        "r_zero": encode_dss_signature(0, s),
        "s_zero": encode_dss_signature(r, 0),
        "p384": p384.sign(canonical(signed), ec.ECDSA(hashes.SHA256())),
        "trailing_byte": good + b"\0",
    }


@pytest.mark.parametrize(
    ("variant", "why"),
    [
        ("truncated", "does not verify"),
        ("r_zero", "does not verify"),
        ("s_zero", "does not verify"),
        ("p384", "base64 of a P-256 DER signature has at most"),
        ("trailing_byte", "does not verify"),
    ],
)
def test_malformed_der_signatures(env: Env, variant: str, why: str) -> None:
    signed = signed_for(members())
    der = _der_variants(env.keys.a, signed)[variant]
    doc = manifest_doc(signed, [entry(kid(env.keys.a), der)])
    refused(env, env.bundle(manifest=doc), SignatureInvalid, "signatures[0]", why)


@pytest.mark.parametrize(
    ("sig", "why"),
    [
        ("not base64!!", "not valid base64"),
        ("", "expected base64"),
        ("A" * 400, "400 characters"),
        ("MEUCIQ", "not valid base64"),  # base64 without its padding
    ],
)
def test_signature_not_base64(env: Env, sig: str, why: str) -> None:
    signed = signed_for(members())
    doc = manifest_doc(signed, [{"keyid": kid(env.keys.a), "sig": sig}])
    refused(env, env.bundle(manifest=doc), SignatureInvalid, "signatures[0]", why)


def test_signature_entry_with_extra_fields(env: Env) -> None:
    signed = signed_for(members())
    sig = entry(kid(env.keys.a), raw_sig(env.keys.a, signed)) | {"note": "x"}
    doc = manifest_doc(signed, [sig])
    refused(env, env.bundle(manifest=doc), SignatureInvalid, "signatures[0]: expected {keyid, sig}")


def test_a_good_signature_next_to_a_bad_one_is_enough(env: Env) -> None:
    signed = signed_for(members())
    good = raw_sig(env.keys.a, signed)
    doc = manifest_doc(signed, [entry(kid(env.keys.outsider), good), entry(kid(env.keys.a), good)])
    assert env.verify(env.bundle(manifest=doc)).signed.counter == 2


def test_expired_signing_key(env: Env, k: Keys) -> None:
    doc = make_root([k.root], [k.a], key_expires={kid(k.a): NOW - timedelta(hours=1)})
    env.root = trust.load_root(doc, NOW)
    refused(env, env.bundle(), SignatureInvalid, kid(k.a)[:16], "expired at")
    # Before its expiry the same key signs fine.
    env.verify(env.bundle(), now=NOW - timedelta(hours=2))


def _rotated(k: Keys, bundle_keys: Sequence[PrivateKey], threshold: int = 1) -> TrustRoot:
    old = trust.load_root(make_root([k.root], [k.a]), NOW)
    return trust.rotate(old, make_root([k.root], bundle_keys, version=2, threshold=threshold), NOW)


def test_rotation_old_keys_only_are_refused(env: Env, k: Keys) -> None:
    env.root = _rotated(k, [k.b])
    refused(env, env.bundle(signers=[k.a]), SignatureInvalid, kid(k.a)[:16], "not a bundles key")


def test_rotation_new_keys_only_are_accepted(env: Env, k: Keys) -> None:
    env.root = _rotated(k, [k.b])
    assert env.verify(env.bundle(signers=[k.b])).signed.counter == 2


def test_rotation_old_and_new_keys_together_are_accepted(env: Env, k: Keys) -> None:
    env.root = _rotated(k, [k.b])
    assert env.verify(env.bundle(signers=[k.a, k.b])).signed.counter == 2


def test_threshold_two_not_met_with_one_key(env: Env, k: Keys) -> None:
    env.root = _rotated(k, [k.b, k.c], threshold=2)
    refused(env, env.bundle(signers=[k.b]), SignatureInvalid, "1 valid signature(s)", "is 2")


def test_the_same_key_signing_twice_counts_once(env: Env, k: Keys) -> None:
    env.root = _rotated(k, [k.b, k.c], threshold=2)
    refused(
        env,
        env.bundle(signers=[k.b, k.b]),
        SignatureInvalid,
        "1 valid signature(s)",
        "counted once",
    )
    assert env.verify(env.bundle(signers=[k.c, k.b])).signed.counter == 2


def test_revoked_signing_key_dropped_by_a_rotated_root(env: Env, k: Keys) -> None:
    # a and b sign for root 1; root 2 revokes a. A bundle a alone signed is refused
    # afterwards, even though root 1 would have taken it.
    first = trust.load_root(make_root([k.root], [k.a, k.b]), NOW)
    env.root = first
    path = env.bundle(signers=[k.a])
    env.verify(path, keep_source=True)
    env.root = trust.rotate(first, make_root([k.root], [k.b], version=2), NOW)
    fresh = Env(ContentStore(env.cs.root.parent / "store2"), env.root, k)
    fresh.cs.ensure()
    refused(fresh, path, SignatureInvalid, kid(k.a)[:16], "not a bundles key")


# -- manifest syntax ------------------------------------------------------------------------


def test_float_inside_signed(env: Env) -> None:
    signed = signed_for(members())
    signed["probation"] = {"seconds": 3.5}
    manifest = build.sign_envelope(signed, [env.keys.a])
    refused(env, env.bundle(manifest=manifest), MalformedBundle, "manifest.json", "3.5")


def test_duplicate_key_inside_signed(env: Env) -> None:
    good = build.sign_envelope(signed_for(members()), [env.keys.a])
    bad = good.replace(b'"counter": 2', b'"counter": 1, "counter": 2')
    refused(
        env, env.bundle(manifest=bad), MalformedBundle, "manifest.json", "duplicate key 'counter'"
    )


def test_integer_too_long_for_python_inside_signed(env: Env) -> None:
    good = build.sign_envelope(signed_for(members()), [env.keys.a])
    bad = good.replace(b'"counter": 2', b'"counter": 2, "x": ' + b"7" * 5000)
    refused(env, env.bundle(manifest=bad), MalformedBundle, "manifest.json", "5000 digits")


def test_lone_surrogate_inside_signed(env: Env) -> None:
    good = build.sign_envelope(signed_for(members()), [env.keys.a])
    bad = good.replace(b'"counter": 2', b'"counter": 2, "description": "\\ud800"')
    refused(env, env.bundle(manifest=bad), MalformedBundle, "manifest.json", "surrogate")


def test_manifest_not_json(env: Env) -> None:
    refused(env, env.bundle(manifest=b"{not json"), MalformedBundle, "manifest.json", "not valid")


def test_manifest_not_utf8(env: Env) -> None:
    refused(env, env.bundle(manifest=b'{"a": "\xff"}'), MalformedBundle, "not UTF-8")


def test_schema_fault_is_named_by_path(env: Env) -> None:
    signed = signed_for(members())
    signed["payloads"][1]["sha256"] = "XYZ"
    refused(
        env,
        env.bundle(signed=signed),
        MalformedBundle,
        "signed.payloads[1].sha256",
    )


def test_counter_must_be_an_integer_not_a_bool(env: Env) -> None:
    signed = signed_for(members(), counter=True)
    refused(env, env.bundle(signed=signed), MalformedBundle, "signed.counter")


def test_model_bundle_without_its_model(env: Env) -> None:
    payloads = [("model.json", MODEL_JSON)]
    refused(
        env, env.bundle(payloads=payloads), MalformedBundle, "needs payload(s) ['model.tflite']"
    )


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"expires": "2026-02-30T00:00:00Z"}, "signed.expires: not a real instant"),
        ({"expires": "2026-12-30"}, "signed.expires"),
        ({"compat": {"device_types": ["motor-drive"], "agent": "at least 0.1"}}, "PEP 440"),
        ({"compat": {"device_types": []}}, "signed.compat.device_types"),
        ({"probation": {"seconds": 3601}}, "signed.probation.seconds"),
        ({"kind": "firmware"}, "signed.kind"),
        ({"version": "1.1"}, "signed.version"),
        ({"counter": -1}, "signed.counter"),
        ({"payloads": []}, "signed.payloads"),
        ({"bundle_id": "a b"}, "signed.bundle_id"),
    ],
)
def test_signed_field_faults(env: Env, over: dict[str, Any], why: str) -> None:
    signed = signed_for(members()) | over
    refused(env, env.bundle(signed=signed), MalformedBundle, "manifest: ", why)


def test_a_missing_field_is_named(env: Env) -> None:
    signed = signed_for(members())
    del signed["counter"]
    refused(env, env.bundle(signed=signed), MalformedBundle, "missing required field `counter`")


@pytest.mark.parametrize(
    ("kind", "payloads", "why"),
    [
        (
            "model",
            [*members(), ("notes.txt", b"x")],
            "a model bundle carries model.tflite and model.json only; ['notes.txt'] would be "
            "ignored by devices",
        ),
        (
            "config",
            [("agent.toml", b'[device]\nname = "gw-1"\n'), ("model.tflite", TFLITE)],
            "a config bundle carries agent.toml only; ['model.tflite'] would be ignored",
        ),
    ],
)
def test_a_bundle_carries_its_kinds_payloads_and_nothing_else(
    env: Env, kind: str, payloads: list[tuple[str, bytes]], why: str
) -> None:
    perms = build.default_permissions(kind)
    signed = signed_for(payloads, kind=kind, required_permissions=perms)
    policy = Policy("motor-drive", "0.1.0", frozenset(perms))
    path = env.bundle(payloads=payloads, signed=signed)
    refused(env, path, MalformedBundle, why, policy=policy)


def test_payload_name_that_is_a_path(env: Env) -> None:
    payloads = [("model.tflite", TFLITE), ("model.json", MODEL_JSON)]
    signed = signed_for(payloads)
    signed["payloads"][1]["name"] = "../model.json"
    err = refused(
        env,
        env.bundle(signed=signed),
        MalformedBundle,
        "signed.payloads[1].name '../model.json' leaves the bundle folder",
    )
    assert "regex" not in str(err)
    signed["payloads"][1]["name"] = "/etc/model.json"
    refused(env, env.bundle(signed=signed), MalformedBundle, "is an absolute path")
    signed["payloads"][1]["name"] = ".model.json"
    err = refused(env, env.bundle(signed=signed), MalformedBundle, "expected a plain file name")
    assert "regex" not in str(err)


def test_a_config_bundle_verifies(env: Env) -> None:
    payloads = [("agent.toml", b'[device]\nname = "gw-1"\n')]
    signed = signed_for(payloads, kind="config", required_permissions=["config:write"])
    policy = Policy("motor-drive", "0.1.0", frozenset({"config:write"}))
    vb = env.verify(env.bundle(payloads=payloads, signed=signed), policy=policy)
    assert vb.kind == "config"
    assert env.cs.read(vb.payloads["agent.toml"], max_bytes=1024) == payloads[0][1]


@pytest.mark.parametrize(
    ("names", "ok"),
    [
        (["edgefleet-0.2.0-py3-none-any.whl"], True),
        (["edgefleet.whl"], False),
        (["edgefleet-0.2.0-py3-none-any.whl", "other-1.0-py3-none-any.whl"], False),
        (["edgefleet-0.2.0-py3-none-any.whl", "NOTES"], False),
        (["NOTES"], False),
    ],
)
def test_an_agent_bundle_carries_exactly_one_wheel(env: Env, names: list[str], ok: bool) -> None:
    payloads = [(w, b"PK wheel " + w.encode()) for w in names]
    signed = signed_for(payloads, kind="agent", required_permissions=["agent:replace"])
    policy = Policy("motor-drive", "0.1.0", frozenset({"agent:replace"}))
    path = env.bundle(payloads=payloads, signed=signed)
    if ok:
        assert env.verify(path, policy=policy).kind == "agent"
    else:
        refused(env, path, MalformedBundle, "exactly one wheel", policy=policy)


# -- policy ---------------------------------------------------------------------------------


def test_downgrade_below_the_floor(env: Env) -> None:
    env.floors = {"model": 5}
    refused(env, env.bundle(), RollbackRejected, "counter 2", "floor 5", "downgrade")


def test_same_version_is_already_installed(env: Env) -> None:
    env.floors = {"model": 2}
    refused(env, env.bundle(), AlreadyInstalled, "counter 2", "already installed")


def test_the_floor_of_another_kind_does_not_apply(env: Env) -> None:
    env.floors = {"config": 9}
    assert env.verify(env.bundle()).signed.counter == 2


def test_expired_manifest(env: Env) -> None:
    signed = signed_for(members(), expires=NOW - timedelta(seconds=1))
    refused(env, env.bundle(signed=signed), BundleExpired, "motor-model-2", "expired at")


def test_wrong_device_type(env: Env) -> None:
    signed = signed_for(members(), device_types=["pump-drive"])
    refused(env, env.bundle(signed=signed), Incompatible, "pump-drive", "'motor-drive'")


@pytest.mark.parametrize("agent", [">=0.2", "<0.1", "==1.0"])
def test_agent_version_out_of_range(env: Env, agent: str) -> None:
    signed = signed_for(members(), agent=agent)
    refused(env, env.bundle(signed=signed), Incompatible, f"needs agent {agent}", "0.1.0")


def test_permission_not_granted(env: Env) -> None:
    signed = signed_for(members(), required_permissions=["model:swap", "agent:replace"])
    refused(env, env.bundle(signed=signed), PermissionDenied, "['agent:replace']")


_WHEEL = ("edgefleet-9.9.9-py3-none-any.whl", b"PK wheel")
_KIND_PAYLOADS: dict[str, list[tuple[str, bytes]]] = {
    "model": members(),
    "config": [("agent.toml", b'[device]\nname = "gw-1"\n')],
    "agent": [_WHEEL],
}


@pytest.mark.parametrize(
    ("kind", "needed"),
    [("model", "model:swap"), ("config", "config:write"), ("agent", "agent:replace")],
)
def test_the_kinds_permission_is_required_even_when_the_manifest_omits_it(
    env: Env, kind: str, needed: str
) -> None:
    payloads = _KIND_PAYLOADS[kind]
    signed = signed_for(payloads, kind=kind, required_permissions=[])
    others = {"model:swap", "config:write", "agent:replace"} - {needed}
    policy = Policy("motor-drive", "0.1.0", frozenset(others))
    path = env.bundle(payloads=payloads, signed=signed)
    refused(env, path, PermissionDenied, f"kind {kind!r} requires {needed!r}", policy=policy)


def test_an_agent_bundle_with_no_listed_permission_verifies_where_granted(env: Env) -> None:
    signed = signed_for([_WHEEL], kind="agent", required_permissions=[])
    policy = Policy("motor-drive", "0.1.0", frozenset({"agent:replace"}))
    assert env.verify(env.bundle(payloads=[_WHEEL], signed=signed), policy=policy).kind == "agent"


@pytest.mark.parametrize("kind", ["model", "config", "agent"])
def test_default_permissions_are_the_kinds_permission(env: Env, kind: str) -> None:
    payloads = _KIND_PAYLOADS[kind]
    perms = build.default_permissions(kind)
    signed = signed_for(payloads, kind=kind, required_permissions=perms)
    path = env.bundle(payloads=payloads, signed=signed)
    policy = Policy("motor-drive", "0.1.0", frozenset(perms))
    assert env.verify(path, policy=policy).kind == kind


# -- container ------------------------------------------------------------------------------


def test_one_byte_flipped_in_a_payload(env: Env) -> None:
    bad = bytearray(TFLITE)
    bad[1000] ^= 0x01
    path = env.bundle(tar_members=members(tflite=bytes(bad)))
    refused(env, path, PayloadMismatch, "'model.tflite'", "sha256")


def test_bytes_appended_after_the_archive(env: Env) -> None:
    path = env.bundle()
    with path.open("ab") as f:
        f.write(b"\0" * 512 + b"evil")
    refused(env, path, MalformedBundle, "after the end-of-archive")


def test_zero_padding_after_the_archive_is_fine(env: Env) -> None:
    path = env.bundle()
    with path.open("ab") as f:
        f.write(b"\0" * 4096)
    env.verify(path)


def _offsets(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (header offset, data offset), read with Python's tarfile."""
    with tarfile.open(path, format=tarfile.USTAR_FORMAT) as tar:
        return {m.name: (m.offset, m.offset_data) for m in tar.getmembers()}


def test_truncated_inside_a_header(env: Env) -> None:
    path = env.bundle()
    header, _ = _offsets(path)["model.json"]
    os.truncate(path, header + 100)
    refused(env, path, MalformedBundle, "member 2", "truncated")


def test_truncated_inside_a_payload(env: Env) -> None:
    path = env.bundle()
    _, data = _offsets(path)["model.tflite"]
    os.truncate(path, data + 10)
    refused(env, path, MalformedBundle, "member 1 'model.tflite'", "truncated")


def test_truncated_before_the_end_of_archive(env: Env) -> None:
    path = env.bundle()
    _, data = _offsets(path)["model.json"]
    os.truncate(path, data + 512)
    refused(env, path, MalformedBundle, "no end-of-archive")


def test_oversized_manifest_is_refused(env: Env) -> None:
    manifest = build.sign_envelope(signed_for(members()), [env.keys.a])
    padded = manifest + b" " * (MAX_MANIFEST_BYTES + 1 - len(manifest))
    path = env.bundle(manifest=padded)
    refused(env, path, MalformedBundle, f"{MAX_MANIFEST_BYTES + 1} bytes", "limit")


def test_oversized_manifest_is_refused_without_reading_it(env: Env) -> None:
    path = env.bundle()
    with path.open("rb") as f:
        reader = BundleReader(f, path.stat().st_size)
        assert env.root is not None
        with pytest.raises(MalformedBundle, match=r"manifest\.json: \d+ bytes; the limit is 100"):
            read_manifest(reader, env.root, NOW, max_bytes=100)
        assert f.tell() == 512  # the header only: not one byte of the manifest was read


def test_smaller_manifest_cap_in_the_policy(env: Env) -> None:
    policy = Policy("motor-drive", "0.1.0", frozenset({"model:swap"}), max_manifest_bytes=256)
    refused(env, env.bundle(), MalformedBundle, "the limit is 256", policy=policy)


def test_bundle_over_the_size_cap(env: Env) -> None:
    policy = Policy("motor-drive", "0.1.0", frozenset({"model:swap"}), max_bundle_bytes=4096)
    refused(env, env.bundle(), MalformedBundle, "b.efb", "the limit is 4096", policy=policy)


def test_payload_longer_than_declared(env: Env) -> None:
    path = env.bundle(tar_members=members(tflite=TFLITE + b"tail"))
    refused(
        env,
        path,
        PayloadMismatch,
        "'model.tflite'",
        f"{len(TFLITE) + 4} bytes in the bundle",
        f"declares {len(TFLITE)}",
    )


def test_payload_shorter_than_declared(env: Env) -> None:
    path = env.bundle(tar_members=members(tflite=TFLITE[:-1]))
    refused(env, path, PayloadMismatch, f"{len(TFLITE) - 1} bytes", f"declares {len(TFLITE)}")


def test_missing_member(env: Env) -> None:
    path = env.bundle(tar_members=members()[:1])
    refused(env, path, MalformedBundle, "'model.json' is missing")


def test_extra_member(env: Env) -> None:
    path = env.bundle(tar_members=[*members(), ("notes.txt", b"hi")])
    refused(env, path, MalformedBundle, "member 3 'notes.txt'", "extra member")


@pytest.mark.parametrize(
    ("order", "where"),
    [
        (["model.tflite", "model.tflite", "model.json"], "member 2 'model.tflite'"),
        (["model.tflite", "model.json", "model.json"], "member 3 'model.json'"),
        (["model.tflite", "model.json", "manifest.json"], "member 3 'manifest.json'"),
    ],
)
def test_duplicate_member(env: Env, order: list[str], where: str) -> None:
    data = dict(members()) | {"manifest.json": b"{}"}
    path = env.bundle(tar_members=[(n, data[n]) for n in order])
    refused(env, path, MalformedBundle, where, "duplicate")


def test_out_of_order_members(env: Env) -> None:
    path = env.bundle(tar_members=list(reversed(members())))
    refused(env, path, MalformedBundle, "member 1 is 'model.json'", "out of order")


def test_manifest_not_the_first_member(env: Env, tmp_path: Path) -> None:
    manifest = build.sign_envelope(signed_for(members()), [env.keys.a])
    path = env.cs.incoming / "b.efb"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in [*members(), ("manifest.json", manifest)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    refused(
        env,
        path,
        MalformedBundle,
        "not an EdgeFleet bundle (.efb): a tar whose first member is 'model.tflite', "
        "not manifest.json",
    )


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "an empty file"),
        (bytes(range(256)) * 8, "no tar header at its start"),
        (random.Random(7).randbytes(4096), "no tar header at its start"),
        (b"hello", "5 bytes"),
        (bytes(10240), "an empty tar (no member)"),
        (b"PK\x03\x04" + bytes(1020), "it is a zip archive"),
        (gzip.compress(b"x" * 2048, mtime=0), "it is gzip-compressed"),
    ],
)
def test_garbage_and_empty_files(env: Env, content: bytes, why: str) -> None:
    path = env.cs.incoming / "b.efb"
    path.write_bytes(content)
    err = refused(env, path, MalformedBundle, f"not an EdgeFleet bundle (.efb): {why}")
    assert "octal" not in str(err)
    assert "checksum" not in str(err)


@pytest.mark.timeout(10)
def test_a_fifo_is_refused_without_waiting_for_a_writer(env: Env) -> None:
    path = env.cs.incoming / "b.efb"
    os.mkfifo(path)
    refused(env, path, MalformedBundle, "b.efb: not a regular file")


def test_a_directory_is_refused(env: Env) -> None:
    path = env.cs.incoming / "b.efb"
    path.mkdir()
    refused(env, path, MalformedBundle, "b.efb: not a regular file")


def test_missing_file(env: Env) -> None:
    refused(env, env.cs.incoming / "nope.efb", MalformedBundle, "nope.efb", "cannot read")


def _raw_bundle(env: Env, evil: tarfile.TarInfo, data: bytes = b"") -> Path:
    """The signed manifest, then ``evil`` written as is by Python's tarfile."""
    manifest = build.sign_envelope(signed_for(members()), [env.keys.a])
    path = env.cs.incoming / "b.efb"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
        if evil.isreg():
            evil.size = len(data)
            tar.addfile(evil, io.BytesIO(data))
        else:
            tar.addfile(evil)
        for name, payload in members():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path


def _info(name: str, kind: bytes = tarfile.REGTYPE, **attrs: Any) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in attrs.items():
        setattr(info, key, value)
    return info


@pytest.mark.parametrize(
    ("info", "why"),
    [
        (_info("../x"), "member 1 name '../x' leaves the bundle folder"),
        (_info("../../etc/passwd"), "leaves the bundle folder"),
        (_info("a/../../x"), "leaves the bundle folder"),
        (_info("/abs"), "member 1 name '/abs' is an absolute path"),
        (_info("models/model.tflite"), "'models/model.tflite' is in a folder"),
        (_info("model.tflite", tarfile.SYMTYPE, linkname="/etc/passwd"), "a symbolic link"),
        (_info("model.tflite", tarfile.LNKTYPE, linkname="manifest.json"), "a hard link"),
        (_info("model.tflite", tarfile.CHRTYPE, devmajor=1, devminor=3), "a character device"),
        (_info("model.tflite", tarfile.BLKTYPE, devmajor=8, devminor=0), "a block device"),
        (_info("model.tflite", tarfile.FIFOTYPE), "a FIFO"),
        (_info("models", tarfile.DIRTYPE), "member 1 'models/': is a directory"),
    ],
    ids=lambda v: v.name if isinstance(v, tarfile.TarInfo) else "",
)
def test_members_that_are_not_plain_files(env: Env, info: tarfile.TarInfo, why: str) -> None:
    refused(env, _raw_bundle(env, info, b"x"), MalformedBundle, why)


def test_gnu_long_name_member(env: Env) -> None:
    refused(env, _raw_bundle(env, _info("x" * 150), b"x"), MalformedBundle, "GNU long name")


def test_a_global_pax_path_is_refused(env: Env) -> None:
    """GNU tar and Python's tarfile name every member after it; so would an operator."""
    manifest = build.sign_envelope(signed_for(members()), [env.keys.a])
    path = env.cs.incoming / "b.efb"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT, pax_headers={"path": "../evil"}) as tar:
        for name, data in [("manifest.json", manifest), *members()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:
        assert tar.getnames() == ["../evil"] * 3
    refused(env, path, MalformedBundle, "global pax header sets path '../evil'")


def _pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


def _block(info: tarfile.TarInfo, data: bytes) -> bytes:
    info.size = len(data)
    return info.tobuf(format=tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512)


def test_two_pax_headers_for_one_member_are_refused(env: Env) -> None:
    """Python's tarfile takes the first path, GNU tar (and a naive reader) the last."""
    manifest = build.sign_envelope(signed_for(members()), [env.keys.a])
    pax = tarfile.TarInfo("PaxHeader")
    pax.type = tarfile.XHDTYPE
    blob = _block(tarfile.TarInfo("manifest.json"), manifest)
    blob += _block(pax, _pax_record("path", "model.tflite"))
    blob += _block(pax, _pax_record("path", "evil.tflite"))
    for name, data in members():
        blob += _block(tarfile.TarInfo(name), data)
    path = env.cs.incoming / "b.efb"
    path.write_bytes(blob + bytes(1024))
    with tarfile.open(path) as tar:
        assert tar.getnames()[1] == "model.tflite"
    refused(env, path, MalformedBundle, "member 1", "a second pax header")


def test_a_pax_path_names_the_member(env: Env) -> None:
    manifest = build.sign_envelope(signed_for(members()), [env.keys.a])
    pax = tarfile.TarInfo("PaxHeader")
    pax.type = tarfile.XHDTYPE
    blob = _block(tarfile.TarInfo("manifest.json"), manifest)
    blob += _block(pax, _pax_record("path", "model.tflite") + _pax_record("mtime", "1.5"))
    blob += _block(tarfile.TarInfo("ignored-raw-name"), TFLITE)
    blob += _block(tarfile.TarInfo("model.json"), MODEL_JSON)
    path = env.cs.incoming / "b.efb"
    path.write_bytes(blob + bytes(1024))
    assert env.verify(path).payloads["model.tflite"] == hashlib.sha256(TFLITE).hexdigest()


def test_a_pax_header_with_other_keys_is_refused(env: Env) -> None:
    manifest = build.sign_envelope(signed_for(members()), [env.keys.a])
    pax = tarfile.TarInfo("PaxHeader")
    pax.type = tarfile.XHDTYPE
    blob = _block(tarfile.TarInfo("manifest.json"), manifest)
    blob += _block(pax, _pax_record("size", "10"))
    for name, data in members():
        blob += _block(tarfile.TarInfo(name), data)
    path = env.cs.incoming / "b.efb"
    path.write_bytes(blob + bytes(1024))
    refused(env, path, MalformedBundle, "member 1 pax header", "key 'size' is not allowed")


def _rewrite_header(path: Path, offset: int, at: int, value: bytes) -> None:
    """Put ``value`` at byte ``at`` of the header at ``offset`` and fix its checksum."""
    with path.open("r+b") as f:
        f.seek(offset)
        block = bytearray(f.read(512))
        block[at : at + len(value)] = value
        block[148:156] = b" " * 8
        block[148:156] = b"%06o\0 " % sum(block)
        f.seek(offset)
        f.write(block)


def test_a_gnu_header_with_a_name_prefix_is_refused(env: Env) -> None:
    manifest = build.sign_envelope(signed_for(members()), [env.keys.a])
    path = env.cs.incoming / "b.efb"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in [("manifest.json", manifest), *members()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    header, _ = _offsets(path)["model.tflite"]
    _rewrite_header(path, header, 345, b"..")
    with tarfile.open(path) as tar:
        assert "../model.tflite" in tar.getnames()  # what Python's tarfile would extract
    refused(env, path, MalformedBundle, "member 1", "name-prefix field", "b'..'")


def test_a_ustar_name_prefix_makes_a_path(env: Env) -> None:
    path = env.bundle()
    header, _ = _offsets(path)["model.json"]
    _rewrite_header(path, header, 345, b"models")
    refused(env, path, MalformedBundle, "'models/model.json'", "plain file names only")


def test_mix_and_match_payload_of_a_with_manifest_of_b(env: Env) -> None:
    other = bytes(reversed(TFLITE))  # same length, other bytes
    a_members = members(tflite=other)
    b_manifest = build.sign_envelope(signed_for(members()), [env.keys.a])
    path = env.bundle(manifest=b_manifest, tar_members=a_members)
    refused(env, path, PayloadMismatch, "'model.tflite'", "sha256 differs")


# -- delta payloads -------------------------------------------------------------------------

NEW_TFLITE = TFLITE[:5000] + b"retrained weights" + TFLITE[5000:]


def _stage_base(env: Env) -> None:
    signed = signed_for(members(), counter=1, version="1.0.0", bundle_id="motor-model-1")
    env.verify(env.bundle("base.efb", signed=signed), floors={})


def _delta_bundle(env: Env, patch_entry: dict[str, Any], patch: bytes) -> Path:
    payloads = [("model.tflite", patch), ("model.json", MODEL_JSON)]
    signed = signed_for(members())
    signed["payloads"][0] = patch_entry
    return env.bundle("delta.efb", signed=signed, payloads=payloads)


def test_delta_payload_applies_and_the_result_is_stored(env: Env) -> None:
    _stage_base(env)
    patch_entry, patch = build.payload_entry("model.tflite", NEW_TFLITE, base=TFLITE)
    vb = env.verify(_delta_bundle(env, patch_entry, patch))
    sha = hashlib.sha256(NEW_TFLITE).hexdigest()
    assert vb.payloads["model.tflite"] == sha
    assert (env.cs.root / sha).read_bytes() == NEW_TFLITE  # a blob: made here, not a range
    assert env.cs.read(sha, max_bytes=1 << 20) == NEW_TFLITE


def test_delta_base_missing(env: Env) -> None:
    patch_entry, patch = build.payload_entry("model.tflite", NEW_TFLITE, base=TFLITE)
    refused(
        env,
        _delta_bundle(env, patch_entry, patch),
        Incompatible,
        "'model.tflite'",
        hashlib.sha256(TFLITE).hexdigest()[:12],
    )


def test_delta_base_missing_is_found_before_any_payload_is_read(env: Env) -> None:
    patch_entry, patch = build.payload_entry("model.tflite", NEW_TFLITE, base=TFLITE)
    path = _delta_bundle(env, patch_entry, patch)
    _, data = _offsets(path)["model.tflite"]
    os.truncate(path, data + 1)  # were the payload read, this would be "truncated"
    refused(env, path, Incompatible, "does not have")


def test_delta_over_the_memory_cap_is_refused_before_reading(env: Env) -> None:
    _stage_base(env)
    patch_entry, patch = build.payload_entry("model.tflite", NEW_TFLITE, base=TFLITE)
    patch_entry["length"] = MAX_DELTA_BYTES + 1
    refused(
        env,
        _delta_bundle(env, patch_entry, patch),
        MalformedBundle,
        "'model.tflite'",
        f"at most {MAX_DELTA_BYTES} bytes",
    )


def test_delta_patch_yields_the_wrong_result(env: Env) -> None:
    _stage_base(env)
    patch_entry, _ = build.payload_entry("model.tflite", NEW_TFLITE, base=TFLITE)
    # A patch made against another base: it applies to ours, but makes other bytes.
    other_base = bytearray(TFLITE)
    other_base[100] ^= 0x55
    wrong = bsdiff4.diff(bytes(other_base), NEW_TFLITE)
    patch_entry["patch"] = {"length": len(wrong), "sha256": hashlib.sha256(wrong).hexdigest()}
    refused(env, _delta_bundle(env, patch_entry, wrong), PayloadMismatch, "'model.tflite'", "patch")


def test_delta_patch_declaring_another_size(env: Env) -> None:
    _stage_base(env)
    patch_entry, patch = build.payload_entry("model.tflite", NEW_TFLITE, base=TFLITE)
    patch_entry["length"] += 1
    refused(
        env,
        _delta_bundle(env, patch_entry, patch),
        PayloadMismatch,
        f"makes {len(NEW_TFLITE)} bytes",
        f"declares {len(NEW_TFLITE) + 1}",
    )


def test_delta_patch_that_is_not_bsdiff(env: Env) -> None:
    _stage_base(env)
    patch_entry, _ = build.payload_entry("model.tflite", NEW_TFLITE, base=TFLITE)
    junk = b"BSDIFF40" + bytes(100)
    patch_entry["patch"] = {"length": len(junk), "sha256": hashlib.sha256(junk).hexdigest()}
    refused(env, _delta_bundle(env, patch_entry, junk), PayloadMismatch, "'model.tflite'")


def test_delta_patch_bytes_damaged(env: Env) -> None:
    _stage_base(env)
    patch_entry, patch = build.payload_entry("model.tflite", NEW_TFLITE, base=TFLITE)
    damaged = bytearray(patch)
    damaged[-1] ^= 0xFF
    signed = signed_for(members())
    signed["payloads"][0] = patch_entry
    path = env.bundle(
        "delta.efb",
        signed=signed,
        payloads=[("model.tflite", patch), ("model.json", MODEL_JSON)],
        tar_members=[("model.tflite", bytes(damaged)), ("model.json", MODEL_JSON)],
    )
    refused(env, path, PayloadMismatch, "'model.tflite'", "sha256 differs")


def test_delta_from_without_patch_is_malformed(env: Env) -> None:
    signed = signed_for(members())
    signed["payloads"][0]["delta_from"] = hashlib.sha256(b"base").hexdigest()
    refused(env, env.bundle(signed=signed), MalformedBundle, "payloads[0]", "go together")


# -- the store after staging ----------------------------------------------------------------


def test_store_read_refuses_a_payload_damaged_at_rest(env: Env) -> None:
    vb = env.verify(env.bundle())
    sha = vb.payloads["model.tflite"]
    ref = json.loads((env.cs.root / f"{sha}.ref").read_bytes())
    with vb.path.open("r+b") as f:
        f.seek(ref["offset"] + 7)
        byte = f.read(1)
        f.seek(ref["offset"] + 7)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(StorageError, match=f"payload {sha[:12]} is damaged on disk"):
        env.cs.read(sha, max_bytes=1 << 20)
    dest = env.cs.root.parent / "model.tflite"
    with pytest.raises(StorageError, match="damaged"):
        env.cs.copy_to(sha, dest)
    assert not dest.exists()
    assert not list(dest.parent.glob(".tmp-*"))
    # The other payload of the same bundle is intact and still readable.
    assert env.cs.read(vb.payloads["model.json"], max_bytes=1 << 20) == MODEL_JSON


def test_store_read_refuses_a_damaged_delta_result(env: Env) -> None:
    _stage_base(env)
    patch_entry, patch = build.payload_entry("model.tflite", NEW_TFLITE, base=TFLITE)
    sha = env.verify(_delta_bundle(env, patch_entry, patch)).payloads["model.tflite"]
    blob = env.cs.root / sha
    blob.write_bytes(NEW_TFLITE[:-1])
    with pytest.raises(StorageError, match="damaged on disk"):
        env.cs.read(sha, max_bytes=1 << 20)


def test_store_read_cap_and_absent(env: Env) -> None:
    vb = env.verify(env.bundle())
    with pytest.raises(StorageError, match="cap 10"):
        env.cs.read(vb.payloads["model.tflite"], max_bytes=10)
    with pytest.raises(StorageError, match="not on this device"):
        env.cs.read("0" * 64, max_bytes=10)


def _installed(vb: VerifiedBundle) -> Installed:
    m = vb.signed
    return Installed(
        m.bundle_id, m.kind, m.version, m.counter, vb.manifest_sha256, dict(vb.payloads)
    )


def test_gc_keeps_what_is_in_use(env: Env) -> None:
    old_signed = signed_for(members(), counter=1, version="1.0.0", bundle_id="m1")
    old = env.verify(env.bundle("old.efb", signed=old_signed), floors={})
    new_payloads = members(tflite=NEW_TFLITE)
    new = env.verify(env.bundle("new.efb", payloads=new_payloads), floors={"model": 1})
    stray = env.cs.incoming / "left-over.efb"
    stray.write_bytes(b"x")
    partial = env.cs.incoming / "next.efb.part"
    partial.write_bytes(b"x")

    journal = Journal(active={"model": _installed(new)})
    removed = env.cs.gc(journal.payloads_in_use())
    assert removed == [old.payloads["model.tflite"]]  # model.json is shared by both
    assert not old.path.exists()
    assert new.path.exists()
    assert env.cs.read(new.payloads["model.tflite"], max_bytes=1 << 20) == NEW_TFLITE
    assert env.cs.read(new.payloads["model.json"], max_bytes=1 << 20) == MODEL_JSON
    assert not stray.exists()
    assert not partial.exists()  # no update in flight: a .part left over is stale

    # A kept version (for rollback) keeps its bundle too.
    again = env.verify(env.bundle("old.efb", signed=old_signed), floors={})
    kept = Journal(active={"model": _installed(new)}, kept={"model": (_installed(again),)})
    assert env.cs.gc(kept.payloads_in_use()) == []
    assert again.path.exists()
    assert env.cs.read(again.payloads["model.tflite"], max_bytes=1 << 20) == TFLITE


def test_gc_keeps_only_the_part_of_the_update_in_flight(env: Env) -> None:
    mine = env.cs.incoming / "offer-mine.efb.part"
    stale = env.cs.incoming / "offer-abandoned.efb.part"
    mine.write_bytes(b"x" * 10)
    stale.write_bytes(b"y" * 10)
    env.cs.gc(set(), in_flight=[mine.name])
    assert mine.read_bytes() == b"x" * 10
    assert not stale.exists()


# -- made with the openssl and tar command lines --------------------------------------------


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(args, cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.mark.parametrize("tar_format", ["ustar", "gnu", "posix"])
def test_bundle_signed_with_openssl_and_packed_with_tar(
    env: Env, tmp_path: Path, k: Keys, tar_format: str
) -> None:
    work = tmp_path / "admin"
    work.mkdir()
    _run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "k.pem"], work)
    _run(["openssl", "pkey", "-in", "k.pem", "-pubout", "-out", "pub.pem"], work)
    der = _run(["openssl", "pkey", "-pubin", "-in", "pub.pem", "-outform", "DER"], work).stdout
    keyid = hashlib.sha256(der).hexdigest()
    public = serialization.load_pem_public_key((work / "pub.pem").read_bytes())
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert keys.keyid(public) == keyid

    root_doc = build.sign_envelope(
        build.root_signed(
            version=1,
            expires=NOW + timedelta(days=365),
            root_keys=[k.root.public_key()],
            bundle_keys=[public],
        ),
        [k.root],
    )
    env.root = trust.load_root(root_doc, NOW)

    for name, data in members():
        (work / name).write_bytes(data)
    signed = signed_for(members())
    body = json.dumps(signed, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    (work / "signed.json").write_bytes(body)
    _run(["openssl", "dgst", "-sha256", "-sign", "k.pem", "-out", "sig.der", "signed.json"], work)
    sig = base64.b64encode((work / "sig.der").read_bytes()).decode()
    manifest = {"signed": signed, "signatures": [{"keyid": keyid, "sig": sig}]}
    (work / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    out = env.cs.incoming / "b.efb"
    _run(
        ["tar", f"--format={tar_format}", "-cf", str(out), "manifest.json", *dict(members())],
        work,
    )

    vb = env.verify(out)
    assert vb.signed.bundle_id == "motor-model-2"
    assert env.cs.read(vb.payloads["model.tflite"], max_bytes=1 << 20) == TFLITE


def test_openssl_signature_over_other_bytes_is_refused(env: Env, tmp_path: Path) -> None:
    """Signing the pretty-printed JSON instead of the canonical form does not verify."""
    work = tmp_path / "admin"
    work.mkdir()
    (work / "k.pem").write_bytes(keys.private_pem(env.keys.a))
    signed = signed_for(members())
    (work / "signed.json").write_text(json.dumps(signed, indent=2))
    _run(["openssl", "dgst", "-sha256", "-sign", "k.pem", "-out", "sig.der", "signed.json"], work)
    doc = manifest_doc(signed, [entry(kid(env.keys.a), (work / "sig.der").read_bytes())])
    refused(env, env.bundle(manifest=doc), SignatureInvalid, "does not verify")


def test_the_same_manifest_packed_another_way_stages_correctly(env: Env, tmp_path: Path) -> None:
    """Offsets are the layout's: a second packing of one manifest must not reuse the first
    file's name with its own offsets."""
    first = env.verify(env.bundle("ustar.efb"))
    tflite, model_json = first.payloads["model.tflite"], first.payloads["model.json"]
    # Only model.json stays in use (say another version shares it): the first file stays,
    # model.tflite's index goes.
    env.cs.gc({model_json})
    assert first.path.exists()
    assert not env.cs.has(tflite)

    manifest = build.sign_envelope(signed_for(members()), [env.keys.a])
    work = tmp_path / "repack"
    work.mkdir()
    (work / "manifest.json").write_bytes(manifest)
    for name, data in members():
        (work / name).write_bytes(data)
    out = env.cs.incoming / "posix.efb"
    _run(["tar", "--format=posix", "-cf", str(out), "manifest.json", *dict(members())], work)
    second = env.verify(out)
    assert second.manifest_sha256 == first.manifest_sha256
    assert second.path != first.path
    assert env.cs.read(tflite, max_bytes=1 << 20) == TFLITE
    assert env.cs.read(model_json, max_bytes=1 << 20) == MODEL_JSON


def test_the_same_bundle_twice_is_kept_once(env: Env) -> None:
    path = env.bundle()
    a = env.verify(path, keep_source=True)
    b = env.verify(path, keep_source=True)
    assert a.path == b.path
    assert [p.name for p in env.cs.bundles.iterdir()] == [a.path.name]
