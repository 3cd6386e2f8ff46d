"""``edge-agent``: run the agent, check a config, read the devices once, run the simulator.

Exit codes: 0 ok, 1 runtime failure, 2 bad config or usage (as systemd and scripts expect:
a config error must not be retried by ``Restart=on-failure`` forever without a message).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from drivers.errors import DriverError, PortInUse
from edge_agent import __version__
from edge_agent.config import AgentConfig, load_config
from edge_agent.errors import (
    ConfigError,
    ModelMismatch,
    ReasoningError,
    SelfTestFailed,
    ServiceError,
    StatePathError,
)
from edge_agent.memory.cli import memory_app
from edge_agent.memory.errors import MemoryStoreError
from edge_agent.ota_cli import ota_app
from edge_agent.read_cli import read
from edge_agent.selftest_cli import selftest
from edge_agent.tsn import tsn_app
from edge_agent.uplink.errors import UplinkError

if TYPE_CHECKING:
    from drivers.sim.plant import Anomaly
    from edge_agent.dashboard import Dashboard
    from edge_agent.looptrace import LoopTrace
    from edge_agent.rules import Decision

T = TypeVar("T")

#: "Restart me": an OTA update needs a new process (systemd's Restart=on-failure does it).
EXIT_RESTART = 3

app = typer.Typer(
    name="edge-agent",
    help="EdgeFleet edge agent on a gateway: CAN and Modbus sources, perception, memory, the INT8 "
    "model with rules, a health API, the MQTT uplink and signed OTA updates.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.add_typer(memory_app, name="memory", help="Inspect, snapshot and restore the memory store.")
app.add_typer(ota_app, name="ota")
app.add_typer(
    tsn_app, name="tsn", help="Render or apply the gate schedule as a taprio qdisc (802.1Qbv)."
)
app.command("read")(read)
app.command("selftest")(selftest)

ConfigOpt = Annotated[
    Path, typer.Option("--config", "-c", help="Agent config (TOML).", show_default=True)
]


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop where it is installed (EDGEFLEET_LOOP=asyncio: never)."""
    if os.environ.get("EDGEFLEET_LOOP", "auto") != "asyncio":
        try:
            import uvloop  # noqa: PLC0415 - optional
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


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
    from edge_agent.statepaths import path_problems, state_paths  # noqa: PLC0415

    cfg = _load_or_exit(file)
    # Where the agent will write: checked without creating anything.
    errors: list[str] = path_problems(state_paths(cfg))
    for spec in cfg.sources:
        # Building a source parses its DBC / register map without touching the network.
        try:
            open_source(spec)
        except DriverError as exc:
            errors.append(f"sources {spec.name!r}: {exc}")
    notes: list[str] = []
    if cfg.reasoning.enabled:
        from edge_agent.acquisition import contract_check  # noqa: PLC0415
        from edge_agent.service import build_stage  # noqa: PLC0415 - loads the model

        # The labels named by rules and thresholds are known only to the model, and so is
        # the acquisition it was trained for.
        try:
            stage = build_stage(cfg, contract=False)
        except ReasoningError as exc:
            errors.append(str(exc))
        else:
            errors_before = len(errors)
            report = contract_check(cfg)(stage.model.manifest)
            for f in report.findings:
                line = f"reasoning.acquisition: {f}"
                if f.severity == "note":
                    notes.append(line)
                elif report.accepted:
                    notes.append(f"{line} (run anyway: acquisition = accept-mismatch)")
                else:
                    errors.append(line)
            notes += [f"reasoning.acquisition: {n}" for n in report.notes]
            if len(errors) > errors_before:
                errors.append(
                    f"reasoning.acquisition: {report.model} was trained for another "
                    "acquisition: retrain it for this config, change the config, or set "
                    '[reasoning] acquisition = "accept-mismatch" to run it anyway (every '
                    "decision is then marked)"
                )
    if errors:
        typer.echo(f"{file}: {len(errors)} error(s) in config", err=True)
        for e in errors:
            typer.echo(f"  {e}", err=True)
        for note in notes:
            typer.echo(f"  note: {note}", err=True)
        raise typer.Exit(2)
    for note in [*cfg.schedule.notes(rate_hz=cfg.perception.rate_hz), *notes]:
        typer.echo(f"{file}: note: {note}", err=True)
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
    dashboard: Annotated[
        bool,
        typer.Option(
            "--dashboard",
            help="A live terminal view of windows/s, stage latencies, decisions and scores, "
            "and a summary at the end (plain lines when stdout is not a terminal).",
        ),
    ] = False,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            metavar="FILE",
            help="Diagnostics: record every window's path from its close to its decision, "
            "the garbage collections and what the event loop ran when it came late to a "
            "gate, and write them to FILE as JSON when the agent stops (bench.e2e --trace "
            "reads it). Costs a thread that wakes at every gate opening.",
        ),
    ] = None,
    anomaly: Annotated[
        list[str] | None,
        typer.Option(
            help="With --simulate: inject an anomaly into the simulated plant, "
            "KIND:SIGNAL@START+DURATION\\[xMAGNITUDE], e.g. spike:current@3+10x8 "
            "(plant seconds from the start). Repeatable.",
        ),
    ] = None,
) -> None:
    """Run the agent: sources -> perception -> memory -> reasoning, logging rates, drops and
    alarms.

    Exit codes: 2 for a bad config (a state folder it cannot make or write included), a
    model that does not fit it or one that fails its known-answer self-test, 1 for a model
    that cannot be loaded or a runtime failure (a port in use, the memory store held by
    another agent).
    """
    from drivers.sim.plant import parse_anomaly  # noqa: PLC0415

    cfg = _load_or_exit(config)
    if anomaly and not simulate:
        typer.echo("edge-agent run: --anomaly needs --simulate", err=True)
        raise typer.Exit(2)
    if trace is not None and not trace.parent.is_dir():
        typer.echo(f"edge-agent run: --trace {trace}: no folder {trace.parent}", err=True)
        raise typer.Exit(2)
    try:
        anomalies = tuple(parse_anomaly(a) for a in anomaly or ())
    except DriverError as exc:
        typer.echo(f"edge-agent run: {exc}", err=True)
        raise typer.Exit(2) from None
    _setup_logging(cfg.agent.log_level)
    try:
        status = run_loop(_run(cfg, duration, simulate, anomalies, dashboard, trace))
    except ReasoningError as exc:
        typer.echo(f"edge-agent: {exc}", err=True)
        # A model that does not fit the config is a config problem; one that does not load
        # (corrupt, missing runtime) is a runtime failure.
        # A model whose known answers fail on every kernel set is refused the same way.
        raise typer.Exit(2 if isinstance(exc, (ModelMismatch, SelfTestFailed)) else 1) from None
    except StatePathError as exc:
        typer.echo(f"{config}: {exc}", err=True)
        raise typer.Exit(2) from None
    except (DriverError, ServiceError, UplinkError, MemoryStoreError) as exc:
        typer.echo(f"edge-agent: {exc}", err=True)
        raise typer.Exit(1) from None
    if status_json:
        typer.echo(json.dumps(status, indent=2, sort_keys=True))
    if status.get("restart_requested"):
        # systemd (Restart=on-failure) starts us again: the A/B launcher then runs the
        # slot the OTA update pointed at.
        typer.echo(f"edge-agent: restarting: {status['restart_requested']}", err=True)
        raise typer.Exit(EXIT_RESTART)


