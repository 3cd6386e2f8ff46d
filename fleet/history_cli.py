"""``fleet history``: how much history the store holds back, and cutting it to a retention
(the same rule ``fleet serve --retention`` applies every 10 minutes; see
:mod:`fleet.retention`). Exit codes as the rest of ``fleet``: 0 ok, 2 usage, 3 store failure.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from fleet.changes import Changes
from fleet.cli_common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    JsonOpt,
    StoreOpt,
    cli_principal,
    fail,
    open_cli_store,
    out,
)
from fleet.errors import FleetError, RetentionError
from fleet.retention import KINDS, describe, parse_retention

history_app = typer.Typer(help="The store's history and its retention.", no_args_is_help=True)

RetentionOpt = Annotated[
    str,
    typer.Option(
        "--retention",
        help="KIND=AGE pairs, e.g. telemetry=30d,decisions=180d (kinds: "
        f"{', '.join(KINDS)}; ages in d or h).",
    ),
]


@history_app.command("expire")
def expire_cmd(retention: RetentionOpt, store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Delete what is older than --retention says, now (audited). What it removed, fleet
    gaps no longer reports as missing."""
    try:
        keep = parse_retention(retention)
    except RetentionError as exc:
        fail(str(exc), EXIT_USAGE)
    if not keep:
        fail("--retention names no kind: nothing to expire", EXIT_USAGE)
    st = open_cli_store(store)
    try:
        gone = Changes(st, cli_principal()).expire_history(keep)
    except FleetError as exc:
        fail(str(exc), EXIT_FAILURE)
    finally:
        st.close()
    if as_json:
        print(json.dumps({"deleted": gone, "keep_s": keep}, separators=(",", ":")))
        return
    out.print(describe(keep))
    for kind, n in gone.items():
        out.print(f"{kind}: {n} deleted")


__all__ = ["history_app"]
