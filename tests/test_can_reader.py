"""CanSource over python-can's in-process virtual bus, and over a bus that vanishes."""

import asyncio
import socket
import struct
import threading
import time
import uuid
from typing import Any

import can
import can.interfaces.virtual
import pytest

from drivers.buffer import SampleBuffer
from drivers.can.reader import RECEIVE_BUFFER_BYTES, CanSource, widen_receive_buffer
from drivers.errors import CanError, DriverConfigError
from drivers.sample import Sample
from drivers.specs import CanSpec
from tests.support.can import SYNTHETIC_DBC, wait_until

pytestmark = pytest.mark.peers

EXT_ID = 0x18FF0103
ENGINE = bytes([0x71, 0x17, 0x1C, 0x73, 0xF3, 0x00, 0x00, 0x00])  # RPM 1500.25, TEMP -12 ...
EXT = struct.pack(">h", 2234) + struct.pack("<b", -7) + b"\x00" + struct.pack("<f", 13.75)


def virtual_spec(channel: str, **kw: Any) -> CanSpec:
    return CanSpec(
        name="vcan",
        interface="virtual",
        channel=channel,
        dbc=SYNTHETIC_DBC,
        recv_timeout_ms=50,
        **kw,
    )


def engine_frame(timestamp: float = 0.0) -> can.Message:
    """The 0x100 ENGINE frame, stamped ``timestamp`` (a bus with ``preserve_timestamps``
    delivers it as the receive stamp)."""
    return can.Message(arbitration_id=0x100, data=ENGINE, is_extended_id=False, timestamp=timestamp)


def stat(source: CanSource, key: str) -> int:
    return int(source.stats()[key])


async def stop(task: "asyncio.Task[None]") -> float:
    """Cancel ``task``; return how long it took to finish."""
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return time.monotonic() - t0


async def running_source(
    channel: str, maxlen: int = 1000
) -> tuple[CanSource, SampleBuffer, "asyncio.Task[None]"]:
    """A CanSource on virtual ``channel`` reading into a new buffer, once its bus is open."""
    source = CanSource(virtual_spec(channel))
    sink = SampleBuffer(maxlen)
    task = asyncio.create_task(source.run(sink))
    await wait_until(lambda: source.stats()["state"] == "open", 5, "bus open")
    return source, sink, task


def test_frames_become_samples_stamped_on_arrival() -> None:
    channel = f"test-{uuid.uuid4()}"

    async def main() -> tuple[list[Sample], CanSource, int, int]:
        source, sink, task = await running_source(channel)
        with can.Bus(interface="virtual", channel=channel) as tx:
            before = time.time_ns()
            tx.send(can.Message(arbitration_id=0x100, data=ENGINE, is_extended_id=False))
            tx.send(can.Message(arbitration_id=EXT_ID, data=EXT, is_extended_id=True))
            tx.send(can.Message(arbitration_id=0x7FF, data=bytes(8), is_extended_id=False))
            tx.send(can.Message(arbitration_id=0x100, data=b"\x01\x02", is_extended_id=False))
            tx.send(can.Message(is_error_frame=True))
            tx.send(
                can.Message(arbitration_id=0x100, is_remote_frame=True, dlc=8, is_extended_id=False)
            )
            await wait_until(lambda: len(sink) == 7, 5, "7 samples")
            after = time.time_ns()
        samples = sink.drain()
        await stop(task)
        return samples, source, before, after

    samples, source, before, after = asyncio.run(main())
    assert [s.signal for s in samples] == [
        "RPM",
        "ENGINE.TEMP",
        "GEAR_STATE",
        "TORQUE",
        "HEIGHT",
        "EXT_STATUS.TEMP",
        "VOLTAGE",
    ]
    assert [s.value for s in samples] == pytest.approx(
        [1500.25, -12.0, 3.0, -100.5, 12.34, -3.5, 13.75]
    )
    # The virtual bus stamps each frame with time.time() as it is sent: float seconds, so
    # a stamp may read up to ~0.3 us below the integer clock read just before.
    assert all(before - 1_000 <= s.t_ns <= after for s in samples)
    # One stamp per frame, taken at arrival: the two frames' samples differ, a frame's agree.
    assert len({s.t_ns for s in samples[:4]}) == 1
    assert len({s.t_ns for s in samples[4:]}) == 1
    assert samples[4].t_ns >= samples[0].t_ns
    stats = source.stats()
    assert stats["frames"] == 4
    assert stats["decoded_frames"] == 2
    assert stats["unknown_frames"] == 1
    assert source.unknown_ids == {(0x7FF, False): 1}
    assert stats["decode_errors"] == 1
    assert stats["error_frames"] == 1
    assert stats["remote_frames"] == 1
    assert stats["samples"] == 7
    assert stats["bus_errors"] == 0
    assert stats["state"] == "stopped"


