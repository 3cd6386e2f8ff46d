"""The orchestrator's step on a real store: the machine, the store's ``ota/status`` rows and
the commands it publishes, with a simulated clock and no broker.

Status rows are real wire bodies, stored with :meth:`Store.ingest` as the ingest stores
them. The paging cases run on both SQL backends (the ``backend`` fixture); the rest, about
the orchestrator's logic, on the in-memory store (tests/support/memstore.py, checked
against SQLite by tests/test_memstore.py), whose ``save_rollout`` fails on demand.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import FleetStoreError
from fleet.rollout import machine as m
from fleet.rollout import orchestrator as orch_module
from fleet.rollout.held import RESEND_GRACE_S
from fleet.rollout.orchestrator import Orchestrator, load, request
from fleet.store import Row, Store
from tests.support.fleet import state
from tests.support.memstore import MemoryStore
from tests.support.stores import Backend
from wire import OtaStatusMsg, decode_command
from wire.messages import encode

pytestmark = pytest.mark.peers

S = 1_000_000_000
T0 = 1_700_000_000 * S
BUNDLE = "model-9"
SITE = "s1"
BOOT_A = "a" * 32
BOOT_B = "b" * 32
BOOT_C = "c" * 32


def status(
    device: str,
    boot: str,
    seq: int,
    state: str,
    t_ns: int,
    *,
    received_ns: int | None = None,
    **detail: Any,
) -> Row:
    """One ``ota/status`` row as the ingest stores it (received when sent unless told)."""
    msg = OtaStatusMsg(
        device=device,
        boot_id=boot,
        seq=seq,
        t_ns=t_ns,
        bundle_id=BUNDLE,
        state=state,
        detail=detail,
    )
    received = t_ns if received_ns is None else received_ns
    return Row(device, SITE, "ota/status", boot, seq, t_ns, encode(msg), received)


def add_rollout(
    store: Store, rid: str, waves: list[list[str]], params: m.Params, now_ns: int
) -> None:
    r = m.create(
        rid,
        bundle_id=BUNDLE,
        version="1.0",
        kind="model",
        sha256="0" * 64,
        length=10,
        waves=waves,
        params=params,
        now_ns=now_ns,
    )
    assert store.insert_rollout(
        rid, r.state, json.dumps({**r.to_json(), "transport": "http"}), now_ns
    )


def stored(store: Store, rid: str) -> m.Rollout:
    return {i: load(doc)[0] for i, _, doc in store.rollouts()}[rid]


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now

    def at(self, s: float) -> None:
        self.now = T0 + int(s * S)


class Broker:
    """What the orchestrator published: ``(device, action)`` in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def __call__(self, topic_name: str, payload: bytes) -> bool:
        self.sent.append((topic_name.split("/")[3], decode_command(payload).action))
        return True

    def take(self) -> list[tuple[str, str]]:
        out, self.sent = self.sent, []
        return out


class FlakyStore(MemoryStore):
    """The in-memory store, but ``save_rollout`` fails while ``fail`` is set."""

    fail = False

    def save_rollout(
        self, rollout_id: str, state: str, doc: str, now_ns: int, *, epoch: int | None = None
    ) -> None:
        if self.fail:
            raise FleetStoreError(f"store {self.url}: save_rollout failed: database is locked")
        super().save_rollout(rollout_id, state, doc, now_ns, epoch=epoch)


def memory_store(devices: list[str]) -> FlakyStore:
    store = FlakyStore()
    store.migrate()
    for d in devices:
        store.register_device(d, SITE)
    return store


def orchestrator(store: Store, clock: Clock, broker: Callable[[str, bytes], bool]) -> Orchestrator:
    return Orchestrator(
        store, publish=broker, url_for=lambda sha, t: f"http://x/{sha}", clock=clock
    )


# -- 1. a wave with more reports in the overlap window than one page -------------------------


