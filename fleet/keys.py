"""The fleet's signing keys and the ``root.json`` devices trust (DESIGN.md section 5).

The formats are ``ota``'s: keys, key ids and signatures come from :mod:`ota.keys`, the root
document from :func:`ota.build.root_signed`, and every root written here has first been
accepted by the device's own code (:func:`ota.trust.load_root`, :func:`ota.trust.rotate`),
so the fleet cannot publish a root its devices would refuse.

A keys folder and how its files are written: :class:`KeySet`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from fleet.errors import FleetError, FleetKeyError
from ota import build as ota_build
from ota import keys as ota_keys
from ota import trust as ota_trust
from ota.errors import TrustError
from ota.fsutil import fsync_dir, write_all
from ota.timefmt import format_utc

ENV_PASSPHRASE = "FLEET_KEY_PASSPHRASE"  # noqa: S105 - a variable name, not a secret
ROOT_JSON = "root.json"
REVOKED_DIR = "revoked"
ROLE_FILE_PREFIX = {"root": "root", "bundles": "bundle"}
_ENCRYPTED_PEM = b"-----BEGIN ENCRYPTED PRIVATE KEY-----"
#: A key id prefix shorter than this could match by accident.
MIN_KEYID_PREFIX = 8


# --- files -------------------------------------------------------------------------------


def write_file(
    path: Path,
    data: bytes,
    *,
    mode: int,
    exclusive: bool,
    error: type[FleetError] = FleetKeyError,
) -> None:
    """Write ``path`` durably: a crash leaves the old file or the whole new one.

    The temp file is created with ``mode`` and ``O_EXCL`` (a key is never readable by
    others, not even for an instant). ``exclusive`` takes the final name with ``link``,
    which fails if it exists, so nothing is overwritten; otherwise ``os.replace``.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # the umask may have narrowed it; the mode is the contract
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise error(f"{path}: already exists; refusing to overwrite it") from None
            tmp.unlink()
        else:
            os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise error(f"{path}: cannot write: {exc.strerror}") from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _move(src: Path, dest_dir: Path) -> Path:
    """Rename ``src`` into ``dest_dir`` durably (both folders synced)."""
    try:
        dest_dir.mkdir(mode=0o700, exist_ok=True)
        dest = dest_dir / src.name
        if dest.exists():
            raise FleetKeyError(f"{dest}: already exists; not moving {src} over it")
        os.replace(src, dest)
        fsync_dir(dest_dir)
        fsync_dir(src.parent)
    except OSError as exc:
        raise FleetKeyError(f"{src}: cannot move to {dest_dir}: {exc.strerror}") from None
    return dest


def read_passphrase(file: Path | None, environ: Mapping[str, str]) -> bytes | None:
    """The passphrase from ``file`` (one line) or else from :data:`ENV_PASSPHRASE`.
    Raises ``FleetKeyError``."""
    if file is not None:
        try:
            # One trailing newline is the editor's, not the passphrase's.
            secret = file.read_bytes().removesuffix(b"\n").removesuffix(b"\r")
        except OSError as exc:
            raise FleetKeyError(
                f"{file}: cannot read the passphrase file: {exc.strerror}",
                missing=isinstance(exc, FileNotFoundError),
            ) from None
        if not secret:
            raise FleetKeyError(f"{file}: the passphrase file is empty")
        return secret
    value = environ.get(ENV_PASSPHRASE, "")
    return value.encode() if value else None


def key_file_name(role: str, keyid: str) -> str:
    """``root-<keyid16>.pem`` or ``bundle-<keyid16>.pem``."""
    return f"{ROLE_FILE_PREFIX[role]}-{keyid[:16]}.pem"


def is_encrypted(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(_ENCRYPTED_PEM)) == _ENCRYPTED_PEM
    except OSError:
        return False


