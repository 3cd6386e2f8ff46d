"""The fleet HTTP API against a real uvicorn and real stores (SQLite and PostgreSQL): every
route's auth (401 without a valid token, 403 below its role), validation errors as
``{"error", "where"}``, cursor pagination, the downsampled series, the explained decisions,
rollouts created from an uploaded signed bundle, pause in the audit log, sessions with CSRF,
and the live events stream."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet.store import OperatorStore, Quarantined, Row
from fleet.store.console_sql import DeviceFilter
from tests.support.api import Api, Clock, running_api
from tests.support.fleet import SITE, boot_id, decision, state, telemetry
from tests.support.ota import Signer, model_members
from tests.support.stores import Backend
from wire import DecisionMsg, SignalStats, TelemetryMsg, encode

pytestmark = pytest.mark.peers

T0 = 1_800_000_000_000_000_000  # 2027-01-15: data times, independent of the wall clock
S = 1_000_000_000


def _row(m: TelemetryMsg | DecisionMsg, kind: str, received_ns: int) -> Row:
    return Row(m.device, SITE, kind, m.boot_id, m.seq, m.t_ns, encode(m), received_ns)


def seed(st: OperatorStore, devices: int = 5) -> dict[str, str]:
    """``devices`` devices gw-0.. (gw-0 online with telemetry and decisions), labels."""
    boots = {}
    for i in range(devices):
        name = f"gw-{i}"
        boots[name] = boot_id()
        st.record_state(name, SITE, state(name, boots[name], 0, online=i % 2 == 0), T0)
    st.set_labels("gw-1", group="line-1", tier="canary")
    b = boots["gw-0"]
    rows = [
        _row(telemetry("gw-0", b, s, T0 + s * S), "telemetry", T0 + s * S) for s in range(1, 61)
    ]
    rows += [
        _row(decision("gw-0", b, 100 + k, T0 + k * S, label="overheat" if k % 3 == 0 else "normal"),
             "decision", T0 + k * S)
        for k in range(1, 11)
    ]  # fmt: skip
    st.ingest(rows)
    return boots


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    url = f"sqlite://{tmp_path / 'fleet.db'}"
    with running_api(url, tmp_path / "artifacts") as a:
        st = a.store()
        try:
            seed(st)
        finally:
            st.close()
        yield a


# -- who may do what ------------------------------------------------------------------------

READS = [
    "/api/v1/devices",
    "/api/v1/devices/gw-0",
    "/api/v1/devices/gw-0/telemetry?signal=temp_c",
    "/api/v1/decisions",
    "/api/v1/gaps",
    "/api/v1/quarantine",
    "/api/v1/rollouts",
]


def test_every_read_needs_a_valid_token_and_a_viewer_may_read(api: Api) -> None:
    for path in READS:
        with api.client(None) as anon:
            r = anon.get(path)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
        assert set(r.json()) == {"error", "where"}
        for bad in ("Bearer nonsense", "Basic abc", f"Bearer {api.tokens['viewer'][:-2]}xx"):
            r = httpx.get(api.base + path, headers={"Authorization": bad})
            assert r.status_code == 401, (path, bad)
        with api.client("viewer") as c:
            assert c.get(path).status_code == 200, path


def test_roles_gate_changes_and_refusals_are_audited(api: Api) -> None:
    with api.client("viewer") as c:
        r = c.put("/api/v1/devices/gw-0/labels", json={"tier": "canary"})
        assert r.status_code == 403
        assert r.json() == {
            "error": "needs the operator role (token:t-viewer is viewer)",
            "where": "role",
        }
        assert c.get("/api/v1/audit").status_code == 403
    with api.client("operator") as c:
        r = c.put("/api/v1/devices/gw-0/labels", json={"tier": "canary", "group": "line-2"})
        assert r.status_code == 200, r.text
        assert r.json() == {"device": "gw-0", "group": "line-2", "tier": "canary"}
        assert c.post("/api/v1/tokens", json={"name": "x", "role": "admin"}).status_code == 403
        assert c.get("/api/v1/users").status_code == 403
        items = c.get("/api/v1/audit").json()["items"]
    actions = [(e["actor"], e["action"], e["result"].split(":")[0]) for e in items]
    assert ("token:t-operator", "device.label", "ok") in actions
    assert ("token:t-viewer", "PUT /api/v1/devices/gw-0/labels", "forbidden") in actions
    assert ("token:t-operator", "POST /api/v1/tokens", "forbidden") in actions


def test_revoked_and_expired_tokens_are_refused(tmp_path: Path) -> None:
    clock = Clock()
    url = f"sqlite://{tmp_path / 'fleet.db'}"
    with running_api(url, tmp_path / "a", clock=clock) as api, api.client("admin") as admin:
        made = admin.post(
            "/api/v1/tokens", json={"name": "short", "role": "viewer", "expires": "1h"}
        )
        assert made.status_code == 201, made.text
        token = made.json()["token"]
        h = {"Authorization": f"Bearer {token}"}
        assert httpx.get(api.base + "/api/v1/devices", headers=h).status_code == 200
        clock.now_ns += 3601 * S
        r = httpx.get(api.base + "/api/v1/devices", headers=h)
        assert (r.status_code, r.json()["error"]) == (401, "token 'short' is expired")
        clock.now_ns -= 3601 * S
        assert admin.delete("/api/v1/tokens/short").status_code == 200
        r = httpx.get(api.base + "/api/v1/devices", headers=h)
        assert (r.status_code, r.json()["error"]) == (401, "token 'short' is revoked")
        listed = {t["name"]: t for t in admin.get("/api/v1/tokens").json()}
        assert listed["short"]["usable"] is False
        assert "token" not in listed["short"]
        assert token not in json.dumps(listed)


def test_a_console_session_needs_its_csrf_token_for_changes(api: Api) -> None:
    with api.client("admin") as admin:
        r = admin.post(
            "/api/v1/users", json={"name": "olga", "role": "operator", "password": "correct horse"}
        )
        assert r.status_code == 201, r.text
        assert (
            admin.post(
                "/api/v1/users", json={"name": "olga", "role": "viewer", "password": "x" * 12}
            ).status_code
            == 409
        )
        assert (
            admin.post("/api/v1/users", json={"name": "ab", "role": "boss", "password": "x" * 12})
            .json()["error"]
            .startswith("role 'boss'")
        )
    with httpx.Client(base_url=api.base) as browser:
        bad = browser.post("/api/v1/session", json={"user": "olga", "password": "wrong horse"})
        assert bad.status_code == 401
        r = browser.post("/api/v1/session", json={"user": "olga", "password": "correct horse"})
        assert r.status_code == 200, r.text
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=strict" in cookie.replace("Strict", "strict")
        csrf = r.json()["csrf"]
        assert browser.get("/api/v1/session").json()["name"] == "olga"
        no = browser.put("/api/v1/devices/gw-2/labels", json={"tier": "critical"})
        assert no.status_code == 403
        assert no.json()["where"] == "header.X-CSRF-Token"
        ok = browser.put(
            "/api/v1/devices/gw-2/labels", json={"tier": "critical"}, headers={"X-CSRF-Token": csrf}
        )
        assert ok.status_code == 200, ok.text
        assert browser.delete("/api/v1/session", headers={"X-CSRF-Token": csrf}).status_code == 200
        assert browser.get("/api/v1/session").status_code == 401
    st = api.store()
    try:
        log = st.audit_log()
    finally:
        st.close()
    assert [(e.actor, e.via, e.action) for e in log[:2]] == [
        ("olga", "console", "device.label"),
        ("olga", "console", "session.sign_in"),
    ]


# -- reads ----------------------------------------------------------------------------------


def test_devices_filter_sort_and_page_by_cursor(api: Api) -> None:
    with api.client("viewer") as c:
        page = c.get("/api/v1/devices", params={"limit": 2}).json()
        names = [d["device"] for d in page["items"]]
        while page["next"]:
            page = c.get("/api/v1/devices", params={"limit": 2, "cursor": page["next"]}).json()
            names += [d["device"] for d in page["items"]]
        assert names == [f"gw-{i}" for i in range(5)]
        desc = c.get("/api/v1/devices", params={"sort": "-device", "limit": 3}).json()
        more = c.get("/api/v1/devices", params={"sort": "-device", "cursor": desc["next"]}).json()
        assert [d["device"] for d in desc["items"] + more["items"]] == [
            f"gw-{i}" for i in range(4, -1, -1)
        ]
        online = c.get("/api/v1/devices", params={"online": "true"}).json()["items"]
        assert [d["device"] for d in online] == ["gw-0", "gw-2", "gw-4"]
        canary = c.get("/api/v1/devices", params={"tier": "canary", "label": "line-1"}).json()
        assert [d["device"] for d in canary["items"]] == ["gw-1"]
        assert c.get("/api/v1/devices", params={"q": "W-3"}).json()["items"][0]["device"] == "gw-3"
        r = c.get("/api/v1/devices", params={"cursor": "not-a-cursor"})
        assert (r.status_code, r.json()["where"]) == (400, "query.cursor")
        r = c.get("/api/v1/devices", params={"sort": "colour"})
        assert (r.status_code, r.json()["where"]) == (422, "query.sort")
        r = c.get("/api/v1/devices/gw-9")
        assert (r.status_code, r.json()) == (
            404,
            {"error": "no device 'gw-9' in the registry", "where": "path.device"},
        )


def test_device_detail_and_its_series_downsampled_in_buckets(api: Api) -> None:
    with api.client("viewer") as c:
        d = c.get("/api/v1/devices/gw-0").json()
        assert d["online"] is True
        assert d["signals"] == ["motor_rpm", "temp_c"]
        assert d["agent_version"] == "0.1.0"
        assert d["gaps"]
        assert d["ota_history"] == []
        since = "2027-01-15T08:00:00Z"
        span = {"since": T0 // S, "until": T0 // S + 61}
        r = c.get(
            "/api/v1/devices/gw-0/telemetry", params={"signal": "motor_rpm", "points": 6, **span}
        )
        assert r.status_code == 200, r.text
        s = r.json()
        assert s["bucket_ns"] == 61 * S // 6 + 1
        assert 5 <= len(s["points"]) <= 6
        first = s["points"][0]
        # telemetry() gives seq s a mean of 1500 + s, min 1400 and max 1600, n = 10 each
        in_first = [k for k in range(1, 61) if k * S < s["bucket_ns"]]
        assert first["points"] == len(in_first)
        assert first["mean"] == pytest.approx(sum(1500 + k for k in in_first) / len(in_first))
        assert (first["min"], first["max"]) == (1400.0, 1600.0)
        assert sum(p["points"] for p in s["points"]) == 60
        r = c.get(
            "/api/v1/devices/gw-0/telemetry",
            params={"signal": "temp_c", "since": since, "until": "2020-01-01T00:00:00Z"},
        )
        assert (r.status_code, r.json()["where"]) == (400, "query.since")
        r = c.get("/api/v1/devices/gw-0/telemetry", params={"signal": "temp_c", "points": 5000})
        assert (r.status_code, r.json()["where"]) == (422, "query.points")
        r = c.get("/api/v1/devices/gw-0/telemetry")
        assert (r.status_code, r.json()["where"]) == (422, "query.signal")


def test_decisions_carry_their_explanation_and_page_newest_first(api: Api) -> None:
    with api.client("viewer") as c:
        first = c.get("/api/v1/decisions", params={"limit": 4}).json()
        seen = first["items"]
        page = first
        while page["next"]:
            page = c.get("/api/v1/decisions", params={"limit": 4, "cursor": page["next"]}).json()
            seen += page["items"]
        assert [d["seq"] for d in seen] == list(range(110, 100, -1))
        d = seen[0]
        assert d["label"] == "normal"
        assert d["top_signals"] == [{"signal": "temp_c", "contribution": 0.5}]
        assert d["rules_fired"] == [{"rule": "temp_high", "reason": "temp_c > 40"}]
        assert d["model_sha256"] == "a" * 64
        alarms = c.get("/api/v1/decisions", params={"label": "overheat", "device": "gw-0"}).json()[
            "items"
        ]
        assert [a["seq"] for a in alarms] == [109, 106, 103]
        assert all(a["alarm"] for a in alarms)


def test_quarantine_and_gaps_are_readable(api: Api) -> None:
    st = api.store()
    try:
        st.quarantine(
            [
                Quarantined(
                    f"edgefleet/v1/{SITE}/gw-x/telemetry",
                    b'{"seq": -1}',
                    f"schema {k}",
                    "$.seq",
                    T0 + k,
                    "gw-x",
                )
                for k in range(3)
            ]
        )
    finally:
        st.close()
    with api.client("viewer") as c:
        page = c.get("/api/v1/quarantine", params={"limit": 2}).json()
        rest = c.get("/api/v1/quarantine", params={"cursor": page["next"]}).json()
        assert [q["reason"] for q in page["items"] + rest["items"]] == [
            "schema 2",
            "schema 1",
            "schema 0",
        ]
        assert page["items"][0]["where"] == "$.seq"
        assert page["items"][0]["payload"] == '{"seq": -1}'
        gaps = c.get("/api/v1/gaps", params={"device": "gw-0"}).json()
        assert gaps
        assert all(g["device"] == "gw-0" for g in gaps)


def test_the_openapi_document_lists_every_route(api: Api) -> None:
    doc = httpx.get(api.base + "/api/v1/openapi.json").json()
    for path in ["/api/v1/devices", "/api/v1/devices/{device}",
                 "/api/v1/devices/{device}/telemetry",
                 "/api/v1/devices/{device}/labels", "/api/v1/decisions", "/api/v1/gaps",
                 "/api/v1/quarantine", "/api/v1/rollouts", "/api/v1/rollouts/{rollout_id}",
                 "/api/v1/rollouts/{rollout_id}/pause", "/api/v1/audit", "/api/v1/events",
                 "/api/v1/users", "/api/v1/tokens", "/api/v1/session"]:  # fmt: skip
        assert path in doc["paths"], path


# -- rollouts -------------------------------------------------------------------------------


def test_a_rollout_from_an_uploaded_bundle_dry_run_create_pause_audit(tmp_path: Path) -> None:
    signer = Signer()
    root = signer.write_root(tmp_path / "root.json")
    members, _ = model_members(tmp_path, "api")
    bundle = signer.bundle(tmp_path / "b.efb", members)
    url = f"sqlite://{tmp_path / 'fleet.db'}"
    with running_api(url, tmp_path / "artifacts", root_json=root) as api:
        st = api.store()
        try:
            seed(st)
        finally:
            st.close()
        form = {"select": f"site={SITE}", "waves": "50%,100%", "dry_run": "true"}
        with api.client("viewer") as v:
            r = v.post("/api/v1/rollouts", data=form, files={"bundle": bundle.read_bytes()})
            assert r.status_code == 403
        with api.client("operator") as c:
            r = c.post(
                "/api/v1/rollouts", data=form, files={"bundle": ("b.efb", bundle.read_bytes())}
            )
            assert r.status_code == 200, r.text
            plan = r.json()
            assert plan["dry_run"] is True
            assert [len(w) for w in plan["plan"]] == [3, 2]
            assert c.get("/api/v1/rollouts").json() == []
            assert not any((tmp_path / "artifacts").glob("*.efb"))
            r = c.post("/api/v1/rollouts", data={**form, "dry_run": "false"},
                       files={"bundle": ("b.efb", bundle.read_bytes())})  # fmt: skip
            assert r.status_code == 200, r.text
            rid = r.json()["id"]
            again = c.post(
                "/api/v1/rollouts", data={"artifact": r.json()["sha256"], "select": f"site={SITE}"}
            )
            assert again.status_code == 409
            assert "active rollout" in again.json()["error"]
            detail = c.get(f"/api/v1/rollouts/{rid}").json()
            assert detail["state"] == "running"
            assert len(detail["devices"]) == 5
            assert c.post(f"/api/v1/rollouts/{rid}/pause").json() == {
                "rollout": rid,
                "requested": "pause",
            }
            assert c.post("/api/v1/rollouts/r99/abort").status_code == 404
            forged = bundle.read_bytes().replace(b"model-1.1.0", b"model-6.6.6")
            bad = c.post("/api/v1/rollouts", data={**form, "dry_run": "false"},
                         files={"bundle": ("x.efb", forged)})  # fmt: skip
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"].startswith("x.efb: 0 valid signature(s)")
            log = c.get("/api/v1/audit").json()["items"]
        acts = [(e["action"], e["target"], e["result"]) for e in log]
        assert ("rollout.pause", rid, "ok") in acts
        assert ("rollout.create", "b.efb", "ok") in acts
        assert ("rollout.abort", "r99", "no rollout 'r99'") in acts
        refused = [r for a, t, r in acts if a == "rollout.create" and t == "x.efb"]
        assert refused, acts
        assert refused[0] != "ok"
        assert not list((tmp_path / "artifacts" / ".incoming").iterdir())


# -- live events ----------------------------------------------------------------------------


def test_events_stream_device_online_and_alarms(api: Api) -> None:
    got: list[tuple[str, dict[str, object]]] = []
    ready = threading.Event()

    def listen() -> None:
        with api.client("viewer") as c, c.stream("GET", "/api/v1/events", timeout=30) as r:
            event = ""
            for line in r.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    got.append((event, json.loads(line[6:])))
                    if event == "hello":
                        ready.set()
                    if event == "decision.alarm":
                        return

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    assert ready.wait(20)
    time.sleep(1.5)  # the first poll takes the baseline
    st = api.store()
    try:
        b = boot_id()
        st.record_state("gw-1", SITE, state("gw-1", b, 0, online=True), time.time_ns())
        msg = decision("gw-1", b, 1, T0, label="overheat")
        # Arrives after the seeded decisions (received at T0 + k s): the stream follows arrival.
        st.ingest([_row(msg, "decision", T0 + 3600 * S)])
    finally:
        st.close()
    t.join(20)
    kinds = [k for k, _ in got]
    assert ("device.online", {"device": "gw-1"}) in got, got
    assert kinds[-1] == "decision.alarm"
    assert got[-1][1]["alarms"] == ["overheat"]


# -- both stores ----------------------------------------------------------------------------


def test_console_reads_on_both_stores(backend: Backend) -> None:
    st = backend.open()
    try:
        seed(st)
        b = boot_id()
        many = TelemetryMsg(device="gw-3", boot_id=b, seq=1, t_ns=T0, period_ns=S, keyframe=True,
                            signals={"a": SignalStats(1.0, 0.0, 2.0, 1.0, 4)})  # fmt: skip
        st.ingest([_row(many, "telemetry", T0), _row(many, "telemetry", T0)])
        assert st.signals("gw-0") == ["motor_rpm", "temp_c"]
        assert st.signals("gw-3") == ["a"]
        buckets = st.series("gw-0", "temp_c", since_ns=T0, until_ns=T0 + 61 * S, bucket_ns=30 * S)
        assert [b.points for b in buckets] == [29, 30, 1]
        assert st.series("gw-3", "a", since_ns=T0, until_ns=T0 + S, bucket_ns=S)[0].points == 1
        # A redelivery in a later batch adds no point, and nothing to the minute rollups.
        assert st.ingest([_row(many, "telemetry", T0 + S)]).duplicates == 1
        (minute,) = st.series("gw-3", "a", since_ns=T0, until_ns=T0 + S, bucket_ns=60 * S)
        assert (minute.points, minute.min, minute.max, minute.mean) == (1, 0.0, 2.0, 1.0)
        # Over whole minutes the rollups hold what the points hold.
        fine = st.series("gw-0", "motor_rpm", since_ns=T0, until_ns=T0 + 180 * S, bucket_ns=S)
        coarse = st.series("gw-0", "motor_rpm", since_ns=T0, until_ns=T0 + 180 * S,
                           bucket_ns=90 * S)  # fmt: skip
        assert sum(b.points for b in coarse) == sum(b.points for b in fine) == 60
        assert min(b.min for b in coarse) == 1400.0
        weighted = sum(b.mean * b.points for b in coarse) / 60
        assert weighted == pytest.approx(sum(1500 + k for k in range(1, 61)) / 60)
        st.register_device("gw_x%", SITE)
        names = [d.device for d, _, _ in st.devices_page(DeviceFilter(q="_"))]
        assert names == ["gw_x%"]  # LIKE's wildcards are literal in a search
        desc = DeviceFilter(sort="device", desc=True)
        first = st.devices_page(desc, limit=2)
        rest = st.devices_page(desc, after=(first[-1][0].device, first[-1][0].device))
        assert [d.device for d, _, _ in first + rest] == [
            "gw_x%",
            *(f"gw-{i}" for i in range(4, -1, -1)),
        ]
        on = st.devices_page(DeviceFilter(online=True, tier="normal", q="GW-"))
        assert [(d.device, g, t) for d, g, t in on] == [
            ("gw-0", "", "normal"),
            ("gw-2", "", "normal"),
            ("gw-4", "", "normal"),
        ]
        assert [d.device for d, _, _ in st.devices_page(DeviceFilter(group="line-1"))] == ["gw-1"]
        page = st.decisions_page(device="gw-0", limit=3)
        nxt = st.decisions_page(
            device="gw-0", before=(page[-1][1], page[-1][0], page[-1][2]), limit=3
        )
        assert [r[2] for r in page + nxt] == list(range(110, 104, -1))
        assert st.newest_received("decision") is not None
        assert len(st.decisions_received(None, limit=100)) == 10
    finally:
        st.close()
