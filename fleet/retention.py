"""How long the fleet keeps its history, and what is due to go. Pure: a spec and ``now`` in,
cut-off times out; the store deletes (:meth:`fleet.store.base.Store.expire`), ``fleet
serve --retention`` and ``fleet history expire`` drive it.

A spec is ``KIND=AGE`` pairs, comma-separated: ``telemetry=30d,decisions=180d``. Kinds:
``telemetry``, ``decisions``, ``ota`` (the devices' OTA status reports), ``quarantine``
(refused messages, by when they came) and ``minutes`` (the per-signal minute rollups the
console charts long ranges from). Ages: a whole number of days (``d``) or hours (``h``).
A kind left out is kept for ever. What a cut removes, ``fleet gaps`` no longer reports as
missing (see docs/ARCHITECTURE.md, "History and retention").
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from fleet.errors import RetentionError

if TYPE_CHECKING:
    from fleet.store import Store

_NS = 1_000_000_000
#: The spec's kind -> what the store expires.
KINDS = {
    "telemetry": "telemetry",
    "decisions": "decision",
    "ota": "ota/status",
    "quarantine": "quarantine",
    "minutes": "minutes",
}
_AGE = re.compile(r"([1-9][0-9]{0,5})([dh])")
_UNIT_S = {"d": 86_400, "h": 3_600}


def parse_retention(spec: str) -> dict[str, int]:
    """``"telemetry=30d,decisions=180d"`` -> ``{"telemetry": 2592000, ...}`` (seconds, by
    the store's kind names: :data:`KINDS`). ``""``: keep everything. Raises
    ``RetentionError`` naming the part that is wrong."""
    keep: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, sep, age = part.partition("=")
        name = name.strip()
        if not sep:
            raise RetentionError(f"--retention {part!r}: expected KIND=AGE, e.g. telemetry=30d")
        if name not in KINDS:
            raise RetentionError(
                f"--retention {part!r}: unknown kind {name!r}; expected one of " + ", ".join(KINDS)
            )
        m = _AGE.fullmatch(age.strip())
        if m is None:
            raise RetentionError(
                f"--retention {part!r}: age {age.strip()!r}: expected whole days or hours, "
                "e.g. 30d or 12h"
            )
        kind = KINDS[name]
        if kind in keep:
            raise RetentionError(f"--retention: {name} is given twice")
        keep[kind] = int(m.group(1)) * _UNIT_S[m.group(2)]
    return keep


def cutoffs(keep: Mapping[str, int], now_ns: int) -> dict[str, int]:
    """Per store kind: what is older than this (UNIX ns) goes."""
    return {kind: now_ns - seconds * _NS for kind, seconds in keep.items()}


def describe(keep: Mapping[str, int]) -> str:
    """One line for the log: what is kept how long."""
    if not keep:
        return "history kept for ever (no --retention)"
    names = {v: k for k, v in KINDS.items()}
    return "history kept: " + ", ".join(
        f"{names[k]} {s // 86_400} d" if s % 86_400 == 0 else f"{names[k]} {s // 3_600} h"
        for k, s in sorted(keep.items(), key=lambda kv: names[kv[0]])
    )


#: Rows deleted per transaction: short enough not to hold the ingest's writes up.
BATCH = 5_000


def apply_retention(
    store: Store,
    keep: Mapping[str, int],
    now_ns: int,
    *,
    batch: int = BATCH,
    stop: threading.Event | None = None,
) -> dict[str, int]:
    """Delete what ``keep`` says is due, kind by kind, ``batch`` rows per transaction,
    until nothing is left or ``stop`` is set; rows deleted per kind. Raises
    ``FleetStoreError`` (what went before stays gone; the next run goes on)."""
    gone: dict[str, int] = {}
    for kind, before in cutoffs(keep, now_ns).items():
        gone[kind] = 0
        while stop is None or not stop.is_set():
            n = store.expire(kind, before, batch)
            gone[kind] += n
            if n < batch:
                break
    return gone
