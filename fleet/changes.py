"""Every change an operator makes to the fleet, once, for the CLI, the API and the console.

:class:`Changes` checks the caller's role, does the change on the store and appends an audit
entry (who, via what, from where, what, on what, the result), also when the change fails, so
a refused pause shows in the audit log as plainly as a granted one. Raises what the change
raises (:class:`fleet.errors.RolloutError`, ``AccessError``, ``FleetStoreError``) after
recording it; ``Forbidden`` when the role is too low. Design: docs/ARCHITECTURE.md,
"The fleet API".
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet import access
from fleet.access import AuditEntry, NewToken, Principal, Role, TokenInfo
from fleet.errors import AccessError, FleetError, RolloutError
from fleet.retention import apply_retention, describe
from fleet.rollout import machine as m
from fleet.rollout.orchestrator import create_rollout, request
from fleet.rollout.plan import TIERS
from fleet.store import OperatorStore

_GROUP = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


class Forbidden(AccessError):
    """The caller's role is too low for this change."""


@dataclass(frozen=True)
class RolloutSpec:
    """What a new rollout is: the bundle file, who gets it and how carefully."""

    bundle: Path
    artifacts: Path
    selector: dict[str, tuple[str, ...]]
    params: m.Params
    transport: str = "http"
    root_json: Path | None = None
    #: What the audit log calls the bundle (an upload's file name); default: the file's name.
    name: str = ""


class Changes:
    """The changes ``who`` may make, from ``remote`` (an address, or ``local`` for the CLI)."""

    def __init__(
        self,
        store: OperatorStore,
        who: Principal,
        *,
        remote: str = "local",
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self._store = store
        self._who = who
        self._remote = remote
        self._clock = clock

    def _check(self, action: str, need: Role) -> None:
        if not access.allows(self._who.role, need):
            who = self._who
            raise Forbidden(f"{action}: needs the {need} role ({who.name} is {who.role})")

    @contextmanager
    def _audited(
        self, action: str, target: str, detail: dict[str, Any], need: Role
    ) -> Iterator[None]:
        result = "ok"
        try:
            self._check(action, need)
            yield
        except FleetError as exc:
            result = str(exc)
            raise
        finally:
            self._store.audit(
                AuditEntry(
                    t_ns=self._clock(),
                    actor=self._who.name,
                    via=self._who.via,
                    remote=self._remote,
                    action=action,
                    target=target,
                    result=result,
                    detail=detail,
                )
            )

    # -- rollouts ------------------------------------------------------------------------

    def rollout_request(self, rollout_id: str, action: str) -> None:
        """Ask the orchestrator to pause, resume or abort ``rollout_id``."""
        with self._audited(f"rollout.{action}", rollout_id, {}, "operator"):
            request(self._store, rollout_id, action)

    def create_rollout(self, spec: RolloutSpec, *, dry_run: bool = False) -> m.Rollout:
        """Check the bundle, plan the waves and (unless ``dry_run``) publish and store it.
        A dry run changes nothing and is not audited."""

        def go() -> m.Rollout:
            try:
                return plan()
            except RolloutError as exc:
                if not spec.name:
                    raise
                # An upload's spool file means nothing to its sender: name what they sent.
                raise RolloutError(str(exc).replace(str(spec.bundle), spec.name)) from None

        def plan() -> m.Rollout:
            return create_rollout(
                self._store,
                spec.bundle,
                artifacts=spec.artifacts,
                selector=spec.selector,
                params=spec.params,
                transport=spec.transport,
                root_json=spec.root_json,
                now_ns=self._clock(),
                dry_run=dry_run,
            )

        if dry_run:
            self._check("rollout.create", "operator")
            return go()
        detail = {
            "bundle": spec.name or spec.bundle.name,
            "selector": {k: list(v) for k, v in spec.selector.items()},
        }
        with self._audited("rollout.create", spec.name or spec.bundle.name, detail, "operator"):
            r = go()
            detail.update({"rollout": r.id, "bundle_id": r.bundle_id, "version": r.version})
        return r

    # -- history -------------------------------------------------------------------------

    def expire_history(self, keep: Mapping[str, int]) -> dict[str, int]:
        """Delete the history older than ``keep`` says (:mod:`fleet.retention`); rows
        deleted per kind. Needs the admin role: what goes cannot come back."""
        detail: dict[str, Any] = {"keep_s": dict(keep)}
        with self._audited("history.expire", describe(keep), detail, "admin"):
            gone = apply_retention(self._store, keep, self._clock())
            detail["deleted"] = gone
        return gone

    # -- device labels -------------------------------------------------------------------

    def set_labels(self, device: str, *, group: str | None, tier: str | None) -> None:
        """Set a device's rollout group and tier; raises RolloutError for a bad value or an
        unknown device (its message says which)."""
        detail = {"group": group, "tier": tier}
        with self._audited("device.label", device, detail, "operator"):
            if tier is not None and tier not in TIERS:
                raise RolloutError(f"tier {tier!r}: expected one of {', '.join(TIERS)}")
            if group and not _GROUP.match(group):
                # The selector's own rule: a group it cannot name could never be rolled out to.
                raise RolloutError(
                    f"group {group!r}: expected 1-128 of A-Z a-z 0-9 _ . : - (or '' to clear)"
                )
            if not self._store.set_labels(device, group=group, tier=tier):
                raise RolloutError(f"no device {device!r} in the registry")

    # -- users and tokens ----------------------------------------------------------------

    def add_user(self, name: str, role: str, password: str) -> None:
        with self._audited("user.add", name, {"role": role}, "admin"):
            access.check_name(name, "user")
            self._store.add_user(
                name, access.check_role(role), access.hash_password(password), self._clock()
            )

    def update_user(
        self,
        name: str,
        *,
        role: str | None = None,
        password: str | None = None,
        disabled: bool | None = None,
    ) -> None:
        detail: dict[str, Any] = {
            "role": role,
            "password": password is not None,
            "disabled": disabled,
        }
        with self._audited("user.update", name, detail, "admin"):
            self._store.update_user(
                name,
                role=None if role is None else access.check_role(role),
                password_hash=None if password is None else access.hash_password(password),
                disabled=disabled,
            )

    def create_token(self, name: str, role: str, *, expires_in_ns: int | None = None) -> NewToken:
        """A new API token; its text is returned once and never stored."""
        now = self._clock()
        expires = None if expires_in_ns is None else now + expires_in_ns
        detail: dict[str, Any] = {"role": role, "expires_ns": expires}
        with self._audited("token.create", name, detail, "admin"):
            access.check_name(name, "token")
            made = access.new_token()
            info = TokenInfo(
                token_id=made.token_id,
                name=name,
                role=access.check_role(role),
                created_ns=now,
                created_by=self._who.name,
                expires_ns=expires,
                revoked_ns=None,
                last_used_ns=None,
            )
            self._store.add_token(info, made.secret_hash)
            detail["token_id"] = made.token_id
        return made

    def revoke_token(self, name: str) -> None:
        with self._audited("token.revoke", name, {}, "admin"):
            self._store.revoke_token(name, self._clock())


__all__ = ["Changes", "Forbidden", "RolloutSpec"]
