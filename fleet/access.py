"""Who may do what: roles, API tokens, console passwords and sessions, the audit record.

Pure: secrets are made, hashed and checked here; the store keeps only hashes, and the
clock is passed in. A token is ``eft_<id>_<secret>``: the id (public, shown by
``fleet tokens list``) finds the row, the secret is compared as a sha256 in constant time.
Design: docs/ARCHITECTURE.md, "The fleet API".
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from fleet.errors import AccessError

Role = Literal["viewer", "operator", "admin"]
ROLES: tuple[Role, ...] = ("viewer", "operator", "admin")
_RANK = {role: i for i, role in enumerate(ROLES)}

TOKEN_PREFIX = "eft_"  # noqa: S105 - a format marker, not a secret
_TOKEN = re.compile(r"^eft_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_DURATION = re.compile(r"^(\d{1,6})([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}

#: scrypt cost: ~50 ms and 16 MiB per check on a gateway-class core; a sign-in is rare.
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**14, 8, 1
MIN_PASSWORD = 10
#: A console session lasts this long after sign-in.
SESSION_NS = 12 * 3600 * 1_000_000_000


def check_role(role: str) -> Role:
    """``role`` if it is one of :data:`ROLES`; raises AccessError naming them."""
    for r in ROLES:
        if role == r:
            return r
    raise AccessError(f"role {role!r}: expected one of {', '.join(ROLES)}")


def allows(have: str, need: Role) -> bool:
    """True if role ``have`` may do what ``need`` may (admin > operator > viewer)."""
    return have in _RANK and _RANK[have] >= _RANK[need]


def check_name(name: str, what: str = "name") -> str:
    """A user or token name: 1-64 of letters, digits, ``._@-``; raises AccessError."""
    if not _NAME.match(name):
        raise AccessError(
            f"{what} {name!r}: use 1-64 letters, digits or ._@- (first a letter or digit)"
        )
    return name


def parse_duration_ns(text: str) -> int:
    """``30d``, ``12h``, ``90m``, ``2w``, ``45s`` in nanoseconds; raises AccessError."""
    m = _DURATION.match(text.strip())
    if not m or int(m.group(1)) == 0:
        raise AccessError(
            f"duration {text!r}: expected a positive number and a unit s, m, h, d or w (e.g. 30d)"
        )
    return int(m.group(1)) * _UNIT_S[m.group(2)] * 1_000_000_000


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class NewToken:
    """A token just made: ``text`` is shown once; the store keeps the id and the hash."""

    token_id: str
    text: str
    secret_hash: str


def new_token() -> NewToken:
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return NewToken(token_id, f"{TOKEN_PREFIX}{token_id}_{secret}", _sha256(secret))


def split_token(text: str) -> tuple[str, str] | None:
    """``(token_id, secret)`` of a well-formed token, else None."""
    m = _TOKEN.match(text)
    return (m.group(1), m.group(2)) if m else None


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(_sha256(secret), stored_hash)


def secret_matches_plain(given: str, expected: str) -> bool:
    """Constant-time equality of two secrets held in the clear (a CSRF token)."""
    return hmac.compare_digest(given.encode(), expected.encode())


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    """An scrypt hash, ``scrypt$N$r$p$salt$hash`` (base64); raises AccessError if too short."""
    if len(password) < MIN_PASSWORD:
        raise AccessError(f"password: at least {MIN_PASSWORD} characters")
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(
        password.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32
    )
    b64 = base64.urlsafe_b64encode
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${b64(salt).decode()}${b64(digest).decode()}"


def password_matches(password: str, stored: str) -> bool:
    """True if ``password`` hashes to ``stored``; False for a malformed stored hash."""
    try:
        kind, n, r, p, salt, digest = stored.split("$")
        if kind != "scrypt":
            return False
        got = hashlib.scrypt(
            password.encode(),
            salt=base64.urlsafe_b64decode(salt),
            n=int(n),
            r=int(r),
            p=int(p),
            dklen=32,
        )
        return hmac.compare_digest(got, base64.urlsafe_b64decode(digest))
    except (ValueError, TypeError):
        return False


@dataclass(frozen=True, slots=True)
class NewSession:
    """A console session: the cookie value (shown to the browser once) and its CSRF token."""

    cookie: str
    secret_hash: str
    csrf: str
    expires_ns: int


def new_session(now_ns: int) -> NewSession:
    cookie = secrets.token_urlsafe(32)
    return NewSession(cookie, _sha256(cookie), secrets.token_urlsafe(24), now_ns + SESSION_NS)


def session_hash(cookie: str) -> str:
    return _sha256(cookie)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is asking: a user (console) or a token (``token:NAME``), with a role."""

    name: str
    role: Role
    #: How they came in, as the audit log says it: ``api`` (a token), ``console`` or ``cli``.
    via: str
    #: The session's CSRF token (console only): every change must echo it.
    csrf: str = ""


@dataclass(frozen=True, slots=True)
class UserInfo:
    name: str
    role: str
    created_ns: int
    disabled: bool


@dataclass(frozen=True, slots=True)
class TokenInfo:
    token_id: str
    name: str
    role: str
    created_ns: int
    created_by: str
    expires_ns: int | None
    revoked_ns: int | None
    last_used_ns: int | None

    def usable(self, now_ns: int) -> bool:
        return self.revoked_ns is None and (self.expires_ns is None or now_ns < self.expires_ns)


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One change: who, via what (api, console, cli), from where, what, on what, the result
    (``ok`` or the one-line error)."""

    t_ns: int
    actor: str
    via: str
    remote: str
    action: str
    target: str
    result: str
    detail: dict[str, Any] = field(default_factory=dict)
    id: int = 0


__all__ = [
    "MIN_PASSWORD",
    "ROLES",
    "SESSION_NS",
    "AuditEntry",
    "NewSession",
    "NewToken",
    "Principal",
    "Role",
    "TokenInfo",
    "UserInfo",
    "allows",
    "check_name",
    "check_role",
    "hash_password",
    "new_session",
    "new_token",
    "parse_duration_ns",
    "password_matches",
    "secret_matches",
    "secret_matches_plain",
    "session_hash",
    "split_token",
]