def load_key(path: Path, passphrase: bytes | None) -> ec.EllipticCurvePrivateKey:
    """The P-256 private key at ``path``; the passphrase is used only if it is encrypted.
    Raises ``FleetKeyError``."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FleetKeyError(
            f"{path}: cannot read the key: {exc.strerror}",
            missing=isinstance(exc, FileNotFoundError),
        ) from None
    encrypted = data.lstrip().startswith(_ENCRYPTED_PEM)
    if encrypted and not passphrase:
        raise FleetKeyError(
            f"{path}: the key is encrypted; give its passphrase in {ENV_PASSPHRASE} "
            "or with --passphrase-file"
        )
    try:
        return ota_keys.load_private_pem(data, passphrase if encrypted else None)
    except TrustError:
        # Without the cause: cryptography's message may quote the file's bytes.
        detail = " (or a wrong passphrase)" if encrypted else ""
        raise FleetKeyError(f"{path}: not a usable ECDSA P-256 private key{detail}") from None


def _write_key(
    folder: Path, role: str, key: ec.EllipticCurvePrivateKey, passphrase: bytes | None
) -> Path:
    path = folder / key_file_name(role, ota_keys.keyid(key.public_key()))
    write_file(path, ota_keys.private_pem(key, passphrase), mode=0o600, exclusive=True)
    return path


def read_root(folder: Path, now: datetime) -> ota_trust.TrustRoot:
    """``folder/root.json``, checked by the device's own loader. Raises ``FleetKeyError``."""
    path = folder / ROOT_JSON
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FleetKeyError(
            f"{path}: cannot read: {exc.strerror}", missing=isinstance(exc, FileNotFoundError)
        ) from None
    try:
        return ota_trust.load_root(data, now)
    except TrustError as exc:
        raise FleetKeyError(f"{path}: {exc}") from None


def check_threshold(role: str, threshold: int, count: int) -> None:
    """A role of ``count`` keys can have ``threshold``; else ``FleetKeyError``."""
    if count < 1:
        raise FleetKeyError(f"the {role} role would have no keys")
    if not 1 <= threshold <= count:
        raise FleetKeyError(
            f"the {role} threshold must be 1..{count} (its number of keys); got {threshold}"
        )


def _role_order(root: ota_trust.TrustRoot, role: str) -> list[str]:
    """The role's key ids in the order root.json lists them (a frozenset has none)."""
    listed = json.loads(root.raw)["signed"]["roles"][role]["keyids"]
    return [k for k in listed if isinstance(k, str)]


# --- init --------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeySet:
    """Layout of a keys folder::

        root-<keyid16>.pem     a root key (0600): signs root.json only; keep it offline
        bundle-<keyid16>.pem   a bundle-signing key (0600)
        root.json              the current root: what ``export-root`` gives to devices
        root.<N>.json          each earlier version, kept when a rotation replaces it
        revoked/               key files a rotation dropped from the root
        replaced-<time>/       a whole key set that ``init --force`` put aside (never deleted)

    Key files are written to a temp file created 0600 with ``O_EXCL`` and then linked to their
    name, which fails if the name exists: a key is never overwritten. Every write is durable
    (fsync, rename or link, fsync of the folder). A passphrase comes from a file or the
    environment variable :data:`ENV_PASSPHRASE`, never from the command line.
    """

    root_json: Path
    root_keys: list[Path]
    bundle_keys: list[Path]
    root: ota_trust.TrustRoot
    #: Where ``--force`` put the previous key set, if there was one.
    replaced: Path | None = None


