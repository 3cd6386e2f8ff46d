"""The rollout planner: which devices, in which wave. Pure: devices in, waves out.

Devices are picked by a selector (``site=a,device_type=b,group=c``; every key must match,
a value may list alternatives with ``|``). Each device has a **tier**: ``canary`` devices go
first, ``critical`` devices only in the last wave, the rest (``normal``) in between. Waves
are cumulative percentages of the selected devices (``1%,10%,50%,100%``): wave ``k`` brings
the total to ``ceil(pct_k * N)``, at least one new device per wave while any are left, and
never a critical device before the last wave. Within a tier the order is a hash of the
rollout id and the device name: stable across restarts, different per rollout, so the same
devices are not always first.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fleet.errors import PlanError

TIERS = ("canary", "normal", "critical")
SELECTOR_KEYS = ("site", "device_type", "group", "tier", "device")
_NAME = re.compile(r"^[A-Za-z0-9_.:\-*]{1,128}$")


@dataclass(frozen=True)
class Candidate:
    device: str
    site: str
    device_type: str
    group: str = ""
    tier: str = "normal"


def parse_selector(text: str) -> dict[str, tuple[str, ...]]:
    """``site=a,device_type=b|c`` -> ``{"site": ("a",), "device_type": ("b", "c")}``."""
    out: dict[str, tuple[str, ...]] = {}
    if not text.strip():
        return out
    for i, part in enumerate(text.split(",")):
        where = f"--select item {i + 1} {part.strip()!r}"
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or key not in SELECTOR_KEYS:
            raise PlanError(
                f"{where}: expected KEY=VALUE with KEY one of {', '.join(SELECTOR_KEYS)}"
            )
        values = tuple(v.strip() for v in value.split("|"))
        bad = [v for v in values if not _NAME.match(v)]
        if bad:
            raise PlanError(
                f"{where}: {key} value {bad[0]!r} is not a name (1-128 of A-Z a-z 0-9 _ . : - *)"
            )
        if key in out:
            raise PlanError(f"{where}: {key} given twice")
        out[key] = values
    return out


def _matches(c: Candidate, selector: Mapping[str, Sequence[str]]) -> bool:
    for key, values in selector.items():
        have = getattr(c, key)
        if not any(v in ("*", have) for v in values):
            return False
    return True


def parse_waves(text: str) -> tuple[float, ...]:
    """``1%,10%,50%,100%`` -> (0.01, 0.1, 0.5, 1.0); increasing, the last 100 %."""
    waves: list[float] = []
    for i, part in enumerate(text.split(",")):
        p = part.strip().removesuffix("%")
        try:
            value = float(p) / 100
        except ValueError:
            raise PlanError(
                f"--waves item {i + 1} {part.strip()!r}: expected a percentage"
            ) from None
        if not 0 < value <= 1 or (waves and value <= waves[-1]):
            raise PlanError(
                f"--waves item {i + 1} {part.strip()!r}: percentages must rise within (0, 100]"
            )
        waves.append(value)
    if not waves or waves[-1] != 1.0:
        raise PlanError("--waves: the last wave must be 100%")
    return tuple(waves)


def parse_fraction(text: str, *, what: str) -> float:
    try:
        value = float(text.strip().removesuffix("%")) / 100
    except ValueError:
        raise PlanError(f"{what}: expected a percentage such as 5%; got {text!r}") from None
    if not 0 <= value <= 1:
        raise PlanError(f"{what}: expected 0%..100%; got {text!r}")
    return value


def _order_key(rollout_id: str, c: Candidate) -> tuple[int, str]:
    h = hashlib.sha256(f"{rollout_id}/{c.device}".encode()).hexdigest()
    return TIERS.index(c.tier), h


def _ceil_share(pct: float, n: int) -> int:
    """``ceil(pct * n)`` for a percentage written in decimal: ``0.07 * 100`` is
    ``7.000000000000001`` in floats, which ``math.ceil`` turns into 8 devices, not 7."""
    return math.ceil(round(pct * n, 9))


def plan(
    rollout_id: str,
    candidates: Iterable[Candidate],
    selector: Mapping[str, Sequence[str]],
    waves: Sequence[float],
) -> list[list[str]]:
    """Device names per wave (each device in exactly one wave; empty waves are dropped).

    Raises :class:`PlanError` for a selected device with a tier outside :data:`TIERS` (a
    mistyped ``Critical`` must not ride in the first wave as a normal device) or a device
    name given twice.
    """
    selected = [c for c in candidates if _matches(c, selector)]
    seen: set[str] = set()
    for c in selected:
        if c.tier not in TIERS:
            raise PlanError(f"device {c.device}: tier {c.tier!r} is not one of {', '.join(TIERS)}")
        if c.device in seen:
            raise PlanError(f"device {c.device}: listed twice among the candidates")
        seen.add(c.device)
    chosen = sorted(selected, key=lambda c: _order_key(rollout_id, c))
    n = len(chosen)
    if n == 0:
        return []
    non_critical = sum(c.tier != "critical" for c in chosen)
    out: list[list[str]] = []
    taken = 0
    for k, pct in enumerate(waves):
        last = k == len(waves) - 1
        target = n if last else min(max(_ceil_share(pct, n), taken + 1), non_critical)
        if target > taken:
            out.append([c.device for c in chosen[taken:target]])
            taken = target
    return out
