"""A device-host process of the chaos benchmark: several simulated devices, each a real
agent :class:`~edge_agent.uplink.publisher.Uplink` (its SQLite outbox in the device's own
state folder, QoS 1, mutual TLS, births with the seq watermark, epitaphs for earlier boots).

``python -m bench.chaos_devices --spec FILE.json --host I``

The spec (written by ``bench.chaos``) names the broker, the TLS folder, the site, the
state root, the devices of each host and the decision rate per device. Each device
produces one decision every ``1 / rate`` s (phases spread over the period) until SIGUSR1,
then only drains; SIGTERM stops every uplink cleanly (a clean ``offline`` with the
watermark) and exits.

On stdout, one JSON object per line:

- ``{"event": "boots", "device": D, "boots": [[boot_id, numbered], ...]}`` for each
  device at start, read from its outbox's ``boots`` table BEFORE the uplink starts a new
  boot: how many seqs each earlier boot numbered, committed with its rows. After a SIGKILL
  that is the only exact record of what the killed boot created (the outbox keeps it until
  the fleet has the boot's epitaph; it was read here at the restart before that).
- ``{"event": "stats", "host": I, "producing": bool, "devices": {D: [boot_id, next_seq,
  outbox_rows, connected]}}`` every 0.5 s.
- ``{"event": "stopped", "host": I, "devices": {...}}`` after a clean stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from edge_agent.uplink.config import TlsSection, UplinkSection
from edge_agent.uplink.publisher import Uplink
from tests.support.uplink_device_proc import MODEL_SHA, make_decision

STATS_S = 0.5


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def earlier_boots(outbox: Path) -> list[list[Any]]:
    """``[boot_id, numbered]`` of every boot the outbox at ``outbox`` still records (none if
    it does not exist yet). Read-only, before the uplink opens it."""
    if not outbox.exists():
        return []
    db = sqlite3.connect(f"file:{outbox}?mode=ro", uri=True, timeout=5)
    try:
        rows = db.execute("SELECT boot_id, next_seq FROM boots ORDER BY started_ns").fetchall()
    except sqlite3.OperationalError:
        return []  # created but never got its schema: nothing numbered
    finally:
        db.close()
    return [[str(b), int(n)] for b, n in rows]


def section(spec: dict[str, Any], device: str) -> UplinkSection:
    tls_dir = Path(spec["tls_dir"]) / device
    return UplinkSection(
        enabled=True,
        host="127.0.0.1",
        port=int(spec["port"]),
        keepalive_s=10,
        tls=TlsSection(
            ca_file=str(tls_dir / "ca.crt"),
            cert_file=str(tls_dir / f"{device}.crt"),
            key_file=str(tls_dir / f"{device}.key"),
        ),
        reconnect_max_ms=int(spec.get("reconnect_max_ms", 5000)),
    )


def _snapshot(ups: dict[str, Uplink]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for name, up in ups.items():
        s = up.stats()
        out[name] = [s["boot_id"], s["next_seq"], s["outbox_rows"], s["connected"]]
    return out


async def _main(spec: dict[str, Any], host: int) -> None:
    names: list[str] = spec["hosts"][host]
    root = Path(spec["state_root"])
    ups: dict[str, Uplink] = {}
    for name in names:
        sec = section(spec, name)
        state = root / name
        state.mkdir(parents=True, exist_ok=True)
        _emit({"event": "boots", "device": name, "boots": earlier_boots(sec.resolve_outbox(state))})
        ups[name] = Uplink(
            sec,
            site=spec["site"],
            device=name,
            device_type="press",
            agent_version="0.1.0",
            state_dir=state,
            model_sha256=lambda: MODEL_SHA,
        )
    tasks = [asyncio.create_task(up.run(), name=f"uplink-{n}") for n, up in ups.items()]
    loop = asyncio.get_running_loop()
    stop, quiet = asyncio.Event(), asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, quiet.set)
    period = 1.0 / float(spec["rate"])
    t0 = time.monotonic()
    # Device k's n-th decision is due at t0 + (k / len + n) * period: spread, not in bursts.
    due = [t0 + period * k / len(names) for k in range(len(names))]
    counters = dict.fromkeys(names, 0)
    next_stats = t0
    while not stop.is_set():
        now = time.monotonic()
        if not quiet.is_set():
            for k, name in enumerate(names):
                while due[k] <= now:
                    ups[name].publish_decision(make_decision(counters[name]))
                    counters[name] += 1
                    due[k] += period
        if now >= next_stats:
            _emit({"event": "stats", "host": host, "producing": not quiet.is_set(),
                   "devices": _snapshot(ups)})  # fmt: skip
            next_stats = now + STATS_S
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), min(0.05, period / 2))
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    _emit({"event": "stopped", "host": host, "devices": _snapshot(ups)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True)
    p.add_argument("--host", type=int, required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    spec = json.loads(Path(args.spec).read_text())
    asyncio.run(_main(spec, args.host))


if __name__ == "__main__":
    main()
