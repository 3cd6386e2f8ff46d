"""The pure rollout state machine, driven by a simulated clock and device status reports.

Reports are shaped like the agent's ``ota/status`` (edge_agent.ota.flush_reports): the
device's OTA state while it works, the outcome (``committed``, ``rolled_back``, ``failed``)
once it is idle, ``detail.code`` / ``detail.permanent`` for failures and the probation
figures with a commit. Nothing sleeps: time is ``Sim.now``.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from fleet.rollout.machine import (
    FINISHED,
    Command,
    Params,
    Rollout,
    abort,
    create,
    on_status,
    pause,
    resume,
    tick,
)
from fleet.rollout.plan import Candidate, plan

T0 = 1_800_000_000_000_000_000
S = 1_000_000_000  # ns per second
BUNDLE = "model-7"
WORKING = ("fetching", "verifying", "staged", "activating", "probation", "committing")


def figures(
    *,
    windows: int = 300,
    p50: float = 1000.0,
    p99: float = 2000.0,
    rss: int = 100_000_000,
    base_p50: float | None = 1000.0,
    base_p99: float | None = 2000.0,
    base_rss: int | None = 100_000_000,
) -> dict[str, Any]:
    """The probation figures a device reports with its commit (ota.updater._probation)."""
    return {
        "windows": windows,
        "p50_us": p50,
        "p99_us": p99,
        "rss_bytes": rss,
        "baseline_p50_us": base_p50,
        "baseline_p99_us": base_p99,
        "baseline_rss": base_rss,
    }


def new_rollout(
    waves: list[list[str]], params: Params | None = None, *, rid: str = "r1"
) -> Rollout:
    return create(
        rid,
        bundle_id=BUNDLE,
        version="1.7.0",
        kind="model",
        sha256="ab" * 32,
        length=4096,
        waves=waves,
        params=params or Params(),
        now_ns=T0,
    )


def names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(n)]


@dataclass
class Sim:
    """One rollout, a clock, and each device's reporting session (boot id, next seq)."""

    r: Rollout
    now: int = T0
    boots: dict[str, str] = field(default_factory=dict)
    seqs: dict[str, int] = field(default_factory=dict)
    sent: list[tuple[int, Command]] = field(default_factory=list)

    def tick(self, after_s: float = 0.0) -> list[Command]:
        self.now += int(after_s * S)
        self.r, cmds = tick(self.r, self.now)
        self.sent += [(self.now, c) for c in cmds]
        return cmds

    def say(
        self,
        device: str,
        state: str,
        *,
        detail: dict[str, Any] | None = None,
        bundle_id: str = BUNDLE,
        reason: str = "",
    ) -> Rollout:
        boot = self.boots.setdefault(device, f"boot-{device}-0")
        seq = self.seqs.get(device, 0)
        self.seqs[device] = seq + 1
        self.r = on_status(
            self.r,
            device=device,
            boot_id=boot,
            seq=seq,
            bundle_id=bundle_id,
            state=state,
            reason=reason,
            detail=detail or {},
            t_ns=self.now,
            received_ns=self.now,
            now_ns=self.now,
        )
        return self.r

    def reboot(self, device: str) -> None:
        n = int(self.boots.get(device, f"boot-{device}-0").rsplit("-", 1)[1]) + 1
        self.boots[device] = f"boot-{device}-{n}"
        self.seqs[device] = 0

    def commit(self, device: str, **fig: Any) -> None:
        for st in WORKING:
            self.say(device, st)
        self.say(device, "committed", detail=figures(**fig), reason="probation passed")

    def fail(self, device: str, code: str, *, permanent: bool | None) -> None:
        self.say(device, "fetching")
        detail: dict[str, Any] = {"code": code}
        if permanent is not None:
            detail["permanent"] = permanent
        self.say(device, "failed", detail=detail, reason=f"{code} failure")

    def probation_fails(self, device: str) -> None:
        for st in WORKING[:-1]:
            self.say(device, st)
        self.say(device, "rolling_back", detail={"code": "probation_failed", **figures()})
        self.say(device, "rolled_back", reason="p99 over budget")

    def offers(self) -> list[str]:
        return [c.device for _, c in self.sent if c.action == "offer"]

    def state(self, device: str) -> str:
        return self.r.devices[device].state

    def phase(self) -> str:
        """The rollout's state, as a plain str (mypy narrows ``sim.r.state`` otherwise)."""
        return self.r.state


def offers(cmds: list[Command]) -> list[str]:
    assert all(c.action == "offer" for c in cmds), cmds
    return [c.device for c in cmds]


def halts(r: Rollout) -> list[str]:
    return [text for _, text in r.history if text.startswith("halted")]


# -- the good path ---------------------------------------------------------------------------


def test_good_model_rolls_out_wave_by_wave() -> None:
    devices = [Candidate(f"gw{i:03d}", site="a", device_type="gw") for i in range(100)]
    waves = plan("r1", devices, {}, (0.01, 0.1, 0.5, 1.0))
    sim = Sim(new_rollout(waves))
    assert sim.r.state == "running"
    assert sim.r.wave == -1
    assert sim.r.history[-1][1] == "created: 100 devices in 4 waves (1/9/40/50)"

    for k, wave in enumerate(waves):
        assert sorted(offers(sim.tick(1))) == sorted(wave)
        assert sim.r.wave == k
        assert all(sim.state(d) == "offered" for d in wave)
        assert sim.r.history[-1][1] == f"wave {k + 1} started: {len(wave)} device(s)"
        # Devices work; the next wave waits until every device of this one finished.
        for d in wave[:-1]:
            sim.commit(d)
        sim.say(wave[-1], "probation")
        assert sim.state(wave[-1]) == "in_progress"
        assert sim.tick(10) == []
        assert sim.r.wave == k
        sim.say(wave[-1], "committing")
        sim.say(wave[-1], "committed", detail=figures())
        assert sim.r.counts(k) == {"committed": len(wave)}

    assert sim.tick(1) == []
    assert sim.phase() == "completed"
    assert [t for _, t in sim.r.history if t.startswith("wave") and "passed" in t] == [
        "wave 1 passed: 1/1 committed",
        "wave 2 passed: 9/9 committed",
        "wave 3 passed: 40/40 committed",
        "wave 4 passed: 50/50 committed",
    ]
    assert sorted(sim.offers()) == sorted(d.device for d in devices)
    assert all(d.attempts == 1 for d in sim.r.devices.values())
    # A completed rollout sends nothing more, whatever comes in.
    sim.say(waves[0][0], "failed", detail={"code": "fetch", "permanent": False})
    assert sim.tick(1000) == []


