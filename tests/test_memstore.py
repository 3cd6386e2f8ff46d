"""The in-memory store (tests/support/memstore.py) answers like the SQL store.

One scenario of writes (ingest with duplicates and conflicts, states of two boots, labels,
rollouts and requests, ota/status rows at one nanosecond, sessions) goes to both
MemoryStore and a SQLite file; every read is compared. So a logic test that uses the memory
store tests what the real store would do.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec

from fleet.store import IngestSession, Quarantined, Row, Store
from fleet.store.sqlite import SqliteStore
from tests.support.fleet import SITE, decision, state, telemetry
from tests.support.memstore import MemoryStore
from wire import encode
from wire.messages import OtaStatusMsg, StateMsg

S = 1_000_000_000
T0 = 1_700_000_000 * S
BOOT_A, BOOT_B, BOOT_C = "a" * 32, "b" * 32, "c" * 32


def _row(msg: Any, kind: str, received_ns: int, body: bytes | None = None) -> Row:
    return Row(msg.device, SITE, kind, msg.boot_id, msg.seq, msg.t_ns,
               encode(msg) if body is None else body, received_ns)  # fmt: skip


def _at(msg: StateMsg, t_ns: int) -> StateMsg:
    return msgspec.structs.replace(msg, t_ns=t_ns)


# Made once: messages carry random trace ids and wall-clock times, and both stores must get
# the same bytes.
ROWS: list[Row] = []
STATES: list[StateMsg] = []


def _messages() -> None:
    if ROWS:
        return
    rows = [_row(telemetry("gw-1", BOOT_A, s, T0 + s * S), "telemetry", T0 + s * S)
            for s in (0, 1, 2, 5, 6)]  # fmt: skip
    rows.append(_row(decision("gw-1", BOOT_A, 7, t_ns=T0 + 7 * S), "decision", T0 + 7 * S))
    rows.append(rows[1])  # a redelivery
    rows.append(_row(telemetry("gw-1", BOOT_A, 2, T0), "telemetry", T0 + 9 * S, b"{}"))
    rows.append(_row(telemetry("gw-1", BOOT_B, 1, T0 + 22 * S), "telemetry", T0 + 22 * S))
    # gw-3: every seq of its boot arrived (the watermark is one past the last), and a
    # decision at the same time as gw-1's.
    rows += [_row(telemetry("gw-3", BOOT_C, q, T0 + q * S), "telemetry", T0 + q * S)
             for q in range(3)]  # fmt: skip
    rows.append(_row(decision("gw-3", BOOT_C, 3, t_ns=T0 + 7 * S), "decision", T0 + 7 * S))
    ROWS.extend(rows)
    STATES.append(_at(state("gw-3", BOOT_C, 4), T0 + 8 * S))
    STATES.append(_at(state("gw-1", BOOT_A, 12), T0 + 10 * S))
    STATES.append(_at(state("gw-1", BOOT_B, 3), T0 + 20 * S))
    # A late Last Will of the old boot does not take the new boot offline.
    STATES.append(_at(state("gw-1", BOOT_A, 12, online=False), T0 + 11 * S))


def _scenario(store: Store) -> None:
    _messages()
    store.migrate()
    store.register_device("gw-2", SITE, "press")
    store.ingest(ROWS[:-1])
    store.ingest(ROWS[:3])  # all stored already
    for st, received in zip(STATES, (10, 20, 21, 9), strict=True):
        store.record_state(st.device, SITE, st, T0 + received * S)
    store.ingest(ROWS[-1:])
    store.quarantine([Quarantined("t/x", b"x" * 5000, "schema", "$.seq", T0, None)])
    store.ensure_device("gw-3", SITE, T0, auto_register=True)
    store.ensure_device("gw-4", SITE, T0, auto_register=False)
    store.set_labels("gw-1", group="north", tier="canary")
    store.set_labels("gw-9", group="x", tier=None)
    for rid, t in (("r1", T0), ("r2", T0 + S)):
        store.insert_rollout(rid, "running", f'{{"id": "{rid}"}}', t)
    store.insert_rollout("r1", "running", "{}", T0 + 2 * S)
    store.save_rollout("r1", "halted", '{"id": "r1", "v": 2}', T0 + 3 * S)
    store.add_rollout_request("r2", "pause", T0)
    store.add_rollout_request("r2", "resume", T0)
    store.finish_rollout_requests([1], T0)
    ota = [OtaStatusMsg(device="gw-1", boot_id=BOOT_B, seq=10 + i, t_ns=T0, bundle_id="m",
                        state="committed") for i in range(5)]  # fmt: skip
    store.ingest([_row(m, "ota/status", T0 + 30 * S) for m in ota])
    s = IngestSession("p-ingest-0", "p", "node", "ingest", 0, "b:1", "active", T0, T0)
    store.save_ingest_sessions([s])
    store.save_ingest_sessions([dataclasses.replace(s, state="stopped", created_ns=T0 + S)])
    store.save_ingest_sessions([s], if_state="draining")


def _reads(store: Store) -> dict[str, Any]:
    first = store.ota_status_since(T0, limit=2)
    return {
        "devices": store.devices(),
        "device": store.device("gw-1"),
        "site": (store.device_site("gw-2"), store.device_site("nope")),
        "telemetry": store.telemetry("gw-1", limit=3),
        "since": store.telemetry("gw-1", since_ns=T0 + 5 * S),
        "decisions": store.decisions(device="gw-1"),
        "all_decisions": store.decisions(limit=1),
        "gaps": store.gaps(),
        "gaps_one": store.gaps("gw-1"),
        "new_gaps": store.record_new_gaps(T0, T0 + 40 * S, T0 + 50 * S),
        "again": store.record_new_gaps(T0, T0 + 40 * S, T0 + 50 * S),
        "quarantined": [(q.reason, q.where, len(q.payload)) for q in store.quarantined()],
        "counts": store.counts(),
        "labels": store.labels(),
        "rollouts": store.rollouts(),
        "active": store.rollouts(active_only=True),
        "requests": store.pending_rollout_requests(),
        "ota_pages": (first, store.ota_status_since(first[-1][0], after=first[-1][1])),
        "sessions": store.ingest_sessions(),
    }


def test_the_memory_store_reads_back_what_sqlite_does(tmp_path: Path) -> None:
    mem = MemoryStore()
    sql = SqliteStore(f"sqlite://{tmp_path / 'fleet.db'}")
    try:
        _scenario(mem)
        _scenario(sql)
        want, got = _reads(sql), _reads(mem)
    finally:
        sql.close()
    assert want["gaps"], "the scenario must have gaps to compare"
    assert want["quarantined"][0][0].startswith("conflict"), want["quarantined"]
    for key, value in want.items():
        assert got[key] == value, key
