"""ModbusSource and ModbusClient against real pymodbus servers (TCP, RTU over TCP, RTU on a pty)."""

import asyncio
import contextlib
import itertools
import logging
import os
import random
import socket
import time
import tty
from collections.abc import AsyncIterator

import pytest
from pymodbus import FramerType

from drivers.buffer import SampleBuffer
from drivers.errors import (
    ModbusConnectionError,
    ModbusError,
    ModbusExceptionResponse,
    ModbusTimeout,
)
from drivers.modbus.client import ModbusClient
from drivers.modbus.poller import ModbusSource
from drivers.source import Source, open_source
from drivers.specs import ModbusSpec, RegisterSpec
from tests.support.modbus_peer import (
    Collector,
    device,
    running_peer,
    running_source,
    sparse_device,
    start_peer,
    start_serial_peer,
    wait_until,
)

pytestmark = pytest.mark.peers

FAST = {"timeout_ms": 100, "backoff_min_ms": 1000, "backoff_max_ms": 4000}


def _spec(port: int, *regs: RegisterSpec, **kw: object) -> ModbusSpec:
    return ModbusSpec("plc", port=port, registers=regs, **kw)  # type: ignore[arg-type]


# --- the client adapter ------------------------------------------------------------------


def test_client_maps_pymodbus_failures_to_our_errors() -> None:
    async def main() -> None:
        async with running_peer({1: device(size=100)}) as peer:
            peer.set_registers(1, "holding", 0, [11, 22])
            async with ModbusClient(_spec(peer.port, timeout_ms=150)) as client:
                assert await client.read("holding", 1, 0, 2) == [11, 22]
                assert await client.read("coil", 1, 0, 3) == [False, False, False]

                with pytest.raises(ModbusExceptionResponse) as refused:
                    await client.read("holding", 1, 99, 2)  # runs past the mapped 100
                assert (refused.value.code, refused.value.unit, refused.value.address) == (2, 1, 99)
                assert refused.value.name == "illegal data address"
                assert "exception code 2 (illegal data address) reading holding 99+2" in str(
                    refused.value
                )

                t0 = time.monotonic()
                with pytest.raises(ModbusTimeout) as silent:
                    await client.read("holding", 7, 0, 1)  # no unit 7: never answers
                assert 0.14 <= time.monotonic() - t0 < 0.5
                assert silent.value.unit == 7

                # Still usable after both.
                assert await client.read("holding", 1, 1, 1) == [22]
            assert not client.connected

        async with ModbusClient(_spec(peer.port)) as client:  # server gone: refused
            with pytest.raises(
                ModbusConnectionError, match=r"127\.0\.0\.1:\d+: connection refused$"
            ):
                await client.read("holding", 1, 0, 1)

    asyncio.run(main())