def test_next_wave_only_after_every_device_of_this_one_finished() -> None:
    sim = Sim(new_rollout([names("a", 3), names("b", 3)]))
    sim.tick()
    sim.commit("a000")
    sim.commit("a001")
    for st in WORKING:
        sim.say("a002", st)
        assert sim.tick(1) == []
    sim.say("a002", "committed", detail=figures())
    assert offers(sim.tick(1)) == names("b", 3)


def test_create_refuses_a_device_in_two_waves() -> None:
    with pytest.raises(ValueError, match=r"b1.*waves 1 and 2"):
        new_rollout([["a1", "b1"], ["b1", "c1"]])


# -- the success gate and the failure threshold ------------------------------------------------


@pytest.mark.parametrize(
    ("n", "ok", "gate", "passes"),
    [
        (20, 19, 0.95, True),
        (20, 18, 0.95, False),
        (100, 95, 0.95, True),
        (100, 94, 0.95, False),
        # 0.55 * 100 is 55.00000000000001 in floats: 55 of 100 meets a 55 % gate.
        (100, 55, 0.55, True),
        (100, 54, 0.55, False),
        (50, 7, 0.14, True),
        (1, 1, 1.0, True),
        (1, 0, 0.01, False),
    ],
)
def test_success_gate(n: int, ok: int, gate: float, passes: bool) -> None:
    # The failure threshold is out of the way (100 %): only the gate judges.
    params = Params(success_gate=gate, max_failure=1.0)
    first = names("a", n)
    sim = Sim(new_rollout([first, ["b000"]], params))
    sim.tick()
    for d in first[:ok]:
        sim.commit(d)
    for d in first[ok:]:
        sim.fail(d, "incompatible", permanent=True)
    cmds = sim.tick(1)
    if passes:
        assert offers(cmds) == ["b000"]
        assert sim.r.state == "running"
    else:
        assert cmds == []
        assert sim.r.state == "halted"
        assert sim.r.reason.startswith(f"wave 1: {ok} of {n} answering devices committed")


def test_gate_counts_only_devices_that_answered() -> None:
    """Timed-out devices count neither for nor against the gate."""
    params = Params(success_gate=0.9, max_failure=1.0)
    sim = Sim(new_rollout([names("a", 10), ["b000"]], params))
    sim.tick()
    for d in names("a", 8):
        sim.commit(d)
    assert sim.tick(301) == [Command("offer", "b000")]  # 8 of 8 answering, 2 timed out
    assert sim.r.history[-2][1] == "wave 1 passed: 8/10 committed"

    sim = Sim(new_rollout([names("a", 10), ["b000"]], params))
    sim.tick()
    for d in names("a", 8):
        sim.commit(d)
    sim.fail("a008", "incompatible", permanent=True)
    assert sim.tick(301) == []  # 8 of 9 answering is under 90 %
    assert sim.r.reason == "wave 1: 8 of 9 answering devices committed (gate 90%; 1 never answered)"


def test_failure_threshold_only_after_min_devices() -> None:
    params = Params(min_devices=5, max_failure=0.2, success_gate=0.0)
    wave = names("a", 10)
    sim = Sim(new_rollout([wave], params))
    sim.tick()
    for d in wave[:4]:
        sim.fail(d, "incompatible", permanent=True)
        assert sim.tick(1) == []
        assert sim.r.state == "running", "4 finished devices are fewer than min_devices"
    sim.commit(wave[4])
    # The halt tells the devices still in flight to roll back the bundle that tripped it.
    assert sim.tick(1) == [Command("rollback", d) for d in wave[5:]]
    assert sim.r.state == "halted"
    assert sim.r.reason.startswith("4 of 5 finished devices failed (more than 20%)")
    assert wave[0] in sim.r.reason  # names the first failure and why
    assert "incompatible failure" in sim.r.reason


@pytest.mark.parametrize(
    ("n", "failed", "max_failure", "halted"),
    [
        (100, 5, 0.05, False),
        (100, 6, 0.05, True),
        # 0.29 * 100 is 28.999999999999996: 29 of 100 do not pass a 29 % threshold.
        (100, 29, 0.29, False),
        (100, 30, 0.29, True),
        (20, 1, 0.05, False),
        (20, 2, 0.05, True),
        (5, 1, 0.0, True),
        (5, 5, 1.0, False),
    ],
)
def test_failure_threshold(n: int, failed: int, max_failure: float, halted: bool) -> None:
    params = Params(min_devices=5, max_failure=max_failure, success_gate=0.0)
    wave = names("a", n)
    sim = Sim(new_rollout([wave, ["b000"]], params))
    sim.tick()
    for d in wave[failed:]:
        sim.commit(d)
    for d in wave[:failed]:
        sim.probation_fails(d)  # a rolled-back device is a failure too
    cmds = sim.tick(1)
    assert (sim.r.state == "halted") is halted
    assert cmds == ([] if halted else [Command("offer", "b000")])


def test_failures_count_over_every_wave_so_far() -> None:
    params = Params(min_devices=5, max_failure=0.1, success_gate=0.5)
    sim = Sim(new_rollout([names("a", 10), names("b", 10), names("c", 10)], params))
    sim.tick()
    for d in names("a", 9):
        sim.commit(d)
    sim.fail("a009", "incompatible", permanent=True)
    assert offers(sim.tick(1)) == names("b", 10)  # 1 of 10 is not more than 10 %
    sim.fail("b000", "incompatible", permanent=True)
    sim.tick(1)
    assert sim.r.state == "halted"
    assert sim.r.reason.startswith("2 of 11 finished devices failed")