def test_status_pages_split_a_run_of_rows_stored_at_the_same_nanosecond(
    backend: Backend,
) -> None:
    store = backend.open()
    try:
        # 25 reports of one batch, all stamped with one arrival time, and one later.
        rows = [
            status(f"d{i:02d}", BOOT_A, 0, "fetching", T0, received_ns=T0 + S) for i in range(25)
        ]
        rows.append(status("d00", BOOT_A, 1, "staged", T0, received_ns=T0 + 2 * S))
        store.ingest(rows)
        seen: list[tuple[int, bytes]] = []
        page = store.ota_status_since(T0, limit=10)
        sizes = [len(page)]
        while len(page) == 10:
            seen += page
            page = store.ota_status_since(page[-1][0], limit=10, after=page[-1][1])
            sizes.append(len(page))
        seen += page
        assert sizes == [10, 10, 6]
        assert sorted(body for _, body in seen) == sorted(r.body for r in rows)
        assert [t for t, _ in seen] == [T0 + S] * 25 + [T0 + 2 * S]
        # Without ``after`` the floor is exclusive, as before.
        assert store.ota_status_since(T0 + S, limit=10) == seen[-1:]
    finally:
        store.close()


def test_a_wave_with_more_reports_than_a_page_within_the_overlap_still_completes(
    backend: Backend,
) -> None:
    """stall.py: 200 devices, 60 progress reports each in a second, then their commits.

    Every row is within CURSOR_OVERLAP_S of the cursor: read with one page of 10,000 rows,
    every step read the same rows again and the commits were never seen.
    """
    devices = [f"d{i:04d}" for i in range(200)]
    per_device = 60
    # More than a page (10,000 rows: the store's default limit, the orchestrator's page).
    assert len(devices) * (per_device + 1) > getattr(orch_module, "STATUS_PAGE", 10_000)
    store = backend.open()
    try:
        for d in devices:
            store.register_device(d, SITE)
        add_rollout(store, "r1", [devices], m.Params(min_devices=1000), T0)
        clock, broker = Clock(), Broker()
        orch = orchestrator(store, clock, broker)
        orch.step()
        assert len(broker.take()) == len(devices)
        rows, t = [], T0 + S
        for k in range(per_device):
            for d in devices:
                rows.append(status(d, BOOT_A, k, "fetching", t))
                t += 1000
        for d in devices:
            rows.append(status(d, BOOT_A, per_device, "committed", t))
            t += 1000
        store.ingest(rows)
        clock.at(2)
        orch.step()
        r = stored(store, "r1")
        assert r.state == "completed", r.counts()
        assert r.counts() == {"committed": len(devices)}
        assert orch.cursor == rows[-1].received_ns
        # The next step re-reads the overlap window (all of it) and changes nothing.
        clock.at(3)
        orch.step()
        assert stored(store, "r1") == r
    finally:
        store.close()


# -- 2. reports from before the device's offer in this rollout -------------------------------


def test_an_earlier_rollouts_reports_of_the_same_bundle_are_not_applied(tmp_path: Path) -> None:
    """replay.py: r1 of a bundle fails on d0 (boot A); d0 is fixed and reboots (boot B);
    r2 of the same bundle must not take boot A's failure, also after a restart."""
    store = memory_store(["d0"])
    clock, broker = Clock(), Broker()
    params = m.Params(min_devices=1, max_failure=0.0)
    add_rollout(store, "r1", [["d0"]], params, T0)
    orch = orchestrator(store, clock, broker)
    orch.step()
    store.ingest([status("d0", BOOT_A, 5, "failed", T0 + S, code="incompatible", permanent=True)])
    clock.at(2)
    orch.step()
    assert stored(store, "r1").state == "halted"

    clock.at(60)
    add_rollout(store, "r2", [["d0"]], params, clock.now)
    orch.step()  # offers d0
    store.ingest([status("d0", BOOT_B, 0, "fetching", T0 + 62 * S)])
    clock.at(63)
    orch.step()
    d = stored(store, "r2").devices["d0"]
    assert (d.state, d.boot_id, d.old_boots) == ("in_progress", BOOT_B, ())

    orch = orchestrator(store, clock, broker)  # fleet serve restarts: replays from T0
    clock.at(100)
    orch.step()
    store.ingest([status("d0", BOOT_B, 6, "committed", T0 + 110 * S)])
    clock.at(111)
    orch.step()
    r2 = stored(store, "r2")
    d = r2.devices["d0"]
    assert (d.state, d.boot_id, d.old_boots, d.code) == ("committed", BOOT_B, (), "")
    assert r2.state == "completed", r2.reason
    assert stored(store, "r1").devices["d0"].state == "failed"