def test_a_reply_of_another_function_is_an_error_not_data() -> None:
    """A gateway that answers a holding-register read with an input-register reply of the
    right length (pymodbus pairs replies by transaction id only): refused, not decoded."""

    def reply(tid: int, uid: int, fc: int, regs: list[int]) -> bytes:
        pdu = bytes([fc, 2 * len(regs)]) + b"".join(r.to_bytes(2, "big") for r in regs)
        return (
            tid.to_bytes(2, "big")
            + b"\0\0"
            + (len(pdu) + 1).to_bytes(2, "big")
            + bytes([uid])
            + pdu
        )

    async def gateway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readexactly(7)
                tid, uid = int.from_bytes(head[:2], "big"), head[6]
                body = await reader.readexactly(int.from_bytes(head[4:6], "big") - 1)
                fc, count = body[0], int.from_bytes(body[3:5], "big")
                n += 1
                wrong = n == 2
                writer.write(reply(tid, uid, 4 if wrong else fc, [0xDEAD if wrong else 7] * count))
                await writer.drain()

    async def main() -> None:
        server = await asyncio.start_server(gateway, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with ModbusClient(_spec(port, timeout_ms=300)) as client:
                assert await client.read("holding", 1, 0, 2) == [7, 7]
                with pytest.raises(ModbusError, match="function code 4 to a holding read"):
                    await client.read("holding", 1, 0, 2)
                assert await client.read("holding", 1, 0, 2) == [7, 7]  # still usable
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_connection_lost_mid_request_is_a_connection_error_at_once() -> None:
    """Not a timeout, and not after one: pymodbus alone leaves the request waiting."""

    async def main() -> None:
        peer = await start_peer({1: device()})
        async with ModbusClient(_spec(peer.port, timeout_ms=5000)) as client:
            pending = asyncio.create_task(client.read("holding", 9, 0, 1))  # silent unit
            await wait_until(lambda: peer.requests[9] == 1)
            t0 = time.monotonic()
            await peer.stop()  # drops the connection while the request waits
            with pytest.raises(ModbusConnectionError, match="lost"):
                await pending
            assert time.monotonic() - t0 < 2.0
            assert not client.connected

    asyncio.run(main())


def test_every_read_gets_its_whole_timeout() -> None:
    """The timeout is kept by one watchdog per port rather than a timer per request: a
    silent unit asked after a run of answered reads still waits its full timeout from its
    own start, not from when the watchdog was first armed."""

    async def main() -> None:
        async with (
            running_peer({1: device()}) as peer,
            ModbusClient(_spec(peer.port, timeout_ms=300)) as client,
        ):
            first = time.monotonic()
            while time.monotonic() - first < 0.25:  # the watchdog's first deadline nears
                assert await client.read("holding", 1, 0, 1) == [0]
            for _ in range(2):
                t0 = time.monotonic()
                with pytest.raises(ModbusTimeout):
                    await client.read("holding", 7, 0, 1)
                assert 0.29 <= time.monotonic() - t0 < 0.8
            assert await client.read("holding", 1, 0, 1) == [0]  # answered reads go on

    asyncio.run(main())


def test_a_port_that_never_accepts_is_a_connect_timeout() -> None:
    """A listener whose backlog is full drops the handshake: the connect is bounded by the
    spec's timeout and says so."""

    async def main() -> None:
        with contextlib.ExitStack() as stack:
            listener = stack.enter_context(socket.socket())
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)
            port = listener.getsockname()[1]
            filler = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
            assert filler.fileno() >= 0
            async with ModbusClient(_spec(port, timeout_ms=200)) as client:
                t0 = time.monotonic()
                with pytest.raises(ModbusConnectionError, match="no answer within 200 ms"):
                    await client.read("holding", 1, 0, 1)
                assert 0.19 <= time.monotonic() - t0 < 1.5

    asyncio.run(main())


def test_gateway_exception_for_a_missing_unit_backs_the_unit_off() -> None:
    """A server that answers code 11 (gateway target failed) for a missing unit."""

    async def main() -> None:
        async with running_peer({1: device()}, ignore_missing=False) as peer:
            spec = _spec(
                peer.port,
                RegisterSpec("live", 0, unit=1, poll_ms=20),
                RegisterSpec("gone", 0, unit=5, poll_ms=20),
                **FAST,
            )
            source = ModbusSource(spec, rng=random.Random(1))
            got = Collector(SampleBuffer(1000))
            async with running_source(source, got.sink):
                await wait_until(lambda: len(got.values("live")) >= 10)
            stats = source.stats()
            assert stats["unit.5.state"] == "backoff"
            assert stats["unit.5.exception_responses"] == 1
            assert stats["unit.1.state"] == "ok"
            assert peer.requests[5] == 1

    asyncio.run(main())


# --- scheduling and isolation ------------------------------------------------------------


