"""The agent's real uplink against a real broker: a fleet-side subscriber, an uplink
section and object, and device processes (``uplink_device_proc``) to spawn, read and kill."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_agent.uplink.config import UplinkSection
from edge_agent.uplink.publisher import Uplink
from tests.support.uplink_device_proc import MODEL_SHA
from wire.messages import DecisionMsg, Message, StateMsg, decode
from wire.topics import parse_topic

SITE = "plant1"


DEVICE = "press-7"


ROOT = f"edgefleet/v1/{SITE}/{DEVICE}"


REPO = Path(__file__).resolve().parents[2]


class Subscriber:
    """The fleet's side: a persistent-session QoS 1 subscriber that reconnects by itself."""

    def __init__(self, port: int, client_id: str = "fleet-test") -> None:
        self.received: list[tuple[str, Message, bool]] = []
        self.lock = threading.Lock()
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        c.reconnect_delay_set(1, 2)
        self.connects: list[tuple[float, bool]] = []
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 3600
        c.connect("127.0.0.1", port, keepalive=5, clean_start=False, properties=props)
        c.loop_start()
        self.client = c

    def _on_connect(self, c: mqtt.Client, u: object, f: Any, rc: Any, p: object) -> None:
        self.connects.append((time.monotonic(), bool(f.session_present)))
        c.subscribe(f"{ROOT}/#", qos=1)

    def _on_message(self, c: mqtt.Client, u: object, msg: mqtt.MQTTMessage) -> None:
        parts = parse_topic(msg.topic)
        assert parts is not None, msg.topic
        decoded = decode(parts.kind, bytes(msg.payload))
        with self.lock:
            self.received.append((parts.kind, decoded, bool(msg.retain)))

    def of(self, kind: str) -> list[Any]:
        with self.lock:
            return [m for k, m, _ in self.received if k == kind]

    def states(self) -> list[tuple[StateMsg, bool]]:
        with self.lock:
            return [(m, r) for k, m, r in self.received if isinstance(m, StateMsg)]

    def unique_decisions(self) -> dict[tuple[str, int], DecisionMsg]:
        return {(m.boot_id, m.seq): m for m in self.of("decision")}

    def wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@contextlib.contextmanager
def subscriber(port: int, client_id: str = "fleet-test") -> Iterator[Subscriber]:
    s = Subscriber(port, client_id)
    try:
        yield s
    finally:
        s.close()


def section(port: int, **kw: Any) -> UplinkSection:
    base: dict[str, Any] = {
        "enabled": True,
        "port": port,
        "keepalive_s": 5,
        "reconnect_min_ms": 100,
        "reconnect_max_ms": 500,
        "replay_rate_per_s": 2000.0,
    }
    base.update(kw)
    return UplinkSection(**base)


def uplink(sec: UplinkSection, state_dir: Path) -> Uplink:
    return Uplink(
        sec,
        site=SITE,
        device=DEVICE,
        device_type="press",
        agent_version="0.1.0",
        state_dir=state_dir,
        model_sha256=lambda: MODEL_SHA,
    )


async def until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def spawn_device(state_dir: Path, port: int, count: int, **kw: Any) -> subprocess.Popen[str]:
    args = [
        sys.executable,
        "-m",
        "tests.support.uplink_device_proc",
        "--state-dir",
        str(state_dir),
        "--port",
        str(port),
        "--count",
        str(count),
    ]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": "."}
    )


def wait_line(proc: subprocess.Popen[str], pred: Callable[[dict[str, Any]], bool]) -> Any:
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"device process exited ({proc.wait()})")
        obj = json.loads(line)
        if pred(obj):
            return obj
    raise AssertionError("device process did not report in time")


def kill9(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
