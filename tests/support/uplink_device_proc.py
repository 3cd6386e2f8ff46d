"""A device process for the uplink's kill tests: runs a real :class:`Uplink` and produces.

``python -m tests.support.uplink_device_proc --state-dir D --port P --count N [--rate R]``

Produces N decisions (R per second; 0: at once; with ``--after-connect`` only once the
uplink is connected), then prints one JSON line
``{"event": "produced", "boot_id": ..., "n": N}`` once they are committed to the outbox, then
a ``{"event": "stats", ...}`` line every 0.2 s. SIGTERM stops it cleanly (clean ``offline``);
tests SIGKILL it to see what survives. ``--ca/--cert/--key``: mutual TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time

from edge_agent.rules import Decision, RuleFiring
from edge_agent.uplink.config import TlsSection, UplinkSection
from edge_agent.uplink.publisher import Uplink

MODEL_SHA = "ab" * 32


def make_decision(i: int, *, pad: int = 0) -> Decision:
    """A realistic decision (~1 KB JSON); ``pad`` adds that many characters of reason text."""
    return Decision(
        trace_id=f"{i:032x}",
        t_ns=time.time_ns(),
        window_seq=i,
        window_start_ns=1_700_000_000_000_000_000 + i * 1_000_000_000,
        model_sha256=MODEL_SHA,
        model_version="1.2.0",
        model_ran=True,
        label="bearing_wear" if i % 7 == 0 else "normal",
        score=0.123456 + (i % 10) / 100,
        probabilities={"normal": 0.8, "bearing_wear": 0.15, "misalignment": 0.05},
        alarms=frozenset({"vibration_high"} if i % 7 == 0 else set()),
        raised=("vibration_high",) if i % 7 == 0 else (),
        cleared=(),
        rules_fired=(RuleFiring("hysteresis", "held for 3 windows" + "x" * pad),),
        top_signals=(("vibration_rms", 0.61), ("current", 0.22), ("temperature", 0.05)),
        attribution="occlusion",
        mode="full",
        stage_latency_ms={"perception": 0.412, "reasoning": 1.234, "rules": 0.05},
    )


def _emit(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _main(args: argparse.Namespace) -> None:
    tls = TlsSection(ca_file=args.ca, cert_file=args.cert, key_file=args.key) if args.ca else None
    section = UplinkSection(
        enabled=True,
        host="127.0.0.1",
        port=args.port,
        keepalive_s=5,
        tls=tls,
        replay_rate_per_s=args.replay_rate,
        reconnect_min_ms=100,
        reconnect_max_ms=500,
    )
    up = Uplink(
        section,
        site=args.site,
        device=args.device,
        device_type="press",
        agent_version="0.1.0",
        state_dir=args.state_dir,
        model_sha256=lambda: MODEL_SHA,
    )
    task = asyncio.create_task(up.run(), name="uplink")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    while args.after_connect and not up.stats()["connected"]:  # noqa: ASYNC110 - no event
        await asyncio.sleep(0.01)  # the birth (and the Last Will) then carry watermark 0
    for i in range(args.count):
        up.publish_decision(make_decision(i))
        if args.rate > 0:
            await asyncio.sleep(1 / args.rate)
    _emit({"event": "produced", "boot_id": up.session.boot_id, "n": args.count})
    while not stop.is_set():
        _emit({"event": "stats", **up.stats()})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    _emit({"event": "stopped"})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--state-dir", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", default="press-7")
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--replay-rate", type=float, default=1000.0)
    p.add_argument("--after-connect", action="store_true", help="produce once connected")
    p.add_argument("--site", default="plant1")
    # Mutual TLS (all three, or none): the CA that signed the broker, the device's own pair.
    p.add_argument("--ca")
    p.add_argument("--cert")
    p.add_argument("--key")
    asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    main()
