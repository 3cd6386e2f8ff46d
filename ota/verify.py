"""The gatekeeper: the only code that turns bundle bytes into a :class:`VerifiedBundle`.

Order matters and is fixed (as in python-tuf's trusted metadata set): nothing of the
manifest is believed before its signatures are, and no payload byte is used before the
manifest is (the steps: :func:`verify_bundle`). Every failure is a typed
:class:`~ota.errors.BundleRejected` (the bundle's fault), a :class:`~ota.errors.TrustError`
(the device's root) or a :class:`~ota.errors.StorageError` (its disk), with what and where.

Design: ``docs/ARCHITECTURE.md``, "OTA on the device".
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import bsdiff4
from packaging.version import InvalidVersion, Version

from ota.canonical import canonical, loads_strict
from ota.efb import NOT_A_BUNDLE, BundleReader
from ota.errors import (
    AlreadyInstalled,
    BundleExpired,
    Incompatible,
    MalformedBundle,
    ModelContractUnmet,
    PayloadMismatch,
    PermissionDenied,
    ProbationUnreachable,
    RollbackRejected,
    SignatureInvalid,
    TrustError,
)
from ota.manifest import KIND_PERMISSION, Payload, Signed, parse_signed
from ota.probation import unreachable
from ota.store import ContentStore
from ota.trust import TrustRoot, explain, signers, split_envelope

MAX_MANIFEST_BYTES = 64 * 1024
MAX_BUNDLE_BYTES = 1024 * 1024 * 1024
#: bsdiff4 needs the base, the patch and the result in memory at once.
MAX_DELTA_BYTES = 256 * 1024 * 1024

_TOKEN = object()
#: The payload of a model bundle that holds the model's manifest, and the most of it that
#: is read into memory for ``Policy.model_check`` (a model manifest's own limit).
MODEL_MANIFEST = "model.json"
MAX_MODEL_MANIFEST_BYTES = 1 << 20


@dataclass(frozen=True)
class Policy:
    """What this device is and what it lets bundles do (from its config)."""

    device_type: str
    agent_version: str
    permissions: frozenset[str]
    max_bundle_bytes: int = MAX_BUNDLE_BYTES
    max_manifest_bytes: int = MAX_MANIFEST_BYTES
    #: Windows the device scores per second (perception rate / hop); None: not checked
    #: (``fleet bundle inspect`` without a target rate).
    windows_per_s: float | None = None
    #: For a model bundle, its ``model.json`` (the model manifest, verified bytes) checked
    #: against what this device's config delivers: a reason to refuse it, or "" to accept
    #: it. None: not checked (the agent sets it: ``edge_agent.ota``).
    model_check: Callable[[bytes], str] | None = None


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle whose every check passed, its payloads staged in the content store.

    Only :func:`verify_bundle` makes one (a private token guards the constructor), so any
    code holding a VerifiedBundle holds verified bytes: staging and activation accept
    nothing else.
    """

    signed: Signed
    #: sha256 of the canonical ``signed`` bytes: the bundle's identity.
    manifest_sha256: str
    #: payload name -> sha256 in the content store (a delta's *result*).
    payloads: Mapping[str, str]
    path: Path
    _token: object = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._token is not _TOKEN:
            raise TypeError("only ota.verify.verify_bundle makes a VerifiedBundle")

    @property
    def kind(self) -> str:
        return self.signed.kind

    @property
    def version(self) -> str:
        return self.signed.version


