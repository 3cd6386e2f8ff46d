"""What a config's sources deliver for each signal, and the model's input contract against it.

The same description serves training for a config (``--acquisition-from``) and
:func:`contract_report`, which checks it against a model (:mod:`models.contract`) at
``check-config``, at start, at a hot swap and before an OTA model is staged.
``[reasoning] acquisition = "accept-mismatch"`` turns the contract's errors into a
warning: the agent runs the model anyway and marks every decision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from drivers.errors import DriverConfigError
from drivers.modbus.plan import plan_blocks
from drivers.specs import CanSpec, ModbusSpec, RegisterSpec, ReplaySpec
from models.acquisition import SignalAcquisition
from models.contract import Finding, check_contract
from models.runtime import ModelManifest

if TYPE_CHECKING:
    from edge_agent.config import AgentConfig

#: Mean arrival delays assumed for training on a config (not checked by the contract).
MODBUS_JITTER_MS = 1.0
CAN_JITTER_MS = 0.7
#: The config key that lets a model run whose contract the config does not meet.
ACCEPT_MISMATCH = "accept-mismatch"

_RAW_LIMITS: Mapping[str, tuple[int, int]] = {
    "int16": (-(1 << 15), (1 << 15) - 1),
    "uint16": (0, (1 << 16) - 1),
    "int32": (-(1 << 31), (1 << 31) - 1),
    "uint32": (0, (1 << 32) - 1),
    "int64": (-(1 << 63), (1 << 63) - 1),
    "uint64": (0, (1 << 64) - 1),
    "bool": (0, 1),
}


@dataclass(frozen=True, slots=True)
class Delivered:
    """One signal as a config delivers it, and the config key that makes it."""

    acquisition: SignalAcquisition
    where: str


def config_acquisition(
    sources: Sequence[ModbusSpec | CanSpec | ReplaySpec],
) -> dict[str, Delivered]:
    """Every signal the sources produce, described as :class:`Delivered`.

    Raises :class:`DriverConfigError` for a register map or DBC the drivers would refuse
    (``check-config`` reports those on their own).

    :func:`config_acquisition` describes every signal the config's sources produce in the
    terms of the model's ``training.acquisition`` (:class:`models.acquisition.SignalAcquisition`):

    * a Modbus register: its block's poll period (registers that share a unit, a function and
      a poll period and sit close together are one read, one schedule: ``drivers.modbus.plan``),
      its resolution (the ``scale`` of an integer type; 0 for a float), the range its type can
      carry, its ``deadband`` and the source's ``heartbeat_ms``;
    * a CAN or replayed signal: its DBC message's cycle time (``GenMsgCycleTime``; a replay
      divides it by its ``speed``), the signal's scale and range.

    Arrival jitter is not in a config: the defaults below are the ones the committed model was
    trained with (:mod:`models.dataset`), and the contract does not compare it.
    """
    out: dict[str, Delivered] = {}
    for spec, at in _keyed(sources):
        out.update(_delivered(spec, at))
    return out


def _keyed(
    sources: Sequence[ModbusSpec | CanSpec | ReplaySpec],
) -> list[tuple[ModbusSpec | CanSpec | ReplaySpec, str]]:
    """Each source with its config key (``sources.can[1]``)."""
    counts = {"modbus": 0, "can": 0, "replay": 0}
    out: list[tuple[ModbusSpec | CanSpec | ReplaySpec, str]] = []
    for spec in sources:
        kind = (
            "modbus"
            if isinstance(spec, ModbusSpec)
            else "can"
            if isinstance(spec, CanSpec)
            else "replay"
        )
        out.append((spec, f"sources.{kind}[{counts[kind]}]"))
        counts[kind] += 1
    return out


def _delivered(spec: ModbusSpec | CanSpec | ReplaySpec, at: str) -> dict[str, Delivered]:
    if isinstance(spec, ModbusSpec):
        return _modbus(spec, at)
    if isinstance(spec, CanSpec):
        return _dbc(spec, at, speed=1.0)
    return _dbc(spec, at, speed=spec.speed)


def _modbus(spec: ModbusSpec, at: str) -> dict[str, Delivered]:
    index = {reg.name: j for j, reg in enumerate(spec.registers)}
    out: dict[str, Delivered] = {}
    for block in plan_blocks(spec):
        source = (
            f"modbus {spec.name} unit {block.unit} {block.function} "
            f"{block.start}..{block.end - 1} poll"
        )
        for entry in block.entries:
            reg = entry.spec
            lo, hi = _register_range(reg)
            out[reg.name] = Delivered(
                SignalAcquisition(
                    source=source,
                    period_ms=float(block.poll_ms) if block.poll_ms > 0 else math.nan,
                    quantum=0.0 if reg.type.startswith("float") else abs(reg.scale),
                    lo=lo,
                    hi=hi,
                    deadband=reg.deadband,
                    heartbeat_ms=float(spec.heartbeat_ms) if reg.deadband else 0.0,
                    jitter_ms=MODBUS_JITTER_MS,
                    synced=False,
                ),
                f"{at}.registers[{index[reg.name]}]",
            )
    return out


def _register_range(reg: RegisterSpec) -> tuple[float, float]:
    if reg.type.startswith("float"):
        return -math.inf, math.inf
    if reg.type == "bitfield":
        raw: tuple[int, int] = (0, (1 << reg.bits) - 1)
    else:
        raw = _RAW_LIMITS[reg.type]
    a, b = raw[0] * reg.scale + reg.offset, raw[1] * reg.scale + reg.offset
    return min(a, b), max(a, b)


def _dbc(spec: CanSpec | ReplaySpec, at: str, *, speed: float) -> dict[str, Delivered]:
    from drivers.can.dbc import signal_timings  # noqa: PLC0415 - cantools only when needed

    out: dict[str, Delivered] = {}
    for t in signal_timings(spec.dbc, signals=spec.signals, prefix=spec.prefix):
        period = math.nan
        if t.cycle_ms is not None and not t.multiplexed and speed > 0:
            period = t.cycle_ms / speed
        kind = "replay" if isinstance(spec, ReplaySpec) else "can"
        out[t.name] = Delivered(
            SignalAcquisition(
                source=f"can {t.message}"
                + (f" replayed by {spec.name}" if kind == "replay" else ""),
                period_ms=period,
                quantum=abs(t.scale),
                lo=-math.inf if t.minimum is None else t.minimum,
                hi=math.inf if t.maximum is None else t.maximum,
                jitter_ms=CAN_JITTER_MS,
                synced=True,
            ),
            f"{at} ({t.message})",
        )
    return out


@dataclass(frozen=True, slots=True)
class ContractReport:
    """The contract of one model against one config.

    ``checked`` is False when the model records no acquisition (nothing to compare with);
    ``accepted``: the config says ``accept-mismatch``, so errors do not stop the model.
    """

    model: str
    findings: tuple[Finding, ...] = ()
    checked: bool = True
    accepted: bool = False
    notes: tuple[str, ...] = field(default=())

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def mismatch(self) -> bool:
        """Errors found (whether accepted or not)."""
        return bool(self.errors)

    @property
    def refused(self) -> bool:
        """Errors found and not accepted: the model must not serve this config."""
        return self.mismatch and not self.accepted

    def refusal(self) -> str:
        """Why the model must not serve this config: every error on a line of its own
        (the CLI prints it as is), and the ways out."""
        lines = "".join(f"\n  {f}" for f in self.errors)
        return (
            f"trained for another acquisition than this config delivers:{lines}\n  retrain "
            "it for this config, change the config, or set [reasoning] acquisition = "
            f'"{ACCEPT_MISMATCH}" to run it anyway (every decision is then marked)'
        )

    def brief(self) -> str:
        """The errors in a few words each (an OTA status reason has 1 KB)."""
        return "; ".join(f"{f.signal} {f.short}" for f in self.errors)

    def to_json(self) -> dict[str, object]:
        return {
            "checked": self.checked,
            "status": (
                "unchecked"
                if not self.checked
                else "mismatch_accepted"
                if self.mismatch and self.accepted
                else "mismatch"
                if self.mismatch
                else "ok"
            ),
            "errors": [str(f) for f in self.errors],
            "notes": [str(f) for f in self.findings if f.severity == "note"] + list(self.notes),
        }


def contract_report(
    sources: Sequence[ModbusSpec | CanSpec | ReplaySpec],
    *,
    grid_ms: float,
    manifest: ModelManifest,
    accept_mismatch: bool = False,
) -> ContractReport:
    """:func:`models.contract.check_contract` of ``manifest`` against what ``sources``
    deliver (a source the drivers would refuse counts as delivering nothing)."""
    name = f"model {manifest.name} {manifest.version} ({manifest.sha256[:12]})"
    model = manifest.acquisition
    if model is None:
        return ContractReport(
            name,
            checked=False,
            accepted=accept_mismatch,
            notes=(
                "the model records no acquisition (training.acquisition): its input contract "
                "is not checked",
            ),
        )
    delivered: dict[str, Delivered] = {}
    notes: list[str] = []
    for spec, at in _keyed(sources):
        try:
            delivered.update(_delivered(spec, at))
        except DriverConfigError as exc:
            notes.append(f"source {spec.name!r} not described: {exc}")
    wanted = {s: model.signals[s] for s in manifest.signals if s in model.signals}
    unrecorded = [s for s in manifest.signals if s not in model.signals]
    if unrecorded:
        notes.append(f"no acquisition recorded for {', '.join(unrecorded)}: not checked")
    findings = check_contract(
        wanted,
        {s: d.acquisition for s, d in delivered.items()},
        grid_ms=grid_ms,
        stats=manifest.input_stats,
        where={s: d.where for s, d in delivered.items()},
    )
    return ContractReport(
        name, tuple(findings), checked=True, accepted=accept_mismatch, notes=tuple(notes)
    )


def contract_check(config: AgentConfig) -> Callable[[ModelManifest], ContractReport]:
    """The check :class:`edge_agent.reasoning.ReasoningStage` runs on every model it
    prepares: :func:`contract_report` against ``config``'s sources and grid."""
    sources = config.sources
    grid_ms = 1000.0 / config.perception.rate_hz
    accept = config.reasoning.acquisition == ACCEPT_MISMATCH

    def check(manifest: ModelManifest) -> ContractReport:
        return contract_report(sources, grid_ms=grid_ms, manifest=manifest, accept_mismatch=accept)

    return check


__all__ = [
    "ACCEPT_MISMATCH",
    "CAN_JITTER_MS",
    "MODBUS_JITTER_MS",
    "ContractReport",
    "Delivered",
    "config_acquisition",
    "contract_check",
    "contract_report",
]
