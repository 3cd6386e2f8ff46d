"""The only module that imports pymodbus: a small async client with our errors.

pymodbus changes its API between minor releases (``slave=`` became ``device_id=``, request
timeouts moved, exceptions come back as reply objects or as raised ``ModbusIOException``
depending on the failure), so everything version-specific lives here and the poller sees one
call, :meth:`ModbusClient.read`, and one error tree, :mod:`drivers.errors`.
"""

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Self

from pymodbus import FramerType
from pymodbus.client import AsyncModbusSerialClient, AsyncModbusTcpClient
from pymodbus.exceptions import ConnectionException, ModbusException, ModbusIOException
from pymodbus.pdu import ExceptionResponse, ModbusPDU

from drivers.errors import (
    ModbusConnectionError,
    ModbusError,
    ModbusExceptionResponse,
    ModbusTimeout,
    modbus_exception_name,
)
from drivers.specs import ModbusSpec, RegisterFunction

# pymodbus logs every timeout and exception reply at ERROR with a frame dump; the poller
# already counts and reports those once per change. Only quiet it when the application
# has not chosen a level itself, so `logging.getLogger("pymodbus").setLevel(DEBUG)` still
# works for protocol debugging.
_pymodbus_logger = logging.getLogger("pymodbus")
if _pymodbus_logger.level == logging.NOTSET:
    _pymodbus_logger.setLevel(logging.CRITICAL)

_ReadCall = Callable[..., Awaitable[ModbusPDU]]

# What opening a port can raise past pymodbus, which only catches OSError/TimeoutError:
# pyserial rejects bad settings with ValueError, and Linux rejects settings a tty does not
# support (e.g. parity on a pty) with termios.error, which is not an OSError.
_OPEN_ERRORS: tuple[type[Exception], ...] = (ModbusException, OSError, ValueError)
try:
    import termios

    _OPEN_ERRORS += (termios.error,)
except ImportError:  # pragma: no cover - not a POSIX host
    pass


#: The function code each read sends, which its reply must carry.
_FUNCTION_CODES: dict[RegisterFunction, int] = {
    "coil": 1,
    "discrete_input": 2,
    "holding": 3,
    "input": 4,
}


