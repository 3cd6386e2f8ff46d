"""``fleet``: the control-room CLI. Device, telemetry and rollout commands arrive with the
fleet issues; until then it reports its version so packaging and the console script are
exercised end to end."""

import typer

from edge_agent import __version__

app = typer.Typer(
    name="fleet",
    help="EdgeFleet control room: ingest, devices, keys, bundles and rollouts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def version() -> None:
    """Print the fleet tools' version."""
    typer.echo(__version__)


@app.callback()
def _root() -> None:
    """EdgeFleet control room."""


def main() -> None:
    """Console-script entry point."""
    app()