# -- 3. a late report of an earlier boot ------------------------------------------------------


def test_a_late_report_of_an_earlier_boot_does_not_take_the_device_over(tmp_path: Path) -> None:
    """d0 reports from boot A, reboots and reports from boot C; a report of boot A's boot
    before, B, reaches the store late (boot B was never seen): it is older by t_ns."""
    store = memory_store(["d0", "d1"])
    clock, broker = Clock(), Broker()
    add_rollout(store, "r1", [["d0", "d1"]], m.Params(min_devices=1), T0)
    orch = orchestrator(store, clock, broker)
    orch.step()
    store.ingest(
        [
            status("d0", BOOT_A, 0, "fetching", T0 + 1 * S),
            status("d0", BOOT_C, 0, "probation", T0 + 5 * S),
            status("d1", BOOT_A, 0, "fetching", T0 + 1 * S),
        ]
    )
    clock.at(6)
    orch.step()
    assert stored(store, "r1").devices["d0"].boot_id == BOOT_C
    # Boot B's report was sent before boot C's (t_ns 3 s) and arrives now.
    store.ingest(
        [status("d0", BOOT_B, 7, "failed", T0 + 3 * S, received_ns=T0 + 7 * S, code="apply")]
    )
    clock.at(8)
    orch.step()
    d = stored(store, "r1").devices["d0"]
    assert (d.state, d.boot_id, d.seq, d.old_boots) == ("in_progress", BOOT_C, 0, (BOOT_A,))
    # Boot C goes on, and its commit counts.
    store.ingest([status("d0", BOOT_C, 1, "committed", T0 + 9 * S)])
    clock.at(10)
    orch.step()
    assert stored(store, "r1").devices["d0"].state == "committed"


# -- 4. one step is all or nothing -------------------------------------------------------------


def test_a_failed_save_loses_no_report_after_a_restart(tmp_path: Path) -> None:
    """cursor2.py: the first step after a restart fails to save; d0's commit, read by that
    step, must still count, though later traffic arrived meanwhile."""
    store = memory_store(["d0", "d1"])
    clock, broker = Clock(), Broker()
    add_rollout(store, "r1", [["d0", "d1"]], m.Params(), T0)
    orchestrator(store, clock, broker).step()
    store.ingest([status("d0", BOOT_A, 3, "committed", T0 + 5 * S)])
    store.ingest([status("d1", BOOT_A, 3, "fetching", T0 + 100 * S)])
    orch = orchestrator(store, clock, broker)  # restart
    store.fail = True
    clock.at(101)
    with pytest.raises(FleetStoreError):
        orch.step()
    store.fail = False
    for t in (102, 103):
        clock.at(t)
        orch.step()
    r = stored(store, "r1")
    assert {k: v.state for k, v in r.devices.items()} == {"d0": "committed", "d1": "in_progress"}


def test_a_failed_save_sends_nothing_of_that_step(tmp_path: Path) -> None:
    store = memory_store(["d0", "d1"])
    clock, broker = Clock(), Broker()
    add_rollout(store, "r1", [["d0"], ["d1"]], m.Params(min_devices=1), T0)
    orch = orchestrator(store, clock, broker)
    # The first step's save fails: its offer is not sent (the stored state never had it,
    # and the next step offers again).
    store.fail = True
    with pytest.raises(FleetStoreError):
        orch.step()
    assert broker.take() == []
    store.fail = False
    orch.step()
    assert broker.take() == [("d0", "install")]
    assert stored(store, "r1").devices["d0"].attempts == 1


