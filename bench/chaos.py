"""Chaos benchmark: the whole uplink path under a seeded schedule of crashes, on SQLite and on
PostgreSQL, and an account of every message.

``python -m bench.chaos [--quick] [--json] [--seed N] [--stores sqlite,postgresql]
[--kinds K,...] [--autosave-s S] [--gap-grace S]``

(The processes are in ``bench.chaos_procs``, the schedule and the accounting in
``bench.chaos_plan``, the devices in ``bench.chaos_devices``.)

For each store, from scratch:

* a real Mosquitto (started by the bench on a free port) running exactly the config ``fleet
  broker-config`` writes (mutual TLS, the per-device ACL, persistence, queues sized by
  ``fleet.broker_sizing`` for this fleet: N devices x the decision rate x 30 min, and its
  default ``autosave_interval``, 60 s, unless ``--autosave-s``);
* ``fleet serve --workers 2`` as a process (its worker processes under it), over mutual TLS
  as the fleet identity, into SQLite or a private PostgreSQL schema (``tests.support.pg``);
* N devices, each the real agent uplink (``bench.chaos_devices``: the SQLite outbox, QoS 1,
  births and epitaphs), in a few device-host processes, each device one decision every
  ``1 / rate`` s;
* a seeded schedule (``bench.chaos_plan.schedule``, one fault every ~20 s, each kind at
  least once) that SIGKILLs the broker (started again after 1-5 s, from its persistence
  file), one ingest worker process (``fleet serve`` starts it again), ``fleet serve`` as a
  whole (process group; started again after 1-5 s), a device-host process (started again
  after 1-4 s: each of its devices a new boot on the same outbox), and changes the worker
  count (SIGTERM, then ``fleet serve --workers 1|2|3``).

Then the devices stop producing and drain (every outbox empty: each message confirmed stored
by the fleet, ``cmd/stored``, or only acked by the broker before a device first heard from
the fleet), the bench waits for the store to hold them (or to stop growing for 60 s: the rest
is lost) and for the ingest's gap audit to have
seen the last of them (``--gap-grace`` + two checks), stops the devices cleanly (a clean
``offline`` with the watermark) and ``fleet serve``, and counts (definitions in
``bench.chaos_plan``): ``sent``, ``stored``, ``lost``, ``duplicate_rows``, ``conflicts``
(quarantined with reason ``conflict``), ``gaps_reported`` (``ingest_gaps`` rows logged
while running plus ``fleet gaps`` at the end), ``false_gaps``, ``max_recovery_s``.

The JSON object on the last stdout line has those keys summed over the stores (``faults``
by kind, ``max_recovery_s`` the largest) and each store's own under ``stores``.
Quick: 50 devices, 180 s per store, both stores; full: 500 devices, 900 s per store.
Target: ``lost == 0``, ``duplicate_rows == 0``, ``false_gaps == 0``, every fault kind
exercised. Exit code 0 when met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import signal
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psycopg

from bench.chaos_plan import (
    BROKER_KILL,
    DEVICE_KILL,
    FAULT_KINDS,
    OUTAGE_BROKER_KILL,
    SERVE_KILL,
    START_WORKERS,
    WORKER_KILL,
    WORKERS_CHANGE,
    Fault,
    GapRange,
    Injected,
    Tally,
    kinds_of,
    recovery_s,
    schedule,
    tally,
    worst,
)
from bench.chaos_procs import FLEET_ID, GAP_CHECK_S, Hosts, Ledger, Serve
from fleet import pki
from fleet.broker_config import write_broker_config
from fleet.broker_sizing import Sizing
from fleet.store import open_store
from tests.support.mosquitto import Mosquitto
from tests.support.pg import private_schema
from tests.support.ports import free_port

SITE = "chaos"
PG_DEFAULT = "postgresql://postgres@127.0.0.1:5432/test"
DEVICES_PER_HOST = 100
GAP_GRACE_S = 30.0
DATA_KINDS = ("telemetry", "decision", "ota/status")


def say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, flush=True)


# --- the fleet around the run --------------------------------------------------------------


def issue_certs(ca_dir: Path, tls: Path, devices: list[str]) -> None:
    pki.init_ca(ca_dir)
    for name in devices:
        pki.issue(ca_dir, name, tls / name, site=SITE)
    pki.issue(ca_dir, FLEET_ID, tls / FLEET_ID, kind="service")


def broker_for(ca_dir: Path, workdir: Path, sizing: Sizing) -> Mosquitto:
    """A broker running the config ``fleet broker-config`` writes into ``workdir``."""
    port = free_port()
    files = write_broker_config(
        ca_dir,
        workdir,
        port=port,
        fleet_identity=FLEET_ID,
        hosts=["127.0.0.1"],
        log_file=workdir / "mosquitto.log",
        run_as=pwd.getpwuid(os.getuid()).pw_name,
        sizing=sizing,
    )
    return Mosquitto(workdir, port=port, config=files.conf.read_text())


@contextlib.contextmanager
def store_url(kind: str, tmp: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite://{tmp / 'fleet.db'}"
    else:
        with private_schema(os.environ.get("EDGEFLEET_TEST_PG_URL", PG_DEFAULT)) as url:
            yield url


def _query(url: str, sql: str) -> list[tuple[Any, ...]]:
    """Rows of one read-only query on the store at ``url`` (its own connection)."""
    if url.startswith("sqlite://"):
        db = sqlite3.connect(f"file:{url.removeprefix('sqlite://')}?mode=ro", uri=True, timeout=30)
        try:
            return list(db.execute(sql).fetchall())
        finally:
            db.close()
    with psycopg.connect(url) as pg:
        return list(pg.execute(sql.encode()).fetchall())


def _kinds_sql() -> str:
    return ", ".join(f"'{k}'" for k in DATA_KINDS)


def stored_count(url: str) -> int:
    try:
        rows = _query(url, f"SELECT COUNT(*) FROM messages WHERE kind IN ({_kinds_sql()})")
    except (sqlite3.Error, psycopg.Error):
        return 0  # not created yet
    return int(rows[0][0])


def wait_for(pred: Any, timeout: float, step: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


#: Once every outbox is empty, the store must grow within this long or the rest is lost.
STALL_S = 60.0


def settle(url: str, sent: int, timeout: float) -> bool:
    """Wait until the store holds ``sent`` messages (True), or has not grown for
    ``STALL_S`` (the devices have nothing left to send: what is missing is lost), or
    ``timeout``."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = stored_count(url)
        if n >= sent:
            return True
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since > STALL_S:
            return False
        time.sleep(2.0)
    return False