def _check_policy(m: Signed, policy: Policy, floors: Mapping[str, int], now: datetime) -> None:
    if now >= m.expires_at:
        raise BundleExpired(f"bundle {m.bundle_id} {m.version}: expired at {m.expires}")
    if policy.device_type not in m.compat.device_types:
        raise Incompatible(
            f"bundle {m.bundle_id}: for device types {m.compat.device_types}; "
            f"this device is {policy.device_type!r}"
        )
    if m.compat.agent:
        try:
            ok = Version(policy.agent_version) in m.agent_range
        except InvalidVersion:
            ok = False
        if not ok:
            raise Incompatible(
                f"bundle {m.bundle_id}: needs agent {m.compat.agent}; "
                f"this agent is {policy.agent_version}"
            )
    # The kind's own permission is required whatever the signed list says: a bundle that
    # omits it must not install an agent on a device that never granted agent:replace.
    needed = KIND_PERMISSION[m.kind]
    if needed not in policy.permissions:
        raise PermissionDenied(
            f"bundle {m.bundle_id}: kind {m.kind!r} requires {needed!r}, which this "
            f"device's policy does not grant (granted: {sorted(policy.permissions) or 'none'})"
        )
    missing = sorted(set(m.required_permissions) - policy.permissions)
    if missing:
        raise PermissionDenied(
            f"bundle {m.bundle_id}: requires {missing}, which this device's policy does not "
            f"grant (granted: {sorted(policy.permissions) or 'none'})"
        )
    floor = floors.get(m.kind)
    if floor is not None:
        if m.counter < floor:
            raise RollbackRejected(
                f"bundle {m.bundle_id} {m.version}: counter {m.counter} is below the "
                f"committed {m.kind} floor {floor} (downgrade refused)"
            )
        if m.counter == floor:
            raise AlreadyInstalled(
                f"bundle {m.bundle_id} {m.version}: counter {m.counter} is already installed"
            )
    if policy.windows_per_s is not None:
        why = unreachable(m.probation, policy.windows_per_s, where=" on this device")
        if why:
            raise ProbationUnreachable(f"bundle {m.bundle_id}: {why}")


def read_manifest(
    reader: BundleReader, root: TrustRoot, now: datetime, *, max_bytes: int
) -> tuple[Signed, str]:
    """Steps 2-4 up to the policy: the manifest member, its signatures, its schema.
    Raises ``MalformedBundle`` or ``SignatureInvalid``."""
    first = reader.next_member()
    if first is None:
        raise MalformedBundle(f"{NOT_A_BUNDLE}: an empty tar (no member)")
    if first.name != "manifest.json":
        raise MalformedBundle(
            f"{NOT_A_BUNDLE}: a tar whose first member is {first.name!r}, not manifest.json"
        )
    if first.size > max_bytes:
        raise MalformedBundle(f"manifest.json: {first.size} bytes; the limit is {max_bytes}")
    data = b"".join(bytes(c) for c in reader.read(first))
    doc = loads_strict(data, what="manifest.json", max_bytes=max_bytes)
    signed, sigs = split_envelope(doc, what="manifest.json")
    body = canonical(signed)
    role = root.roles["bundles"]
    why: list[str] = []
    ok = signers(body, sigs, role, root.keys, now, what="manifest.json", why=why)
    if len(ok) < role.threshold:
        raise SignatureInvalid(
            f"manifest.json: {len(ok)} valid signature(s) by trusted bundle keys; "
            f"the threshold is {role.threshold}" + explain(why)
        )
    return parse_signed(signed), hashlib.sha256(body).hexdigest()