@pytest.mark.parametrize("restart", [False, True], ids=["same-process", "after-a-restart"])
def test_a_request_taken_by_a_step_whose_save_fails_is_applied_by_the_next(
    tmp_path: Path, restart: bool
) -> None:
    """The request stays pending in the store until its rollout is saved: neither the next
    step nor a restarted orchestrator (a crash between reading and saving) loses it."""
    store = memory_store(["d0", "d1", "d2"])
    clock, broker = Clock(), Broker()
    add_rollout(store, "r1", [["d0"], ["d1", "d2"]], m.Params(min_devices=1), T0)
    orch = orchestrator(store, clock, broker)
    orch.step()
    assert broker.take() == [("d0", "install")]
    store.ingest([status("d0", BOOT_A, 0, "committed", T0 + S)])
    request(store, "r1", "pause")
    clock.at(2)
    store.fail = True
    with pytest.raises(FleetStoreError):
        orch.step()
    assert [a for _, _, a in store.pending_rollout_requests()] == ["pause"]
    store.fail = False
    if restart:
        orch = orchestrator(store, clock, broker)
    clock.at(3)
    orch.step()
    assert store.pending_rollout_requests() == []
    r = stored(store, "r1")
    assert r.state == "paused"
    assert r.devices["d0"].state == "committed"
    assert broker.take() == []  # paused: wave 2 waits
    request(store, "r1", "resume")
    clock.at(4)
    orch.step()
    assert broker.take() == [("d1", "install"), ("d2", "install")]


# -- 5. a halt stops the devices in flight ----------------------------------------------------


def test_a_halt_sends_rollback_to_the_devices_in_flight(tmp_path: Path) -> None:
    """linger.py: d0 fails permanently and the rollout halts while d1 is in probation and
    d2 has its offer: both are told to roll back, once, and an abort later still works."""
    store = memory_store(["d0", "d1", "d2"])
    clock, broker = Clock(), Broker()
    add_rollout(store, "r1", [["d0", "d1", "d2"]], m.Params(min_devices=1, max_failure=0.0), T0)
    orch = orchestrator(store, clock, broker)
    orch.step()
    assert broker.take() == [("d0", "install"), ("d1", "install"), ("d2", "install")]
    store.ingest(
        [
            status("d0", BOOT_A, 1, "failed", T0 + S, code="incompatible", permanent=True),
            status("d1", BOOT_A, 1, "probation", T0 + S),
        ]
    )
    clock.at(2)
    orch.step()
    r = stored(store, "r1")
    assert r.state == "halted"
    assert broker.take() == [("d1", "rollback"), ("d2", "rollback")]
    clock.at(3)
    orch.step()
    assert broker.take() == []
    # d1's answer to the rollback still counts.
    store.ingest([status("d1", BOOT_A, 2, "rolled_back", T0 + 4 * S, code="aborted")])
    clock.at(5)
    orch.step()
    assert stored(store, "r1").devices["d1"].state == "rolled_back"
    # The operator's abort of the halted rollout: rollback again to the one still silent.
    request(store, "r1", "abort")
    clock.at(6)
    orch.step()
    assert broker.take() == [("d2", "rollback")]
    assert stored(store, "r1").state == "aborted"


def test_an_abort_of_a_rollout_halted_long_ago_is_still_applied(tmp_path: Path) -> None:
    """linger.py, the end: the CLI accepts an abort of a halted rollout at any time; the
    orchestrator took it and dropped it once the rollout was past LINGER_S."""
    store = memory_store(["d0", "d1"])
    clock, broker = Clock(), Broker()
    add_rollout(store, "r1", [["d0", "d1"]], m.Params(min_devices=1, max_failure=0.0), T0)
    orch = orchestrator(store, clock, broker)
    orch.step()
    store.ingest([status("d0", BOOT_A, 1, "failed", T0 + S, code="incompatible", permanent=True)])
    clock.at(2)
    orch.step()
    assert stored(store, "r1").state == "halted"
    broker.take()
    clock.at(2 + orch_module.LINGER_S + 100)
    orch.step()
    request(store, "r1", "abort")
    orch.step()
    r = stored(store, "r1")
    assert r.state == "aborted"
    assert r.devices["d1"].state == "aborted"
    assert broker.take() == [("d1", "rollback")]


def online(store: Store, *devices: str, up: bool = True) -> None:
    """The registry sees ``devices`` come online (or go offline)."""
    for d in devices:
        store.record_state(d, SITE, state(d, BOOT_A, 0, online=up, site=SITE), T0)


GRACE = RESEND_GRACE_S


