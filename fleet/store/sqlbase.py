"""The plumbing every SQL query family of the store is written on: a connection behind
:meth:`SqlBase._run`, a transaction behind :meth:`SqlBase._txn`, and SQL written with ``?``
that :meth:`SqlBase._sql` gives each driver's placeholder style. See docs/ARCHITECTURE.md,
"The store"."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Protocol, TypeVar

_T = TypeVar("_T")


class Cursor(Protocol):
    """The part of a DB-API cursor the shared queries use (sqlite3 and psycopg 3 both fit)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def executemany(self, sql: Any, params: Any, /) -> Any: ...

    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """The part of a connection the shared queries use: ``execute`` and ``cursor``."""

    def execute(self, sql: Any, params: Any = ..., /) -> Any: ...

    def cursor(self) -> Any: ...


class SqlBase(ABC):
    """A DB-API connection behind two methods: subclasses set :attr:`PARAM` and implement
    :meth:`_run` (which maps driver errors to :mod:`fleet.errors`) and :meth:`_txn`."""

    #: The driver's placeholder: ``?`` (sqlite3) or ``%s`` (psycopg).
    PARAM: ClassVar[str] = "?"

    url: str

    @abstractmethod
    def _run(self, what: str, fn: Callable[[Any], _T]) -> _T:
        """Run ``fn`` on the connection; a driver error becomes a store error naming ``what``."""

    @abstractmethod
    def _txn(self, db: Any) -> AbstractContextManager[Any]:
        """A write transaction on ``db``: committed on exit, rolled back on an exception."""

    @classmethod
    def _sql(cls, text: str) -> Any:
        """``text`` (written with ``?``) in this driver's placeholder style.

        bytes for psycopg: its typing accepts only literal strings as ``str`` queries, and
        these are built from constants here."""
        if cls.PARAM == "?":
            return text
        return text.replace("?", cls.PARAM).encode()
