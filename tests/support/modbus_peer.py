"""A real pymodbus server on loopback for the Modbus tests (not a mock of our code).

Units not in the map never answer (``ignore_missing_devices``), which is how a dead unit
behind a gateway looks on the wire. Every request the server receives is counted per unit,
so tests can assert how many requests the poller sent.
"""

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pymodbus import FramerType
from pymodbus.datastore import (
    ModbusDeviceContext,
    ModbusSequentialDataBlock,
    ModbusServerContext,
    ModbusSparseDataBlock,
)
from pymodbus.pdu import ModbusPDU
from pymodbus.server import ModbusSerialServer, ModbusTcpServer

from drivers.buffer import SampleBuffer
from drivers.modbus import codec
from drivers.modbus.poller import ModbusSource
from drivers.sample import Sample
from drivers.specs import RegisterSpec

# pymodbus' datastore constructors carry no annotations, which mypy --strict refuses to call.
_Sequential: Any = ModbusSequentialDataBlock
_Sparse: Any = ModbusSparseDataBlock
_ServerContext: Any = ModbusServerContext

# Function name -> datastore function code (the one getValues/setValues map to the store).
_FC = {"coil": 1, "discrete_input": 2, "holding": 3, "input": 4}


def device(size: int = 1000) -> ModbusDeviceContext:
    """A unit with ``size`` zeroed registers/bits of each kind at protocol addresses 0..size-1.

    Reading at or past ``size`` is answered with exception 2 (illegal data address).
    ``ModbusDeviceContext`` adds 1 to every protocol address, hence the blocks start at 1.
    """
    return ModbusDeviceContext(
        co=_Sequential(1, [False] * size),
        di=_Sequential(1, [False] * size),
        hr=_Sequential(1, [0] * size),
        ir=_Sequential(1, [0] * size),
    )


def sparse_device(holding: Mapping[int, list[int]]) -> ModbusDeviceContext:
    """A unit whose holding registers exist only at the given protocol address ranges.

    Reads touching any other address are answered with exception 2.
    """
    return ModbusDeviceContext(hr=_Sparse({a + 1: v for a, v in holding.items()}))


@dataclass
class Peer:
    """A running server: where it listens and what it has seen."""

    server: ModbusTcpServer | ModbusSerialServer
    devices: Mapping[int, ModbusDeviceContext]
    port: int
    requests: Counter[int] = field(default_factory=Counter)

    def set_registers(
        self, unit: int, function: str, address: int, values: list[int] | list[bool]
    ) -> None:
        """Write raw words (or bits) into unit ``unit``'s datastore."""
        self.devices[unit].setValues(_FC[function], address, values)

    def write(self, unit: int, spec: RegisterSpec, value: float) -> None:
        """Store ``value`` for ``spec`` the way a device would (through our codec)."""
        if spec.function in ("coil", "discrete_input"):
            self.set_registers(unit, spec.function, spec.address, [bool(value)])
        else:
            self.set_registers(unit, spec.function, spec.address, codec.encode(spec, value))

    async def stop(self) -> None:
        await self.server.shutdown()  # type: ignore[no-untyped-call]


def _tracer(peer_box: list[Peer]) -> Callable[[bool, ModbusPDU], ModbusPDU]:
    def trace(sending: bool, pdu: ModbusPDU) -> ModbusPDU:
        if not sending and peer_box:
            peer_box[0].requests[pdu.dev_id] += 1
        return pdu

    return trace


