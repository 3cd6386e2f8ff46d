"""Read planning: pure coalescing rules, and fewer requests counted at a real server."""

import asyncio
import random

import pytest

from drivers.buffer import SampleBuffer
from drivers.errors import DriverConfigError
from drivers.modbus.plan import BlockEntry, ReadBlock, coalesce, plan_blocks, split_block
from drivers.modbus.poller import ModbusSource
from drivers.specs import ModbusSpec, RegisterSpec
from tests.support.modbus_peer import Collector, device, running_peer, running_source, wait_until

pytestmark = pytest.mark.peers


def _regs(*addresses: int, **kw: object) -> list[RegisterSpec]:
    return [RegisterSpec(f"r{a}", a, **kw) for a in addresses]  # type: ignore[arg-type]


def _spans(blocks: list[ReadBlock]) -> list[tuple[int, int]]:
    return [(b.start, b.count) for b in blocks]


def test_neighbours_within_max_gap_share_a_block() -> None:
    # 0..3 contiguous; 10 is 6 after the end (4) -> merged; 40 is 29 after 11 -> new block.
    blocks = coalesce(_regs(0, 1, 2, 3, 10, 40), max_gap=8, max_registers=120)
    assert _spans(blocks) == [(0, 11), (40, 1)]
    assert [e.offset for e in blocks[0].entries] == [0, 1, 2, 3, 10]
    assert blocks[0].entries[4] == BlockEntry(10, RegisterSpec("r10", 10))


def test_gap_is_measured_from_the_end_of_a_wide_value() -> None:
    regs = [RegisterSpec("f", 0, type="float64"), RegisterSpec("g", 6)]  # f ends at 4, gap 2
    assert _spans(coalesce(regs, max_gap=2, max_registers=120)) == [(0, 7)]
    assert _spans(coalesce(regs, max_gap=1, max_registers=120)) == [(0, 4), (6, 1)]


def test_max_gap_zero_merges_only_adjacent() -> None:
    assert _spans(coalesce(_regs(0, 1, 3), max_gap=0, max_registers=120)) == [(0, 2), (3, 1)]


def test_block_never_exceeds_max_registers() -> None:
    blocks = coalesce(_regs(*range(0, 300)), max_gap=8, max_registers=120)
    assert _spans(blocks) == [(0, 120), (120, 120), (240, 60)]
    # A wide value that would cross the limit starts the next block instead of splitting.
    regs = [*_regs(*range(0, 9)), RegisterSpec("wide", 9, type="uint32")]
    assert _spans(coalesce(regs, max_gap=8, max_registers=10)) == [(0, 9), (9, 2)]


def test_bits_allow_2000_per_request() -> None:
    coils = _regs(*range(0, 2500, 2), function="coil", type="bool")
    blocks = coalesce(coils, max_gap=8, max_registers=120)
    assert _spans(blocks) == [(0, 1999), (2000, 499)]
    assert all(b.function == "coil" for b in blocks)


def test_groups_by_unit_function_and_period() -> None:
    regs = [
        RegisterSpec("a", 0, unit=1),
        RegisterSpec("b", 1, unit=2),
        RegisterSpec("c", 2, unit=1, function="input"),
        RegisterSpec("d", 3, unit=1, poll_ms=1000),
        RegisterSpec("e", 1, unit=1),
    ]
    blocks = coalesce(regs, max_gap=8, max_registers=120)
    assert [(b.unit, b.function, b.poll_ms, b.start, b.count) for b in blocks] == [
        (1, "holding", 100, 0, 2),
        (1, "holding", 1000, 3, 1),
        (1, "input", 100, 2, 1),
        (2, "holding", 100, 1, 1),
    ]


def test_overlapping_views_of_one_register_share_a_block() -> None:
    regs = [
        RegisterSpec("word", 5, type="uint32"),
        RegisterSpec("flag", 5, type="bool", bit=2),
        RegisterSpec("low", 6),
    ]
    (block,) = coalesce(regs, max_gap=0, max_registers=120)
    assert (block.start, block.count) == (5, 2)
    assert [(e.offset, e.spec.name) for e in block.entries] == [
        (0, "flag"),
        (0, "word"),
        (1, "low"),
    ]


