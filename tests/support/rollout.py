"""A whole fleet on loopback for rollout tests: a Mosquitto, ``fleet serve``'s ingest and
rollout service in threads, and N :class:`~edge_agent.fleetsim.SimAgent` devices (each with
its own MQTT connection, outbox, OTA journal and store) on one event loop in another thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.fleetsim import SimAgent, sim_config
from fleet.ingest import IngestConfig
from fleet.ingest import serve as ingest_serve
from fleet.rollout import machine as m
from fleet.rollout.orchestrator import create_rollout, load
from fleet.rollout.plan import parse_selector
from fleet.rollout.service import RolloutService, serve_rollouts
from fleet.store import Store, open_store
from tests.support.mosquitto import Mosquitto
from tests.support.ota import DEVICE_TYPE, Signer, model_members
from tests.support.ports import free_port

SITE = "plant-t"


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


@dataclass
class Fleet:
    tmp: Path
    broker: Mosquitto
    signer: Signer
    store_url: str
    artifacts: Path
    agents: dict[str, SimAgent] = field(default_factory=dict)
    stop_service: threading.Event = field(default_factory=threading.Event)
    service: threading.Thread | None = None
    http_port: int = 0
    coap_port: int = 0

    def store(self) -> Store:
        st = open_store(self.store_url)
        st.migrate()
        return st

    def start_service(self) -> None:
        # Ports picked here, just before the bind, and kept for a restart (offers already sent
        # name them). Picked when the fleet was made, another process (a second test run) had
        # the seconds it takes 50 agents to start to take one, and no rollout ever advanced.
        self.http_port = self.http_port or free_port()
        self.coap_port = self.coap_port or free_port()
        self.stop_service = threading.Event()
        cfg = RolloutService(
            store_url=self.store_url,
            artifacts=self.artifacts,
            broker_host="127.0.0.1",
            broker_port=self.broker.port,
            http_port=self.http_port,
            coap_port=self.coap_port,
            tick_s=0.2,
        )
        self.service = threading.Thread(
            target=serve_rollouts, args=(cfg, self.stop_service), name="rollouts", daemon=True
        )
        self.service.start()

    def stop_service_now(self) -> None:
        self.stop_service.set()
        if self.service is not None:
            self.service.join(10)

    def create(self, bundle: Path, **params: Any) -> str:
        select = params.pop("select", "")
        transport = params.pop("transport", "http")
        st = self.store()
        try:
            r = create_rollout(
                st,
                bundle,
                artifacts=self.artifacts,
                selector=parse_selector(select),
                params=m.Params(**params),
                transport=transport,
            )
        finally:
            st.close()
        return r.id

    def rollout(self, rollout_id: str) -> m.Rollout:
        st = self.store()
        try:
            for rid, _, doc in st.rollouts():
                if rid == rollout_id:
                    return load(doc)[0]
        finally:
            st.close()
        raise KeyError(rollout_id)

    def wait_state(self, rollout_id: str, states: set[str], timeout: float) -> m.Rollout:
        box: list[m.Rollout] = []

        def done() -> bool:
            box[:] = [self.rollout(rollout_id)]
            return box[0].state in states

        wait_for(done, timeout, f"rollout {rollout_id} to reach {states}")
        return box[0]

    def serving(self) -> dict[str, str]:
        return {name: a.model_sha256() for name, a in self.agents.items()}


@contextmanager
def fleet(
    tmp: Path,
    broker: Mosquitto,
    n: int,
    *,
    labels: dict[str, tuple[str, str]] | None = None,
    window_hz: float = 10.0,
    offline: tuple[str, ...] = (),
) -> Iterator[Fleet]:
    """``n`` devices ``dev-00`` .. registered and online (``offline`` ones registered only)."""
    signer = Signer()
    root = signer.write_root(tmp / "root.json")
    f = Fleet(
        tmp,
        broker,
        signer,
        f"sqlite://{tmp / 'fleet.db'}",
        tmp / "artifacts",
    )
    f.artifacts.mkdir()
    stop_ingest = threading.Event()
    ingest_cfg = IngestConfig(
        store_url=f.store_url, broker_port=broker.port, client_id="t-ingest", batch_ms=20
    )
    ingest = threading.Thread(
        target=ingest_serve, args=(ingest_cfg,), kwargs={"stop": stop_ingest}, daemon=True
    )
    ingest.start()
    names = [f"dev-{i:02d}" for i in range(n)]
    st = f.store()
    for name in offline:
        st.register_device(name, SITE, DEVICE_TYPE)
    st.close()
    for name in names:
        if name in offline:
            continue
        cfg = sim_config(
            device=name,
            site=SITE,
            state_dir=tmp / "devices" / name,
            broker=("127.0.0.1", broker.port),
            trust_root=root,
        )
        f.agents[name] = SimAgent(cfg, window_hz=window_hz, seed=3 + len(f.agents) % 5)
    stop_agents: asyncio.Event | None = None
    ready = threading.Event()
    loop_box: list[asyncio.AbstractEventLoop] = []

    async def run_agents() -> None:
        nonlocal stop_agents
        stop_agents = asyncio.Event()
        loop_box.append(asyncio.get_running_loop())
        ready.set()
        async with asyncio.TaskGroup() as tg:
            for a in f.agents.values():
                tg.create_task(a.run(stop_agents))

    agents_thread = threading.Thread(target=asyncio.run, args=(run_agents(),), daemon=True)
    agents_thread.start()
    ready.wait(10)
    try:
        st = f.store()
        try:

            def registered() -> bool:
                online = {d.device for d in st.devices() if d.online}
                return online >= set(f.agents)

            wait_for(registered, 60, "every device online in the registry")
            for device, (group, tier) in (labels or {}).items():
                st.set_labels(device, group=group, tier=tier)
        finally:
            st.close()
        f.start_service()
        yield f
    finally:
        f.stop_service_now()
        if loop_box and stop_agents is not None:
            loop_box[0].call_soon_threadsafe(stop_agents.set)
        agents_thread.join(20)
        stop_ingest.set()
        ingest.join(20)


def model_bundle(f: Fleet, tag: str, **kw: Any) -> tuple[Path, str]:
    members, sha = model_members(f.tmp, tag)
    return f.signer.bundle(f.tmp / f"{tag}.efb", members, **kw), sha


def dump(r: m.Rollout) -> str:
    return json.dumps({"state": r.state, "reason": r.reason, "history": r.history[-10:]}, indent=1)