def verify_bundle(  # noqa: PLR0915 - the checks in the order the security argument needs, in one place to audit
    path: Path,
    *,
    root: TrustRoot | None,
    policy: Policy,
    floors: Mapping[str, int],
    now: datetime,
    store: ContentStore,
    keep_source: bool = False,
) -> VerifiedBundle:
    """Check every byte of the bundle at ``path`` and stage it; see the module docstring.

    ``floors`` maps a kind to its committed anti-rollback counter. ``keep_source`` copies
    the file into the store instead of moving it (a user's file). Runs blocking I/O and
    hashing: call it in a thread from the event loop. Raises ``BundleRejected``
    (``MalformedBundle``, ``PayloadMismatch``, ``ModelContractUnmet``, ...) for the bundle's
    faults, ``TrustError`` for the device's root, ``StorageError`` for its disk.

    Step by step:

    1. a trust root is configured and not expired (no root: every bundle is refused);
    2. the file's size is capped; the first member is ``manifest.json`` and its declared size
       is capped before a byte of it is read;
    3. the manifest is strict JSON; ``signed`` is signed by a threshold of the root's
       ``bundles`` keys over its canonical bytes (a key counts once);
    4. ``signed`` is checked field by field; then expiry, compat (device type, agent version),
       permissions (the device grants the kind's own permission and every listed one),
       anti-rollback (counter above the kind's floor; equal is "already installed"), and that
       the probation can score its minimum of windows at the device's window rate;
    5. the members after the manifest are exactly the listed payloads, in the listed order,
       each with its declared length; each payload's sha256 is computed while streaming;
       then only zero padding may follow;
    6. a delta payload's sizes are capped and its base must be in the store before any
       payload byte is read; its patch is checked like any payload, then applied to the base,
       and the result's length and sha256 are checked before it is kept;
    7. staging: the bundle is kept whole in the content store and its payloads indexed.
    """
    if root is None:
        raise TrustError("no trust root configured: every bundle is refused")
    root.require_current(now)
    try:
        # O_NONBLOCK: opening a FIFO (``ota install`` of the wrong path) must not hang
        # waiting for a writer; on a regular file it changes nothing.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise MalformedBundle(f"{path.name}: cannot read: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise MalformedBundle(f"{path.name}: not a regular file")
    size = st.st_size
    with os.fdopen(fd, "rb") as f:
        if size > policy.max_bundle_bytes:
            raise MalformedBundle(
                f"{path.name}: {size} bytes; the limit is {policy.max_bundle_bytes}"
            )
        if size == 0:
            raise MalformedBundle(f"{path.name}: {NOT_A_BUNDLE}: an empty file")
        reader = BundleReader(f, size)
        m, manifest_sha = read_manifest(reader, root, now, max_bytes=policy.max_manifest_bytes)
        _check_policy(m, policy, floors, now)
        _check_deltas(m, store)

        refs: dict[str, tuple[int, int]] = {}
        patches: dict[str, bytes] = {}
        inspected: bytes | None = None
        seen = {"manifest.json": 0}
        for i, p in enumerate(m.payloads, start=1):
            member = reader.next_member()
            if member is None:
                raise MalformedBundle(
                    f"payload {p.name!r} is missing (the bundle ends at member {i})"
                )
            _not_seen(member.index, member.name, seen)
            if member.name != p.name:
                listed = [q.name for q in m.payloads]
                why = "out of order" if member.name in listed else "not listed in the manifest"
                raise MalformedBundle(f"member {i} is {member.name!r} ({why}); expected {p.name!r}")
            if member.size != p.member_length:
                raise PayloadMismatch(
                    f"payload {p.name!r}: {member.size} bytes in the bundle; "
                    f"the manifest declares {p.member_length}"
                )
            h = hashlib.sha256()
            inspect = m.kind == "model" and p.name == MODEL_MANIFEST and policy.model_check
            if inspect and p.length > MAX_MODEL_MANIFEST_BYTES:
                raise ModelContractUnmet(
                    f"payload {p.name!r}: {p.length} bytes; a model manifest is at most "
                    f"{MAX_MODEL_MANIFEST_BYTES}"
                )
            keep = bytearray() if p.delta_from is not None or inspect else None
            for chunk in reader.read(member):
                h.update(chunk)
                if keep is not None:
                    keep += chunk
            if h.hexdigest() != p.member_sha256:
                raise PayloadMismatch(f"payload {p.name!r}: sha256 differs from the manifest")
            if keep is None:
                refs[p.sha256] = (member.offset, member.size)
            elif p.delta_from is None:
                refs[p.sha256] = (member.offset, member.size)
                inspected = bytes(keep)
            else:
                patches[p.name] = bytes(keep)
        extra = reader.next_member()
        if extra is not None:
            _not_seen(extra.index, extra.name, seen)
            raise MalformedBundle(
                f"member {extra.index} {extra.name!r}: not listed in the manifest (extra member)"
            )

    blobs: dict[str, bytes] = {}
    for p in m.payloads:
        if p.delta_from is None:
            continue
        blobs[p.sha256] = _apply_delta(p.name, p.delta_from, patches[p.name], p, store)
        if p.name == MODEL_MANIFEST:
            inspected = blobs[p.sha256]
    if m.kind == "model" and policy.model_check is not None and inspected is not None:
        why = policy.model_check(inspected)
        if why:
            raise ModelContractUnmet(f"bundle {m.bundle_id} {m.version}: {why}")
    staged = store.stage(path, manifest_sha, refs, blobs, keep_source=keep_source)
    return VerifiedBundle(
        signed=m,
        manifest_sha256=manifest_sha,
        payloads={p.name: p.sha256 for p in m.payloads},
        path=staged,
        _token=_TOKEN,
    )


