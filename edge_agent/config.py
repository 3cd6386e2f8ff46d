"""The agent's TOML config: schema, validation with exact errors, and conversion to specs.

One file per agent (``/etc/edge-agent/agent.toml``). :func:`load_config` reports *every*
problem it finds, each naming the key path, the bad value and what was expected::

    sources.modbus[0].registers[3].type: expected one of 'bool', 'int16', ...; got 'int33'

Types are strict (TOML has real types: ``port = "502"`` is an error, not a guess) and
unknown keys are rejected, so a typo never silently falls back to a default. Relative file
paths (a DBC, a capture) are resolved against the config file's folder.
"""

from __future__ import annotations

import math
import socket
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, ValidationError

from drivers.specs import (
    CanSpec,
    ModbusSpec,
    RegisterSpec,
    ReplaySpec,
)
from edge_agent._schema import Name, PositiveMs, StrictModel
from edge_agent.api import ApiSection
from edge_agent.breaker import BreakerSpec, DegradedMode
from edge_agent.errors import ConfigError
from edge_agent.gcl import GateControlList, ScheduleSection, window_close_phase_ns
from edge_agent.memory.config import MemorySection
from edge_agent.modbus_config import ModbusSection, check_modbus
from edge_agent.ota_config import OtaSection
from edge_agent.perception import Interpolation, PerceptionSpec
from edge_agent.rules import (
    DROPOUT,
    NORMAL,
    Condition,
    ConstraintRule,
    HysteresisSpec,
    Op,
    RuleKind,
    RuleSet,
    Stat,
)
from edge_agent.uplink.config import UplinkSection

#: Refuse config files larger than this before parsing them.
MAX_CONFIG_BYTES = 1 << 20


class AgentSection(StrictModel):
    """Who this agent is and where it keeps its state."""

    device: Name = Field(default_factory=lambda: socket.gethostname().split(".")[0] or "edge")
    site: Name = "default"
    device_type: Name = "generic"
    state_dir: str = "/var/lib/edge-agent"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    stats_interval_s: Annotated[float, Field(gt=0, le=3600)] = 5.0


class PerceptionSection(StrictModel):
    signals: Annotated[list[Name], Field(min_length=1, max_length=1024)]
    rate_hz: Annotated[float, Field(gt=0, le=10_000)] = 100.0
    window: Annotated[int, Field(ge=1, le=100_000)] = 64
    hop: Annotated[int, Field(ge=1, le=100_000)] | None = None
    interpolation: Interpolation = "hold"
    max_staleness_ms: Annotated[float, Field(gt=0, le=3_600_000)] = 200.0
    lateness_ms: Annotated[float, Field(ge=0, le=60_000)] = 20.0
    max_catch_up_windows: Annotated[int, Field(ge=1, le=10_000)] = 16
    queue_size: Annotated[int, Field(ge=16, le=10_000_000)] = 65_536


class CanSection(StrictModel):
    name: Name
    interface: Annotated[str, Field(min_length=1)]
    channel: Annotated[str, Field(min_length=1)]
    dbc: Annotated[str, Field(min_length=1)]
    bitrate: Annotated[int, Field(ge=1_000, le=8_000_000)] | None = None
    options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    signals: list[Name] = Field(default_factory=list)
    prefix: str = ""
    recv_timeout_ms: PositiveMs = 200
    backoff_min_ms: PositiveMs = 100
    backoff_max_ms: PositiveMs = 30_000


class ReplaySection(StrictModel):
    name: Name
    path: Annotated[str, Field(min_length=1)]
    dbc: Annotated[str, Field(min_length=1)]
    speed: Annotated[float, Field(ge=0, le=1000)] = 1.0
    loop: bool = False
    signals: list[Name] = Field(default_factory=list)
    prefix: str = ""
    strict: bool = False


class SourcesSection(StrictModel):
    modbus: list[ModbusSection] = Field(default_factory=list)
    can: list[CanSection] = Field(default_factory=list)
    replay: list[ReplaySection] = Field(default_factory=list)


