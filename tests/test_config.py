"""Config: a good file converts to driver specs; every kind of bad input gets its exact error."""

from pathlib import Path
from typing import cast

import pytest

from drivers.specs import CanSpec, ModbusSpec
from edge_agent.config import load_config, parse_config
from edge_agent.errors import ConfigError, ReasoningError
from edge_agent.reasoning import ReasoningStage
from edge_agent.service import build_stage
from models import LoadedModel
from models.kernels import JIT_ENV

pytestmark = pytest.mark.peers

DATA = Path(__file__).parent / "data"

GOOD = """
[agent]
device = "gw-1"
site = "plant-a"

[perception]
signals = ["voltage", "speed"]
rate_hz = 100
window = 64

[[sources.modbus]]
name = "drive"
host = "127.0.0.1"
port = 5020
unit = 2
poll_ms = 50

[[sources.modbus.registers]]
name = "voltage"
address = 0
function = "input"
type = "float32"
order = "CDAB"
scale = 0.1

[[sources.modbus.registers]]
name = "status"
address = 10
type = "bitfield"
bit = 4
bits = 3
unit = 7
poll_ms = 1000

[[sources.can]]
name = "bus"
interface = "virtual"
channel = "demo"
dbc = "mini.dbc"
signals = ["speed"]
"""


def parse(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, base_dir=DATA)
    return info.value.errors


def test_good_config_converts_to_specs() -> None:
    cfg = parse_config(GOOD, base_dir=DATA)
    assert cfg.agent.device == "gw-1"
    assert cfg.perception.signals == ("voltage", "speed")
    assert cfg.perception.hop == 64  # defaults to the window
    mb, can = cfg.sources
    assert isinstance(mb, ModbusSpec)
    assert isinstance(can, CanSpec)
    volt, status = mb.registers
    # Source-level unit and poll period apply unless the register overrides them.
    assert (volt.unit, volt.poll_ms, volt.order, volt.scale) == (2, 50, "CDAB", 0.1)
    assert (status.unit, status.poll_ms, status.bit, status.bits) == (7, 1000, 4, 3)
    assert can.dbc == DATA / "mini.dbc"  # resolved against the config's folder


def test_example_config_is_valid() -> None:
    cfg = load_config(Path(__file__).parents[1] / "examples" / "agent.toml")
    assert cfg.sources
    assert cfg.reasoning.enabled
    assert cfg.reasoning.rules.constraints


def test_reasoning_section_converts() -> None:
    text = (
        GOOD
        + RULE.replace("value = 4.0", "value = 4")
        + (
            "\n[reasoning]\nmodel_dir = 'm'\nbackend = 'tflite_runtime'\njit = 'off'\n"
            "[reasoning.thresholds]\ndrift = 1\n"
            "[reasoning.breaker]\nmode = 'rules_only'\n[reasoning.budget_ms]\nreasoning = 1.5\n"
        )
    )
    rc = parse_config(text, base_dir=DATA).reasoning
    assert rc.model_dir == DATA / "m"  # resolved against the config's folder
    assert rc.backend == "tflite_runtime"
    assert rc.jit is False
    assert rc.rules.thresholds == {"drift": 1.0}  # an integer is a fine probability
    (r,) = rc.rules.constraints
    assert (r.name, r.kind, r.label, str(r.when)) == ("r", "exclude", "drift", "speed.mean < 4")
    assert (rc.breaker.mode, rc.breaker.budget_us) == ("rules_only", 1500.0)
    # Absent, the section means: the committed model, defaults everywhere.
    default = parse_config(GOOD, base_dir=DATA).reasoning
    assert (default.enabled, default.model_dir, default.backend) == (True, None, None)
    assert default.jit is None  # auto: compiled where the kernels can run
    on = parse_config(GOOD + "\n[reasoning]\njit = 'on'\n", base_dir=DATA).reasoning
    assert on.jit is True
    yes = parse_config(GOOD + "\n[reasoning]\njit = true\n", base_dir=DATA).reasoning
    assert yes.jit is True
    (error,) = parse(GOOD + "\n[reasoning]\njit = 'yes'\n")
    assert error.startswith("reasoning.jit: "), error
    assert "'auto', 'on' or 'off'" in error, error