# -- the regression check --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fig", "regressed"),
    [
        # Over >= 100 windows the P99 is compared: +15 % is the limit.
        ({"windows": 100, "p99": 2300.0}, False),
        ({"windows": 100, "p99": 2301.0}, True),
        ({"windows": 5000, "p99": 4000.0, "p50": 1000.0}, True),
        # Under 100 windows a P99 is a maximum of a few windows: the median is compared.
        ({"windows": 99, "p99": 9000.0}, False),
        ({"windows": 99, "p50": 1151.0}, True),
        ({"windows": 20, "p50": 1151.0}, True),
        ({"windows": 20, "p50": 1150.0}, False),
        # Under 20 windows latency says nothing.
        ({"windows": 19, "p50": 9000.0, "p99": 9000.0}, False),
        ({"windows": 0, "p50": 9000.0, "p99": 9000.0}, False),
        # An absolute slack of 50 us, as on the device: +40 % of 100 us is noise.
        ({"windows": 50, "p50": 140.0, "base_p50": 100.0}, False),
        ({"windows": 50, "p50": 151.0, "base_p50": 100.0}, True),
        # No baseline (the device had not run the model before): nothing to compare.
        ({"windows": 500, "p99": 9000.0, "base_p99": None}, False),
        ({"windows": 50, "p50": 9000.0, "base_p50": None}, False),
        # Memory +10 % against its own baseline, whatever the windows.
        ({"windows": 0, "rss": 110_000_000}, False),
        ({"windows": 0, "rss": 110_000_001}, True),
        ({"windows": 500, "rss": 200_000_000, "base_rss": None}, False),
        ({}, False),
    ],
)
def test_regression_check(fig: dict[str, Any], regressed: bool) -> None:
    sim = Sim(new_rollout([["a000", "a001"], ["b000"]], Params(success_gate=0.5)))
    sim.tick()
    sim.commit("a000")
    sim.commit("a001", **fig)
    assert sim.r.devices["a001"].regressed is regressed
    cmds = sim.tick(1)
    if regressed:
        assert cmds == [Command("rollback", "a001")]
        assert sim.r.state == "halted"
        assert sim.r.reason == "regression check tripped on 1 device(s) (a001)"
    else:
        assert cmds == [Command("offer", "b000")]


def test_regression_check_reads_only_numbers() -> None:
    sim = Sim(new_rollout([["a000"]]))
    sim.tick()
    bad = {**figures(), "windows": "500", "p99_us": True, "rss_bytes": "huge"}
    sim.say("a000", "committed", detail=bad)
    assert sim.r.devices["a000"].regressed is False


def test_slow_model_halts_at_the_first_wave_and_those_devices_roll_back() -> None:
    slow = {"windows": 400, "p99": 3000.0}  # +50 % P99
    devices = [Candidate(f"gw{i:03d}", site="a", device_type="gw") for i in range(300)]
    waves = plan("r1", devices, {}, (0.01, 0.1, 0.5, 1.0))
    assert len(waves[0]) == 3
    sim = Sim(new_rollout(waves))
    first = sim.tick()
    assert len(first) == 3
    a, b, fine = waves[0]
    sim.commit(a, **slow)
    sim.say(b, "probation")
    # The regressed device and the devices still in flight are told to roll back.
    assert sim.tick(1) == [
        Command("rollback", a),
        Command("rollback", b),
        Command("rollback", fine),
    ]
    assert sim.r.state == "halted"
    # A device in flight that still commits a regression (the rollback did not take: it
    # raced the commit) is told again, once; a device that committed fine is left alone.
    sim.commit(b, **slow)
    assert sim.tick(1) == [Command("rollback", b)]
    assert sim.tick(1) == []
    sim.commit(fine)
    assert sim.tick(1) == []
    assert sim.offers() == list(waves[0])
    assert [cmd.device for _, cmd in sim.sent if cmd.action == "rollback"] == [a, b, fine, b]
    assert len(halts(sim.r)) == 1
    # A committed device reports the rollback it was told to do as a manual one (no bundle,
    # edge_agent.ota publishes "-"): not this rollout's; nothing is sent twice.
    before = sim.r
    sim.say(a, "rolling_back", bundle_id="-")
    sim.say(a, "rolled_back", bundle_id="-")
    assert sim.r == before
    assert sim.r.devices[a].rollback_sent
    assert sim.tick(60) == []


def test_a_late_regression_after_completion_is_still_rolled_back() -> None:
    params = Params(device_timeout_s=60, success_gate=0.5)
    sim = Sim(new_rollout([["a000", "a001"], ["b000"]], params))
    sim.tick()
    sim.commit("a000")
    assert sim.tick(61) == [Command("offer", "b000")]  # a001 timed out
    sim.commit("b000")
    assert sim.tick(1) == []
    assert sim.r.state == "completed"
    sim.commit("a001", windows=500, p99=2400.0)  # late, and +20 % P99
    assert sim.tick(1) == [Command("rollback", "a001")]
    assert sim.tick(1) == []
    assert sim.r.state == "completed"
    assert sim.r.history[-1][1] == "rollback sent to 1 regressed device(s): a001"


# -- retries ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "permanent"),
    [
        ("bad_signature", True),
        ("bad_signature", None),
        ("incompatible", True),
        ("incompatible", None),
        ("permission_denied", None),
        ("downgrade", True),
        ("trust", True),
        ("fetch_too_large", True),
        ("fetch", True),  # the device says it is permanent: it knows best
    ],
)
def test_permanent_failure_is_never_retried(code: str, permanent: bool | None) -> None:
    sim = Sim(new_rollout([["a000"], names("b", 5)], Params(max_failure=1.0)))
    sim.tick()
    sim.fail("a000", code, permanent=permanent)
    assert sim.state("a000") == "failed"
    assert sim.r.devices["a000"].code == code
    for _ in range(20):
        sim.tick(60)
    assert sim.offers() == ["a000"]
    assert sim.r.state == "halted"


