"""Read every register of a :class:`ModbusSpec` once, for ``edge-agent read``.

The same read blocks as the poller (:func:`drivers.modbus.plan.plan_blocks`), sent once
each in plan order. What the poller rides out becomes the reading's error instead: an
exception reply (code and name; a coalesced block refused with "illegal data address" is
split and each value asked alone, so one unmapped register does not hide its
neighbours), a timeout (the unit's other blocks are then not asked: on a serial line each
would cost another timeout), a port that cannot be reached (every value not yet read).
"""

from drivers.errors import (
    ModbusConnectionError,
    ModbusError,
    ModbusExceptionResponse,
    ModbusTimeout,
)
from drivers.modbus.client import ModbusClient
from drivers.modbus.codec import decode, decode_raw
from drivers.modbus.plan import ReadBlock, plan_blocks, split_block
from drivers.readout import ErrorKind, Reading
from drivers.specs import ModbusSpec, RegisterSpec

_ILLEGAL_DATA_ADDRESS = 2
# A gateway saying the unit behind it does not answer: as good as a timeout.
_GATEWAY_CODES = frozenset((10, 11))


async def read_modbus(spec: ModbusSpec) -> list[Reading]:
    """One :class:`Reading` per register of ``spec``, in config order.

    Raises :class:`drivers.errors.DriverConfigError` for a map the poller would refuse.
    """
    blocks = plan_blocks(spec)
    got: dict[str, Reading] = {}
    async with ModbusClient(spec) as client:
        try:
            await client.connect()
        except ModbusConnectionError as exc:
            return [_failed(spec.name, r, exc, "connection") for r in spec.registers]
        silent: dict[int, ModbusError] = {}  # unit -> why it was given up on
        todo: list[ReadBlock] = list(blocks)
        while todo:
            block = todo.pop(0)
            entries = [e.spec for e in block.entries]
            if block.unit in silent:
                why = silent[block.unit]
                note = f"not asked: unit {block.unit} failed an earlier read ({why})"
                for reg in entries:
                    got[reg.name] = _failed(spec.name, reg, why, _kind(why), text=note)
                continue
            try:
                values = await client.read(block.function, block.unit, block.start, block.count)
            except ModbusConnectionError as exc:
                for reg in [*entries, *(e.spec for b in todo for e in b.entries)]:
                    got[reg.name] = _failed(spec.name, reg, exc, "connection")
                break
            except ModbusExceptionResponse as exc:
                if exc.code == _ILLEGAL_DATA_ADDRESS and len(block.entries) > 1:
                    parts = split_block(block)
                    if len(parts) > 1:
                        todo[:0] = parts
                        continue
                if exc.code in _GATEWAY_CODES:
                    silent[block.unit] = exc
                for reg in entries:
                    got[reg.name] = _failed(spec.name, reg, exc, "exception")
            except ModbusError as exc:
                if isinstance(exc, ModbusTimeout):
                    silent[block.unit] = exc
                for reg in entries:
                    got[reg.name] = _failed(spec.name, reg, exc, _kind(exc))
            else:
                words = [int(v) for v in values]
                for entry in block.entries:
                    reg = entry.spec
                    mine = words[entry.offset : entry.offset + reg.width]
                    got[reg.name] = Reading(
                        source=spec.name,
                        signal=reg.name,
                        where=_where(reg),
                        type=_type(reg),
                        raw=tuple(mine),
                        decoded=decode_raw(reg, mine),
                        value=decode(reg, mine),
                    )
    return [got[r.name] for r in spec.registers]


def _kind(exc: ModbusError) -> ErrorKind:
    if isinstance(exc, ModbusTimeout):
        return "timeout"
    if isinstance(exc, ModbusConnectionError):
        return "connection"
    if isinstance(exc, ModbusExceptionResponse):
        return "exception"
    return "error"


def _failed(
    source: str, reg: RegisterSpec, exc: ModbusError, kind: ErrorKind, *, text: str = ""
) -> Reading:
    code = exc.code if isinstance(exc, ModbusExceptionResponse) else None
    return Reading(
        source=source,
        signal=reg.name,
        where=_where(reg),
        type=_type(reg),
        error=text or str(exc),
        error_kind=kind,
        code=code,
    )


def _where(reg: RegisterSpec) -> str:
    span = f"+{reg.width}" if reg.width > 1 else ""
    return f"unit {reg.unit} {reg.function} {reg.address}{span}"


def _type(reg: RegisterSpec) -> str:
    if reg.function in ("coil", "discrete_input"):
        return "bool"
    order = f" {reg.order}" if reg.width > 1 or reg.order in ("BADC", "DCBA") else ""
    if reg.type == "bitfield":
        return f"bitfield{order} bit {reg.bit}+{reg.bits}"
    if reg.type == "bool":
        return f"bool{order} bit {reg.bit}"
    return f"{reg.type}{order}"
