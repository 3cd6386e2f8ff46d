"""The OTA state machine: pure, table-driven, one update at a time (h11's ``_state.py``)::

idle ──offer──> fetching ──fetched──> verifying ──verified──> staged ──activate──>
  ^  └──install FILE──────────────────┘   │                     │
  │                                       └──rejected───────────┴──> idle (failed)
activating ──activated──> probation ──passed──> committing ──committed──> idle
    │                        │  └──abort / failed──> rolling_back ──rolled_back──> idle
    └──activation_failed─────┴──────────────────────┘          ^
                                             committing ──failed──┘ (recovery, agent)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ota.errors import IllegalTransition

State = Literal[
    "idle", "fetching", "verifying", "staged", "activating", "probation", "committing",
    "rolling_back",
]  # fmt: skip
Event = Literal[
    "offer", "install", "fetched", "verified", "rejected", "activate", "activated",
    "activation_failed", "passed", "failed", "abort", "committed", "rolled_back",
]  # fmt: skip

#: (state, event) -> next state. Anything else is an IllegalTransition.
TRANSITIONS: dict[tuple[State, Event], State] = {
    ("idle", "offer"): "fetching",
    ("idle", "install"): "verifying",
    ("fetching", "fetched"): "verifying",
    ("fetching", "rejected"): "idle",
    ("verifying", "verified"): "staged",
    ("verifying", "rejected"): "idle",
    ("staged", "activate"): "activating",
    ("staged", "rejected"): "idle",
    ("activating", "activated"): "probation",
    ("activating", "activation_failed"): "rolling_back",
    ("probation", "passed"): "committing",
    ("probation", "failed"): "rolling_back",
    ("probation", "abort"): "rolling_back",
    ("committing", "committed"): "idle",
    # Only at recovery: an agent build's commit was interrupted and the launcher has gone
    # back to the previous slot since (the new build failed its boots). Not committed.
    ("committing", "failed"): "rolling_back",
    ("rolling_back", "rolled_back"): "idle",
    # A committed version can be rolled back by hand (edge-agent ota rollback).
    ("idle", "abort"): "rolling_back",
}

#: How many superseded versions of each kind stay in the store for rollback.
KEEP_VERSIONS = 2


@dataclass(frozen=True)
class Installed:
    """One version of one kind, as the device knows it."""

    bundle_id: str
    kind: str
    version: str
    counter: int
    manifest_sha256: str
    #: payload name -> sha256 in the content store
    payloads: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {
            "bundle_id": self.bundle_id,
            "kind": self.kind,
            "version": self.version,
            "counter": self.counter,
            "manifest_sha256": self.manifest_sha256,
            "payloads": dict(self.payloads),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Installed:
        return cls(
            bundle_id=str(d["bundle_id"]),
            kind=str(d["kind"]),
            version=str(d["version"]),
            counter=int(d["counter"]),
            manifest_sha256=str(d["manifest_sha256"]),
            payloads={str(k): str(v) for k, v in dict(d["payloads"]).items()},
        )


@dataclass(frozen=True)
class Update:
    """The update in flight: what it is, where it came from, how far it got."""

    bundle_id: str
    kind: str = ""
    version: str = ""
    source: str = ""
    #: the candidate once verified
    target: Installed | None = None
    #: what was active before the switch (None: the factory version)
    replaced: Installed | None = None
    started_ns: int = 0
    step_ns: int = 0
    probation_s: int = 0
    #: the bundle's probation limits (ota.manifest.Probation fields), for a restart
    probation: dict[str, int] = field(default_factory=dict)
    reason: str = ""
    #: agent builds: the boot that activated it (probation runs in the next boot)
    boot_id: str = ""
    #: the device before the switch, for the regression rule (survives a restart)
    baseline_p50_us: float | None = None
    baseline_p99_us: float | None = None
    baseline_rss: int | None = None
    #: the rollback target did not come back: ``replaced`` is what serves instead (None:
    #: the factory version); a manual rollback records that, not its kept version
    fell_back: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "bundle_id": self.bundle_id,
            "kind": self.kind,
            "version": self.version,
            "source": self.source,
            "target": self.target.to_json() if self.target else None,
            "replaced": self.replaced.to_json() if self.replaced else None,
            "started_ns": self.started_ns,
            "step_ns": self.step_ns,
            "probation_s": self.probation_s,
            "probation": dict(self.probation),
            "reason": self.reason,
            "boot_id": self.boot_id,
            "baseline_p50_us": self.baseline_p50_us,
            "baseline_p99_us": self.baseline_p99_us,
            "baseline_rss": self.baseline_rss,
            "fell_back": self.fell_back,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Update:
        return cls(
            bundle_id=str(d["bundle_id"]),
            kind=str(d.get("kind", "")),
            version=str(d.get("version", "")),
            source=str(d.get("source", "")),
            target=Installed.from_json(d["target"]) if d.get("target") else None,
            replaced=Installed.from_json(d["replaced"]) if d.get("replaced") else None,
            started_ns=int(d.get("started_ns", 0)),
            step_ns=int(d.get("step_ns", 0)),
            probation_s=int(d.get("probation_s", 0)),
            probation={str(k): int(v) for k, v in dict(d.get("probation") or {}).items()},
            reason=str(d.get("reason", "")),
            boot_id=str(d.get("boot_id", "")),
            baseline_p50_us=_opt_float(d.get("baseline_p50_us")),
            baseline_p99_us=_opt_float(d.get("baseline_p99_us")),
            baseline_rss=_opt_int(d.get("baseline_rss")),
            fell_back=d.get("fell_back") is True,
        )


def _opt_float(v: object) -> float | None:
    return None if v is None else float(v)  # type: ignore[arg-type]


def _opt_int(v: object) -> int | None:
    return None if v is None else int(v)  # type: ignore[call-overload]


@dataclass(frozen=True)
class Outcome:
    """How the last update ended: ``committed``, ``rolled_back`` or ``failed``."""

    result: str
    bundle_id: str
    version: str
    reason: str
    t_ns: int

    def to_json(self) -> dict[str, Any]:
        return {
            "result": self.result,
            "bundle_id": self.bundle_id,
            "version": self.version,
            "reason": self.reason,
            "t_ns": self.t_ns,
        }


@dataclass(frozen=True)
class Journal:
    """The whole persisted state: the state, the update in flight, and per
    kind the **active** version (the pointer: what runs), the versions kept for rollback and
    the committed anti-rollback **floor**. The pointer switch is the ``activate`` transition
    itself, so "which version is live" and "where the update was" can never disagree: both
    are in one document, written atomically (:mod:`ota.journal`).
    """

    state: State = "idle"
    update: Update | None = None
    active: dict[str, Installed] = field(default_factory=dict)
    kept: dict[str, tuple[Installed, ...]] = field(default_factory=dict)
    floors: dict[str, int] = field(default_factory=dict)
    last: Outcome | None = None
    #: bumped at every transition: a cheap "did anything change" for readers
    generation: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "format": 1,
            "state": self.state,
            "update": self.update.to_json() if self.update else None,
            "active": {k: v.to_json() for k, v in self.active.items()},
            "kept": {k: [v.to_json() for v in vs] for k, vs in self.kept.items()},
            "floors": dict(self.floors),
            "last": self.last.to_json() if self.last else None,
            "generation": self.generation,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Journal:
        """The journal ``to_json`` wrote; anything else is a :class:`ValueError` that says
        what is wrong (a damaged journal must not pass for a consistent one)."""
        state = d.get("state", "idle")
        if state not in {s for s, _ in TRANSITIONS} | set(TRANSITIONS.values()):
            raise ValueError(f"journal: unknown state {state!r}")
        try:
            last = d.get("last")
            j = cls(
                state=state,
                update=Update.from_json(d["update"]) if d.get("update") else None,
                active={
                    str(k): Installed.from_json(v) for k, v in dict(d.get("active", {})).items()
                },
                kept={
                    str(k): tuple(Installed.from_json(v) for v in vs)
                    for k, vs in dict(d.get("kept", {})).items()
                },
                floors={str(k): int(v) for k, v in dict(d.get("floors", {})).items()},
                last=Outcome(**last) if last else None,
                generation=int(d.get("generation", 0)),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"journal: malformed ({type(exc).__name__}: {exc})") from None
        # What step() guarantees, checked again: recover() decides from these.
        if (state == "idle") != (j.update is None):
            raise ValueError(f"journal: state {state!r} with{'' if j.update else 'out'} an update")
        needs_target = state in ("staged", "activating", "probation", "committing")
        if needs_target and j.update is not None and j.update.target is None:
            raise ValueError(f"journal: state {state!r} without the verified target")
        return j

    def payloads_in_use(self) -> set[str]:
        """Every sha the store must keep: active, kept, and the update in flight."""
        shas: set[str] = set()
        for inst in self.active.values():
            shas |= set(inst.payloads.values())
        for vs in self.kept.values():
            for inst in vs:
                shas |= set(inst.payloads.values())
        if self.update is not None:
            for maybe in (self.update.target, self.update.replaced):
                if maybe is not None:
                    shas |= set(maybe.payloads.values())
        return shas


def _up(up: Update | None, event: str) -> Update:
    if up is None:
        raise IllegalTransition(f"OTA: {event!r} with no update in flight")
    return up


def _target(up: Update | None, event: str) -> Installed:
    tgt = _up(up, event).target
    if tgt is None:
        raise IllegalTransition(f"OTA: {event!r} before the bundle was verified")
    return tgt


def step(  # noqa: PLR0915 - the one transition function: the table's check and each event's effect
    j: Journal,
    event: Event,
    now_ns: int,
    *,
    update: Update | None = None,
    target: Installed | None = None,
    reason: str = "",
) -> Journal:
    """The journal after ``event``; raises :class:`IllegalTransition` if not allowed."""
    nxt = TRANSITIONS.get((j.state, event))
    if nxt is None:
        raise IllegalTransition(f"OTA: {event!r} is not accepted in state {j.state!r}")
    up = j.update
    active, kept, floors, last = dict(j.active), dict(j.kept), dict(j.floors), j.last

    if event in ("offer", "install"):
        if update is None:
            raise ValueError(f"{event} needs the update")
        up = replace(update, started_ns=now_ns)
    elif up is None and event != "abort":
        raise IllegalTransition(f"OTA: {event!r} with no update in flight")

    if event == "abort" and j.state == "idle":
        # A manual rollback of a committed version: the newest kept one of update.kind
        # comes back, or the factory version when none is kept (no target: nothing new
        # is involved). The floor stays: anti-rollback guards what may be *installed*.
        if update is None or not update.kind:
            raise ValueError("a rollback from idle needs update.kind")
        if update.kind not in active and not kept.get(update.kind):
            raise IllegalTransition(
                f"OTA: nothing to roll back: {update.kind} runs its factory version"
            )
        up = replace(update, target=None, replaced=None, started_ns=now_ns)
        reason = reason or "rollback requested"
    elif event == "verified":
        if target is None:
            raise ValueError("verified needs the target")
        up = replace(
            update or _up(up, event), target=target, kind=target.kind, version=target.version
        )
    elif event == "activate":
        # The pointer switch: from here on the new version is the live one.
        tgt = _target(up, event)
        up = replace(update or _up(up, event), replaced=active.get(tgt.kind))
        active[tgt.kind] = tgt
    elif event == "committed":
        tgt = _target(up, event)
        up = _up(up, event)
        kind = tgt.kind
        floors[kind] = max(floors.get(kind, -1), tgt.counter)
        if up.replaced is not None:
            older = tuple(v for v in kept.get(kind, ()) if v != up.replaced)
            kept[kind] = (up.replaced, *older)[:KEEP_VERSIONS]
        last = Outcome("committed", up.bundle_id, up.version, reason, now_ns)
        up = None
    elif event == "rolled_back":
        up = _up(up, event)
        if up.target is not None:
            kind = up.target.kind
            if up.replaced is not None:
                active[kind] = up.replaced
            else:
                active.pop(kind, None)
        elif up.fell_back:
            # A manual rollback whose kept version did not come back: record what the
            # fallback left serving (``replaced``; None is the factory version). The kept
            # list stays as it was: nothing new was installed or removed.
            if up.replaced is not None:
                active[up.kind] = up.replaced
            else:
                active.pop(up.kind, None)
        else:
            back = kept.get(up.kind, ())
            if back:
                active[up.kind] = back[0]
                kept[up.kind] = back[1:]
            else:
                # Nothing kept: the version before was the factory one (or is no longer
                # on the device), which is what runs when nothing is active.
                active.pop(up.kind, None)
        last = Outcome("rolled_back", up.bundle_id, up.version, up.reason or reason, now_ns)
        up = None
    elif event == "rejected":
        up = _up(up, event)
        last = Outcome("failed", up.bundle_id, up.version, reason, now_ns)
        up = None
    if up is not None:
        up = replace(up, step_ns=now_ns, reason=reason or up.reason)
    return Journal(nxt, up, active, kept, floors, last, j.generation + 1)


Action = Literal["none", "drop", "rollback", "continue_probation", "finish_commit",
                 "finish_rollback"]  # fmt: skip


def recover(j: Journal, *, running_agent_version: str | None = None) -> tuple[Action, str]:
    """What to do with the journal found at start, and why (for the status report).

    After a crash: an interrupted fetch/verify/stage is dropped (the old version never
    stopped serving); an interrupted activation or a probation of a model/config is rolled
    back (its evidence died with the process); a probation of an agent build continues (the
    restart is part of activating it); an interrupted commit or rollback is finished. For an
    agent build, probation and commit both first check which build runs: if it is not the new
    one, the launcher gave up on the new slot, and the update is rolled back (recorded so),
    never committed.
    """
    s = j.state
    if s == "idle":
        return "none", ""
    if s in ("fetching", "verifying", "staged"):
        return "drop", f"interrupted while {s} (the agent restarted); nothing was switched"
    up = j.update
    if s == "activating":
        return "rollback", "interrupted while activating (the agent restarted)"
    gave_up = _agent_gave_up(up, running_agent_version)
    if s == "probation":
        if gave_up:
            return "rollback", gave_up
        if up is not None and up.kind == "agent":
            return "continue_probation", "new agent build started; probation continues"
        return "rollback", "interrupted during probation (the agent restarted)"
    if s == "committing":
        if gave_up:
            return "rollback", f"{gave_up}; its interrupted commit is not finished"
        return "finish_commit", ""
    return "finish_rollback", ""


def _agent_gave_up(up: Update | None, running: str | None) -> str:
    """Why the agent build of ``up`` is not the one running ("" if it is, or unknown)."""
    if up is None or up.kind != "agent" or running is None or up.version == running:
        return ""
    return (
        f"agent {up.version} did not become healthy (running {running} again: the boot "
        "counter gave up on the new slot)"
    )
