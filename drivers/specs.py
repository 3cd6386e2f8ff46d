"""What a driver needs to know, as frozen data.

The agent's config loader (``edge_agent.config``) validates the TOML file and builds
these; drivers never see TOML. Defaults here are the documented defaults of the config.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

RegisterFunction = Literal["coil", "discrete_input", "holding", "input"]
RegisterType = Literal[
    "bool",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float32",
    "float64",
    "bitfield",
]
WordOrder = Literal["ABCD", "DCBA", "BADC", "CDAB"]

# The Literal types above are the single source of these lists.
REGISTER_FUNCTIONS: tuple[RegisterFunction, ...] = get_args(RegisterFunction)
REGISTER_TYPES: tuple[RegisterType, ...] = get_args(RegisterType)
WORD_ORDERS: tuple[WordOrder, ...] = get_args(WordOrder)

#: Registers (16-bit words) each type occupies. ``bool`` and ``bitfield`` read one register
#: (or one bit, for coils and discrete inputs).
REGISTER_WIDTH: Mapping[RegisterType, int] = {
    "bool": 1,
    "int16": 1,
    "uint16": 1,
    "int32": 2,
    "uint32": 2,
    "int64": 4,
    "uint64": 4,
    "float32": 2,
    "float64": 4,
    "bitfield": 1,
}


@dataclass(frozen=True, slots=True)
class RegisterSpec:
    """One value read from a Modbus unit.

    ``value = raw * scale + offset``. A new sample is emitted when the value moves by at
    least ``deadband`` from the last emitted one, or when ``heartbeat_ms`` of the source has
    passed since (so a steady value still reads as fresh downstream). ``bit``/``bits``
    select a field of a 16-bit register for ``bitfield`` (and the bit tested for ``bool`` on
    a holding/input register).
    """

    name: str
    address: int
    function: RegisterFunction = "holding"
    type: RegisterType = "uint16"
    order: WordOrder = "ABCD"
    unit: int = 1
    scale: float = 1.0
    offset: float = 0.0
    deadband: float = 0.0
    poll_ms: int = 100
    bit: int = 0
    bits: int = 1

    @property
    def width(self) -> int:
        """Registers (or bits, for coils and discrete inputs) this value occupies."""
        if self.function in ("coil", "discrete_input"):
            return 1
        return REGISTER_WIDTH[self.type]


@dataclass(frozen=True, slots=True)
class ModbusSpec:
    """One Modbus port: a TCP endpoint or a serial line with its units."""

    name: str
    transport: Literal["tcp", "rtu"] = "tcp"
    host: str = "127.0.0.1"
    port: int = 502
    device: str = ""  # serial device for RTU, e.g. /dev/ttyUSB0
    baudrate: int = 19200
    parity: Literal["N", "E", "O"] = "E"
    stopbits: int = 1
    bytesize: int = 8
    timeout_ms: int = 500
    max_gap: int = 8  # registers between two values that may still share one request
    max_registers: int = 120  # per request (the protocol allows 125)
    backoff_min_ms: int = 500
    backoff_max_ms: int = 30_000
    heartbeat_ms: int = 1000
    registers: tuple[RegisterSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class CanSpec:
    """One CAN interface with the DBC that decodes it.

    ``interface`` and ``channel`` are python-can's (``socketcan``/``can0`` on a device,
    ``virtual`` or ``udp_multicast`` in tests); ``options`` are passed to ``can.Bus`` as is.
    Only the DBC signals named in ``signals`` are emitted (all when empty). A signal is
    named by its bare DBC name, or ``MESSAGE.SIGNAL`` when the bare name is not unique.
    """

    name: str
    interface: str
    channel: str
    dbc: Path
    bitrate: int | None = None
    options: Mapping[str, str | int | float | bool] = field(default_factory=dict)
    signals: tuple[str, ...] = ()
    prefix: str = ""
    recv_timeout_ms: int = 200
    backoff_min_ms: int = 100
    backoff_max_ms: int = 30_000


@dataclass(frozen=True, slots=True)
class ReplaySpec:
    """Play a candump ``.log`` or Vector ``.asc`` capture through a DBC.

    ``speed`` scales recorded time (1.0 = as recorded, 0 = as fast as possible); ``loop``
    starts over at the end. A malformed line is skipped and counted, or with ``strict``
    stops the replay.
    """

    name: str
    path: Path
    dbc: Path
    speed: float = 1.0
    loop: bool = False
    signals: tuple[str, ...] = ()
    prefix: str = ""
    strict: bool = False
