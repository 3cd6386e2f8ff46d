"""``fleet artifacts ...``: publish bundles into a folder and serve it over HTTP and CoAP.

``fleet.cli`` mounts ``app`` as ``artifacts``. Exit codes: 0 done, 1 refused or failed (the
message on stderr names the folder, file or address), 2 bad usage (typer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from pathlib import Path
from typing import Annotated

import typer

from fleet.artifacts import ArtifactServer, ArtifactStats, publish
from fleet.errors import ArtifactError, ArtifactPortInUse

app = typer.Typer(
    help="Bundles by sha256 over HTTP (range requests) and CoAP (block-wise).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DirOpt = Annotated[
    Path,
    typer.Option("--dir", file_okay=False, help="The folder of <sha256>.efb files."),
]


@app.command("add")
def add_cmd(
    files: Annotated[list[Path], typer.Argument(help="Bundle files to publish.", dir_okay=False)],
    directory: DirOpt = Path("artifacts"),
) -> None:
    """Copy bundles into --dir under their sha256 (fsynced); print one sha256 per file."""
    for file in files:
        try:
            sha = publish(directory, file)
        except ArtifactError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"{sha}  {file}")


@app.command("serve")
def serve_cmd(
    directory: DirOpt = Path("artifacts"),
    http_host: Annotated[str, typer.Option("--http-host")] = "127.0.0.1",
    http_port: Annotated[int, typer.Option("--http-port", min=0, max=65535)] = 8080,
    coap_host: Annotated[str, typer.Option("--coap-host")] = "127.0.0.1",
    coap_port: Annotated[int, typer.Option("--coap-port", min=0, max=65535)] = 5683,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the bound ports, and the stats at exit, as JSON.")
    ] = False,
) -> None:
    """Serve --dir until SIGINT / SIGTERM (HTTP /v1/bundles/<sha256>, CoAP bundles/<sha256>)."""
    server = ArtifactServer(
        directory,
        http_host=http_host,
        http_port=http_port,
        coap_host=coap_host,
        coap_port=coap_port,
    )
    try:
        stats = asyncio.run(_serve(server, as_json))
    except ArtifactPortInUse as exc:
        option = "--http-port" if exc.transport == "HTTP" else "--coap-port"
        typer.echo(f"error: {option}: {exc.host}:{exc.port} is already in use", err=True)
        raise typer.Exit(1) from None
    except ArtifactError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(vars(stats)))
    else:
        typer.echo(f"stopped; served {stats}", err=True)


async def _serve(server: ArtifactServer, as_json: bool) -> ArtifactStats:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with server:
            if as_json:
                ports = {"http_port": server.http_port, "coap_port": server.coap_port}
                typer.echo(json.dumps(ports))
            else:
                typer.echo(
                    f"serving {server.directory}: {server.http_url('<sha256>')} "
                    f"and {server.coap_url('<sha256>')}",
                    err=True,
                )
            await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
    return server.stats