def test_bad_signature_fails_everywhere_without_retries_and_halts() -> None:
    devices = [Candidate(f"gw{i:04d}", site="a", device_type="gw") for i in range(1000)]
    waves = plan("r1", devices, {}, (0.01, 0.1, 0.5, 1.0))
    sim = Sim(new_rollout(waves))
    first = offers(sim.tick())
    assert len(first) == 10
    for d in first:
        sim.fail(d, "bad_signature", permanent=True)
    assert sim.tick(1) == []
    assert sim.r.state == "halted"
    assert sim.r.reason.startswith("10 of 10 finished devices failed")
    for _ in range(50):
        assert sim.tick(30) == []
    assert sorted(sim.offers()) == sorted(first)
    assert sim.r.counts() == {"failed": 10, "waiting": 990}
    assert all(sim.r.devices[d].attempts == 1 for d in first)


@pytest.mark.parametrize("code", ["fetch", "fetch_stalled", "busy", "interrupted", "storage"])
def test_transient_failure_retried_with_exponential_backoff_then_failed(code: str) -> None:
    params = Params(max_attempts=4, retry_backoff_s=5.0, max_failure=1.0, success_gate=0.0)
    sim = Sim(new_rollout([["a000", "a001"], ["b000"]], params))
    sim.tick()
    sim.commit("a001")
    offered_at = [sim.now]
    for attempt, backoff in enumerate([5, 10, 20], start=1):
        sim.fail("a000", code, permanent=None if code != "fetch" else False)
        assert sim.state("a000") == "waiting"
        assert sim.r.devices["a000"].attempts == attempt
        assert sim.tick(backoff - 0.001) == []
        assert sim.tick(0.001) == [Command("offer", "a000")]
        assert sim.state("a000") == "offered"
        offered_at.append(sim.now)
    gaps = [(b - a) / S for a, b in itertools.pairwise(offered_at)]
    assert gaps == pytest.approx([5, 10, 20])
    sim.fail("a000", code, permanent=False)
    assert sim.state("a000") == "failed"
    assert sim.r.devices["a000"].attempts == 4
    assert offers(sim.tick(3600)) == ["b000"]  # the gate is 0 here: the wave went on
    assert sim.offers().count("a000") == 4


def test_transient_failure_then_success_on_retry() -> None:
    sim = Sim(new_rollout([["a000"], ["b000"]]))
    sim.tick()
    sim.fail("a000", "fetch_stalled", permanent=False)
    assert sim.tick(5) == [Command("offer", "a000")]
    sim.commit("a000")
    assert sim.tick(1) == [Command("offer", "b000")]
    assert sim.r.devices["a000"].attempts == 2


# -- timeouts --------------------------------------------------------------------------------


def test_offline_device_times_out_and_the_wave_proceeds() -> None:
    params = Params(device_timeout_s=300, success_gate=0.9)
    sim = Sim(new_rollout([names("a", 10), ["b000"]], params))
    sim.tick()
    for d in names("a", 9):
        sim.commit(d)
    sim.say("a009", "fetching")  # then silence
    assert sim.tick(300) == []  # exactly the timeout: not yet
    assert sim.state("a009") == "in_progress"
    assert sim.tick(0.001) == [Command("offer", "b000")]
    assert sim.state("a009") == "timed_out"
    assert "300 s" in sim.r.devices["a009"].reason
    assert sim.r.history[-2][1] == "wave 1 passed: 9/10 committed"
    # A late progress report does not reopen it; a late outcome counts.
    sim.say("a009", "probation")
    assert sim.state("a009") == "timed_out"
    sim.say("a009", "committing")
    sim.say("a009", "committed", detail=figures())
    assert sim.state("a009") == "committed"


def test_late_failure_after_the_timeout_counts() -> None:
    params = Params(device_timeout_s=60, min_devices=2, max_failure=0.4, success_gate=0.5)
    sim = Sim(new_rollout([names("a", 3), names("b", 3)], params))
    sim.tick()
    sim.commit("a000")
    sim.commit("a001")
    assert offers(sim.tick(61)) == names("b", 3)  # a002 timed out, silent
    sim.fail("a002", "incompatible", permanent=True)
    sim.fail("b000", "incompatible", permanent=True)
    sim.tick(1)
    assert sim.r.state == "halted"
    assert sim.r.reason.startswith("2 of 4 finished devices failed")


def test_a_wave_where_nobody_answers_halts_instead_of_waiting_forever() -> None:
    sim = Sim(new_rollout([names("a", 3), ["b000"]], Params(device_timeout_s=120)))
    sim.tick()
    assert sim.tick(120.5) == []
    assert sim.r.state == "halted"
    assert sim.r.reason == (
        "wave 1: 0 of 0 answering devices committed (gate 95%; 3 never answered)"
    )


def test_timed_out_devices_are_not_failures_for_the_threshold() -> None:
    params = Params(device_timeout_s=10, min_devices=1, max_failure=0.0, success_gate=1.0)
    sim = Sim(new_rollout([names("a", 5), ["b000"]], params))
    sim.tick()
    sim.commit("a000")
    assert sim.tick(11) == [Command("offer", "b000")]
    assert sim.r.counts(0) == {"committed": 1, "timed_out": 4}