def test_offers_saved_but_never_sent_go_again_once_online_devices_stay_silent() -> None:
    """A leader killed between saving offers and sending them: the next one cannot tell
    them from offers sent, so it holds them; a device online and silent for the grace did
    not get it and is offered again, once; an offline one only after it has been online
    for the grace (its session would have delivered a sent offer)."""
    store = memory_store(["d0", "d1", "d2", "d3"])
    clock = Clock()
    add_rollout(store, "r1", [["d0", "d1", "d2"], ["d3"]], m.Params(min_devices=1), T0)
    online(store, "d0", "d1")

    def killed(topic_name: str, payload: bytes) -> bool:
        raise SystemExit("the leader died between the save and the send")

    with pytest.raises(SystemExit):
        orchestrator(store, clock, killed).step()
    r = stored(store, "r1")
    assert [(d.state, d.attempts, d.sent_ns) for d in r.devices.values()][:3] == [
        ("offered", 1, 0),
        ("offered", 1, 0),
        ("offered", 1, 0),
    ]
    broker = Broker()
    nxt = orchestrator(store, clock, broker)
    clock.at(1)
    nxt.step()
    clock.at(1 + GRACE - 0.5)
    nxt.step()
    assert broker.take() == [], "held for the grace: the devices may have it"
    clock.at(1 + GRACE)
    nxt.step()
    assert sorted(broker.take()) == [("d0", "install"), ("d1", "install")]
    r = stored(store, "r1")
    assert all(r.devices[d].sent_ns == r.devices[d].offered_ns > 0 for d in ("d0", "d1"))
    assert r.devices["d0"].attempts == 1, "the same offer, not another attempt"
    assert r.devices["d2"].sent_ns == 0
    # d2 comes online late: its grace starts then, not at the takeover.
    clock.at(2 + GRACE)
    online(store, "d2")
    nxt.step()
    clock.at(2 + 2 * GRACE - 0.5)
    nxt.step()
    assert broker.take() == []
    clock.at(2 + 2 * GRACE)
    nxt.step()
    assert broker.take() == [("d2", "install")]
    clock.at(3 + 2 * GRACE)
    nxt.step()
    assert broker.take() == []
    # A leader after one that sent (and recorded it) sends nothing again.
    third = orchestrator(store, clock, broker)
    for t in (4, 5 + GRACE):
        clock.at(t + 2 * GRACE)
        third.step()
    assert broker.take() == []


def test_offers_sent_but_not_recorded_are_not_sent_again_when_the_devices_answer() -> None:
    """The window the bench hit (double_offers 6): the leader handed the offers to the
    broker and died before recording them. The devices got them and answer; the next
    leader sees the answers within the grace and sends nothing twice."""
    store = memory_store(["d0", "d1", "d2"])
    clock = Clock()
    add_rollout(store, "r1", [["d0", "d1"], ["d2"]], m.Params(min_devices=1), T0)
    online(store, "d0", "d1", "d2")
    first = Broker()

    def send_then_die(topic_name: str, payload: bytes) -> bool:
        first(topic_name, payload)
        store.fail = True  # the record of the send after it never makes it to the store
        return True

    with pytest.raises(FleetStoreError):
        orchestrator(store, clock, send_then_die).step()
    store.fail = False
    assert sorted(first.take()) == [("d0", "install"), ("d1", "install")]
    assert all(d.sent_ns == 0 for d in stored(store, "r1").devices.values())
    broker = Broker()
    nxt = orchestrator(store, clock, broker)
    clock.at(1)
    nxt.step()
    # The agents' first reports come in over the next seconds; d1 goes offline meanwhile
    # (its report still stored), and d0 is slow but inside the grace.
    store.ingest([status("d1", BOOT_A, 1, "fetching", T0 + 2 * S)])
    online(store, "d1", up=False)
    clock.at(2)
    nxt.step()
    store.ingest([status("d0", BOOT_A, 1, "fetching", T0 + int((GRACE - 1) * S))])
    for t in (GRACE - 0.5, GRACE + 1, 3 * GRACE):
        clock.at(t)
        nxt.step()
    assert broker.take() == []
    r = stored(store, "r1")
    assert [r.devices[d].state for d in ("d0", "d1")] == ["in_progress", "in_progress"]