# --- one store's run -----------------------------------------------------------------------


def inject(
    fault: Fault,
    state: dict[str, Any],
    broker: Mosquitto,
    hosts: Hosts,
    start_serve: Any,
) -> Injected:
    """Apply ``fault``; what was killed is started again before this returns."""
    serve: Serve = state["serve"]
    t_ns = time.time_ns()
    touched: frozenset[str] | None = None
    if fault.kind == BROKER_KILL:
        broker.kill()
        time.sleep(fault.down_s)
        broker.start()
    elif fault.kind == WORKER_KILL:
        pids = serve.worker_pids()
        if pids:
            pid = pids[fault.target % len(pids)]
            t_ns = time.time_ns()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    elif fault.kind == SERVE_KILL:
        serve.kill_all()
        time.sleep(fault.down_s)
        state["serve"] = start_serve(serve.workers)
    elif fault.kind == DEVICE_KILL:
        i = fault.target % len(hosts.procs)
        touched = frozenset(hosts.names[i])
        hosts.kill(i)
        time.sleep(fault.down_s)
        hosts.start(i)
    elif fault.kind == WORKERS_CHANGE:
        serve.stop()
        state["serve"] = start_serve(fault.target)
    elif fault.kind == OUTAGE_BROKER_KILL:
        serve.kill_all()
        time.sleep(fault.down_s)  # the broker queues (and acks) for the ingest's sessions
        broker.kill()
        time.sleep(1.0)
        broker.start()
        state["serve"] = start_serve(serve.workers)
    return Injected(fault.kind, t_ns, touched)


