"""A model rollout to N agents through 4 waves on loopback: time, fleet CPU, MQTT messages.

A Mosquitto on a free port; ``fleet serve`` as its own process (ingest, artifact server,
orchestrator; its CPU is what ``fleet_cpu_pct`` measures, in % of one core over the
rollout); N :class:`~edge_agent.fleetsim.SimAgent` devices in this process (each its own
MQTT connection, outbox, OTA updater and reasoning stage; 10 windows/s each). The bundle is
the committed model with its own sha256; probation 1 s. ``seconds`` runs from
``fleet rollout create`` to the rollout completed; ``msgs_per_device`` counts the offers
sent to and the ``ota/status`` reports stored from each device for this bundle.
Baseline in the same run: the time for the same devices to fetch, verify and stage the
bundle with no orchestration at all (``bare_update_s``: each agent's updater given the file
directly, all at once).

    python -m bench.rollout [--quick] [--json]

Keys: devices, seconds, msgs_per_device, fleet_cpu_pct, waves, bare_update_s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from edge_agent.fleetsim import SimAgent, sim_config
from fleet.rollout import machine as m
from fleet.rollout.orchestrator import create_rollout, load
from fleet.rollout.plan import parse_selector
from fleet.store import open_store
from tests.support.mosquitto import mosquitto
from tests.support.ota import Signer, model_members
from tests.support.ports import free_port

SITE = "bench"


def run(n: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    signer = Signer()
    root = signer.write_root(tmp / "root.json")
    members, new_sha = model_members(tmp, "v2")
    bundle = signer.bundle(tmp / "v2.efb", members, probation={"seconds": 1, "min_windows": 5})
    store_url = f"sqlite://{tmp / 'fleet.db'}"
    artifacts = tmp / "artifacts"
    artifacts.mkdir()
    with mosquitto(tmp / "broker") as broker:
        fleet = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fleet.cli",
                "serve",
                "--http",
                "127.0.0.1:0",
                "--store",
                store_url,
                "--broker",
                f"127.0.0.1:{broker.port}",
                "--artifacts",
                str(artifacts),
                "--artifact-port",
                str(free_port()),
                "--coap-port",
                str(free_port()),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        proc = psutil.Process(fleet.pid)
        agents = {
            f"dev-{i:03d}": SimAgent(
                sim_config(
                    device=f"dev-{i:03d}",
                    site=SITE,
                    state_dir=tmp / "devices" / f"dev-{i:03d}",
                    broker=("127.0.0.1", broker.port),
                    trust_root=root,
                ),
                window_hz=10.0,
                seed=3 + i % 5,
            )
            for i in range(n)
        }
        stop_box: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        started = threading.Event()

        async def main() -> None:
            stop = asyncio.Event()
            stop_box.append((asyncio.get_running_loop(), stop))
            started.set()
            async with asyncio.TaskGroup() as tg:
                for a in agents.values():
                    tg.create_task(a.run(stop))

        thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        thread.start()
        started.wait(10)
        try:
            time.sleep(1.0)  # fleet serve migrates the store
            store = open_store(store_url)
            store.migrate()
            deadline = time.monotonic() + 120
            while {d.device for d in store.devices() if d.online} < set(agents):
                if time.monotonic() > deadline:
                    raise RuntimeError("devices did not all come online")
                time.sleep(0.2)
            cpu0 = proc.cpu_times()
            t0 = time.monotonic()
            r = create_rollout(
                store,
                bundle,
                artifacts=artifacts,
                selector=parse_selector(""),
                params=m.Params(waves=(0.01, 0.1, 0.5, 1.0), min_devices=1, device_timeout_s=120),
            )
            while True:
                doc = {rid: d for rid, _, d in store.rollouts()}[r.id]
                r = load(doc)[0]
                if r.state != "running":
                    break
                if time.monotonic() - t0 > 600:
                    raise RuntimeError("rollout did not finish in 600 s")
                time.sleep(0.1)
            seconds = time.monotonic() - t0
            cpu1 = proc.cpu_times()
            time.sleep(1.0)  # the last status reports reach the store
            statuses = 0
            for _, body in store.ota_status_since(0, limit=1_000_000):
                if json.loads(body).get("bundle_id") == r.bundle_id:
                    statuses += 1
            offers = sum(d.attempts for d in r.devices.values())
            serving = {a.model_sha256() for a in agents.values()}
            store.close()
        finally:
            loop, stop = stop_box[0]
            loop.call_soon_threadsafe(stop.set)
            thread.join(30)
            fleet.terminate()
            fleet.wait(20)
    busy = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    bare = asyncio.run(bare_updates(tmp, root, bundle, n))
    return {
        "devices": n,
        "state": r.state,
        "seconds": round(seconds, 2),
        "waves": [len(w) for w in r.waves],
        "committed": sum(d.state == "committed" for d in r.devices.values()),
        "all_serving_new": serving == {new_sha},
        "msgs_per_device": round((statuses + offers) / n, 2),
        "status_msgs_per_device": round(statuses / n, 2),
        "fleet_cpu_pct": round(100 * busy / seconds, 1),
        "bare_update_s": bare,
    }


async def bare_updates(tmp: Path, root: Path, bundle: Path, n: int) -> float:
    """The same updates with no fleet: every device's updater given the file at once."""
    agents = [
        SimAgent(
            sim_config(
                device=f"bare-{i:03d}",
                site=SITE,
                state_dir=tmp / "bare" / f"bare-{i:03d}",
                broker=("127.0.0.1", 1),
                trust_root=root,
            ),
            window_hz=10.0,
        )
        for i in range(n)
    ]
    for a in agents:
        a.uplink = None  # no broker: only the updates
    stop = asyncio.Event()
    tasks = [asyncio.create_task(a.run(stop)) for a in agents]
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    outcomes = await asyncio.gather(*(a.ota.install_file(bundle) for a in agents if a.ota))
    took = time.monotonic() - t0
    stop.set()
    await asyncio.gather(*tasks)
    assert all(o.result == "committed" for o in outcomes), outcomes[:3]
    return round(took, 2)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.rollout", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="30 devices instead of 100")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("EDGEFLEET_LOOP", "asyncio")
    out = run(30 if args.quick else 100)
    if not args.json:
        for k, v in out.items():
            print(f"{k:>24}: {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
