"""The retention spec (pure): what ``--retention`` takes and what it cuts when."""

from __future__ import annotations

import pytest

from fleet.errors import RetentionError
from fleet.retention import cutoffs, describe, parse_retention

D = 86_400
NS = 1_000_000_000


def test_a_spec_names_kinds_and_ages_in_days_or_hours() -> None:
    keep = parse_retention(" telemetry=30d, decisions=180d,ota=12h,quarantine=7d,minutes=365d ")
    assert keep == {
        "telemetry": 30 * D,
        "decision": 180 * D,
        "ota/status": 12 * 3600,
        "quarantine": 7 * D,
        "minutes": 365 * D,
    }
    assert parse_retention("") == {}
    now = 1_000 * D * NS
    assert cutoffs({"telemetry": 30 * D}, now) == {"telemetry": now - 30 * D * NS}
    assert describe(parse_retention("decisions=180d,ota=12h")) == (
        "history kept: decisions 180 d, ota 12 h"
    )
    assert describe({}) == "history kept for ever (no --retention)"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("telemetry=0d", "expected whole days or hours"),
        ("telemetry=1.5d", "expected whole days or hours"),
        ("telemetry=-3d", "expected whole days or hours"),
        ("telemetry=3m", "expected whole days or hours"),
        ("state=3d", "unknown kind 'state'"),
        ("=3d", "unknown kind ''"),
        ("decisions=1d,decisions=1d", "decisions is given twice"),
    ],
)
def test_a_bad_spec_names_the_part_that_is_wrong(spec: str, words: str) -> None:
    with pytest.raises(RetentionError, match=words):
        parse_retention(spec)