async def start_peer(
    devices: Mapping[int, ModbusDeviceContext],
    *,
    port: int = 0,
    framer: FramerType = FramerType.SOCKET,
    ignore_missing: bool = True,
) -> Peer:
    """Start a TCP server on 127.0.0.1 (``port=0`` picks a free one) with ``framer``.

    With ``FramerType.RTU`` the server speaks RTU frames (CRC, no MBAP header) over TCP,
    the way a serial-to-Ethernet converter in transparent mode does. With
    ``ignore_missing=False`` a missing unit is answered with exception 11 (gateway target
    failed to respond) instead of silence.
    """
    box: list[Peer] = []
    context = _ServerContext(devices=dict(devices), single=False)
    server = ModbusTcpServer(
        context,
        framer=framer,
        address=("127.0.0.1", port),
        ignore_missing_devices=ignore_missing,
        trace_pdu=_tracer(box),
    )
    await server.serve_forever(background=True)
    sockets = server.transport.sockets  # type: ignore[attr-defined]
    peer = Peer(server=server, devices=devices, port=sockets[0].getsockname()[1])
    box.append(peer)
    return peer


async def start_serial_peer(devices: Mapping[int, ModbusDeviceContext], path: str) -> Peer:
    """Start an RTU server on the serial device ``path`` (e.g. one end of a pty null modem)."""
    box: list[Peer] = []
    context = _ServerContext(devices=dict(devices), single=False)
    server = ModbusSerialServer(
        context,
        framer=FramerType.RTU,
        port=path,
        baudrate=115200,
        # Linux ptys reject parity bits (termios EINVAL), so the pty tests run 8N1.
        parity="N",
        ignore_missing_devices=True,
        trace_pdu=_tracer(box),
    )
    await server.serve_forever(background=True)
    peer = Peer(server=server, devices=devices, port=0)
    box.append(peer)
    return peer


@contextlib.asynccontextmanager
async def running_peer(
    devices: Mapping[int, ModbusDeviceContext],
    *,
    port: int = 0,
    framer: FramerType = FramerType.SOCKET,
    ignore_missing: bool = True,
) -> AsyncIterator[Peer]:
    """:func:`start_peer` as ``async with``; the server stops on exit."""
    peer = await start_peer(devices, port=port, framer=framer, ignore_missing=ignore_missing)
    try:
        yield peer
    finally:
        await peer.stop()


@contextlib.contextmanager
def peer_in_thread(
    devices: Mapping[int, ModbusDeviceContext], *, ignore_missing: bool = True
) -> Iterator[Peer]:
    """:func:`start_peer` on its own event loop in a thread, for code under test that runs
    its own loop (a CLI through typer's CliRunner). The datastore may be written from the
    test's thread while no request is in flight."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="modbus-peer", daemon=True)
    thread.start()
    try:
        started = start_peer(devices, ignore_missing=ignore_missing)
        peer = asyncio.run_coroutine_threadsafe(started, loop).result(10)
        try:
            yield peer
        finally:
            asyncio.run_coroutine_threadsafe(peer.stop(), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0, step: float = 0.005) -> None:
    """Poll ``cond`` until it holds; fail the test with ``TimeoutError`` after ``timeout``."""
    async with asyncio.timeout(timeout):
        # Conditions span server datastores, counters and buffers; none has an event to await.
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(step)


@contextlib.asynccontextmanager
async def running_source(
    source: ModbusSource, sink: SampleBuffer
) -> AsyncIterator["asyncio.Task[None]"]:
    """Run ``source`` in a task for the ``async with`` body, then cancel it.

    A poller that died on its own re-raises here, so a test cannot pass over a crash.
    """
    task = asyncio.create_task(source.run(sink), name=f"modbus {source.name}")
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Collector:
    """Drains a :class:`SampleBuffer` into per-signal lists as the test goes."""

    def __init__(self, sink: SampleBuffer) -> None:
        self.sink = sink
        self.by_signal: dict[str, list[Sample]] = {}

    def pull(self) -> dict[str, list[Sample]]:
        for s in self.sink.drain():
            self.by_signal.setdefault(s.signal, []).append(s)
        return self.by_signal

    def values(self, signal: str) -> list[float]:
        return [s.value for s in self.pull().get(signal, [])]

    def has(self, *signals: str) -> bool:
        got = self.pull()
        return all(name in got for name in signals)
