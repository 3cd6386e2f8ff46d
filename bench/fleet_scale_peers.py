"""The peer processes of ``bench.fleet_scale``, driven over stdin and stdout (JSON lines).

``python -m bench.fleet_scale_peers devices --port P --count N --tag T --rate R``: N paho
clients on one thread (:class:`bench.fleet_devices.Fleet`, one TCP connection, client id and
gap-free seq stream each); ``run SECONDS`` on stdin publishes R telemetry messages per device
per second and answers ``{"published", "acked", "lag_max_s"}`` once the broker acked them.
``bare --port P --group G``: one paho subscriber on the ingest's shared subscription
filter in group G, counting (``count`` answers ``{"received", "last_s"}``). ``agents --port P
--count N --root FILE --state DIR``: N :class:`~edge_agent.fleetsim.SimAgent` devices (real
uplink and OTA) on site ``rollout``. ``quit`` (or stdin closing) ends each of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from bench.fleet_devices import ACK_WAIT_S, Fleet

ROLLOUT_SITE = "rollout"


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _commands() -> queue.Queue[str]:
    """stdin's lines, read by a thread so the caller can keep its clients alive meanwhile;
    ``quit`` when stdin closes."""
    q: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            q.put(line.strip())
        q.put("quit")

    threading.Thread(target=read, daemon=True).start()
    return q


def devices(port: int, count: int, tag: str, rate: float) -> None:
    fleet = Fleet("127.0.0.1", port, count, tag)
    connect_s = fleet.connect_all()
    connected = sum(d.connected for d in fleet.devices)
    _say({"connected": connected, "connect_s": round(connect_s, 3), "error": fleet.last_error})
    q = _commands()
    sent = [0]
    while True:
        try:
            cmd = q.get_nowait().split()
        except queue.Empty:
            fleet.settle(lambda: False, 0.2)
            continue
        if cmd[:1] == ["run"]:
            n, lag = fleet.run(float(cmd[1]), rate)
            sent[0] += n
            fleet.settle(lambda: fleet.acked() >= sent[0], ACK_WAIT_S)
            _say({"published": sent[0], "acked": fleet.acked(), "lag_max_s": round(lag, 3),
                  "connected": sum(d.connected for d in fleet.devices)})  # fmt: skip
        elif cmd[:1] == ["quit"]:
            fleet.close()
            _say({"closed": True})
            return


def bare(port: int, group: str, index: int) -> None:
    """A subscriber that only counts: the same filter, QoS and shared group shape as one
    ingest worker, and nothing else."""
    received = 0
    last = 0.0
    lock = threading.Lock()

    def on_message(client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        nonlocal received, last
        with lock:
            received += 1
            last = time.time()

    client = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=f"bench-bare-{group}-{index}", protocol=mqtt.MQTTv5
    )
    client.on_message = on_message
    subscribed = threading.Event()
    client.on_subscribe = lambda *a: subscribed.set()
    client.connect("127.0.0.1", port, keepalive=60, clean_start=True)
    client.loop_start()
    client.subscribe(f"$share/{group}/edgefleet/v1/+/+/telemetry", qos=1)
    subscribed.wait(30)
    _say({"subscribed": subscribed.is_set()})
    q = _commands()
    while True:
        cmd = q.get().split()
        if cmd[:1] == ["count"]:
            with lock:
                _say({"received": received, "last_s": last})
        elif cmd[:1] == ["quit"]:
            client.disconnect()
            client.loop_stop()
            return


def agents(port: int, count: int, root: Path, state: Path, window_hz: float) -> None:
    from edge_agent.fleetsim import SimAgent, sim_config  # noqa: PLC0415 - only this role

    sims = [
        SimAgent(
            sim_config(
                device=f"agent-{i:03d}",
                site=ROLLOUT_SITE,
                state_dir=state / f"agent-{i:03d}",
                broker=("127.0.0.1", port),
                trust_root=root,
            ),
            window_hz=window_hz,
            seed=3 + i % 5,
        )
        for i in range(count)
    ]

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        q = _commands()

        def wait_quit() -> None:
            while q.get() != "quit":
                pass
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=wait_quit, daemon=True).start()
        _say({"started": count})
        async with asyncio.TaskGroup() as tg:
            for a in sims:
                tg.create_task(a.run(stop))
        _say({"serving": sorted({a.model_sha256() for a in sims})})

    asyncio.run(run())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.fleet_scale_peers")
    sub = ap.add_subparsers(dest="role", required=True)
    d = sub.add_parser("devices")
    d.add_argument("--port", type=int, required=True)
    d.add_argument("--count", type=int, required=True)
    d.add_argument("--tag", required=True)
    d.add_argument("--rate", type=float, default=1.0)
    b = sub.add_parser("bare")
    b.add_argument("--port", type=int, required=True)
    b.add_argument("--group", default="bare")
    b.add_argument("--index", type=int, default=0)
    a = sub.add_parser("agents")
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--count", type=int, required=True)
    a.add_argument("--root", type=Path, required=True)
    a.add_argument("--state", type=Path, required=True)
    a.add_argument("--window-hz", type=float, default=5.0)
    args = ap.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        if args.role == "devices":
            devices(args.port, args.count, args.tag, args.rate)
        elif args.role == "bare":
            bare(args.port, args.group, args.index)
        else:
            agents(args.port, args.count, args.root, args.state, args.window_hz)


if __name__ == "__main__":
    main()
