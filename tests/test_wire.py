"""The wire contract: topics round-trip, messages decode strictly with a path to the fault."""

import json
from typing import Any

import msgspec
import pytest

from edge_agent.rules import Decision
from wire import (
    MAX_PAYLOAD_BYTES,
    DecisionMsg,
    OtaCommand,
    OtaStatusMsg,
    SignalStats,
    StateMsg,
    TelemetryMsg,
    TelemetryPeriod,
    WireError,
    decode,
    decode_command,
    encode,
    encode_command,
    parse_topic,
    topic,
)
from wire.messages import MAX_DEPTH, ModelRef, RuleFired, TopSignal, WindowRef, kind_of
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


def test_a_state_holding_seqs_it_never_numbered_is_refused() -> None:
    body = {"device": "gw1", "boot_id": "a" * 32, "seq": 5, "t_ns": 1, "state": "online"}
    body |= {"site": "plant1", "held": 5}
    msg = decode("state", json.dumps(body).encode())
    assert isinstance(msg, StateMsg)
    assert msg.held == 5
    body["held"] = 6
    with pytest.raises(WireError, match="held 6 is beyond the watermark"):
        decode("state", json.dumps(body).encode())


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


# --- what msgspec alone lets through: repeated keys, depth, NUL in free-form text -----------


class _Pairs(list[tuple[str, object]]):
    """A JSON object as its key/value pairs, in order, repeats kept."""


def _load_pairs(raw: bytes) -> object:
    return json.loads(raw, object_pairs_hook=_Pairs)


