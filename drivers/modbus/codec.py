"""Register words <-> values for every type and word/byte order. Pure, no I/O.

:func:`decode_raw` says what the orders ``ABCD``, ``CDAB``, ``BADC`` and ``DCBA`` mean for
16-, 32- and 64-bit values and for the bits of a register; :func:`decode`, what precision a
value keeps once it is a sample.

Design: ``docs/ARCHITECTURE.md``, "Modbus polling".
"""

import struct
from collections.abc import Callable, Iterable, Sequence
from operator import add, itemgetter, mul

from drivers.specs import REGISTER_WIDTH, RegisterSpec, RegisterType, WordOrder

_STRUCT: dict[RegisterType, str] = {
    "int16": ">h",
    "uint16": ">H",
    "int32": ">i",
    "uint32": ">I",
    "int64": ">q",
    "uint64": ">Q",
    "float32": ">f",
    "float64": ">d",
}


def _words_swapped(order: WordOrder) -> bool:
    return order in ("CDAB", "DCBA")


def _bytes_swapped(order: WordOrder) -> bool:
    return order in ("BADC", "DCBA")


def _to_wire(big_endian: bytes, order: WordOrder) -> list[int]:
    words = [big_endian[i : i + 2] for i in range(0, len(big_endian), 2)]
    if _words_swapped(order):
        words.reverse()
    if _bytes_swapped(order):
        words = [w[::-1] for w in words]
    return [int.from_bytes(w, "big") for w in words]


def _swap16(word: int) -> int:
    return ((word & 0xFF) << 8) | (word >> 8)


def _bit_word(spec: RegisterSpec, word: int) -> int:
    """The register holding a ``bool``/``bitfield``, in order (coil bits pass as they are)."""
    if spec.function in ("holding", "input") and _bytes_swapped(spec.order):
        return _swap16(word)
    return int(word)


def _from_wire(registers: Sequence[int], order: WordOrder) -> bytes:
    words = [r.to_bytes(2, "big") for r in registers]
    if _bytes_swapped(order):
        words = [w[::-1] for w in words]
    if _words_swapped(order):
        words.reverse()
    return b"".join(words)


def decode_raw(spec: RegisterSpec, registers: Sequence[int]) -> int | float:
    """The raw (unscaled) value of ``spec`` from exactly ``spec.width`` register words.

    Exact: an ``int`` for integer types, bools and bitfields, a ``float`` for float types.

    Orders name the byte layout of a 32-bit value whose big-endian bytes are ``A B C D``:

    =====  ==========================  ==========================
    order  registers on the wire        meaning
    =====  ==========================  ==========================
    ABCD   ``AB CD``                    big-endian (the Modbus default)
    CDAB   ``CD AB``                    words swapped ("word swap", many PLCs)
    BADC   ``BA DC``                    bytes swapped inside each word
    DCBA   ``DC BA``                    fully little-endian
    =====  ==========================  ==========================

    The same two switches (reverse word order, swap bytes in a word) apply to 16- and 64-bit
    values, so ``CDAB`` on a float64 ``A..H`` is ``GH EF CD AB``. A one-register value has no
    word order: ``ABCD`` = ``CDAB`` and ``BADC`` = ``DCBA`` (its two bytes swapped). ``bool`` and
    ``bitfield`` on a holding/input register are one-register values too: the word is put in
    order first and ``bit``/``bits`` count from its least significant bit, so bits 0-7 of a
    ``BADC`` register are the first byte on the wire (the high byte of the word as read).
    Coils and discrete inputs are single bits; an order on them is refused.
    """
    if len(registers) != spec.width:
        raise ValueError(f"{spec.name}: expected {spec.width} registers, got {len(registers)}")
    if spec.type == "bool":
        return (_bit_word(spec, registers[0]) >> spec.bit) & 1
    if spec.type == "bitfield":
        return (_bit_word(spec, registers[0]) >> spec.bit) & ((1 << spec.bits) - 1)
    value: int | float
    (value,) = struct.unpack(_STRUCT[spec.type], _from_wire(registers, spec.order))
    return value


def decode(spec: RegisterSpec, registers: Sequence[int]) -> float:
    """The scaled value: ``raw * scale + offset``, a float (the sample's value).

    :func:`decode_raw` gives integer types as an exact ``int`` (``edge-agent read`` shows a
    64-bit value as the device sent it). :func:`decode` and the poller's :func:`decoder` give
    ``raw * scale + offset`` as a ``float``, a sample's value: exact for integers up to 2^53
    there, and up to 2^24 once perception puts it in a float32 window (what memory and
    telemetry carry: about 7 significant digits). That is why the config asks for an explicit
    ``scale`` on int64/uint64 registers.
    """
    return decode_raw(spec, registers) * spec.scale + spec.offset


def encode_raw(spec: RegisterSpec, raw: int | float) -> list[int]:
    """Register words that :func:`decode_raw` turns back into ``raw``.

    Integer types round to the nearest integer and raise ``ValueError`` when it does not
    fit, so a simulator never writes a silently wrapped value. An ``int`` is taken exactly:
    ``encode_raw(int64, 2**63 - 1)`` works where the float ``2.0**63`` does not fit.
    """
    if spec.type in ("bool", "bitfield"):
        width = 1 if spec.type == "bool" else spec.bits
        field = round(raw)
        if not 0 <= field < (1 << width):
            raise ValueError(f"{spec.name}: {raw} does not fit in {width} bit(s)")
        return [_bit_word(spec, field << spec.bit)]
    fmt = _STRUCT[spec.type]
    try:
        packed = struct.pack(fmt, raw if spec.type.startswith("float") else round(raw))
    except (struct.error, OverflowError) as exc:
        raise ValueError(f"{spec.name}: {raw} does not fit in {spec.type}") from exc
    return _to_wire(packed, spec.order)


