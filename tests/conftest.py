"""Shared test policy.

Under CI (``CI`` set, as ``.ci/run`` does) a skipped test is turned into a failure: CI must
exercise every component, so a missing mosquitto, PostgreSQL or network namespace shows up
as red, not as a quiet "s".
"""

import os
from collections.abc import Generator

import pytest

# Fixtures shared across test modules (defined with what they need in tests/support).
from tests.support.firmware import real_wheel, tiny_fs
from tests.support.stores import backend

__all__ = ["backend", "real_wheel", "tiny_fs"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.skipped and os.environ.get("CI") and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, where every component must run: {reason}"
