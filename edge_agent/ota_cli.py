"""``edge-agent ota``: what a field engineer needs: status, install a bundle file, roll back.

``install`` and ``rollback`` talk to the running agent through its health API (the
config's ``[api]`` host and port, loopback only): the agent verifies, swaps between two
windows and runs the probation, and the command waits for the outcome. ``status`` asks the
agent, or reads the journal when it is not running. Errors are one line on stderr.

Exit codes: 0 done (committed, rolled back, or status shown); 1 the update failed or was
refused (the reason is printed); 2 bad usage or config; 3 the agent is not running.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.table import Table

from edge_agent.config import AgentConfig, load_config
from edge_agent.console import make_console
from edge_agent.errors import ConfigError
from edge_agent.ota_config import ota_dir
from ota.journal import load as load_journal
from ota.updater import describe

ota_app = typer.Typer(
    name="ota",
    help="OTA updates: status, install a bundle file, roll back. install and rollback talk "
    "to the running agent through its health API (\\[api] host and port in the config); "
    "status reads the journal on disk when the agent is not running.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DEFAULT_CONFIG = Path("/etc/edge-agent/agent.toml")
ConfigOpt = Annotated[
    Path, typer.Option("--config", "-c", help="Agent config (TOML).", show_default=True)
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")]
# soft_wrap: an error stays one line whatever the terminal's width (scripts grep it).
_err = make_console(stderr=True, soft_wrap=True)


def _fail(message: str, code: int) -> NoReturn:
    _err.print("[red]error:[/red] ", end="")
    _err.print(message, highlight=False, markup=False)
    raise typer.Exit(code)


def _config(path: Path) -> AgentConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        _fail(str(exc), 2)


class _AgentDown(Exception):
    pass


def _api(
    config: AgentConfig, method: str, route: str, body: Any = None, timeout: float = 5.0
) -> tuple[int, Any]:
    api = config.api
    if not api.enabled:
        raise _AgentDown(
            f"the agent's API is off ([api] enabled = false in {config.path}); "
            "edge-agent ota install and rollback talk to the running agent through it"
        )
    url = f"http://{api.host}:{api.port}{route}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    try:
        # The URL is always http://<[api] host>:<port>/v1/...: no user-chosen scheme.
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        why = (
            f"the agent is not running: nothing answers at {api.host}:{api.port} "
            f"([api] in {config.path}): {reason}"
        )
        raise _AgentDown(why) from None


@ota_app.command(
    "status",
    help="Active versions, the update in flight, the last outcome: from the running agent "
    "(through its health API), else from the journal on disk.",
)
def status(config: ConfigOpt = DEFAULT_CONFIG, as_json: JsonOpt = False) -> None:
    cfg = _config(config)
    try:
        _, doc = _api(cfg, "GET", "/v1/status", timeout=2.0)
        st = doc.get("ota", {})
        source = "agent"
    except _AgentDown:
        journal, warning = load_journal(ota_dir(cfg.state_dir) / "journal.json", repair=False)
        st = {**describe(journal), "warning": warning}
        source = "journal (agent not running)"
    if as_json:
        typer.echo(json.dumps(st, indent=1, sort_keys=True))
        return
    out = make_console()
    out.print(f"OTA state: [bold]{st.get('state', '?')}[/bold]  ({source})", highlight=False)
    table = Table("kind", "version", "counter", "bundle", "floor", "kept for rollback")
    kinds = sorted(set(st.get("active", {})) | set(st.get("floors", {})) | {"model"})
    for kind in kinds:
        a = st.get("active", {}).get(kind)
        table.add_row(
            kind,
            a["version"] if a else "factory",
            str(a["counter"]) if a else "-",
            a["bundle_id"] if a else "-",
            str(st.get("floors", {}).get(kind, "-")),
            ", ".join(st.get("kept", {}).get(kind, [])) or "-",
        )
    out.print(table)
    last = st.get("last")
    if last:
        line = f"last: {last['result']} {last['bundle_id']} {last['version']}: {last['reason']}"
        out.print(line, highlight=False)
    if st.get("warning"):
        out.print(f"[yellow]warning:[/yellow] {st['warning']}", highlight=False)


def _outcome(code: int, doc: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(doc, sort_keys=True))
    else:
        colour = "green" if doc.get("result") in ("committed", "rolled_back") else "red"
        typer.echo(f"{doc.get('result', '?')}: {doc.get('reason', '')}", err=colour == "red")
    if code >= 300:
        raise typer.Exit(1)


@ota_app.command(
    "install",
    help="Hand BUNDLE to the running agent through its health API (\\[api] in the config): "
    "it verifies, stages, swaps it in and runs the probation; wait for the outcome. The agent "
    "must be running (edge-agent run, or systemctl start edge-agent); if it is not, this says "
    "so on one line and exits 3.",
)
def install(
    bundle: Annotated[Path, typer.Argument(help="The .efb bundle file.")],
    config: ConfigOpt = DEFAULT_CONFIG,
    as_json: JsonOpt = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the outcome.")] = 120.0,
) -> None:
    cfg = _config(config)
    path = bundle.resolve()
    if not path.is_file():
        _fail(f"{bundle}: no such file", 2)
    try:
        code, doc = _api(cfg, "POST", "/v1/ota/install", {"path": str(path)}, timeout=timeout)
    except _AgentDown as exc:
        _fail(str(exc), 3)
    _outcome(code, doc, as_json)


@ota_app.command(
    "rollback",
    help="Ask the running agent through its health API (\\[api] in the config) to abort a "
    "probation or to bring back the previous committed version of KIND. Exits 3 when the "
    "agent is not running.",
)
def rollback(
    config: ConfigOpt = DEFAULT_CONFIG,
    kind: Annotated[str, typer.Option(help="model, config or agent.")] = "model",
    as_json: JsonOpt = False,
) -> None:
    cfg = _config(config)
    try:
        code, doc = _api(cfg, "POST", "/v1/ota/rollback", {"kind": kind}, timeout=30.0)
    except _AgentDown as exc:
        _fail(str(exc), 3)
    _outcome(code, doc, as_json)
