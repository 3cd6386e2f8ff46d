"""MQTT topics: ``edgefleet/v1/{site}/{device}/{kind}``.

``kind`` is ``state`` (retained birth and the Last Will), ``telemetry``, ``decision``,
``ota/status``, or ``cmd/{name}`` for commands to the device. Site and device names are the
config's ``Name`` pattern (``[A-Za-z0-9_.:-]+``), so they can never contain ``/``, ``+`` or
``#`` and a topic always parses back to the same parts.
"""

from __future__ import annotations

import re
from typing import NamedTuple

PREFIX = "edgefleet/v1"
_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
#: Kinds a device publishes (``cmd/...`` is the other direction).
UPLINK_KINDS = ("state", "telemetry", "decision", "ota/status")


class Topic(NamedTuple):
    site: str
    device: str
    kind: str


def _check(what: str, name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{what} {name!r} is not a valid name ([A-Za-z0-9_.:-], 1-128 chars)")
    return name


def topic(site: str, device: str, kind: str) -> str:
    """The topic of ``kind`` for one device. Raises ``ValueError`` for a bad name or kind."""
    if kind not in UPLINK_KINDS and not (
        kind.startswith("cmd/") and _NAME.match(kind.removeprefix("cmd/"))
    ):
        raise ValueError(f"unknown topic kind {kind!r}")
    return f"{PREFIX}/{_check('site', site)}/{_check('device', device)}/{kind}"


def parse_topic(name: str) -> Topic | None:
    """The parts of an uplink or command topic, or ``None`` if it is not one of ours."""
    parts = name.split("/")
    if len(parts) < 5 or "/".join(parts[:2]) != PREFIX:
        return None
    site, device, kind = parts[2], parts[3], "/".join(parts[4:])
    if not (_NAME.match(site) and _NAME.match(device)):
        return None
    if kind in UPLINK_KINDS or (kind.startswith("cmd/") and _NAME.match(kind.removeprefix("cmd/"))):
        return Topic(site, device, kind)
    return None


def device_root(site: str, device: str) -> str:
    """``edgefleet/v1/{site}/{device}``: everything one device may publish under."""
    return f"{PREFIX}/{_check('site', site)}/{_check('device', device)}"


def shared_subscription(group: str = "ingest") -> list[str]:
    """The fleet's subscriptions (MQTT 5 shared: ``$share/{group}/...``), one per kind."""
    return [f"$share/{group}/{PREFIX}/+/+/{kind}" for kind in UPLINK_KINDS]
