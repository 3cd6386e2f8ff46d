"""Both fleet stores for one test (the ``backend`` fixture): a fresh SQLite file and a
private PostgreSQL schema, with a way to run SQL around the store."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fleet.store import (
    OperatorStore,
    open_store,
)
from tests.support.pg import pg_url, private_schema

PG_HELP = (
    "the PostgreSQL store tests need a server: export "
    "EDGEFLEET_TEST_PG_URL=postgresql://postgres@127.0.0.1:5432/test "
    "(CI sets it; each test creates and drops its own schema there)"
)


@dataclass
class Backend:
    name: str
    url: str
    app: str = ""  # PostgreSQL application_name of this test's connections

    def sql(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run one statement outside the store (to set up what the store must cope with)."""
        if self.name == "sqlite":
            with sqlite3.connect(self.url.removeprefix("sqlite://")) as db:
                return db.execute(statement.replace("%s", "?"), params).fetchall()
        with psycopg.connect(self.url, autocommit=True) as pg:
            cur = pg.execute(statement.encode(), params)
            return cur.fetchall() if cur.description else []

    def open(self) -> OperatorStore:
        store = open_store(self.url)
        store.migrate()
        return store


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        yield Backend("sqlite", f"sqlite://{tmp_path / 'fleet.db'}")
        return
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(private_schema(pg_url()))
        except psycopg.Error as exc:
            pytest.fail(f"cannot reach EDGEFLEET_TEST_PG_URL ({exc}); {PG_HELP}")
        # private_schema names the sessions after their schema (application_name).
        yield Backend("postgresql", url, app=url.rsplit("application_name=", 1)[1])