def test_a_device_silent_once_the_update_runs_is_a_failure_not_offline() -> None:
    """Silence after activating (the update may have killed the agent) counts against the
    gate and the threshold; silence while fetching is an offline device, left out."""
    params = Params(device_timeout_s=10, min_devices=1, max_failure=0.0, success_gate=0.5)
    sim = Sim(new_rollout([names("a", 3), ["b000"]], params))
    sim.tick()
    sim.commit("a000")
    sim.say("a001", "fetching")  # then nothing: the network went
    for st in ("fetching", "verifying", "staged", "activating", "probation"):
        sim.say("a002", st)  # then nothing: running the new version
    assert sim.tick(11) == []  # the failure threshold (0 %) trips on a002
    assert sim.r.state == "halted"
    assert "1 of 2 finished devices failed" in sim.r.reason
    assert "a002" in sim.r.reason
    d1, d2 = sim.r.devices["a001"], sim.r.devices["a002"]
    assert (d1.state, d1.silent, d2.state, d2.silent) == ("timed_out", False, "timed_out", True)
    assert "last reported: fetching)" in d1.reason
    assert "last reported: probation; went silent running the update" in d2.reason

    # Under the gate alone: 1 of 2 counted devices committed is under 60 %.
    params = Params(device_timeout_s=10, min_devices=5, success_gate=0.6)
    sim = Sim(new_rollout([names("a", 3), ["b000"]], params))
    sim.tick()
    sim.commit("a000")
    sim.say("a002", "activating")
    assert sim.tick(11) == []
    assert sim.r.reason == (
        "wave 1: 1 of 2 answering devices committed (gate 60%; 1 never answered)"
    )


def test_a_retry_gets_its_own_timeout() -> None:
    params = Params(device_timeout_s=100, retry_backoff_s=50)
    sim = Sim(new_rollout([["a000"], ["b000"]], params))
    sim.tick()
    sim.tick(90)
    sim.fail("a000", "fetch", permanent=False)
    assert sim.tick(50) == [Command("offer", "a000")]
    assert sim.tick(99) == []
    assert sim.state("a000") == "offered"
    sim.tick(2)
    assert sim.state("a000") == "timed_out"


# -- duplicates and replays ------------------------------------------------------------------


def _in_progress_sim() -> Sim:
    sim = Sim(new_rollout([["a000", "a001"], ["b000"]]))
    sim.tick()
    for st in WORKING[:4]:
        sim.say("a000", st)  # seqs 0..3
    return sim


def _report(sim: Sim, **kw: Any) -> Rollout:
    args: dict[str, Any] = {
        "device": "a000",
        "boot_id": "boot-a000-0",
        "seq": 4,
        "bundle_id": BUNDLE,
        "state": "failed",
        "reason": "x",
        "detail": {"code": "bad_signature", "permanent": True},
        "t_ns": sim.now + 5 * S,
        "received_ns": sim.now + 5 * S,
        "now_ns": sim.now + 5 * S,
    }
    args.update(kw)
    return on_status(sim.r, **args)


@pytest.mark.parametrize(
    "kw",
    [
        {"seq": 3},  # the same (boot_id, seq) again
        {"seq": 0},  # an older one of this boot
        {"seq": 2, "state": "committed", "detail": figures()},
        {"bundle_id": "model-6"},  # another bundle
        {"device": "stranger"},  # not in the rollout
        {"device": "b000", "seq": 99},  # in the rollout, never offered yet
        {"state": "dancing"},  # not a state we know: ignored, not guessed
    ],
)
def test_stale_foreign_or_duplicate_reports_change_nothing(kw: dict[str, Any]) -> None:
    sim = _in_progress_sim()
    before = sim.r
    assert _report(sim, **kw) == before
    # And the next genuine report still applies.
    sim.r = _report(sim)
    assert sim.state("a000") == "failed"


def test_a_duplicate_of_a_final_report_changes_nothing() -> None:
    sim = _in_progress_sim()
    sim.r = _report(sim, state="committed", detail=figures())
    once = sim.r
    assert _report(sim, state="committed", detail=figures()) == once
    assert _report(sim, seq=4, state="failed") == once


def test_a_new_boot_resets_the_seq_order_and_the_old_boot_is_stale() -> None:
    sim = _in_progress_sim()
    sim.r = _report(sim, seq=50, state="probation", detail={})
    # The device rebooted mid-update: its new boot counts from 0 again.
    sim.r = _report(sim, boot_id="boot-a000-1", seq=0, state="probation", detail={})
    assert sim.r.devices["a000"].boot_id == "boot-a000-1"
    assert sim.r.devices["a000"].seq == 0
    before = sim.r
    # A redelivered report of the boot before is older than anything of the new boot.
    assert _report(sim, boot_id="boot-a000-0", seq=51) == before
    sim.r = _report(sim, boot_id="boot-a000-1", seq=1, state="committed", detail=figures())
    assert sim.state("a000") == "committed"


def test_a_report_received_before_the_offer_is_not_about_it() -> None:
    """A stored report of an earlier rollout of the same bundle (read again after a restart,
    or by the overlap window) must not judge this offer, nor displace the device's boot."""
    sim = Sim(new_rollout([["a000"], ["b000"]], Params(min_devices=1, max_failure=0.0)))
    sim.now += 60 * S
    sim.tick()  # offered at T0 + 60 s
    before = sim.r
    earlier = _report(
        sim, boot_id="boot-a000-old", seq=5, t_ns=T0 + S, received_ns=T0 + S, now_ns=sim.now
    )
    assert earlier == before
    assert sim.tick(1) == []
    assert sim.phase() == "running"
    # Received at the offer or later: applied.
    sim.say("a000", "fetching")
    assert sim.r.devices["a000"].boot_id == "boot-a000-0"
    assert sim.r.devices["a000"].old_boots == ()


def test_a_report_of_the_attempt_before_a_retry_stored_late_is_ignored() -> None:
    sim = Sim(new_rollout([["a000"], ["b000"]]))
    sim.tick()
    sim.fail("a000", "fetch", permanent=False)  # seqs 0, 1: waiting for a retry
    assert sim.tick(5) == [Command("offer", "a000")]
    before = sim.r
    # Seq 2 of the first attempt was received before the retry's offer, read only now.
    late = _report(sim, seq=2, state="failed", received_ns=sim.now - S, now_ns=sim.now + S)
    assert late == before