def encode(spec: RegisterSpec, value: float) -> list[int]:
    """Register words for a scaled ``value`` (inverse of :func:`decode`)."""
    return encode_raw(spec, (value - spec.offset) / spec.scale)


def decoder(spec: RegisterSpec) -> Callable[[Sequence[int], int], float]:
    """:func:`decode` compiled for one spec, for pollers that decode the same map all day.

    ``decoder(spec)(registers, i) == decode(spec, registers[i : i + spec.width])`` for every
    type and order (the tests hold it to that); type, order, scale and offset are resolved
    once, so a call is one struct round trip instead of a chain of checks and list copies.

    The order becomes two struct byte orders: packing the wire words little-endian swaps
    the bytes inside each word, and reading the packed bytes little-endian reverses them
    all, which is the same as swapping the words and the bytes within them. So
    ABCD = pack ``>`` / unpack ``>``, DCBA = ``>`` / ``<``, CDAB = ``<`` / ``<``,
    BADC = ``<`` / ``>``.
    """
    scale, offset = spec.scale, spec.offset
    plain = scale == 1.0 and offset == 0.0
    if spec.type in ("bool", "bitfield"):
        shift = spec.bit
        mask = 1 if spec.type == "bool" else (1 << spec.bits) - 1
        if spec.function in ("holding", "input") and _bytes_swapped(spec.order):
            # The field is read from the word with its two bytes swapped back.
            def swapped(regs: Sequence[int], i: int) -> float:
                w = regs[i]
                return float(((((w & 0xFF) << 8) | (w >> 8)) >> shift) & mask) * scale + offset

            return swapped
        if plain:
            return lambda regs, i: float((regs[i] >> shift) & mask)
        return lambda regs, i: float((regs[i] >> shift) & mask) * scale + offset

    width = REGISTER_WIDTH[spec.type]
    words, swap = _words_swapped(spec.order), _bytes_swapped(spec.order)
    pack = struct.Struct(("<" if words != swap else ">") + "H" * width).pack
    unpack = struct.Struct(("<" if words else ">") + _STRUCT[spec.type][1]).unpack
    if width == 1:
        if plain:
            return lambda regs, i: float(unpack(pack(regs[i]))[0])
        return lambda regs, i: unpack(pack(regs[i]))[0] * scale + offset
    if width == 2:
        if plain:
            return lambda regs, i: float(unpack(pack(regs[i], regs[i + 1]))[0])
        return lambda regs, i: unpack(pack(regs[i], regs[i + 1]))[0] * scale + offset
    if plain:
        return lambda regs, i: float(unpack(pack(*regs[i : i + width]))[0])
    return lambda regs, i: unpack(pack(*regs[i : i + width]))[0] * scale + offset


def block_decoder(
    entries: Sequence[tuple[int, RegisterSpec]],
) -> Callable[[Sequence[int]], Iterable[float]]:
    """Every value of one read block at once, for the poller's hot path.

    ``list(block_decoder(entries)(registers))`` equals ``[decoder(spec)(registers, offset)
    for offset, spec in entries]`` (``-0.0`` may come out as ``0.0`` where it is scaled,
    as :func:`decode` gives it). It runs for every read of every block, so the common
    case is one struct round trip for the whole block: when
    every value is a number held in registers (no bits, no coils) and all of them agree on
    whether the bytes inside a word are swapped, the registers each value uses are picked
    in big-endian word order (a word-swapped value's words reversed), packed in one call
    whose byte order undoes a byte swap, and unpacked in one call with one format for the
    whole block; scale and offset are applied by C-level ``map``. Any other block falls
    back to one :func:`decoder` per value.
    """
    specs = [spec for _, spec in entries]
    swaps = {_bytes_swapped(spec.order) for spec in specs}
    numeric = all(spec.type in _STRUCT and spec.function in ("holding", "input") for spec in specs)
    if not entries or not numeric or len(swaps) != 1:
        pairs = [(offset, decoder(spec)) for offset, spec in entries]
        return lambda regs: [decode(regs, offset) for offset, decode in pairs]
    picks: list[int] = []
    for offset, spec in entries:
        words = range(offset, offset + spec.width)
        picks.extend(reversed(words) if _words_swapped(spec.order) else words)
    pick: Callable[[Sequence[int]], tuple[int, ...]]
    if len(picks) == 1:
        only = picks[0]
        pick = lambda regs: (regs[only],)  # noqa: E731 - itemgetter(i) returns no tuple
    else:
        pick = itemgetter(*picks)
    pack = struct.Struct(("<" if swaps.pop() else ">") + "H" * len(picks)).pack
    unpack = struct.Struct(">" + "".join(_STRUCT[spec.type][1] for spec in specs)).unpack
    if all(spec.scale == 1.0 and spec.offset == 0.0 for spec in specs):
        return lambda regs: map(float, unpack(pack(*pick(regs))))
    scales = [spec.scale for spec in specs]
    offsets = [spec.offset for spec in specs]
    return lambda regs: map(add, map(mul, unpack(pack(*pick(regs))), scales), offsets)
