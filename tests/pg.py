"""The PostgreSQL the store tests use: ``EDGEFLEET_TEST_PG_URL`` (``.ci/run`` and ``make test``
set it when a server answers). Without it the PostgreSQL cases skip, which CI turns into a
failure (tests/conftest.py): CI always runs them."""

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def pg_url() -> str:
    url = os.environ.get("EDGEFLEET_TEST_PG_URL", "")
    if not url:
        pytest.skip("no PostgreSQL for the store tests: set EDGEFLEET_TEST_PG_URL")
    return url


@contextmanager
def fresh_schema() -> Iterator[str]:
    """A URL of ``EDGEFLEET_TEST_PG_URL`` whose connections see only a schema of their own
    (``search_path`` through the URL's ``options``), dropped afterwards: a test's tables,
    ingest sessions included, never meet another test's."""
    import psycopg  # noqa: PLC0415 - only the PostgreSQL cases need it

    base = pg_url()
    schema = f"t_{uuid.uuid4().hex}"
    with psycopg.connect(base, autocommit=True) as pg:
        pg.execute(f"CREATE SCHEMA {schema}".encode())
    try:
        sep = "&" if "?" in base else "?"
        yield f"{base}{sep}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(base, autocommit=True) as pg:
            pg.execute(f"DROP SCHEMA {schema} CASCADE".encode())