def _existing(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    names = [ROOT_JSON, REVOKED_DIR]
    found = [folder / n for n in names if (folder / n).exists()]
    found += sorted(folder.glob("root.*.json")) + sorted(folder.glob("*.pem"))
    return found


def init_keys(
    folder: Path,
    *,
    now: datetime,
    root_keys: int = 1,
    root_threshold: int = 1,
    bundle_keys: int = 1,
    bundle_threshold: int = 1,
    expires_days: int = 365,
    passphrase: bytes | None = None,
    force: bool = False,
) -> KeySet:
    """Generate root and bundle keys and ``root.json`` version 1, signed by the root keys.
    Raises ``FleetKeyError``."""
    check_threshold("root", root_threshold, root_keys)
    check_threshold("bundles", bundle_threshold, bundle_keys)
    if root_keys + bundle_keys > ota_trust.MAX_KEYS:
        raise FleetKeyError(f"at most {ota_trust.MAX_KEYS} keys in a root (devices refuse more)")
    if expires_days < 1:
        raise FleetKeyError(f"--expires-days must be at least 1; got {expires_days}")
    old = _existing(folder)
    replaced = None
    if old and not force:
        raise FleetKeyError(
            f"{folder}: already holds a key set ({', '.join(p.name for p in old[:4])}"
            f"{', ...' if len(old) > 4 else ''}); refusing to replace it without --force"
        )
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise FleetKeyError(f"{folder}: cannot create the folder: {exc.strerror}") from None
    if old:
        # Put aside, never deleted: a root key lost to a mistyped --force would strand
        # every device that trusts it.
        replaced = folder / f"replaced-{now:%Y%m%dT%H%M%SZ}"
        if replaced.exists():
            raise FleetKeyError(f"{replaced}: already exists; try again in a second")
        for path in old:
            _move(path, replaced)

    roots = [ota_keys.generate() for _ in range(root_keys)]
    bundles = [ota_keys.generate() for _ in range(bundle_keys)]
    signed = ota_build.root_signed(
        version=1,
        expires=now + timedelta(days=expires_days),
        root_keys=[k.public_key() for k in roots],
        bundle_keys=[k.public_key() for k in bundles],
        root_threshold=root_threshold,
        bundle_threshold=bundle_threshold,
    )
    data = ota_build.sign_envelope(signed, roots)
    try:
        root = ota_trust.load_root(data, now)
    except TrustError as exc:  # our own bug if it happens; never write such a root
        raise FleetKeyError(f"the new root.json does not load on a device: {exc}") from None
    root_paths = [_write_key(folder, "root", k, passphrase) for k in roots]
    bundle_paths = [_write_key(folder, "bundles", k, passphrase) for k in bundles]
    write_file(folder / ROOT_JSON, data, mode=0o644, exclusive=True)
    return KeySet(folder / ROOT_JSON, root_paths, bundle_paths, root, replaced)


# --- rotate ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rotation:
    old_version: int
    new_version: int
    root: ota_trust.TrustRoot
    archived: Path
    added: list[Path]
    revoked: list[str]
    #: Key files of revoked keys, moved to ``revoked/``.
    moved: list[Path]


def resolve_keyid(prefix: str, keyids: Sequence[str]) -> str:
    """The one key id in ``keyids`` that starts with ``prefix`` (at least 8 hex digits).
    Raises ``FleetKeyError`` (none or several match)."""
    p = prefix.strip().lower()
    if len(p) < MIN_KEYID_PREFIX:
        raise FleetKeyError(
            f"key id {prefix!r}: give at least {MIN_KEYID_PREFIX} hex digits (see fleet keys list)"
        )
    matches = [k for k in keyids if k.startswith(p)]
    if not matches:
        raise FleetKeyError(f"key id {prefix!r}: no key of the current root.json has it")
    if len(matches) > 1:
        raise FleetKeyError(f"key id {prefix!r}: matches {len(matches)} keys; give more digits")
    return matches[0]


def _available(
    folder: Path, role: str, keyids: Sequence[str], passphrase: bytes | None
) -> dict[str, ec.EllipticCurvePrivateKey]:
    """The private keys of ``keyids`` whose files are in ``folder`` (a renamed or foreign
    file under a key's name is an error, not a missing key)."""
    found: dict[str, ec.EllipticCurvePrivateKey] = {}
    for kid in keyids:
        path = folder / key_file_name(role, kid)
        if not path.exists():
            continue
        key = load_key(path, passphrase)
        if ota_keys.keyid(key.public_key()) != kid:
            raise FleetKeyError(f"{path}: holds another key than {kid[:16]} (its name says)")
        found[kid] = key
    return found


def rotate_keys(
    folder: Path,
    *,
    now: datetime,
    add_bundle_keys: int = 0,
    new_root_keys: int = 0,
    revoke: Sequence[str] = (),
    root_threshold: int | None = None,
    bundle_threshold: int | None = None,
    expires_days: int = 365,
    passphrase: bytes | None = None,
) -> Rotation:
    """Write ``root.json`` version N+1 by the TUF rule; keep version N as ``root.N.json``.

    The new root is signed by every old root key whose file is here (at least the old
    threshold, else nothing is written) and by the new root keys, and it is accepted by
    :func:`ota.trust.rotate` before a byte is written: what the fleet publishes is what a
    device will take.
    Raises ``FleetKeyError``.
    """
    if expires_days < 1:
        raise FleetKeyError(f"--expires-days must be at least 1; got {expires_days}")
    old = read_root(folder, now)
    revoked = [resolve_keyid(p, sorted(old.keys)) for p in revoke]
    old_root_ids = _role_order(old, "root")
    old_signers = _available(folder, "root", old_root_ids, passphrase)
    old_role = old.roles["root"]
    if len(old_signers) < old_role.threshold:
        missing = [key_file_name("root", k) for k in old_root_ids if k not in old_signers]
        raise FleetKeyError(
            f"{folder}: rotating root.json version {old.version} needs {old_role.threshold} of "
            f"its root keys; only {len(old_signers)} here (missing: {', '.join(missing)}). "
            "Bring the offline root keys here; nothing was written"
        )

    generated_roots = [ota_keys.generate() for _ in range(new_root_keys)]
    generated_bundles = [ota_keys.generate() for _ in range(add_bundle_keys)]
    kept_root_ids = [k for k in old_root_ids if k not in revoked]
    kept_bundle_ids = [k for k in _role_order(old, "bundles") if k not in revoked]
    root_pubs = [old.keys[k].public for k in kept_root_ids]
    root_pubs += [k.public_key() for k in generated_roots]
    bundle_pubs = [old.keys[k].public for k in kept_bundle_ids]
    bundle_pubs += [k.public_key() for k in generated_bundles]
    new_root_threshold = old_role.threshold if root_threshold is None else root_threshold
    new_bundle_threshold = (
        old.roles["bundles"].threshold if bundle_threshold is None else bundle_threshold
    )
    check_threshold("root", new_root_threshold, len(root_pubs))
    check_threshold("bundles", new_bundle_threshold, len(bundle_pubs))

    new_signers = {k: v for k, v in old_signers.items() if k in kept_root_ids}
    new_signers |= {ota_keys.keyid(k.public_key()): k for k in generated_roots}
    if len(new_signers) < new_root_threshold:
        raise FleetKeyError(
            f"{folder}: the new root needs {new_root_threshold} signatures by its own root "
            f"keys; only {len(new_signers)} of them are here; nothing was written"
        )
    key_expires = {
        kid: key.expires
        for kid, key in old.keys.items()
        if key.expires is not None and kid not in revoked
    }
    signed = ota_build.root_signed(
        version=old.version + 1,
        expires=now + timedelta(days=expires_days),
        root_keys=root_pubs,
        bundle_keys=bundle_pubs,
        root_threshold=new_root_threshold,
        bundle_threshold=new_bundle_threshold,
        key_expires=key_expires,
    )
    # One signature per distinct key: old keys sign their successor, new keys accept it.
    signers = list((old_signers | new_signers).values())
    data = ota_build.sign_envelope(signed, signers)
    try:
        new = ota_trust.rotate(old, data, now)
    except TrustError as exc:
        raise FleetKeyError(
            f"the new root.json would be refused by devices ({exc}); nothing was written"
        ) from None

    added = [_write_key(folder, "root", k, passphrase) for k in generated_roots]
    added += [_write_key(folder, "bundles", k, passphrase) for k in generated_bundles]
    archived = folder / f"root.{old.version}.json"
    if not (archived.exists() and archived.read_bytes() == old.raw):
        write_file(archived, old.raw, mode=0o644, exclusive=True)
    write_file(folder / ROOT_JSON, data, mode=0o644, exclusive=False)
    moved = []
    for kid in revoked:
        for role in ("root", "bundles"):
            path = folder / key_file_name(role, kid)
            if path.exists():
                moved.append(_move(path, folder / REVOKED_DIR))
    return Rotation(old.version, new.version, new, archived, added, revoked, moved)


# --- reading a key set -------------------------------------------------------------------


def export_root(folder: Path, now: datetime) -> bytes:
    """The exact bytes of the current root.json, after the device's loader accepted them."""
    return read_root(folder, now).raw


def bundle_signers(
    folder: Path, passphrase: bytes | None, now: datetime
) -> tuple[ota_trust.TrustRoot, list[ec.EllipticCurvePrivateKey]]:
    """The root and every bundle key of its ``bundles`` role present and valid in ``folder``.
    Raises ``FleetKeyError``."""
    root = read_root(folder, now)
    role = root.roles["bundles"]
    ids = [k for k in _role_order(root, "bundles") if root.keys[k].valid_at(now)]
    keys = list(_available(folder, "bundles", ids, passphrase).values())
    if not keys:
        wanted = ", ".join(key_file_name("bundles", k) for k in sorted(role.keyids))
        raise FleetKeyError(
            f"{folder}: no usable bundle key of root.json version {root.version} is here "
            f"(expected one of {wanted})",
            missing=True,
        )
    return root, keys


@dataclass(frozen=True)
class KeyInfo:
    keyid: str
    roles: list[str]
    expires: datetime | None
    #: The private key file in the folder, or None (kept elsewhere: offline).
    file: Path | None
    encrypted: bool


@dataclass(frozen=True)
class Listing:
    version: int
    expires: datetime
    expired: bool
    thresholds: dict[str, int]
    keys: list[KeyInfo]
    #: Key files in the folder that the current root does not name.
    stray: list[Path]

    def to_json(self) -> dict[str, object]:
        return {
            "version": self.version,
            "expires": format_utc(self.expires),
            "expired": self.expired,
            "thresholds": self.thresholds,
            "keys": [
                {
                    "keyid": k.keyid,
                    "roles": k.roles,
                    "expires": format_utc(k.expires) if k.expires else None,
                    "file": str(k.file) if k.file else None,
                    "encrypted": k.encrypted,
                }
                for k in self.keys
            ],
            "stray_files": [str(p) for p in self.stray],
        }


def list_keys(folder: Path, now: datetime) -> Listing:
    """The current root's keys: roles, expiry, and which private keys are in ``folder``
    (matched by file name, so an encrypted key needs no passphrase to be listed)."""
    root = read_root(folder, now)
    infos: list[KeyInfo] = []
    named: set[Path] = set()
    for kid in sorted(root.keys):
        roles = [r for r in ota_trust.ROLES if kid in root.roles[r].keyids]
        file = None
        for role in roles:
            path = folder / key_file_name(role, kid)
            if path.exists():
                file = path
                named.add(path)
        infos.append(
            KeyInfo(
                kid,
                roles,
                root.keys[kid].expires,
                file,
                is_encrypted(file) if file else False,
            )
        )
    stray = [p for p in sorted(folder.glob("*.pem")) if p not in named]
    return Listing(
        root.version,
        root.expires,
        root.is_expired(now),
        {r: root.roles[r].threshold for r in ota_trust.ROLES},
        infos,
        stray,
    )
