"""The launcher systemd runs: pick the slot, count the boot, exec the agent in the same PID.

::

    /opt/edge-agent/bin/python -P -m firmware.boot --slots /var/lib/edge-agent/slots \\
        -- run --config /etc/edge-agent/agent.toml

It always runs from the base install (the venv), never from a slot, so a broken agent build
cannot break the code that rolls it back. What each start does: :func:`main`. Design:
``docs/ARCHITECTURE.md``, "A/B slots".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from firmware.errors import StateFileError
from firmware.slots import ENTRY_POINT, Event, SlotName, Slots, SlotState, why_unusable

ENV_SLOT = "EDGEFLEET_SLOT"
BASE = "base"

# Runs in the new interpreter, started with -P so neither the working directory nor a
# script's directory lands on sys.path ahead of the slot. The slot directory comes as
# argv[1] and is never spliced into the code (no quoting). Inserted at sys.path[0], it comes
# before site-packages and before the path entries and finders of an editable install, so
# the slot's edge_agent, ota, ... and its edgefleet-*.dist-info (the version
# importlib.metadata reports) win over the base install's. PYTHONPATH would too, but it is
# inherited by every child the agent starts and is replaced by any Environment= in a drop-in.
BOOTSTRAP = (
    "import sys\n"
    "slot = sys.argv.pop(1)\n"
    "if slot:\n"
    "    sys.path.insert(0, slot)\n"
    "sys.argv[0] = 'edge-agent'\n"
    "from edge_agent.cli import main\n"
    "main()\n"
)


@dataclass(frozen=True)
class BootDecision:
    slot: SlotName | None  # None: the base install
    state: SlotState  # to persist before running (equal to the input when nothing changed)
    reason: str  # one line for the journal
    event: Event | None = None  # set when this boot rolled back or fell back


def decide_boot(
    state: SlotState, *, now: float, present: frozenset[SlotName] = frozenset({"a", "b"})
) -> BootDecision:
    """Which slot this boot runs and the state to persist first. Pure: no I/O, no clock.

    ``present`` holds the slots whose directory is runnable (:meth:`Slots.present`).
    """
    cur = state.active
    if cur is None:
        return BootDecision(None, state, "no agent build active in a slot: the base install")
    info = state.slot(cur)
    label = info.label(cur)
    if cur not in present:
        return _fall_back(
            state, now, present, f"slot {label} is damaged ({'/'.join(ENTRY_POINT)} missing)"
        )
    if info.status == "trying":
        if state.boot_count >= state.max_boots:
            return _fall_back(
                state,
                now,
                present,
                f"slot {label} did not become healthy in {state.boot_count} boots",
            )
        n = state.boot_count + 1
        return BootDecision(
            cur,
            dataclasses.replace(state, boot_count=n),
            f"slot {label} on probation: boot {n} of {state.max_boots}",
        )
    # good, or bad after a rollback that had nowhere to go (Slots.rollback): runs uncounted.
    return BootDecision(cur, state, f"slot {label} ({info.status})")


def _fall_back(
    state: SlotState, now: float, present: frozenset[SlotName], why: str
) -> BootDecision:
    cur = state.active
    assert cur is not None
    failed = state.slot(cur)
    bad = state.with_slot(cur, dataclasses.replace(failed, status="bad"))
    prev = state.previous
    why_not = why_unusable(state, prev, present)
    if why_not is None and prev is not None:
        back = state.slot(prev)
        event = Event("rolled_back", why, now, cur, failed.version, f"{prev} {back.version}")
        new = dataclasses.replace(bad, active=prev, previous=None, boot_count=0, last_event=event)
        return BootDecision(prev, new, f"{why}: back to slot {back.label(prev)}", event)
    # Staying on the failed build would be systemd restarting it forever; the base install
    # (the venv this launcher runs from) is the one build that is always there.
    event = Event("fell_back_to_base", f"{why}; {why_not}", now, cur, failed.version, BASE)
    new = dataclasses.replace(bad, active=None, previous=None, boot_count=0, last_event=event)
    return BootDecision(None, new, f"{why}; {why_not}: running the base install", event)


def slot_env(slot: SlotName | None, state: SlotState) -> str:
    """The ``EDGEFLEET_SLOT`` value: ``"<slot>:<version>"`` or ``"base"``."""
    return BASE if slot is None else f"{slot}:{state.slot(slot).version}"


def parse_slot_env(value: str | None) -> tuple[str, str | None]:
    """``EDGEFLEET_SLOT`` back to (slot, version); (``"base"``, None) when unset or base."""
    if not value or value == BASE:
        return BASE, None
    slot, _, version = value.partition(":")
    return slot, version or None


def exec_argv(slot_dir: Path | None, agent_args: list[str]) -> list[str]:
    """The argv the launcher execs: this interpreter running the slot's (or base) agent CLI."""
    return [
        sys.executable,
        "-P",
        "-c",
        BOOTSTRAP,
        "" if slot_dir is None else str(slot_dir),
        *agent_args,
    ]