def test_the_bus_stamp_is_kept_when_on_the_wall_clock_else_replaced_on_arrival() -> None:
    """SocketCAN and udp_multicast stamp a frame with the kernel's receive time: that is the
    sample's stamp, even when the reader takes the frame later. A stamp that is not on the
    wall clock (an adapter's own counter) or lies in the future is replaced by the arrival
    time, and the frames after it are still read."""
    channel = f"test-{uuid.uuid4()}"

    async def main() -> tuple[list[Sample], int, int, float]:
        _, sink, task = await running_source(channel)
        # preserve_timestamps: the virtual bus delivers the sender's stamp, as a kernel would
        # its own receive time.
        with can.Bus(interface="virtual", channel=channel, preserve_timestamps=True) as tx:
            before = time.time_ns()
            received_at = (before - 300_000_000) / 1e9  # the kernel took it 300 ms ago
            for stamp in (received_at, 12.5, (before + 5_000_000_000) / 1e9, received_at):
                tx.send(engine_frame(stamp))
            await wait_until(lambda: len(sink) == 16, 5, "16 samples")
            after = time.time_ns()
        samples = sink.drain()
        await stop(task)
        return samples, before, after, received_at

    samples, before, after, received_at = asyncio.run(main())
    assert [s.signal for s in samples] == ["RPM", "ENGINE.TEMP", "GEAR_STATE", "TORQUE"] * 4
    kept = int(received_at * 1e9)
    assert {s.t_ns for s in samples[:4]} == {kept}
    assert {s.t_ns for s in samples[12:]} == {kept}
    # The adapter's counter (12.5 s) and the stamp 5 s ahead: stamped as they arrived.
    assert all(before <= s.t_ns <= after for s in samples[4:12])


def test_a_stream_is_read_in_bursts_and_a_quiet_bus_in_recv_without_losing_a_frame() -> None:
    """While frames keep coming the reader sleeps out each batch interval and takes what
    queued; after a quiet spell it waits in recv again. Every frame of a 1 kHz stream, then
    of a second one after 150 ms of silence, arrives once, in order, with its own stamp."""
    channel = f"test-{uuid.uuid4()}"

    async def main() -> tuple[list[Sample], list[int]]:
        _, sink, task = await running_source(channel, 10_000)
        sent: list[int] = []
        with can.Bus(interface="virtual", channel=channel, preserve_timestamps=True) as tx:
            for count in (300, 20):
                for _ in range(count):
                    t_ns = time.time_ns()
                    sent.append(t_ns)
                    tx.send(engine_frame(t_ns / 1e9))
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.15)
            await wait_until(lambda: len(sink) == 4 * len(sent), 5, "every frame's samples")
        samples = sink.drain()
        await stop(task)
        return samples, sent

    samples, sent = asyncio.run(main())
    rpm = [s.t_ns for s in samples if s.signal == "RPM"]
    assert rpm == [int(t / 1e9 * 1e9) for t in sent]


