"""The journal on disk: ``ota/journal.json``, written atomically at every transition, and
the anti-rollback floors kept a second time in ``ota/floors.json``.

A journal that cannot be read is moved aside and the device falls back to its factory
versions; the floors are never forgotten that way: a load takes the larger of the two files
per kind, and refuses every install when neither can be read (:func:`load_state`).

Design: ``docs/ARCHITECTURE.md``, "OTA on the device".
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from ota.errors import StorageError
from ota.fsutil import atomic_write
from ota.machine import Journal

log = logging.getLogger(__name__)

MAX_JOURNAL_BYTES = 1024 * 1024
MAX_FLOORS_BYTES = 64 * 1024
FLOORS_NAME = "floors.json"

_T = TypeVar("_T")


@dataclass(frozen=True)
class Loaded:
    journal: Journal
    #: what had to be repaired or could not be read ("" when all was well)
    warning: str = ""
    #: non-empty: the floors are unknown, every install is refused with this reason
    refused: str = ""


def floors_path(journal_path: Path) -> Path:
    return journal_path.with_name(FLOORS_NAME)


def load(path: Path, *, repair: bool = True) -> tuple[Journal, str]:
    """The journal at ``path`` (empty if none) and a warning when it had to be reset; its
    floors are the larger of its own and the floors file's (see :func:`load_state`)."""
    got = load_state(path, repair=repair)
    return got.journal, got.warning


def load_state(path: Path, *, repair: bool = True) -> Loaded:
    """The journal at ``path`` with the floors of both files merged (module docstring).

    ``repair=False`` (a reader such as ``edge-agent ota status``) leaves a damaged file where
    it is for the agent to deal with and writes nothing.

    A journal that cannot be read is moved aside (``journal.json.corrupt-<ns>``) and the device
    falls back to its factory versions (an empty journal): running the version that came with
    the image is always consistent, guessing which staged version was meant is not. The
    **floors** are the exception: forgetting them would let any older, still-unexpired signed
    bundle in again as a downgrade. So they are also in ``floors.json`` (small, written durably
    before the journal that raises them, only ever raised), and a load takes the larger of the
    two per kind:

    - journal damaged, floors file readable: the floors come from the file;
    - floors file damaged or missing, journal readable: the journal's floors, file rewritten;
    - neither readable (or the journal damaged and no floors file): the floors are unknown and
      the load says so (:attr:`Loaded.refused`). The updater then refuses every install until
      an operator intervenes, and nothing is written or moved, so a restart cannot turn
      "unknown" into "none": the device keeps serving what it serves.
    """
    fpath = floors_path(path)
    journal, jwhy = _read(path, MAX_JOURNAL_BYTES, _parse, "journal")
    floors, fwhy = _read(fpath, MAX_FLOORS_BYTES, _parse_floors, "floors")
    if journal is not None:
        merged = _max(journal.floors, floors or {})
        warning = ""
        if fwhy:
            warning = f"OTA floors file {fpath} unreadable ({fwhy}); rewritten from the journal"
            log.warning("%s", warning)
        if repair and merged != floors:
            try:
                save_floors(fpath, merged)
            except StorageError as exc:  # the journal still holds them; the next load retries
                log.error("%s", exc)
                warning = warning or str(exc)
        if merged != journal.floors:
            journal = replace(journal, floors=merged)
        return Loaded(journal, warning)
    if not jwhy:  # no journal: a fresh device, or one whose journal was moved aside
        if floors is None and not fwhy and repair:
            # A fresh device: an empty floors file says "nothing committed yet", so a journal
            # damaged before the first commit is not taken for unknown floors.
            try:
                save_floors(fpath, {})
            except StorageError as exc:
                log.error("%s", exc)
        if not fwhy:
            return Loaded(Journal(floors=floors or {}))
        return _refused(path, "missing", fpath, fwhy)
    if floors is None:
        return _refused(path, jwhy, fpath, fwhy or "missing")
    why = f"OTA journal {path} unreadable ({jwhy})"
    if repair:
        aside = path.with_name(f"{path.name}.corrupt-{time.time_ns()}")
        path.replace(aside)
        why += f"; moved to {aside.name}, factory versions run"
    why += f"; anti-rollback floors kept from {fpath.name}"
    log.error("%s", why)
    return Loaded(Journal(floors=floors), why)


def _refused(path: Path, jwhy: str, fpath: Path, fwhy: str) -> Loaded:
    why = (
        f"OTA installs refused: the anti-rollback floors are unknown ({path}: {jwhy}; "
        f"{fpath}: {fwhy}); both left as they are, the device keeps what it runs. To resume, "
        f'stop the agent and either write {fpath} as {{"format": 1, "floors": {{"<kind>": '
        "<last committed counter>, ...}} (the fleet's record of this device), or delete "
        f"both files to accept any signed version again; then start it"
    )
    log.error("%s", why)
    return Loaded(Journal(), why, why)


def _read(path: Path, limit: int, parse: Callable[[bytes], _T], what: str) -> tuple[_T | None, str]:
    """(value, ""); (None, "") when missing; (None, why) when unreadable. A journal that
    cannot be read at all is the disk's fault (raised); a floors file is only a copy."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        if what == "floors":
            return None, f"cannot read: {exc}"
        raise StorageError(f"{path}: cannot read the OTA {what}: {exc}") from None
    if len(data) > limit:
        return None, f"{len(data)} bytes"
    try:
        return parse(data), ""
    except (ValueError, KeyError, TypeError) as exc:
        return None, str(exc) or type(exc).__name__


def _parse(data: bytes) -> Journal:
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("format") != 1:
        raise ValueError("not an OTA journal (format 1)")
    return Journal.from_json(doc)


def _parse_floors(data: bytes) -> dict[str, int]:
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("format") != 1:
        raise ValueError("not an OTA floors file (format 1)")
    raw = doc.get("floors")
    if not isinstance(raw, dict):
        raise TypeError("floors: expected an object")
    out: dict[str, int] = {}
    for kind, counter in raw.items():
        if type(counter) is not int or counter < 0:
            raise ValueError(f"floors.{kind}: expected a counter, got {counter!r}")
        out[str(kind)] = counter
    return out


def _max(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    return {k: max(a.get(k, -1), b.get(k, -1)) for k in sorted(a.keys() | b.keys())}


def save_floors(path: Path, floors: Mapping[str, int]) -> None:
    """Write ``floors`` to the floors file ``path``, never lowering what it holds."""
    old, _ = _read(path, MAX_FLOORS_BYTES, _parse_floors, "floors")
    doc = {"format": 1, "floors": _max(floors, old or {})}
    try:
        atomic_write(path, json.dumps(doc, indent=1, sort_keys=True).encode())
    except OSError as exc:
        raise StorageError(f"{path}: cannot write the OTA floors: {exc}") from None


def save(path: Path, journal: Journal) -> None:
    try:
        atomic_write(path, json.dumps(journal.to_json(), indent=1, sort_keys=True).encode())
    except OSError as exc:
        raise StorageError(f"{path}: cannot write the OTA journal: {exc}") from None
