"""``edge-agent read``: every configured value read once from the real devices, one table.

For commissioning: is the PLC reachable, does each register answer, are word order and
scale right? Modbus values are asked once each, CAN signals listened to for
``--can-listen`` seconds; replay sources are left out. Sources are read concurrently.

Exit codes: 0 every value read, 1 any value failed (exception reply, timeout, device or
bus unreachable, a signal not heard), 2 a bad config or option. ``--json`` prints one
JSON document on stdout; diagnostics go to stderr.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from drivers.errors import DriverConfigError, modbus_exception_name
from drivers.readout import Reading, read_once
from drivers.specs import CanSpec, ModbusSpec, ReplaySpec
from edge_agent.config import AgentConfig, load_config
from edge_agent.errors import ConfigError

#: Lines wider than any terminal, so a pipe gets each row on one line.
_PIPE_WIDTH = 100_000


def read(
    config: Annotated[
        Path, typer.Option("--config", "-c", help="Agent config (TOML).", show_default=True)
    ] = Path("/etc/edge-agent/agent.toml"),
    source: Annotated[
        list[str] | None,
        typer.Option("--source", "-s", metavar="NAME", help="Read only this source (repeatable)."),
    ] = None,
    can_listen: Annotated[
        float,
        typer.Option(
            "--can-listen",
            min=0.05,
            max=600,
            help="Seconds to listen to each CAN bus; a signal not heard in that time fails.",
        ),
    ] = 2.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
) -> None:
    """Read every configured register and CAN signal once from the devices, then exit.

    One row per value: where, raw words (or frame bytes), exact decoded value, scaled
    value, or why it failed. Exit 1 if any read failed, 2 for a bad config.
    """
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    specs = _pick(cfg, source or [])
    try:
        readings = asyncio.run(_read_all(specs, can_listen))
    except DriverConfigError as exc:
        typer.echo(f"edge-agent read: {exc}", err=True)
        raise typer.Exit(2) from None
    failed = sum(not r.ok for r in readings)
    if json_out:
        doc = {
            "config": str(config),
            "ok": failed == 0,
            "read": len(readings) - failed,
            "failed": failed,
            "readings": [_to_json(r) for r in readings],
        }
        typer.echo(json.dumps(doc, indent=2))
    else:
        _print_table(readings)
        typer.echo(f"{len(readings) - failed} read, {failed} failed", err=True)
    if failed:
        raise typer.Exit(1)


def _pick(cfg: AgentConfig, names: Sequence[str]) -> list[ModbusSpec | CanSpec]:
    by_name = {s.name: s for s in cfg.sources}
    for name in names:
        if name not in by_name:
            known = ", ".join(by_name)
            typer.echo(
                f"edge-agent read: --source {name!r}: no such source; known: {known}", err=True
            )
            raise typer.Exit(2)
        if isinstance(by_name[name], ReplaySpec):
            typer.echo(
                f"edge-agent read: --source {name!r}: a replay source reads a capture file, "
                f"there is no device to read",
                err=True,
            )
            raise typer.Exit(2)
    chosen = [by_name[n] for n in dict.fromkeys(names)] if names else list(cfg.sources)
    picked: list[ModbusSpec | CanSpec] = []
    for spec in chosen:
        if isinstance(spec, ReplaySpec):
            typer.echo(
                f"edge-agent read: left out replay source {spec.name!r} (a capture file, "
                f"no device)",
                err=True,
            )
        else:
            picked.append(spec)
    return picked


async def _read_all(specs: Sequence[ModbusSpec | CanSpec], listen_s: float) -> list[Reading]:
    results = await asyncio.gather(*(read_once(s, listen_s=listen_s) for s in specs))
    return [r for group in results for r in group]


def _to_json(r: Reading) -> dict[str, Any]:
    error: dict[str, Any] | None = None
    if not r.ok:
        error = {"kind": r.error_kind, "message": r.error}
        if r.code is not None:
            error.update(code=r.code, name=modbus_exception_name(r.code))
    return {
        "source": r.source,
        "signal": r.signal,
        "where": r.where,
        "type": r.type,
        "raw": list(r.raw) if r.ok else None,
        "decoded": _finite(r.decoded),
        "value": _finite(r.value),
        "unit": r.unit,
        "error": error,
    }


def _finite(x: int | float | None) -> int | float | None:
    """JSON has no NaN/inf: a float register holding one reads as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _print_table(readings: Sequence[Reading]) -> None:
    table = Table("source", "signal", "where", "type", "raw", "decoded", "value", "error")
    for r in readings:
        if r.ok:
            table.add_row(
                r.source,
                r.signal,
                r.where,
                r.type,
                _raw_text(r),
                str(r.decoded),
                f"{r.value:.10g} {r.unit}".rstrip(),
                "",
            )
        else:
            table.add_row(
                r.source, r.signal, r.where, r.type, "", "", "", _error_text(r), style="red"
            )
    console = Console(
        soft_wrap=False, highlight=False, width=None if sys.stdout.isatty() else _PIPE_WIDTH
    )
    console.print(table)


def _raw_text(r: Reading) -> str:
    if r.type == "can":
        return " ".join(f"{b:02X}" for b in r.raw)
    if r.type == "bool":  # a coil or discrete input (a register's bit says "bool bit N")
        return " ".join(str(b) for b in r.raw)
    return " ".join(f"0x{w:04X}" for w in r.raw)


def _error_text(r: Reading) -> str:
    if r.error_kind == "exception":  # the message names the code and its meaning
        return r.error
    return f"{r.error_kind}: {r.error}"
