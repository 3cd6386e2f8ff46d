"""Fleet ingest throughput: MQTT -> ingest workers -> SQLite / PostgreSQL, against bare paho.

``python -m bench.fleet_ingest [--quick] [--json]``

A real Mosquitto (``tests.support.mosquitto``) on loopback. For each consumer, a publisher process
floods N valid telemetry messages (QoS 1, 100 device ids, seq gap-free per device) while
the consumer is OFFLINE with a persistent session in the shared group, so the broker queues
them; then the consumer connects and the clock runs from its first message until it has the
last one (for the workers: until the last is stored). That measures what the consumer can
drain, not how fast one Python publisher can publish, and leaves start-up costs out.

* ``bare_msgs_per_s``: a bare paho subscriber (same shared subscriptions, QoS 1, automatic
  acks, the workers' Receive Maximum, no parsing, no store): the ceiling any Python
  consumer on this broker can reach. It is measured before the first worker run and after
  each, on the same broker, and each ``*_vs_bare`` divides by the mean of the two bare runs
  around it (the machine is shared, and its load moves within a minute);
  ``bare_msgs_per_s`` is the median of the bare runs (all in ``bare_runs``);
* ``sqlite_1w`` / ``sqlite_2w``: one ingest worker (in this process) / two worker processes
  (``fleet.ingest.serve``) into one SQLite file, messages per second until all are stored;
* ``pg_1w`` / ``pg_2w``: the same into PostgreSQL (``EDGEFLEET_TEST_PG_URL``, default
  ``postgresql://postgres@127.0.0.1:5432/test``);
* ``lost``: messages published (PUBACKed by the broker) but not stored, over all runs;
  ``duplicates``: messages the workers got more than once (the store kept one copy).

Each consumer's session is ended after its run: all of them subscribe to every device, so a
session left offline would have the broker queue a copy of every later run's messages.
The bench only watches the store for progress (an index range count of this run's devices,
every 0.1 s); in PostgreSQL it works in a schema of its own, dropped after the run, so a
shared database neither grows nor keeps a schema version newer than other checkouts know.

Target: one worker (``sqlite_1w``, ``pg_1w``) >= 80 % of the bare rate; ``lost`` and
``duplicates`` zero.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
import psycopg
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from fleet.ingest import IngestConfig, IngestStats, IngestWorker, serve
from fleet.ingest.sessions import session_id
from fleet.store import open_store
from tests.support.mosquitto import Mosquitto, mosquitto
from tests.support.pg import private_schema
from wire import SignalStats, TelemetryMsg, encode, topic
from wire.topics import shared_subscription

DEVICES = 100
SITE = "bench"
PG_DEFAULT = "postgresql://postgres@127.0.0.1:5432/test"


def _payloads(n: int, tag: str) -> list[tuple[str, bytes]]:
    boots = {d: uuid.uuid4().hex for d in range(DEVICES)}
    out = []
    now = time.time_ns()
    for i in range(n):
        d, seq = i % DEVICES, i // DEVICES  # data seqs start at 0 per boot
        device = f"{tag}-{d:03d}"
        msg = TelemetryMsg(
            device=device,
            boot_id=boots[d],
            seq=seq,
            t_ns=now + i,
            period_ns=1_000_000_000,
            keyframe=seq % 10 == 0,
            signals={f"s{k}": SignalStats(1.0 * k, 0.0, 2.0 * k, 1.5 * k, 100) for k in range(8)},
        )
        out.append((topic(SITE, device, "telemetry"), encode(msg)))
    return out


def _publish(host: str, port: int, n: int, tag: str, done: Any) -> None:
    """Publisher process: N QoS 1 messages, as fast as the broker acks them."""
    messages = _payloads(n, tag)
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=f"bench-pub-{tag}", protocol=mqtt.MQTTv5
    )
    client.max_inflight_messages_set(1000)
    acked = threading.Semaphore(0)
    client.on_publish = lambda *_: acked.release()
    client.connect(host, port)
    client.loop_start()
    t0 = time.monotonic()
    for t, payload in messages:
        client.publish(t, payload, qos=1)
    for _ in range(n):
        if not acked.acquire(timeout=120):
            break
    elapsed = time.monotonic() - t0
    client.disconnect()
    client.loop_stop()
    done.put(elapsed)


def publish(broker: Mosquitto, n: int, tag: str) -> float:
    ctx = multiprocessing.get_context("spawn")
    done: Any = ctx.Queue()
    p = ctx.Process(target=_publish, args=(broker.host, broker.port, n, tag, done))
    p.start()
    elapsed: float = done.get(timeout=600)
    p.join(30)
    return elapsed


def _session_props() -> Properties:
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.SessionExpiryInterval = 3600
    # The workers' flow control: without it Mosquitto would hold the bare subscriber to
    # its max_inflight_messages (100), a different pipeline from the one it is compared to.
    props.ReceiveMaximum = IngestConfig(store_url="").queue_max
    return props


def drop_session(broker: Mosquitto, client_id: str) -> None:
    """End a persistent session at the broker (clean start, expiry 0).

    Every session of this bench subscribes to every device's telemetry, so one left behind
    offline would be sent a copy of each later run's messages: the broker would queue (and
    autosave) ever more for nobody, later runs would be slower than earlier ones, and a bare
    subscriber coming back would first count the backlog of the run before it.
    """
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.SessionExpiryInterval = 0
    connected = threading.Event()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    c.on_connect = lambda *_: connected.set()
    c.connect(broker.host, broker.port, clean_start=True, properties=props)
    c.loop_start()
    if not connected.wait(10):
        raise RuntimeError(f"could not end the session of {client_id}")
    c.disconnect()
    c.loop_stop()


def bare_rate(broker: Mosquitto, n: int) -> float:
    """A paho subscriber that only counts: the drain rate ceiling."""
    got = 0
    first = last = 0.0
    finished = threading.Event()
    subscribed = threading.Event()

    def on_message(client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        nonlocal got, first, last
        got += 1
        now = time.monotonic()
        if got == 1:
            first = now
        last = now
        if got >= n:
            finished.set()

    def make() -> mqtt.Client:
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-bare", protocol=mqtt.MQTTv5)
        c.on_connect = lambda c, *_: c.subscribe([(t, 1) for t in shared_subscription("bare")])
        c.on_subscribe = lambda *_: subscribed.set()
        c.on_message = on_message
        c.connect(broker.host, broker.port, clean_start=False, properties=_session_props())
        return c

    c = make()
    c.loop_start()
    subscribed.wait(10)
    c.disconnect()
    c.loop_stop()
    publish(broker, n, "bare")
    c = make()
    c.loop_start()
    finished.wait(300)
    c.disconnect()
    c.loop_stop()
    drop_session(broker, "bench-bare")
    if got < n:
        raise RuntimeError(f"bare subscriber got {got} of {n}")
    return n / (last - first) if last > first else float("nan")


class _Progress:
    """Rows of one run's devices (``{tag}-NNN``), counted on the primary key's index.

    Not ``Store.counts()``: that scans every table, and polled while the workers write it
    took CPU (and, in PostgreSQL, buffer traffic) from the very thing being measured.
    """

    def __init__(self, url: str, tag: str) -> None:
        self._range = (f"{tag}-", f"{tag}.")  # '.' follows '-': every "{tag}-..." between
        self._pg: psycopg.Connection[tuple[Any, ...]] | None = None
        self._lite: sqlite3.Connection | None = None
        if url.startswith("sqlite:"):
            self._lite = sqlite3.connect(unquote(urlsplit(url).path), timeout=15)
        else:
            self._pg = psycopg.connect(url, autocommit=True)

    def stored(self) -> int:
        if self._lite is not None:
            row = self._lite.execute(
                "SELECT COUNT(*) FROM messages WHERE device >= ? AND device < ?", self._range
            ).fetchone()
        else:
            assert self._pg is not None
            row = self._pg.execute(
                "SELECT COUNT(*) FROM messages WHERE device >= %s AND device < %s", self._range
            ).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        if self._pg is not None:
            self._pg.close()
        if self._lite is not None:
            self._lite.close()


def ingest_rate(
    broker: Mosquitto, url: str, n: int, workers: int, label: str
) -> tuple[float, int, int]:
    """(msgs/s, lost, duplicates) of ``workers`` ingest workers draining N queued messages."""
    group = f"g-{label}"
    config = IngestConfig(
        store_url=url,
        broker_host=broker.host,
        broker_port=broker.port,
        group=group,
        client_id=f"bench-{label}",
    )
    store = open_store(url)
    store.migrate()
    # Create the sessions (and their shared subscriptions) under the names fleet serve gives
    # its workers, then go offline.
    ids = [session_id(config.client_id, group, i) for i in range(workers)]
    for cid in ids:
        w = IngestWorker(replace(config, client_id=cid, migrate=False))
        w.start()
        if not w.wait_ready(10):
            raise RuntimeError(f"{cid} did not subscribe")
        w.stop()
    store.close()
    tag = f"{label}-{uuid.uuid4().hex[:6]}"
    progress = _Progress(url, tag)
    publish(broker, n, tag)
    stats: list[IngestStats] = []
    deadline = time.monotonic() + 600
    if workers == 1:
        worker = IngestWorker(replace(config, client_id=ids[0], migrate=False))
        worker.start()
        # Polled, not waited on: no need to be quick here (the clock is the worker's own
        # last commit), only not to take the GIL from the worker's threads too often.
        while worker.stats.stored < n and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # count late redeliveries, if any
        worker.stop()
        stats = [worker.stats]
    else:
        stop = threading.Event()
        runner = threading.Thread(
            target=lambda: stats.extend(serve(config, workers=workers, stop=stop))
        )
        runner.start()
        while progress.stored() < n and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        stop.set()
        runner.join(120)
    progress.close()
    for cid in ids:
        drop_session(broker, cid)
    total = IngestStats()
    for s in stats:
        total.add(s)
    # From the first message any worker received to the last commit of any: start-up
    # (store process, connect) is left out, as it is for the bare subscriber.
    if total.first_received_ns is None or total.last_commit_ns is None:
        raise RuntimeError(f"{label}: no message was stored")
    elapsed = (total.last_commit_ns - total.first_received_ns) / 1e9
    # Devices are new for every run, so every stored row is one of ours (other writers on a
    # shared PostgreSQL database cannot skew this, unlike a table count).
    return n / elapsed, max(0, n - total.stored), total.duplicates


def orchestrate(quick: bool, as_json: bool) -> int:
    n = 10_000 if quick else 50_000
    # A schema of its own in the shared database, dropped after the run.
    pg_base = os.environ.get("EDGEFLEET_TEST_PG_URL", PG_DEFAULT)
    figures: dict[str, Any] = {"messages": n, "devices": DEVICES}
    lost = duplicates = 0
    with (
        tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp,
        mosquitto(Path(tmp) / "broker") as broker,
        private_schema(pg_base) as pg,
    ):
        bares: list[float] = []
        runs = [
            ("sqlite_1w", f"sqlite://{tmp}/fleet1.db", 1),
            ("sqlite_2w", f"sqlite://{tmp}/fleet2.db", 2),
            ("pg_1w", pg, 1),
            ("pg_2w", pg, 2),
        ]
        bares.append(bare_rate(broker, n))
        for label, url, workers in runs:
            rate, run_lost, run_dups = ingest_rate(broker, url, n, workers, label)
            bares.append(bare_rate(broker, n))
            around = (bares[-2] + bares[-1]) / 2
            figures[label] = round(rate)
            figures[f"{label}_vs_bare"] = round(rate / around, 3)
            lost += run_lost
            duplicates += run_dups
            if not as_json:
                print(
                    f"{label}: {rate:,.0f} msg/s ({figures[f'{label}_vs_bare']:.0%} of bare "
                    f"{around:,.0f} msg/s around it), lost {run_lost}, "
                    f"duplicates {run_dups}",
                    flush=True,
                )
    figures["bare_msgs_per_s"] = round(statistics.median(bares))
    figures["bare_runs"] = [round(b) for b in bares]
    figures["lost"] = lost
    figures["duplicates"] = duplicates
    if not as_json:
        print(f"bare paho subscriber: {figures['bare_msgs_per_s']:,} msg/s")
    print(json.dumps(figures))
    return 0 if lost == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet_ingest", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument("--quick", action="store_true", help="10,000 messages instead of 50,000")
    parser.add_argument(
        "--json", action="store_true", help="figures as one JSON object on the last line"
    )
    args = parser.parse_args(argv)
    return orchestrate(args.quick, args.json)


if __name__ == "__main__":
    sys.exit(main())