def _not_seen(index: int, name: str, seen: dict[str, int]) -> None:
    if name in seen:
        raise MalformedBundle(
            f"member {index} {name!r}: duplicate (the same name is member {seen[name]})"
        )
    seen[name] = index


def _check_deltas(m: Signed, store: ContentStore) -> None:
    """Before any payload byte is read: a delta fits in memory and its base is here.

    A patch is kept in memory and patched there, so its size and its result's are capped
    up front; a device without the base would otherwise read the whole bundle for nothing.
    """
    for p in m.payloads:
        if p.delta_from is None:
            continue
        if max(p.length, p.member_length) > MAX_DELTA_BYTES:
            raise MalformedBundle(
                f"payload {p.name!r}: a delta of {p.member_length} bytes making {p.length} "
                f"bytes; a delta is patched in memory, at most {MAX_DELTA_BYTES} bytes"
            )
        if not store.has(p.delta_from):
            raise Incompatible(
                f"payload {p.name!r}: delta against {p.delta_from[:12]}, which this device "
                "does not have"
            )


_BSDIFF_MAGIC = b"BSDIFF40"


def _patch_result_size(patch: bytes) -> int | None:
    """The result size a bsdiff4 patch declares (its header), or None if it has none.

    bsdiff4 allocates that many bytes before it checks anything, so it is compared with
    the manifest before the patch is applied.
    """
    if len(patch) < 32 or patch[:8] != _BSDIFF_MAGIC:
        return None
    raw = int.from_bytes(patch[24:32], "little")
    # bsdiff's offtin: sign and magnitude, the sign in the top bit.
    return -(raw & ~(1 << 63)) if raw >> 63 else raw


def _apply_delta(name: str, base_sha: str, patch: bytes, p: Payload, store: ContentStore) -> bytes:
    size = _patch_result_size(patch)
    if size is None:
        raise PayloadMismatch(f"payload {name!r}: not a bsdiff4 patch (no BSDIFF40 header)")
    if size != p.length:
        raise PayloadMismatch(
            f"payload {name!r}: the patch makes {size} bytes; the manifest declares {p.length}"
        )
    if not store.has(base_sha):
        raise Incompatible(
            f"payload {name!r}: delta against {base_sha[:12]}, which this device does not have"
        )
    base = store.read(base_sha, max_bytes=MAX_DELTA_BYTES)
    try:
        result: bytes = bsdiff4.patch(base, patch)
    # bsdiff4's C code raises ValueError, MemoryError or a bare Exception on a bad patch.
    except Exception as exc:  # noqa: BLE001
        raise PayloadMismatch(f"payload {name!r}: the delta patch does not apply: {exc}") from None
    if len(result) != p.length or hashlib.sha256(result).hexdigest() != p.sha256:
        raise PayloadMismatch(
            f"payload {name!r}: the patched result differs from the manifest's length/sha256"
        )
    return result