def test_dead_unit_does_not_delay_the_live_unit_and_poller_survives() -> None:
    period, window = 0.05, 2.0

    async def main() -> None:
        async with running_peer({1: device()}) as peer:  # unit 2 is dead: never answers
            spec = _spec(
                peer.port,
                RegisterSpec("live", 0, unit=1, poll_ms=int(period * 1000)),
                RegisterSpec("dead", 0, unit=2, poll_ms=int(period * 1000)),
                **FAST,
            )
            source = ModbusSource(spec, rng=random.Random(3))
            got = Collector(SampleBuffer(10_000))
            async with running_source(source, got.sink) as task:
                await wait_until(lambda: got.has("live"))
                first = got.pull()["live"][0].t_ns
                await asyncio.sleep(window)
                assert not task.done()
            live = [s.t_ns for s in got.pull()["live"] if s.t_ns <= first + window * 1e9]
            expected = window / period
            # Each probe of the dead unit costs the port one timeout (100 ms); with a 1 s
            # minimum backoff that is at most 3 probes in the window.
            assert len(live) >= 0.75 * expected, (len(live), expected)
            worst_gap = max(b - a for a, b in itertools.pairwise(live)) / 1e9
            assert worst_gap < period + spec.timeout_ms / 1000 + 0.1, worst_gap
            stats = source.stats()
            assert stats["unit.2.state"] == "backoff"
            assert stats["unit.1.state"] == "ok"
            assert 1 <= peer.requests[2] <= 3  # probes only, not every 50 ms
            assert stats["timeouts"] == peer.requests[2]
            assert "dead" not in got.pull()

    asyncio.run(main())


def test_pymodbus_closing_the_connection_after_silent_units_is_ridden_out() -> None:
    """pymodbus drops the TCP connection after 5 unanswered requests in a row; we reconnect."""

    async def main() -> None:
        async with running_peer({1: device()}) as peer:
            dead = [RegisterSpec(f"dead{u}", 0, unit=u, poll_ms=60_000) for u in range(2, 8)]
            spec = _spec(peer.port, RegisterSpec("live", 0, poll_ms=20), *dead, timeout_ms=50)
            source = ModbusSource(spec, rng=random.Random(5))
            got = Collector(SampleBuffer(10_000))
            async with running_source(source, got.sink):
                await wait_until(lambda: source.timeouts >= 6)
                n = len(got.values("live"))
                await wait_until(lambda: len(got.values("live")) >= n + 5)
            stats = source.stats()
            assert int(stats["reconnects"]) >= 1
            assert stats["connection_errors"] == 0
            assert stats["timeouts"] == 6

    asyncio.run(main())


