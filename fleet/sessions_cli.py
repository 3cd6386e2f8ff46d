"""``fleet sessions``: the ingest's MQTT sessions as the store records them, and retiring the
sessions of a node that is gone (any running ``fleet serve`` then drains them).

Exit codes as the rest of ``fleet``: 0 ok, 1 not found / nothing to do, 2 bad usage, 3 store
failure.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.table import Table

from fleet.cli_common import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    JsonOpt,
    StoreOpt,
    fail,
    open_cli_store,
    out,
)

# fleet.ingest.sessions is imported on use: importing fleet.ingest loads paho, which the
# read commands never need.

sessions_app = typer.Typer(
    help="The ingest's MQTT sessions at the broker (fleet serve records and drains them).",
    no_args_is_help=True,
)


def _iso(t_ns: int | None) -> str:
    if t_ns is None:
        return "-"
    return datetime.fromtimestamp(t_ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S")


@sessions_app.command("list")
def list_cmd(
    store: StoreOpt = None,
    show_all: Annotated[
        bool, typer.Option("--all", help="Also the sessions drained and ended.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Every session fleet serve opened and not yet ended: who owns it, its state, when it
    was last seen running and how many messages a drain took from it."""
    from fleet.ingest.sessions import ENDED  # noqa: PLC0415 - see the imports

    st = open_cli_store(store)
    try:
        sessions = [s for s in st.ingest_sessions() if show_all or s.state != ENDED]
    finally:
        st.close()
    if as_json:
        print(json.dumps([asdict(s) for s in sessions], separators=(",", ":")))
        return
    table = Table("client id", "node", "group", "worker", "state", "last seen (UTC)", "drained")
    for s in sessions:
        table.add_row(
            s.client_id, s.node, s.group, "-" if s.index < 0 else str(s.index), s.state,
            _iso(s.last_seen_ns), str(s.drained),
        )  # fmt: skip
    out.print(table)


@sessions_app.command("retire")
def retire_cmd(
    node: Annotated[str, typer.Argument(help="The node (host name) whose fleet serve is gone.")],
    store: StoreOpt = None,
    force: Annotated[
        bool, typer.Option("--force", help="Even if its sessions were seen running lately.")
    ] = False,
) -> None:
    """Hand the sessions of NODE (a fleet serve that will not come back) to the others: each
    running fleet serve looks for such sessions every 10 s and drains them into the store."""
    from fleet.ingest.sessions import ALIVE_WITHIN_NS, HEARTBEAT_S, retire  # noqa: PLC0415

    st = open_cli_store(store)
    try:
        to_orphan, lately = retire(st.ingest_sessions(), node, time.time_ns(), force=force)
        if lately and not force:
            names = ", ".join(s.client_id for s in lately)
            fail(
                f"node {node!r}: {names} seen running within {ALIVE_WITHIN_NS // 10**9} s: stop "
                "its fleet serve first (or --force)",
                EXIT_USAGE,
            )
        if not to_orphan:
            fail(f"node {node!r} has no session to retire", EXIT_NOT_FOUND)
        written = st.save_ingest_sessions(to_orphan)
    finally:
        st.close()
    out.print(
        f"node {node}: {written} session(s) retired; a running fleet serve drains them within "
        f"{HEARTBEAT_S:.0f} s (see fleet sessions list)",
        markup=False,
    )
