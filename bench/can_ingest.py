"""CAN ingest: frames/s, drops, latency and CPU of CanSource at a saturated bus rate.

``python -m bench.can_ingest [--quick] [--json]``

A sender process puts DBC-encodable frames on a python-can ``udp_multicast`` bus, paced at
8,000 frames/s (a saturated 1 Mbit/s classic CAN bus); a receiver process runs
:class:`~drivers.can.reader.CanSource` into a :class:`~drivers.buffer.SampleBuffer` that a
consumer coroutine drains, as the agent does. Both run in a private network namespace
(``tests.support.netns``) so no multicast reaches a real NIC; this needs root.

Every fourth frame is ``BENCH_CLOCK`` carrying the sender's ``time.time_ns()`` (64-bit
signal ``T_NS``); the others are 4-signal Intel, Motorola and multiplexed extended-id
frames (``bench/data/can_ingest.dbc``). Both processes read the same CLOCK_REALTIME, so

* ``p50_us``/``p99_us``: sample arrival stamp minus the sender's clock: the time from
  ``bus.send`` to the frame's arrival in our socket (UDP over ``lo``; the reader keeps the
  kernel's receive stamp, :mod:`drivers.can.reader`);
* ``delivery_p50_us``/``delivery_p99_us``: when the consumer drained the sample minus the
  sender's clock: adds decoding, batching (<= 2 ms) and the loop wake-up;
* ``drops``: samples the buffer dropped plus frames sent but never received;
* ``cpu_pct``: receiver process CPU (all threads) over the measured interval, % of one core;
* ``cpu_ms_per_1000_frames`` next to ``bare_cpu_ms_per_1000_frames``: CPU per 1,000 frames
  received of the receiver and of a bare python-can ``Bus.recv()`` loop on the same bus at
  the same rate (``bare_cpu_pct``, ``bare_drops``): what receive -> stamp -> decode ->
  sample costs above only receiving.

Then the rate is ramped until a step drops frames or the sender cannot keep the pace;
``max_frames_per_s`` is the best rate received with zero drops.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
BENCH_DBC = REPO / "bench" / "data" / "can_ingest.dbc"
GROUP = "239.74.163.77"
BASE_RATE = 8000
QUICK_RAMP = (12_000, 16_000, 24_000, 32_000, 48_000, 64_000)
FULL_RAMP = (12_000, 16_000, 20_000, 24_000, 28_000, 32_000, 40_000, 48_000, 64_000, 80_000)
#: Whole --quick run stays under 30 s: no new ramp step starts after this.
QUICK_BUDGET_S = 21.0
#: The non-clock frames: (message, fixed signals, signal -> value range), 64 variants each.
PAYLOADS: tuple[tuple[str, dict[str, int], dict[str, tuple[float, float]]], ...] = (
    (
        "BENCH_DRIVE",
        {},
        {
            "MOTOR_RPM": (0, 6000),
            "MOTOR_TORQUE": (-300, 300),
            "DC_VOLTAGE": (300, 650),
            "DC_CURRENT": (-200, 200),
        },
    ),
    (
        "BENCH_HYDRAULICS",
        {},
        {"PRESSURE_A": (0, 250), "PRESSURE_B": (-10, 250), "OIL_TEMP": (20, 90), "FLOW": (0, 120)},
    ),
    ("BENCH_VIBRATION", {"PAGE": 0}, {"AXIS_X": (-2, 2), "AXIS_Y": (-2, 2), "AXIS_Z": (-2, 2)}),
    (
        "BENCH_VIBRATION",
        {"PAGE": 1},
        {"VIB_RMS": (0, 20), "VIB_PEAK": (0, 60), "BEARING_TEMP": (20, 90)},
    ),
)
#: Sender counts as keeping the pace when it reaches this share of the target rate.
PACE_OK = 0.98


# -- sender (runs in the netns) -----------------------------------------------------------


def sender(group: str, port: int, rate: float, seconds: float) -> None:
    import can  # noqa: PLC0415 -- the parent process never needs python-can
    import cantools  # noqa: PLC0415

    db = cantools.database.load_file(BENCH_DBC)
    assert isinstance(db, cantools.database.can.Database)
    rng = random.Random(7)
    payloads: list[list[tuple[int, bool, bytes]]] = []
    for name, fixed, ranges in PAYLOADS:
        msg = db.get_message_by_name(name)
        payloads.append(
            [
                (
                    msg.frame_id,
                    msg.is_extended_frame,
                    msg.encode(
                        {**fixed, **{k: rng.uniform(lo, hi) for k, (lo, hi) in ranges.items()}}
                    ),
                )
                for _ in range(64)
            ]
        )
    clock = db.get_message_by_name("BENCH_CLOCK")
    probe = time.time_ns()
    # The hot loop writes T_NS with int.to_bytes; prove that is the DBC's layout.
    assert clock.encode({"T_NS": probe}) == probe.to_bytes(8, "little")

    total = int(rate * seconds)
    with can.Bus(interface="udp_multicast", channel=group, port=port, fd=False) as bus:
        send = bus.send
        message = can.Message
        t0 = time.perf_counter()
        for i in range(total):
            ahead = t0 + i / rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
            kind = i & 3
            if kind == 0:
                data = time.time_ns().to_bytes(8, "little")
                send(message(arbitration_id=0x100, is_extended_id=False, data=data))
                continue
            if kind == 3:
                kind += (i >> 2) & 1  # the multiplexed frame alternates its two pages
            frame_id, ext, data = payloads[kind - 1][(i >> 3) & 63]
            send(message(arbitration_id=frame_id, is_extended_id=ext, data=data))
        elapsed = time.perf_counter() - t0
    print(json.dumps({"sent": total, "elapsed_s": elapsed}), flush=True)


# -- receiver (runs in the netns) ---------------------------------------------------------


def _pct(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] / 1000.0


async def receiver(group: str, port: int) -> None:
    from drivers.buffer import SampleBuffer  # noqa: PLC0415
    from drivers.can.reader import CanSource  # noqa: PLC0415
    from drivers.specs import CanSpec  # noqa: PLC0415

    spec = CanSpec(
        name="bench",
        interface="udp_multicast",
        channel=group,
        dbc=BENCH_DBC,
        options={"port": port, "fd": False},
        recv_timeout_ms=100,
    )
    source = CanSource(spec)
    sink = SampleBuffer(maxlen=65_536)
    task = asyncio.create_task(source.run(sink), name="bench-can-source")
    stamp_lat: list[int] = []
    deliv_lat: list[int] = []
    first: tuple[float, float, int] | None = None  # monotonic, process_time, decoded
    last: tuple[float, float, int] | None = None
    stopping = False

    async def consume() -> None:
        nonlocal first, last
        while not stopping or len(sink):
            if not await sink.wait(0.05):
                continue
            batch = sink.drain()
            now = time.time_ns()
            for s in batch:
                if s.signal == "T_NS":
                    sent = int(s.value)
                    stamp_lat.append(s.t_ns - sent)
                    deliv_lat.append(now - sent)
            mark = (time.monotonic(), time.process_time(), int(source.stats()["decoded_frames"]))
            if first is None:
                first = mark
            last = mark

    consumer = asyncio.create_task(consume(), name="bench-consumer")
    for _ in range(2000):
        if source.stats()["state"] == "open":
            break
        await asyncio.sleep(0.005)
    print("READY", flush=True)
    # Blocks until the parent says the sender is done; a thread, not the loop.
    await asyncio.to_thread(sys.stdin.readline)
    # Let frames still in the socket and the buffer arrive before stopping.
    seen = -1
    while (frames := int(source.stats()["frames"])) != seen:
        seen = frames
        await asyncio.sleep(0.2)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    stopping = True
    await consumer
    stats = dict(source.stats())
    out: dict[str, Any] = {"stats": stats, "buffer_dropped": sink.dropped}
    if first is not None and last is not None and last[0] > first[0]:
        wall = last[0] - first[0]
        out["frames_per_s"] = (last[2] - first[2]) / wall
        out["cpu_pct"] = 100.0 * (last[1] - first[1]) / wall
        out["measured_s"] = wall
    stamp_lat.sort()
    deliv_lat.sort()
    out.update(
        latency_samples=len(stamp_lat),
        p50_us=_pct(stamp_lat, 0.50),
        p99_us=_pct(stamp_lat, 0.99),
        max_us=_pct(stamp_lat, 1.0),
        delivery_p50_us=_pct(deliv_lat, 0.50),
        delivery_p99_us=_pct(deliv_lat, 0.99),
    )
    print(json.dumps(out), flush=True)


def bare_receiver(group: str, port: int) -> None:
    """The baseline: a python-can ``Bus.recv()`` loop on the same bus that only counts
    frames, measured like the receiver (CPU between its first and last frame)."""
    import threading  # noqa: PLC0415

    import can  # noqa: PLC0415

    bus = can.Bus(interface="udp_multicast", channel=group, port=port, fd=False)
    stop = threading.Event()
    print("READY", flush=True)

    def wait_stop() -> None:
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=wait_stop, daemon=True).start()
    n = 0
    first: tuple[float, float] | None = None
    last: tuple[float, float] = (0.0, 0.0)
    while True:
        msg = bus.recv(0.2)
        if msg is None:
            if stop.is_set():
                break
            continue
        n += 1
        last = (time.monotonic(), time.process_time())
        if first is None:
            first = last
    bus.shutdown()
    out: dict[str, Any] = {"stats": {"frames": n}, "buffer_dropped": 0}
    if first is not None and last[0] > first[0]:
        wall = last[0] - first[0]
        out.update(frames_per_s=(n - 1) / wall, cpu_pct=100 * (last[1] - first[1]) / wall)
    nan = float("nan")
    out.update(p50_us=nan, p99_us=nan, delivery_p50_us=nan, delivery_p99_us=nan)
    print(json.dumps(out), flush=True)


def cpu_ms_per_1000(step: "Step") -> float:
    """CPU time one process spent per 1,000 frames received, in ms."""
    return 1e6 * (step.cpu_pct / 100.0) / step.frames_per_s if step.frames_per_s else 0.0


# -- orchestration (host namespace; starts the two processes in the netns) ----------------


@dataclass
class Step:
    rate: int
    sent: int
    sender_rate: float
    received: int
    frames_per_s: float
    buffer_dropped: int
    lost: int
    p50_us: float
    p99_us: float
    delivery_p50_us: float
    delivery_p99_us: float
    cpu_pct: float

    @property
    def drops(self) -> int:
        return self.buffer_dropped + self.lost

    @property
    def paced(self) -> bool:
        return self.sender_rate >= PACE_OK * self.rate


def run_step(ns: str, rate: int, seconds: float, port: int, role: str = "receiver") -> Step:
    from tests.support.netns import in_netns  # noqa: PLC0415

    me = [sys.executable, "-m", "bench.can_ingest"]
    bus = ["--group", GROUP, "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rx = subprocess.Popen(
        in_netns(ns, [*me, "--role", role, *bus]),
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        stdin: IO[str] | None = rx.stdin
        assert stdin is not None
        assert rx.stdout is not None
        ready = rx.stdout.readline().strip()
        if ready != "READY":
            raise RuntimeError(f"receiver did not start (said {ready!r})")
        tx = subprocess.run(
            in_netns(
                ns, [*me, "--role", "sender", *bus, "--rate", str(rate), "--seconds", str(seconds)]
            ),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=seconds * 3 + 30,
            check=True,
        )
        out, _ = rx.communicate("STOP\n", timeout=30)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    sent = json.loads(tx.stdout.strip().splitlines()[-1])
    got = json.loads(out.strip().splitlines()[-1])
    received = int(got["stats"]["frames"])
    return Step(
        rate=rate,
        sent=sent["sent"],
        sender_rate=sent["sent"] / sent["elapsed_s"],
        received=received,
        frames_per_s=got.get("frames_per_s", 0.0),
        buffer_dropped=got["buffer_dropped"],
        lost=max(0, sent["sent"] - received),
        p50_us=got["p50_us"],
        p99_us=got["p99_us"],
        delivery_p50_us=got["delivery_p50_us"],
        delivery_p99_us=got["delivery_p99_us"],
        cpu_pct=got.get("cpu_pct", float("nan")),
    )


def _row(s: Step) -> str:
    return (
        f"{s.rate:>7} {s.sender_rate:>9.0f} {s.sent:>8} {s.received:>8} {s.frames_per_s:>9.0f} "
        f"{s.drops:>6} {s.p50_us:>7.0f} {s.p99_us:>7.0f} {s.delivery_p50_us:>8.0f} "
        f"{s.delivery_p99_us:>8.0f} {s.cpu_pct:>6.1f}"
    )


HEADER = (
    "   rate   sent/s     sent     recv  frames/s  drops  p50 µs  p99 µs  dlv p50  dlv p99  cpu %"
)


def orchestrate(quick: bool, as_json: bool) -> int:
    from tests.support.netns import netns, netns_problem  # noqa: PLC0415

    problem = netns_problem()
    if problem is not None:
        print(f"can_ingest: cannot run: {problem}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    base_s, step_s = (4.0, 1.5) if quick else (10.0, 4.0)
    ramp_rates = QUICK_RAMP if quick else FULL_RAMP
    say = (lambda *a: print(*a, file=sys.stderr)) if as_json else print
    port = 41_000 + random.randrange(10_000)
    with netns("efbench") as ns:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        say(
            f"CAN ingest: udp_multicast {GROUP} in netns {ns}; sender -> CanSource -> "
            f"SampleBuffer; {os.cpu_count()} cpus, load average {load}"
        )
        say(HEADER)
        base = run_step(ns, BASE_RATE, base_s, port)
        say(_row(base))
        port += 1
        bare = run_step(ns, BASE_RATE, base_s, port, role="bare")
        say(_row(bare) + "   (bare Bus.recv loop)")
        say(f"ramp ({step_s:.1f} s per step):")
        best: Step | None = base if base.drops == 0 and base.paced else None
        limit = "base rate failed"
        for rate in ramp_rates:
            if quick and time.monotonic() - t_start > QUICK_BUDGET_S:
                limit = "time budget (--quick)"
                break
            port += 1
            step = run_step(ns, rate, step_s, port)
            say(_row(step))
            if step.drops:
                limit = f"drops at {rate} frames/s"
                break
            if not step.paced:
                limit = f"sender reached only {step.sender_rate:.0f} of {rate} frames/s"
                break
            if best is None or step.frames_per_s > best.frames_per_s:
                best = step
        else:
            limit = "end of ramp"
    max_fps = round(best.frames_per_s) if best is not None else 0
    say(
        f"at {BASE_RATE} frames/s: {base.frames_per_s:.0f} decoded frames/s, {base.drops} drops, "
        f"latency p50 {base.p50_us:.0f} µs p99 {base.p99_us:.0f} µs, "
        f"cpu {base.cpu_pct:.1f} % of one core; per 1,000 frames {cpu_ms_per_1000(base):.2f} ms "
        f"of CPU against {cpu_ms_per_1000(bare):.2f} ms for a bare Bus.recv loop"
    )
    say(
        f"max with zero drops: {max_fps} frames/s (ramp stopped: {limit}); "
        f"{time.monotonic() - t_start:.1f} s"
    )
    if as_json:
        print(
            json.dumps(
                {
                    "rate_hz": BASE_RATE,
                    "frames_per_s": round(base.frames_per_s, 1),
                    "drops": base.drops,
                    "p50_us": round(base.p50_us, 1),
                    "p99_us": round(base.p99_us, 1),
                    "cpu_pct": round(base.cpu_pct, 1),
                    "bare_cpu_pct": round(bare.cpu_pct, 1),
                    "cpu_ms_per_1000_frames": round(cpu_ms_per_1000(base), 2),
                    "bare_cpu_ms_per_1000_frames": round(cpu_ms_per_1000(bare), 2),
                    "bare_drops": bare.drops,
                    "max_frames_per_s": max_fps,
                    "delivery_p50_us": round(base.delivery_p50_us, 1),
                    "delivery_p99_us": round(base.delivery_p99_us, 1),
                    "max_limited_by": limit,
                }
            )
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.can_ingest", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument("--quick", action="store_true", help="short run (< 30 s)")
    parser.add_argument(
        "--json", action="store_true", help="figures as one JSON object on the last line"
    )
    parser.add_argument("--role", choices=("sender", "receiver", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--group", default=GROUP, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=BASE_RATE, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=1.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is None:
        return orchestrate(args.quick, args.json)
    from tests.support.netns import assert_isolated  # noqa: PLC0415

    assert_isolated()
    if args.role == "sender":
        sender(args.group, args.port, args.rate, args.seconds)
    elif args.role == "bare":
        bare_receiver(args.group, args.port)
    else:
        asyncio.run(receiver(args.group, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
