"""Codec: known wire layouts, and every type x order round-tripping through a real server."""

import asyncio
import math
import random
import struct
from typing import Any

import pytest

from drivers.buffer import SampleBuffer
from drivers.modbus import codec
from drivers.modbus.client import ModbusClient
from drivers.modbus.poller import ModbusSource
from drivers.specs import (
    REGISTER_TYPES,
    WORD_ORDERS,
    ModbusSpec,
    RegisterSpec,
    RegisterType,
    WordOrder,
)
from tests.support.modbus_peer import Collector, device, running_peer, running_source, wait_until

pytestmark = pytest.mark.peers

# uint32 0x11223344 as registers, per order (see the table in codec's docstring).
U32_WIRE = {
    "ABCD": [0x1122, 0x3344],
    "CDAB": [0x3344, 0x1122],
    "BADC": [0x2211, 0x4433],
    "DCBA": [0x4433, 0x2211],
}
U64_WIRE = {
    "ABCD": [0x1122, 0x3344, 0x5566, 0x7788],
    "CDAB": [0x7788, 0x5566, 0x3344, 0x1122],
    "BADC": [0x2211, 0x4433, 0x6655, 0x8877],
    "DCBA": [0x8877, 0x6655, 0x4433, 0x2211],
}

# A value per type that uses every byte and the sign where there is one.
VALUES: dict[RegisterType, float] = {
    "bool": 1,
    "bitfield": 21,
    "int16": -12345,
    "uint16": 0xBEEF,
    "int32": -123456789,
    "uint32": 0xDEADBEEF,
    "int64": -1234567890123456789,
    "uint64": 0xFEDCBA9876543210,
    "float32": -3.14159,
    "float64": math.pi * 1e10,
}


INT64_MAX, INT64_MIN, UINT64_MAX = (1 << 63) - 1, -(1 << 63), (1 << 64) - 1
EXTREMES: list[tuple[RegisterType, int]] = [
    ("int64", INT64_MAX),
    ("int64", INT64_MIN),
    ("uint64", UINT64_MAX),
    ("int64", (1 << 53) + 1),  # the first integer a float64 cannot hold
]


def _wire64(value: int, signed: bool, order: WordOrder) -> list[int]:
    """Bytes A..H of ``value`` (big-endian) laid out as registers per ``order``, by hand."""
    b = value.to_bytes(8, "big", signed=signed)
    pairs = [b[i : i + 2] for i in range(0, 8, 2)]  # AB CD EF GH
    if order in ("CDAB", "DCBA"):
        pairs.reverse()
    if order in ("BADC", "DCBA"):
        pairs = [p[::-1] for p in pairs]
    return [int.from_bytes(p, "big") for p in pairs]


def _spec(t: RegisterType, order: WordOrder, address: int = 0, **kw: object) -> RegisterSpec:
    extra: dict[str, object] = {"bit": 3} if t == "bool" else {}
    if t == "bitfield":
        extra = {"bit": 4, "bits": 5}
    extra.update(kw)
    return RegisterSpec(f"{t}_{order}", address, type=t, order=order, **extra)  # type: ignore[arg-type]


def _expected(t: RegisterType, value: float) -> float:
    """What a perfect round trip gives back: float32 rounds, 64-bit ints go through float."""
    if t == "float32":
        return float(struct.unpack(">f", struct.pack(">f", value))[0])
    return float(value)


@pytest.mark.parametrize("order", WORD_ORDERS)
def test_32_and_64_bit_wire_layouts(order: WordOrder) -> None:
    assert codec.encode_raw(_spec("uint32", order), 0x11223344) == U32_WIRE[order]
    assert codec.decode_raw(_spec("uint32", order), U32_WIRE[order]) == 0x11223344
    assert codec.encode_raw(_spec("uint64", order), 0x1122334455667788) == U64_WIRE[order]
    one = codec.encode(_spec("float32", order), 1.0)
    assert codec.decode(_spec("float32", order), one) == 1.0
    assert sorted(one) == [0x0000, 0x3F80 if order in ("ABCD", "CDAB") else 0x803F]


