"""The wire contract: topics round-trip, messages decode strictly with a path to the fault."""

import json

import pytest

from edge_agent.rules import Decision
from wire import (
    MAX_PAYLOAD_BYTES,
    DecisionMsg,
    SignalStats,
    StateMsg,
    TelemetryMsg,
    WireError,
    decode,
    encode,
    parse_topic,
    topic,
)
from wire.messages import kind_of
from wire.topics import Topic, device_root, shared_subscription

BOOT = "0123456789abcdef0123456789abcdef"


def telemetry(seq: int = 1) -> TelemetryMsg:
    return TelemetryMsg(
        device="gw-1",
        boot_id=BOOT,
        seq=seq,
        t_ns=1_700_000_000_000_000_000,
        period_ns=1_000_000_000,
        keyframe=True,
        signals={"current": SignalStats(12.0, 11.5, 12.5, 12.1, 100)},
    )


def test_topics_round_trip_and_refuse_wildcards() -> None:
    t = topic("plant-a", "gw-1", "ota/status")
    assert t == "edgefleet/v1/plant-a/gw-1/ota/status"
    assert parse_topic(t) == Topic("plant-a", "gw-1", "ota/status")
    assert parse_topic("edgefleet/v1/plant-a/gw-1/cmd/ota") == Topic("plant-a", "gw-1", "cmd/ota")
    assert device_root("plant-a", "gw-1") == "edgefleet/v1/plant-a/gw-1"
    for bad in ("gw/1", "gw+", "gw#", ""):
        with pytest.raises(ValueError, match="not a valid name"):
            topic("plant-a", bad, "telemetry")
    with pytest.raises(ValueError, match="unknown topic kind"):
        topic("plant-a", "gw-1", "secrets")
    for junk in (
        "edgefleet/v1/a/b",
        "other/v1/a/b/telemetry",
        "edgefleet/v1/a/b/bogus",
        "edgefleet/v2/a/b/state",
    ):
        assert parse_topic(junk) is None
    assert shared_subscription()[0] == "$share/ingest/edgefleet/v1/+/+/state"


def test_messages_round_trip() -> None:
    msg = telemetry()
    raw = encode(msg)
    assert decode("telemetry", raw) == msg
    assert kind_of(msg) == "telemetry"
    # Compact signal stats on the wire: [mean, min, max, last, n].
    assert json.loads(raw)["signals"]["current"] == [12.0, 11.5, 12.5, 12.1, 100]
    state = StateMsg(
        device="gw-1", boot_id=BOOT, seq=0, t_ns=1, state="offline", clean=False, site="a"
    )
    assert decode("state", encode(state)) == state


def test_a_real_decision_fits_the_schema() -> None:
    d = Decision(
        trace_id="ab" * 16,
        t_ns=5,
        window_seq=3,
        window_start_ns=1,
        model_sha256="c" * 64,
        model_version="1.0.0",
        model_ran=True,
        label="spike",
        score=float("nan"),
        probabilities={"normal": 0.1, "spike": 0.9},
        alarms=frozenset({"spike"}),
        raised=("spike",),
        cleared=(),
        rules_fired=(),
        top_signals=(("current", 0.8),),
        attribution="occlusion",
        mode="full",
        stage_latency_ms={"perception": 0.1, "memory": 0.2, "reasoning": 0.3},
    )
    body = {"device": "gw-1", "boot_id": BOOT, "seq": 7, **d.to_json()}
    msg = decode("decision", json.dumps(body).encode())
    assert isinstance(msg, DecisionMsg)
    assert msg.score is None  # NaN travels as null
    assert msg.top_signals[0].signal == "current"


@pytest.mark.parametrize(
    ("mutate", "reason", "where"),
    [
        (lambda d: d.update(seq="1"), "Expected `int`, got `str`", "$.seq"),
        (lambda d: d.update(seq=-1), "Expected `int` >= 0", "$.seq"),
        (lambda d: d.update(seq=1.0), "Expected `int`, got `float`", "$.seq"),
        (lambda d: d.update(keyframe=1), "Expected `bool`, got `int`", "$.keyframe"),
        (lambda d: d.update(boot_id="xyz"), "Expected `str` matching regex", "$.boot_id"),
        (lambda d: d.update(device="gw/1"), "Expected `str` matching regex", "$.device"),
        (lambda d: d.update(extra=1), "Object contains unknown field `extra`", "$"),
        (lambda d: d.pop("t_ns"), "Object missing required field `t_ns`", "$"),
        (
            lambda d: d.update(signals={"current": [1, 2, 3]}),
            "Expected `array` of at least length 5",
            "$.signals[...]",
        ),
        (lambda d: d.update(period_ns=0), "Expected `int` >= 1", "$.period_ns"),
    ],
)
def test_bad_fields_name_where(mutate: object, reason: str, where: str) -> None:
    body = json.loads(encode(telemetry()))
    mutate(body)  # type: ignore[operator]
    with pytest.raises(WireError) as err:
        decode("telemetry", json.dumps(body).encode())
    assert err.value.reason.startswith(reason), err.value.reason
    assert err.value.where == where


def test_text_with_a_nul_is_refused_as_postgresql_would_fail_on_it() -> None:
    # SQLite stores a NUL, PostgreSQL text refuses it: refused by the schema, both stores
    # quarantine the message the same way instead of one failing the whole batch.
    body = {
        "device": "gw1",
        "boot_id": "a" * 32,
        "seq": 1,
        "t_ns": 1,
        "state": "online",
        "site": "plant1",
        "agent_version": "1.0",
    }
    msg = decode("state", json.dumps(body).encode())
    assert isinstance(msg, StateMsg)
    assert msg.agent_version == "1.0"
    body["agent_version"] = "1.0\u0000"
    with pytest.raises(WireError) as err:
        decode("state", json.dumps(body).encode())
    assert err.value.where == "$.agent_version"


def test_bad_payloads() -> None:
    good = encode(telemetry())
    with pytest.raises(WireError, match="expected at most"):
        decode("telemetry", b" " * (MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(WireError, match="not a JSON object"):
        decode("telemetry", good[:-3])
    with pytest.raises(WireError, match="not a JSON object"):
        decode("telemetry", good.replace(b"12.1", b"NaN"))
    with pytest.raises(WireError, match="not a JSON object"):
        decode("telemetry", b"\xff\xfe")
    with pytest.raises(WireError, match="Number out of range"):
        decode("telemetry", good.replace(b"12.1", b"1e999"))
    with pytest.raises(WireError, match="unknown message kind"):
        decode("cmd/ota", good)
