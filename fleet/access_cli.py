"""``fleet users``, ``fleet tokens`` and ``fleet audit``: who may use the API and console,
and the record of every change. Changes go through :class:`fleet.changes.Changes` (audited,
as the API's are). Exit codes as the rest of ``fleet``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from fleet import access
from fleet.changes import Changes
from fleet.cli_common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    JsonOpt,
    StoreOpt,
    cli_principal,
    fail,
    open_cli_store,
    out,
)
from fleet.errors import AccessError, FleetError, FleetStoreError

users_app = typer.Typer(help="Users of the console and API.", no_args_is_help=True)
tokens_app = typer.Typer(help="API tokens (Authorization: Bearer).", no_args_is_help=True)
audit_app = typer.Typer(
    help="The audit log: every change, who, when, from where.", no_args_is_help=True
)

RoleOpt = Annotated[str, typer.Option(help="viewer, operator or admin.")]
PasswordEnvOpt = Annotated[
    str | None,
    typer.Option(help="Read the password from this environment variable (default: prompt)."),
]


def _iso(t_ns: int | None) -> str:
    if not t_ns:
        return "-"
    return datetime.fromtimestamp(t_ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _password(env: str | None) -> str:
    if env is not None:
        value = os.environ.get(env)
        if not value:
            fail(f"--password-env {env}: the variable is not set or empty", EXIT_USAGE)
        return value
    value = typer.prompt("password", hide_input=True, confirmation_prompt=True)
    return str(value)


def _change(store: str | None, what: str, fn: Callable[[Changes], object]) -> None:
    """Run one change; AccessError is bad usage (2), a store failure 3."""
    st = open_cli_store(store, create=True)
    try:
        fn(Changes(st, cli_principal()))
    except FleetStoreError as exc:
        fail(str(exc), EXIT_FAILURE)
    except (AccessError, FleetError) as exc:
        fail(f"{what}: {exc}", EXIT_USAGE)
    finally:
        st.close()


@users_app.command("add")
def users_add(
    name: str, role: RoleOpt = "viewer", password_env: PasswordEnvOpt = None, store: StoreOpt = None
) -> None:
    """Add a user who signs in to the console with a password (at least 10 characters)."""
    password = _password(password_env)
    _change(store, "users add", lambda c: c.add_user(name, role, password))
    out.print(f"user {name}: added ({role})", markup=False)


@users_app.command("set")
def users_set(
    name: str,
    role: Annotated[str | None, typer.Option(help="A new role.")] = None,
    password: Annotated[bool, typer.Option("--password", help="Set a new password.")] = False,
    password_env: PasswordEnvOpt = None,
    disabled: Annotated[
        bool | None, typer.Option("--disable/--enable", help="Lock the user out, or let back in.")
    ] = None,
    store: StoreOpt = None,
) -> None:
    """Change a user's role, password or whether they may sign in (ends their sessions)."""
    new = _password(password_env) if password or password_env else None
    _change(
        store,
        "users set",
        lambda c: c.update_user(name, role=role, password=new, disabled=disabled),
    )
    out.print(f"user {name}: updated", markup=False)


@users_app.command("list")
def users_list(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    st = open_cli_store(store)
    try:
        users = st.users()
    finally:
        st.close()
    if as_json:
        print(json.dumps([{"name": u.name, "role": u.role, "created_ns": u.created_ns,
                           "disabled": u.disabled} for u in users]))  # fmt: skip
        return
    table = Table("user", "role", "created (UTC)", "state")
    for u in users:
        table.add_row(u.name, u.role, _iso(u.created_ns), "disabled" if u.disabled else "active")
    out.print(table)


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Option(help="A name to know it by (unique).")],
    role: RoleOpt = "viewer",
    expires: Annotated[str | None, typer.Option(help="e.g. 30d, 12h (default: never).")] = None,
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Make an API token and print it once: it is stored only as a hash."""
    try:
        ttl = access.parse_duration_ns(expires) if expires else None
    except AccessError as exc:
        fail(f"--expires: {exc}", EXIT_USAGE)
    made: list[access.NewToken] = []
    _change(
        store, "tokens create", lambda c: made.append(c.create_token(name, role, expires_in_ns=ttl))
    )
    if as_json:
        print(
            json.dumps({"name": name, "role": role, "id": made[0].token_id, "token": made[0].text})
        )
        return
    print(made[0].text)


@tokens_app.command("list")
def tokens_list(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Every token (never its secret): role, who made it, expiry, last use."""
    st = open_cli_store(store)
    try:
        tokens = st.tokens()
    finally:
        st.close()
    if as_json:
        print(json.dumps([{"id": t.token_id, "name": t.name, "role": t.role,
                           "created_ns": t.created_ns, "created_by": t.created_by,
                           "expires_ns": t.expires_ns, "revoked_ns": t.revoked_ns,
                           "last_used_ns": t.last_used_ns} for t in tokens]))  # fmt: skip
        return
    table = Table("id", "name", "role", "created by", "expires", "revoked", "last used")
    for t in tokens:
        table.add_row(t.token_id, t.name, t.role, t.created_by, _iso(t.expires_ns),
                      _iso(t.revoked_ns), _iso(t.last_used_ns))  # fmt: skip
    out.print(table)


@tokens_app.command("revoke")
def tokens_revoke(
    name: Annotated[str, typer.Argument(help="Its name or id.")], store: StoreOpt = None
) -> None:
    """Revoke a token: the API refuses it from the next request."""
    _change(store, "tokens revoke", lambda c: c.revoke_token(name))
    out.print(f"token {name}: revoked", markup=False)


@audit_app.command("list")
def audit_list(
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="Newest entries to show.")] = 50,
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The newest changes first: when, who, via what, from where, what, result."""
    st = open_cli_store(store)
    try:
        entries = st.audit_log(limit=limit)
    finally:
        st.close()
    if as_json:
        print(json.dumps([{"id": e.id, "t_ns": e.t_ns, "actor": e.actor, "via": e.via,
                           "remote": e.remote, "action": e.action, "target": e.target,
                           "result": e.result, "detail": e.detail} for e in entries]))  # fmt: skip
        return
    table = Table("time (UTC)", "who", "via", "from", "action", "target", "result")
    for e in entries:
        # Targets and results can hold device names: text, never markup.
        table.add_row(_iso(e.t_ns), escape(e.actor), e.via, e.remote, e.action, escape(e.target),
                      escape(e.result))  # fmt: skip
    out.print(table)