def test_plan_is_deterministic_whatever_the_input_order() -> None:
    regs = [
        *_regs(*range(0, 200, 3)),
        *_regs(*range(1000, 1100, 7), unit=2),
        *_regs(*range(500, 520), function="input", poll_ms=50),
    ]
    expected = coalesce(regs, max_gap=4, max_registers=50)
    rng = random.Random(7)
    for _ in range(20):
        shuffled = regs[:]
        rng.shuffle(shuffled)
        assert coalesce(shuffled, max_gap=4, max_registers=50) == expected


def test_split_block_gives_one_read_per_value() -> None:
    regs = [
        RegisterSpec("a", 0),
        RegisterSpec("b", 10, type="float32"),
        RegisterSpec("b_hi", 10),  # overlaps b: stays with it
        RegisterSpec("c", 11 + 1),
    ]
    (block,) = coalesce(regs, max_gap=9, max_registers=120)
    assert _spans(split_block(block)) == [(0, 1), (10, 2), (12, 1)]


@pytest.mark.parametrize(
    ("reg", "message"),
    [
        (RegisterSpec("x", 65535, type="uint32"), r"registers\[1\]\.address"),
        (RegisterSpec("x", 0, unit=0), r"registers\[1\]\.unit"),
        (RegisterSpec("x", 0, function="coil", type="float32"), r"registers\[1\]\.type"),
        (RegisterSpec("x", 0, type="bitfield", bit=12, bits=8), r"registers\[1\]\.bit/bits"),
        (
            RegisterSpec("x", 0, function="coil", type="bool", order="BADC"),
            r"registers\[1\]\.order: a coil is one bit",
        ),
        (RegisterSpec("ok", 3), r"registers\[1\]\.name: 'ok' is used"),
        (RegisterSpec("x", 0, poll_ms=-1), r"registers\[1\]\.poll_ms"),
    ],
)
def test_unpollable_maps_are_config_errors_naming_the_register(
    reg: RegisterSpec, message: str
) -> None:
    spec = ModbusSpec("plc", registers=(RegisterSpec("ok", 0), reg))
    with pytest.raises(DriverConfigError, match=message):
        plan_blocks(spec)
    with pytest.raises(DriverConfigError):
        ModbusSource(spec)


def test_port_level_limits_are_checked() -> None:
    one = (RegisterSpec("a", 0),)
    with pytest.raises(DriverConfigError, match=r"modbus\[plc\]\.max_registers: 126"):
        plan_blocks(ModbusSpec("plc", max_registers=126, registers=one))
    with pytest.raises(DriverConfigError, match=r"registers: empty"):
        plan_blocks(ModbusSpec("plc"))
    with pytest.raises(DriverConfigError, match="backoff"):
        plan_blocks(ModbusSpec("plc", backoff_min_ms=0, registers=one))


def test_coalescing_sends_fewer_requests_counted_at_the_server() -> None:
    """Six values, two requests: the server sees exactly one request per block."""
    regs = _regs(0, 1, 2, 3, 10, 40, poll_ms=60_000)  # one poll each during the test

    async def requests_for(max_gap: int) -> tuple[int, int]:
        async with running_peer({1: device()}) as peer:
            spec = ModbusSpec("plc", port=peer.port, max_gap=max_gap, registers=tuple(regs))
            source = ModbusSource(spec)
            got = Collector(SampleBuffer(100))
            async with running_source(source, got.sink):
                await wait_until(lambda: got.has(*(r.name for r in regs)))
                # Nothing else is due for a minute; give a stray request time to show up.
                await asyncio.sleep(0.05)
            return peer.requests[1], len(source.blocks)

    async def main() -> None:
        assert await requests_for(max_gap=8) == (2, 2)
        assert await requests_for(max_gap=0) == (3, 3)  # 0..3, 10, 40
        # Without coalescing it would be one request per value:
        assert len(coalesce(regs, max_gap=-1, max_registers=1)) == 6

    asyncio.run(main())
