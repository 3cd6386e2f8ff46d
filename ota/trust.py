"""The trust root (``root.json``): who may sign roots and bundles, how many must agree.

A key may carry its own ``expires`` (an extension of DESIGN's form): past it, its
signatures no longer count. A key is revoked by a new root that drops it from a role.

Rotation follows TUF: the new root's version is exactly one higher and it is signed by a
threshold of the *old* root's root keys and by a threshold of its *own* root keys; a key
counts once however often it signs. An expired root accepts no bundle (fail closed), but a
newer root may still replace it, since that is how an expired root is repaired.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from ota import keys as _keys
from ota.canonical import canonical, loads_strict
from ota.errors import MalformedBundle, SignatureInvalid, TrustError
from ota.timefmt import parse_utc

#: A root with hundreds of keys is not a root we made.
MAX_ROOT_BYTES = 64 * 1024
MAX_KEYS = 32
MAX_SIGNATURES = 32
ROLES = ("root", "bundles")


@dataclass(frozen=True)
class Key:
    keyid: str
    public: ec.EllipticCurvePublicKey
    expires: datetime | None

    def valid_at(self, now: datetime) -> bool:
        return self.expires is None or now < self.expires


@dataclass(frozen=True)
class Role:
    keyids: frozenset[str]
    threshold: int
    #: ``root`` or ``bundles``, for messages
    name: str = ""


@dataclass(frozen=True)
class TrustRoot:
    """A parsed and self-consistent root. Only :func:`load_root` and :func:`rotate` make one.

    The document is TUF-shaped (DESIGN.md section 5)::

        {"signed": {"_type": "root", "version": 1, "expires": "2027-12-01T00:00:00Z",
                    "keys": {"<keyid>": {"keytype": "ecdsa", "scheme": "ecdsa-sha2-nistp256",
                                         "public": "<PEM>", "expires"?: "<time>"}},
                    "roles": {"root": {"keyids": [...], "threshold": 1},
                              "bundles": {"keyids": [...], "threshold": 1}}},
         "signatures": [{"keyid": "<keyid>", "sig": "<base64 DER>"}]}
    """

    version: int
    expires: datetime
    keys: Mapping[str, Key]
    roles: Mapping[str, Role]
    #: The exact file bytes, kept so a rotated root is persisted as received.
    raw: bytes

    def is_expired(self, now: datetime) -> bool:
        return now >= self.expires

    def require_current(self, now: datetime) -> None:
        if self.is_expired(now):
            raise TrustError(
                f"trust root version {self.version} expired at "
                f"{self.expires:%Y-%m-%dT%H:%M:%SZ}; install a newer root.json"
            )


def signers(
    data: bytes,
    signatures: Iterable[Mapping[str, Any]],
    role: Role,
    keys: Mapping[str, Key],
    now: datetime | None,
    *,
    what: str,
    why: list[str] | None = None,
) -> set[str]:
    """The distinct key ids of ``role`` whose signature over ``data`` verifies at ``now``
    (``None``: whatever the keys' expiry, for an integrity check).

    Signatures by keys outside the role, expired keys or malformed entries do not count;
    they are not errors by themselves (TUF: extra signatures are ignored). ``why``, when
    given, collects one line per signature that did not count, for the caller's error.
    """
    good: set[str] = set()
    lines: list[str] = [] if why is None else why
    for i, entry in enumerate(signatures):
        at = f"signatures[{i}]"
        kid = entry.get("keyid")
        if not isinstance(kid, str):
            lines.append(f"{at}: keyid is not a string")
            continue
        short = kid[:16]
        if kid in good:
            lines.append(f"{at}: key {short} already counted (a key is counted once)")
            continue
        key = keys.get(kid)
        if key is None or kid not in role.keyids:
            lines.append(f"{at}: key {short} is not a {role.name} key of this root")
            continue
        if now is not None and not key.valid_at(now):
            assert key.expires is not None  # valid_at is only false with an expiry
            lines.append(f"{at}: key {short} expired at {key.expires:%Y-%m-%dT%H:%M:%SZ}")
            continue
        try:
            der = _keys.decode_sig(entry.get("sig"), where=f"{at}.sig")
        except SignatureInvalid as exc:
            lines.append(str(exc))
            continue
        if _keys.verifies(key.public, der, data):
            good.add(kid)
        else:
            lines.append(
                f"{at}: key {short}: the signature does not verify "
                f"(over the canonical bytes of {what}'s 'signed')"
            )
    return good


def explain(why: list[str], limit: int = 4) -> str:
    """`` (reason; reason; ...)`` for an error message: why signatures did not count."""
    if not why:
        return ""
    more = f"; and {len(why) - limit} more" if len(why) > limit else ""
    return f" ({'; '.join(why[:limit])}{more})"


def split_envelope(doc: Mapping[str, Any], *, what: str) -> tuple[dict[str, Any], list[Any]]:
    """``signed`` and ``signatures`` of an envelope, shape-checked; nothing else allowed."""
    extra = set(doc) - {"signed", "signatures"}
    if extra:
        raise SignatureInvalid(f"{what}: unexpected key(s) {sorted(extra)}")
    signed = doc.get("signed")
    sigs = doc.get("signatures")
    if not isinstance(signed, dict):
        raise SignatureInvalid(f"{what}.signed: expected an object")
    if not isinstance(sigs, list) or not sigs:
        raise SignatureInvalid(f"{what}.signatures: unsigned (expected a non-empty list)")
    if len(sigs) > MAX_SIGNATURES:
        raise SignatureInvalid(f"{what}.signatures: {len(sigs)} entries; at most {MAX_SIGNATURES}")
    for i, s in enumerate(sigs):
        if not isinstance(s, dict) or set(s) != {"keyid", "sig"}:
            raise SignatureInvalid(f"{what}.signatures[{i}]: expected {{keyid, sig}}")
    return signed, sigs


def _parse_signed(signed: Mapping[str, Any], raw: bytes) -> TrustRoot:
    where = "root.json: signed"
    if signed.get("_type") != "root":
        raise TrustError(f"{where}._type: expected 'root'; got {signed.get('_type')!r}")
    version = signed.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TrustError(f"{where}.version: expected an integer >= 1; got {version!r}")
    expires = parse_utc(signed.get("expires"))
    if expires is None:
        raise TrustError(
            f"{where}.expires: expected YYYY-MM-DDTHH:MM:SSZ; got {signed.get('expires')!r}"
        )
    raw_keys = signed.get("keys")
    if not isinstance(raw_keys, dict) or not raw_keys or len(raw_keys) > MAX_KEYS:
        raise TrustError(f"{where}.keys: expected an object of 1..{MAX_KEYS} keys")
    parsed: dict[str, Key] = {}
    for kid, entry in raw_keys.items():
        kw = f"{where}.keys.{kid[:16]}"
        if not isinstance(entry, dict):
            raise TrustError(f"{kw}: expected an object")
        if entry.get("keytype") != "ecdsa" or entry.get("scheme") != "ecdsa-sha2-nistp256":
            raise TrustError(f"{kw}: expected keytype 'ecdsa', scheme 'ecdsa-sha2-nistp256'")
        pem = entry.get("public")
        if not isinstance(pem, str):
            raise TrustError(f"{kw}.public: expected a PEM string")
        public = _keys.load_public_pem(pem, where=f"{kw}.public")
        if _keys.keyid(public) != kid:
            raise TrustError(f"{kw}: the key id is not the sha256 of the key's DER")
        key_expires = None
        if "expires" in entry:
            key_expires = parse_utc(entry["expires"])
            if key_expires is None:
                raise TrustError(f"{kw}.expires: expected YYYY-MM-DDTHH:MM:SSZ")
        parsed[kid] = Key(kid, public, key_expires)
    raw_roles = signed.get("roles")
    if not isinstance(raw_roles, dict):
        raise TrustError(f"{where}.roles: expected an object")
    roles: dict[str, Role] = {}
    for name in ROLES:
        entry = raw_roles.get(name)
        rw = f"{where}.roles.{name}"
        if not isinstance(entry, dict):
            raise TrustError(f"{rw}: missing")
        kids = entry.get("keyids")
        threshold = entry.get("threshold")
        if not isinstance(kids, list) or not all(isinstance(k, str) for k in kids):
            raise TrustError(f"{rw}.keyids: expected a list of key ids")
        unknown = [k for k in kids if k not in parsed]
        if unknown:
            raise TrustError(f"{rw}.keyids: unknown key id(s) {[k[:16] for k in unknown]}")
        if (
            not isinstance(threshold, int)
            or isinstance(threshold, bool)
            or not 1 <= threshold <= len(set(kids))
        ):
            raise TrustError(
                f"{rw}.threshold: expected 1..{len(set(kids))} (distinct keys); got {threshold!r}"
            )
        roles[name] = Role(frozenset(kids), threshold, name)
    return TrustRoot(version, expires, parsed, roles, raw)


def _parse(data: bytes) -> tuple[TrustRoot, list[Any], bytes]:
    try:
        doc = loads_strict(data, what="root.json", max_bytes=MAX_ROOT_BYTES)
        signed, sigs = split_envelope(doc, what="root.json")
    except (MalformedBundle, SignatureInvalid) as exc:
        raise TrustError(str(exc)) from None
    return _parse_signed(signed, data), sigs, canonical(signed)


def load_root(data: bytes, now: datetime) -> TrustRoot:
    """The root provisioned on the device, checked against its own root keys.

    The first root is trusted because it was installed, not because it signs itself; the
    self-signature still catches a damaged or hand-edited file. Expiry is *not* checked
    here, neither the root's (an expired root must still be replaceable; verification
    checks it) nor its root keys': the self-signature is an integrity check, and a root
    key past its ``expires`` must not make the whole root unloadable, which would refuse
    bundles signed by keys that are still valid. ``now`` is kept for callers' symmetry.
    """
    del now
    root, sigs, body = _parse(data)
    role = root.roles["root"]
    why: list[str] = []
    ok = signers(body, sigs, role, root.keys, None, what="root.json", why=why)
    if len(ok) < role.threshold:
        raise TrustError(
            f"root.json: {len(ok)} valid root signature(s); its threshold is {role.threshold}"
            + explain(why)
        )
    return root


def rotate(old: TrustRoot, data: bytes, now: datetime) -> TrustRoot:
    """Accept ``data`` as the successor of ``old`` by the TUF rule, or raise TrustError."""
    new, sigs, body = _parse(data)
    if new.version != old.version + 1:
        raise TrustError(
            f"new root.json: version {new.version}; expected exactly {old.version + 1}"
        )
    for label, root in (("old", old), ("new", new)):
        role = root.roles["root"]
        why: list[str] = []
        ok = signers(body, sigs, role, root.keys, now, what="new root.json", why=why)
        if len(ok) < role.threshold:
            raise TrustError(
                f"new root.json: signed by {len(ok)} of the {label} root's root keys; "
                f"its threshold is {role.threshold}" + explain(why)
            )
    if new.is_expired(now):
        raise TrustError(f"new root.json: expired at {new.expires:%Y-%m-%dT%H:%M:%SZ}")
    return new
