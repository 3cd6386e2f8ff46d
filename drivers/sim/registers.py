"""The simulated drive's Modbus register map (unit 1) and its pure encoding. No I/O.

Mixed types and word orders on purpose, like a real drive, so the poller's codec paths are
exercised end to end. Addresses are protocol (0-based) addresses. ``value = raw * scale``.

Values outside a register's range saturate at its limits (a 4-20 mA transmitter does the
same), so a large drift never wraps around. A signal the plant does not report (``dropout``)
is simply not written: the register keeps its last value, as a drive whose sensor died
keeps serving its last reading. The map as a table: ``docs/ARCHITECTURE.md``, "The plant
simulator".
"""

from collections.abc import Mapping
from typing import NamedTuple

from drivers.modbus.codec import encode
from drivers.specs import RegisterFunction, RegisterSpec

SIM_UNIT = 1

SIM_REGISTERS: tuple[RegisterSpec, ...] = (
    RegisterSpec("voltage", 0, "holding", "float32", "CDAB", unit=SIM_UNIT),
    RegisterSpec("current", 2, "holding", "float32", "CDAB", unit=SIM_UNIT),
    RegisterSpec("frequency", 4, "holding", "uint16", unit=SIM_UNIT, scale=0.01),
    RegisterSpec("speed", 5, "holding", "int16", unit=SIM_UNIT),
    RegisterSpec("temperature", 6, "holding", "int16", unit=SIM_UNIT, scale=0.1),
    RegisterSpec("vibration", 7, "holding", "uint16", unit=SIM_UNIT, scale=0.01),
    RegisterSpec("ramp_state", 8, "holding", "bitfield", unit=SIM_UNIT, bit=0, bits=2),
    RegisterSpec("at_setpoint", 8, "holding", "bitfield", unit=SIM_UNIT, bit=2, bits=1),
    RegisterSpec("overtemp_warning", 8, "holding", "bitfield", unit=SIM_UNIT, bit=3, bits=1),
    RegisterSpec("frequency_setpoint", 9, "holding", "uint16", unit=SIM_UNIT, scale=0.01),
    RegisterSpec("uptime", 0, "input", "uint32", "ABCD", unit=SIM_UNIT, poll_ms=1000),
    RegisterSpec(
        "ambient_temperature", 2, "input", "int16", unit=SIM_UNIT, scale=0.1, poll_ms=1000
    ),
    RegisterSpec("running", 0, "coil", "bool", unit=SIM_UNIT),
)

# Raw (unscaled) limits of each integer type; floats are left alone.
_RAW_LIMITS: dict[str, tuple[int, int]] = {
    "int16": (-(1 << 15), (1 << 15) - 1),
    "uint16": (0, (1 << 16) - 1),
    "int32": (-(1 << 31), (1 << 31) - 1),
    "uint32": (0, (1 << 32) - 1),
    "int64": (-(1 << 63), (1 << 63) - 1),
    "uint64": (0, (1 << 64) - 1),
    "bool": (0, 1),
}


class RegisterWrite(NamedTuple):
    """Words (or coil bits, as 0/1) to store at ``address`` of one table of one unit."""

    unit: int
    function: RegisterFunction
    address: int
    words: list[int]


def saturate(spec: RegisterSpec, value: float) -> float:
    """``value`` clipped to what ``spec`` can represent."""
    if spec.type == "bitfield":
        low, high = 0, (1 << spec.bits) - 1
    elif spec.type in _RAW_LIMITS:
        low, high = _RAW_LIMITS[spec.type]
    else:
        return value
    raw = (value - spec.offset) / spec.scale
    raw = min(max(raw, float(low)), float(high))
    return raw * spec.scale + spec.offset


def register_writes(
    values: Mapping[str, float], registers: tuple[RegisterSpec, ...] = SIM_REGISTERS
) -> list[RegisterWrite]:
    """What to write for one snapshot of named values.

    Bitfields that share a register are OR-ed into one word; the word is written only when
    every field of it has a value, so a missing field never clears its neighbours. Writes to
    adjacent addresses of one table come back joined, sorted by (unit, table, address).
    """
    writes: list[RegisterWrite] = []
    shared: dict[tuple[int, RegisterFunction, int], list[int] | None] = {}
    for spec in registers:
        value = values.get(spec.name)
        if spec.type == "bitfield" and spec.function in ("holding", "input"):
            key = (spec.unit, spec.function, spec.address)
            word = shared.get(key, [0])
            if value is None or word is None:
                shared[key] = None
            else:
                shared[key] = [word[0] | encode(spec, saturate(spec, value))[0]]
            continue
        if value is None:
            continue
        words = encode(spec, saturate(spec, value))
        if spec.function in ("coil", "discrete_input"):
            words = [1 if words[0] else 0]
        writes.append(RegisterWrite(spec.unit, spec.function, spec.address, words))
    for (unit, function, address), word in shared.items():
        if word is not None:
            writes.append(RegisterWrite(unit, function, address, word))
    return _merge(writes)


def _merge(writes: list[RegisterWrite]) -> list[RegisterWrite]:
    """Join writes to adjacent addresses of one table: one datastore call per run, not per
    value (this runs 100 times a second on a gateway's shared cores)."""
    merged: list[RegisterWrite] = []
    for w in sorted(writes, key=lambda w: (w.unit, w.function, w.address)):
        last = merged[-1] if merged else None
        if (
            last is not None
            and (last.unit, last.function) == (w.unit, w.function)
            and last.address + len(last.words) == w.address
        ):
            last.words.extend(w.words)
        else:
            merged.append(RegisterWrite(w.unit, w.function, w.address, list(w.words)))
    return merged


def table_sizes(
    registers: tuple[RegisterSpec, ...] = SIM_REGISTERS,
) -> dict[tuple[int, RegisterFunction], int]:
    """Per (unit, table): one past the highest address the map uses."""
    sizes: dict[tuple[int, RegisterFunction], int] = {}
    for spec in registers:
        key = (spec.unit, spec.function)
        sizes[key] = max(sizes.get(key, 0), spec.address + spec.width)
    return sizes
