"""The PostgreSQL the store tests use: ``EDGEFLEET_TEST_PG_URL`` (``.ci/run`` and ``make test``
set it when a server answers). Without it the PostgreSQL cases skip, which CI turns into a
failure (tests/conftest.py): CI always runs them."""

import os

import pytest


def pg_url() -> str:
    url = os.environ.get("EDGEFLEET_TEST_PG_URL", "")
    if not url:
        pytest.skip("no PostgreSQL for the store tests: set EDGEFLEET_TEST_PG_URL")
    return url
