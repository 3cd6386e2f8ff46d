"""Coalesce a register map into as few read requests as possible. Pure, no I/O.

Every request on a serial line costs a turnaround (often 10-50 ms at 19200 baud), so reading
ten neighbouring values in one request instead of ten is the single biggest win a poller has.
:func:`plan_blocks` groups registers that share a unit, a function and a poll period, and
merges neighbours as long as the hole between them is small (``max_gap``: the registers in the
hole are read and thrown away) and the request stays within ``max_registers``.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from drivers.errors import DriverConfigError
from drivers.specs import REGISTER_FUNCTIONS, ModbusSpec, RegisterFunction, RegisterSpec

#: Protocol limits per request: 125 registers (FC 3/4), 2000 bits (FC 1/2).
MAX_REGISTERS_PER_READ = 125
MAX_BITS_PER_READ = 2000

BIT_FUNCTIONS: frozenset[RegisterFunction] = frozenset(("coil", "discrete_input"))

_FUNCTION_RANK = {f: i for i, f in enumerate(REGISTER_FUNCTIONS)}


class BlockEntry(NamedTuple):
    """One value inside a block: it starts ``offset`` registers (or bits) after the start."""

    offset: int
    spec: RegisterSpec


@dataclass(frozen=True, slots=True)
class ReadBlock:
    """One read request, repeated every ``poll_ms`` (0 = as often as the port allows).

    ``entries`` are ordered by offset; they may overlap (two views of one register).
    """

    unit: int
    function: RegisterFunction
    start: int
    count: int
    poll_ms: int
    entries: tuple[BlockEntry, ...]

    @property
    def end(self) -> int:
        """First address after the block."""
        return self.start + self.count


def validate(spec: ModbusSpec) -> None:
    """Raise :class:`DriverConfigError` naming the first register the poller cannot read.

    The config loader checks types and ranges of single keys; this checks what only makes
    sense against the protocol (a value running past address 65535, a float on a coil) and
    across registers (two values with one signal name).
    """
    where = f"sources.modbus[{spec.name}]"
    if not 1 <= spec.max_registers <= MAX_REGISTERS_PER_READ:
        raise DriverConfigError(
            f"{where}.max_registers: {spec.max_registers} is outside 1..{MAX_REGISTERS_PER_READ}"
        )
    if spec.max_gap < 0:
        raise DriverConfigError(f"{where}.max_gap: {spec.max_gap} must be >= 0")
    if spec.timeout_ms <= 0:
        raise DriverConfigError(f"{where}.timeout_ms: {spec.timeout_ms} must be > 0")
    if not 0 < spec.backoff_min_ms <= spec.backoff_max_ms:
        raise DriverConfigError(
            f"{where}.backoff_min_ms/backoff_max_ms: need 0 < {spec.backoff_min_ms} "
            f"<= {spec.backoff_max_ms}"
        )
    if not spec.registers:
        raise DriverConfigError(f"{where}.registers: empty; a Modbus source needs a register")
    seen: set[str] = set()
    for i, reg in enumerate(spec.registers):
        at = f"{where}.registers[{i}]"
        if reg.name in seen:
            raise DriverConfigError(f"{at}.name: {reg.name!r} is used by another register")
        seen.add(reg.name)
        # Unit 0 is broadcast: nobody answers a read. 255 is the usual "this TCP device" id.
        if not 1 <= reg.unit <= 255:
            raise DriverConfigError(f"{at}.unit: {reg.unit} is outside 1..255")
        if reg.poll_ms < 0:
            raise DriverConfigError(f"{at}.poll_ms: {reg.poll_ms} must be >= 0")
        if reg.address < 0 or reg.address + reg.width > 65536:
            raise DriverConfigError(
                f"{at}.address: {reg.address} (+{reg.width}) is outside 0..65535"
            )
        if reg.function in BIT_FUNCTIONS:
            if reg.type != "bool" or reg.bit != 0:
                raise DriverConfigError(
                    f"{at}.type: a {reg.function} is one bit; expected type 'bool' with bit 0, "
                    f"got {reg.type!r} bit {reg.bit}"
                )
            if reg.order != "ABCD":
                raise DriverConfigError(
                    f"{at}.order: a {reg.function} is one bit, it has no byte order; "
                    f"got {reg.order!r}"
                )
        elif reg.width > spec.max_registers:
            raise DriverConfigError(
                f"{at}.type: {reg.type} needs {reg.width} registers, more than "
                f"max_registers={spec.max_registers}"
            )
        if reg.type == "bitfield" and not (
            reg.bits >= 1 and reg.bit >= 0 and reg.bit + reg.bits <= 16
        ):
            raise DriverConfigError(
                f"{at}.bit/bits: bits {reg.bit}..{reg.bit + reg.bits - 1} do not fit in 16"
            )
        if reg.type == "bool" and not 0 <= reg.bit <= 15:
            raise DriverConfigError(f"{at}.bit: {reg.bit} is outside 0..15")
        if reg.scale == 0:
            raise DriverConfigError(f"{at}.scale: 0 would make every reading 'offset'")


def coalesce(
    registers: Iterable[RegisterSpec], *, max_gap: int, max_registers: int
) -> list[ReadBlock]:
    """Merge registers into read blocks; see the module docstring for the rule.

    ``max_gap`` and ``max_registers`` count registers for holding/input and bits for
    coil/discrete_input, where the block limit is raised to the protocol's 2000 bits.
    The result is sorted by (unit, function, poll_ms, start), so the same map always gives
    the same plan.
    """
    groups: dict[tuple[int, RegisterFunction, int], list[RegisterSpec]] = {}
    for reg in registers:
        groups.setdefault((reg.unit, reg.function, reg.poll_ms), []).append(reg)

    blocks: list[ReadBlock] = []
    for (unit, function, poll_ms), regs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], _FUNCTION_RANK[kv[0][1]], kv[0][2])
    ):
        limit = MAX_BITS_PER_READ if function in BIT_FUNCTIONS else max_registers
        regs.sort(key=lambda r: (r.address, r.width, r.name))
        current: list[RegisterSpec] = []
        start = end = 0
        for reg in regs:
            reg_end = reg.address + reg.width
            # A negative gap is an overlap (two views of one register): always mergeable
            # as long as the block stays within the limit.
            if current and reg.address - end <= max_gap and max(end, reg_end) - start <= limit:
                current.append(reg)
                end = max(end, reg_end)
                continue
            if current:
                blocks.append(
                    _block(
                        unit=unit,
                        function=function,
                        poll_ms=poll_ms,
                        start=start,
                        end=end,
                        regs=current,
                    )
                )
            current, start, end = [reg], reg.address, reg_end
        if current:
            blocks.append(
                _block(
                    unit=unit,
                    function=function,
                    poll_ms=poll_ms,
                    start=start,
                    end=end,
                    regs=current,
                )
            )
    return blocks


def plan_blocks(spec: ModbusSpec) -> list[ReadBlock]:
    """Validate ``spec`` and coalesce its registers into read blocks."""
    validate(spec)
    return coalesce(spec.registers, max_gap=spec.max_gap, max_registers=spec.max_registers)


def split_block(block: ReadBlock) -> list[ReadBlock]:
    """``block`` as one block per value (overlapping values still share one).

    Used when a unit rejects a coalesced read with "illegal data address": the hole between
    two values is not mapped on that device, so only reading each value alone works.
    """
    return coalesce((e.spec for e in block.entries), max_gap=-1, max_registers=max(block.count, 1))


def _block(
    *,
    unit: int,
    function: RegisterFunction,
    poll_ms: int,
    start: int,
    end: int,
    regs: list[RegisterSpec],
) -> ReadBlock:
    return ReadBlock(
        unit=unit,
        function=function,
        start=start,
        count=end - start,
        poll_ms=poll_ms,
        entries=tuple(BlockEntry(r.address - start, r) for r in regs),
    )
