"""Modbus poll throughput and latency: our poller path vs a bare pymodbus loop.

Run as ``python -m bench.modbus_poll [--quick] [--json]``.

A pymodbus TCP server runs in a child process (its CPU must not share our event loop) on
loopback with one unit holding 10 registers. Both paths read the same 10-register request:

* **bare**: ``await client.read_holding_registers(0, count=10)`` in a tight loop;
* **ours**: :class:`drivers.modbus.poller.ModbusSource` with one 10-register block at
  ``poll_ms=0`` (as fast as the port answers) and deadband 0, so every read goes through the
  real path: scheduler, :class:`~drivers.modbus.client.ModbusClient`, decode of the 8 values
  in the block, 8 samples into a :class:`~drivers.buffer.SampleBuffer`.

The two alternate in short slices (order flipped every pair) so load from other processes
on a shared machine hits both alike. ``overhead_pct`` is the median over pairs of
``bare reads/s / our reads/s - 1``; its interquartile range shows how noisy the run was.
Latency is the cycle time between consecutive completed reads (for ours: between the
arrival stamps of consecutive samples of one signal), so it includes everything each path
does per read. ``cpu_us_per_read`` is this process's CPU time per read (the server runs
elsewhere): the least noisy view of what our layer costs.

With ``--json`` the last line is one JSON object with ``reads_per_s``, ``bare_reads_per_s``,
``overhead_pct``, ``p50_us``, ``p99_us`` (ours), plus ``bare_p50_us``, ``bare_p99_us``,
``overhead_p25_pct``, ``overhead_p75_pct``, ``cpu_us_per_read``, ``bare_cpu_us_per_read``.
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from pymodbus.client import AsyncModbusTcpClient
from pymodbus.datastore import ModbusDeviceContext, ModbusSequentialDataBlock, ModbusServerContext
from pymodbus.server import ModbusTcpServer

from drivers.buffer import SampleBuffer
from drivers.modbus.poller import ModbusSource
from drivers.specs import ModbusSpec, RegisterSpec

REGISTERS = 10
# A typical map: 4 plain words, 2 scaled temperatures and 2 word-swapped float32s, filling
# exactly the 10 registers the bare loop reads.
SIGNALS = (
    RegisterSpec("w0", 0),
    RegisterSpec("w1", 1),
    RegisterSpec("w2", 2, type="int16"),
    RegisterSpec("w3", 3, type="int16"),
    RegisterSpec("t0", 4, type="int16", scale=0.1, offset=-40.0),
    RegisterSpec("t1", 5, type="int16", scale=0.1, offset=-40.0),
    RegisterSpec("f0", 6, type="float32", order="CDAB"),
    RegisterSpec("f1", 8, type="float32", order="CDAB"),
)


def _serve(conn: Connection) -> None:
    """Child process: a pymodbus TCP server on a free loopback port, sent back via ``conn``."""

    async def main() -> None:
        sequential: Any = ModbusSequentialDataBlock
        context: Any = ModbusServerContext
        unit = ModbusDeviceContext(hr=sequential(1, list(range(100, 100 + REGISTERS))))
        server = ModbusTcpServer(context(devices={1: unit}, single=False), address=("127.0.0.1", 0))
        await server.serve_forever(background=True)
        conn.send(server.transport.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        await asyncio.Event().wait()

    asyncio.run(main())


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


class Slice:
    """One measured slice of one path: reads, wall and CPU seconds, per-read cycles (µs)."""

    def __init__(self, stamps_ns: list[int], cpu_s: float) -> None:
        if len(stamps_ns) < 2:
            raise RuntimeError("no reads completed in the slice")
        self.reads = len(stamps_ns) - 1
        self.seconds = (stamps_ns[-1] - stamps_ns[0]) / 1e9
        self.cpu_s = cpu_s
        self.cycles_us = [(b - a) / 1e3 for a, b in itertools.pairwise(stamps_ns)]

    @property
    def reads_per_s(self) -> float:
        return self.reads / self.seconds

    @property
    def cpu_us_per_read(self) -> float:
        return self.cpu_s / self.reads * 1e6


async def bare_slice(port: int, seconds: float) -> Slice:
    """``read_holding_registers`` in a tight loop.

    On a new connection per slice, as the poller gets: on loopback a fresh connection has a
    slightly heavier latency tail than one that has run for a while, which would otherwise
    be billed to our side.
    """
    client = AsyncModbusTcpClient("127.0.0.1", port=port, timeout=1, retries=0, reconnect_delay=0)
    if not await client.connect():
        raise RuntimeError(f"cannot connect to the bench server on port {port}")
    try:
        perf = time.perf_counter_ns
        for _ in range(20):  # warm up, as the poller slice does
            await client.read_holding_registers(0, count=REGISTERS, device_id=1)
        stamps: list[int] = []
        cpu0 = time.process_time()
        deadline = perf() + int(seconds * 1e9)
        while True:
            reply = await client.read_holding_registers(0, count=REGISTERS, device_id=1)
            t = perf()
            if reply.isError() or len(reply.registers) != REGISTERS:
                raise RuntimeError(f"bad reply {reply}")
            stamps.append(t)
            if t >= deadline:
                break
        cpu = time.process_time() - cpu0
    finally:
        client.close()
    return Slice(stamps, cpu)


async def ours_slice(port: int, seconds: float) -> Slice:
    """A fresh ModbusSource polling one 10-register block at ``poll_ms=0``."""
    regs = tuple(
        RegisterSpec(
            s.name,
            s.address,
            type=s.type,
            order=s.order,
            scale=s.scale,
            offset=s.offset,
            poll_ms=0,
        )
        for s in SIGNALS
    )
    source = ModbusSource(ModbusSpec("bench", port=port, timeout_ms=1000, registers=regs))
    if len(source.blocks) != 1 or source.blocks[0].count != REGISTERS:
        raise RuntimeError(f"expected one {REGISTERS}-register block, got {source.blocks}")
    sink = SampleBuffer(maxlen=100_000)
    task = asyncio.create_task(source.run(sink), name="modbus bench")
    stamps: list[int] = []
    try:
        # pymodbus sleeps 100 ms after connecting; then warm up like the bare loop.
        while source.replies < 20:  # noqa: ASYNC110 - a counter, no event to await
            await asyncio.sleep(0.005)
        sink.drain()
        cpu0 = time.process_time()
        deadline = time.monotonic() + seconds
        # Drain like the agent's perception stage does (every 20 ms): keeping every sample
        # alive instead would bill page faults and GC for a backlog no real consumer has.
        # Its cost is on our side of the comparison, so it only slices: each read emits
        # one sample per signal in map order, so every len(SIGNALS)-th is the block's stamp.
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(0.02, left))
            batch = sink.drain()
            if len(batch) % len(SIGNALS) or (batch and batch[0].signal != SIGNALS[0].name):
                raise RuntimeError("samples are not whole blocks in map order")
            stamps.extend(s.t_ns for s in batch[:: len(SIGNALS)])
        cpu = time.process_time() - cpu0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    stats = source.stats()
    if stats["timeouts"] or stats["errors"] or stats["exception_responses"]:
        raise RuntimeError(f"poller saw failures: {stats}")
    if sink.dropped:
        raise RuntimeError(f"bench consumer fell behind: {sink.dropped} samples dropped")
    return Slice(stamps, cpu)


async def measure(port: int, pairs: int, seconds: float) -> dict[str, float]:
    bare: list[Slice] = []
    ours: list[Slice] = []
    for i in range(pairs):
        # Short alternating slices, order flipped each pair, so background load on a shared
        # machine hits both paths alike; the overhead is taken pair by pair.
        if i % 2 == 0:
            b = await bare_slice(port, seconds)
            o = await ours_slice(port, seconds)
        else:
            o = await ours_slice(port, seconds)
            b = await bare_slice(port, seconds)
        bare.append(b)
        ours.append(o)
        print(
            f"  pair {i + 1:2d}: bare {b.reads_per_s:6.0f} reads/s "
            f"({b.cpu_us_per_read:5.1f} µs CPU/read), ours {o.reads_per_s:6.0f} reads/s "
            f"({o.cpu_us_per_read:5.1f} µs CPU/read)",
            flush=True,
        )
    overheads = sorted(b.reads_per_s / o.reads_per_s - 1.0 for b, o in zip(bare, ours, strict=True))
    ours_cycles = sorted(c for s in ours for c in s.cycles_us)
    bare_cycles = sorted(c for s in bare for c in s.cycles_us)
    return {
        "reads_per_s": round(statistics.median(s.reads_per_s for s in ours), 1),
        "bare_reads_per_s": round(statistics.median(s.reads_per_s for s in bare), 1),
        "overhead_pct": round(statistics.median(overheads) * 100.0, 2),
        "overhead_p25_pct": round(_percentile(overheads, 0.25) * 100.0, 2),
        "overhead_p75_pct": round(_percentile(overheads, 0.75) * 100.0, 2),
        "p50_us": round(_percentile(ours_cycles, 0.50), 1),
        "p99_us": round(_percentile(ours_cycles, 0.99), 1),
        "bare_p50_us": round(_percentile(bare_cycles, 0.50), 1),
        "bare_p99_us": round(_percentile(bare_cycles, 0.99), 1),
        "cpu_us_per_read": round(statistics.median(s.cpu_us_per_read for s in ours), 1),
        "bare_cpu_us_per_read": round(statistics.median(s.cpu_us_per_read for s in bare), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.modbus_poll", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="short run (< 30 s)")
    parser.add_argument("--json", action="store_true", help="print a JSON object as the last line")
    args = parser.parse_args(argv)
    pairs, seconds = (24, 0.25) if args.quick else (40, 1.0)

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(child,), name="modbus-bench-server", daemon=True)
    server.start()
    try:
        if not parent.poll(20):
            raise RuntimeError("bench server did not start")
        port = int(parent.recv())
        print(
            f"modbus poll bench: pymodbus server pid {server.pid} on 127.0.0.1:{port}, "
            f"{REGISTERS}-register reads, {pairs} pairs of {seconds:.1f} s slices"
        )
        result = asyncio.run(measure(port, pairs, seconds))
    finally:
        server.terminate()
        server.join(5)
    print(
        f"bare pymodbus loop : {result['bare_reads_per_s']:8.0f} reads/s  "
        f"p50 {result['bare_p50_us']:7.1f} µs  p99 {result['bare_p99_us']:7.1f} µs"
    )
    print(
        f"ModbusSource path  : {result['reads_per_s']:8.0f} reads/s  "
        f"p50 {result['p50_us']:7.1f} µs  p99 {result['p99_us']:7.1f} µs"
    )
    print(
        f"client CPU per read: ours {result['cpu_us_per_read']:.1f} µs, "
        f"bare {result['bare_cpu_us_per_read']:.1f} µs"
    )
    print(
        f"overhead           : {result['overhead_pct']:+.1f} % median of {pairs} paired slices "
        f"(IQR {result['overhead_p25_pct']:+.1f} .. {result['overhead_p75_pct']:+.1f} %; "
        "target <= 10 %)"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