def test_reasoning_jit_reaches_the_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(__file__).parent.parent / "examples" / "agent.toml"
    text = example.read_text()
    assert 'jit = "auto"' in text

    def stage(value: str) -> ReasoningStage:
        text_now = text.replace('jit = "auto"', f'jit = "{value}"')
        return build_stage(parse_config(text_now, base_dir=example.parent))

    assert isinstance(stage("off").model, LoadedModel)
    assert not cast(LoadedModel, stage("off").model).jit
    assert cast(LoadedModel, stage("on").model).jit  # numba is a dependency
    monkeypatch.setenv(JIT_ENV, "0")
    assert not cast(LoadedModel, stage("auto").model).jit
    refused = r"cannot load .*required \(jit=True\).*EDGEFLEET_JIT=0"
    with pytest.raises(ReasoningError, match=refused):
        stage("on")


def replace(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1)


BAD: list[tuple[str, str, str]] = [
    ("not toml", "[agent\ndevice = 1", "not valid TOML: Expected ']' at the end of a table"),
    (
        "unknown top-level key",
        GOOD + "\n[agnet]\n",
        "agnet: unknown key; expected one of: agent, perception, sources",
    ),
    (
        "unknown nested key",
        replace("scale = 0.1", "scale = 0.1\nadress = 3"),
        "sources.modbus[0].registers[0].adress: unknown key; expected one of: name, address, "
        "function, type, order, unit, scale, offset, deadband, poll_ms, bit, bits",
    ),
    (
        "string where an integer belongs",
        replace("port = 5020", 'port = "5020"'),
        "sources.modbus[0].port: expected a valid integer; got '5020'",
    ),
    (
        "value out of range",
        replace("port = 5020", "port = 70000"),
        "sources.modbus[0].port: expected less than or equal to 65535; got 70000",
    ),
    (
        "unknown register type",
        replace('type = "float32"', 'type = "int33"'),
        "sources.modbus[0].registers[0].type: expected one of 'bool', 'int16', 'uint16', "
        "'int32', 'uint32', 'int64', 'uint64', 'float32', 'float64' or 'bitfield'; got 'int33'",
    ),
    (
        "unknown word order",
        replace('order = "CDAB"', 'order = "ACBD"'),
        "sources.modbus[0].registers[0].order: expected one of 'ABCD', 'DCBA', 'BADC' or "
        "'CDAB'; got 'ACBD'",
    ),
    (
        "missing required key",
        replace('signals = ["voltage", "speed"]\n', ""),
        "perception.signals: required key is missing",
    ),
    (
        "coil with a numeric type",
        replace('function = "input"', 'function = "coil"'),
        "sources.modbus[0].registers[0].type: expected 'bool' for function 'coil'; got 'float32'",
    ),
    (
        "byte order on a coil",
        replace('function = "input"\ntype = "float32"', 'function = "coil"\ntype = "bool"'),
        "sources.modbus[0].registers[0].order: a coil is one bit, it has no byte order; "
        "expected no order (or 'ABCD'); got 'CDAB'",
    ),
    (
        "bit on a whole-register type",
        replace('type = "bitfield"', 'type = "uint16"'),
        "sources.modbus[0].registers[1].bit: only 'bool' and 'bitfield' registers pick bits, "
        "a uint16 reads the whole value; got bit = 4",
    ),
    (
        "bits on a whole-register type",
        replace('type = "bitfield"', 'type = "uint16"'),
        "sources.modbus[0].registers[1].bits: only a 'bitfield' has a width in bits (a bool is "
        "one bit); got bits = 3 on a uint16",
    ),
    (
        "bits on a bool",
        replace('type = "bitfield"', 'type = "bool"'),
        "sources.modbus[0].registers[1].bits: only a 'bitfield' has a width in bits (a bool is "
        "one bit); got bits = 3 on a bool",
    ),
    (
        "int64 without a scale",
        replace('type = "bitfield"\nbit = 4\nbits = 3', 'type = "int64"'),
        "sources.modbus[0].registers[1].scale: required on an int64: its value travels as a "
        "float, not an exact integer (float32 in windows, memory and telemetry: about 7 "
        "significant digits); write the scale that gives the units you need (1.0: raw units, "
        "rounded)",
    ),
    (
        "uint64 without a scale",
        replace('type = "bitfield"\nbit = 4\nbits = 3', 'type = "uint64"'),
        "sources.modbus[0].registers[1].scale: required on an uint64: its value travels as a float",
    ),
    (
        "bitfield past the register",
        replace("bit = 4", "bit = 14"),
        "sources.modbus[0].registers[1].bits: expected bit + bits <= 16; got bit=14, bits=3",
    ),
    (
        "register past the address space",
        replace("address = 0", "address = 65535"),
        "sources.modbus[0].registers[0].address: float32 needs 2 registers, past the end at "
        "65535; got 65535",
    ),
    (
        "duplicate signal name",
        replace('name = "status"', 'name = "voltage"'),
        "sources.modbus[0].registers[1].name: 'voltage' is already produced by "
        "sources.modbus[0].registers[0]",
    ),
    (
        "perception signal nobody produces",
        replace('signals = ["voltage", "speed"]', 'signals = ["voltage", "speeed"]'),
        "perception.signals[1]: 'speeed' is produced by no source; known: speed, status, voltage",
    ),
    (
        "missing DBC file",
        replace('dbc = "mini.dbc"', 'dbc = "nope.dbc"'),
        f"sources.can[0].dbc: file not found: {str(DATA / 'nope.dbc')!r}",
    ),
    (
        "rtu without a serial device",
        replace('name = "drive"', 'name = "drive"\ntransport = "rtu"'),
        "sources.modbus[0].device: required for transport 'rtu'; got ''",
    ),
    (
        "hop longer than the window",
        replace("window = 64", "window = 64\nhop = 65"),
        "perception.hop: expected at most window (64); got 65",
    ),
    (
        "rate without whole ns steps",
        replace("rate_hz = 100", "rate_hz = 3"),
        "perception.rate_hz: expected a rate with a whole number of ns per step "
        "(e.g. 50, 100, 200, 1000); got 3.0",
    ),
    (
        "duplicate source names",
        replace('name = "bus"', 'name = "drive"'),
        "sources.can[0].name: 'drive' is already used by sources.modbus[0].name",
    ),
    (
        "bad characters in a name",
        replace('device = "gw-1"', 'device = "gw 1/x"'),
        "agent.device: expected a string that should match pattern '^[A-Za-z0-9_.:\\-]+$'; "
        "got 'gw 1/x'",
    ),
    (
        "empty register list",
        "[perception]\nsignals=['a']\n[[sources.modbus]]\nname='m'\nregisters=[]\n",
        "sources.modbus[0].registers: expected a list that should have at least 1 item after "
        "validation, not 0; got []",
    ),
]