def _dump(value: object, compact: bool = True) -> str:
    sep = "," if compact else ", "
    colon = ":" if compact else ": "
    if isinstance(value, _Pairs):
        return "{" + sep.join(json.dumps(k) + colon + _dump(v, compact) for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + sep.join(_dump(v, compact) for v in value) + "]"
    return json.dumps(value)


def _objects(value: object, path: str = "$") -> list[tuple[str, _Pairs]]:
    """Every object in a document with its JSON path, outermost first."""
    found: list[tuple[str, _Pairs]] = []
    if isinstance(value, _Pairs):
        found.append((path, value))
        for k, v in value:
            found += _objects(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _objects(v, f"{path}[{i}]")
    return found


def _every_message() -> list[tuple[str, bytes]]:
    decision = DecisionMsg(
        device="gw-1",
        boot_id=BOOT,
        seq=4,
        t_ns=5,
        trace_id="ab" * 16,
        window=WindowRef(seq=3, start_ns=1),
        model=ModelRef(sha256="c" * 64, version="1.0.0", ran=True),
        label="spike",
        score=0.9,
        probabilities={"normal": 0.1, "spike": 0.9},
        alarms=["spike"],
        raised=["spike"],
        cleared=[],
        rules_fired=[RuleFired(rule="r1", reason="held 3 windows")],
        top_signals=[TopSignal(signal="current", contribution=0.8)],
        attribution="occlusion",
        degraded=False,
        mode="full",
        stage_latency_ms={"perception": 0.1},
    )
    more = TelemetryMsg(
        device="gw-1",
        boot_id=BOOT,
        seq=2,
        t_ns=7,
        period_ns=10_000_000,
        keyframe=False,
        signals={"current": SignalStats(1.0, 1.0, 1.0, 1.0, 1), "rpm": SignalStats(2, 2, 2, 2, 1)},
        more=[TelemetryPeriod(8, True, {"current": SignalStats(1.0, 1.0, 1.0, 1.0, 1)})],
    )
    ota = OtaStatusMsg(
        device="gw-1",
        boot_id=BOOT,
        seq=9,
        t_ns=9,
        bundle_id="b1",
        state="failed",
        detail={"code": "probation_failed", "figures": {"p99_us": [1, 2, {"a": 1, "b": 2}]}},
    )
    state = StateMsg(device="gw-1", boot_id=BOOT, seq=0, t_ns=1, state="online", site="a")
    return [
        ("telemetry", encode(telemetry())),
        ("telemetry", encode(more)),
        ("decision", encode(decision)),
        ("ota/status", encode(ota)),
        ("state", encode(state)),
    ]


def _other(value: object) -> object:
    """Another value the schema accepts where ``value`` is (so the last key would win)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    return value


def test_a_key_given_twice_is_refused_in_every_object_of_every_kind() -> None:
    # msgspec keeps the last of two equal keys: {"seq": 1025, ..., "seq": 3} was stored as
    # seq 3. Every object of every kind, with each of its keys repeated (same value or
    # another), compact (the agent's bytes) or spaced: refused, naming the key's path.
    cases = 0
    for kind, raw in _every_message():
        assert decode(kind, raw) is not None
        for compact in (True, False):
            doc = _load_pairs(raw)
            assert decode(kind, _dump(doc, compact).encode()) == decode(kind, raw)
            for path, obj in _objects(doc):
                for key, value in list(obj):
                    for again in (value, _other(value)):
                        obj.append((key, again))
                        with pytest.raises(WireError) as err:
                            decode(kind, _dump(doc, compact).encode())
                        del obj[-1]
                        assert err.value.reason == f'duplicate key "{key}"', (kind, path, key)
                        assert err.value.where == f"{path}.{key}"
                        cases += 1
    assert cases > 150
    # The same key spelled with an escape is the same key.
    raw = encode(telemetry()).replace(b'"seq":1', b'"seq":1,"\\u0073eq":3')
    with pytest.raises(WireError, match='duplicate key "seq"'):
        decode("telemetry", raw)


def test_reformatted_payloads_without_repeats_are_accepted() -> None:
    # The cheap tests that skip the scan must not refuse a payload that merely differs
    # from the agent's bytes: spaces, another key order, an explicit empty `more`, escapes.
    for kind, raw in _every_message():
        doc = _load_pairs(raw)
        assert isinstance(doc, _Pairs)
        reordered = _Pairs(reversed(doc))
        for variant in (_dump(doc, False), _dump(reordered), json.dumps(json.loads(raw))):
            assert decode(kind, variant.encode()) == decode(kind, raw)
    body = json.loads(encode(telemetry()))
    assert decode("telemetry", json.dumps({**body, "more": []}).encode()) == telemetry()
    escaped = encode(telemetry()).replace(b'"gw-1"', b'"gw\\u002d1"')
    assert decode("telemetry", escaped) == telemetry()


def test_nul_is_refused_in_every_text_field_and_inside_detail() -> None:
    # One rule for all text: PostgreSQL text cannot hold NUL. The free-form `detail` was
    # not checked (stored on PostgreSQL as bytes, refused nowhere).
    base = json.loads(_every_message()[3][1])
    cases: list[tuple[dict[str, Any], str]] = [
        ({"reason": "a\u0000"}, "$.reason"),
        ({"detail": {"code": "x\u0000y"}}, "$.detail.code"),
        ({"detail": {"figures": {"list": [1, "\u0000"]}}}, "$.detail.figures.list[1]"),
        ({"detail": {"figures": {"k\u0000": 1}}}, '$.detail.figures["k\\u0000"]'),
    ]
    for change, where in cases:
        for raw in (
            json.dumps({**base, **change}).encode(),
            msgspec.json.encode({**base, **change}),  # compact, in field order: canonical
        ):
            with pytest.raises(WireError) as err:
                decode("ota/status", raw)
            assert "NUL character (\\u0000)" in err.value.reason, raw
            assert err.value.where == where
            assert "\x00" not in str(err.value)
    # "\\u0000" (a backslash, then text) is no NUL.
    text = {**base, "detail": {"code": "\\u0000"}}
    assert decode("ota/status", json.dumps(text).encode()) is not None


def test_refusals_quote_no_nul_or_control_character() -> None:
    # An unknown field named "zz\u0000": msgspec quotes the name in its message; a reason
    # with a NUL would fail the quarantine insert on PostgreSQL.
    body = json.loads(encode(telemetry()))
    body["zz\u0000\n"] = 1
    with pytest.raises(WireError) as err:
        decode("telemetry", json.dumps(body).encode())
    assert err.value.reason == "Object contains unknown field `zz\\u0000\\u000a`"


def test_detail_nested_deeper_than_the_cap_is_refused_with_where() -> None:
    # 60,000 levels made msgspec raise RecursionError (quarantined as an internal error).
    base = json.loads(_every_message()[3][1])
    base["detail"] = {"a": 1}
    agent = encode(msgspec.convert(base, OtaStatusMsg))
    assert MAX_DEPTH == 32
    for levels in (30, 31, 40, 60_000):  # the top object and detail are 2 levels
        nested = b"[" * levels + b"]" * levels
        for raw in (agent, json.dumps(base).encode()):
            deep = raw.replace(b"1}", nested + b"}").replace(b": 1", b": " + nested)
            if levels <= 30:
                assert decode("ota/status", deep) is not None
                continue
            with pytest.raises(WireError) as err:
                decode("ota/status", deep)
            assert err.value.reason == "nested deeper than 32 levels"
            assert err.value.where == "$.detail.a" + "[0]" * 30


def test_a_command_with_a_key_given_twice_is_refused() -> None:
    cmd = OtaCommand(action="install", bundle_id="b1", url="https://h/b.efb", length=10)
    raw = encode_command(cmd)
    assert decode_command(raw) == cmd
    assert decode_command(json.dumps(json.loads(raw), indent=1).encode()) == cmd
    twice = raw.replace(b'"action":"install"', b'"action":"install","action":"rollback"')
    with pytest.raises(WireError, match='duplicate key "action"'):
        decode_command(twice)
