"""The one time format inside signed documents: ``YYYY-MM-DDTHH:MM:SSZ`` (UTC)."""

from __future__ import annotations

import re
from datetime import UTC, datetime

_RFC3339_Z = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")


def parse_utc(text: object) -> datetime | None:
    """The instant ``text`` names, or ``None`` when it is not in the one allowed form."""
    if not isinstance(text, str) or not _RFC3339_Z.match(text):
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None


def format_utc(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_now() -> datetime:
    return datetime.now(UTC)
