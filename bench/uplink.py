"""Uplink replay after a broker outage: how fast the backlog drains while live traffic goes on.

A real Mosquitto (``tests.support.mosquitto``) on loopback and a persistent-session QoS 1
subscriber standing in for the fleet. The device (an in-process :class:`Uplink` with the
config defaults: ``replay_rate_per_s`` 200, ``max_inflight`` 32) produces 100 decisions/s
(~1 KB each, realistic ones). The broker is stopped (SIGTERM) for the outage (60 s; 10 s with
``--quick``), the rows pile up in the outbox, then the broker is restarted and production
goes on while the backlog drains.

``replay_msgs_per_s`` is the backlog (messages produced during the outage) divided by the
time from its first to its last arrival at the subscriber; ``catch_up_s`` the time from the
broker's restart until the outbox is back to live traffic only (<= 5 rows). The uplink paces
on purpose (token bucket), so the replay rate sits at ``replay_rate_per_s`` by design;
``unpaced_msgs_per_s`` is the same drain with the bucket opened (the uplink's own ceiling:
SQLite peek/ack plus paho), and ``bare_msgs_per_s`` a bare paho QoS 1 publish loop (same
payloads, same 32-message window) on the same broker, the baseline.

    python -m bench.uplink [--quick] [--json]

Keys: replay_msgs_per_s, replay_rate_limit_per_s, backlog_msgs, catch_up_s, live_msgs,
received_unique, duplicates, lost, unpaced_msgs_per_s, bare_msgs_per_s, delta_saving_pct
(null here: the telemetry delta encoder's bench fills it).
Target: replay_msgs_per_s >= 0.9 * replay_rate_limit_per_s, lost 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from bench import uplink_delta
from edge_agent.uplink.config import UplinkSection
from edge_agent.uplink.publisher import Uplink
from tests.support.mosquitto import Mosquitto
from tests.support.uplink_device_proc import MODEL_SHA, make_decision
from wire.messages import encode, kind_of

SITE, DEVICE = "plant1", "bench-1"
ROOT = f"edgefleet/v1/{SITE}/{DEVICE}"
LIVE_RATE = 100.0


class _Fleet:
    """Persistent-session QoS 1 subscriber: arrival time of every (boot_id, seq)."""

    def __init__(self, port: int) -> None:
        self.arrivals: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-fleet", protocol=mqtt.MQTTv5)
        c.reconnect_delay_set(1, 2)
        c.on_connect = lambda c, u, f, rc, p: c.subscribe(f"{ROOT}/decision", qos=1)
        c.on_message = self._on_message
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 3600
        c.connect("127.0.0.1", port, keepalive=10, clean_start=False, properties=props)
        c.loop_start()
        self.client = c

    def _on_message(self, c: mqtt.Client, u: object, msg: mqtt.MQTTMessage) -> None:
        seq = json.loads(msg.payload)["seq"]
        with self.lock:
            self.arrivals.append((time.monotonic(), int(seq)))

    def snapshot(self) -> list[tuple[float, int]]:
        with self.lock:
            return list(self.arrivals)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


async def _until(cond: Callable[[], bool], timeout: float, step: float = 0.05) -> None:
    """Poll ``cond`` until it holds or ``timeout`` passes (the result then shows the gap)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(step)


def _uplink(port: int, state: Path, rate: float) -> Uplink:
    sec = UplinkSection(
        enabled=True,
        port=port,
        keepalive_s=10,
        replay_rate_per_s=rate,
        reconnect_min_ms=100,
        reconnect_max_ms=500,
    )
    return Uplink(
        sec,
        site=SITE,
        device=DEVICE,
        device_type="bench",
        agent_version="bench",
        state_dir=state,
        model_sha256=lambda: MODEL_SHA,
    )


async def _replay(broker: Mosquitto, state: Path, outage_s: float) -> dict[str, Any]:
    fleet = _Fleet(broker.port)
    up = _uplink(broker.port, state, UplinkSection().replay_rate_per_s)
    task = asyncio.create_task(up.run(), name="uplink")
    produced = 0

    async def produce_for(seconds: float) -> None:
        nonlocal produced
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < seconds:
            up.publish_decision(make_decision(produced))
            produced += 1
            n += 1
            # Paced against the start, so slow iterations do not lower the rate.
            await asyncio.sleep(max(0.0, t0 + n / LIVE_RATE - time.monotonic()))

    try:
        await _until(lambda: up.stats()["connected"] is True, 30)
        await produce_for(2.0)
        await asyncio.to_thread(broker.stop)
        first_backlog = produced
        await produce_for(outage_s)
        last_backlog = produced - 1
        await asyncio.to_thread(broker.start)
        t_restart = time.monotonic()
        catch_up_s: float | None = None
        while catch_up_s is None and time.monotonic() - t_restart < outage_s * 3 + 30:
            await produce_for(0.2)
            if int(str(up.stats()["outbox_rows"])) <= 5:
                catch_up_s = time.monotonic() - t_restart
        await produce_for(1.0)
        await _until(lambda: up.stats()["outbox_rows"] == 0, 60)
        await _until(lambda: len({s for _, s in fleet.snapshot()}) >= produced, 10)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        fleet.close()
    arrivals = fleet.snapshot()
    seen = {s for _, s in arrivals}
    backlog = [t for t, s in arrivals if first_backlog <= s <= last_backlog]
    span = (max(backlog) - min(backlog)) if len(backlog) > 1 else 0.0
    n_backlog = last_backlog - first_backlog + 1
    return {
        "outage_s": outage_s,
        "backlog_msgs": n_backlog,
        "replay_msgs_per_s": round(n_backlog / span, 1) if span > 0 else None,
        "replay_rate_limit_per_s": up.section.replay_rate_per_s,
        "catch_up_s": None if catch_up_s is None else round(catch_up_s, 2),
        "live_msgs": produced - n_backlog,
        "produced": produced,
        "received_unique": len(seen),
        "duplicates": len(arrivals) - len(seen),
        "lost": len(set(range(produced)) - seen),
        "uplink_stats": {
            k: v
            for k, v in up.stats().items()
            if k in ("sent", "acked", "reconnects", "dropped", "connect_failures")
        },
    }


