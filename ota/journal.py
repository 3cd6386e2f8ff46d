"""The journal on disk: ``ota/journal.json``, written atomically at every transition.

A journal that cannot be read is moved aside (``journal.json.corrupt-<ns>``) and the device
falls back to its factory versions (an empty journal): running the version that came with
the image is always consistent, guessing which staged version was meant is not.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from ota.errors import StorageError
from ota.fsutil import atomic_write
from ota.machine import Journal

log = logging.getLogger(__name__)

MAX_JOURNAL_BYTES = 1024 * 1024


def load(path: Path, *, repair: bool = True) -> tuple[Journal, str]:
    """The journal at ``path`` (empty if none) and a warning when it had to be reset.

    ``repair=False`` (a reader such as ``edge-agent ota status``) leaves a damaged file where
    it is for the agent to deal with."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Journal(), ""
    except OSError as exc:
        raise StorageError(f"{path}: cannot read the OTA journal: {exc}") from None
    try:
        return _parse(data), ""
    except (ValueError, KeyError, TypeError) as exc:
        if not repair:
            return Journal(), f"OTA journal {path} unreadable ({exc})"
        aside = path.with_name(f"{path.name}.corrupt-{time.time_ns()}")
        path.replace(aside)
        why = f"OTA journal {path} unreadable ({exc}); moved to {aside.name}, factory versions run"
        log.error("%s", why)
        return Journal(), why


def _parse(data: bytes) -> Journal:
    if len(data) > MAX_JOURNAL_BYTES:
        raise ValueError(f"{len(data)} bytes")
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("format") != 1:
        raise ValueError("not an OTA journal (format 1)")
    return Journal.from_json(doc)


def save(path: Path, journal: Journal) -> None:
    try:
        atomic_write(path, json.dumps(journal.to_json(), indent=1, sort_keys=True).encode())
    except OSError as exc:
        raise StorageError(f"{path}: cannot write the OTA journal: {exc}") from None
