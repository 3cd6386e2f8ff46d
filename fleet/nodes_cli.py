"""``fleet nodes``: the ``fleet serve`` nodes on the store, which one leads the rollouts, and
what each ingests (see :mod:`fleet.leader`).

Exit codes as the rest of ``fleet``: 0 ok, 3 store failure.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from datetime import UTC, datetime

import typer
from rich.table import Table

from fleet.cli_common import JsonOpt, StoreOpt, open_cli_store, out
from fleet.leader import GONE_AFTER_S

nodes_app = typer.Typer(
    help="The fleet serve nodes on the store and the one that leads the rollouts.",
    no_args_is_help=True,
)


@nodes_app.command("list")
def list_cmd(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Every node that recorded itself: host and pid, since when, last seen (a node unseen
    for 10 s is gone: killed, or cut off), the leader and its epoch, ingest figures."""
    st = open_cli_store(store)
    try:
        nodes = st.nodes()
    finally:
        st.close()
    now = time.time_ns()
    if as_json:
        rows = [{**asdict(n), "alive": now - n.seen_ns <= GONE_AFTER_S * 1e9} for n in nodes]
        print(json.dumps(rows, separators=(",", ":")))
        return
    table = Table("node", "host", "pid", "started (UTC)", "last seen", "leads", "stored", "msg/s")
    for n in nodes:
        ago = (now - n.seen_ns) / 1e9
        seen = f"{ago:.0f} s ago" + ("" if ago <= GONE_AFTER_S else " (gone)")
        started = datetime.fromtimestamp(n.started_ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            n.node, n.host, str(n.pid), started, seen,
            f"yes (epoch {n.epoch})" if n.leader else "",
            str(n.stats.get("stored", "-")), str(n.stats.get("stored_per_s", "-")),
        )  # fmt: skip
    out.print(table)


__all__ = ["nodes_app"]
