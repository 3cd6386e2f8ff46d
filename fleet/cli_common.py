"""What every ``fleet`` sub-command shares: exit codes, the ``--store`` and ``--json``
options, opening the store, and failing with one line on stderr.

Exit codes: 0 ok, 1 not found / nothing to do, 2 bad usage, 3 store or broker failure.
"""

from __future__ import annotations

import getpass
import os
from pathlib import Path
from typing import Annotated, NoReturn
from urllib.parse import unquote, urlsplit

import typer

from edge_agent.console import make_console
from fleet.access import Principal
from fleet.errors import FleetError
from fleet.store import OperatorStore, open_store

ENV_STORE = "FLEET_STORE"
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_FAILURE = 3
ENV_MQTT_PASSWORD = "FLEET_MQTT_PASSWORD"  # noqa: S105 - a variable name, not a secret

out = make_console(highlight=False, soft_wrap=True)
err = make_console(stderr=True, highlight=False)

StoreOpt = Annotated[
    str | None,
    typer.Option(
        "--store",
        envvar=ENV_STORE,
        help="Store URL (sqlite:///abs/path.db, postgresql://...) or a SQLite file path "
        "\\[default: ./fleet.db] (only fleet serve and rollout create make a missing file)",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def fail(message: str, code: int) -> NoReturn:
    """One line on stderr, never wrapped (a script greps it), then exit ``code``."""
    typer.echo(f"fleet: {message}", err=True)
    raise typer.Exit(code)


def store_url(value: str | None) -> str:
    """``--store`` / ``FLEET_STORE`` as a URL; a bare path is a SQLite file (made absolute)."""
    if not value:
        value = "fleet.db"
    if "://" in value:
        return value
    return f"sqlite://{Path(value).expanduser().resolve()}"


def sqlite_file(url: str) -> Path | None:
    """The file a ``sqlite://`` URL names; None for any other scheme."""
    parts = urlsplit(url)
    return Path(unquote(parts.path)) if parts.scheme.lower() == "sqlite" else None


def _named_by(value: str | None) -> str:
    if not value:
        return f"the default ./fleet.db; name another with --store or {ENV_STORE}"
    return ENV_STORE if os.environ.get(ENV_STORE) == value else "--store"


def open_cli_store(
    value: str | None, *, migrate: bool = True, create: bool = False
) -> OperatorStore:
    """The store of ``--store``, migrated unless ``migrate`` is False (a command that must
    change nothing); a failure ends the command with exit code 3.

    A SQLite file that does not exist is that failure unless ``create``: a read command run
    in the wrong folder would otherwise make an empty ``fleet.db`` and report an empty fleet.
    """
    url = store_url(value)
    path = sqlite_file(url)
    if not create and path is not None and not path.exists():
        fail(f"store {path} does not exist ({_named_by(value)})", EXIT_FAILURE)
    try:
        store = open_store(url)
        if migrate:
            store.migrate()
    except FleetError as exc:
        fail(str(exc), EXIT_FAILURE)
    return store


def cli_principal() -> Principal:
    """Who a CLI change is by, for the audit log: the local account. Whoever can open the
    store can change it directly, so the CLI acts as admin; the record says who it was."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = f"uid{os.getuid()}"
    return Principal(f"cli:{name}", "admin", "cli")
