"""Health probes as a client sends them: good ones, and the malformed ones the agent must
refuse (shared by the probe tests and the HTTP API tests)."""

from __future__ import annotations

import json
from typing import Any

from drivers.sim.plant import SIGNALS
from edge_agent.perception import PerceptionSpec
from edge_agent.simwindows import T0_NS

#: The grid of plant_windows() (the example config's): 250 ms staleness for 200 ms polls.
SPEC = PerceptionSpec(signals=SIGNALS, rate_hz=100.0, window=64, hop=64, max_staleness_ms=250.0)


MS = 1_000_000


KNOWN = ", ".join(SIGNALS)


def good(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "sensor_id": "line-3/probe",
        "timestamp_ns": T0_NS + 5 * MS,
        "payload": {"current": 9.5, "speed": 930},
    }
    doc.update(over)
    return doc


def body(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def without(key: str) -> bytes:
    doc = good()
    del doc[key]
    return body(doc)


#: (id, body, where, what the message must say). Shared with tests/test_api.py (HTTP 400).
MALFORMED: list[tuple[str, bytes, str, str]] = [
    ("not-json", b"{sensor_id: 1}", "body", "not JSON: Expecting property name"),
    ("not-utf8", b'{"sensor_id": "\xff"}', "body", "not UTF-8"),
    ("array", b"[1, 2]", "body", "expected a JSON object, got an array"),
    ("too-deep", b"[" * 5000, "body", "nested too deeply"),
    ("huge-int", b'{"timestamp_ns": ' + b"9" * 5000 + b"}", "body", "not JSON we accept"),
    ("unknown-key", body(good(extra=1)), "extra", "unknown key(s) 'extra'; expected sensor_id"),
    ("duplicate-key", b'{"sensor_id": "a", "sensor_id": "b"}', "sensor_id", "more than once"),
    ("no-sensor", without("sensor_id"), "sensor_id", "required"),
    ("no-payload", without("payload"), "payload", "required"),
    ("sensor-int", body(good(sensor_id=42)), "sensor_id", "expected a string, got an integer"),
    ("sensor-empty", body(good(sensor_id="")), "sensor_id", "must not be empty"),
    ("sensor-long", body(good(sensor_id="x" * 129)), "sensor_id", "129 characters; at most 128"),
    ("sensor-newline", body(good(sensor_id="a\nb")), "sensor_id", "must be printable"),
    ("ts-float", body(good(timestamp_ns=1.7e18)), "timestamp_ns", "got a float"),
    ("ts-bool", body(good(timestamp_ns=True)), "timestamp_ns", "got a boolean (true)"),
    ("ts-string", body(good(timestamp_ns="17")), "timestamp_ns", "got a string ('17')"),
    ("ts-negative", body(good(timestamp_ns=-1)), "timestamp_ns", "must be >= 0, got -1"),
    ("ts-too-big", body(good(timestamp_ns=2**63)), "timestamp_ns", "must be < 2**63"),
    ("payload-list", body(good(payload=[1.0])), "payload", "expected an object"),
    ("payload-null", body(good(payload=None)), "payload", "got null"),
    ("payload-empty", body(good(payload={})), "payload", f"at least one signal; known: {KNOWN}"),
    (
        "payload-unknown",
        body(good(payload={"torque": 1.0, "current": 1.0, "rpm": 2})),
        "payload.torque",
        f"unknown signal(s) 'torque', 'rpm'; known: {KNOWN}",
    ),
    (
        "payload-nan",
        b'{"sensor_id": "s", "timestamp_ns": 1, "payload": {"current": NaN}}',
        "payload.current",
        "NaN is not allowed",
    ),
    (
        "payload-inf",
        b'{"sensor_id": "s", "timestamp_ns": 1, "payload": {"speed": -Infinity}}',
        "payload.speed",
        "-Infinity is not allowed",
    ),
    (
        "payload-overflow",
        b'{"sensor_id": "s", "timestamp_ns": 1, "payload": {"speed": 1e999}}',
        "payload.speed",
        "not a finite number",
    ),
    (
        "payload-float32",
        body(good(payload={"voltage": 1e39})),
        "payload.voltage",
        "out of float32 range",
    ),
    (
        "payload-string",
        body(good(payload={"current": "9.5"})),
        "payload.current",
        "expected a number, got a string",
    ),
    (
        "payload-bool",
        body(good(payload={"current": False})),
        "payload.current",
        "expected a number, got a boolean",
    ),
    (
        "payload-duplicate",
        b'{"sensor_id": "s", "timestamp_ns": 1, "payload": {"speed": 1, "speed": 2}}',
        "payload.speed",
        "more than once",
    ),
]
