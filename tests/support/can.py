"""Shared fixtures for the CAN tests: data paths and waiting on conditions."""

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import cantools
import cantools.database
import pytest
from cantools.database.can import Database as CanDatabase

REPO = Path(__file__).resolve().parents[2]
#: The real Subaru capture, copied into the repository (source, license, sha256: its README).
SUBARU_DIR = REPO / "tests" / "data" / "can" / "subaru-wrx"
SUBARU_LOG = SUBARU_DIR / "can_sample_t34-54s.log"
SUBARU_DBC = SUBARU_DIR / "sample_can_spec.dbc"
SYNTHETIC_DBC = REPO / "tests" / "data" / "synthetic.dbc"

# Figures from SUBARU_DIR/README.md ("Decode statistics (measured)").
SUBARU_FRAMES = 18_285
SUBARU_IN_DBC_FRAMES = 8_420
SUBARU_UNKNOWN_IDS = 27
SUBARU_DURATION_S = 19.999


def require_subaru() -> tuple[Path, Path]:
    """The capture and its DBC; a missing file fails the test (it must not skip silently)."""
    for path in (SUBARU_LOG, SUBARU_DBC):
        if not path.is_file():
            pytest.fail(f"test data missing: {path.resolve()} (part of the repository)")
    return SUBARU_LOG, SUBARU_DBC


def wait_until_sync(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``cond`` (from a thread that may block) until true; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


async def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Like :func:`wait_until_sync` but yields to the event loop between polls."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


def load_db(path: Path) -> CanDatabase:
    """cantools' own view of a DBC: the reference our decoder is checked against."""
    db = cantools.database.load_file(path)
    assert isinstance(db, CanDatabase)
    return db


def reference_decode(db: CanDatabase, frame_id: int, data: bytes) -> dict[str, float]:
    """``db.decode_message`` with raw numbers for choices, as floats."""
    decoded = db.decode_message(frame_id, data, decode_choices=False)
    assert isinstance(decoded, dict)
    out: dict[str, float] = {}
    for name, value in decoded.items():
        assert isinstance(value, int | float)
        out[name] = float(value)
    return out