RULE = """
[[reasoning.rules]]
name = "r"
kind = "exclude"
label = "drift"
signal = "speed"
op = "<"
value = 4.0
"""


def rule(old: str, new: str) -> str:
    assert old in RULE, old
    return GOOD + RULE.replace(old, new, 1)


BAD += [
    (
        "unknown reasoning key",
        GOOD + "\n[reasoning]\nmodeldir = 'x'\n",
        "reasoning.modeldir: unknown key; expected one of: enabled, model_dir, backend, "
        "threads, jit, top_signals, thresholds, hysteresis, budget_ms, breaker, rules, "
        "acquisition",
    ),
    (
        "unknown backend",
        GOOD + "\n[reasoning]\nbackend = 'tensorrt'\n",
        "reasoning.backend: expected one of 'auto', 'ai_edge_litert' or 'tflite_runtime'; "
        "got 'tensorrt'",
    ),
    (
        "threads as a string",
        GOOD + "\n[reasoning]\nthreads = '2'\n",
        "reasoning.threads: expected a valid integer; got '2'",
    ),
    (
        "threshold above 1",
        GOOD + "\n[reasoning.thresholds]\ndrift = 1.5\n",
        "reasoning.thresholds.drift: expected less than or equal to 1; got 1.5",
    ),
    (
        "threshold for normal",
        GOOD + "\n[reasoning.thresholds]\nnormal = 0.5\n",
        "reasoning.thresholds.normal: expected an alarm label of the model (not 'normal' or "
        "the built-in 'dropout'); got 'normal'",
    ),
    (
        "threshold inside the hysteresis margin",
        GOOD + "\n[reasoning.thresholds]\ndrift = 0.05\n",
        "reasoning.thresholds.drift: expected more than hysteresis.margin (0.1), or the alarm "
        "could never clear; got 0.05",
    ),
    (
        "raise_after zero",
        GOOD + "\n[reasoning.hysteresis]\nraise_after = 0\n",
        "reasoning.hysteresis.raise_after: expected greater than or equal to 1; got 0",
    ),
    (
        "margin of 1",
        GOOD + "\n[reasoning.hysteresis]\nmargin = 1.0\n",
        "reasoning.hysteresis.margin: expected less than 1; got 1.0",
    ),
    (
        "zero budget",
        GOOD + "\n[reasoning.budget_ms]\nreasoning = 0\n",
        "reasoning.budget_ms.reasoning: expected greater than 0; got 0",
    ),
    (
        "budget for an unknown stage",
        GOOD + "\n[reasoning.budget_ms]\nuplink = 1.0\n",
        "reasoning.budget_ms.uplink: unknown key; expected one of: perception, memory, reasoning",
    ),
    (
        "unknown breaker mode",
        GOOD + "\n[reasoning.breaker]\nmode = 'skip'\n",
        "reasoning.breaker.mode: expected one of 'every_k' or 'rules_only'; got 'skip'",
    ),
    (
        "every_k with k = 1",
        GOOD + "\n[reasoning.breaker]\nk = 1\n",
        "reasoning.breaker.k: expected greater than or equal to 2; got 1",
    ),
    (
        "unknown rule kind",
        rule('kind = "exclude"', 'kind = "forbid"'),
        "reasoning.rules[0].kind: expected one of 'exclude' or 'require'; got 'forbid'",
    ),
    (
        "unknown operator",
        rule('op = "<"', 'op = "=="'),
        "reasoning.rules[0].op: expected one of '<', '<=', '>' or '>='; got '=='",
    ),
    (
        "unknown statistic",
        rule('op = "<"', 'op = "<"\nstat = "median"'),
        "reasoning.rules[0].stat: expected one of 'mean', 'min', 'max' or 'last'; got 'median'",
    ),
    (
        "rule on a signal perception does not have",
        rule('signal = "speed"', 'signal = "temperature"'),
        "reasoning.rules[0].signal: expected one of the perception signals (voltage, speed); "
        "got 'temperature'",
    ),
    (
        "register scale not finite",
        replace("scale = 0.1", "scale = nan"),
        "sources.modbus[0].registers[0].scale: expected a finite number; got nan",
    ),
    (
        "register offset infinite",
        replace('order = "CDAB"', 'order = "CDAB"\noffset = -inf'),
        "sources.modbus[0].registers[0].offset: expected a finite number; got -inf",
    ),
    (
        "register deadband infinite",
        replace('order = "CDAB"', 'order = "CDAB"\ndeadband = inf'),
        "sources.modbus[0].registers[0].deadband: expected a finite number; got inf",
    ),
    (
        "rule value as a string",
        rule("value = 4.0", 'value = "4"'),
        "reasoning.rules[0].value: expected a valid number; got '4'",
    ),
    (
        "rule value not finite",
        rule("value = 4.0", "value = nan"),
        "reasoning.rules[0].value: expected a finite number; got nan",
    ),
    (
        "rule on the normal label",
        rule('label = "drift"', 'label = "normal"'),
        "reasoning.rules[0].label: expected an alarm label of the model (not 'normal' or the "
        "built-in 'dropout'); got 'normal'",
    ),
    (
        "rule without an operator",
        rule('op = "<"\n', ""),
        "reasoning.rules[0].op: required key is missing",
    ),
    (
        "two rules with one name",
        GOOD + RULE + RULE.replace('label = "drift"', 'label = "spike"'),
        "reasoning.rules[1].name: 'r' is already used by reasoning.rules[0]",
    ),
]