def test_exception_reply_is_counted_logged_once_and_the_unit_stays_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        async with running_peer({1: device(size=100)}) as peer:
            spec = _spec(
                peer.port,
                RegisterSpec("good", 0, poll_ms=10),
                RegisterSpec("unmapped", 500, poll_ms=10),
                **FAST,
            )
            source = ModbusSource(spec)
            got = Collector(SampleBuffer(10_000))
            async with running_source(source, got.sink):
                await wait_until(lambda: source.exception_responses >= 10)
            stats = source.stats()
            assert stats["unit.1.state"] == "ok"
            assert stats["unit.1.exception_responses"] == stats["exception_responses"]
            assert len(got.values("good")) >= 9
            assert "unmapped" not in got.pull()

    with caplog.at_level(logging.WARNING, logger="drivers.modbus.poller"):
        asyncio.run(main())
    msgs = [r.getMessage() for r in caplog.records if "exception code" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert "unit 1 answered exception code 2 for holding 500+1 (unmapped)" in msgs[0]
    # pymodbus' own error logging (one line with a frame dump per reply) is quiet.
    assert not [r for r in caplog.records if r.name.startswith("pymodbus")]


def test_block_over_an_unmapped_hole_is_split_into_single_reads() -> None:
    # Unit maps 0..4 and 10..14 only; max_gap=9 coalesces 0 and 10 into one read over the hole.
    unit = sparse_device({0: [5, 0, 0, 0, 0], 10: [7, 0, 0, 0, 0]})

    async def main() -> None:
        async with running_peer({1: unit}) as peer:
            spec = _spec(peer.port, RegisterSpec("a", 0), RegisterSpec("b", 10), max_gap=9)
            source = ModbusSource(spec)
            assert len(source.blocks) == 1
            got = Collector(SampleBuffer(1000))
            async with running_source(source, got.sink):
                await wait_until(lambda: got.has("a", "b"))
            assert got.values("a")[0] == 5
            assert got.values("b")[0] == 7
            assert source.stats()["blocks_split"] == 1

    asyncio.run(main())


# --- deadband and heartbeat --------------------------------------------------------------


def test_deadband_emits_only_moves_of_at_least_deadband() -> None:
    steady = RegisterSpec("steady", 0, deadband=5.0, poll_ms=10)
    every = RegisterSpec("every", 1, poll_ms=10)  # deadband 0: every poll

    async def main() -> None:
        async with running_peer({1: device()}) as peer:
            spec = _spec(peer.port, steady, every, heartbeat_ms=60_000)
            source = ModbusSource(spec)
            got = Collector(SampleBuffer(10_000))

            async def polls(n: int) -> None:
                target = peer.requests[1] + n
                await wait_until(lambda: peer.requests[1] >= target)

            peer.write(1, steady, 100)
            async with running_source(source, got.sink):
                await wait_until(lambda: got.has("steady"))
                for value in (103, 96, 104):  # all within 5 of 100: suppressed
                    peer.write(1, steady, value)
                    await polls(3)
                peer.write(1, steady, 106)  # moved 6
                await wait_until(lambda: 106 in got.values("steady"))
                peer.write(1, steady, 101)  # exactly 5 back: emitted
                await wait_until(lambda: 101 in got.values("steady"))
                await polls(3)
            assert got.values("steady") == [100, 106, 101]
            assert source.stats()["replies"] == len(got.values("every"))

    asyncio.run(main())


def test_heartbeat_re_emits_a_steady_value() -> None:
    heartbeat = 0.2
    reg = RegisterSpec("steady", 0, deadband=1e9, poll_ms=10)

    async def main() -> None:
        async with running_peer({1: device()}) as peer:
            peer.write(1, reg, 42)
            spec = _spec(peer.port, reg, heartbeat_ms=int(heartbeat * 1000))
            source = ModbusSource(spec)
            got = Collector(SampleBuffer(10_000))
            async with running_source(source, got.sink):
                await wait_until(lambda: len(got.values("steady")) >= 5)
            stamps = [s.t_ns / 1e9 for s in got.pull()["steady"]]
            gaps = [b - a for a, b in itertools.pairwise(stamps)]
            # Each re-emission is the first poll at or after the heartbeat.
            assert all(heartbeat - 0.002 <= g < heartbeat + 0.08 for g in gaps), gaps
            assert set(got.values("steady")) == {42}

    asyncio.run(main())


# --- connection loss and cancellation ----------------------------------------------------


def test_reconnects_after_the_server_restarts() -> None:
    reg = RegisterSpec("v", 0, poll_ms=10)

    async def main() -> None:
        peer = await start_peer({1: device()})
        port = peer.port
        peer.write(1, reg, 1)
        spec = _spec(port, reg, timeout_ms=200, backoff_min_ms=50, backoff_max_ms=200)
        source = ModbusSource(spec, rng=random.Random(0))
        got = Collector(SampleBuffer(10_000))
        async with running_source(source, got.sink) as task:
            await wait_until(lambda: got.has("v"))
            await peer.stop()
            await wait_until(lambda: source.connection_errors >= 2)
            assert source.stats()["connected"] == 0
            peer = await start_peer({1: device()}, port=port)
            peer.write(1, reg, 2)
            await wait_until(lambda: 2 in got.values("v"))
            assert not task.done()
            stats = source.stats()
        await peer.stop()
        assert int(stats["reconnects"]) >= 1
        assert stats["connected"] == 1
        assert stats["unit.1.state"] == "ok"  # the port failed, not the unit

    asyncio.run(main())


def test_starts_while_the_server_is_down_and_connects_when_it_comes_up() -> None:
    reg = RegisterSpec("v", 0, poll_ms=10)

    async def main() -> None:
        peer = await start_peer({1: device()})
        port = peer.port
        await peer.stop()  # nothing listens on `port` now
        spec = _spec(port, reg, timeout_ms=200, backoff_min_ms=50, backoff_max_ms=200)
        source = ModbusSource(spec, rng=random.Random(0))
        got = Collector(SampleBuffer(1000))
        async with running_source(source, got.sink):
            await wait_until(lambda: source.connection_errors >= 2)
            assert source.requests == 0
            peer = await start_peer({1: device()}, port=port)
            peer.write(1, reg, 7)
            await wait_until(lambda: 7 in got.values("v"))
            stats = source.stats()
        await peer.stop()
        assert stats["reconnects"] == 0  # the first connection is not a reconnect
        assert stats["late_polls"] == 0

    asyncio.run(main())


def test_cancel_ends_run_promptly_even_mid_request() -> None:
    """Cancelling while pymodbus waits on a 5 s timeout ends within milliseconds."""

    async def main() -> None:
        async with running_peer({1: device()}) as peer:
            spec = _spec(peer.port, RegisterSpec("dead", 0, unit=9), timeout_ms=5000)
            source = ModbusSource(spec)
            task = asyncio.create_task(source.run(SampleBuffer(10)))
            await wait_until(lambda: peer.requests[9] == 1)
            t0 = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert time.monotonic() - t0 < 0.2

    asyncio.run(main())


def test_cancel_is_never_lost_while_polling_flat_out() -> None:
    """At poll_ms=0 a reply often lands in the same loop pass as the cancellation.

    Python 3.11's wait_for then returns the reply and drops the CancelledError; the client
    must raise it again or run() keeps polling after it was told to stop.
    """

    async def main() -> None:
        async with running_peer({1: device()}) as peer:
            spec = _spec(peer.port, RegisterSpec("v", 0, poll_ms=0))
            rng = random.Random(11)
            for _ in range(15):
                source = ModbusSource(spec)
                task = asyncio.create_task(source.run(SampleBuffer(100)))
                await wait_until(lambda s=source: s.replies >= 1)  # type: ignore[misc]
                await asyncio.sleep(rng.uniform(0, 0.003))
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=1.0)
                assert task in done, f"run() ignored cancel after {source.replies} replies"
                assert task.cancelled()

    asyncio.run(main())