def test_a_late_report_of_a_boot_never_seen_is_old_by_its_time() -> None:
    sim = _in_progress_sim()  # boot-a000-0, seqs 0..3 at sim.now
    sim.now += 10 * S
    sim.reboot("a000")
    sim.say("a000", "probation")  # boot-a000-1, t_ns sim.now
    before = sim.r
    # A boot between the two, never applied, whose report reaches us late: older by t_ns.
    late = _report(sim, boot_id="boot-a000-x", seq=9, t_ns=sim.now - 5 * S, received_ns=sim.now + S)
    assert late == before
    assert sim.r.devices["a000"].boot_id == "boot-a000-1"
    # A boot never seen that is newer than the last report does take over.
    newer = _report(sim, boot_id="boot-a000-2", seq=0, t_ns=sim.now + 5 * S)
    assert newer.devices["a000"].boot_id == "boot-a000-2"
    assert newer.devices["a000"].old_boots == ("boot-a000-0", "boot-a000-1")
    assert newer.devices["a000"].state == "failed"


def test_a_report_while_a_retry_is_due_is_old_after_the_next_offer() -> None:
    sim = Sim(new_rollout([["a000"], ["b000"]]))
    sim.tick()
    sim.fail("a000", "fetch", permanent=False)
    sim.say("a000", "failed", detail={"code": "fetch", "permanent": False})  # seq 2, waiting
    assert sim.state("a000") == "waiting"
    assert sim.r.devices["a000"].attempts == 1
    assert sim.tick(5) == [Command("offer", "a000")]
    before = sim.r
    redelivered = on_status(
        sim.r,
        device="a000",
        boot_id="boot-a000-0",
        seq=2,
        bundle_id=BUNDLE,
        state="failed",
        reason="",
        detail={"code": "fetch", "permanent": False},
        t_ns=sim.now,
        received_ns=sim.now,
        now_ns=sim.now,
    )
    assert redelivered == before
    assert sim.state("a000") == "offered"


def test_replaying_the_whole_stream_changes_nothing_random() -> None:
    """Property: after a stream of reports, any of them delivered again is a no-op."""
    for seed in range(60):
        rng = random.Random(seed)
        sim = Sim(new_rollout([names("a", 6), names("b", 6)], Params(max_failure=1.0)))
        sim.tick()
        log: list[dict[str, Any]] = []
        for _ in range(40):
            d = rng.choice(names("a", 6))
            if rng.random() < 0.1:
                sim.reboot(d)
            state = rng.choice([*WORKING, "committed", "failed", "rolled_back"])
            detail = (
                figures(p99=rng.uniform(1500, 2500))
                if state == "committed"
                else {"code": rng.choice(["fetch", "bad_signature"])}
            )
            seq = sim.seqs.get(d, 0)
            boot = sim.boots.setdefault(d, f"boot-{d}-0")
            sim.say(d, state, detail=detail)
            log.append(
                {
                    "device": d,
                    "boot_id": boot,
                    "seq": seq,
                    "state": state,
                    "detail": detail,
                    "t_ns": sim.now,
                    "received_ns": sim.now,
                }
            )
            if rng.random() < 0.2:
                sim.tick(rng.uniform(0, 30))
        after = sim.r
        for msg in rng.sample(log, len(log)):
            again = on_status(after, bundle_id=BUNDLE, reason="", now_ns=sim.now + S, **msg)
            assert again == after, (seed, msg)


# -- pause, resume, abort --------------------------------------------------------------------


def test_pause_holds_offers_and_retries_resume_continues() -> None:
    sim = Sim(new_rollout([["a000", "a001"], ["b000"]]))
    sim.tick()
    sim.r = pause(sim.r, sim.now)
    assert sim.r.state == "paused"
    sim.commit("a000")
    sim.fail("a001", "fetch", permanent=False)
    assert sim.tick(5) == []
    assert sim.tick(3600) == []  # no retry, no next wave, however long
    assert sim.r.devices["a001"].attempts == 1
    assert pause(sim.r, sim.now) == sim.r  # pausing twice changes nothing
    sim.r = resume(sim.r, sim.now)
    assert sim.r.state == "running"
    assert sim.tick(0) == [Command("offer", "a001")]
    sim.commit("a001")
    assert sim.tick(1) == [Command("offer", "b000")]
    texts = [t for _, t in sim.r.history]
    assert texts.count("paused") == 1
    assert texts.count("resumed") == 1


def test_paused_rollout_still_halts_on_failures() -> None:
    params = Params(min_devices=2, max_failure=0.1)
    sim = Sim(new_rollout([names("a", 4), ["b000"]], params))
    sim.tick()
    sim.r = pause(sim.r, sim.now)
    sim.fail("a000", "incompatible", permanent=True)
    sim.fail("a001", "incompatible", permanent=True)
    sim.tick(1)
    assert sim.r.state == "halted"
    assert resume(sim.r, sim.now) == sim.r  # a halt is final


def test_abort_mid_wave_sends_rollback_to_devices_in_flight_only() -> None:
    params = Params(max_failure=1.0, success_gate=0.5, device_timeout_s=100, retry_backoff_s=600)
    sim = Sim(new_rollout([["t000", "t001"], names("a", 5), names("b", 3)], params))
    sim.tick()
    sim.commit("t001")
    assert offers(sim.tick(101)) == names("a", 5)  # t000 timed out: silent, maybe offline
    sim.commit("a000")  # committed: stays
    sim.fail("a001", "incompatible", permanent=True)  # failed: stays
    sim.fail("a002", "fetch", permanent=False)  # waiting for a retry: no rollback needed
    sim.say("a003", "probation")  # in progress
    assert sim.tick(10) == []  # a004 offered, silent
    sim.r, cmds = abort(sim.r, sim.now)
    assert cmds == [Command("rollback", "a003"), Command("rollback", "a004")]
    assert sim.r.state == "aborted"
    assert {d: sim.state(d) for d in ["t000", "t001", *names("a", 5)]} == {
        "t000": "timed_out",
        "t001": "committed",
        "a000": "committed",
        "a001": "failed",
        "a002": "aborted",
        "a003": "aborted",
        "a004": "aborted",
    }
    assert all(sim.state(d) == "aborted" for d in names("b", 3))
    assert sim.r.history[-1][1] == "aborted: rollback sent to 2 device(s) in flight"
    assert sim.r.reason == "aborted by the operator"
    # Nothing more: no retry, no wave, and reports of aborted devices are ignored.
    before = sim.r
    sim.say("a003", "rolling_back")
    sim.say("a003", "rolled_back")
    assert sim.r == before
    assert sim.tick(3600) == []
    assert abort(sim.r, sim.now) == (sim.r, [])
    assert resume(sim.r, sim.now) == sim.r
    assert pause(sim.r, sim.now) == sim.r