@pytest.mark.parametrize("order", WORD_ORDERS)
@pytest.mark.parametrize(("t", "raw"), EXTREMES)
def test_64_bit_extremes_decode_exactly(t: RegisterType, raw: int, order: WordOrder) -> None:
    """The raw value is the exact integer; the scaled value (a sample) is its nearest float."""
    spec = _spec(t, order)
    words = _wire64(raw, t == "int64", order)
    assert codec.encode_raw(spec, raw) == words
    got = codec.decode_raw(spec, words)
    assert isinstance(got, int)
    assert got == raw
    assert codec.decode(spec, words) == float(raw)
    assert codec.decoder(spec)(words, 0) == float(raw)
    scaled = _spec(t, order, scale=0.001)
    assert codec.decoder(scaled)(words, 0) == codec.decode(scaled, words) == raw * 0.001


def test_16_bit_byte_swap_and_bits() -> None:
    assert codec.encode_raw(_spec("uint16", "BADC"), 0x1122) == [0x2211]
    assert codec.encode_raw(_spec("uint16", "ABCD"), 0x1122) == [0x1122]
    assert codec.decode_raw(_spec("bitfield", "ABCD"), [0b1_1010_1111]) == 0b11010
    assert codec.decode_raw(_spec("bool", "ABCD"), [0b1000]) == 1.0
    assert codec.decode_raw(_spec("bool", "ABCD"), [0b0111]) == 0.0


@pytest.mark.parametrize("order", WORD_ORDERS)
def test_bitfield_and_bool_apply_the_byte_order(order: WordOrder) -> None:
    """A register holding 0x1234 in order: BADC/DCBA put it on the wire as 0x3412, and
    bits count from the least significant bit of 0x1234 (ABCD/CDAB: one word, no swap)."""
    wire = 0x3412 if order in ("BADC", "DCBA") else 0x1234
    field = _spec("bitfield", order, bit=4, bits=8)  # 0x1234 >> 4 & 0xFF = 0x23
    flag = _spec("bool", order, bit=12)  # 0x1234 bit 12 = 1 (bit 12 of 0x3412 is 1 too)
    low = _spec("bool", order, bit=2)  # 0x1234 bit 2 = 1, 0x3412 bit 2 = 0
    assert codec.decode_raw(field, [wire]) == 0x23
    assert codec.decoder(field)([wire], 0) == 0x23
    assert codec.decode_raw(flag, [wire]) == 1
    assert codec.decode_raw(low, [wire]) == 1
    assert codec.decoder(low)([wire], 0) == 1
    assert codec.decode_raw(_spec("bool", order, bit=1), [wire]) == 0
    # encode (the simulator's path) puts the field where decode reads it.
    assert codec.encode_raw(field, 0x23) == [0x3002 if order in ("BADC", "DCBA") else 0x0230]
    assert codec.encode_raw(low, 1) == [0x0400 if order in ("BADC", "DCBA") else 0x0004]


def test_scale_offset_round_trip() -> None:
    spec = RegisterSpec("temp", 0, type="int16", scale=0.1, offset=-40.0)
    assert codec.encode(spec, 23.5) == [635]
    assert codec.decode(spec, [635]) == pytest.approx(23.5)


def test_encode_refuses_values_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        codec.encode(_spec("uint16", "ABCD"), 70000)
    with pytest.raises(ValueError, match="does not fit"):
        codec.encode(_spec("int16", "ABCD"), -40000)
    with pytest.raises(ValueError, match="does not fit"):
        codec.encode(_spec("bitfield", "ABCD"), 32)
    with pytest.raises(ValueError, match="expected 2 registers"):
        codec.decode(_spec("float32", "ABCD"), [1])


@pytest.mark.parametrize("t", REGISTER_TYPES)
@pytest.mark.parametrize("order", WORD_ORDERS)
def test_pure_round_trip(t: RegisterType, order: WordOrder) -> None:
    spec = _spec(t, order)
    assert codec.decode(spec, codec.encode(spec, VALUES[t])) == _expected(t, VALUES[t])


