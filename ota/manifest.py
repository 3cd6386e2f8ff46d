"""The signed part of a bundle's ``manifest.json``, as a typed, checked value.

DESIGN.md section 5 fixes the fields and their JSON types; this module adds the limits a
device needs before it trusts a number (lengths, counts, seconds). Unknown fields are
allowed and ignored: they are signed, so a newer fleet may add some without breaking old
agents. Only :mod:`ota.verify` calls :func:`parse_signed`, after the signature checked out.

A delta payload (``delta_from``) also names its patch: ``patch = {"length", "sha256"}`` of
the member bytes in the bundle, so the patch is checked before bsdiff parses it; the
payload's own ``length`` and ``sha256`` are those of the result.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from ota.efb import name_problem
from ota.errors import MalformedBundle
from ota.timefmt import parse_utc

Kind = Literal["model", "config", "agent"]
KINDS: tuple[Kind, ...] = ("model", "config", "agent")
#: The permission a bundle of each kind needs, whatever its ``required_permissions`` say:
#: the signed list may add permissions, never drop this one.
KIND_PERMISSION: dict[str, str] = {
    "model": "model:swap",
    "config": "config:write",
    "agent": "agent:replace",
}

#: Per payload and in total; an agent wheel with its dependencies stays far below.
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024
MAX_PAYLOADS = 64
MAX_PROBATION_S = 3600
#: A probation's length when the bundle does not set one. At the default perception (a
#: 64-step window every 64 steps at 100 Hz: 1.56 windows/s) it scores ~31 windows: the
#: :data:`DEFAULT_MIN_WINDOWS` with margin for a loaded gateway, and the 20 the latency
#: regression rule needs (:data:`ota.probation.REGRESSION_MIN_WINDOWS`).
DEFAULT_PROBATION_S = 20
#: Windows the new version must score before a probation can pass, unless the bundle says.
DEFAULT_MIN_WINDOWS = 10

Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$")]
#: A payload name is a tar member name: one path component, no leading dot.
MemberName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,99}$")]
Length = Annotated[int, msgspec.Meta(ge=0, le=MAX_PAYLOAD_BYTES)]
SemVer = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
        r"(-[0-9A-Za-z.\-]{1,64})?(\+[0-9A-Za-z.\-]{1,64})?$"
    ),
]
Stamp = Annotated[str, msgspec.Meta(pattern=r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")]


class Patch(msgspec.Struct, frozen=True):
    length: Length
    sha256: Sha256


class Payload(msgspec.Struct, frozen=True):
    name: MemberName
    length: Length
    sha256: Sha256
    delta_from: Sha256 | None = None
    patch: Patch | None = None

    @property
    def member_length(self) -> int:
        """The bytes of this payload's tar member: the patch for a delta, else the file."""
        return self.patch.length if self.patch is not None else self.length

    @property
    def member_sha256(self) -> str:
        return self.patch.sha256 if self.patch is not None else self.sha256


class Compat(msgspec.Struct, frozen=True):
    device_types: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=256)]
    agent: Annotated[str, msgspec.Meta(max_length=256)] = ""


class Probation(msgspec.Struct, frozen=True):
    """How long the new version is watched, and the limits it must keep meanwhile."""

    seconds: Annotated[int, msgspec.Meta(ge=0, le=MAX_PROBATION_S)] = DEFAULT_PROBATION_S
    #: Reasoning-stage P99 over the probation, µs (0: only the +regression_pct rule).
    p99_us: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] = 0
    #: Allowed P99 growth against the same device's pre-update baseline, percent.
    regression_pct: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 15
    #: Allowed resident-memory growth against the pre-update baseline, percent.
    memory_pct: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 10
    #: Windows the new version must score before a pass is possible (no signal = failure).
    min_windows: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = DEFAULT_MIN_WINDOWS


class Signed(msgspec.Struct, frozen=True):
    bundle_id: Name
    kind: Kind
    version: SemVer
    counter: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    expires: Stamp
    compat: Compat
    required_permissions: Annotated[list[Name], msgspec.Meta(max_length=64)]
    payloads: Annotated[list[Payload], msgspec.Meta(min_length=1, max_length=MAX_PAYLOADS)]
    probation: Probation = Probation()
    description: Annotated[str, msgspec.Meta(max_length=1024)] = ""

    @property
    def expires_at(self) -> datetime:
        when = parse_utc(self.expires)
        assert when is not None  # the Stamp pattern and parse_signed made sure
        return when

    @property
    def agent_range(self) -> SpecifierSet:
        return SpecifierSet(self.compat.agent)

    def payload(self, name: str) -> Payload:
        for p in self.payloads:
            if p.name == name:
                return p
        raise KeyError(name)