class ModbusClient:
    """One connection to one Modbus port (TCP endpoint or RTU serial line).

    Use as ``async with ModbusClient(spec) as client``; entering does not connect (the
    device may be down at start-up), :meth:`read` connects on demand. Not safe for
    concurrent ``read`` calls from several tasks: the poller serialises requests per port,
    as a serial line requires anyway.

    For ``transport="rtu"``, ``spec.device`` is a serial device or any pyserial URL, e.g.
    ``socket://10.0.0.5:4001`` for RTU frames tunnelled through a serial-to-TCP converter.

    Behaviour of pymodbus 3.11.4 this adapter relies on (re-check when the pin moves):

    * ``execute`` awaits each reply with ``asyncio.wait_for(response_future, timeout)``. With a
      timeout that is one timer per request, cancelled when the reply comes, plus one more
      loop iteration to pass the reply on: a quarter of the instructions a read costs
      (bench.modbus_poll, docs/ARCHITECTURE.md). So we build the client with
      ``timeout=None`` and keep the time ourselves: one watchdog timer per port, re-armed
      at most once per timeout, fails a late request's ``response_future`` with
      ``TimeoutError``, which ``execute`` treats as its own timeout. The connect is bounded
      by wrapping ``ctx.call_create``.
    * A request that timed out is retried ``retries`` times; we use ``retries=0`` because the
      poller owns retry policy (backoff).
    * A timeout is *raised* as ``ModbusIOException("No response received ...")``; an exception
      reply is *returned* as an ``ExceptionResponse`` with ``isError()`` true.
    * ``TransactionManager.execute`` turns the ``CancelledError`` of its waiting task into
      ``ModbusIOException("Request cancelled outside pymodbus.")``. Swallowing that would break
      ``TaskGroup`` shutdown, so we turn it back into ``CancelledError``.
    * After ``retries + 3`` consecutive unanswered requests pymodbus closes the TCP connection
      itself. With ``reconnect_delay=0`` it does not start its own (untracked) reconnect task;
      :meth:`ModbusClient.read` reconnects on the next call instead.
    * On Python 3.11, ``asyncio.wait_for`` inside ``execute`` returns a reply that arrived in
      the same loop iteration as a cancellation and swallows the ``CancelledError``; we check
      ``Task.cancelling()`` after every reply and raise it again.
    * A connection lost mid-request is not reported to the waiting request. We notice the
      disconnect (``trace_connect``), fail the request at once and report a connection error.
    * ``connect()`` logs why a connect failed and returns ``False``. Our wrapper of its
      transport's ``call_create`` keeps the ``OSError``/timeout, so the error says
      "connection refused" or "no route to host" rather than only "cannot connect".
    """

    def __init__(self, spec: ModbusSpec) -> None:
        self.spec = spec
        #: Successful connects, the first one included.
        self.connects = 0
        self._disconnects = 0
        self._client: AsyncModbusTcpClient | AsyncModbusSerialClient | None = None
        self._calls: dict[RegisterFunction, _ReadCall] = {}
        self._connect_failure: BaseException | None = None
        self._timeout = spec.timeout_ms / 1000.0
        # Monotonic deadline of the read in flight (0.0: none) and the watchdog enforcing it.
        self._deadline = 0.0
        self._watchdog: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if spec.transport == "tcp":
            self._where = f"{spec.host}:{spec.port}"
        else:
            self._where = spec.device

    async def __aenter__(self) -> Self:
        # pymodbus binds to the running loop in its constructor, so build it here.
        self._loop = asyncio.get_running_loop()
        self._client = self._make_client()
        c = self._client
        self._wrap_connect(c)
        self._calls = {
            "holding": c.read_holding_registers,
            "input": c.read_input_registers,
            "coil": c.read_coils,
            "discrete_input": c.read_discrete_inputs,
        }
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        """Whether a transport is open (says nothing about the units behind it)."""
        return self._client is not None and self._client.connected

    def close(self) -> None:
        """Close the connection; a later :meth:`read` opens it again."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._client is not None:
            self._client.close()

    async def connect(self) -> None:
        """Open the port if it is not open. Raises :class:`ModbusConnectionError`."""
        client = self._require_client()
        if client.connected:
            return
        self._connect_failure = None
        try:
            ok = await client.connect()
        except _OPEN_ERRORS as exc:
            raise ModbusConnectionError(f"cannot open {self._where}: {exc}") from exc
        if not ok or not client.connected:
            why = _describe(self._connect_failure, self.spec.timeout_ms)
            raise ModbusConnectionError(f"cannot connect to {self._where}{why}")
        self.connects += 1

    async def read(
        self, function: RegisterFunction, unit: int, address: int, count: int
    ) -> list[int] | list[bool]:
        """Read ``count`` registers (or bits) at ``address`` of ``unit``.

        Returns exactly ``count`` values: ints for holding/input, bools for coils and
        discrete inputs. Raises :class:`ModbusTimeout` when the unit does not answer,
        :class:`ModbusExceptionResponse` with the unit's exception code,
        :class:`ModbusConnectionError` when the port cannot be opened or was lost during
        the request, and :class:`ModbusError` for anything else pymodbus reports (garbled
        or mismatched replies). Cancellation propagates as ``CancelledError``.
        """
        client = self._client
        if client is None:
            raise RuntimeError("ModbusClient is used outside 'async with'")
        if not client.connected:
            await self.connect()
        disconnects = self._disconnects
        self._deadline = time.monotonic() + self._timeout
        if self._watchdog is None:
            self._watchdog = self._require_loop().call_later(self._timeout, self._expire)
        try:
            reply = await self._calls[function](address, count=count, device_id=unit)
        except (ModbusException, ValueError) as exc:
            # ValueError: pymodbus validates count/address/device id while encoding.
            raise self._map_failure(exc, unit, address, disconnects) from exc
        finally:
            self._deadline = 0.0
        # With the loop given, current_task skips get_running_loop (a getpid() per call).
        task = asyncio.current_task(self._loop)
        if task is not None and task.cancelling():
            # Python 3.11's asyncio.wait_for (which pymodbus awaits the reply with) returns
            # the reply instead of raising when the reply and our cancellation land in the
            # same loop iteration. Dropping that cancellation would leave run() polling
            # forever after TaskGroup asked it to stop; frequent at poll_ms=0.
            raise asyncio.CancelledError
        if reply.isError():
            if isinstance(reply, ExceptionResponse):
                code = reply.exception_code
                raise ModbusExceptionResponse(
                    f"unit {unit} answered exception code {code} ({modbus_exception_name(code)}) "
                    f"reading {function} {address}+{count}",
                    code=code,
                    unit=unit,
                    address=address,
                )
            raise ModbusError(
                f"unit {unit} returned an error reply {reply}", unit=unit, address=address
            )
        if reply.function_code != _FUNCTION_CODES[function]:
            # pymodbus pairs a reply with its request by transaction and unit id only (and
            # RTU has no transaction id): a reply to another function must not become data.
            raise ModbusError(
                f"unit {unit} answered function code {reply.function_code} to a {function} "
                f"read (function code {_FUNCTION_CODES[function]}) of {address}+{count}",
                unit=unit,
                address=address,
            )
        if function in ("holding", "input"):
            registers = reply.registers
            if len(registers) != count:
                raise ModbusError(
                    f"unit {unit} returned {len(registers)} registers for {address}+{count}",
                    unit=unit,
                    address=address,
                )
            return registers
        bits = reply.bits
        # Bits come padded to a whole byte.
        if len(bits) < count:
            raise ModbusError(
                f"unit {unit} returned {len(bits)} bits for {address}+{count}",
                unit=unit,
                address=address,
            )
        return bits[:count] if len(bits) != count else bits

    def _map_failure(
        self, exc: Exception, unit: int, address: int, disconnects: int
    ) -> BaseException:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # pymodbus converted our cancellation into ModbusIOException; undo that so the
            # caller's TaskGroup / timeout sees the cancellation it asked for.
            return asyncio.CancelledError()
        text = str(exc)
        if isinstance(exc, ConnectionException):
            return ModbusConnectionError(
                f"not connected to {self._where}: {text}", unit=unit, address=address
            )
        if isinstance(exc, ModbusIOException) and "No response received" in text:
            if "CLOSING CONNECTION" in text:
                # pymodbus gave up on the connection after several silent requests; the
                # next read reconnects. For the caller it is still this unit not answering.
                return ModbusTimeout(
                    f"unit {unit} did not answer (connection to {self._where} reset)",
                    unit=unit,
                    address=address,
                )
            if self._disconnects != disconnects:
                return ModbusConnectionError(
                    f"connection to {self._where} lost", unit=unit, address=address
                )
            return ModbusTimeout(
                f"unit {unit} did not answer within {self.spec.timeout_ms} ms",
                unit=unit,
                address=address,
            )
        return ModbusError(f"unit {unit}: {text}", unit=unit, address=address)

    def _wrap_connect(self, client: AsyncModbusTcpClient | AsyncModbusSerialClient) -> None:
        """Bound the transport's connect by our timeout and keep why it failed."""
        ctx = getattr(client, "ctx", None)
        create = getattr(ctx, "call_create", None)
        if ctx is None or create is None or not hasattr(ctx, "response_future"):
            raise RuntimeError(
                "this pymodbus has no ctx.call_create / ctx.response_future: "
                "drivers/modbus/client.py needs updating for it"
            )
        timeout = self._timeout

        async def call_create() -> Any:
            try:
                async with asyncio.timeout(timeout):
                    return await create()
            except (OSError, TimeoutError) as exc:
                self._connect_failure = exc
                raise

        ctx.call_create = call_create

    def _expire(self) -> None:
        """Watchdog: fail the read in flight once its deadline has passed.

        Reads re-arm nothing while the watchdog is pending; when it fires early (the read it
        was armed for ended, another is in flight) it waits for that read's deadline.
        """
        self._watchdog = None
        if not self._deadline:
            return  # idle: the next read arms it again
        left = self._deadline - time.monotonic()
        if left > 0:
            self._watchdog = self._require_loop().call_later(left, self._expire)
            return
        self._fail_in_flight()

    def _fail_in_flight(self) -> None:
        """End the request pymodbus waits on as unanswered (execute's own timeout path)."""
        if not self._deadline or self._client is None:
            return
        future: asyncio.Future[Any] = self._client.ctx.response_future
        if not future.done():
            future.set_exception(TimeoutError())

    def _on_connect(self, connected: bool) -> None:
        if not connected:
            self._disconnects += 1
            # pymodbus leaves a request on a lost connection waiting for its timeout.
            self._fail_in_flight()

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("ModbusClient is used outside 'async with'")
        return self._loop

    def _require_client(self) -> AsyncModbusTcpClient | AsyncModbusSerialClient:
        if self._client is None:
            raise RuntimeError("ModbusClient is used outside 'async with'")
        return self._client

    def _make_client(self) -> AsyncModbusTcpClient | AsyncModbusSerialClient:
        spec = self.spec
        # No timeout: pymodbus would arm a timer per request (see the class docstring);
        # _wrap_connect bounds the connect and the watchdog each request.
        timeout: Any = None
        if spec.transport == "tcp":
            return AsyncModbusTcpClient(
                spec.host,
                port=spec.port,
                name=spec.name,
                timeout=timeout,
                retries=0,
                reconnect_delay=0,
                trace_connect=self._on_connect,
            )
        return AsyncModbusSerialClient(
            spec.device,
            framer=FramerType.RTU,
            baudrate=spec.baudrate,
            bytesize=spec.bytesize,
            parity=spec.parity,
            stopbits=spec.stopbits,
            name=spec.name,
            timeout=timeout,
            retries=0,
            reconnect_delay=0,
            trace_connect=self._on_connect,
        )


def _describe(exc: BaseException | None, timeout_ms: int) -> str:
    """``": connection refused"``-style detail of a failed connect ('' when unknown)."""
    if exc is None:
        return ""
    if isinstance(exc, TimeoutError):
        return f": no answer within {timeout_ms} ms"
    if isinstance(exc, OSError) and exc.errno:
        # asyncio's strerror is "Connect call failed (host, port)"; the errno says why.
        return f": {os.strerror(exc.errno).lower()}"
    return f": {exc}"