@pytest.mark.parametrize("t", REGISTER_TYPES)
@pytest.mark.parametrize("order", WORD_ORDERS)
@pytest.mark.parametrize(("scale", "offset"), [(1.0, 0.0), (0.1, -40.0)])
def test_compiled_decoder_equals_decode_on_random_words(
    t: RegisterType, order: WordOrder, scale: float, offset: float
) -> None:
    """The poller's compiled decoder must agree with decode() bit for bit (NaN with NaN)."""
    rng = random.Random(f"{t}{order}{scale}")
    for _ in range(300):
        spec = _spec(t, order, scale=scale, offset=offset)
        if t == "bool":
            spec = _spec(t, order, scale=scale, offset=offset, bit=rng.randrange(16))
        elif t == "bitfield":
            bit = rng.randrange(16)
            spec = _spec(
                t, order, scale=scale, offset=offset, bit=bit, bits=rng.randint(1, 16 - bit)
            )
        words = [rng.randrange(65536) for _ in range(spec.width)]
        at = rng.randrange(3)
        padded = [rng.randrange(65536) for _ in range(at)] + words + [0xFFFF]
        want = codec.decode(spec, words)
        got = codec.decoder(spec)(padded, at)
        assert got == want or (math.isnan(got) and math.isnan(want)), (spec, words)


def _random_entry(rng: random.Random, orders: tuple[WordOrder, ...]) -> tuple[int, RegisterSpec]:
    t = rng.choice(REGISTER_TYPES)
    kw: dict[str, Any] = {}
    if t == "bool":
        kw["bit"] = rng.randrange(16)
    elif t == "bitfield":
        bit = rng.randrange(16)
        kw.update(bit=bit, bits=rng.randint(1, 16 - bit))
    if rng.random() < 0.5:
        kw.update(scale=rng.choice([0.1, 0.001, 2.5]), offset=rng.choice([0.0, -40.0, 7.5]))
    spec = _spec(t, rng.choice(orders), **kw)
    return rng.randrange(12), spec


