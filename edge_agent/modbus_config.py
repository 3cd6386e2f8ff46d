"""The ``[[sources.modbus]]`` sections of the agent's config and their checks across keys.

Part of :mod:`edge_agent.config` (which reports these errors with every other one); kept
apart because a register map has rules of its own: which keys mean something for which
type and function. A key that would be accepted and then ignored is refused instead,
naming it, e.g. ``sources.modbus[0].registers[3].bits: ...``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from drivers.specs import REGISTER_WIDTH, RegisterFunction, RegisterType, WordOrder
from edge_agent._schema import Name, PositiveMs, StrictModel

_BIT_FUNCTIONS: frozenset[RegisterFunction] = frozenset(("coil", "discrete_input"))


class RegisterSection(StrictModel):
    """64-bit integers: a value travels as a float, never as an exact integer (a sample is a
    float64; perception's windows, and so memory, telemetry and the fleet store, hold float32:
    about 7 significant digits). Rather than carry a second number type through every stage,
    an int64/uint64 register must state its ``scale``, which is where the user decides the
    units worth those digits (1.0: raw units, rounded). ``edge-agent read`` shows the exact
    raw integer.
    """

    name: Name
    address: Annotated[int, Field(ge=0, le=65_535)]
    function: RegisterFunction = "holding"
    type: RegisterType = "uint16"
    order: WordOrder = "ABCD"
    unit: Annotated[int, Field(ge=1, le=255)] | None = None
    # nan/inf would turn every reading of the register into nan/inf: refused by name.
    scale: Annotated[float, Field(allow_inf_nan=False)] = 1.0
    offset: Annotated[float, Field(allow_inf_nan=False)] = 0.0
    deadband: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    poll_ms: PositiveMs | None = None
    bit: Annotated[int, Field(ge=0, le=15)] = 0
    bits: Annotated[int, Field(ge=1, le=16)] = 1


class ModbusSection(StrictModel):
    name: Name
    transport: Literal["tcp", "rtu"] = "tcp"
    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65_535)] = 502
    device: str = ""
    baudrate: Annotated[int, Field(ge=300, le=4_000_000)] = 19_200
    parity: Literal["N", "E", "O"] = "E"
    stopbits: Literal[1, 2] = 1
    bytesize: Literal[7, 8] = 8
    unit: Annotated[int, Field(ge=1, le=255)] = 1
    poll_ms: PositiveMs = 100
    timeout_ms: PositiveMs = 500
    max_gap: Annotated[int, Field(ge=0, le=120)] = 8
    max_registers: Annotated[int, Field(ge=1, le=125)] = 120
    backoff_min_ms: PositiveMs = 500
    backoff_max_ms: PositiveMs = 30_000
    heartbeat_ms: PositiveMs = 1_000
    registers: Annotated[list[RegisterSection], Field(min_length=1)]


def check_modbus(mb: ModbusSection, at: str) -> list[str]:
    """Errors across the keys of one Modbus source ``at`` (``sources.modbus[i]``)."""
    errors: list[str] = []
    if mb.transport == "rtu" and not mb.device:
        errors.append(f"{at}.device: required for transport 'rtu'; got ''")
    if mb.backoff_min_ms > mb.backoff_max_ms:
        errors.append(
            f"{at}.backoff_min_ms: expected at most backoff_max_ms ({mb.backoff_max_ms}); "
            f"got {mb.backoff_min_ms}"
        )
    for j, reg in enumerate(mb.registers):
        errors.extend(check_register(reg, f"{at}.registers[{j}]"))
    return errors


def check_register(reg: RegisterSection, at: str) -> list[str]:
    """Errors across the keys of one register ``at``: what the types allow, and no key
    written that its type or function would ignore."""
    errors: list[str] = []
    given = reg.model_fields_set
    bit_function = reg.function in _BIT_FUNCTIONS
    if bit_function and reg.type != "bool":
        errors.append(f"{at}.type: expected 'bool' for function {reg.function!r}; got {reg.type!r}")
    if bit_function and reg.order != "ABCD":
        errors.append(
            f"{at}.order: a {reg.function} is one bit, it has no byte order; "
            f"expected no order (or 'ABCD'); got {reg.order!r}"
        )
    if bit_function and reg.bit != 0:
        errors.append(
            f"{at}.bit: a {reg.function} is one bit; expected no bit (or 0); got {reg.bit}"
        )
    if "bit" in given and reg.type not in ("bool", "bitfield"):
        errors.append(
            f"{at}.bit: only 'bool' and 'bitfield' registers pick bits, a {reg.type} reads "
            f"the whole value; got bit = {reg.bit}"
        )
    if "bits" in given and reg.type != "bitfield":
        errors.append(
            f"{at}.bits: only a 'bitfield' has a width in bits (a bool is one bit); "
            f"got bits = {reg.bits} on a {reg.type}"
        )
    width = 1 if bit_function else REGISTER_WIDTH[reg.type]
    if reg.address + width > 65_536:
        errors.append(
            f"{at}.address: {reg.type} needs {width} registers, past the end at 65535; "
            f"got {reg.address}"
        )
    if reg.type == "bitfield" and reg.bit + reg.bits > 16:
        errors.append(f"{at}.bits: expected bit + bits <= 16; got bit={reg.bit}, bits={reg.bits}")
    if reg.scale == 0:
        errors.append(f"{at}.scale: expected a non-zero factor; got 0")
    elif reg.type in ("int64", "uint64") and not bit_function and "scale" not in given:
        errors.append(
            f"{at}.scale: required on an {reg.type}: its value travels as a float, not an "
            f"exact integer (float32 in windows, memory and telemetry: about 7 significant "
            f"digits); write the scale that gives the units you need (1.0: raw units, rounded)"
        )
    return errors