def test_a_halt_sends_rollback_to_every_device_in_flight_once() -> None:
    params = Params(min_devices=1, max_failure=0.0, retry_backoff_s=600)
    sim = Sim(new_rollout([names("a", 5), names("b", 2)], params))
    sim.tick()
    sim.commit("a000")  # committed: left alone
    sim.fail("a001", "fetch", permanent=False)  # waiting for a retry: nothing installing
    sim.say("a002", "probation")  # in progress
    sim.fail("a003", "incompatible", permanent=True)  # trips the halt
    cmds = sim.tick(1)  # a004: offered, silent
    assert sim.phase() == "halted"
    assert cmds == [Command("rollback", "a002"), Command("rollback", "a004")]
    assert sim.r.history[-1][1] == "rollback sent to 2 device(s) in flight: a002, a004"
    assert sim.tick(1) == []
    assert sim.tick(3600) == []  # and no timeout turns into another command
    # Their answers still count.
    sim.say("a002", "rolled_back")
    assert sim.state("a002") == "rolled_back"


def test_abort_mid_wave_of_a_halted_rollout_still_rolls_back_the_ones_in_flight() -> None:
    params = Params(min_devices=1, max_failure=0.0)
    sim = Sim(new_rollout([names("a", 3)], params))
    sim.tick()
    sim.fail("a000", "incompatible", permanent=True)
    sim.say("a001", "activating")
    sim.tick(1)
    assert sim.r.state == "halted"
    sim.r, cmds = abort(sim.r, sim.now)
    assert cmds == [Command("rollback", "a001"), Command("rollback", "a002")]


def test_abort_before_the_tick_that_would_catch_a_regression_still_rolls_it_back() -> None:
    sim = Sim(new_rollout([["a000", "a001"], ["b000"]]))
    sim.tick()
    sim.commit("a000", rss=150_000_000)  # +50 % memory
    sim.say("a001", "probation")
    sim.r, cmds = abort(sim.r, sim.now)
    assert cmds == [Command("rollback", "a001")]
    assert sim.tick(1) == [Command("rollback", "a000")]
    assert sim.tick(1) == []
    assert sim.r.state == "aborted"


# -- two waves tripping in the same tick ------------------------------------------------------


def test_two_waves_tripping_in_the_same_tick_halt_once() -> None:
    params = Params(device_timeout_s=60, min_devices=5, max_failure=0.2, success_gate=0.8)
    w1, w2, w3 = names("a", 10), names("b", 20), names("c", 30)
    sim = Sim(new_rollout([w1, w2, w3], params))
    sim.tick()
    for d in w1[:9]:
        sim.commit(d)
    sim.say(w1[9], "fetching")  # late
    assert offers(sim.tick(61)) == w2
    # Before the next tick: the late wave-1 device fails, and wave 2 fails its gate too.
    sim.fail(w1[9], "incompatible", permanent=True)
    for d in w2[:8]:
        sim.probation_fails(d)
    for d in w2[8:]:
        sim.commit(d)
    history = len(sim.r.history)
    assert sim.tick(1) == []
    assert sim.r.state == "halted"
    assert len(sim.r.history) == history + 1
    assert halts(sim.r) == [sim.r.history[-1][1]]
    # 1 of wave 1 and 8 of wave 2 failed, of the 30 that finished.
    assert sim.r.reason.startswith("9 of 30 finished devices failed")
    for _ in range(10):
        assert sim.tick(60) == []
    assert len(halts(sim.r)) == 1
    assert not set(sim.offers()) & set(w3)


# -- already installed -----------------------------------------------------------------------


def test_already_installed_counts_as_committed() -> None:
    sim = Sim(new_rollout([["a000", "a001"], ["b000"]], Params(success_gate=1.0)))
    sim.tick()
    sim.commit("a000")
    sim.say("a001", "verifying")
    sim.say("a001", "failed", detail={"code": "already_installed", "permanent": True})
    assert sim.state("a001") == "committed"
    assert sim.r.devices["a001"].code == "already_installed"
    assert sim.tick(1) == [Command("offer", "b000")]
    assert sim.r.history[-2][1] == "wave 1 passed: 2/2 committed"


# -- surviving a restart ---------------------------------------------------------------------


def _round_trip(r: Rollout) -> Rollout:
    return Rollout.from_json(json.loads(json.dumps(r.to_json())))


def test_json_round_trip_is_equal_in_every_state() -> None:
    sim = Sim(new_rollout([names("a", 4), names("b", 4)], Params(waves=(0.5, 1.0))))
    assert _round_trip(sim.r) == sim.r
    sim.tick()
    sim.commit("a000", p99=9000.0)
    sim.fail("a001", "fetch", permanent=False)
    sim.say("a002", "probation")
    sim.reboot("a002")
    sim.say("a002", "probation")
    assert _round_trip(sim.r) == sim.r
    sim.tick(1)
    assert sim.r.state == "halted"
    assert _round_trip(sim.r) == sim.r
    aborted, _ = abort(sim.r, sim.now)
    assert _round_trip(aborted) == aborted
    assert _round_trip(pause(new_rollout([["x"]]), T0)) == pause(new_rollout([["x"]]), T0)