def _same(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(
        g == w or (math.isnan(g) and math.isnan(w)) for g, w in zip(got, want, strict=True)
    )


@pytest.mark.parametrize(
    "orders",
    [("ABCD", "CDAB"), ("BADC", "DCBA"), WORD_ORDERS],
    ids=["bytes-in-order", "bytes-swapped", "mixed"],
)
def test_block_decoder_equals_one_decoder_per_value(orders: tuple[WordOrder, ...]) -> None:
    """The poller decodes a whole block in one call: the same values as one decoder per
    value, for blocks of any types, scales, gaps and overlaps, whether the block takes the
    one-struct path (numbers whose bytes agree on order) or the per-value one."""
    rng = random.Random(f"block{orders}")
    for _ in range(400):
        entries = sorted(
            (_random_entry(rng, orders) for _ in range(rng.randint(1, 6))), key=lambda e: e[0]
        )
        words = [rng.randrange(65536) for _ in range(16)]
        want = [codec.decoder(spec)(words, offset) for offset, spec in entries]
        got = list(codec.block_decoder(entries)(words))
        assert _same(got, want), (entries, words, got, want)
    assert list(codec.block_decoder([])([1, 2])) == []


def test_block_decoder_reads_coils_and_single_values() -> None:
    coil = RegisterSpec("c", 0, function="coil", type="bool")
    assert list(codec.block_decoder([(0, coil), (2, coil)])([True, False, False])) == [1.0, 0.0]
    word = _spec("int16", "ABCD", scale=0.1, offset=-40.0)
    assert list(codec.block_decoder([(1, word)])([0, 0xFFFF])) == [-0.1 - 40.0]
    assert list(codec.block_decoder([(0, _spec("float32", "CDAB"))])([0, 0x3F80])) == [1.0]


def test_compiled_decoder_reads_coil_bits() -> None:
    spec = RegisterSpec("c", 0, function="coil", type="bool")
    assert codec.decoder(spec)([False, True], 1) == 1.0
    assert codec.decoder(spec)([False, True], 0) == 0.0


def test_every_type_and_order_round_trips_through_a_server() -> None:
    """Encode with the codec, store in a real server, poll with ModbusSource, compare."""
    specs: list[RegisterSpec] = []
    address = 0
    for t in REGISTER_TYPES:
        for order in WORD_ORDERS:
            # Alternate holding and input registers so both read functions are covered.
            function = "holding" if len(specs) % 2 == 0 else "input"
            specs.append(_spec(t, order, address, function=function))
            address += 4
    specs.append(RegisterSpec("coil_7", 7, function="coil", type="bool"))
    specs.append(RegisterSpec("di_9", 9, function="discrete_input", type="bool"))
    scaled = RegisterSpec("scaled", 500, type="int16", scale=0.1, offset=-40.0)
    specs.append(scaled)

    async def main() -> None:
        async with running_peer({1: device()}) as peer:
            for s in specs[:-3]:
                peer.write(1, s, VALUES[s.type])
            peer.set_registers(1, "coil", 7, [True])
            peer.set_registers(1, "discrete_input", 9, [True])
            peer.write(1, scaled, 23.5)
            spec = ModbusSpec("codec", port=peer.port, registers=tuple(specs))
            source = ModbusSource(spec)
            got = Collector(SampleBuffer(10_000))
            async with running_source(source, got.sink):
                await wait_until(lambda: got.has(*(s.name for s in specs)))
            for s in specs[:-3]:
                assert got.values(s.name)[0] == _expected(s.type, VALUES[s.type]), s.name
            assert got.values("coil_7")[0] == 1.0
            assert got.values("di_9")[0] == 1.0
            assert got.values("scaled")[0] == pytest.approx(23.5)

    asyncio.run(main())


def test_a_byte_swapped_bitfield_polled_from_a_server() -> None:
    """Raw words set on a real server, polled by ModbusSource: BADC/DCBA bitfields and bools
    are read from the byte-swapped word, ABCD/CDAB from the word as it is."""
    specs = [
        s
        for i, order in enumerate(WORD_ORDERS)
        for s in (
            RegisterSpec(f"state_{order}", i, type="bitfield", order=order, bit=4, bits=8),
            RegisterSpec(f"low_{order}", i, type="bool", order=order, bit=2),
        )
    ]

    async def main() -> None:
        async with running_peer({1: device()}) as peer:
            for i, order in enumerate(WORD_ORDERS):
                peer.set_registers(
                    1, "holding", i, [0x3412 if order in ("BADC", "DCBA") else 0x1234]
                )
            source = ModbusSource(ModbusSpec("bits", port=peer.port, registers=tuple(specs)))
            got = Collector(SampleBuffer(1000))
            async with running_source(source, got.sink):
                await wait_until(lambda: got.has(*(s.name for s in specs)))
            for order in WORD_ORDERS:
                assert got.values(f"state_{order}")[0] == 0x23, order
                assert got.values(f"low_{order}")[0] == 1, order

    asyncio.run(main())


def test_64_bit_extremes_from_a_server() -> None:
    """INT64_MAX, INT64_MIN and UINT64_MAX (and 2^53 + 1) in every order on a real server:
    read back through the client and the codec exactly; polled as samples, their float."""
    cases: list[tuple[RegisterSpec, int]] = []
    for order in WORD_ORDERS:
        for t, raw in EXTREMES:
            name = f"{t}_{raw}_{order}"
            cases.append((RegisterSpec(name, 4 * len(cases), type=t, order=order), raw))

    async def main() -> None:
        async with running_peer({1: device()}) as peer:
            for spec, raw in cases:
                peer.set_registers(1, "holding", spec.address, codec.encode_raw(spec, raw))
            async with ModbusClient(ModbusSpec("x", port=peer.port)) as client:
                words = await client.read("holding", 1, 0, 4 * len(cases))
            for spec, raw in cases:
                got = codec.decode_raw(spec, words[spec.address : spec.address + 4])
                assert (got, type(got)) == (raw, int), spec.name
            source = ModbusSource(
                ModbusSpec("big", port=peer.port, registers=tuple(s for s, _ in cases))
            )
            got_samples = Collector(SampleBuffer(1000))
            async with running_source(source, got_samples.sink):
                await wait_until(lambda: got_samples.has(*(s.name for s, _ in cases)))
            for spec, raw in cases:
                assert got_samples.values(spec.name)[0] == float(raw), spec.name

    asyncio.run(main())
