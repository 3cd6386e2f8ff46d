"""The fleet past one machine: N devices, 1-3 ``fleet serve`` nodes on one PostgreSQL.

``python -m bench.fleet_scale [--quick] [--json] [--devices N] [--seconds S] [--rate R]``

Real peers only: a Mosquitto on a free port, the PostgreSQL of ``--pg`` (default
``EDGEFLEET_TEST_PG_URL``, else ``postgresql://postgres@127.0.0.1:5432/test``) in a schema of
its own, dropped at the end. N devices are real MQTT connections (one paho client each,
spread over device-host processes of 1,000, :mod:`bench.fleet_scale_peers`), each publishing
R telemetry messages a second in every phase of S seconds:

1. **bare**: as many plain paho subscribers as the largest node count, on a shared
   subscription of their own: the rate a subscriber that only counts takes in;
2. **1, 2, 3 nodes**: ``fleet serve`` processes (node ids ``n1``..) added one per phase on
   the ingest's shared subscription; each phase's rate is the devices' acked messages over
   the time until all of them were stored;
3. in the last phase, a rollout of a model bundle to 100 more devices (real agents:
   :class:`~edge_agent.fleetsim.SimAgent`, site ``rollout``) in three waves; once a tenth of
   them committed, the leading node is killed (SIGKILL, its whole process group),
   ``leader_takeover_s`` runs until another node holds the lead, and the killed node is
   started again (as systemd would). Every ``cmd/ota`` offer is counted by a subscriber:
   ``double_offers`` is the offers a device got beyond its attempts in the rollout's record.
4. **queries**: ``history_hours`` of history at one message per 10 s for every device is
   written into the store; then the CLI's and console's reads are timed: a device's last
   hour, the first page of devices (latest per device), a device's gaps; and once, the
   gaps of the whole fleet (``gaps_fleet_ms``, with the ranges found in
   ``gaps_fleet_found``: one per device, its first messages, which went to the bare
   phase's subscribers and not to the store; more would be loss).

Keys (JSON, last line): devices, nodes, msgs_per_s, msgs_stored, msgs_expected, lost,
duplicate_rows, ingest_vs_bare, leader_takeover_s, double_offers, query_p99_ms,
fleet_cpu_pct, rss_mb_per_node, with per-phase figures in ``phases`` and what limited the
run in ``notes``. ``--quick``: 2,000 devices, 20 s phases, 2 h of history; full: 10,000
devices, 60 s phases, 24 h of history. The load average before the run is in ``load1``:
these 2-core VMs are noisy, and a run with another job beside it says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from bench.fleet_devices import FD_MARGIN, _raise_nofile
from bench.fleet_scale_run import (
    Nodes,
    OfferCounter,
    Peer,
    broker_rss_mb,
    engines_cpu_s,
    ready_probe,
    stored_count,
)
from fleet.rollout import machine as m
from fleet.rollout.orchestrator import create_rollout, load
from fleet.store import open_store
from fleet.store.console_sql import DeviceFilter
from tests.support.mosquitto import Mosquitto
from tests.support.ota import Signer, model_members
from tests.support.pg import private_schema

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
PER_HOST = 1000
ROLLOUT_DEVICES = 100
HISTORY_PERIOD_S = 10
QUERY_SAMPLES = 300
STORE_WAIT_S = 90.0


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _phase(
    hosts: list[Peer], counted: Callable[[], int], seconds: float, before: int,
    nodes: Nodes | None,
) -> dict[str, Any]:  # fmt: skip
    """Every device host publishes for ``seconds``; returns the phase's figures once every
    acked message is stored (or ``STORE_WAIT_S`` passed). The counts are cumulative over
    the run, the stored one in the same terms as the acked one (``counted``)."""
    cpu0 = nodes.cpu_s() if nodes else 0.0
    engines0 = engines_cpu_s(nodes.broker) if nodes else {}
    t_go = time.monotonic()
    for h in hosts:
        h.send(f"run {seconds}")
    replies = [h.read(seconds + 120) for h in hosts]
    acked = sum(r["acked"] for r in replies)
    phase_acked = acked - before
    out: dict[str, Any] = {
        "acked": phase_acked,
        "lag_max_s": max(r["lag_max_s"] for r in replies),
        "connected": sum(r["connected"] for r in replies),
    }
    if nodes is None:
        return {**out, "t_go": t_go, "acked_total": acked}
    deadline = time.monotonic() + STORE_WAIT_S
    stored = counted()
    while stored < acked and time.monotonic() < deadline:
        time.sleep(0.1)
        stored = counted()
    took = time.monotonic() - t_go
    cpu = nodes.cpu_s() - cpu0
    engines = engines_cpu_s(nodes.broker)
    out.update(
        acked_total=acked,
        stored_total=stored,
        msgs_per_s=round(phase_acked / took, 1),
        fleet_cpu_pct=round(100 * cpu / took, 1),
        rss_mb_per_node=nodes.rss_mb(),
        broker_cpu_pct=round(100 * (engines["broker"] - engines0["broker"]) / took, 1),
        postgres_cpu_pct=round(100 * (engines["postgres"] - engines0["postgres"]) / took, 1),
        broker_rss_mb=broker_rss_mb(nodes.broker),
    )
    return out


def _bare(hosts: list[Peer], port: int, count: int, seconds: float) -> dict[str, Any]:
    subs = [
        Peer(["bare", "--port", str(port), "--group", "bare", "--index", str(i)], f"bare-{i}")
        for i in range(count)
    ]
    try:
        for s in subs:
            s.read(30)
        wall0 = time.time()
        phase = _phase(hosts, lambda: 0, seconds, 0, None)
        time.sleep(2.0)
        counts = []
        for s in subs:
            s.send("count")
            counts.append(s.read(10))
        received = sum(c["received"] for c in counts)
        last = max(c["last_s"] for c in counts)
        took = max(last - wall0, 1e-6)
        return {
            "subscribers": count,
            "acked": phase["acked"],
            "received": received,
            "msgs_per_s": round(received / took, 1),
            "acked_total": phase["acked_total"],
        }
    finally:
        for s in subs:
            s.close()


def _rollout(
    work: Path, url: str, port: int, nodes: Nodes, hosts: list[Peer], seconds: float,
    before: int,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """The last phase with a rollout to the agents and the leader killed halfway."""
    signer = Signer()
    root = signer.write_root(work / "root.json")
    members, new_sha = model_members(work, "v2")
    # Probation: 5 windows in 5 s where the agents make 25. The hundred agents share one
    # process, which a loaded 2-core VM can stall for over a second: with 2 s (10 windows)
    # such a stall halted the rollout before the leader could be killed (twice on
    # 2026-12-06), and the kill is what this phase measures.
    bundle = signer.bundle(work / "v2.efb", members, probation={"seconds": 5, "min_windows": 5})
    agents = Peer(
        ["agents", "--port", str(port), "--count", str(ROLLOUT_DEVICES), "--root", str(root),
         "--state", str(work / "agents")],
        "agents",
    )  # fmt: skip
    offers = OfferCounter(port)
    store = open_store(url)
    out: dict[str, Any] = {}
    try:
        agents.read(120)
        deadline = time.monotonic() + 180
        while sum(d.online for d in store.devices() if d.site == "rollout") < ROLLOUT_DEVICES:
            if time.monotonic() > deadline:
                raise RuntimeError("the rollout's agents did not all come online in 180 s")
            time.sleep(0.5)
        (work / "art-create").mkdir()
        r = create_rollout(
            store, bundle, artifacts=work / "art-create", selector={"site": ("rollout",)},
            params=m.Params(waves=(0.1, 0.5, 1.0), min_devices=1, device_timeout_s=180),
        )  # fmt: skip
        t0 = time.monotonic()
        for h in hosts:
            h.send(f"run {seconds}")
        killed: tuple[str, int] | None = None
        takeover: float | None = None
        t_kill = 0.0
        while True:
            doc = {rid: d for rid, _, d in store.rollouts()}[r.id]
            r = load(doc)[0]
            committed = sum(d.state == "committed" for d in r.devices.values())
            if killed is None and committed >= ROLLOUT_DEVICES // 10 and r.state == "running":
                killed = nodes.leader()
                t_kill = time.monotonic()
                nodes.kill(killed[0])
            if killed is not None and takeover is None:
                now = nodes.leader()
                if now[0] != killed[0] and now[1] > killed[1]:
                    takeover = time.monotonic() - t_kill
                    out["new_leader"] = now[0]
                    nodes.start(killed[0])
            if r.state != "running" and takeover is not None:
                break
            if r.state != "running" and killed is None:
                # Halted (or done) before a tenth had committed: there is no kill to time.
                out["error"] = f"rollout {r.state} before the leader was killed"
                break
            if time.monotonic() - t0 > 900:
                out["error"] = f"rollout still {r.state} after 900 s ({committed} committed)"
                break
            time.sleep(0.1)
        out.update(
            state=r.state,
            seconds=round(time.monotonic() - t0, 1),
            committed=sum(d.state == "committed" for d in r.devices.values()),
            killed=killed[0] if killed else None,
            leader_takeover_s=round(takeover, 2) if takeover is not None else None,
        )
        replies = [h.read(seconds + 300) for h in hosts]
        acked = sum(rep["acked"] for rep in replies)
        time.sleep(2.0)
        got = offers.offers()
        attempts = {name: d.attempts for name, d in r.devices.items()}
        out["offers"] = sum(got.values())
        out["attempts"] = sum(attempts.values())
        out["double_offers"] = sum(max(0, got.get(n, 0) - a) for n, a in attempts.items())
        out["unknown_offers"] = sum(v for n, v in got.items() if n not in attempts)
        agents.close()
        out["all_serving_new"] = agents.last.get("serving") == [new_sha]
        phase = {"acked": acked - before, "acked_total": acked}
        return out, phase
    finally:
        offers.close()
        agents.close()
        store.close()


def _history(url: str, names: list[str], hours: float, now_ns: int) -> dict[str, Any]:
    """``hours`` of telemetry at one message per 10 s for every device, ending an hour in
    the past, written straight into the tables (each statement 200 devices), with what
    the ingest keeps beside them: the keys (schema v13) and each boot's run of stored seqs
    (v15)."""
    per = int(hours * 3600 / HISTORY_PERIOD_S)
    t0 = now_ns - int((hours + 1) * 3600e9)
    step = HISTORY_PERIOD_S * 1_000_000_000
    with psycopg.connect(url, autocommit=True) as db:
        body = db.execute(
            "SELECT body FROM messages WHERE kind = 'telemetry' AND device = %s LIMIT 1",
            (names[0],),
        ).fetchone()
        assert body is not None
        keys = db.execute("SELECT to_regclass('message_keys') IS NOT NULL").fetchone()
        runs = db.execute("SELECT to_regclass('seq_runs') IS NOT NULL").fetchone()
        started = time.monotonic()
        for i in range(0, len(names), 200):
            chunk = names[i : i + 200]
            with db.transaction():
                db.execute(
                    "INSERT INTO boots (device, boot_id, first_received_ns, watermark) "
                    "SELECT d, md5(d || 'history'), %s, %s FROM unnest(%s::text[]) d",
                    (t0, per, chunk),
                )
                db.execute(
                    "INSERT INTO messages (device, boot_id, seq, kind, t_ns, received_ns, body) "
                    "SELECT d, md5(d || 'history'), s, 'telemetry', %s + s * %s, %s + s * %s, %s "
                    "FROM unnest(%s::text[]) d, generate_series(0, %s - 1) s",
                    (t0, step, t0, step, body[0], chunk, per),
                )
                if keys and keys[0]:  # schema v13: the keys table beside the partitions
                    db.execute(
                        "INSERT INTO message_keys (device, boot_id, seq, kind, t_ns) "
                        "SELECT d, md5(d || 'history'), s, 'telemetry', %s + s * %s "
                        "FROM unnest(%s::text[]) d, generate_series(0, %s - 1) s",
                        (t0, step, chunk, per),
                    )
                if runs and runs[0]:  # schema v15: the one run an in-order boot leaves
                    db.execute(
                        "INSERT INTO seq_runs (device, boot_id, low, high, high_t) "
                        "SELECT d, md5(d || 'history'), 0, %s - 1, %s + (%s - 1) * %s "
                        "FROM unnest(%s::text[]) d",
                        (per, t0, per, step, chunk),
                    )
        took = time.monotonic() - started
        # A day-old history has been through autovacuum on a real store (PostgreSQL 13+
        # vacuums after inserts): visibility map set, so the key reads are index-only.
        db.execute("VACUUM ANALYZE messages")
        if keys and keys[0]:
            db.execute("VACUUM ANALYZE message_keys")
        rows = db.execute("SELECT count(*) FROM messages").fetchone()
    return {"history_rows": rows[0] if rows else 0, "history_write_s": round(took, 1)}


def _queries(url: str, names: list[str], now_ns: int) -> dict[str, Any]:
    store = open_store(url)
    rng = random.Random(7)
    timings: dict[str, list[float]] = {"last_hour": [], "devices_page": [], "gaps": []}
    try:
        for _ in range(QUERY_SAMPLES):
            dev = rng.choice(names)
            t = time.perf_counter()
            rows = store.telemetry(dev, since_ns=now_ns - 3_600_000_000_000, limit=1000)
            timings["last_hour"].append(time.perf_counter() - t)
            assert rows, dev
            t = time.perf_counter()
            store.devices_page(DeviceFilter(), limit=100)
            timings["devices_page"].append(time.perf_counter() - t)
            t = time.perf_counter()
            store.gaps(dev)
            timings["gaps"].append(time.perf_counter() - t)
        t = time.perf_counter()
        fleet_gaps = store.gaps()  # `fleet gaps` with no --device: the whole fleet, once
        fleet_gaps_s = time.perf_counter() - t
    finally:
        store.close()
    out: dict[str, Any] = {
        "gaps_fleet_ms": round(1000 * fleet_gaps_s, 1),
        "gaps_fleet_found": len(fleet_gaps),
    }
    for k, xs in timings.items():
        out[f"{k}_p50_ms"] = round(1000 * statistics.median(xs), 2)
        out[f"{k}_p99_ms"] = round(1000 * _percentile(xs, 0.99), 2)
    out["query_p99_ms"] = max(out[f"{k}_p99_ms"] for k in timings)
    return out


def run(devices: int, seconds: float, rate: float, node_counts: list[int], hours: float,
        pg: str, say: Any) -> dict[str, Any]:  # fmt: skip
    figures: dict[str, Any] = {
        "devices": devices, "nodes": max(node_counts), "rate": rate, "seconds": seconds,
        "load1": round(os.getloadavg()[0], 2),
    }  # fmt: skip
    nofile = _raise_nofile(devices + ROLLOUT_DEVICES)
    if nofile < devices + ROLLOUT_DEVICES + FD_MARGIN:
        raise RuntimeError(f"RLIMIT_NOFILE is {nofile}: raise the hard limit (ulimit -Hn)")
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp, private_schema(pg) as url:
        work = Path(tmp)
        broker = Mosquitto(work / "broker", extra="max_connections -1\nmax_queued_messages 0\n")
        broker.start()
        hosts: list[Peer] = []
        nodes = Nodes(url, broker, work)
        try:
            say(f"connecting {devices} devices ...")
            for i in range(0, devices, PER_HOST):
                count = min(PER_HOST, devices - i)
                hosts.append(Peer(["devices", "--port", str(broker.port), "--count", str(count),
                                   "--tag", f"d{i // PER_HOST}", "--rate", str(rate)],
                                  f"devices-{i // PER_HOST}"))  # fmt: skip
            hello = [h.read(300) for h in hosts]
            figures["connected"] = sum(x["connected"] for x in hello)
            figures["connect_s"] = max(x["connect_s"] for x in hello)
            if figures["connected"] < devices:
                raise RuntimeError(f"only {figures['connected']} of {devices} devices connected")
            say(f"bare: {max(node_counts)} plain subscribers, {seconds} s ...")
            phases: dict[str, Any] = {"bare": _bare(hosts, broker.port, max(node_counts), seconds)}
            before = phases["bare"]["acked_total"]
            bare_rate = phases["bare"]["msgs_per_s"]

            def counted(base: int = before) -> int:
                return stored_count(url) + base

            for n in node_counts:
                while len(nodes.running) < n:
                    nodes.start(f"n{len(nodes.running) + 1}")
                nodes.wait_alive(n)
                if n == node_counts[0]:
                    ready_probe(broker, url)
                if n == node_counts[-1] and n >= 2:
                    say(f"{n} nodes, rollout to {ROLLOUT_DEVICES} agents, leader killed ...")
                    rollout, p = _rollout(work, url, broker.port, nodes, hosts, seconds, before)
                    figures["rollout"] = rollout
                    p = _drain(p, counted, nodes)
                else:
                    say(f"{n} node(s), {seconds} s ...")
                    p = _phase(hosts, counted, seconds, before, nodes)
                phases[f"nodes_{n}"] = p
                before = p["acked_total"]
            expected = before - phases["bare"]["acked_total"]
            figures["phases"] = phases
            last = phases[f"nodes_{node_counts[-1]}"]
            figures.update(_totals(url, expected, last, bare_rate, phases, node_counts))
            figures["leader_takeover_s"] = figures.get("rollout", {}).get("leader_takeover_s")
            figures["double_offers"] = figures.get("rollout", {}).get("double_offers")
            for h in hosts:
                h.close()
            hosts = []
            nodes.stop_all()
            now_ns = time.time_ns()
            names = _device_names(url)
            say(f"writing {hours} h of history for {len(names)} devices ...")
            figures.update(_history(url, names, hours, now_ns))
            say("timing queries ...")
            figures.update(_queries(url, names, now_ns))
        finally:
            for h in hosts:
                h.close()
            nodes.stop_all()
            broker.stop()
    figures["load1_after"] = round(os.getloadavg()[0], 2)
    return figures


def _drain(p: dict[str, Any], counted: Callable[[], int], nodes: Nodes) -> dict[str, Any]:
    """The rollout phase's store catching up (its rate spans the kill and restart)."""
    deadline = time.monotonic() + STORE_WAIT_S
    stored = counted()
    while stored < p["acked_total"] and time.monotonic() < deadline:
        time.sleep(0.2)
        stored = counted()
    return {**p, "stored_total": stored, "rss_mb_per_node": nodes.rss_mb()}


