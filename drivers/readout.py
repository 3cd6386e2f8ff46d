"""One-off reads of a source's real device, for commissioning (``edge-agent read``).

Not the polling path: every configured value is asked for once (Modbus) or listened for
for a while (CAN), and each gives one :class:`Reading` with what was on the wire, the
exact decoded value, the scaled value and, when it failed, why. :func:`read_once` picks
the reader by spec type and imports its module on use, as :func:`drivers.source.open_source`
does.
"""

from dataclasses import dataclass
from importlib import import_module
from typing import Literal

from drivers.specs import CanSpec, ModbusSpec

#: Why a reading failed: the unit answered an exception code; it did not answer in time;
#: the port or bus cannot be reached; a garbled or mismatched reply; no frame carrying the
#: signal during the listen; the frame did not decode.
ErrorKind = Literal["exception", "timeout", "connection", "error", "no_frame", "decode"]


@dataclass(frozen=True, slots=True)
class Reading:
    """One configured value, read once.

    ``raw`` is what carried it: the register words (coil and input bits as 0/1) or the CAN
    frame's bytes. ``decoded`` is the exact value before ``scale``/``offset`` (an ``int``
    for integer types, so a 64-bit register shows every digit); ``value`` is what the
    agent would sample. ``error`` is empty when the read worked; otherwise ``error_kind``
    says which kind of failure and ``code`` carries a Modbus exception code.
    """

    source: str
    signal: str
    where: str  # "unit 1 holding 0+2" | "0x101 motor_status"
    type: str  # "float32 CDAB" | "bitfield BADC bit 4+8" | "can"
    raw: tuple[int, ...] = ()
    decoded: int | float | None = None
    value: float | None = None
    unit: str = ""  # engineering unit where the config has one (a DBC signal's)
    error: str = ""
    error_kind: ErrorKind | None = None
    code: int | None = None

    @property
    def ok(self) -> bool:
        """Whether the value was read."""
        return not self.error


async def read_once(spec: ModbusSpec | CanSpec, *, listen_s: float) -> list[Reading]:
    """Read every value ``spec`` configures from its device, in config order.

    Modbus: each value once (coalesced as the poller would); CAN: the last frame of each
    signal heard within ``listen_s``. Failures are readings with an error, never raised;
    only a spec that cannot be used raises :class:`drivers.errors.DriverConfigError`.
    (A replay source has no device: the caller leaves it out.)
    """
    if isinstance(spec, ModbusSpec):
        modbus = import_module("drivers.modbus.readout")
        readings: list[Reading] = await modbus.read_modbus(spec)
        return readings
    can = import_module("drivers.can.readout")
    heard: list[Reading] = await can.listen_can(spec, listen_s)
    return heard