class HysteresisSection(StrictModel):
    raise_after: Annotated[int, Field(ge=1, le=1000)] = 2
    clear_after: Annotated[int, Field(ge=1, le=1000)] = 3
    margin: Annotated[float, Field(ge=0, lt=1)] = 0.1


class BudgetSection(StrictModel):
    perception: Annotated[float, Field(gt=0, le=60_000)] = 5.0
    memory: Annotated[float, Field(gt=0, le=60_000)] = 2.0
    reasoning: Annotated[float, Field(gt=0, le=60_000)] = 2.0


class BreakerSection(StrictModel):
    trip_after: Annotated[int, Field(ge=1, le=10_000)] = 3
    recover_after: Annotated[int, Field(ge=1, le=10_000)] = 5
    mode: DegradedMode = "every_k"
    k: Annotated[int, Field(ge=2, le=10_000)] = 4
    probe_every: Annotated[int, Field(ge=2, le=100_000)] = 10


class RuleSection(StrictModel):
    name: Name
    kind: RuleKind
    label: Name
    signal: Name
    stat: Stat = "mean"
    op: Op
    value: float


class ReasoningSection(StrictModel):
    enabled: bool = True
    model_dir: Annotated[str, Field(min_length=1)] | None = None
    backend: Literal["auto", "ai_edge_litert", "tflite_runtime"] = "auto"
    threads: Annotated[int, Field(ge=1, le=64)] = 1
    # true / false mean on / off: a TOML user may well write them.
    jit: Annotated[
        Literal["auto", "on", "off"],
        BeforeValidator(lambda v: {True: "on", False: "off"}[v] if isinstance(v, bool) else v),
    ] = "auto"
    top_signals: Annotated[int, Field(ge=0, le=64)] = 3
    thresholds: dict[Name, Annotated[float, Field(gt=0, le=1)]] = Field(default_factory=dict)
    hysteresis: HysteresisSection = Field(default_factory=HysteresisSection)
    budget_ms: BudgetSection = Field(default_factory=BudgetSection)
    breaker: BreakerSection = Field(default_factory=BreakerSection)
    rules: Annotated[list[RuleSection], Field(max_length=256)] = Field(default_factory=list)
    acquisition: Literal["check", "accept-mismatch"] = "check"


