"""Stored, not just delivered: the fleet confirms what it committed (``cmd/stored``) and the
agent's outbox keeps a row until then, so a broker killed before it saved what it had
acknowledged loses nothing.

The pure parts (the policy, the wire message) on constructed inputs; the outbox on a real
SQLite file; the whole path against a real Mosquitto (persistence saved only at a clean
stop, so a SIGKILL loses everything it acknowledged), the real fleet ingest into SQLite and
the agent's real uplink.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest
from msgspec import UnsetType

from edge_agent.uplink.delivery import Delivery
from edge_agent.uplink.outbox import Outbox, Session
from edge_agent.uplink.states import HELD_EVERY_S, StateMessages
from fleet.ingest import IngestConfig, IngestWorker
from fleet.store import open_store
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.uplink import section, stop, until, uplink
from tests.support.uplink_device_proc import make_decision
from wire import WireError
from wire.commands import MAX_STORED_RANGES, decode_stored, seq_ranges, stored_commands
from wire.messages import StateMsg, decode

S = 1_000_000_000
BOOT = "0123456789abcdef0123456789abcdef"


# -- the policy ---------------------------------------------------------------------------


def test_delivery_keeps_rows_only_once_a_fleet_confirms_in_auto_mode() -> None:
    assert not Delivery("auto", 60, fleet_confirms=False).keep
    assert Delivery("auto", 60, fleet_confirms=True).keep
    assert Delivery("stored", 60, fleet_confirms=False).keep
    assert not Delivery("broker", 60, fleet_confirms=True).keep
    auto = Delivery("auto", 60, fleet_confirms=False)
    auto.confirmed(100 * S, 0)
    assert auto.keep
    with pytest.raises(ValueError, match="expected auto, stored or broker"):
        Delivery("sometimes", 60, fleet_confirms=False)


def test_resend_waits_for_a_later_confirmation_to_age() -> None:
    d = Delivery("stored", 60, fleet_confirms=False)
    assert d.resend_before(1000 * S) is None  # nothing confirmed: the fleet may be down
    d.confirmed(1000 * S, 990 * S)  # a row acked at 990 s is stored, at 1000 s
    assert d.resend_before(1059 * S) is None  # not yet confirm_timeout_s later
    assert d.resend_before(1060 * S) == 990 * S
    d.confirmed(1030 * S, 1020 * S)
    d.confirmed(1030 * S + S // 2, 1010 * S)  # same second, older ack: the max is kept
    assert d.resend_before(1089 * S) == 990 * S
    assert d.resend_before(1091 * S) == 1020 * S
    assert not Delivery("broker", 60, fleet_confirms=True).resend_before(10**6 * S)


# -- the wire message ---------------------------------------------------------------------


def test_stored_command_round_trip_and_ranges() -> None:
    assert seq_ranges([7, 1, 3, 2, 3]) == [(1, 3), (7, 7)]
    (payload,) = stored_commands(BOOT, [5, 4, 9])
    cmd = decode_stored(payload)
    assert (cmd.boot_id, cmd.seqs) == (BOOT, [(4, 5), (9, 9)])
    many = stored_commands(BOOT, range(0, 2 * MAX_STORED_RANGES + 2, 2))
    assert len(many) == 2
    assert sum(len(decode_stored(p).seqs) for p in many) == MAX_STORED_RANGES + 1


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b'{"boot_id": "x", "seqs": [[1, 2]]}', "$.boot_id"),
        (b'{"boot_id": "' + BOOT.encode() + b'", "seqs": [[3, 2]]}', "starts after it ends"),
        (b'{"boot_id": "' + BOOT.encode() + b'", "seqs": []}', "$.seqs"),
        (b'{"boot_id": "' + BOOT.encode() + b'", "seqs": [[1, 2]], "seqs": [[9, 9]]}', "seqs"),
        (b'{"boot_id": "' + BOOT.encode() + b'", "seqs": [[-1, 2]]}', "$.seqs"),
        (b'{"boot_id": ', "not a JSON object"),
        (b" " * 20_000, "bytes; expected at most"),
    ],
)
def test_a_malformed_stored_command_is_refused_saying_where(payload: bytes, words: str) -> None:
    with pytest.raises(WireError) as err:
        decode_stored(payload)
    assert words in str(err.value) or words in getattr(err.value, "where", "")


# -- the outbox ---------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000 * S

    def __call__(self) -> int:
        return self.ns


def _filled(path: Path, clock: Clock, n: int) -> tuple[Outbox, list[int]]:
    box = Outbox(path, boot_id=BOOT, clock_ns=clock)
    for seq in range(n):
        assert box.put("decision", "t", b"{}", seq)
    return box, [r.id for r in box.peek(0, n)]


def test_outbox_keeps_acked_rows_until_confirmed(tmp_path: Path) -> None:
    clock = Clock()
    box, ids = _filled(tmp_path / "outbox.db", clock, 6)
    assert box.mark_acked(ids[:4]) == 4
    assert (len(box), box.awaiting) == (6, 4)
    clock.ns += 5 * S
    assert box.mark_acked(ids[3:4]) == 1  # sent again and acked again: counted once
    assert box.awaiting == 4
    assert not box.fleet_confirms
    assert box.confirm(BOOT, [(90, 99)]) == (0, 0)  # none of these here
    assert box.fleet_confirms  # but a fleet that confirms is there
    deleted, latest = box.confirm(BOOT, [(0, 1), (5, 5)])
    assert deleted == 3  # seq 5 was never acked: stored is stored
    assert latest == 1_000 * S
    assert (len(box), box.awaiting, box.confirmed) == (3, 2, 3)
    assert box.confirm("f" * 32, [(0, 99)]) == (0, 0)  # another boot: nothing of it here
    # Rows acked before a time are sent again, and stamped so they are not picked twice.
    assert [r.seq for r in box.stale(1_003 * S, 10)] == [2]
    assert box.stale(1_003 * S, 10) == []
    box.close()
    again = Outbox(tmp_path / "outbox.db", boot_id="e" * 32, clock_ns=clock)
    assert again.fleet_confirms  # remembered: the next start keeps rows from the first ack
    assert (len(again), again.awaiting) == (3, 2)
    again.close()


def test_trimming_an_acked_row_counts_it_out(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.db", boot_id=BOOT, max_bytes=64 * 1024, reserve_bytes=0)
    big = b"x" * 20_000
    for seq in range(3):
        assert box.put("telemetry", "t", big, seq)
    box.mark_acked([r.id for r in box.peek(0, 3)])
    assert box.awaiting == 3
    assert box.put("telemetry", "t", big, 3)  # over the cap: the oldest (acked) goes
    assert (len(box), box.awaiting) == (3, 2)
    box.close()


def test_an_outbox_of_the_previous_schema_gains_the_ack_column(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL,"
        " topic TEXT NOT NULL, payload BLOB NOT NULL, boot_id TEXT NOT NULL,"
        " seq INTEGER NOT NULL, bytes INTEGER NOT NULL, t_ns INTEGER NOT NULL);"
        "CREATE TABLE boots (boot_id TEXT PRIMARY KEY, next_seq INTEGER NOT NULL,"
        " clean INTEGER NOT NULL DEFAULT 0, started_ns INTEGER NOT NULL);"
        f"INSERT INTO outbox VALUES (1, 'decision', 't', x'7b7d', '{BOOT}', 0, 4, 1);"
        "PRAGMA user_version=2;"
    )
    conn.close()
    box = Outbox(path, boot_id="e" * 32)
    assert (len(box), box.awaiting) == (1, 0)
    assert box.confirm(BOOT, [(0, 0)])[0] == 1
    box.close()


def test_the_state_tells_the_lowest_held_seq_again_when_it_moved(tmp_path: Path) -> None:
    clock, mono = Clock(), [0.0]
    session = Session(BOOT)
    box = Outbox(tmp_path / "o.db", boot_id=BOOT, clock_ns=clock)
    keep = [False]
    states = StateMessages(
        device="gw1",
        site="plant1",
        device_type="gw",
        agent_version="1.0",
        model_sha256=lambda: "a" * 64,
        model_health=None,
        clock_ns=clock,
        session=session,
        outbox=box,
        keep=lambda: keep[0],
        monotonic=lambda: mono[0],
    )
    for _ in range(5):
        assert box.put("decision", "t", b"{}", session.take())

    def told(payload: bytes) -> tuple[int, int | None]:
        msg = decode("state", payload)
        assert isinstance(msg, StateMsg)
        return msg.seq, None if isinstance(msg.held, UnsetType) else msg.held

    assert told(states.make("online", True)) == (5, None)  # rows go at their PUBACK
    assert not states.tell_held()
    keep[0] = True  # the fleet's first confirmation
    assert states.tell_held(), "at once: no online carried held yet"
    assert told(states.make("online", True)) == (5, 0)
    mono[0] += HELD_EVERY_S - 1
    box.confirm(BOOT, [(0, 2)])
    assert not states.tell_held(), "not before HELD_EVERY_S"
    mono[0] += 1
    assert states.tell_held()
    assert told(states.make("online", True)) == (5, 3)
    mono[0] += HELD_EVERY_S
    assert not states.tell_held(), "held did not move"
    box.confirm(BOOT, [(3, 4)])
    mono[0] += HELD_EVERY_S
    assert states.tell_held()
    assert told(states.make("online", True)) == (5, 5), "none held: the watermark"
    # An earlier boot's epitaph carries its own held.
    assert told(states.make("offline", True, boot=("e" * 32, 9))) == (9, 9)
    box.close()


# -- the whole path -------------------------------------------------------------------------


def _forgetful_broker(workdir: Path) -> Mosquitto:
    """A broker that saves its state only at a clean stop: SIGKILLed, it forgets everything
    it acknowledged, as one killed between two autosaves forgets what came since."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    return Mosquitto(
        workdir,
        port=port,
        config=(
            f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {workdir}/\nautosave_interval 86400\n"
            "max_queued_messages 100000\n"
            f"log_dest file {workdir / 'mosquitto.log'}\nlog_type error\nlog_type warning\n"
        ),
    )