@pytest.mark.parametrize(
    ("text", "message"), [(t, m) for _, t, m in BAD], ids=[k for k, _, _ in BAD]
)
def test_bad_config_names_path_value_and_expectation(text: str, message: str) -> None:
    errors = parse(text)
    assert any(e.startswith(message) for e in errors), errors


def test_byte_order_is_accepted_where_it_applies() -> None:
    """Every order on a bitfield or a bool bit of a holding register (the codec swaps the
    word's bytes for BADC/DCBA); the bit keys where the type picks bits."""
    for order in ("ABCD", "CDAB", "BADC", "DCBA"):
        text = replace('type = "bitfield"', f'type = "bitfield"\norder = "{order}"')
        mb = parse_config(text, base_dir=DATA).sources[0]
        assert isinstance(mb, ModbusSpec)
        assert (mb.registers[1].order, mb.registers[1].bit, mb.registers[1].bits) == (order, 4, 3)
    flag = replace("bits = 3\n", "").replace('type = "bitfield"', 'type = "bool"\norder = "BADC"')
    mb = parse_config(flag, base_dir=DATA).sources[0]
    assert isinstance(mb, ModbusSpec)
    assert (mb.registers[1].type, mb.registers[1].order, mb.registers[1].bit) == ("bool", "BADC", 4)