def test_task_group_failure_stops_the_poller_promptly() -> None:
    """A sibling's failure cancels run() through the TaskGroup instead of waiting it out."""

    class Boom(Exception):
        pass

    async def main() -> None:
        async with running_peer({1: device()}) as peer:
            spec = _spec(peer.port, RegisterSpec("dead", 0, unit=9), timeout_ms=5000)
            source = ModbusSource(spec)

            async def sibling() -> None:
                await wait_until(lambda: peer.requests[9] == 1)
                raise Boom

            async def service() -> None:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(source.run(SampleBuffer(10)), name="modbus plc")
                    tg.create_task(sibling(), name="sibling")

            t0 = time.monotonic()
            with pytest.raises(ExceptionGroup) as group:
                await service()
            assert group.value.subgroup(Boom) is not None
            assert len(group.value.exceptions) == 1  # the poller ended by cancellation
            assert time.monotonic() - t0 < 1.0

    asyncio.run(main())


def test_factory_builds_a_modbus_source() -> None:
    source = open_source(ModbusSpec("plc", registers=(RegisterSpec("a", 0),)))
    assert isinstance(source, ModbusSource)
    assert isinstance(source, Source)
    assert source.name == "plc"
    assert source.stats()["requests"] == 0


# --- RTU framing -------------------------------------------------------------------------