def _device_names(url: str) -> list[str]:
    with psycopg.connect(url) as db:
        rows = db.execute(
            "SELECT device FROM devices WHERE site = 'bench' AND device <> 'bench-probe' "
            "ORDER BY device"
        ).fetchall()
    return [r[0] for r in rows]


def _totals(url: str, expected: int, last: dict[str, Any], bare_rate: float,
            phases: dict[str, Any], node_counts: list[int]) -> dict[str, Any]:  # fmt: skip
    with psycopg.connect(url) as db:
        row = db.execute(
            "SELECT count(*) FROM messages WHERE kind = 'telemetry' AND device LIKE 'd%%'"
        ).fetchone()
        dup = db.execute(
            "SELECT count(*) FROM (SELECT 1 FROM messages GROUP BY device, boot_id, seq "
            "HAVING count(*) > 1) x"
        ).fetchone()
    stored = row[0] if row else 0
    rates = [phases[f"nodes_{n}"].get("msgs_per_s") for n in node_counts]
    best = max((r for r in rates if r), default=0.0)
    measured = [p for k, p in phases.items() if k.startswith("nodes_") and "fleet_cpu_pct" in p]
    rss = [p["rss_mb_per_node"] for p in phases.values() if "rss_mb_per_node" in p]
    return {
        "msgs_expected": expected,
        "msgs_stored": stored,
        "lost": expected - stored,
        "duplicate_rows": dup[0] if dup else 0,
        "msgs_per_s": best,
        "ingest_vs_bare": round(best / bare_rate, 3) if bare_rate else None,
        "fleet_cpu_pct": max((p["fleet_cpu_pct"] for p in measured), default=None),
        "rss_mb_per_node": max(rss, default=None),
        "last_phase_stored_all": last.get("stored_total", 0) >= last.get("acked_total", 0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fleet_scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="2,000 devices, 20 s phases, 2 h")
    ap.add_argument("--json", action="store_true", help="only the JSON line")
    ap.add_argument("--devices", type=int, help="devices (quick 2,000, full 10,000)")
    ap.add_argument("--seconds", type=float, help="seconds per phase (quick 20, full 60)")
    ap.add_argument("--rate", type=float, default=1.0, help="messages per device per second")
    ap.add_argument("--nodes", default="1,2,3", help="node counts, one phase each")
    ap.add_argument("--hours", type=float, help="history written for the queries (2 / 24)")
    ap.add_argument("--pg", default=os.environ.get("EDGEFLEET_TEST_PG_URL") or DEFAULT_PG)
    args = ap.parse_args(argv)
    devices = args.devices or (2000 if args.quick else 10_000)
    seconds = args.seconds or (20.0 if args.quick else 60.0)
    hours = args.hours or (2.0 if args.quick else 24.0)
    node_counts = sorted({int(x) for x in args.nodes.split(",")})

    def say(text: str) -> None:
        if not args.json:
            print(text, file=sys.stderr, flush=True)

    os.environ.setdefault("EDGEFLEET_LOOP", "asyncio")
    try:
        figures = run(devices, seconds, args.rate, node_counts, hours, args.pg, say)
    except (RuntimeError, OSError, psycopg.Error) as exc:
        print(json.dumps({"devices": devices, "error": str(exc)}))
        return 1
    if not args.json:
        for k, v in figures.items():
            if k not in ("phases", "rollout"):
                print(f"{k:>24}: {v}")
        print(
            json.dumps({"phases": figures["phases"], "rollout": figures.get("rollout")}, indent=1)
        )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