def _log(line: str) -> None:
    print(f"edge-agent boot: {line}", file=sys.stderr, flush=True)


def _boot(root: Path, now: float) -> BootDecision:
    slots = Slots(root)
    if not root.is_dir():
        # A fresh device: nothing installed yet, and nothing to create for it.
        return BootDecision(None, SlotState(), f"no {root}: the base install")
    with slots.locked():
        slots.sweep()
        try:
            state = slots.load()
        except StateFileError as exc:
            _log(f"{exc}; moving it aside to {slots.state_path.name}.corrupt")
            state = slots.reset_state(str(exc), now=now)
        present = slots.present()
        decision = decide_boot(state, now=now, present=present)
        if decision.state != state:
            try:
                slots.save(decision.state)
            except StateFileError as exc:
                # A boot that cannot be counted is not given to an unproven build.
                if (
                    decision.slot is not None
                    and decision.state.slot(decision.slot).status == "trying"
                ):
                    prev = state.previous
                    safe = prev if why_unusable(state, prev, present) is None else None
                    decision = BootDecision(
                        safe, state, f"{exc}: boot not counted, running {slot_env(safe, state)}"
                    )
                else:
                    decision = dataclasses.replace(decision, reason=f"{decision.reason} ({exc})")
    return decision


def main(argv: list[str] | None = None) -> NoReturn:
    """Pick the slot, count the boot and exec the agent; never returns.

    Each start:

    1. takes the slots' lock, sweeps what a killed install left (``.staging-*``, ``.trash-*``);
    2. reads state.json (a corrupt one is moved aside and the base install runs, see
       :mod:`firmware.slots`);
    3. :func:`decide_boot` (pure) picks the slot and the new state: a ``trying`` build gets its
       boot counted, one that used up ``max_boots`` is marked ``bad`` and the previous good slot
       runs again (no previous: the base install), the reason kept in ``last_event`` for the
       agent to report;
    4. persists the new state durably, *then* ``os.execve``\\ s the interpreter with the slot
       directory first on ``sys.path``, so systemd's ``Type=notify`` and watchdog see the
       agent as the service's main PID. ``EDGEFLEET_SLOT`` tells the agent what it runs
       (``a:0.2.0``, or ``base``).

    stdlib and ``firmware`` only (``firmware.slots`` imports zipfile and packaging lazily), so a
    start costs a few milliseconds before the agent's own imports.
    """
    args = sys.argv[1:] if argv is None else argv
    own, agent_args = (
        (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
    )
    parser = argparse.ArgumentParser(
        prog="python -m firmware.boot",
        description="Pick the agent's A/B slot, count the boot, exec edge-agent with ARGS.",
        epilog="usage: python -m firmware.boot --slots DIR -- ARGS (edge-agent's arguments)",
    )
    parser.add_argument("--slots", type=Path, required=True, help="the slots directory")
    opts = parser.parse_args(own)
    root: Path = opts.slots
    try:
        decision = _boot(root, time.time())
    except (StateFileError, OSError) as exc:
        # Could neither read nor rewrite state.json (read-only, I/O error): nothing about
        # the slots can be trusted or recorded, so run the base install and say so.
        decision = BootDecision(None, SlotState(), f"{exc}: running the base install")
    _log(decision.reason)
    env = dict(os.environ)
    env[ENV_SLOT] = slot_env(decision.slot, decision.state)
    slot_dir = None if decision.slot is None else root / decision.slot
    argv_new = exec_argv(slot_dir, agent_args)
    try:
        os.execve(argv_new[0], argv_new, env)  # noqa: S606  (our own interpreter, argv as a list)
    except OSError as exc:
        _log(f"cannot exec {argv_new[0]}: {exc.strerror}")
    raise SystemExit(1)


if __name__ == "__main__":
    main()
