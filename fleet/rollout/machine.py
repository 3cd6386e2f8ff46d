"""A rollout as a pure state machine: status reports and the clock in, commands out.

The orchestrator (:mod:`fleet.rollout.orchestrator`) feeds it the devices' ``ota/status``
reports (:func:`on_status`) and the time (:func:`tick`); everything it decides is here, so
it is tested without a broker or a sleep: waves and their success gate, the failure
threshold, the regression check, retries of transient failures, timeouts (offline vs
silent devices), dedupe on ``(boot_id, seq)``, reports older than the latest offer, pause,
resume and abort (a halt, like an abort, rolls back the devices in flight). The rules and
why: ``docs/ARCHITECTURE.md``, section "Rollouts".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

RolloutState = Literal["running", "paused", "halted", "aborted", "completed"]
DeviceState = Literal[
    "waiting", "offered", "in_progress", "committed", "failed", "rolled_back", "timed_out",
    "aborted",
]  # fmt: skip
FINISHED = frozenset({"committed", "failed", "rolled_back", "timed_out"})
FAILURES = frozenset({"failed", "rolled_back"})
#: Device OTA states (ota.machine) that mean "working on it".
IN_PROGRESS = frozenset(
    {"fetching", "verifying", "staged", "activating", "probation", "committing", "rolling_back"}
)
#: Device OTA states after the new version started running: silence from here on is
#: likely the update's doing (an agent it killed), not a network that went away.
RUNNING_NEW = frozenset({"activating", "probation", "committing", "rolling_back"})
#: Failure codes worth another offer (ota.errors codes; the device says ``permanent`` too).
TRANSIENT = frozenset({"fetch", "fetch_stalled", "interrupted", "busy", "storage", "apply"})


@dataclass(frozen=True)
class Params:
    waves: tuple[float, ...] = (0.01, 0.1, 0.5, 1.0)
    max_failure: float = 0.05
    min_devices: int = 5
    success_gate: float = 0.95
    device_timeout_s: float = 300.0
    max_attempts: int = 3
    retry_backoff_s: float = 5.0
    p99_regression_pct: float = 15.0
    memory_regression_pct: float = 10.0


@dataclass(frozen=True)
class DeviceRun:
    device: str
    wave: int
    state: DeviceState = "waiting"
    attempts: int = 0
    offered_ns: int = 0
    next_offer_ns: int = 0
    boot_id: str = ""
    seq: int = -1
    reason: str = ""
    code: str = ""
    regressed: bool = False
    #: Rollback was sent because the device regressed (sent once, not on every tick).
    rollback_sent: bool = False
    #: Boot ids this device reported under before ``boot_id`` (newest last, bounded).
    old_boots: tuple[str, ...] = ()
    #: Timed out after reporting the new version running (not merely offline): a failure.
    silent: bool = False
    #: The device's ``t_ns`` of the newest report applied: orders a boot id never seen
    #: against ``boot_id`` (0: nothing applied yet, or a document from before this field).
    t_ns: int = 0
    #: ``offered_ns`` of the offer the orchestrator handed to the broker (its record, saved
    #: after the send): an offer saved but never marked sent is held by the next leader and
    #: sent again if the device stays silent (fleet.rollout.held). 0: not known to be sent.
    sent_ns: int = 0


@dataclass(frozen=True)
class Command:
    action: Literal["offer", "rollback"]
    device: str


@dataclass(frozen=True)
class Rollout:
    id: str
    bundle_id: str
    version: str
    kind: str
    sha256: str
    length: int
    params: Params
    waves: tuple[tuple[str, ...], ...]
    devices: dict[str, DeviceRun]
    state: RolloutState = "running"
    wave: int = -1
    created_ns: int = 0
    updated_ns: int = 0
    reason: str = ""
    history: tuple[tuple[int, str], ...] = ()

    # -- views ------------------------------------------------------------------------------

    def counts(self, wave: int | None = None) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.devices.values():
            if wave is None or d.wave == wave:
                out[d.state] = out.get(d.state, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["waves"] = [list(w) for w in self.waves]
        doc["params"]["waves"] = list(self.params.waves)
        doc["history"] = [list(h) for h in self.history]
        return doc

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Rollout:
        params = dict(d["params"])
        params["waves"] = tuple(params["waves"])
        return cls(
            id=d["id"],
            bundle_id=d["bundle_id"],
            version=d["version"],
            kind=d["kind"],
            sha256=d["sha256"],
            length=int(d["length"]),
            params=Params(**params),
            waves=tuple(tuple(w) for w in d["waves"]),
            devices={
                k: DeviceRun(**{**v, "old_boots": tuple(v.get("old_boots", ()))})
                for k, v in d["devices"].items()
            },
            state=d["state"],
            wave=int(d["wave"]),
            created_ns=int(d["created_ns"]),
            updated_ns=int(d["updated_ns"]),
            reason=d.get("reason", ""),
            history=tuple((int(t), str(m)) for t, m in d.get("history", [])),
        )


MAX_HISTORY = 200
#: Boot ids remembered per device to refuse replays from earlier boots; a device that
#: reboots more often than this during one rollout is not worth a longer memory.
MAX_OLD_BOOTS = 8


def _log(r: Rollout, now_ns: int, text: str, **changes: Any) -> Rollout:
    history = (*r.history, (now_ns, text))[-MAX_HISTORY:]
    return replace(r, history=history, updated_ns=now_ns, **changes)


def create(
    rollout_id: str,
    *,
    bundle_id: str,
    version: str,
    kind: str,
    sha256: str,
    length: int,
    waves: list[list[str]],
    params: Params,
    now_ns: int,
) -> Rollout:
    """A running rollout of ``waves`` (as :func:`fleet.rollout.plan.plan` makes them); the
    first :func:`tick` offers wave 1. Raises ValueError for a device in two waves."""
    devices: dict[str, DeviceRun] = {}
    for k, names in enumerate(waves):
        for name in names:
            if name in devices:
                raise ValueError(
                    f"rollout {rollout_id}: device {name} is in waves "
                    f"{devices[name].wave + 1} and {k + 1}"
                )
            devices[name] = DeviceRun(device=name, wave=k)
    r = Rollout(
        id=rollout_id,
        bundle_id=bundle_id,
        version=version,
        kind=kind,
        sha256=sha256,
        length=length,
        params=params,
        waves=tuple(tuple(w) for w in waves),
        devices=devices,
        created_ns=now_ns,
        updated_ns=now_ns,
    )
    sizes = "/".join(str(len(w)) for w in waves)
    return _log(r, now_ns, f"created: {len(devices)} devices in {len(waves)} waves ({sizes})")


def on_status(
    r: Rollout,
    *,
    device: str,
    boot_id: str,
    seq: int,
    bundle_id: str,
    state: str,
    reason: str,
    detail: dict[str, Any],
    t_ns: int,
    received_ns: int,
    now_ns: int,
) -> Rollout:
    """Apply one ``ota/status`` report; anything stale, foreign or duplicated is ignored.

    ``t_ns`` is the device's own time of the report, ``received_ns`` the fleet's time of
    arrival (the store's stamp, the same clock as ``now_ns`` and the offers).
    """
    d = r.devices.get(device)
    if d is None or bundle_id != r.bundle_id or d.state == "aborted":
        return r
    if d.state == "waiting" and d.attempts == 0:
        return r  # not offered yet: whatever it says is not about this rollout's offer
    if received_ns < d.offered_ns:
        # Stored before the latest offer: a report of an earlier rollout of this bundle
        # (its boot id would displace the device's real one) or of the attempt before a
        # retry, which is judged already. Reports are read again from the store after a
        # restart, so this is no corner case.
        return r
    if (boot_id == d.boot_id and seq <= d.seq) or boot_id in d.old_boots:
        # A duplicate or a replay of something already applied, or a redelivery from a
        # boot before the one the device reports from now (the outbox sends the old boot's
        # rows first, so anything of it arriving later is older than what we have).
        return r
    if boot_id != d.boot_id and d.boot_id and t_ns < d.t_ns:
        # A boot id never seen, but older than the report applied last: a late report from
        # a boot before the one we know (it was never applied, so it is not in old_boots),
        # not a new boot. Not remembered as old: if this is a real new boot whose clock is
        # behind, its later reports take over once they are newer.
        return r
    if boot_id != d.boot_id and d.boot_id:
        d = replace(d, old_boots=(*d.old_boots, d.boot_id)[-MAX_OLD_BOOTS:])
    d = replace(d, boot_id=boot_id, seq=seq, t_ns=max(t_ns, d.t_ns))
    if d.state == "waiting":
        # A retry is due: the attempt before is judged already. The report still moves the
        # order on, so a redelivery of it after the next offer is known as old.
        devices = dict(r.devices)
        devices[device] = d
        return replace(r, devices=devices, updated_ns=now_ns)
    code = str(detail.get("code", ""))
    if state in IN_PROGRESS:
        if d.state not in FINISHED:
            # The reason says how far it got (shown if it goes silent from here).
            d = replace(d, state="in_progress", reason=state)
    elif state == "committed":
        d = replace(d, state="committed", reason=reason, regressed=_regressed(r.params, detail))
    elif state == "rolled_back":
        d = replace(d, state="rolled_back", reason=reason, code=code or "probation_failed")
    elif state == "failed":
        permanent = bool(detail.get("permanent", code not in TRANSIENT))
        if code == "already_installed":
            # The device has this version committed already: that is a success.
            d = replace(d, state="committed", reason=reason, code=code)
        elif not permanent and d.attempts < r.params.max_attempts:
            backoff = r.params.retry_backoff_s * 2 ** (d.attempts - 1)
            d = replace(
                d,
                state="waiting",
                reason=reason,
                code=code,
                next_offer_ns=now_ns + int(backoff * 1e9),
            )
        else:
            d = replace(d, state="failed", reason=reason, code=code)
    else:
        return r
    devices = dict(r.devices)
    devices[device] = d
    return replace(r, devices=devices, updated_ns=now_ns)


#: A P99 is compared only over this many windows; a median over at least REGRESSION_MIN.
P99_MIN_WINDOWS = 100
REGRESSION_MIN_WINDOWS = 20
#: Latency differences below this are noise on a gateway, whatever the percentage.
SLACK_US = 50.0


def _regressed(p: Params, detail: dict[str, Any]) -> bool:
    """The regression check on one committed device's own before/after figures.

    A P99 over a probation of a few seconds is a maximum of a few windows: it is compared
    (``p99_regression_pct``) only over :data:`P99_MIN_WINDOWS` windows or more, otherwise
    the median is, over at least :data:`REGRESSION_MIN_WINDOWS`; fewer windows say nothing.
    """

    def num(key: str) -> float | None:
        v = detail.get(key)
        if not isinstance(v, int | float) or isinstance(v, bool):
            return None
        try:
            f = float(v)
        except OverflowError:  # an integer past float range: not a figure
            return None
        return f if math.isfinite(f) else None

    windows = num("windows") or 0
    grow = 1 + p.p99_regression_pct / 100
    key = "p99_us" if windows >= P99_MIN_WINDOWS else "p50_us"
    now, base = num(key), num(f"baseline_{key}")
    judged = windows >= REGRESSION_MIN_WINDOWS and now is not None and base
    if judged and now is not None and base and now > max(base * grow, base + SLACK_US):
        return True
    rss, base_rss = num("rss_bytes"), num("baseline_rss")
    return bool(
        rss is not None and base_rss and rss > base_rss * (1 + p.memory_regression_pct / 100)
    )


def _share(fraction: float, n: int) -> float:
    """``fraction * n`` for a fraction written as a decimal percentage: in floats
    ``0.55 * 100`` is ``55.00000000000001`` (55 of 100 would miss a 55 % gate) and
    ``0.29 * 100`` is ``28.999999999999996`` (29 of 100 would pass a 29 % threshold)."""
    return round(fraction * n, 9)


def _offer(r: Rollout, names: list[str], now_ns: int) -> tuple[Rollout, list[Command]]:
    devices = dict(r.devices)
    cmds: list[Command] = []
    for name in names:
        d = devices[name]
        devices[name] = replace(d, state="offered", attempts=d.attempts + 1, offered_ns=now_ns)
        cmds.append(Command("offer", name))
    return replace(r, devices=devices), cmds


def tick(r: Rollout, now_ns: int) -> tuple[Rollout, list[Command]]:
    """Time passes: timeouts, retries, the halting rules and the next wave.

    A halted, completed or aborted rollout offers nothing more, but a device of it that
    commits a regression late (it was in flight or timed out, or the abort came before the
    tick that would have caught it) is still told to roll back: keep ticking it while
    devices may report late.
    """
    if r.state in ("halted", "completed", "aborted"):
        return _roll_back_regressed(r, now_ns)
    cmds: list[Command] = []
    p = r.params
    # Timeouts: an offer that got no final answer in time does not hold its wave.
    devices = dict(r.devices)
    for name, d in devices.items():
        if (
            d.state in ("offered", "in_progress")
            and now_ns - d.offered_ns > p.device_timeout_s * 1e9
        ):
            silent = d.state == "in_progress" and d.reason in RUNNING_NEW
            devices[name] = replace(
                d,
                state="timed_out",
                silent=silent,
                reason=(
                    f"no answer {p.device_timeout_s:g} s after the offer (offline?)"
                    if d.state == "offered"
                    else f"no final status {p.device_timeout_s:g} s after the offer (last "
                    f"reported: {d.reason}{'; went silent running the update' if silent else ''})"
                ),
            )
    r = replace(r, devices=devices)

    # Halting rules, over every device so far.
    regressed = [d for d in r.devices.values() if d.state == "committed" and d.regressed]
    failed = [d for d in r.devices.values() if _failed(d)]
    finished = [d for d in r.devices.values() if _counted(d)]
    why = ""
    if regressed:
        names = ", ".join(sorted(d.device for d in regressed)[:5])
        why = f"regression check tripped on {len(regressed)} device(s) ({names})"
    elif len(finished) >= p.min_devices and len(failed) > _share(p.max_failure, len(finished)):
        first = min(failed, key=lambda d: d.device)
        why = (
            f"{len(failed)} of {len(finished)} finished devices failed "
            f"(more than {p.max_failure:.0%}); {first.device}: {first.reason}"
        )
    if why:
        return _halt(r, now_ns, why, cmds)

    if r.state == "paused":
        return r, cmds

    # Retries that are due.
    due = [
        d.device
        for d in r.devices.values()
        if d.state == "waiting" and d.attempts > 0 and d.next_offer_ns <= now_ns
    ]
    if due:
        r, more = _offer(r, sorted(due), now_ns)
        cmds += more

    # The current wave: done? gate met? then the next one.
    if r.wave >= 0:
        wave = [r.devices[n] for n in r.waves[r.wave]]
        if not all(d.state in FINISHED for d in wave):
            return r, cmds
        answered = [d for d in wave if _counted(d)]
        ok = sum(d.state == "committed" for d in answered)
        if not answered or ok < _share(p.success_gate, len(answered)):
            why = (
                f"wave {r.wave + 1}: {ok} of {len(answered)} answering devices committed "
                f"(gate {p.success_gate:.0%}; {len(wave) - len(answered)} never answered)"
            )
            return _halt(r, now_ns, why, cmds)
        r = _log(r, now_ns, f"wave {r.wave + 1} passed: {ok}/{len(wave)} committed")
    if r.wave + 1 >= len(r.waves):
        return _log(r, now_ns, "completed", state="completed"), cmds
    nxt = r.wave + 1
    r, more = _offer(replace(r, wave=nxt), list(r.waves[nxt]), now_ns)
    return _log(r, now_ns, f"wave {nxt + 1} started: {len(r.waves[nxt])} device(s)"), cmds + more


def _failed(d: DeviceRun) -> bool:
    return d.state in FAILURES or (d.state == "timed_out" and d.silent)


def _counted(d: DeviceRun) -> bool:
    """Finished and counted by the gate and the threshold: all but the never-answered."""
    return d.state in FINISHED and (d.state != "timed_out" or d.silent)


def _halt(r: Rollout, now_ns: int, why: str, cmds: list[Command]) -> tuple[Rollout, list[Command]]:
    """Halt: rollback to the regressed devices and to every device still in flight.

    A device that was offered the bundle and has not finished would otherwise go on to
    install what tripped the halt. Sent once: a halted rollout is not halted again. The
    device's state stays (offered, in progress): its answer still counts (a regressed
    commit that raced the rollback is still told to roll back), and an abort of the halted
    rollout sends rollback again, as it did before.
    """
    r = _log(r, now_ns, f"halted: {why}", state="halted", reason=why)
    r, more = _roll_back_regressed(r, now_ns, log=False)
    flying = sorted(n for n, d in r.devices.items() if d.state in ("offered", "in_progress"))
    if flying:
        shown = ", ".join(flying[:5]) + (", ..." if len(flying) > 5 else "")
        r = _log(r, now_ns, f"rollback sent to {len(flying)} device(s) in flight: {shown}")
    return r, cmds + more + [Command("rollback", name) for name in flying]


def _roll_back_regressed(
    r: Rollout, now_ns: int, *, log: bool = True
) -> tuple[Rollout, list[Command]]:
    """Rollback to every committed device that regressed and was not told yet."""
    due = sorted(
        name
        for name, d in r.devices.items()
        if d.state == "committed" and d.regressed and not d.rollback_sent
    )
    if not due:
        return r, []
    devices = dict(r.devices)
    for name in due:
        devices[name] = replace(devices[name], rollback_sent=True)
    r = replace(r, devices=devices)
    if log:
        r = _log(r, now_ns, f"rollback sent to {len(due)} regressed device(s): {', '.join(due)}")
    return r, [Command("rollback", name) for name in due]


def pause(r: Rollout, now_ns: int) -> Rollout:
    if r.state != "running":
        return r
    return _log(r, now_ns, "paused", state="paused")


def resume(r: Rollout, now_ns: int) -> Rollout:
    """Only a paused rollout resumes: a halt is final (its failures would trip it again);
    fix what failed and create a new rollout."""
    if r.state != "paused":
        return r
    return _log(r, now_ns, "resumed", state="running", reason="")


def abort(r: Rollout, now_ns: int) -> tuple[Rollout, list[Command]]:
    if r.state in ("aborted", "completed"):
        return r, []
    devices = dict(r.devices)
    cmds: list[Command] = []
    for name, d in devices.items():
        if d.state in ("offered", "in_progress"):
            cmds.append(Command("rollback", name))
            devices[name] = replace(d, state="aborted", reason="rollout aborted")
        elif d.state == "waiting":
            devices[name] = replace(d, state="aborted", reason="rollout aborted")
    r = replace(r, devices=devices)
    text = f"aborted: rollback sent to {len(cmds)} device(s) in flight"
    return _log(r, now_ns, text, state="aborted", reason="aborted by the operator"), cmds
