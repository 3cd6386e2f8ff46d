"""``edge-agent``: run the agent, check a config, run the plant simulator.

Exit codes: 0 ok, 1 runtime failure, 2 bad config or usage (as systemd and scripts expect:
a config error must not be retried by ``Restart=on-failure`` forever without a message).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from drivers.errors import DriverError
from edge_agent import __version__
from edge_agent.config import AgentConfig, load_config
from edge_agent.errors import ConfigError

app = typer.Typer(
    name="edge-agent",
    help="EdgeFleet edge agent: field-bus drivers, perception and (later) reasoning on a gateway.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigOpt = Annotated[
    Path, typer.Option("--config", "-c", help="Agent config (TOML).", show_default=True)
]


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _load_or_exit(path: Path) -> AgentConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


@app.command("check-config")
def check_config(
    file: Annotated[Path, typer.Argument(help="Config file to validate.")],
) -> None:
    """Validate FILE: exit 0, or print every error (key path, bad value, expected) and exit 2."""
    from drivers.source import open_source  # noqa: PLC0415 - loads DBCs; only when asked

    cfg = _load_or_exit(file)
    errors: list[str] = []
    for spec in cfg.sources:
        # Building a source parses its DBC / register map without touching the network.
        try:
            open_source(spec)
        except DriverError as exc:
            errors.append(f"sources {spec.name!r}: {exc}")
    if errors:
        typer.echo(f"{file}: {len(errors)} error(s) in config", err=True)
        for e in errors:
            typer.echo(f"  {e}", err=True)
        raise typer.Exit(2)
    typer.echo(
        f"{file}: ok ({len(cfg.sources)} source(s), {len(cfg.perception.signals)} signal(s), "
        f"{cfg.perception.window} x {cfg.perception.rate_hz:g} Hz windows)"
    )


@app.command()
def run(
    config: ConfigOpt = Path("/etc/edge-agent/agent.toml"),
    duration: Annotated[
        float | None,
        typer.Option(help="Stop after this many seconds (default: run until signalled)."),
    ] = None,
    simulate: Annotated[
        bool,
        typer.Option(
            "--simulate",
            help="Also run the plant simulator in this process, on the Modbus port and CAN "
            "channel the config's first sources name (for the demo).",
        ),
    ] = False,
    status_json: Annotated[
        bool, typer.Option("--status-json", help="Print a final JSON status on stdout.")
    ] = False,
) -> None:
    """Run the agent: sources -> perception, logging windows/s, completeness and drops."""
    cfg = _load_or_exit(config)
    _setup_logging(cfg.agent.log_level)
    try:
        status = asyncio.run(_run(cfg, duration, simulate))
    except DriverError as exc:
        typer.echo(f"edge-agent: {exc}", err=True)
        raise typer.Exit(1) from None
    if status_json:
        typer.echo(json.dumps(status, indent=2, sort_keys=True))


async def _run(cfg: AgentConfig, duration: float | None, simulate: bool) -> dict[str, object]:
    from edge_agent.service import Agent, run_until_signalled  # noqa: PLC0415

    agent = Agent(cfg)
    if not simulate:
        await run_until_signalled(agent, duration)
        return agent.status()
    from drivers.sim.server import PlantSimulator  # noqa: PLC0415

    sim_args = _simulator_args_for(cfg)
    async with PlantSimulator(**sim_args):  # type: ignore[arg-type]
        await run_until_signalled(agent, duration)
    return agent.status()


def _simulator_args_for(cfg: AgentConfig) -> dict[str, object]:
    from drivers.specs import CanSpec, ModbusSpec  # noqa: PLC0415

    args: dict[str, object] = {"seed": 1}
    for spec in cfg.sources:
        if isinstance(spec, ModbusSpec) and spec.transport == "tcp" and "modbus_port" not in args:
            args["modbus_host"], args["modbus_port"] = spec.host, spec.port
        if isinstance(spec, CanSpec) and "can_interface" not in args:
            args["can_interface"], args["can_channel"] = spec.interface, spec.channel
    return args


@app.command()
def version() -> None:
    """Print the agent version."""
    typer.echo(__version__)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