class SocketBus(can.BusABC):
    """A bus over a UDP socket on the loopback, as SocketCAN and udp_multicast are sockets."""

    def __init__(self, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.bind(("127.0.0.1", 0))
        super().__init__(channel="udp")

    def fileno(self) -> int:
        return self.sock.fileno()

    def _recv_internal(self, timeout: float | None) -> tuple[can.Message | None, bool]:
        return None, False

    def send(self, msg: can.Message, timeout: float | None = None) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        super().shutdown()
        self.sock.close()


def rcvbuf(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


def test_a_socket_bus_gets_a_receive_buffer_for_over_100_ms_of_frames() -> None:
    with open("/proc/sys/net/core/rmem_max") as f:
        cap = int(f.read())
    bus = SocketBus(rcvbuf=4096)
    try:
        before = rcvbuf(bus.sock)
        got = widen_receive_buffer(bus)
        # The kernel doubles what it is asked for (its bookkeeping) and caps at rmem_max.
        assert got == rcvbuf(bus.sock) == 2 * min(RECEIVE_BUFFER_BYTES, cap) > before
        # The bus's own socket is still open and usable.
        bus.sock.sendto(b"x", bus.sock.getsockname())
        assert bus.sock.recv(8) == b"x"
    finally:
        bus.shutdown()
    # A larger buffer is left as it is; a bus that is not a socket has none to size.
    big = SocketBus(rcvbuf=min(2 * RECEIVE_BUFFER_BYTES, cap))
    try:
        kept = rcvbuf(big.sock)
        assert widen_receive_buffer(big) == kept
    finally:
        big.shutdown()
    with can.Bus(interface="virtual", channel=f"test-{uuid.uuid4()}") as virtual:
        assert widen_receive_buffer(virtual) is None


class Adapter:
    """A USB CAN adapter that can be pulled out: plugged into python-can's virtual bus."""

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self.present = threading.Event()
        self.present.set()
        self.opened = 0
        self.refused = 0

    def open(self) -> can.BusABC:
        if not self.present.is_set():
            self.refused += 1
            raise can.CanInitializationError(f"{self.channel}: No such device")
        self.opened += 1
        return VanishingBus(self)


class VanishingBus(can.BusABC):
    """A real python-can bus (over a VirtualBus) whose recv fails once its adapter is gone."""

    def __init__(self, adapter: Adapter, **kwargs: Any) -> None:
        self._adapter = adapter
        self._inner = can.interfaces.virtual.VirtualBus(channel=adapter.channel)
        super().__init__(channel=adapter.channel, **kwargs)
        self.channel_info = f"vanishing adapter on {adapter.channel}"

    def _recv_internal(self, timeout: float | None) -> tuple[can.Message | None, bool]:
        if not self._adapter.present.is_set():
            raise can.CanOperationError("Network is down [Error Code 100]")
        return self._inner.recv(timeout), True

    def send(self, msg: can.Message, timeout: float | None = None) -> None:
        self._inner.send(msg, timeout)

    def shutdown(self) -> None:
        super().shutdown()
        self._inner.shutdown()


def test_reconnects_after_the_bus_vanishes() -> None:
    adapter = Adapter(f"test-{uuid.uuid4()}")
    spec = virtual_spec(adapter.channel, backoff_min_ms=10, backoff_max_ms=50)

    async def main() -> CanSource:
        source = CanSource(spec, bus_factory=adapter.open)
        sink = SampleBuffer(1000)
        task = asyncio.create_task(source.run(sink))
        with can.Bus(interface="virtual", channel=adapter.channel) as tx:
            frame = engine_frame()
            await wait_until(lambda: source.stats()["state"] == "open", 5, "bus open")
            tx.send(frame)
            await wait_until(lambda: len(sink) == 4, 5, "samples before the fault")

            adapter.present.clear()
            # The read fails, then reopening fails while the adapter is out.
            await wait_until(lambda: adapter.refused >= 2, 5, "failed reopen attempts")
            assert not task.done()
            assert stat(source, "bus_errors") >= 3
            assert source.stats()["state"] in ("backoff", "connecting")
            assert source.stats()["up"] == 0
            assert "No such device" in str(source.stats()["last_error"])

            adapter.present.set()
            await wait_until(lambda: stat(source, "reconnects") == 1, 5, "reconnect")
            await wait_until(lambda: source.stats()["state"] == "open", 5, "bus reopened")
            assert source.stats()["up"] == 1
            tx.send(frame)
            await wait_until(lambda: len(sink) == 8, 5, "samples after the reconnect")
        engine = ["RPM", "ENGINE.TEMP", "GEAR_STATE", "TORQUE"]
        assert [s.signal for s in sink.drain()] == engine * 2
        await stop(task)
        return source

    source = asyncio.run(main())
    assert adapter.opened == 2
    assert stat(source, "bus_errors") == 1 + adapter.refused
    assert stat(source, "frames") == 2


def test_cancellation_is_prompt_and_closes_the_bus() -> None:
    channel = f"test-{uuid.uuid4()}"
    # recv_timeout_ms far above a second: the reader caps each wait so it still stops fast.
    spec = CanSpec(
        name="slow", interface="virtual", channel=channel, dbc=SYNTHETIC_DBC, recv_timeout_ms=10_000
    )

    async def main() -> float:
        source = CanSource(spec)
        task = asyncio.create_task(source.run(SampleBuffer(10)))
        await wait_until(lambda: source.stats()["state"] == "open", 5, "bus open")
        assert channel in can.interfaces.virtual.channels
        return await stop(task)

    assert asyncio.run(main()) < 1.0
    assert channel not in can.interfaces.virtual.channels  # shut down, not leaked
    assert not [t for t in threading.enumerate() if t.name == "can-reader-slow"]


def test_unknown_interface_is_a_config_error() -> None:
    spec = CanSpec(name="x", interface="no-such-can", channel="can0", dbc=SYNTHETIC_DBC)
    with pytest.raises(DriverConfigError, match=r"unknown interface 'no-such-can'.*socketcan"):
        CanSource(spec)


@pytest.mark.parametrize(
    ("fault", "error", "match"),
    [
        (
            can.CanInterfaceNotImplementedError("msgpack not installed"),
            DriverConfigError,
            "not available: msgpack",
        ),
        (TypeError("unexpected keyword 'bitrat'"), DriverConfigError, "bad bus options"),
        (RuntimeError("bug in a driver"), CanError, "reader failed: RuntimeError"),
    ],
)
def test_faults_that_retrying_cannot_fix_end_run(
    fault: Exception, error: type[Exception], match: str
) -> None:
    def factory() -> can.BusABC:
        raise fault

    spec = virtual_spec("unused")
    with pytest.raises(error, match=match) as err:
        asyncio.run(CanSource(spec, bus_factory=factory).run(SampleBuffer(10)))
    assert not isinstance(err.value, can.CanError)