async def _run(
    cfg: AgentConfig,
    duration: float | None,
    simulate: bool,
    anomalies: Sequence[Anomaly] = (),
    dashboard: bool = False,
    trace: Path | None = None,
) -> dict[str, object]:
    from edge_agent.compose import build_agent  # noqa: PLC0415
    from edge_agent.service import run_until_signalled  # noqa: PLC0415

    dash: Dashboard | None = None

    def on_decision(d: Decision) -> None:
        if dash is not None:
            dash.on_decision(d)

    agent = build_agent(cfg, on_decision=on_decision if dashboard else None)
    _keep_startup_out_of_gc()
    # numba's modules and kernels, loaded after READY, live as long too.
    agent.on_kernels_loaded = _keep_startup_out_of_gc
    async with contextlib.AsyncExitStack() as stack:
        if trace is not None:
            from edge_agent.looptrace import LoopTrace  # noqa: PLC0415 - diagnostics only

            tracer = agent.trace = LoopTrace(agent.gcl)
            stack.callback(_write_trace, tracer, trace)
            tracer.start()  # here: on the loop's thread
            stack.callback(tracer.stop)
        if simulate:
            from drivers.sim.server import PlantSimulator  # noqa: PLC0415
            from drivers.specs import CanSpec, ModbusSpec  # noqa: PLC0415

            # Serve what the config reads: its first Modbus TCP port and its first CAN channel.
            modbus_specs = [s for s in cfg.sources if isinstance(s, ModbusSpec)]
            k, modbus = next(
                ((k, s) for k, s in enumerate(modbus_specs) if s.transport == "tcp"), (0, None)
            )
            can_spec = next((s for s in cfg.sources if isinstance(s, CanSpec)), None)
            try:
                await stack.enter_async_context(
                    PlantSimulator(
                        seed=1,
                        anomalies=anomalies,
                        modbus_host=modbus.host if modbus else "127.0.0.1",
                        modbus_port=modbus.port if modbus else None,
                        can_interface=can_spec.interface if can_spec else None,
                        can_channel=can_spec.channel if can_spec else "edgefleet-sim",
                    )
                )
            except PortInUse as exc:
                raise ServiceError(
                    f"sources.modbus[{k}].port: {exc} (another edge-agent --simulate?); the "
                    "simulator serves the port the config reads"
                ) from None
        if not dashboard:
            await run_until_signalled(agent, duration)
            return agent.status()
        from edge_agent.dashboard import Dashboard, model_description  # noqa: PLC0415

        # Built as the plant starts, so the anomaly times on screen match the plant's.
        dash = Dashboard(cfg.agent.device, model_description(agent.status()), anomalies, duration)
        # Log lines would tear the live view; warnings still show above it.
        logging.getLogger().setLevel(max(logging.WARNING, logging.getLogger().level))
        view = dash

        async def show(done: asyncio.Event) -> None:
            await view.run(done, agent.status, gates=agent.gcl)

        await run_until_signalled(agent, duration, alongside=show)
    return agent.status()