def test_rtu_frames_over_tcp() -> None:
    """RTU framer (CRC, no MBAP) through pyserial's socket:// URL to a pymodbus RTU server."""
    regs = (
        RegisterSpec("f", 0, type="float32", order="CDAB"),
        RegisterSpec("c", 3, function="coil", type="bool"),
        RegisterSpec("dead", 0, unit=4),
    )

    async def main() -> None:
        async with running_peer({1: device()}, framer=FramerType.RTU) as peer:
            peer.write(1, regs[0], 1.5)
            peer.set_registers(1, "coil", 3, [True])
            spec = ModbusSpec(
                "rtu",
                transport="rtu",
                device=f"socket://127.0.0.1:{peer.port}",
                registers=regs,
                **FAST,  # type: ignore[arg-type]
            )
            source = ModbusSource(spec)
            got = Collector(SampleBuffer(1000))
            async with running_source(source, got.sink):
                await wait_until(lambda: len(got.values("f")) >= 3 and got.has("c"))
            assert got.values("f")[0] == 1.5
            assert got.values("c")[0] == 1.0
            assert source.stats()["unit.4.state"] == "backoff"

    asyncio.run(main())


@contextlib.asynccontextmanager
async def null_modem() -> AsyncIterator[tuple[str, str]]:
    """Two real ttys wired back to back: a null-modem cable between two pty pairs.

    Like ``socat pty pty`` without the dependency: bytes written to one slave come out of
    the other. Raw mode, so the line discipline neither echoes nor edits frames.
    """
    loop = asyncio.get_running_loop()
    (master_a, slave_a), (master_b, slave_b) = os.openpty(), os.openpty()
    for fd in (slave_a, slave_b):
        tty.setraw(fd)
    for fd in (master_a, master_b):
        os.set_blocking(fd, False)

    def pump(src: int, dst: int) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(dst, os.read(src, 4096))

    loop.add_reader(master_a, pump, master_a, master_b)
    loop.add_reader(master_b, pump, master_b, master_a)
    try:
        yield os.ttyname(slave_a), os.ttyname(slave_b)
    finally:
        loop.remove_reader(master_a)
        loop.remove_reader(master_b)
        for fd in (master_a, slave_a, master_b, slave_b):
            os.close(fd)


def test_rtu_on_a_serial_line() -> None:
    regs = (
        RegisterSpec("i", 0, type="int32", order="DCBA"),
        RegisterSpec("u", 5),
        RegisterSpec("dead", 0, unit=3),
        RegisterSpec("unmapped", 5000),
    )

    async def main() -> None:
        async with null_modem() as (server_tty, client_tty):
            await serial_main(server_tty, client_tty)

    async def serial_main(server_tty: str, client_tty: str) -> None:
        peer = await start_serial_peer({1: device()}, server_tty)
        try:
            peer.write(1, regs[0], -70000)
            peer.write(1, regs[1], 513)
            spec = ModbusSpec(
                "rs485",
                transport="rtu",
                device=client_tty,
                baudrate=115200,
                parity="N",
                registers=regs,
                **FAST,  # type: ignore[arg-type]
            )
            source = ModbusSource(spec)
            got = Collector(SampleBuffer(1000))
            async with running_source(source, got.sink):
                await wait_until(lambda: len(got.values("u")) >= 5 and got.has("i"))
                await wait_until(lambda: source.exception_responses >= 1)
            assert got.values("i")[0] == -70000
            assert got.values("u")[0] == 513
            stats = source.stats()
            assert stats["unit.3.state"] == "backoff"
            assert stats["unit.1.state"] == "ok"
        finally:
            await peer.stop()

    asyncio.run(main())
