"""Fleet-side test data: a device's messages as the agent sends them, a device-side
publisher, store URLs, waiting for the store."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from fleet.ingest import (
    IngestConfig,
    IngestWorker,
)
from fleet.store import Store, open_store
from tests.support.mosquitto import Mosquitto
from wire import (
    DecisionMsg,
    OtaStatusMsg,
    SignalStats,
    StateMsg,
    TelemetryMsg,
    encode,
    topic,
)
from wire.messages import ModelRef, RuleFired, TopSignal, WindowRef

REPO = Path(__file__).resolve().parents[2]


SITE = "plant1"


def boot_id() -> str:
    return uuid.uuid4().hex


def telemetry(device: str, boot: str, seq: int, t_ns: int | None = None) -> TelemetryMsg:
    return TelemetryMsg(
        device=device,
        boot_id=boot,
        seq=seq,
        t_ns=t_ns if t_ns is not None else time.time_ns(),
        period_ns=1_000_000_000,
        keyframe=seq % 10 == 0,
        signals={
            "motor_rpm": SignalStats(1500.0 + seq, 1400.0, 1600.0, 1501.0 + seq, 10),
            "temp_c": SignalStats(40.5, 40.0, 41.0, 40.7, 10),
        },
    )


def decision(
    device: str, boot: str, seq: int, t_ns: int | None = None, label: str = "normal"
) -> DecisionMsg:
    return DecisionMsg(
        device=device,
        boot_id=boot,
        seq=seq,
        t_ns=t_ns if t_ns is not None else time.time_ns(),
        trace_id=uuid.uuid4().hex,
        window=WindowRef(seq=seq, start_ns=1),
        model=ModelRef(sha256="a" * 64, version="1.0.0", ran=True),
        label=label,
        score=0.25,
        probabilities={"normal": 0.75, "bearing_fault": 0.25},
        alarms=["overheat"] if label != "normal" else [],
        raised=[],
        cleared=[],
        rules_fired=[RuleFired(rule="temp_high", reason="temp_c > 40")],
        top_signals=[TopSignal(signal="temp_c", contribution=0.5)],
        attribution="gradient",
        degraded=False,
        mode="normal",
        stage_latency_ms={"perception": 1.5, "reasoning": 0.25, "rules": None},
    )


def state(
    device: str, boot: str, seq: int, *, online: bool = True, clean: bool = True, site: str = SITE
) -> StateMsg:
    return StateMsg(
        device=device,
        boot_id=boot,
        seq=seq,
        t_ns=time.time_ns(),
        state="online" if online else "offline",
        clean=clean,
        site=site,
        device_type="gateway",
        agent_version="0.1.0",
        model_sha256="b" * 64,
    )


_KIND = {TelemetryMsg: "telemetry", DecisionMsg: "decision", OtaStatusMsg: "ota/status"}


def topic_of(msg: TelemetryMsg | DecisionMsg | OtaStatusMsg | StateMsg) -> str:
    if isinstance(msg, StateMsg):
        return topic(msg.site, msg.device, "state")
    return topic(SITE, msg.device, _KIND[type(msg)])


class Publisher:
    """A device-side paho client (MQTT v5, QoS 1); ``flush`` waits for every PUBACK.

    Publishing while the broker is away queues in paho and goes out after the reconnect.
    """

    def __init__(
        self, host: str, port: int, client_id: str = "", reconnect_s: tuple[int, int] = (1, 2)
    ) -> None:
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"pub-{uuid.uuid4().hex[:8]}",
            protocol=mqtt.MQTTv5,
        )
        self.client.max_inflight_messages_set(200)
        self.client.reconnect_delay_set(*reconnect_s)
        self._lock = threading.Lock()
        self.sent: list[int] = []
        self.acked: set[int] = set()
        self.client.on_publish = self._on_publish
        self.client.connect(host, port)
        self.client.loop_start()

    def _on_publish(
        self,
        client: mqtt.Client,
        userdata: object,
        mid: int,
        reason_code: ReasonCode,
        properties: Properties,
    ) -> None:
        with self._lock:
            self.acked.add(mid)

    def publish(self, topic_name: str, payload: bytes, *, retain: bool = False) -> None:
        info = self.client.publish(topic_name, payload, qos=1, retain=retain)
        with self._lock:
            self.sent.append(info.mid)

    def send(
        self, msg: TelemetryMsg | DecisionMsg | OtaStatusMsg | StateMsg, *, retain: bool = False
    ) -> None:
        self.publish(topic_of(msg), encode(msg), retain=retain)

    def flush(self, timeout: float = 60.0) -> None:
        def done() -> bool:
            with self._lock:
                return all(m in self.acked for m in self.sent)

        wait_until(done, timeout, "PUBACKs for every published message")
        with self._lock:
            self.sent.clear()
            self.acked.clear()

    def close(self) -> None:
        self.flush()
        self.client.disconnect()
        self.client.loop_stop()


def sqlite_url(path: Path) -> str:
    return f"sqlite://{path.resolve()}"


def wait_until(pred: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def ota_status(device: str, boot: str, seq: int) -> OtaStatusMsg:
    return OtaStatusMsg(
        device=device, boot_id=boot, seq=seq, t_ns=time.time_ns(), bundle_id="b1", state="staged"
    )


def probe_until_stored(pub: Publisher, store: Store, msg: StateMsg, timeout: float) -> None:
    """Publish ``msg`` (a birth) until the store knows its device: the ingest is subscribed."""

    def known() -> bool:
        pub.send(msg, retain=True)
        pub.flush()
        return store.device(msg.device) is not None

    wait_until(known, timeout, f"the ingest to store {msg.device}'s birth")


def make_worker(broker: Mosquitto, url: str, client_id: str = "w1", **kw: Any) -> IngestWorker:
    return IngestWorker(
        IngestConfig(
            store_url=url,
            broker_host=broker.host,
            broker_port=broker.port,
            client_id=client_id,
            batch_ms=20,
            **kw,
        )
    )


def opened(url: str) -> Store:
    store = open_store(url)
    store.migrate()
    return store


def stored_seqs(store: Store, device: str) -> list[int]:
    """Every data seq stored for ``device`` (telemetry, decisions), sorted."""
    seqs = [r[1] for r in store.telemetry(device, limit=100_000)]
    seqs += [r[2] for r in store.decisions(device=device, limit=100_000)]
    return sorted(seqs)
