"""The agent never sends a payload the fleet could not take: its caps, proven.

A 5 MB publish vanished without a trace: Mosquitto dropped it for the ingest, whose
CONNECT Maximum Packet Size is twice the wire's payload limit. That is only safe if every
packet the agent can send is under that size: every data message passes ``wire.decode``
(256 KiB) before it is numbered, a row over it found in the outbox is never sent, and the
largest message an agent can build, under the longest topic, reaches the ingest's store.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from edge_agent.uplink.publisher import Uplink
from fleet.ingest import MAX_PACKET_BYTES, IngestConfig, IngestWorker
from fleet.store import open_store
from tests.support.fleet import Publisher
from tests.support.mosquitto import mosquitto
from tests.support.uplink import section, stop, subscriber, until, uplink
from tests.support.uplink_device_proc import MODEL_SHA, make_decision
from wire import MAX_PAYLOAD_BYTES, SignalStats, TelemetryMsg, TelemetryPeriod, encode, topic

pytestmark = pytest.mark.peers

LONGEST = "n" * 128  # the longest site, device and signal name the wire allows


def _telemetry_of(size: int, device: str, boot: str, seq: int) -> TelemetryMsg:
    """A valid telemetry message whose JSON is ``size`` bytes or just under (one
    signal per extra period: the cheapest way to grow a message without breaking a cap)."""
    stats = {LONGEST: SignalStats(1.0, 0.0, 2.0, 1.5, 10)}
    more: list[TelemetryPeriod] = []

    def build() -> TelemetryMsg:
        return TelemetryMsg(
            device=device,
            boot_id=boot,
            seq=seq,
            t_ns=1_700_000_000_000_000_000,
            period_ns=1_000_000,
            keyframe=True,
            signals=stats,
            more=more,
        )

    period = TelemetryPeriod(1_700_000_000_000_000_001, True, stats)
    more.append(period)
    one = len(encode(build()))
    more.append(period)
    step = len(encode(build())) - one
    more.extend([period] * max(0, (size - one) // step - 1))
    while len(encode(build())) <= size:
        more.append(period)
    while len(encode(build())) > size:
        more.pop()
    return build()


def _fields(msg: TelemetryMsg) -> dict[str, object]:
    return {f: getattr(msg, f) for f in msg.__struct_fields__}


def _largest_publish_packet(topic_name: str, payload: int) -> int:
    """Bytes of an MQTT 5 QoS 1 PUBLISH without properties, as the agent sends it."""
    remaining = 2 + len(topic_name.encode()) + 2 + 1 + payload  # topic, packet id, props
    header = 1 + next(n for n in range(1, 5) if remaining < 128**n)
    return header + remaining


def test_every_packet_the_agent_can_send_is_under_the_ingests_maximum() -> None:
    longest_topic = topic(LONGEST, LONGEST, "ota/status")
    largest = _largest_publish_packet(longest_topic, MAX_PAYLOAD_BYTES)
    assert largest < MAX_PACKET_BYTES, (largest, MAX_PACKET_BYTES)
    # The broker forwards the topic and payload as they came, without properties of ours
    # (no subscription identifier): the margin is ~256 KiB.
    assert MAX_PACKET_BYTES - largest > 200_000


def test_the_uplink_refuses_a_message_over_the_cap_and_counts_it(tmp_path: Path) -> None:
    up = uplink(section(1), tmp_path / "state")
    try:
        boot = up.session.boot_id
        fits = _telemetry_of(MAX_PAYLOAD_BYTES, "press-7", boot, 0)
        assert MAX_PAYLOAD_BYTES - 200 < len(encode(fits)) <= MAX_PAYLOAD_BYTES
        too_big = _telemetry_of(MAX_PAYLOAD_BYTES + 400, "press-7", boot, 1)
        assert len(encode(too_big)) > MAX_PAYLOAD_BYTES
        assert up.publish(
            "telemetry", lambda b, s: _telemetry_of(MAX_PAYLOAD_BYTES, "press-7", b, s)
        )
        assert not up.publish(
            "telemetry", lambda b, s: _telemetry_of(MAX_PAYLOAD_BYTES + 400, "press-7", b, s)
        )
        stats = up.stats()
        assert stats["invalid"] == {"telemetry": 1}
        assert "expected at most 262144" in str(stats["last_error"])
        assert stats["next_seq"] == 1, "a refused message takes no seq: no gap for the fleet"
        assert stats["outbox_rows"] == 1
        assert max(len(r.payload) for r in up.outbox.peek(0, 10)) <= MAX_PAYLOAD_BYTES
    finally:
        up.outbox.close()


def test_an_outbox_row_over_the_cap_is_never_sent(tmp_path: Path) -> None:
    """A row another build left in the outbox: dropped unsent, counted, the rest delivered."""
    state = tmp_path / "state"
    with mosquitto(tmp_path / "broker") as broker, subscriber(broker.port) as sub:
        first = uplink(section(broker.port), state)
        for i in range(3):
            assert first.publish_decision(make_decision(i))
        first.outbox.close()
        db = sqlite3.connect(state / "outbox.db")
        big = b"{" + b" " * MAX_PAYLOAD_BYTES + b"}"
        with db:
            db.execute("UPDATE outbox SET payload = ?, bytes = ? WHERE seq = 1", (big, len(big)))
        db.close()
        up = uplink(section(broker.port), state)

        async def main() -> None:
            task = asyncio.create_task(up.run())
            await until(lambda: up.stats()["outbox_rows"] == 0, 20, "an empty outbox")
            await stop(task)

        asyncio.run(main())
        sub.wait(lambda: len(sub.of("decision")) >= 2, 10, "the two good decisions")
        time.sleep(0.3)
        assert sorted(d.seq for d in sub.of("decision")) == [0, 2]
        assert up.stats()["invalid"] == {"decision": 1}
        assert "over the wire limit" in str(up.stats()["last_error"])


def test_the_largest_message_the_agent_can_send_reaches_the_ingests_store(
    tmp_path: Path,
) -> None:
    """Through a broker that refuses packets over the ingest's maximum at the source (the
    setting docs/INSTALL.md recommends): the agent's largest message passes, a foreign 5 MB
    publish is refused with a line in the broker's default log."""
    url = f"sqlite://{tmp_path / 'fleet.db'}"
    extra = f"max_packet_size {MAX_PACKET_BYTES}\n"
    with mosquitto(tmp_path / "broker", extra=extra) as broker:
        worker = IngestWorker(
            IngestConfig(store_url=url, broker_port=broker.port, client_id="ingest-caps")
        )
        worker.start()
        try:
            assert worker.wait_ready(10)
            up = Uplink(
                section(broker.port),
                site=LONGEST,
                device=LONGEST,
                device_type="press",
                agent_version="0.1.0",
                state_dir=tmp_path / "state",
                model_sha256=lambda: MODEL_SHA,
            )

            async def main() -> None:
                task = asyncio.create_task(up.run())
                assert up.publish(
                    "telemetry",
                    lambda b, s: _telemetry_of(MAX_PAYLOAD_BYTES, LONGEST, b, s),
                )
                await until(lambda: up.stats()["outbox_rows"] == 0, 20, "acked")
                await stop(task)

            asyncio.run(main())
            deadline = time.monotonic() + 20
            while worker.stats.stored < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            foreign = Publisher(broker.host, broker.port, client_id="foreign-1")
            foreign.publish(topic("plant1", "gw-1", "telemetry"), b"{" + b" " * (5 << 20))
            deadline = time.monotonic() + 10
            while "oversize" not in broker.log() and time.monotonic() < deadline:
                time.sleep(0.05)
            foreign.client.disconnect()
            foreign.client.loop_stop()
        finally:
            worker.stop()
    assert "Client foreign-1 disconnected due to oversize packet." in broker.log()
    # The birth, the large message, the clean offline: nothing of the 5 MB one.
    assert (worker.stats.received, worker.stats.stored, worker.stats.states) == (3, 1, 2)
    store = open_store(url)
    try:
        (row,) = store.telemetry(LONGEST)
        assert MAX_PAYLOAD_BYTES - 200 < len(row[3]) <= MAX_PAYLOAD_BYTES
        assert worker.stats.quarantined == dict.fromkeys(worker.stats.quarantined, 0)
    finally:
        store.close()
