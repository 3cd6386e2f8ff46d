"""The PostgreSQL the store tests use: ``EDGEFLEET_TEST_PG_URL`` (``.ci/run`` and ``make test``
set it when a server answers). Without it the PostgreSQL cases skip, which CI turns into a
failure (tests/conftest.py): CI always runs them.

Every test (and benchmark) works in a schema of its own (:func:`private_schema`): the
database is shared with other checkouts' runs and with the next CI, so nothing may be left in
its public schema, least of all a schema version newer than the code CI will run.
"""

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest


def pg_url() -> str:
    url = os.environ.get("EDGEFLEET_TEST_PG_URL", "")
    if not url:
        pytest.skip("no PostgreSQL for the store tests: set EDGEFLEET_TEST_PG_URL")
    return url


def with_search_path(url: str, schema: str) -> str:
    """``url`` whose sessions see ``schema`` first (and create their tables there)."""
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options=-csearch_path%3D{schema}&application_name={schema}"


@contextmanager
def private_schema(base: str) -> Iterator[str]:
    """A new schema in the database at ``base``, as a URL whose search path is it; dropped
    with everything in it on exit."""
    schema = f"t_{uuid.uuid4().hex}"
    with psycopg.connect(base, autocommit=True) as pg:
        pg.execute(f"CREATE SCHEMA {schema}".encode())
    try:
        yield with_search_path(base, schema)
    finally:
        with psycopg.connect(base, autocommit=True) as pg:
            pg.execute(f"DROP SCHEMA {schema} CASCADE".encode())


@contextmanager
def pg_schema_url() -> Iterator[str]:
    """:func:`private_schema` of the test database (skips without one, as :func:`pg_url`)."""
    with private_schema(pg_url()) as url:
        yield url