def test_a_64_bit_register_with_a_scale_is_accepted() -> None:
    for t in ("int64", "uint64"):
        text = replace('type = "bitfield"\nbit = 4\nbits = 3', f'type = "{t}"\nscale = 1.0')
        mb = parse_config(text, base_dir=DATA).sources[0]
        assert isinstance(mb, ModbusSpec)
        assert (mb.registers[1].type, mb.registers[1].scale) == (t, 1.0)
    errors = parse(replace('type = "bitfield"\nbit = 4\nbits = 3', 'type = "int64"'))
    assert len(errors) == 1, errors  # one line for one problem


def test_every_error_is_reported_not_just_the_first() -> None:
    text = replace("port = 5020", 'port = "x"').replace('type = "float32"', 'type = "no"')
    errors = parse(text)
    assert len(errors) == 2
    assert errors[0].startswith("sources.modbus[0].port:")
    assert errors[1].startswith("sources.modbus[0].registers[0].type:")


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.toml")
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigError, match="expected at most 1048576"):
        load_config(big)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(binary)


def test_no_source_at_all() -> None:
    errors = parse("[perception]\nsignals = ['a']\n[sources]\n")
    assert errors[0] == (
        "sources: no source configured; expected at least one of modbus, can, replay"
    )


def test_ota_section_names_a_missing_trust_root_and_unknown_permissions(tmp_path: Path) -> None:
    example = Path(__file__).parents[1] / "examples" / "agent.toml"
    text = example.read_text().replace(
        'permissions = ["model:swap", "config:write"]',
        'permissions = ["model:swap", "firmware:flash"]\ntrust_root = "no-such-root.json"',
    )
    with pytest.raises(ConfigError) as info:
        parse_config(text, base_dir=example.parent)
    errors = "\n".join(info.value.errors)
    assert "ota.trust_root: file not found: 'no-such-root.json'" in errors
    assert "ota.permissions: unknown ['firmware:flash']" in errors
