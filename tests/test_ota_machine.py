"""The pure OTA state machine: every transition, what commit and rollback do to the versions,
recovery after a crash in each state, and the journal's JSON form."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import replace
from typing import Any, get_args

import pytest

from ota.errors import IllegalTransition
from ota.machine import (
    KEEP_VERSIONS,
    TRANSITIONS,
    Event,
    Installed,
    Journal,
    Outcome,
    State,
    Update,
    recover,
    step,
)

T0 = 1_700_000_000_000_000_000
STATES: tuple[State, ...] = get_args(State)
EVENTS: tuple[Event, ...] = get_args(Event)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def version(n: int, kind: str = "model") -> Installed:
    v = f"1.{n}.0"
    return Installed(
        bundle_id=f"{kind}-{n}",
        kind=kind,
        version=v,
        counter=n,
        manifest_sha256=sha(f"manifest {kind} {v}"),
        payloads={"model.tflite": sha(f"tflite {kind} {v}"), "model.json": sha(f"json {v}")},
    )


V0, V1, V2 = version(0), version(1), version(2)
OFFER = Update(bundle_id="model-2", source="https://fleet/b/model-2.efb")


def journal_in(state: State) -> Journal:
    """A consistent journal in ``state``: V1 committed over V0, V2 on its way."""
    base = Journal(active={"model": V1}, kept={"model": (V0,)}, floors={"model": 1})
    if state == "idle":
        return base
    if state in ("fetching", "verifying"):
        return replace(base, state=state, update=OFFER)
    target = replace(OFFER, target=V2, kind="model", version=V2.version)
    if state == "staged":
        return replace(base, state=state, update=target)
    return replace(base, state=state, update=replace(target, replaced=V1), active={"model": V2})


def kwargs(state: State, event: Event) -> dict[str, Any]:
    if event in ("offer", "install"):
        return {"update": OFFER}
    if event == "verified":
        return {"target": V2}
    if event == "abort" and state == "idle":
        return {"update": Update(bundle_id="manual", kind="model")}
    return {}


@pytest.mark.parametrize(
    ("state", "event", "expected"),
    [(s, e, n) for (s, e), n in TRANSITIONS.items()],
    ids=[f"{s}-{e}" for s, e in TRANSITIONS],
)
def test_every_allowed_transition(state: State, event: Event, expected: State) -> None:
    j = journal_in(state)
    nxt = step(j, event, T0 + 5, **kwargs(state, event))
    assert nxt.state == expected
    assert nxt.generation == j.generation + 1
    if expected == "idle":
        assert nxt.update is None
        assert nxt.last is not None
        assert nxt.last.t_ns == T0 + 5
    else:
        assert nxt.update is not None
        assert nxt.update.step_ns == T0 + 5


ILLEGAL = [(s, e) for s, e in itertools.product(STATES, EVENTS) if (s, e) not in TRANSITIONS]


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=[f"{s}-{e}" for s, e in ILLEGAL])
def test_every_other_transition_is_illegal(state: State, event: Event) -> None:
    j = journal_in(state)
    with pytest.raises(IllegalTransition, match=f"'{event}' is not accepted in state '{state}'"):
        step(j, event, T0, **kwargs(state, event))


def test_the_table_covers_every_state() -> None:
    assert {s for s, _ in TRANSITIONS} == set(STATES)
    assert set(TRANSITIONS.values()) <= set(STATES)
    assert len(ILLEGAL) == len(STATES) * len(EVENTS) - len(TRANSITIONS)


def test_events_that_need_their_data() -> None:
    idle = Journal()
    with pytest.raises(ValueError, match="offer needs the update"):
        step(idle, "offer", T0)
    with pytest.raises(ValueError, match="verified needs the target"):
        step(journal_in("verifying"), "verified", T0)
    with pytest.raises(ValueError, match=r"needs update\.kind"):
        step(journal_in("idle"), "abort", T0, update=Update(bundle_id="manual"))
    # A journal that says "staged" but lost its target cannot be activated.
    broken = replace(journal_in("staged"), update=OFFER)
    with pytest.raises(IllegalTransition, match="before the bundle was verified"):
        step(broken, "activate", T0)
    with pytest.raises(IllegalTransition, match="no update in flight"):
        step(Journal(state="fetching"), "fetched", T0)


def _run(j: Journal, target: Installed, *, fail: str | None = None) -> Journal:
    """offer -> ... -> commit (or rollback on ``fail``) of ``target``; returns the journal."""
    t = T0
    j = step(j, "offer", t, update=Update(bundle_id=target.bundle_id, source="http://fleet"))
    j = step(j, "fetched", t + 1)
    j = step(j, "verified", t + 2, target=target)
    j = step(j, "activate", t + 3)
    assert j.active[target.kind] == target  # the pointer switch is the activate step
    j = step(j, "activated", t + 4)
    if fail is not None:
        j = step(j, "failed", t + 5, reason=fail)
        return step(j, "rolled_back", t + 6)
    j = step(j, "passed", t + 5)
    return step(j, "committed", t + 6)


def test_first_update_over_the_factory_version_commits() -> None:
    j = _run(Journal(), V1)
    assert j.state == "idle"
    assert j.active == {"model": V1}
    assert j.floors == {"model": 1}
    assert j.kept == {}  # the factory version is not in the store
    assert j.last == Outcome("committed", "model-1", "1.1.0", "", T0 + 6)
    assert j.update is None


def test_commit_raises_the_floor_and_keeps_the_replaced_version() -> None:
    j = _run(journal_in("idle"), V2)
    assert j.active == {"model": V2}
    assert j.floors == {"model": 2}
    assert j.kept == {"model": (V1, V0)}


def test_at_most_keep_versions_are_kept() -> None:
    j = Journal()
    versions = [version(n) for n in range(1, 6)]
    for v in versions:
        j = _run(j, v)
    assert KEEP_VERSIONS == 2
    assert j.kept["model"] == (versions[3], versions[2])  # newest first
    assert j.floors == {"model": 5}
    in_use = j.payloads_in_use()
    assert set(versions[4].payloads.values()) <= in_use
    assert versions[1].payloads["model.tflite"] not in in_use
    assert versions[0].payloads["model.tflite"] not in in_use


def test_the_floor_never_goes_down() -> None:
    j = replace(journal_in("idle"), floors={"model": 9})
    assert _run(j, V2).floors == {"model": 9}


def test_kinds_are_independent() -> None:
    agent = version(7, kind="agent")
    j = _run(_run(journal_in("idle"), V2), agent)
    assert j.active == {"model": V2, "agent": agent}
    assert j.floors == {"model": 2, "agent": 7}
    assert j.kept == {"model": (V1, V0)}


def test_rollback_restores_the_replaced_version() -> None:
    before = journal_in("idle")
    j = _run(before, V2, fail="p99 1900 us over the 1500 us budget")
    assert j.active == {"model": V1}
    assert j.kept == before.kept
    assert j.floors == before.floors  # nothing was committed
    assert j.last == Outcome(
        "rolled_back", "model-2", "1.2.0", "p99 1900 us over the 1500 us budget", T0 + 6
    )


def test_activation_failure_rolls_back_too() -> None:
    j = step(journal_in("activating"), "activation_failed", T0, reason="model did not load")
    assert j.state == "rolling_back"
    j = step(j, "rolled_back", T0 + 1)
    assert j.active == {"model": V1}
    assert j.last is not None
    assert j.last.reason == "model did not load"


def test_rollback_to_the_factory_version_pops_the_active_one() -> None:
    j = _run(Journal(), V1, fail="no windows scored")
    assert j.active == {}
    assert j.floors == {}
    assert j.last is not None
    assert j.last.result == "rolled_back"


def test_abort_during_probation() -> None:
    j = step(journal_in("probation"), "abort", T0, reason="operator abort")
    j = step(j, "rolled_back", T0 + 1)
    assert j.active == {"model": V1}
    assert j.last is not None
    assert j.last.reason == "operator abort"


def test_rejected_bundle_changes_no_version() -> None:
    for state in ("fetching", "verifying", "staged"):
        before = journal_in(state)
        j = step(before, "rejected", T0, reason="bad_signature: manifest.json ...")
        assert (j.state, j.active, j.kept, j.floors) == (
            "idle",
            before.active,
            before.kept,
            {"model": 1},
        )
        assert j.last is not None
        assert (j.last.result, j.last.reason) == ("failed", "bad_signature: manifest.json ...")


def test_manual_rollback_from_idle_walks_back_the_kept_versions() -> None:
    manual = Update(bundle_id="manual", kind="model")
    j = replace(
        journal_in("idle"), active={"model": V2}, kept={"model": (V1, V0)}, floors={"model": 2}
    )
    j = step(j, "abort", T0, update=manual)
    assert j.state == "rolling_back"
    assert j.active == {"model": V2}  # nothing switched until the rollback is done
    j = step(j, "rolled_back", T0 + 1)
    assert (j.active, j.kept) == ({"model": V1}, {"model": (V0,)})
    assert j.floors == {"model": 2}  # the floor stays: downgrades stay refused
    assert j.last is not None
    assert (j.last.result, j.last.reason) == ("rolled_back", "rollback requested")
    j = step(step(j, "abort", T0 + 2, update=manual), "rolled_back", T0 + 3)
    assert (j.active, j.kept) == ({"model": V0}, {"model": ()})
    # Nothing kept: the factory version comes back.
    j = step(step(j, "abort", T0 + 4, update=manual), "rolled_back", T0 + 5)
    assert j.active == {}
    # And from the factory version there is nothing to roll back to.
    with pytest.raises(IllegalTransition, match="nothing to roll back: model runs its factory"):
        step(j, "abort", T0 + 6, update=manual)


def test_manual_rollback_after_the_first_update_restores_the_factory_version() -> None:
    j = _run(Journal(), V1)
    j = step(
        step(j, "abort", T0, update=Update(bundle_id="manual", kind="model")), "rolled_back", T0
    )
    assert j.active == {}
    assert j.floors == {"model": 1}


def test_payloads_in_use_include_the_update_in_flight() -> None:
    j = journal_in("probation")
    # active V2, kept V0, and the update's replaced V1 (no longer active but not yet kept)
    j = replace(j, kept={"model": (V0,)})
    assert j.payloads_in_use() == {s for v in (V0, V1, V2) for s in v.payloads.values()}
    assert step(step(j, "failed", T0), "rolled_back", T0).payloads_in_use() == {
        s for v in (V0, V1) for s in v.payloads.values()
    }


# -- recovery -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "action", "why"),
    [
        ("idle", "none", ""),
        ("fetching", "drop", "interrupted while fetching"),
        ("verifying", "drop", "interrupted while verifying"),
        ("staged", "drop", "nothing was switched"),
        ("activating", "rollback", "interrupted while activating"),
        ("probation", "rollback", "interrupted during probation"),
        ("committing", "finish_commit", ""),
        ("rolling_back", "finish_rollback", ""),
    ],
)
def test_recover_in_each_state(state: State, action: str, why: str) -> None:
    got, reason = recover(journal_in(state))
    assert got == action
    assert why in reason


def _agent_probation() -> Journal:
    agent = version(3, kind="agent")
    up = Update(bundle_id="agent-3", kind="agent", version=agent.version, target=agent)
    return Journal(state="probation", update=up, active={"agent": agent})


def test_recover_agent_probation_continues_in_the_new_build() -> None:
    assert recover(_agent_probation()) == (
        "continue_probation",
        "new agent build started; probation continues",
    )
    action, _ = recover(_agent_probation(), running_agent_version="1.3.0")
    assert action == "continue_probation"


def test_recover_agent_probation_rolls_back_when_the_old_build_runs() -> None:
    action, reason = recover(_agent_probation(), running_agent_version="1.2.0")
    assert action == "rollback"
    assert "agent 1.3.0 did not become healthy" in reason
    assert "running 1.2.0" in reason


def test_recover_agent_commit_finishes_in_the_new_build() -> None:
    committing = replace(_agent_probation(), state="committing")
    assert recover(committing, running_agent_version="1.3.0") == ("finish_commit", "")
    assert recover(committing) == ("finish_commit", "")  # nothing known about what runs


def test_recover_agent_commit_rolls_back_when_the_old_build_runs() -> None:
    # The new build passed, the commit was interrupted, and its next boots failed: the
    # launcher went back to the previous slot. Committing it now would record a lie.
    committing = replace(_agent_probation(), state="committing")
    action, reason = recover(committing, running_agent_version="1.2.0")
    assert action == "rollback"
    assert "agent 1.3.0 did not become healthy" in reason
    assert "running 1.2.0" in reason
    assert "not finished" in reason
    rolled = step(step(committing, "failed", T0, reason=reason), "rolled_back", T0 + 1)
    assert rolled.state == "idle"
    assert rolled.last is not None
    assert rolled.last.result == "rolled_back"
    assert rolled.floors == {}  # never raised for a build that did not commit
    assert "agent" not in rolled.active  # the factory build it replaced


# -- the journal's JSON ---------------------------------------------------------------------


@pytest.mark.parametrize("state", STATES)
def test_journal_json_round_trip(state: State) -> None:
    j = replace(
        journal_in(state),
        last=Outcome("committed", "model-1", "1.1.0", "", T0),
        generation=41,
    )
    text = json.dumps(j.to_json())
    back = Journal.from_json(json.loads(text))
    assert back == j
    assert back.to_json() == j.to_json()


def test_journal_json_round_trip_after_a_real_run() -> None:
    j = _run(_run(Journal(), V1), V2, fail="latency")
    assert Journal.from_json(json.loads(json.dumps(j.to_json()))) == j


def test_journal_from_json_refuses_an_unknown_state() -> None:
    with pytest.raises(ValueError, match="journal: unknown state 'exploding'"):
        Journal.from_json({"state": "exploding"})


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda d: d["active"]["model"].pop("counter"), r"malformed \(KeyError: 'counter'\)"),
        (lambda d: d["active"].update(model=[1]), r"malformed \(TypeError"),
        (lambda d: d["floors"].update(model="two"), r"malformed \(ValueError"),
        (lambda d: d.update(last={"result": "committed", "surprise": 1}), "malformed"),
        (lambda d: d.update(update=None), "state 'probation' without an update"),
        (lambda d: d["update"].update(target=None), "state 'probation' without the verified"),
        (lambda d: d.update(state="idle"), "state 'idle' with an update"),
    ],
)
def test_journal_from_json_refuses_a_damaged_journal(mutate: Any, why: str) -> None:
    d = json.loads(json.dumps(journal_in("probation").to_json()))
    mutate(d)
    with pytest.raises(ValueError, match=f"journal: {why}"):
        Journal.from_json(d)


def test_empty_journal_json_is_idle() -> None:
    assert Journal.from_json({}) == Journal()
