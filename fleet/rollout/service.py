"""The rollout service of one ``fleet serve`` node: the artifact server (every node serves
every bundle) and, while this node leads (:mod:`fleet.leader`), the orchestrator's steps,
with its own MQTT client for the commands."""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.reasoncodes import ReasonCode

from fleet.errors import FleetError, LeadershipLost, RolloutError
from fleet.leader import Lead, default_node, lead_for
from fleet.rollout.orchestrator import Orchestrator

log = logging.getLogger(__name__)


class MqttCommands:
    """The orchestrator's own MQTT client: QoS 1 publishes to devices' ``cmd/ota``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        client_id: str = "fleet-orchestrator",
        username: str | None = None,
        password: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        self._client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
        )
        if username is not None:
            self._client.username_pw_set(username, password)
        if tls_ca or tls_cert:
            self._client.tls_set(
                ca_certs=tls_ca,
                certfile=tls_cert,
                keyfile=tls_key,
                tls_version=ssl.PROTOCOL_TLS_CLIENT,
            )
        self._connected = threading.Event()
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.reconnect_delay_set(min_delay=1, max_delay=10)
        self.host, self.port = host, port

    def _on_connect(self, _c: mqtt.Client, _u: Any, _f: Any, rc: ReasonCode, _p: Any) -> None:
        if not rc.is_failure:
            self._connected.set()

    def _on_disconnect(self, *_a: Any) -> None:
        self._connected.clear()

    def start(self) -> None:
        self._client.connect_async(self.host, self.port, keepalive=30)
        self._client.loop_start()

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    def publish(self, topic_name: str, payload: bytes) -> bool:
        if not self._connected.is_set():
            return False
        info = self._client.publish(topic_name, payload, qos=1)
        return info.rc == mqtt.MQTT_ERR_SUCCESS

    def stop(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


@dataclass(frozen=True)
class RolloutService:
    """What ``fleet serve`` runs beside the ingest: the artifact server and the orchestrator."""

    store_url: str
    artifacts: Path
    broker_host: str = "127.0.0.1"
    broker_port: int = 1883
    http_host: str = "127.0.0.1"
    http_port: int = 8700
    coap_port: int = 5683
    #: The host name devices use to reach the artifact server (default: http_host).
    advertise: str = ""
    #: The base URL of HTTP(S) offers (a load balancer in front of every node); default
    #: ``http://{advertise}:{http_port}``. Checked by :func:`check_artifact_url`.
    artifact_url: str = ""
    tick_s: float = 0.5
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: This fleet serve's node id: the one that leads runs the orchestrator.
    node: str = field(default_factory=default_node)

    def __repr__(self) -> str:  # the password must never reach a log line
        return f"RolloutService(store={self.store_url!r}, artifacts={str(self.artifacts)!r})"


def check_artifact_url(url: str) -> str:
    """``url`` if it can be the base of an offer's URL: ``http(s)://host[:port][/path]``,
    no query or fragment (else RolloutError saying what is wrong)."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RolloutError(f"--artifact-url {url!r}: expected http(s)://HOST[:PORT][/PATH]")
    if parts.query or parts.fragment:
        raise RolloutError(f"--artifact-url {url!r}: a query or fragment cannot be a base")
    return url


def serve_rollouts(cfg: RolloutService, stop: threading.Event) -> None:
    """Blocking until ``stop``: run it in a thread of ``fleet serve``."""
    asyncio.run(run_rollouts(cfg, stop))


async def run_rollouts(cfg: RolloutService, stop: threading.Event) -> None:
    """The artifact server and the orchestrator until ``stop``, on the running event loop."""
    from fleet.artifacts import ArtifactServer  # noqa: PLC0415 - aiohttp/aiocoap on use
    from fleet.store import open_store  # noqa: PLC0415

    cfg.artifacts.mkdir(parents=True, exist_ok=True)
    store = open_store(cfg.store_url)
    store.migrate()
    lead = lead_for(cfg.store_url, store, cfg.node)
    mq = MqttCommands(
        cfg.broker_host,
        cfg.broker_port,
        username=cfg.username,
        password=cfg.password,
        tls_ca=cfg.tls_ca,
        tls_cert=cfg.tls_cert,
        tls_key=cfg.tls_key,
    )
    mq.start()
    host = cfg.advertise or cfg.http_host
    try:
        async with ArtifactServer(
            cfg.artifacts,
            http_host=cfg.http_host,
            http_port=cfg.http_port,
            coap_host=cfg.http_host,
            coap_port=cfg.coap_port,
            fill=store.bundle,  # a bundle another node published
        ) as srv:
            base = cfg.artifact_url.rstrip("/") or f"http://{host}:{srv.http_port}"

            def url_for(sha: str, transport: str) -> str:
                if transport == "coap":
                    return f"coap://{host}:{srv.coap_port}/bundles/{sha}"
                return f"{base}/v1/bundles/{sha}"

            orch = Orchestrator(store, publish=mq.publish, url_for=url_for)
            log.info(
                "rollouts: artifacts on http://%s:%d and coap://%s:%d",
                host, srv.http_port, host, srv.coap_port,
            )  # fmt: skip
            while not stop.is_set():
                try:
                    await asyncio.to_thread(_lead_step, orch, lead, cfg.node)
                except FleetError as exc:
                    log.error("rollouts: %s", exc)
                except Exception:  # a bug must not silently end the rollout service
                    log.exception("rollouts: step failed; retrying at the next tick")
                await asyncio.sleep(cfg.tick_s)
    finally:
        lead.release()
        mq.stop()
        store.close()


def _lead_step(orch: Orchestrator, lead: Lead, node: str) -> None:
    """One tick of this node: take the lead if it is free, check it is still held, and
    step the rollouts only then. A step fenced off by a newer epoch drops the lead."""
    if orch.epoch is None:
        epoch = lead.try_take(time.time_ns())
        if epoch is None:
            return  # another node leads
        orch.epoch, orch.cursor = epoch, None  # read the statuses again from the start
        log.info("rollouts: node %s leads the rollouts (epoch %d)", node, epoch)
    elif not lead.holds():
        log.warning("rollouts: node %s lost the lead (epoch %d); stepping down", node, orch.epoch)
        orch.epoch = None
        lead.release()
        return
    try:
        orch.step()
    except LeadershipLost as exc:
        log.warning("rollouts: node %s: %s; stepping down", node, exc)
        orch.epoch = None
        lead.release()


__all__ = ["MqttCommands", "RolloutService", "run_rollouts", "serve_rollouts"]
