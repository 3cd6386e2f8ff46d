"""The one error tree of ``drivers``, drawn on its root :class:`DriverError`.

Foreign exceptions (``can.CanError``, ``pymodbus.ModbusException``, ``OSError`` from a
serial port ...) are turned into these at the boundary of each driver.
"""


class DriverError(Exception):
    """Root of every error raised by ``drivers``.

    ::

        DriverError
        ├── DriverConfigError        the spec is wrong (bad DBC, bad register map): the user's fault
        ├── CanError                 the CAN side failed at run time
        │   └── CanBusError          bus error, bus-off, vanished interface (we reconnect)
        ├── ModbusError              a Modbus request failed
        │   ├── ModbusTimeout        no reply in time (also a ``TimeoutError``)
        │   ├── ModbusConnectionError  cannot reach the port (also a ``ConnectionError``)
        │   │   └── PortInUse    the simulator cannot serve: its Modbus TCP port is taken
        │   └── ModbusExceptionResponse  the unit answered with an exception code
        └── ReplayError              a capture file cannot be read
    """


class DriverConfigError(DriverError):
    """A driver spec cannot be used: a DBC that does not parse, an impossible register map."""


class CanError(DriverError):
    """A CAN interface failed at run time."""


class CanBusError(CanError):
    """Bus error, bus-off or an interface that went away; the reader reconnects."""


class ModbusError(DriverError):
    """A Modbus request failed. ``unit`` and ``address`` say where."""

    def __init__(self, message: str, *, unit: int | None = None, address: int | None = None):
        super().__init__(message)
        self.unit = unit
        self.address = address


class ModbusTimeout(ModbusError, TimeoutError):
    """The unit did not answer within the timeout."""


class ModbusConnectionError(ModbusError, ConnectionError):
    """The port (TCP endpoint or serial device) cannot be reached."""


class PortInUse(ModbusConnectionError):
    """The simulator's Modbus TCP port is already bound by another process; the caller
    knows which option or key set it and says so."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(f"{host}:{port} is already in use")
        self.host = host
        self.port = port


#: The exception codes of the Modbus application protocol (V1.1b3, section 7).
MODBUS_EXCEPTION_NAMES: dict[int, str] = {
    1: "illegal function",
    2: "illegal data address",
    3: "illegal data value",
    4: "server device failure",
    5: "acknowledge",
    6: "server device busy",
    8: "memory parity error",
    10: "gateway path unavailable",
    11: "gateway target device failed to respond",
}


def modbus_exception_name(code: int) -> str:
    """The protocol's name of exception ``code`` (``"code 42"``-style for unknown ones)."""
    return MODBUS_EXCEPTION_NAMES.get(code, f"unknown exception code {code}")


class ModbusExceptionResponse(ModbusError):
    """The unit answered with a Modbus exception code (e.g. 2 = illegal data address)."""

    def __init__(
        self, message: str, *, code: int, unit: int | None = None, address: int | None = None
    ):
        super().__init__(message, unit=unit, address=address)
        self.code = code

    @property
    def name(self) -> str:
        """The code's name in the protocol, e.g. ``illegal data address``."""
        return modbus_exception_name(self.code)


class ReplayError(DriverError):
    """A capture file is missing, unreadable or of an unknown format."""
