"""What the ingest must never let through or lose quietly, end to end on both stores: a real
Mosquitto, a real worker, SQLite and PostgreSQL.

Payloads msgspec alone accepted (a key given twice, NUL inside ``detail``, ``detail`` nested
60,000 deep), a second body under a stored key (a conflict), and messages the broker
dropped for the ingest (gaps, see the second half).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from fleet.store import Store
from tests.mqtt_broker import Mosquitto, mosquitto
from tests.pg import pg_url
from tests.test_fleet_ingest import (
    SITE,
    Publisher,
    boot_id,
    make_worker,
    opened,
    ota_status,
    probe_until_stored,
    sqlite_url,
    state,
    telemetry,
    wait_until,
)
from wire import encode, topic


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with mosquitto(tmp_path / "broker") as b:
        yield b


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "fleet.db")
    return pg_url()


@pytest.fixture
def device() -> str:
    """A device name of this test alone (the PostgreSQL database is shared)."""
    return f"gw-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = opened(store_url)
    try:
        yield s
    finally:
        s.close()


def _ota_with(device: str, boot: str, seq: int, detail_json: bytes) -> bytes:
    raw = encode(ota_status(device, boot, seq))
    assert raw.endswith(b'"detail":{}}')
    return raw.removesuffix(b"{}}") + detail_json + b"}"


def test_payloads_msgspec_let_through_are_quarantined_with_reason_and_where(
    broker: Mosquitto, store_url: str, store: Store, device: str
) -> None:
    """Before: a repeated key was stored (last one wins), NUL inside `detail` was stored
    (on PostgreSQL, whose text refuses NUL everywhere else), 60,000 levels of `detail`
    were quarantined as `internal error: RecursionError`, and an unknown field named with
    a NUL made a reason PostgreSQL could not store."""
    boot = boot_id()
    ota_t = topic(SITE, device, "ota/status")
    tel_t = topic(SITE, device, "telemetry")
    twice = encode(telemetry(device, boot, 1025)).replace(b'"seq":1025', b'"seq":1025,"seq":3')
    unknown = json.dumps({**msgspec.to_builtins(telemetry(device, boot, 4)), "x\u0000": 1})
    bad = [
        (tel_t, twice, 'duplicate key "seq"', "$.seq"),
        (ota_t, _ota_with(device, boot, 5, b'{"code":"a\\u0000b"}'), "NUL", "$.detail.code"),
        (
            ota_t,
            _ota_with(device, boot, 6, b'{"a":' + b"[" * 60_000 + b"]" * 60_000 + b"}"),
            "nested deeper than 32 levels",
            "$.detail.a" + "[0]" * 30,
        ),
        (tel_t, unknown.encode(), "unknown field `x\\u0000`", "$"),
    ]
    with make_worker(broker, store_url, f"w-{device}") as worker:
        assert worker.wait_ready(10)
        pub = Publisher(broker.host, broker.port)
        probe_until_stored(pub, store, state(device, boot, 0), 30)
        pub.send(telemetry(device, boot, 0))
        for t, payload, _, _ in bad:
            pub.publish(t, payload)
        pub.send(telemetry(device, boot, 1))
        pub.close()
        wait_until(
            lambda: worker.stats.stored == 2 and sum(worker.stats.quarantined.values()) == 4,
            30,
            "two stored, four quarantined",
        )
    assert worker.stats.quarantined["schema"] == 4, worker.stats.quarantined
    assert worker.stats.store_retries == 0
    held = {q.payload: q for q in store.quarantined(limit=10_000) if q.device == device}
    for _, payload, reason, where in bad:
        q = held[payload[:4096]]
        assert reason in q.reason, q.reason
        assert q.where == where
    assert [seq for _, seq, _, _ in store.telemetry(device)] == [0, 1]
    stored_ota = store.ota_status_since(0, limit=100_000)
    assert all(device.encode() not in body for _, body in stored_ota)


def test_a_second_body_under_a_stored_key_is_a_conflict_not_a_duplicate(
    broker: Mosquitto, store_url: str, store: Store, device: str
) -> None:
    """Before: counted as a duplicate and the second body silently dropped."""
    boot = boot_id()
    first = [telemetry(device, boot, seq) for seq in range(4)]
    forged = telemetry(device, boot, 2, t_ns=first[2].t_ns + 1)
    with make_worker(broker, store_url, f"w-{device}") as worker:
        assert worker.wait_ready(10)
        pub = Publisher(broker.host, broker.port)
        probe_until_stored(pub, store, state(device, boot, 0), 30)
        for msg in first:
            pub.send(msg)
        pub.flush()
        wait_until(lambda: worker.stats.stored == 4, 30, "the first four stored")
        pub.send(forged)  # same key, another body
        pub.send(first[3])  # the same bytes again: a redelivery
        pub.close()
        wait_until(
            lambda: worker.stats.conflicts + worker.stats.duplicates == 2, 30, "both handled"
        )
    assert (worker.stats.stored, worker.stats.duplicates, worker.stats.conflicts) == (4, 1, 1)
    assert sum(worker.stats.quarantined.values()) == 0
    assert worker.stats.as_dict()["conflicts"] == 1
    bodies = {seq: body for _, seq, _, body in store.telemetry(device)}
    assert bodies[2] == encode(first[2])
    (q,) = [q for q in store.quarantined(limit=10_000) if q.device == device]
    assert q.reason.startswith(f"conflict: seq 2 of boot {boot}")
    assert q.payload == encode(forged)
