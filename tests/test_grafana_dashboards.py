"""``fleet serve``'s Prometheus metrics after a real ingest, and the Grafana dashboards in
``deploy/grafana/``: every metric a panel queries exists in the ``/metrics`` of a real agent
(``edge-agent run --simulate`` with its uplink on) or a real ``fleet serve``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.agent import example_text
from tests.support.api import make_tokens
from tests.support.fleet import Publisher, boot_id, decision, state, telemetry
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port

pytestmark = pytest.mark.peers

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "deploy" / "grafana"
_HEALTH_API = re.compile(r"health API on http://127\.0\.0\.1:(\d+)")
_IDENT = re.compile(r"\b((?:edgefleet|fleet)_[a-zA-Z0-9_:]*)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (ours all start edgefleet_ or fleet_)."""
    return set(_IDENT.findall(expr))


def dashboard_exprs(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]


def missing(path: Path, samples: set[str]) -> set[str]:
    return {n for e in dashboard_exprs(path) for n in metric_names(e)} - samples


def sample_names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def wait_for(pred: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path / "broker")
    b.start()
    try:
        yield b
    finally:
        b.stop()


def test_fleet_metrics_count_a_real_ingest_and_feed_the_fleet_dashboard(
    tmp_path: Path, broker: Mosquitto
) -> None:
    url = f"sqlite://{tmp_path / 'fleet.db'}"
    tokens = make_tokens(url)
    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "fleet.cli", "serve", "--store", url, "--broker",
         f"127.0.0.1:{broker.port}", "--no-rollouts", "--http", f"127.0.0.1:{port}",
         "--client-id", "metrics-test", "--batch-ms", "20"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:

        def scrape() -> str:
            r = httpx.get(base + "/metrics", timeout=5)
            r.raise_for_status()
            return r.text

        def workers_up() -> bool:
            try:
                text = scrape()
            except httpx.HTTPError:
                return False
            return values(text).get(("fleet_ingest_workers", (("state", "connected"),))) == 1

        wait_for(workers_up, 60, "fleet serve's ingest worker to connect")
        pub = Publisher("127.0.0.1", broker.port)
        b = boot_id()
        pub.send(state("gw-m", b, 0))
        msgs = [telemetry("gw-m", b, s) for s in range(1, 11)] + [decision("gw-m", b, 11)]
        for m in msgs:
            pub.send(m)
        pub.send(msgs[0])  # a redelivery: the same bytes again
        pub.publish("edgefleet/v1/plant1/gw-m/telemetry", b'{"seq": "not a number"}')
        pub.flush()
        pub.close()

        def counted() -> bool:
            v = values(scrape())
            return v.get(("fleet_messages_received_total", ())) == 14

        wait_for(counted, 30, "the ingest to count 14 messages")
        r = httpx.get(
            base + "/api/v1/devices", headers={"Authorization": f"Bearer {tokens['viewer']}"}
        )
        assert r.status_code == 200
        assert httpx.get(base + "/api/v1/devices").status_code == 401
        time.sleep(5.5)  # the fleet's state is read from the store at most every 5 s
        text = scrape()
    finally:
        serve.terminate()
        _, err = serve.communicate(timeout=60)
    v = values(text)
    assert v[("fleet_messages_stored_total", ())] == 11
    assert v[("fleet_messages_duplicate_total", ())] == 1
    assert v[("fleet_messages_quarantined_total", (("reason", "schema"),))] == 1
    assert v[("fleet_ingest_lag_seconds_count", ())] == 12  # stored and found stored
    assert v[("fleet_ingest_lag_seconds_bucket", (("le", "+Inf"),))] == 12
    assert v[("fleet_store_write_seconds_count", ())] == v[("fleet_store_batches_total", ())] >= 1
    assert v[("fleet_devices", (("state", "online"),))] == 1
    assert v[("fleet_api_requests_total", (("route", "/api/v1/devices"), ("status", "200")))] == 1
    assert v[("fleet_api_requests_total", (("route", "/api/v1/devices"), ("status", "401")))] == 1
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)), "a family exported twice"
    fleet_board = DASHBOARDS / "edgefleet-fleet.json"
    assert not missing(fleet_board, sample_names(text)), missing(fleet_board, sample_names(text))
    assert "Traceback" not in err, err[-3000:]


def test_the_agent_dashboard_reads_only_what_a_real_agent_exports(
    tmp_path: Path, broker: Mosquitto
) -> None:
    text = example_text()
    text = text.replace("enabled = false                # the demo runs without a broker",
                        "enabled = true")  # fmt: skip
    text = text.replace("port = 1883", f"port = {broker.port}")
    text = text.replace('dbc = "../drivers/sim/motor_drive.dbc"',
                        f'dbc = "{REPO / "drivers" / "sim" / "motor_drive.dbc"}"')  # fmt: skip
    config = tmp_path / "agent.toml"
    config.write_text(text)
    # --simulate serves the health API on a free port and says which on stderr.
    agent = subprocess.Popen(
        [str(Path(sys.executable).parent / "edge-agent"), "run", "-c", str(config), "--simulate"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(agent.stderr or []), daemon=True)
    reader.start()
    scraped: list[str] = []

    def ready() -> bool:
        found = next((m for ln in list(lines) if (m := _HEALTH_API.search(ln))), None)
        if found is None:
            return False
        try:
            t = httpx.get(f"http://127.0.0.1:{found[1]}/metrics", timeout=5).text
        except httpx.HTTPError:
            return False
        v = values(t)
        scraped[:] = [t]
        # Sent, not acked: with nobody subscribed the broker's PUBACK says "no matching
        # subscribers" and the agent keeps the rows for the fleet.
        return v.get(("edgefleet_windows_total", ()), 0) >= 2 and (
            v.get(("edgefleet_uplink_sent_total", ()), 0) >= 1
        )

    try:
        wait_for(ready, 90, "the agent to score windows and publish over its uplink")
    finally:
        agent.terminate()
        agent.wait(60)
        reader.join(10)
    samples = sample_names(scraped[0])
    agent_board = DASHBOARDS / "edgefleet-agent.json"
    assert not missing(agent_board, samples), missing(agent_board, samples)
    assert values(scraped[0])[("edgefleet_uplink_connected", ())] == 1


def test_the_dashboards_are_importable_and_the_check_can_fail() -> None:
    for path in sorted(DASHBOARDS.glob("*.json")):
        doc = json.loads(path.read_text())
        assert doc["uid"], path
        assert doc["title"], path
        assert doc["schemaVersion"] >= 36, path
        assert doc["__inputs"][0]["pluginId"] == "prometheus", path
        ids = [p["id"] for p in doc["panels"]]
        assert len(ids) == len(set(ids)), path
        for p in doc["panels"]:
            assert p["targets"], (path, p["title"])
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${DS_PROMETHEUS}", (path, p["title"])
                assert metric_names(t["expr"]), (path, p["title"], t["expr"])
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == [
        "edgefleet-agent.json",
        "edgefleet-fleet.json",
    ]
    # The name check itself: a panel reading a metric nobody exports is caught.
    assert metric_names('sum by (le) (rate(fleet_nope_seconds_bucket{a="b"}[5m]))') == {
        "fleet_nope_seconds_bucket"
    }
    assert missing(DASHBOARDS / "edgefleet-fleet.json", set())
