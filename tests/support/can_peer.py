"""The two ends of the cross-process CAN test, each run in its own process in a netns.

``python -m tests.support.can_peer recv ...`` runs our :class:`CanSource` on a ``udp_multicast``
bus, prints ``READY`` once the bus is open, and when it has seen ``--expect`` frames (or
``--timeout`` passed) prints one JSON line with its stats and every sample.

``python -m tests.support.can_peer send ...`` plays the first ``--count`` frames of a candump
capture onto the bus at ``--rate`` frames/s and prints one JSON line with the
``time.time_ns()`` taken just before each send.
"""

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import can

from drivers.buffer import SampleBuffer
from drivers.can.reader import CanSource
from drivers.specs import CanSpec
from tests.support.netns import assert_isolated


def pace(i: int, t0: float, rate: float) -> None:
    """Sleep until frame ``i`` is due; frames already late are sent back to back."""
    ahead = t0 + i / rate - time.perf_counter()
    if ahead > 0:
        time.sleep(ahead)


def send(args: argparse.Namespace) -> None:
    frames: list[can.Message] = []
    for msg in can.LogReader(args.capture):
        if len(frames) >= args.count:
            break
        frames.append(msg)
    sent_ns: list[int] = []
    with can.Bus(interface="udp_multicast", channel=args.group, port=args.port, fd=False) as bus:
        t0 = time.perf_counter()
        for i, msg in enumerate(frames):
            pace(i, t0, args.rate)
            sent_ns.append(time.time_ns())
            bus.send(msg)
    print(json.dumps({"sent": len(frames), "sent_ns": sent_ns}), flush=True)


async def poll(cond: Callable[[], bool], deadline: float) -> None:
    """Return when ``cond()`` holds or at ``deadline``; the JSON report tells which."""
    while not cond():
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(0.005)


async def receive(args: argparse.Namespace) -> None:
    spec = CanSpec(
        name="peer",
        interface="udp_multicast",
        channel=args.group,
        dbc=Path(args.dbc),
        options={"port": args.port, "fd": False},
        recv_timeout_ms=50,
    )
    source = CanSource(spec)
    sink = SampleBuffer(maxlen=1_000_000)
    task = asyncio.create_task(source.run(sink), name="can-peer-source")
    deadline = time.monotonic() + args.timeout
    await poll(lambda: source.stats()["state"] == "open", deadline)
    print("READY", flush=True)

    def seen() -> int:
        s = source.stats()
        return int(s["frames"]) + int(s["error_frames"]) + int(s["remote_frames"])

    await poll(lambda: seen() >= args.expect, deadline)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    samples = [[s.signal, s.value, s.t_ns] for s in sink.drain()]
    print(
        json.dumps({"stats": dict(source.stats()), "dropped": sink.dropped, "samples": samples}),
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.can_peer")
    sub = parser.add_subparsers(dest="role", required=True)
    rx = sub.add_parser("recv")
    rx.add_argument("--dbc", required=True)
    rx.add_argument("--expect", type=int, required=True)
    rx.add_argument("--timeout", type=float, default=10.0)
    tx = sub.add_parser("send")
    tx.add_argument("--capture", required=True)
    tx.add_argument("--count", type=int, required=True)
    tx.add_argument("--rate", type=float, default=2000.0)
    for p in (rx, tx):
        p.add_argument("--group", required=True)
        p.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    assert_isolated()
    if args.role == "send":
        send(args)
    else:
        asyncio.run(receive(args))


if __name__ == "__main__":
    main(sys.argv[1:])
