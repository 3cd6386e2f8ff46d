"""Strict JSON in, canonical bytes out: the two ends of every signature.

What is signed is ``canonical(signed)``, exactly DESIGN.md section 5's form, so a manifest
made with ``python -c 'json.dumps(...)'`` and signed with ``openssl dgst -sha256 -sign``
verifies here. Parsing is strict because the signed bytes are recomputed from what we
parsed: a duplicate key (the last wins in ``json``, the first in some other parsers) or a
float (its text form is not stable across languages) would let two readers see different
documents behind one signature.
"""

from __future__ import annotations

import json
from typing import Any

from ota.errors import MalformedBundle

#: Nesting deeper than this is refused before Python's recursion limit is near.
MAX_DEPTH = 16
#: No field we sign needs more (a counter is < 2**63: 19 digits). Python refuses to parse
#: an integer of more than 4300 digits with a bare ValueError; we refuse long before.
MAX_INT_DIGITS = 64


class _Refuse(ValueError):
    pass


def _no_floats(text: str) -> float:
    raise _Refuse(f"a number with a fraction or exponent ({text}) is not allowed")


def _no_constants(text: str) -> float:
    raise _Refuse(f"{text} is not allowed")


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refuse(f"an integer of {digits} digits is not allowed (at most {MAX_INT_DIGITS})")
    return int(text)


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refuse(f"duplicate key {key!r}")
        out[key] = value
    return out


def _utf8(text: str) -> None:
    # JSON's \uXXXX escapes can name a lone surrogate, which is no character: the canonical
    # bytes (UTF-8) of a document holding one cannot be made, so it cannot be signed.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _Refuse(
            f"string {text[:40]!r} holds a lone surrogate (\\u{ord(text[exc.start]):04x})"
        ) from None


def _check(value: object, level: int = 0) -> None:
    """Depth and strings of a parsed document: what ``json`` itself lets through."""
    if level > MAX_DEPTH:
        raise _Refuse(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        _utf8(value)
    elif isinstance(value, dict):
        for key, v in value.items():
            _utf8(key)
            _check(v, level + 1)
    elif isinstance(value, list):
        for v in value:
            _check(v, level + 1)


def loads_strict(data: bytes, *, what: str, max_bytes: int) -> dict[str, Any]:
    """Parse ``data`` as one JSON object: UTF-8, no duplicate keys, no floats, no NaN, no
    lone surrogates, integers of at most :data:`MAX_INT_DIGITS` digits.

    The size is checked before any parsing. Raises :class:`MalformedBundle` naming ``what``.
    """
    if len(data) > max_bytes:
        raise MalformedBundle(f"{what}: {len(data)} bytes; the limit is {max_bytes}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedBundle(f"{what}: not UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(
            text,
            object_pairs_hook=_pairs,
            parse_float=_no_floats,
            parse_constant=_no_constants,
            parse_int=_int,
        )
        _check(value)
    except _Refuse as exc:
        raise MalformedBundle(f"{what}: {exc}") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise MalformedBundle(f"{what}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise MalformedBundle(f"{what}: expected a JSON object; got {type(value).__name__}")
    return value


def canonical(signed: object) -> bytes:
    """The bytes a signature covers (DESIGN.md section 5)."""
    return json.dumps(signed, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
