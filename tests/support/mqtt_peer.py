"""An MQTT 5 client over mutual TLS that records what the broker answered (the PKI and
broker tests)."""

from __future__ import annotations

import os
import pwd
import threading
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

SITE = "site-a"


NOT_AUTHORIZED = 135


# An accepted QoS 1 publish: Success, or "No matching subscribers" (16) when nobody listens.
ACCEPTED = (0, 16)


TIMEOUT = 5.0


def login_name() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


class Peer:
    def __init__(
        self,
        port: int,
        ca: Path | None,
        cert: Path | None,
        key: Path | None,
        *,
        client_id: str,
        will_topic: str | None = None,
    ) -> None:
        self.port = port
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
        )
        if ca is not None:  # None: the plain loopback listener
            self.client.tls_set(
                ca_certs=str(ca),
                certfile=str(cert) if cert else None,
                keyfile=str(key) if key else None,
            )
        if will_topic is not None:
            self.client.will_set(will_topic, b"offline", qos=1)
        self._cond = threading.Condition()
        self.connack: int | None = None
        self.disconnected = False
        self.pubacks: dict[int, int] = {}
        self.subacks: dict[int, list[int]] = {}
        self.messages: list[tuple[str, bytes, bool]] = []
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_publish = self._on_publish
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message

    def _on_connect(
        self, c: mqtt.Client, u: object, f: object, rc: ReasonCode, p: Properties | None
    ) -> None:
        with self._cond:
            self.connack = rc.value
            self._cond.notify_all()

    def _on_disconnect(
        self, c: mqtt.Client, u: object, f: object, rc: ReasonCode, p: Properties | None
    ) -> None:
        with self._cond:
            self.disconnected = True
            self._cond.notify_all()

    def _on_publish(
        self, c: mqtt.Client, u: object, mid: int, rc: ReasonCode, p: Properties
    ) -> None:
        with self._cond:
            self.pubacks[mid] = rc.value
            self._cond.notify_all()

    def _on_subscribe(
        self, c: mqtt.Client, u: object, mid: int, rcs: list[ReasonCode], p: Properties
    ) -> None:
        with self._cond:
            self.subacks[mid] = [rc.value for rc in rcs]
            self._cond.notify_all()

    def _on_message(self, c: mqtt.Client, u: object, msg: mqtt.MQTTMessage) -> None:
        with self._cond:
            self.messages.append((msg.topic, bytes(msg.payload), bool(msg.retain)))
            self._cond.notify_all()

    def wait(self, what: str, pred: Callable[[], bool]) -> None:
        with self._cond:
            if not self._cond.wait_for(pred, TIMEOUT):
                raise AssertionError(f"timed out waiting for {what}")

    def start(self) -> Peer:
        self.client.connect("127.0.0.1", self.port, keepalive=30)
        self.client.loop_start()
        self.wait("CONNACK", lambda: self.connack is not None)
        assert self.connack == 0
        return self

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def publish(self, topic_name: str, payload: bytes, *, retain: bool = False) -> int:
        """The PUBACK reason code of a QoS 1 publish."""
        info = self.client.publish(topic_name, payload, qos=1, retain=retain)
        self.wait(f"PUBACK for {topic_name}", lambda: info.mid in self.pubacks)
        return self.pubacks[info.mid]

    def subscribe(self, filt: str) -> list[int]:
        """The SUBACK reason codes of a QoS 1 subscription."""
        _, mid = self.client.subscribe(filt, qos=1)
        assert mid is not None
        self.wait(f"SUBACK for {filt}", lambda: mid in self.subacks)
        return self.subacks[mid]

    def payloads(self) -> list[bytes]:
        with self._cond:
            return [m[1] for m in self.messages]
