"""How fast the devices a bundle is for score windows, for ``fleet bundle build``.

DESIGN.md section 5: a bundle's probation must be able to score its minimum number of
windows at the window rate of the device it targets, or it is refused up front. A device
checks this itself before staging (:func:`ota.probation.unreachable`); the fleet checks it
at build time when it knows the rate: given as windows per second, read from a target's
agent config (its ``[perception]`` grid rate and hop), or, for a config bundle, from the
config it carries (which may not change ``[perception]``).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.errors import BundleError


@dataclass(frozen=True)
class Target:
    """A window rate and where it came from (said in every message about it)."""

    windows_per_s: float
    source: str


def from_rate(windows_per_s: float) -> Target:
    """``--window-rate``: windows per second, as the devices' status reports them."""
    if not math.isfinite(windows_per_s) or windows_per_s <= 0:
        raise BundleError(f"--window-rate: expected windows per second > 0; got {windows_per_s}")
    return Target(windows_per_s, "--window-rate")


def from_config_file(path: Path) -> Target:
    """``--target-config``: the ``[perception]`` of an agent config (nothing else is read,
    so a device's config with its own paths works on the fleet's machine)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BundleError(
            f"{path}: cannot read: {exc.strerror}", missing=isinstance(exc, FileNotFoundError)
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BundleError(f"{path}: not UTF-8 (byte {exc.start})") from None
    return from_config_text(text, str(path))


def from_config_text(text: str, source: str) -> Target:
    """The window rate of the agent config ``text`` (``source`` names it in errors)."""
    # The agent's own schema, so defaults and limits are the device's; imported here
    # because it is heavy (pydantic models of every section) and only these options need it.
    from pydantic import ValidationError  # noqa: PLC0415

    from edge_agent.config import PerceptionSection  # noqa: PLC0415
    from edge_agent.perception import PerceptionSpec  # noqa: PLC0415

    try:
        raw: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BundleError(f"{source}: not valid TOML: {exc}") from None
    table = raw.get("perception")
    if not isinstance(table, dict):
        raise BundleError(f"{source}: no [perception] table: its window rate is unknown")
    try:
        per = PerceptionSection.model_validate(table)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in ("perception", *first["loc"]))
        raise BundleError(f"{source}: {where}: {first['msg']}") from None
    hop = per.hop if per.hop is not None else per.window
    try:
        spec = PerceptionSpec(
            signals=tuple(per.signals), rate_hz=per.rate_hz, window=per.window, hop=hop
        )
    except ValueError as exc:
        raise BundleError(f"{source}: perception: {exc}") from None
    rate = f"{spec.rate_hz:g} Hz, hop {spec.hop}"
    return Target(spec.windows_per_s, f"{source}: {rate}")