#: The payloads of each kind (DESIGN.md section 5; names are what the device looks for):
#: these and nothing else, so no signed byte is carried that a device would ignore. An
#: ``agent`` bundle carries exactly one wheel instead (:data:`_WHEEL`).
KIND_PAYLOADS: dict[str, tuple[str, ...]] = {
    "model": ("model.tflite", "model.json"),
    "config": ("agent.toml",),
    "agent": (),
}
_WHEEL = re.compile(r"^[A-Za-z0-9_.]+-[A-Za-z0-9_.!+]+(-[A-Za-z0-9_.]+){3}\.whl$")


_PAYLOAD_NAME_AT = re.compile(r"signed\.payloads\[(\d+)\]\.name")
_MEMBER_NAME_RULE = (
    "expected a plain file name (letters, digits, '.', '_', '-'; starting with a letter or "
    "digit; at most 100 characters)"
)


def _check_payload_names(signed: dict[str, Any]) -> None:
    """A payload name that is a path is refused in words, before the schema's pattern."""
    payloads = signed.get("payloads")
    if not isinstance(payloads, list):
        return
    for i, p in enumerate(payloads):
        name = p.get("name") if isinstance(p, dict) else None
        why = name_problem(name) if isinstance(name, str) else ""
        if why:
            raise MalformedBundle(f"manifest: signed.payloads[{i}].name {name!r} {why}")


def parse_signed(signed: dict[str, Any]) -> Signed:
    """Check ``signed`` field by field; :class:`MalformedBundle` names the first fault."""
    _check_payload_names(signed)
    try:
        m = msgspec.convert(signed, Signed, strict=True)
    except msgspec.ValidationError as exc:
        reason, _, where = str(exc).partition(" - at `")
        path = where.rstrip("`").replace("$", "signed", 1) if where else "signed"
        at = _PAYLOAD_NAME_AT.fullmatch(path)
        if at and "regex" in reason:
            name = signed["payloads"][int(at.group(1))]["name"]
            reason = f"{name!r}: {_MEMBER_NAME_RULE}"
        raise MalformedBundle(f"manifest: {path}: {reason}") from None
    if parse_utc(m.expires) is None:
        raise MalformedBundle(f"manifest: signed.expires: not a real instant: {m.expires!r}")
    try:
        SpecifierSet(m.compat.agent)
    except InvalidSpecifier:
        raise MalformedBundle(
            f"manifest: signed.compat.agent: not a PEP 440 version range: {m.compat.agent!r}"
        ) from None
    names = [p.name for p in m.payloads]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise MalformedBundle(f"manifest: signed.payloads: duplicate name(s) {dupes}")
    if "manifest.json" in names:
        raise MalformedBundle("manifest: signed.payloads: 'manifest.json' is the manifest")
    for i, p in enumerate(m.payloads):
        if (p.delta_from is None) != (p.patch is None):
            raise MalformedBundle(
                f"manifest: signed.payloads[{i}]: delta_from and patch go together"
            )
    total = sum(p.member_length for p in m.payloads)
    if total > MAX_PAYLOAD_BYTES:
        raise MalformedBundle(
            f"manifest: payloads total {total} bytes; at most {MAX_PAYLOAD_BYTES}"
        )
    _check_kind_payloads(m.kind, names)
    return m


def _check_kind_payloads(kind: str, names: list[str]) -> None:
    if kind == "agent":
        if len(names) != 1 or not _WHEEL.match(names[0]):
            raise MalformedBundle(
                f"manifest: an agent bundle carries exactly one wheel (*.whl) and nothing "
                f"else; it lists {names}"
            )
        return
    wanted = KIND_PAYLOADS[kind]
    missing = [n for n in wanted if n not in names]
    if missing:
        raise MalformedBundle(f"manifest: a {kind} bundle needs payload(s) {missing}")
    extra = [n for n in names if n not in wanted]
    if extra:
        raise MalformedBundle(
            f"manifest: a {kind} bundle carries {' and '.join(wanted)} only; {extra} "
            "would be ignored by devices"
        )
