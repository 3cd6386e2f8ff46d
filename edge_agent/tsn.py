"""``edge-agent tsn``: show or install the NIC side of the gate control list (tc taprio).

``render`` prints the ``tc qdisc replace ... taprio`` command for the config's ``[schedule]``;
``apply`` runs it (root or CAP_NET_ADMIN, iproute2, a kernel with taprio and a NIC with
enough TX queues). The schedule's base time defaults to the phase at which perception windows
close (``[perception] lateness_ms``), as the agent's own scheduler uses it.

Exit codes: 0 ok; 1 ``apply`` failed (not root, no ``tc``, no interface, tc refused);
2 bad config. Diagnostics go to stderr, the command (``render``) to stdout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from edge_agent.config import load_config
from edge_agent.errors import ConfigError
from edge_agent.gcl import (
    GateControlList,
    format_command,
    render_taprio,
)

#: Refuse config files larger than this before parsing them (as the agent's loader does).
DEFAULT_CONFIG = Path("/etc/edge-agent/agent.toml")

tsn_app = typer.Typer(
    name="tsn",
    help="Render or apply the gate control list as a tc taprio qdisc on the NIC.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigOpt = Annotated[
    Path, typer.Option("--config", "-c", help="Agent config (TOML) with a \\[schedule] section.")
]
InterfaceOpt = Annotated[
    str | None,
    typer.Option("--interface", "-i", help="Network interface. Default: schedule.tsn.interface."),
]


# -- loading ---------------------------------------------------------------------------------


def schedule_from_config(path: str | Path) -> GateControlList:
    """The gate control list of the agent config at ``path``.

    The whole config is validated (a schedule is only as good as the config it runs in);
    raises :class:`ConfigError` listing every problem, each naming the key path.
    """
    return _load(path)[0]


def _load(path: str | Path) -> tuple[GateControlList, list[str]]:
    """The list and the schedule's notes (warnings)."""
    cfg = load_config(path)
    return cfg.gate_control_list, cfg.schedule.notes(rate_hz=cfg.perception.rate_hz)


def apply_problem(
    euid: int, tc_path: str | None, iface_exists: bool, *, interface: str = "the interface"
) -> str | None:
    """Why ``apply`` cannot run here, or None. Pure: the caller looks at the system."""
    if euid != 0:
        return (
            "installing a qdisc needs root (or CAP_NET_ADMIN); run as root, or use "
            "`edge-agent tsn render` and run the printed command yourself"
        )
    if tc_path is None:
        return "`tc` is not on PATH; install iproute2"
    if not iface_exists:
        return f"no network interface {interface!r} (see `ip link`); pick one with --interface"
    return None


def tc_failure(stderr: str, returncode: int, *, interface: str, needed_queues: int) -> str:
    """A message for a failed ``tc`` run that says what to do, with tc's own words after it."""
    said = stderr.strip() or "(no output)"
    lowered = said.lower()
    if "kind is unknown" in lowered or "unknown qdisc" in lowered:
        cause = (
            "the kernel lacks the taprio qdisc (CONFIG_NET_SCH_TAPRIO; try `modprobe sch_taprio`)"
        )
    elif "not supported" in lowered:
        cause = (
            f"the kernel lacks taprio (CONFIG_NET_SCH_TAPRIO) or {interface} has too few TX "
            f"queues (the schedule needs {needed_queues}; see `ethtool -l {interface}`)"
        )
    else:
        cause = f"tc failed with exit code {returncode}"
    return f"{cause}; tc said: {said}"


def _tx_queues(interface: str) -> int | None:
    try:
        return sum(
            1 for n in os.listdir(f"/sys/class/net/{interface}/queues") if n.startswith("tx-")
        )
    except OSError:
        return None


def _fail(lines: Sequence[str], code: int) -> NoReturn:
    for line in lines:
        typer.echo(line, err=True)
    raise typer.Exit(code)


def _load_or_exit(config: Path) -> GateControlList:
    try:
        gcl, notes = _load(config)
    except ConfigError as exc:
        _fail([f"{exc.source}: {e}" for e in exc.errors], 2)
    for note in notes:
        typer.echo(f"{config}: note: {note}", err=True)
    return gcl


# -- commands --------------------------------------------------------------------------------


@tsn_app.command()
def render(config: ConfigOpt = DEFAULT_CONFIG, interface: InterfaceOpt = None) -> None:
    """Print the tc taprio command for the config's schedule."""
    gcl = _load_or_exit(config)
    typer.echo(format_command(render_taprio(gcl, interface)))


@tsn_app.command()
def apply(
    config: ConfigOpt = DEFAULT_CONFIG,
    interface: InterfaceOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Check and print the command; do not run it.")
    ] = False,
) -> None:
    """Install the schedule on the NIC as a taprio qdisc (replaces the root qdisc)."""
    gcl = _load_or_exit(config)
    iface = interface or gcl.interface
    argv = render_taprio(gcl, iface)
    problem = apply_problem(
        os.geteuid(),
        shutil.which("tc"),
        os.path.isdir(f"/sys/class/net/{iface}"),
        interface=iface,
    )
    if problem is not None:
        _fail([f"cannot apply: {problem}"], 1)
    if dry_run:
        typer.echo(format_command(argv))
        return
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        message = tc_failure(
            done.stderr, done.returncode, interface=iface, needed_queues=gcl.tx_queues
        )
        have = _tx_queues(iface)
        if have is not None and have < gcl.tx_queues:
            message += f" ({iface} has {have} TX queue(s); the schedule needs {gcl.tx_queues})"
        _fail([f"cannot apply: {message}", f"command: {format_command(argv)}"], 1)
    typer.echo(f"taprio installed on {iface}: {len(gcl.entries)} entries, {gcl.cycle_ns} ns cycle")


if __name__ == "__main__":
    tsn_app()