async def _unpaced(port: int, state: Path, n: int) -> float:
    """Drain ``n`` queued decisions with the token bucket opened; messages per second."""
    up = _uplink(port, state, 1_000_000.0)
    for i in range(n):
        up.publish_decision(make_decision(i))
    t0 = time.monotonic()
    task = asyncio.create_task(up.run(), name="uplink-unpaced")
    try:
        await _until(lambda: up.pump.acked >= n, 120, step=0.005)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return n / (time.monotonic() - t0)


def _bare(port: int, n: int) -> float:
    """A bare paho QoS 1 loop: same payloads, a 32-message window, until every PUBACK."""
    payloads = []
    for i in range(n):
        d = make_decision(i).to_json()
        payloads.append(json.dumps({**d, "device": DEVICE, "boot_id": "0" * 32, "seq": i}))
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-bare", protocol=mqtt.MQTTv5)
    c.max_inflight_messages_set(32)
    done = threading.Event()
    acked = 0

    def on_publish(c: mqtt.Client, u: object, mid: int, rc: object, p: object) -> None:
        nonlocal acked
        acked += 1
        if acked == n:
            done.set()

    c.on_publish = on_publish
    c.connect("127.0.0.1", port)
    c.loop_start()
    time.sleep(0.2)
    t0 = time.monotonic()
    for p in payloads:
        c.publish(f"{ROOT}/decision", p, qos=1)
    done.wait(120)
    rate = n / (time.monotonic() - t0)
    c.disconnect()
    c.loop_stop()
    return rate


def run(quick: bool) -> dict[str, Any]:
    outage_s = 10.0 if quick else 60.0
    n_fast = 2000 if quick else 10_000
    with tempfile.TemporaryDirectory() as tmp:
        broker = Mosquitto(Path(tmp) / "broker")
        broker.start()
        try:
            r = asyncio.run(_replay(broker, Path(tmp) / "state", outage_s))
            r["unpaced_msgs_per_s"] = round(
                asyncio.run(_unpaced(broker.port, Path(tmp) / "state-unpaced", n_fast)), 1
            )
            r["bare_msgs_per_s"] = round(_bare(broker.port, n_fast), 1)
        finally:
            broker.stop()
    r["payload_bytes"] = len(encode_sample())
    # Delta upload on the simulator at 100 Hz telemetry (bench.uplink_delta has the details).
    delta = uplink_delta.run(120.0 if quick else 600.0)
    r["delta_saving_pct"] = delta["delta_saving_pct"]
    r["delta_deadband_rule"] = delta["deadband_rule"]
    r["delta_sensitivity_100hz"] = delta["sensitivity_100hz"]
    return r


def encode_sample() -> bytes:
    import msgspec  # noqa: PLC0415

    from wire.messages import DecisionMsg  # noqa: PLC0415

    d = make_decision(1).to_json()
    msg = msgspec.convert({**d, "device": DEVICE, "boot_id": "0" * 32, "seq": 1}, DecisionMsg)
    assert kind_of(msg) == "decision"
    return encode(msg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 10 s outage instead of 60 s")
    ap.add_argument("--json", action="store_true", help="print the JSON result as the last line")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    r = run(args.quick)
    print(
        f"uplink replay: {r['backlog_msgs']} decisions ({r['payload_bytes']} B) queued during "
        f"a {r['outage_s']:g} s outage at {LIVE_RATE:g}/s"
    )
    print(
        f"  drained at {r['replay_msgs_per_s']} msgs/s (limit {r['replay_rate_limit_per_s']:g}) "
        f"while live traffic went on; caught up {r['catch_up_s']} s after the restart"
    )
    print(
        f"  received {r['received_unique']}/{r['produced']} unique, {r['duplicates']} "
        f"duplicates, lost {r['lost']}"
    )
    print(
        f"  unpaced uplink {r['unpaced_msgs_per_s']} msgs/s; bare paho QoS 1 loop "
        f"{r['bare_msgs_per_s']} msgs/s"
    )
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