def run_store(kind: str, args: argparse.Namespace, ca_dir: Path, tls: Path, devices: list[str],
              tmp: Path, quiet: bool) -> dict[str, Any]:  # fmt: skip
    work = tmp / kind
    work.mkdir()
    sizing = Sizing(
        devices=len(devices),
        msgs_per_min=args.rate * 60,
        outage_min=30,
        msg_bytes=1000,  # the bench's decisions are ~800 B
        **({"autosave_s": args.autosave_s} if args.autosave_s else {}),
    )
    broker = broker_for(ca_dir, work / "broker", sizing)
    # A few hosts (at least 2, so a host kill leaves devices running), up to 100 devices each.
    per = min(len(devices), max(2, -(-len(devices) // DEVICES_PER_HOST)))
    names = [devices[i::per] for i in range(per)]
    spec = work / "spec.json"
    spec.write_text(json.dumps({"port": broker.port, "tls_dir": str(tls), "site": SITE,
                                "state_root": str(work / "devices"), "hosts": names,
                                "rate": args.rate}))  # fmt: skip
    plan = schedule(args.seed, args.duration, hosts=per, every_s=args.every,
                    settle_s=min(15.0, args.duration / 6), kinds=args.kinds)  # fmt: skip
    ledger = Ledger()
    serve_log = (work / "serve.log").open("a")
    hosts_log = (work / "devices.log").open("a")
    hosts = Hosts(spec, names, ledger, hosts_log)
    injected: list[Injected] = []
    started = time.monotonic()
    with store_url(kind, work) as url:
        open_store(url).close()  # migrated before the first worker starts
        state: dict[str, Any] = {}

        def start_serve(workers: int) -> Serve:
            return Serve(url, broker, tls, workers, serve_log, args.gap_grace)

        broker.start()
        try:
            state["serve"] = start_serve(START_WORKERS)
            for i in range(per):
                hosts.start(i)
            t0 = time.monotonic()
            say(quiet, f"{kind}: {len(devices)} devices in {per} host(s), {len(plan)} faults "
                       f"over {args.duration:.0f} s, broker :{broker.port}")  # fmt: skip
            for fault in plan:
                time.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
                injected.append(inject(fault, state, broker, hosts, start_serve))
                say(quiet, f"  {time.monotonic() - t0:6.1f} s {fault.kind} "
                           f"target={fault.target} down={fault.down_s} s; stored "
                           f"{stored_count(url):,} of {ledger.sent():,} numbered")  # fmt: skip
            time.sleep(max(0.0, t0 + args.duration - time.monotonic()))
            hosts.signal_all(signal.SIGUSR1)  # stop producing; drain
            t_quiet = time.monotonic()
            drained = wait_for(
                lambda: (
                    ledger.drained(devices)
                    and all(ledger.reported.get(i, 0) > t_quiet + 1 for i in range(per))
                ),
                args.drain_timeout,
            )
            sent = ledger.sent()
            complete = settle(url, sent, args.drain_timeout)
            say(quiet, f"  drained: outboxes empty {drained}, store complete {complete} "
                       f"({time.monotonic() - t_quiet:.0f} s)")  # fmt: skip
            # The ingest's gap audit covers messages received up to now - grace: let it see
            # the last ones before it stops.
            time.sleep(args.gap_grace + 2 * GAP_CHECK_S)
            hosts.stop_all()
            time.sleep(3)  # the clean offlines (watermarks) reach the store
            code = state["serve"].stop()
            if code != 0:
                say(quiet, f"  fleet serve exited {code} at the end (log: {work / 'serve.log'})")
        finally:
            hosts.stop_all()
            if "serve" in state:
                state["serve"].kill_all()
            broker.stop()
            serve_log.close()
            hosts_log.close()
        result = account(url, ledger, injected, len(devices))
    result["faults"] = kinds_of(plan, args.kinds)
    result["drained"] = drained
    result["seconds"] = round(time.monotonic() - started, 1)
    result["broker_dropped_lines"] = broker.log().count("Outgoing messages are being dropped")
    return result


def account(url: str, ledger: Ledger, injected: list[Injected], devices: int) -> dict[str, Any]:
    rows = _query(
        url,
        f"SELECT device, boot_id, seq, t_ns, received_ns FROM messages "
        f"WHERE kind IN ({_kinds_sql()})",
    )
    logged = [GapRange(*r) for r in _query(url, "SELECT device, boot_id, first_missing, "
                                                "last_missing FROM ingest_gaps")]  # fmt: skip
    store = open_store(url)
    try:
        final = [GapRange(g.device, g.boot_id, g.first_missing, g.last_missing)
                 for g in store.gaps()]  # fmt: skip
    finally:
        store.close()
    conflicts = int(
        _query(url, "SELECT COUNT(*) FROM quarantine WHERE reason LIKE 'conflict%'")[0][0]
    )
    quarantined = int(_query(url, "SELECT COUNT(*) FROM quarantine")[0][0])
    with ledger.lock:
        numbered = dict(ledger.numbered)
    t: Tally = tally(numbered, [(r[0], r[1], int(r[2])) for r in rows], [*logged, *final],
                     devices=devices)  # fmt: skip
    arrivals: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        arrivals.setdefault(r[0], []).append((int(r[3]), int(r[4])))
    recoveries = recovery_s(injected, arrivals)
    by_kind: dict[str, float | None] = {}
    for f, took in zip(injected, recoveries, strict=True):
        prev = by_kind.get(f.kind, 0.0)
        by_kind[f.kind] = None if took is None or prev is None else max(prev, took)
    out = asdict(t)
    out.update(
        conflicts=conflicts,
        quarantined=quarantined,
        gaps_logged=len(logged),
        gaps_at_end=len(final),
        max_recovery_s=_round(worst(recoveries)),
        recovery_s_by_kind={k: _round(v) for k, v in by_kind.items()},
        boots=len(numbered),
    )
    return out


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


# --- the whole run -------------------------------------------------------------------------

SUMMED = ("sent", "stored", "lost", "duplicate_rows", "conflicts", "gaps_reported", "false_gaps")


def combine(devices: int, per_store: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The summary over the stores (see the module docstring)."""
    faults = dict.fromkeys(FAULT_KINDS, 0)
    for r in per_store.values():
        for k, n in r["faults"].items():
            faults[k] = faults.get(k, 0) + n
    out: dict[str, Any] = {"devices": devices, "faults": faults}
    for key in SUMMED:
        out[key] = sum(int(r[key]) for r in per_store.values())
    out["max_recovery_s"] = worst(r["max_recovery_s"] for r in per_store.values())
    out["target_met"] = (
        out["lost"] == 0
        and out["duplicate_rows"] == 0
        and out["false_gaps"] == 0
        and all(n > 0 for r in per_store.values() for n in r["faults"].values())
    )
    out["stores"] = per_store
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="50 devices, 180 s per store")
    p.add_argument("--json", action="store_true", help="only the JSON summary line on stdout")
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--devices", type=int, help="devices (default: 50 quick, 500 full)")
    p.add_argument("--duration", type=float, help="chaos seconds per store (180 / 900)")
    p.add_argument("--every", type=float, default=20.0, help="mean seconds between faults")
    p.add_argument("--rate", type=float, default=1.0, help="decisions per device per second")
    p.add_argument("--stores", default="sqlite,postgresql")
    p.add_argument("--autosave-s", type=int, default=0,
                   help="the broker's autosave_interval (default: broker-config's)")  # fmt: skip
    p.add_argument("--gap-grace", type=float, default=GAP_GRACE_S,
                   help="fleet serve --gap-grace (its default)")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=600.0)
    p.add_argument("--kinds", default=",".join(FAULT_KINDS),
                   help=f"fault kinds to draw from (also {OUTAGE_BROKER_KILL}, opt-in: see "
                        "bench.chaos_plan)")  # fmt: skip
    args = p.parse_args(argv)
    args.kinds = tuple(k for k in args.kinds.split(",") if k)
    for k in args.kinds:
        if k not in (*FAULT_KINDS, OUTAGE_BROKER_KILL):
            p.error(f"--kinds: unknown fault kind {k!r}")
    args.devices = args.devices or (50 if args.quick else 500)
    args.duration = args.duration or (180.0 if args.quick else 900.0)
    args.stores = [s for s in args.stores.split(",") if s]
    for s in args.stores:
        if s not in ("sqlite", "postgresql"):
            p.error(f"--stores: unknown store {s!r} (sqlite, postgresql)")
    return args


def run(args: argparse.Namespace, quiet: bool) -> dict[str, Any]:
    """Every store's run and the summary (the JSON object ``main`` prints)."""
    n = args.devices
    devices = [f"dev-{i:04d}" for i in range(n)]
    per_store: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp_name:
        tmp = Path(tmp_name)
        t = time.monotonic()
        issue_certs(tmp / "ca", tmp / "tls", devices)
        say(quiet, f"certificates for {n} devices: {time.monotonic() - t:.1f} s")
        for kind in args.stores:
            r = run_store(kind, args, tmp / "ca", tmp / "tls", devices, tmp, quiet)
            per_store[kind] = r
            say(quiet, f"{kind}: sent {r['sent']:,} stored {r['stored']:,} lost {r['lost']} "
                       f"duplicate_rows {r['duplicate_rows']} conflicts {r['conflicts']} gaps "
                       f"{r['gaps_reported']} (false {r['false_gaps']}) max_recovery "
                       f"{r['max_recovery_s']} s {r['recovery_s_by_kind']}")  # fmt: skip
            if r["lost_examples"] or r["false_examples"]:
                say(quiet, f"  lost e.g. {r['lost_examples']}; false gaps e.g. "
                           f"{r['false_examples']}")  # fmt: skip
    summary = combine(n, per_store)
    summary.update(seed=args.seed, duration_s=args.duration, rate_per_device=args.rate,
                   autosave_s=args.autosave_s or Sizing().autosave_s, quick=args.quick,
                   gap_grace_s=args.gap_grace)  # fmt: skip
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # SIGTERM (or SIGINT, which a shell's background job ignores) ends the run through the
    # cleanup: the broker, fleet serve and the device hosts are stopped, not left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    summary = run(args, quiet=bool(args.json))
    print(json.dumps(summary), flush=True)
    return 0 if summary["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
