"""``edge-agent selftest``: the model's known-answer self-test on demand.

Loads the configured model exactly as the agent does at start and runs its golden windows
(:mod:`models.selftest`), on the preferred kernels and then, if those answer wrong, on the
builtin int8 kernels; prints the expected and actual int8 outputs per window.

Exit codes: 0 the model would be served (``kernels`` says on which kernels), 2 it would not
(wrong answers on every kernel set) or a bad config, 1 it cannot be loaded at all.
``--json`` prints one JSON document on stdout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from edge_agent.config import AgentConfig, load_config
from edge_agent.errors import ConfigError
from models.errors import ModelError
from models.known_answers import Verdict
from models.selftest import KnownAnswersFailed, load_checked


def selftest(
    config: Annotated[
        Path, typer.Option("--config", "-c", help="Agent config (TOML).", show_default=True)
    ] = Path("/etc/edge-agent/agent.toml"),
    json_out: Annotated[
        bool, typer.Option("--json", help="One JSON document on stdout instead of lines.")
    ] = False,
) -> None:
    """Run the configured model's known-answer self-test and print expected vs actual."""
    try:
        cfg: AgentConfig = load_config(config)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    rc = cfg.reasoning
    if not rc.enabled:
        typer.echo(f"{config}: reasoning is disabled: no model to test", err=True)
        raise typer.Exit(2)
    where = str(rc.model_dir) if rc.model_dir is not None else "the committed default model"
    try:
        model = load_checked(rc.model_dir, backend=rc.backend, threads=rc.threads, jit=rc.jit)
    except KnownAnswersFailed as exc:
        _report({"model": where, "result": "failed", "reason": str(exc)}, exc.verdicts, json_out)
        raise typer.Exit(2) from None
    except ModelError as exc:
        typer.echo(f"edge-agent selftest: cannot load {where}: {exc}", err=True)
        raise typer.Exit(1) from None
    m = model.manifest
    result = model.selftest
    head: dict[str, Any] = {
        "model": where,
        "name": m.name,
        "version": m.version,
        "sha256": m.sha256,
        **result.status(),
        "reason": result.line(),
    }
    _report(head, result.verdicts, json_out)


def _report(head: dict[str, Any], verdicts: tuple[Verdict, ...], json_out: bool) -> None:
    if json_out:
        typer.echo(json.dumps({**head, "verdicts": [v.to_json() for v in verdicts]}))
        return
    for v in verdicts:
        typer.echo(f"{v.kernels}: {'PASS' if v.passed else 'FAIL'} (tolerance {v.tolerance})")
        for c in v.checks:
            mark = "ok " if c.diff <= v.tolerance else "BAD"
            typer.echo(
                f"  {mark} window {c.index:2d}  expected {_row(c.expected)}  "
                f"actual {_row(c.actual)}  diff {c.diff}"
            )
    line = head["reason"]
    if head["result"] == "failed":
        typer.echo(f"edge-agent selftest: {line}", err=True)
    else:
        typer.echo(line)


def _row(values: tuple[int, ...]) -> str:
    return "[" + " ".join(f"{v:4d}" for v in values) + "]"
