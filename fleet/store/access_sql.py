"""The store's users, API tokens, console sessions and audit log (schema v7), one query text
for SQLite and PostgreSQL. Only hashes are stored (see :mod:`fleet.access`). Every method
raises :class:`fleet.errors.FleetStoreError` on a store failure and
:class:`fleet.errors.AccessError` when a name is taken or unknown."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fleet.access import AuditEntry, TokenInfo, UserInfo
from fleet.errors import AccessError
from fleet.store.sqlbase import Connection, SqlBase

_TOKEN_COLS = "token_id, name, role, created_ns, created_by, expires_ns, revoked_ns, last_used_ns"  # noqa: S105
_AUDIT_COLS = "id, t_ns, actor, via, remote, action, target, detail, result"


def _token(r: Sequence[Any]) -> TokenInfo:
    return TokenInfo(r[0], r[1], r[2], int(r[3]), r[4], r[5], r[6], r[7])


def _audit(r: Sequence[Any]) -> AuditEntry:
    return AuditEntry(
        id=int(r[0]),
        t_ns=int(r[1]),
        actor=r[2],
        via=r[3],
        remote=r[4],
        action=r[5],
        target=r[6],
        detail=json.loads(r[7]),
        result=r[8],
    )


class AccessSql(SqlBase):
    """Users, tokens, sessions and the audit log on a SQL store."""

    # -- users ---------------------------------------------------------------------------

    def add_user(self, name: str, role: str, password_hash: str, now_ns: int) -> None:
        """Add a user; raises AccessError if the name is taken."""
        sql = self._sql(
            "INSERT INTO users (name, role, password_hash, created_ns) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (name) DO NOTHING"
        )

        def go(db: Connection) -> int:
            with self._txn(db):
                return int(db.execute(sql, (name, role, password_hash, now_ns)).rowcount)

        if self._run("add_user", go) == 0:
            raise AccessError(f"user {name!r} exists already")

    def update_user(
        self,
        name: str,
        *,
        role: str | None = None,
        password_hash: str | None = None,
        disabled: bool | None = None,
    ) -> None:
        """Change a user's role, password or disabled flag; raises AccessError if unknown.
        Disabling a user also ends their console sessions."""
        sql = self._sql(
            "UPDATE users SET role = COALESCE(?, role), password_hash = COALESCE(?, "
            "password_hash), disabled = COALESCE(?, disabled) WHERE name = ?"
        )
        drop = self._sql("DELETE FROM console_sessions WHERE principal = ?")

        def go(db: Connection) -> int:
            with self._txn(db):
                n = int(db.execute(sql, (role, password_hash, disabled, name)).rowcount)
                if n and (disabled or role is not None or password_hash is not None):
                    db.execute(drop, (name,))
                return n

        if self._run("update_user", go) == 0:
            raise AccessError(f"user {name!r}: no such user")

    def users(self) -> list[UserInfo]:
        sql = self._sql("SELECT name, role, created_ns, disabled FROM users ORDER BY name")
        return self._run(
            "users",
            lambda db: [
                UserInfo(r[0], r[1], int(r[2]), bool(r[3])) for r in db.execute(sql).fetchall()
            ],
        )

    def user_password(self, name: str) -> tuple[str, str] | None:
        """``(role, password_hash)`` of an enabled user, else None."""
        sql = self._sql("SELECT role, password_hash FROM users WHERE name = ? AND NOT disabled")

        def go(db: Connection) -> tuple[str, str] | None:
            r = db.execute(sql, (name,)).fetchone()
            return None if r is None else (r[0], r[1])

        return self._run("user_password", go)

    # -- API tokens ----------------------------------------------------------------------

    def add_token(self, info: TokenInfo, secret_hash: str) -> None:
        """Add a token; raises AccessError if its name is taken."""
        sql = self._sql(
            f"INSERT INTO api_tokens ({_TOKEN_COLS}, secret_hash) "  # noqa: S608 - constants
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO NOTHING"
        )
        row = (
            info.token_id,
            info.name,
            info.role,
            info.created_ns,
            info.created_by,
            info.expires_ns,
            info.revoked_ns,
            info.last_used_ns,
            secret_hash,
        )

        def go(db: Connection) -> int:
            with self._txn(db):
                return int(db.execute(sql, row).rowcount)

        if self._run("add_token", go) == 0:
            raise AccessError(f"token {info.name!r} exists already (revoke it or pick a name)")

    def tokens(self) -> list[TokenInfo]:
        sql = self._sql(f"SELECT {_TOKEN_COLS} FROM api_tokens ORDER BY created_ns, name")  # noqa: S608 - constants
        return self._run("tokens", lambda db: [_token(r) for r in db.execute(sql).fetchall()])

    def token(self, token_id: str) -> tuple[TokenInfo, str] | None:
        """A token and its secret hash, by id."""
        sql = self._sql(
            f"SELECT {_TOKEN_COLS}, secret_hash FROM api_tokens WHERE token_id = ?"  # noqa: S608 - constants
        )

        def go(db: Connection) -> tuple[TokenInfo, str] | None:
            r = db.execute(sql, (token_id,)).fetchone()
            return None if r is None else (_token(r), r[8])

        return self._run("token", go)

    def touch_token(self, token_id: str, now_ns: int) -> None:
        """Record a token's use (at most one write a minute per token)."""
        sql = self._sql(
            "UPDATE api_tokens SET last_used_ns = ? WHERE token_id = ? AND "
            "(last_used_ns IS NULL OR last_used_ns < ?)"
        )

        def go(db: Connection) -> None:
            with self._txn(db):
                db.execute(sql, (now_ns, token_id, now_ns - 60_000_000_000))

        self._run("touch_token", go)

    def revoke_token(self, name: str, now_ns: int) -> None:
        """Revoke a token by name or id; raises AccessError if unknown or revoked already."""
        sql = self._sql(
            "UPDATE api_tokens SET revoked_ns = ? WHERE (name = ? OR token_id = ?) "
            "AND revoked_ns IS NULL"
        )

        def go(db: Connection) -> int:
            with self._txn(db):
                return int(db.execute(sql, (now_ns, name, name)).rowcount)

        if self._run("revoke_token", go) == 0:
            raise AccessError(f"token {name!r}: no such token, or revoked already")

    # -- console sessions ----------------------------------------------------------------

    def add_session(
        self,
        secret_hash: str,
        principal: str,
        role: str,
        csrf: str,
        *,
        now_ns: int,
        expires_ns: int,
    ) -> None:
        """Add a console session and drop the expired ones."""
        add = self._sql(
            "INSERT INTO console_sessions (secret_hash, principal, role, csrf, created_ns, "
            "expires_ns) VALUES (?, ?, ?, ?, ?, ?)"
        )
        purge = self._sql("DELETE FROM console_sessions WHERE expires_ns <= ?")

        def go(db: Connection) -> None:
            with self._txn(db):
                db.execute(purge, (now_ns,))
                db.execute(add, (secret_hash, principal, role, csrf, now_ns, expires_ns))

        self._run("add_session", go)

    def session(self, secret_hash: str, now_ns: int) -> tuple[str, str, str] | None:
        """``(principal, role, csrf)`` of a live session, else None."""
        sql = self._sql(
            "SELECT principal, role, csrf FROM console_sessions WHERE secret_hash = ? "
            "AND expires_ns > ?"
        )

        def go(db: Connection) -> tuple[str, str, str] | None:
            r = db.execute(sql, (secret_hash, now_ns)).fetchone()
            return None if r is None else (r[0], r[1], r[2])

        return self._run("session", go)

    def drop_session(self, secret_hash: str) -> None:
        sql = self._sql("DELETE FROM console_sessions WHERE secret_hash = ?")

        def go(db: Connection) -> None:
            with self._txn(db):
                db.execute(sql, (secret_hash,))

        self._run("drop_session", go)

    # -- audit ---------------------------------------------------------------------------

    def audit(self, entry: AuditEntry) -> int:
        """Append one entry; returns its id."""
        sql = self._sql(
            "INSERT INTO audit (t_ns, actor, via, remote, action, target, detail, result) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?) RETURNING id"
        )
        row = (
            entry.t_ns,
            entry.actor,
            entry.via,
            entry.remote,
            entry.action,
            entry.target,
            json.dumps(entry.detail, sort_keys=True),
            entry.result,
        )

        def go(db: Connection) -> int:
            with self._txn(db):
                return int(db.execute(sql, row).fetchone()[0])

        return self._run("audit", go)

    def audit_log(self, *, before_id: int | None = None, limit: int = 100) -> list[AuditEntry]:
        """The newest ``limit`` entries, newest first; ``before_id`` pages back."""
        sql = self._sql(
            f"SELECT {_AUDIT_COLS} FROM audit WHERE id < ? ORDER BY id DESC LIMIT ?"  # noqa: S608 - constants
        )
        bound = before_id if before_id is not None else 2**62
        return self._run(
            "audit_log",
            lambda db: [_audit(r) for r in db.execute(sql, (bound, limit)).fetchall()],
        )
