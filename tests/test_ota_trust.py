"""The trust root: loading root.json, its checks, and rotation by the TUF rule."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from ota import build, keys, trust
from ota.errors import TrustError

NOW = datetime(2026, 12, 3, 12, 0, 0, tzinfo=UTC)
YEAR = timedelta(days=365)

PrivateKey = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class Keys:
    r1: PrivateKey
    r2: PrivateKey
    r3: PrivateKey
    b: PrivateKey


@pytest.fixture(scope="module")
def k() -> Keys:
    return Keys(*(keys.generate() for _ in range(4)))


def kid(key: PrivateKey) -> str:
    return keys.keyid(key.public_key())


def root_signed(
    root_keys: Sequence[PrivateKey],
    bundle_keys: Sequence[PrivateKey],
    *,
    version: int = 1,
    threshold: int = 1,
    expires: datetime = NOW + YEAR,
    key_expires: dict[str, datetime] | None = None,
) -> dict[str, Any]:
    return build.root_signed(
        version=version,
        expires=expires,
        root_keys=[r.public_key() for r in root_keys],
        bundle_keys=[b.public_key() for b in bundle_keys],
        root_threshold=threshold,
        key_expires=key_expires,
    )


def doc(signed: dict[str, Any], signers: Sequence[PrivateKey]) -> bytes:
    return build.sign_envelope(signed, signers)


def refused(data: bytes, *fragments: str, old: trust.TrustRoot | None = None) -> TrustError:
    def attempt() -> trust.TrustRoot:
        return trust.load_root(data, NOW) if old is None else trust.rotate(old, data, NOW)

    with pytest.raises(TrustError) as info:
        attempt()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    return info.value


# -- loading --------------------------------------------------------------------------------


def test_load_root(k: Keys) -> None:
    data = doc(root_signed([k.r1], [k.b]), [k.r1])
    root = trust.load_root(data, NOW)
    assert root.version == 1
    assert root.expires == (NOW + YEAR).replace(microsecond=0)
    assert root.roles["root"].keyids == {kid(k.r1)}
    assert root.roles["bundles"].keyids == {kid(k.b)}
    assert root.roles["bundles"].threshold == 1
    assert root.raw == data
    assert not root.is_expired(NOW)
    root.require_current(NOW)


def test_an_expired_root_loads_but_is_not_current(k: Keys) -> None:
    root = trust.load_root(doc(root_signed([k.r1], [k.b], expires=NOW), [k.r1]), NOW)
    assert root.is_expired(NOW)
    with pytest.raises(TrustError, match="trust root version 1 expired at"):
        root.require_current(NOW)


def test_a_root_byte_flipped_inside_signed(k: Keys) -> None:
    data = doc(root_signed([k.r1], [k.b]), [k.r1])
    assert data.count(b'"version": 1') == 1
    bad = data.replace(b'"version": 1', b'"version": 2')
    refused(bad, "0 valid root signature(s)", "signatures[0]", "does not verify")


def test_a_root_signed_by_a_bundle_key(k: Keys) -> None:
    refused(doc(root_signed([k.r1], [k.b]), [k.b]), "not a root key of this root")


def test_a_root_signed_by_a_key_it_does_not_list(k: Keys) -> None:
    refused(doc(root_signed([k.r1], [k.b]), [k.r2]), kid(k.r2)[:16], "not a root key")


def test_a_root_whose_root_key_expired_still_loads(k: Keys) -> None:
    # The self-signature is an integrity check; an expired root key must not make the
    # device refuse bundles signed by bundle keys that are still valid.
    signed = root_signed([k.r1], [k.b], key_expires={kid(k.r1): NOW - YEAR})
    root = trust.load_root(doc(signed, [k.r1]), NOW)
    assert root.keys[kid(k.r1)].expires == (NOW - YEAR).replace(microsecond=0)
    assert not root.keys[kid(k.r1)].valid_at(NOW)
    assert root.keys[kid(k.b)].valid_at(NOW)


def test_root_threshold_two_counts_a_key_once(k: Keys) -> None:
    signed = root_signed([k.r1, k.r2], [k.b], threshold=2)
    refused(doc(signed, [k.r1, k.r1]), "1 valid root signature(s)", "threshold is 2", "once")
    assert trust.load_root(doc(signed, [k.r2, k.r1]), NOW).roles["root"].threshold == 2


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda s: s.update(_type="bundle"), "signed._type: expected 'root'"),
        (lambda s: s.update(version=0), "signed.version: expected an integer >= 1"),
        (lambda s: s.update(version=True), "signed.version"),
        (lambda s: s.update(expires="2027-01-01"), "signed.expires: expected YYYY-MM-DDTHH:MM:SSZ"),
        (lambda s: s.update(keys={}), "signed.keys: expected an object of 1..32 keys"),
        (lambda s: s["roles"].pop("bundles"), "signed.roles.bundles: missing"),
        (lambda s: s["roles"]["root"].update(threshold=0), "roles.root.threshold: expected 1..1"),
        (lambda s: s["roles"]["root"].update(threshold=2), "roles.root.threshold: expected 1..1"),
        (lambda s: s["roles"]["bundles"].update(keyids=["ab" * 32]), "unknown key id(s)"),
        (lambda s: s["roles"]["bundles"].update(keyids="x"), "expected a list of key ids"),
    ],
)
def test_root_schema_faults_name_the_field(k: Keys, mutate: Any, why: str) -> None:
    signed = root_signed([k.r1], [k.b])
    mutate(signed)
    refused(doc(signed, [k.r1]), "root.json", why)


def test_root_duplicate_role_keyids_do_not_raise_the_threshold(k: Keys) -> None:
    signed = root_signed([k.r1], [k.b])
    signed["roles"]["root"] = {"keyids": [kid(k.r1), kid(k.r1)], "threshold": 2}
    refused(doc(signed, [k.r1]), "roles.root.threshold: expected 1..1 (distinct keys)")


def test_root_key_id_must_be_the_keys_sha256(k: Keys) -> None:
    signed = root_signed([k.r1], [k.b])
    entry = signed["keys"].pop(kid(k.b))
    signed["keys"][kid(k.r2)] = entry
    signed["roles"]["bundles"]["keyids"] = [kid(k.r2)]
    refused(doc(signed, [k.r1]), "the key id is not the sha256 of the key's DER")


def test_root_key_of_another_curve(k: Keys) -> None:
    p384 = ec.generate_private_key(ec.SECP384R1())
    signed = root_signed([k.r1], [k.b])
    bid = kid(k.b)
    signed["keys"][bid]["public"] = keys.public_pem(p384.public_key())
    refused(doc(signed, [k.r1]), "expected an ECDSA P-256 key; got ECDSA on secp384r1")


def test_root_key_with_another_scheme(k: Keys) -> None:
    signed = root_signed([k.r1], [k.b])
    signed["keys"][kid(k.b)]["scheme"] = "rsassa-pss-sha256"
    refused(doc(signed, [k.r1]), f"keys.{kid(k.b)[:16]}", "scheme 'ecdsa-sha2-nistp256'")


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "not valid JSON"),
        (b"[]", "expected a JSON object"),
        (b'{"signed": {"version": 1.0}, "signatures": []}', "1.0"),
        (b'{"signed": {}, "signed": {}, "signatures": []}', "duplicate key 'signed'"),
        (b'{"signed": {"v": ' + b"9" * 5000 + b"}}", "5000 digits"),
        (b'{"signed": {}, "signatures": []}', "unsigned"),
        (b'{"signed": {}, "signatures": [], "extra": 1}', "unexpected key(s) ['extra']"),
        (b" " * (trust.MAX_ROOT_BYTES + 1), "the limit is"),
    ],
)
def test_root_json_syntax(data: bytes, why: str) -> None:
    refused(data, "root.json", why)


def test_root_json_with_unsigned_extra_is_refused(k: Keys) -> None:
    """The signatures cover ``signed`` only; anything next to it is refused, not ignored."""
    data = json.loads(doc(root_signed([k.r1], [k.b]), [k.r1]))
    data["note"] = "hello"
    refused(json.dumps(data).encode(), "unexpected key(s) ['note']")


# -- rotation -------------------------------------------------------------------------------


@pytest.fixture
def v1(k: Keys) -> trust.TrustRoot:
    return trust.load_root(doc(root_signed([k.r1], [k.b]), [k.r1]), NOW)


def test_rotation_to_new_root_keys(k: Keys, v1: trust.TrustRoot) -> None:
    data = doc(root_signed([k.r2], [k.b], version=2), [k.r1, k.r2])
    v2 = trust.rotate(v1, data, NOW)
    assert v2.version == 2
    assert v2.roles["root"].keyids == {kid(k.r2)}
    assert v2.raw == data
    # And on: v3 needs v2's key, no longer v1's.
    v3 = trust.rotate(v2, doc(root_signed([k.r3], [k.b], version=3), [k.r2, k.r3]), NOW)
    assert v3.version == 3
    refused(
        doc(root_signed([k.r1], [k.b], version=4), [k.r1]),
        "signed by 0 of the old root's root keys",
        kid(k.r1)[:16],
        old=v3,
    )


@pytest.mark.parametrize("version", [1, 3, 0])
def test_rotation_version_not_one_higher(k: Keys, v1: trust.TrustRoot, version: int) -> None:
    data = doc(root_signed([k.r1], [k.b], version=max(version, 1)), [k.r1])
    if version == 0:
        data = data.replace(b'"version": 1', b'"version": 0')
        refused(data, "version: expected an integer >= 1", old=v1)
    else:
        refused(data, f"version {version}; expected exactly 2", old=v1)


def test_rotation_not_signed_by_the_old_roots_threshold(k: Keys, v1: trust.TrustRoot) -> None:
    data = doc(root_signed([k.r2], [k.b], version=2), [k.r2])
    refused(data, "signed by 0 of the old root's root keys; its threshold is 1", old=v1)


def test_rotation_old_threshold_two_needs_two_old_keys(k: Keys) -> None:
    old = trust.load_root(doc(root_signed([k.r1, k.r2], [k.b], threshold=2), [k.r1, k.r2]), NOW)
    new = root_signed([k.r1, k.r2], [k.b], version=2, threshold=1)
    refused(
        doc(new, [k.r1]), "signed by 1 of the old root's root keys; its threshold is 2", old=old
    )
    refused(doc(new, [k.r1, k.r1]), "counted once", old=old)
    assert trust.rotate(old, doc(new, [k.r1, k.r2]), NOW).version == 2


def test_rotation_not_signed_by_the_new_roots_own_threshold(k: Keys, v1: trust.TrustRoot) -> None:
    data = doc(root_signed([k.r2], [k.b], version=2), [k.r1])
    refused(data, "signed by 0 of the new root's root keys; its threshold is 1", old=v1)


def test_rotation_new_own_threshold_two(k: Keys, v1: trust.TrustRoot) -> None:
    new = root_signed([k.r1, k.r2], [k.b], version=2, threshold=2)
    refused(doc(new, [k.r1]), "signed by 1 of the new root's root keys; its threshold is 2", old=v1)
    assert trust.rotate(v1, doc(new, [k.r1, k.r2]), NOW).version == 2


def test_rotation_to_an_expired_root(k: Keys, v1: trust.TrustRoot) -> None:
    data = doc(root_signed([k.r1], [k.b], version=2, expires=NOW - timedelta(seconds=1)), [k.r1])
    refused(data, "new root.json: expired at", old=v1)


def test_an_expired_root_can_still_be_replaced(k: Keys) -> None:
    old = trust.load_root(doc(root_signed([k.r1], [k.b], expires=NOW - YEAR), [k.r1]), NOW)
    new = trust.rotate(old, doc(root_signed([k.r1], [k.b], version=2), [k.r1]), NOW)
    new.require_current(NOW)


def test_rotation_garbage_is_a_trust_error(v1: trust.TrustRoot) -> None:
    refused(b"\x00garbage", "root.json", old=v1)


def test_rotation_can_revoke_a_bundle_key(k: Keys, v1: trust.TrustRoot) -> None:
    v2 = trust.rotate(v1, doc(root_signed([k.r1], [k.r3], version=2), [k.r1]), NOW)
    assert kid(k.b) not in v2.roles["bundles"].keyids
    assert kid(k.b) not in v2.keys
