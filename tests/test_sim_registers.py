"""The simulator's register map and its pure encoding into datastore writes."""

import pytest

from drivers.modbus.codec import decode
from drivers.sim.plant import MotorPlant
from drivers.sim.registers import (
    SIM_REGISTERS,
    RegisterWrite,
    register_writes,
    saturate,
    table_sizes,
)
from drivers.specs import RegisterSpec

pytestmark = pytest.mark.peers


def _snapshot(t: float = 40.0) -> dict[str, float]:
    plant = MotorPlant(3)
    return plant.values_at(t) | plant.state_at(t).as_signals()


def _spec(name: str) -> RegisterSpec:
    return next(s for s in SIM_REGISTERS if s.name == name)


def _image(writes: list[RegisterWrite], function: str) -> dict[int, int]:
    return {
        w.address + i: word
        for w in writes
        if w.function == function
        for i, word in enumerate(w.words)
    }


def test_map_is_unit_1_without_overlaps() -> None:
    assert {s.unit for s in SIM_REGISTERS} == {1}
    assert len({s.name for s in SIM_REGISTERS}) == len(SIM_REGISTERS)
    used: dict[tuple[str, int], str] = {}
    for s in SIM_REGISTERS:
        if s.type == "bitfield":
            continue
        for address in range(s.address, s.address + s.width):
            assert (s.function, address) not in used, s.name
            used[(s.function, address)] = s.name
    assert table_sizes() == {(1, "holding"): 10, (1, "input"): 3, (1, "coil"): 1}


def test_a_full_snapshot_is_one_write_per_table_and_decodes_back() -> None:
    values = _snapshot()
    writes = register_writes(values)
    assert [(w.function, w.address, len(w.words)) for w in writes] == [
        ("coil", 0, 1),
        ("holding", 0, 10),
        ("input", 0, 3),
    ]
    images = {fn: _image(writes, fn) for fn in ("holding", "input", "coil")}
    for spec in SIM_REGISTERS:
        words = [images[spec.function][a] for a in range(spec.address, spec.address + spec.width)]
        tolerance = 1e-4 if spec.type == "float32" else spec.scale / 2 + 1e-9
        assert decode(spec, words) == pytest.approx(values[spec.name], abs=tolerance), spec.name


def test_bitfields_share_their_word() -> None:
    values = _snapshot() | {"ramp_state": 2.0, "at_setpoint": 1.0, "overtemp_warning": 1.0}
    assert _image(register_writes(values), "holding")[8] == 0b1110
    values |= {"ramp_state": 1.0, "at_setpoint": 0.0, "overtemp_warning": 0.0}
    assert _image(register_writes(values), "holding")[8] == 0b0001


def test_a_missing_signal_leaves_its_registers_alone() -> None:
    values = _snapshot()
    del values["vibration"], values["voltage"]
    writes = register_writes(values)
    holding = [(w.address, len(w.words)) for w in writes if w.function == "holding"]
    assert holding == [(2, 5), (8, 2)]  # 0-1 (voltage) and 7 (vibration) untouched
    del values["at_setpoint"]
    holding = [
        (w.address, len(w.words)) for w in register_writes(values) if w.function == "holding"
    ]
    assert holding == [(2, 5), (9, 1)]  # a status word with a field missing is not written


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("vibration", -3.0, 0.0),
        ("frequency", 700.0, 655.35),
        ("temperature", 5000.0, 3276.7),
        ("temperature", -5000.0, -3276.8),
        ("speed", 1e6, 32767.0),
        ("ramp_state", 7.0, 3.0),
        ("voltage", 1e6, 1e6),  # floats are not clipped
    ],
)
def test_values_saturate_instead_of_wrapping(name: str, value: float, expected: float) -> None:
    spec = _spec(name)
    assert saturate(spec, value) == pytest.approx(expected)
    words = register_writes(_snapshot() | {name: value})
    image = _image(words, spec.function)
    raw = [image[a] for a in range(spec.address, spec.address + spec.width)]
    assert decode(spec, raw) == pytest.approx(expected, rel=1e-6)