@app.command()
def simulate(
    modbus_port: Annotated[
        int, typer.Option(help="Modbus TCP port to serve (0: any free port).")
    ] = 5020,
    modbus_host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    no_modbus: Annotated[bool, typer.Option("--no-modbus", help="Serve CAN only.")] = False,
    can_interface: Annotated[
        str, typer.Option(help="python-can interface (virtual, udp_multicast, socketcan).")
    ] = "udp_multicast",
    can_channel: Annotated[
        str, typer.Option(help="CAN channel (a multicast group for udp_multicast, can0 ...).")
    ] = "239.74.163.2",
    no_can: Annotated[bool, typer.Option("--no-can", help="Serve Modbus only.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the plant's duty cycle and noise.")] = 0,
    anomaly: Annotated[
        list[str] | None,
        typer.Option(
            help="Inject an anomaly, KIND:SIGNAL@START+DURATION\\[xMAGNITUDE], e.g. "
            "drift:temperature@30+60x15 (kinds: drift spike stuck dropout noise). Repeatable.",
        ),
    ] = None,
    speed: Annotated[float, typer.Option(help="Plant seconds per wall-clock second.")] = 1.0,
    duration: Annotated[
        float | None, typer.Option(help="Stop after this many seconds (default: until Ctrl-C).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug | info | warning | error")] = "info",
) -> None:
    """Run the plant simulator: a motor drive on Modbus TCP and CAN, with anomalies."""
    from drivers.sim.plant import parse_anomaly  # noqa: PLC0415
    from drivers.sim.server import SimOptions, serve  # noqa: PLC0415

    _setup_logging(log_level)
    try:
        options = SimOptions(
            seed=seed,
            anomalies=tuple(parse_anomaly(a) for a in anomaly or ()),
            modbus_host=modbus_host,
            modbus_port=None if no_modbus else modbus_port,
            can_interface=None if no_can else can_interface,
            can_channel=can_channel,
            speed=speed,
        )
    except DriverError as exc:
        typer.echo(f"edge-agent simulate: {exc}", err=True)
        raise typer.Exit(2) from None

    async def main() -> None:
        async with asyncio.timeout(duration):
            await serve(options)

    try:
        asyncio.run(main())
    except TimeoutError:
        pass
    except KeyboardInterrupt:
        pass
    except PortInUse as exc:
        typer.echo(f"edge-agent simulate: --modbus-port: {exc} (another simulator?)", err=True)
        raise typer.Exit(1) from None
    except DriverError as exc:
        typer.echo(f"edge-agent simulate: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
def version() -> None:
    """Print the agent version."""
    typer.echo(__version__)


#: Set by :func:`main` (the ``edge-agent`` program), not when ``app`` runs inside another
#: process (a test): ``run`` then takes the start-up objects out of the collector.
_OWN_PROCESS = False


def main() -> None:
    """Console-script entry point."""
    global _OWN_PROCESS  # noqa: PLW0603 - one flag, set once before the command runs
    _OWN_PROCESS = True
    app()


def _write_trace(trace: LoopTrace, path: Path) -> None:
    """Write the trace; a failure is said in one line and does not change the exit code."""
    try:
        trace.dump(path)
    except OSError as exc:
        typer.echo(f"edge-agent: --trace {path}: cannot write: {exc.strerror or exc}", err=True)


def _keep_startup_out_of_gc() -> None:
    """What start-up built (modules, the model, the stages, later the compiled kernels)
    lives as long as the agent:
    ``gc.freeze()`` moves it out of the collector's reach, so its automatic full
    collections scan only what comes after. Each of those stopped the event loop for
    15-45 ms, every ~10 s under bench.e2e's load (docs/ARCHITECTURE.md, "The real-time
    path"). No collection first: it would stop the loop as long, and what start-up left
    as garbage is a one-off. Only in the agent's own process: in a test it would freeze
    the test runner's objects too."""
    if _OWN_PROCESS:
        gc.freeze()
        logging.getLogger("edge_agent").info(
            "start-up objects kept out of the garbage collector (%d)", gc.get_freeze_count()
        )


if __name__ == "__main__":
    main()