class AgentConfigModel(StrictModel):
    """The whole file. Field docs live in ``examples/agent.toml``."""

    agent: AgentSection = Field(default_factory=AgentSection)
    perception: PerceptionSection
    sources: SourcesSection
    reasoning: ReasoningSection = Field(default_factory=ReasoningSection)
    memory: MemorySection = Field(default_factory=MemorySection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    api: ApiSection = Field(default_factory=ApiSection)
    uplink: UplinkSection = Field(default_factory=UplinkSection)
    ota: OtaSection = Field(default_factory=OtaSection)


@dataclass(frozen=True, slots=True)
class ReasoningConfig:
    """The ``[reasoning]`` section, converted.

    ``model_dir`` None means the model committed with the agent
    (:data:`models.DEFAULT_MODEL_DIR`); ``backend`` None means whichever runtime imports.
    ``jit`` is :func:`models.load_model`'s: None where the compiled kernels can run, True
    (required: loading fails without them), False (numpy).
    Labels named by ``rules`` and ``thresholds`` are checked against the model when it is
    loaded (the config alone does not know them). ``acquisition``: ``check`` refuses a
    model whose input contract the sources do not meet (``edge_agent.acquisition``);
    ``accept-mismatch`` runs it anyway, warns once and marks every decision.
    """

    enabled: bool
    model_dir: Path | None
    backend: str | None
    threads: int
    jit: bool | None
    rules: RuleSet
    breaker: BreakerSpec
    budget_ms: Mapping[str, float]
    acquisition: Literal["check", "accept-mismatch"] = "check"


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """A validated config, already turned into what each part consumes."""

    path: Path
    agent: AgentSection
    perception: PerceptionSpec
    queue_size: int
    sources: tuple[ModbusSpec | CanSpec | ReplaySpec, ...]
    reasoning: ReasoningConfig
    memory: MemorySection
    #: ``agent.state_dir`` resolved against the config file's folder.
    state_dir: Path
    schedule: ScheduleSection
    #: The ``[schedule]`` section as a timeline; without ``base_time_ns`` its cycles start
    #: when windows close (lateness past a grid point), so the first entry meets them.
    gate_control_list: GateControlList
    api: ApiSection
    #: ``[uplink]`` with its file paths (TLS, password) resolved against the config's folder.
    uplink: UplinkSection
    #: ``[ota]``; ``trust_root`` stays as written (resolved against ``path`` when used).
    ota: OtaSection = field(default_factory=OtaSection)


# -- loading ---------------------------------------------------------------------------------


def load_config(path: str | Path) -> AgentConfig:
    """Read, validate and convert ``path``. Raises :class:`ConfigError` listing every error."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                str(p), [f"file is {size} bytes; expected at most {MAX_CONFIG_BYTES}"]
            )
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(str(p), ["file not found"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), [f"not UTF-8 text: {exc.reason} at byte {exc.start}"]) from None
    except OSError as exc:
        raise ConfigError(str(p), [f"cannot read: {exc.strerror}"]) from None
    return parse_config(text, source=str(p), base_dir=p.parent)


def parse_config(
    text: str, *, source: str = "<config>", base_dir: Path | None = None
) -> AgentConfig:
    """Validate TOML ``text``; relative paths resolve against ``base_dir`` (default: cwd).
    Raises ``ConfigError`` naming the key and what was wrong."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, [f"not valid TOML: {exc}"]) from None
    try:
        model = AgentConfigModel.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(source, [_format(e) for e in exc.errors()]) from None
    base = base_dir if base_dir is not None else Path.cwd()
    errors = _check(model, base)
    if errors:
        raise ConfigError(source, errors)
    return _convert(model, Path(source), base)


# -- error messages -------------------------------------------------------------------------


def _path(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _format(err: Any) -> str:
    loc = tuple(err["loc"])
    path = _path(loc)
    kind = err["type"]
    value = err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "missing":
        return f"{path}: required key is missing"
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        hint = f"; expected one of: {', '.join(allowed)}" if allowed else ""
        return f"{path}: unknown key{hint}"
    if kind == "literal_error":
        return f"{path}: expected one of {ctx.get('expected')}; got {value!r}"
    msg = str(err["msg"])
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    elif msg.startswith("Input should be "):
        msg = "expected " + msg[len("Input should be ") :]
    elif msg.startswith("String should "):
        msg = "expected a string that should " + msg[len("String should ") :]
    elif msg.startswith("List should "):
        msg = "expected a list that should " + msg[len("List should ") :]
    return f"{path}: {msg}; got {_show(value)}"


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _allowed_keys(loc: Sequence[int | str]) -> list[str]:
    """The keys allowed at ``loc``, found by walking the schema; [] if it cannot tell."""
    node: Any = AgentConfigModel
    for part in loc:
        node = _unwrap(node)
        if isinstance(part, int):
            args = typing.get_args(node)
            if not args:
                return []
            node = args[0]
        elif isinstance(node, type) and issubclass(node, BaseModel):
            field = node.model_fields.get(part)
            if field is None:
                return []
            node = field.annotation
        else:
            return []
    node = _unwrap(node)
    if isinstance(node, type) and issubclass(node, BaseModel):
        return list(node.model_fields)
    return []


def _unwrap(node: Any) -> Any:
    """Strip ``Annotated`` and ``X | None`` down to the model or list type inside."""
    while True:
        origin = typing.get_origin(node)
        if origin is Annotated:
            node = typing.get_args(node)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(node) if a is not type(None)]
            node = args[0]
        else:
            return node


# -- checks across keys ---------------------------------------------------------------------


def _check(model: AgentConfigModel, base: Path) -> list[str]:
    """Every finding across keys: names, what each source produces, perception, sections."""
    errors = _check_source_names(model.sources)
    produced, open_ended = _check_sources(model.sources, base, errors)
    per = model.perception
    errors.extend(_check_perception(per))
    errors.extend(_check_reasoning(model.reasoning, per.signals))
    errors.extend(model.memory.check(per.signals))
    errors.extend(model.schedule.check())
    errors.extend(resolve_uplink(model.uplink, base).check(per.signals))
    errors.extend(model.ota.check(base))
    errors.extend(_check_signals_produced(per.signals, produced, open_ended))
    return errors


def _check_source_names(src: SourcesSection) -> list[str]:
    """A source name is used once across modbus, can and replay."""
    errors: list[str] = []
    names: dict[str, str] = {}
    if not (src.modbus or src.can or src.replay):
        errors.append("sources: no source configured; expected at least one of modbus, can, replay")
    named: list[tuple[str, Sequence[ModbusSection | CanSection | ReplaySection]]] = [
        ("modbus", src.modbus),
        ("can", src.can),
        ("replay", src.replay),
    ]
    for kind, items in named:
        for i, item in enumerate(items):
            where = f"sources.{kind}[{i}].name"
            if item.name in names:
                errors.append(f"{where}: {item.name!r} is already used by {names[item.name]}")
            else:
                names[item.name] = where
    return errors


def _check_sources(
    src: SourcesSection, base: Path, errors: list[str]
) -> tuple[dict[str, str], bool]:
    """Each source's own checks (appended to ``errors``); returns which key produces each
    signal, and whether some CAN/replay source without a signal list may produce anything."""
    produced: dict[str, str] = {}
    open_ended = False
    for i, mb in enumerate(src.modbus):
        at = f"sources.modbus[{i}]"
        errors.extend(check_modbus(mb, at))
        for j, reg in enumerate(mb.registers):
            rat = f"{at}.registers[{j}]"
            if reg.name in produced:
                errors.append(
                    f"{rat}.name: {reg.name!r} is already produced by {produced[reg.name]}"
                )
            else:
                produced[reg.name] = rat
    decoded: list[tuple[str, Sequence[CanSection | ReplaySection]]] = [
        ("can", src.can),
        ("replay", src.replay),
    ]
    for kind, decoders in decoded:
        for i, item in enumerate(decoders):
            at = f"sources.{kind}[{i}]"
            errors.extend(_check_decoder(item, at, base))
            if not item.signals:
                open_ended = True
            for sig in item.signals:
                full = item.prefix + sig
                if full in produced:
                    errors.append(f"{at}.signals: {full!r} is already produced by {produced[full]}")
                else:
                    produced[full] = f"{at}.signals"
    return produced, open_ended


def _check_decoder(item: CanSection | ReplaySection, at: str, base: Path) -> list[str]:
    errors: list[str] = []
    dbc = _resolve(item.dbc, base)
    if not dbc.is_file():
        errors.append(f"{at}.dbc: file not found: {str(dbc)!r}")
    if isinstance(item, ReplaySection) and not _resolve(item.path, base).is_file():
        errors.append(f"{at}.path: file not found: {str(_resolve(item.path, base))!r}")
    if isinstance(item, CanSection) and item.backoff_min_ms > item.backoff_max_ms:
        errors.append(
            f"{at}.backoff_min_ms: expected at most backoff_max_ms "
            f"({item.backoff_max_ms}); got {item.backoff_min_ms}"
        )
    return errors


def _check_perception(per: PerceptionSection) -> list[str]:
    errors: list[str] = []
    hop = per.hop if per.hop is not None else per.window
    if hop > per.window:
        errors.append(f"perception.hop: expected at most window ({per.window}); got {hop}")
    if 1e9 / per.rate_hz != int(1e9 / per.rate_hz):
        errors.append(
            f"perception.rate_hz: expected a rate with a whole number of ns per step "
            f"(e.g. 50, 100, 200, 1000); got {per.rate_hz}"
        )
    return errors


def _check_signals_produced(
    signals: Sequence[str], produced: Mapping[str, str], open_ended: bool
) -> list[str]:
    errors: list[str] = []
    seen: set[str] = set()
    for k, sig in enumerate(signals):
        if sig in seen:
            errors.append(f"perception.signals[{k}]: {sig!r} is listed twice")
        seen.add(sig)
        if sig not in produced and not open_ended:
            known = ", ".join(sorted(produced)) or "none"
            errors.append(
                f"perception.signals[{k}]: {sig!r} is produced by no source; known: {known}"
            )
    return errors


def _check_reasoning(rs: ReasoningSection, signals: Sequence[str]) -> list[str]:
    errors: list[str] = []
    names: dict[str, int] = {}
    for i, rule in enumerate(rs.rules):
        at = f"reasoning.rules[{i}]"
        if rule.name in names:
            errors.append(
                f"{at}.name: {rule.name!r} is already used by reasoning.rules[{names[rule.name]}]"
            )
        else:
            names[rule.name] = i
        if rule.signal not in signals:
            errors.append(
                f"{at}.signal: expected one of the perception signals "
                f"({', '.join(signals)}); got {rule.signal!r}"
            )
        if rule.label in (NORMAL, DROPOUT):
            errors.append(
                f"{at}.label: expected an alarm label of the model (not {NORMAL!r} or the "
                f"built-in {DROPOUT!r}); got {rule.label!r}"
            )
        if not math.isfinite(rule.value):
            errors.append(f"{at}.value: expected a finite number; got {rule.value!r}")
    for label in rs.thresholds:
        if label in (NORMAL, DROPOUT):
            errors.append(
                f"reasoning.thresholds.{label}: expected an alarm label of the model (not "
                f"{NORMAL!r} or the built-in {DROPOUT!r}); got {label!r}"
            )
    for label, t in rs.thresholds.items():
        if t - rs.hysteresis.margin <= 0 and label not in (NORMAL, DROPOUT):
            errors.append(
                f"reasoning.thresholds.{label}: expected more than hysteresis.margin "
                f"({rs.hysteresis.margin:g}), or the alarm could never clear; got {t:g}"
            )
    return errors


def _resolve(path: str, base: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else base / p


# -- conversion -----------------------------------------------------------------------------


def _convert(model: AgentConfigModel, path: Path, base: Path) -> AgentConfig:
    per = model.perception
    sources = _source_specs(model.sources, base)
    reasoning = _reasoning_config(model.reasoning, base)
    return AgentConfig(
        path=path,
        agent=model.agent,
        perception=PerceptionSpec(
            signals=tuple(per.signals),
            rate_hz=per.rate_hz,
            window=per.window,
            hop=per.hop if per.hop is not None else per.window,
            interpolation=per.interpolation,
            max_staleness_ms=per.max_staleness_ms,
            lateness_ms=per.lateness_ms,
            max_catch_up_windows=per.max_catch_up_windows,
        ),
        queue_size=per.queue_size,
        sources=sources,
        reasoning=reasoning,
        memory=model.memory,
        state_dir=_resolve(model.agent.state_dir, base),
        schedule=model.schedule,
        gate_control_list=GateControlList.from_section(
            model.schedule,
            default_base_ns=window_close_phase_ns(
                model.schedule.cycle_us * 1000, lateness_ms=per.lateness_ms
            ),
        ),
        api=model.api,
        uplink=resolve_uplink(model.uplink, base),
        ota=model.ota,
    )


def _source_specs(src: SourcesSection, base: Path) -> tuple[ModbusSpec | CanSpec | ReplaySpec, ...]:
    """The drivers' specs of every configured source (paths resolved against ``base``)."""
    sources: list[ModbusSpec | CanSpec | ReplaySpec] = [_modbus_spec(mb) for mb in src.modbus]
    for can in src.can:
        sources.append(
            CanSpec(
                name=can.name,
                interface=can.interface,
                channel=can.channel,
                dbc=_resolve(can.dbc, base),
                bitrate=can.bitrate,
                options=dict(can.options),
                signals=tuple(can.signals),
                prefix=can.prefix,
                recv_timeout_ms=can.recv_timeout_ms,
                backoff_min_ms=can.backoff_min_ms,
                backoff_max_ms=can.backoff_max_ms,
            )
        )
    for rp in src.replay:
        sources.append(
            ReplaySpec(
                name=rp.name,
                path=_resolve(rp.path, base),
                dbc=_resolve(rp.dbc, base),
                speed=rp.speed,
                loop=rp.loop,
                signals=tuple(rp.signals),
                prefix=rp.prefix,
                strict=rp.strict,
            )
        )
    return tuple(sources)


def _modbus_spec(mb: ModbusSection) -> ModbusSpec:
    regs = tuple(
        RegisterSpec(
            name=r.name,
            address=r.address,
            function=r.function,
            type=r.type,
            order=r.order,
            unit=r.unit if r.unit is not None else mb.unit,
            scale=r.scale,
            offset=r.offset,
            deadband=r.deadband,
            poll_ms=r.poll_ms if r.poll_ms is not None else mb.poll_ms,
            bit=r.bit,
            bits=r.bits,
        )
        for r in mb.registers
    )
    return ModbusSpec(
        name=mb.name,
        transport=mb.transport,
        host=mb.host,
        port=mb.port,
        device=mb.device,
        baudrate=mb.baudrate,
        parity=mb.parity,
        stopbits=mb.stopbits,
        bytesize=mb.bytesize,
        timeout_ms=mb.timeout_ms,
        max_gap=mb.max_gap,
        max_registers=mb.max_registers,
        backoff_min_ms=mb.backoff_min_ms,
        backoff_max_ms=mb.backoff_max_ms,
        heartbeat_ms=mb.heartbeat_ms,
        registers=regs,
    )


def _reasoning_config(rs: ReasoningSection, base: Path) -> ReasoningConfig:
    rules = RuleSet(
        constraints=tuple(
            ConstraintRule(
                name=r.name,
                kind=r.kind,
                label=r.label,
                when=Condition(signal=r.signal, stat=r.stat, op=r.op, value=r.value),
            )
            for r in rs.rules
        ),
        hysteresis=HysteresisSpec(
            raise_after=rs.hysteresis.raise_after,
            clear_after=rs.hysteresis.clear_after,
            margin=rs.hysteresis.margin,
        ),
        thresholds=dict(rs.thresholds),
        top_k=rs.top_signals,
    )
    budgets = rs.budget_ms.model_dump()
    return ReasoningConfig(
        enabled=rs.enabled,
        model_dir=_resolve(rs.model_dir, base) if rs.model_dir is not None else None,
        backend=None if rs.backend == "auto" else rs.backend,
        threads=rs.threads,
        jit={"auto": None, "on": True, "off": False}[rs.jit],
        rules=rules,
        breaker=BreakerSpec(
            budget_us=rs.budget_ms.reasoning * 1000.0,
            trip_after=rs.breaker.trip_after,
            recover_after=rs.breaker.recover_after,
            mode=rs.breaker.mode,
            k=rs.breaker.k,
            probe_every=rs.breaker.probe_every,
        ),
        budget_ms=budgets,
        acquisition=rs.acquisition,
    )


def resolve_uplink(section: UplinkSection, base: Path) -> UplinkSection:
    """``section`` with its relative file paths made relative to ``base`` (the config's folder)."""
    update: dict[str, object] = {}
    if section.password_file is not None:
        update["password_file"] = str(_resolve(section.password_file, base))
    if section.tls is not None:
        tls = section.tls
        files = {"ca_file": tls.ca_file, "cert_file": tls.cert_file, "key_file": tls.key_file}
        update["tls"] = tls.model_copy(
            update={k: str(_resolve(v, base)) for k, v in files.items() if v is not None}
        )
    return section.model_copy(update=update) if update else section