@dataclass
class Script:
    """A random fleet: each device commits, fails (transiently or for good), regresses or
    stays silent; what it does is fixed per device and attempt, so two runs of the same
    script see the same reports."""

    seed: int

    def behaviour(self, device: str, attempt: int) -> str:
        rng = random.Random(f"{self.seed}/{device}/{attempt}")
        return rng.choices(
            ["commit", "transient", "permanent", "silent", "slow", "installed", "probation"],
            weights=[70, 10, 2, 5, 1, 3, 2],
        )[0]


def _respond(sim: Sim, script: Script, cmds: list[Command]) -> None:
    for c in cmds:
        if c.action != "offer":
            continue
        what = script.behaviour(c.device, sim.r.devices[c.device].attempts)
        if what == "commit":
            sim.commit(c.device)
        elif what == "slow":
            sim.commit(c.device, windows=200, p99=5000.0)
        elif what == "transient":
            sim.fail(c.device, "fetch", permanent=False)
        elif what == "permanent":
            sim.fail(c.device, "incompatible", permanent=True)
        elif what == "installed":
            sim.say(c.device, "failed", detail={"code": "already_installed"})
        elif what == "probation":
            sim.probation_fails(c.device)
        elif what == "silent":
            sim.say(c.device, "fetching")


def _drive(sim: Sim, script: Script, steps: range, rng: random.Random) -> list[str]:
    """Run ``steps`` of the script; returns what was sent, as text, for comparison."""
    out: list[str] = []
    for step in steps:
        cmds = sim.tick(rng.choice([0.5, 3, 11, 40]))
        out += [f"{step}:{c.action}:{c.device}" for c in cmds]
        _respond(sim, script, cmds)
        if step == 7 and rng.random() < 0.3:
            sim.r = pause(sim.r, sim.now)
        if step == 12:
            sim.r = resume(sim.r, sim.now)
        out.append(f"{step}:{sim.r.state}:{sim.r.wave}")
    return out


def test_restart_mid_rollout_continues_identically() -> None:
    """Property: to_json -> json -> from_json at any point, then the same inputs, gives the
    same commands and the same final rollout as carrying on without the restart."""
    params = Params(
        device_timeout_s=30, min_devices=10, max_failure=0.15, success_gate=0.8, max_attempts=3
    )
    restarted_mid_wave = 0
    for seed in range(40):
        devices = [Candidate(f"gw{i:03d}", site="a", device_type="gw") for i in range(120)]
        waves = plan(f"r{seed}", devices, {}, (0.05, 0.2, 0.5, 1.0))
        script = Script(seed)
        cut = random.Random(seed).randint(1, 15)

        a = Sim(new_rollout(waves, params, rid=f"r{seed}"))
        rng_a = random.Random(seed)
        head = _drive(a, script, range(cut), rng_a)
        state = json.loads(json.dumps(a.r.to_json()))
        b = replace(a, r=Rollout.from_json(state), boots=dict(a.boots), seqs=dict(a.seqs))
        b.sent = list(a.sent)
        assert b.r == a.r
        restarted_mid_wave += any(
            d.state in ("offered", "in_progress") for d in b.r.devices.values()
        )
        rng_b = random.Random()
        rng_b.setstate(rng_a.getstate())
        tail_a = _drive(a, script, range(cut, 60), rng_a)
        tail_b = _drive(b, script, range(cut, 60), rng_b)
        assert tail_a == tail_b, seed
        assert a.r == b.r, seed
        assert head  # the head did something
    assert restarted_mid_wave > 5  # the property was exercised with devices in flight


# -- random runs: invariants -----------------------------------------------------------------


def test_random_rollouts_keep_their_invariants() -> None:
    """Whatever devices do: offers go wave by wave, never while paused or after a halt, at
    most max_attempts per device; every run ends (offline devices do not block it)."""
    for seed in range(60):
        rng = random.Random(seed)
        params = Params(
            device_timeout_s=rng.choice([20, 60]),
            min_devices=rng.choice([1, 5, 10]),
            max_failure=rng.choice([0.05, 0.2, 1.0]),
            success_gate=rng.choice([0.5, 0.9, 0.0]),
            max_attempts=rng.choice([1, 2, 3]),
            retry_backoff_s=rng.choice([1, 5]),
        )
        n = rng.choice([1, 7, 40, 150])
        devices = [Candidate(f"gw{i:03d}", site="a", device_type="gw") for i in range(n)]
        waves = plan(f"r{seed}", devices, {}, (0.01, 0.1, 0.5, 1.0))
        sim = Sim(new_rollout(waves, params, rid=f"r{seed}"))
        script = Script(seed)
        for step in range(400):
            if sim.r.state not in ("running", "paused"):
                break
            before = sim.r
            cmds = sim.tick(rng.choice([0.5, 3, 11, 40]))
            for c in cmds:
                if c.action != "offer":
                    continue
                ctx = (seed, step, c.device)
                assert before.state == "running", ctx
                w = sim.r.devices[c.device].wave
                assert w <= sim.r.wave, ctx
                if w > before.wave:
                    # A new wave only once every device of the one before finished.
                    assert w == before.wave + 1, ctx
                    if before.wave >= 0:
                        prev = [sim.r.devices[x].state for x in waves[before.wave]]
                        assert all(st in FINISHED for st in prev), ctx
            _respond(sim, script, cmds)
            if step == 7:
                sim.r = pause(sim.r, sim.now)
            if step == 12:
                sim.r = resume(sim.r, sim.now)
        assert sim.r.state in ("completed", "halted"), (seed, sim.r.state)
        per_device: dict[str, int] = {}
        for d in sim.offers():
            per_device[d] = per_device.get(d, 0) + 1
        assert max(per_device.values()) <= params.max_attempts, seed
        assert len(halts(sim.r)) == (sim.r.state == "halted"), seed
        if sim.r.state == "completed":
            assert all(d.state != "waiting" for d in sim.r.devices.values()), seed