def _seqs(store_url: str) -> list[int]:
    store = open_store(store_url)
    try:
        return sorted(seq for _, _, seq, _ in store.decisions(limit=10_000))
    finally:
        store.close()


def _gaps(store_url: str) -> list[tuple[str, int, int]]:
    store = open_store(store_url)
    try:
        return [(g.boot_id, g.first_missing, g.last_missing) for g in store.gaps()]
    finally:
        store.close()


@pytest.mark.peers
@pytest.mark.parametrize("delivery", ["auto", "broker"])
def test_a_broker_killed_before_saving_loses_nothing_once_the_fleet_confirms(
    tmp_path: Path, delivery: str
) -> None:
    """The ingest is down (an upgrade); the broker acknowledges 40 decisions, queues them
    for the ingest's session, and is SIGKILLed before it saves them. With the fleet's
    confirmations the agent still holds them and, once the fleet confirms later ones and
    not these, sends them again: all 55 are stored. While they are on their way the fleet
    reports no gap: the device's state says it still holds them (``held``). With
    ``delivery = "broker"`` (PUBACK is enough, as before) those 40 are gone, the failure
    this guards against, and the fleet reports exactly them."""
    store_url = f"sqlite://{tmp_path / 'fleet.db'}"
    broker = _forgetful_broker(tmp_path / "broker")
    broker.start()

    def ingest() -> IngestWorker:
        w = IngestWorker(
            IngestConfig(
                store_url=store_url,
                broker_port=broker.port,
                client_id="ingest-t",
                gap_check_s=0.3,
                gap_grace_s=0.3,
            )
        )
        w.start()
        assert w.wait_ready(10)
        return w

    worker = ingest()
    up = uplink(section(broker.port, delivery=delivery, confirm_timeout_s=6), tmp_path / "state")

    async def main() -> dict[str, object]:
        task = asyncio.create_task(up.run())
        try:
            for i in range(10):
                assert up.publish_decision(make_decision(i))
            await until(lambda: worker.stats.stored == 10, 20, "10 stored")
            if delivery == "auto":
                await until(lambda: up.stats()["delivery"] == "stored", 10, "a confirmation")
            await asyncio.to_thread(worker.stop)
            for i in range(10, 50):
                assert up.publish_decision(make_decision(i))
            await until(lambda: up.pump.acked >= 50, 20, "the broker acked all 50")
            if delivery == "auto":
                assert up.stats()["awaiting_confirmation"] == 40
            else:
                assert up.stats()["outbox_rows"] == 0
            broker.kill()
            broker.start()
            revived = await asyncio.to_thread(ingest)
            try:
                # The device goes on: the fleet confirms what comes now, and the 40 the
                # broker lost, acked before it, are sent again confirm_timeout_s later.
                for i in range(50, 55):
                    assert up.publish_decision(make_decision(i))
                await until(lambda: _seqs(store_url)[-1:] == [54], 20, "54 stored")
                await asyncio.sleep(1.5)  # audits every 0.3 s, with a hole 10..49 open
                gaps = await asyncio.to_thread(_gaps, store_url)
                if delivery == "auto":
                    assert _seqs(store_url) == list(range(10)) + list(range(50, 55))
                    assert (gaps, revived.stats.gaps) == ([], 0)  # on their way
                    await until(lambda: up.stats()["outbox_rows"] == 0, 30, "all confirmed")
                else:
                    assert gaps == [(up.session.boot_id, 10, 49)]
                    await until(lambda: revived.stats.gaps == 1, 10, "the gap logged")
                    await asyncio.sleep(2)  # room for anything that would still come
            finally:
                await asyncio.to_thread(revived.stop)
            return up.stats()
        finally:
            await stop(task)

    try:
        stats = asyncio.run(main())
    finally:
        broker.stop()
    seqs = _seqs(store_url)
    if delivery == "auto":
        assert seqs == list(range(55)), seqs
        assert stats["resent"] == 40, stats  # by the timer, not all at the reconnect
        assert _gaps(store_url) == []
    else:
        assert seqs == list(range(10)) + list(range(50, 55)), seqs


@pytest.mark.peers
def test_clean_stop_waits_for_the_confirmations_and_leaves_an_empty_outbox(
    tmp_path: Path,
) -> None:
    store_url = f"sqlite://{tmp_path / 'fleet.db'}"
    broker = _forgetful_broker(tmp_path / "broker")
    broker.start()
    worker = IngestWorker(IngestConfig(store_url=store_url, broker_port=broker.port))
    worker.start()
    up = uplink(section(broker.port, delivery="stored"), tmp_path / "state")

    async def main() -> None:
        task = asyncio.create_task(up.run())
        await until(lambda: bool(up.stats()["connected"]), 10, "connected")
        for i in range(30):
            assert up.publish_decision(make_decision(i))
        await stop(task)

    try:
        assert worker.wait_ready(10)
        started = time.monotonic()
        asyncio.run(main())
        assert time.monotonic() - started < 15
    finally:
        worker.stop()
        broker.stop()
    box = Outbox(tmp_path / "state" / "outbox.db", boot_id="e" * 32)
    assert len(box) == 0
    box.close()
    assert _seqs(store_url) == list(range(30))
    assert worker.stats.confirms >= 1
