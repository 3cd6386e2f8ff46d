"""Several ``fleet serve`` nodes on one store: the rollout lead elected through PostgreSQL,
fenced by its epoch, taken over when the leader is killed; one node only on SQLite.

Real PostgreSQL (a private schema per test), real SQLite files, real Mosquitto and
``fleet serve`` as processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from typer.testing import CliRunner

from fleet.artifacts import ArtifactServer, ArtifactStats, publish
from fleet.cli import app
from fleet.errors import LeadershipLost, NodesRefused, RolloutError
from fleet.leader import GONE_AFTER_S, NodeBeat, PgLead, check_alone, lead_for
from fleet.rollout.service import check_artifact_url
from fleet.store import OperatorStore, open_store
from ota.errors import FetchError
from ota.fetch import fetch
from tests.support.fleet import REPO, wait_until
from tests.support.mosquitto import Mosquitto, mosquitto
from tests.support.pg import pg_schema_url

S = 1_000_000_000


@pytest.fixture
def pg_store() -> Iterator[tuple[str, OperatorStore]]:
    with pg_schema_url() as url:
        st = open_store(url)
        st.migrate()
        try:
            yield url, st
        finally:
            st.close()


def test_one_lead_at_a_time_and_a_deposed_leader_cannot_save(
    pg_store: tuple[str, OperatorStore],
) -> None:
    url, st = pg_store
    a, b = PgLead(url, st, "node-a"), PgLead(url, st, "node-b")
    try:
        assert a.try_take(1 * S) == 1
        assert b.try_take(2 * S) is None, "the lock is held"
        assert a.holds()
        st.save_rollout("r1", "running", "{}", 3 * S, epoch=1)
        # node-a's connection to the server ends (killed, cut off): the lock goes with it.
        a.release()
        assert not a.holds()
        assert b.try_take(4 * S) == 2
        with pytest.raises(LeadershipLost, match="epoch 1 no longer leads; node-b"):
            st.save_rollout("r1", "halted", "{}", 5 * S, epoch=1)
        assert st.rollouts() == [("r1", "running", "{}")], "nothing written by the old leader"
        st.save_rollout("r1", "paused", "{}", 6 * S, epoch=2)
        leaders = [(n.node, n.epoch) for n in st.nodes() if n.leader]
        assert leaders == [], "no node recorded itself: the lead is a row of its own"
    finally:
        a.release()
        b.release()


def test_a_second_store_schema_has_a_lead_of_its_own(
    pg_store: tuple[str, OperatorStore],
) -> None:
    url, st = pg_store
    with pg_schema_url() as other_url:
        other = open_store(other_url)
        other.migrate()
        here, there = PgLead(url, st, "n"), PgLead(other_url, other, "n")
        try:
            assert here.try_take(1) == 1
            assert there.try_take(1) == 1, "another fleet's lead in the same database"
        finally:
            here.release()
            there.release()
            other.close()


def test_sqlite_holds_one_node_and_a_node_id_is_used_once(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'fleet.db'}"
    st = open_store(url)
    st.migrate()
    try:
        now = time.time_ns()
        check_alone(st, url, "a", now)  # alone: fine
        st.node_seen("a", host="gw-host", pid=4242, started_ns=now, now_ns=now, stats_json="{}")
        with pytest.raises(NodesRefused, match="SQLite holds one node") as err:
            check_alone(st, url, "b", now + S)
        assert "a (host gw-host, pid 4242, seen 1 s ago)" in str(err.value)
        with pytest.raises(NodesRefused, match="node id 'a' is already running"):
            check_alone(st, url, "a", now + S)
        # Gone (not seen for GONE_AFTER_S): it no longer counts.
        check_alone(st, url, "b", now + int((GONE_AFTER_S + 1) * S))
        # Its process on this host is no more (killed, restarted by systemd at once).
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        st.node_seen(
            "a", host=socket.gethostname(), pid=dead.pid, started_ns=now, now_ns=now,
            stats_json="{}",
        )  # fmt: skip
        check_alone(st, url, "a", now + S)
        check_alone(st, url, "b", now + S)
        # A node records itself, and the lead on SQLite is always its one node's.
        beat = NodeBeat(st, "b", now)
        lead = lead_for(url, st, "b")
        assert lead.try_take(now) == 1
        assert lead.holds()
        shown = {n.node: n for n in st.nodes()}
        assert (shown["b"].leader, shown["b"].epoch) == (True, 1)
        assert not shown["a"].leader
        beat.gone()
        assert [n.node for n in st.nodes()] == ["a"]
    finally:
        st.close()


def _serve(url: str, broker: Mosquitto, node: str, log: Path) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "fleet.cli", "serve", "--store", url,
        "--broker", f"{broker.host}:{broker.port}", "--node-id", node, "--http", "off",
        "--artifact-port", "0", "--coap-port", "0", "--status-interval", "0",
        "--artifacts", str(log.parent / f"artifacts-{node}"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("w") as err:
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True
        )


def _nodes(url: str) -> list[dict[str, Any]]:
    r = CliRunner().invoke(app, ["nodes", "list", "--json", "--store", url])
    assert r.exit_code == 0, r.output
    rows: list[dict[str, Any]] = json.loads(r.stdout)
    return rows


def _tables(url: str) -> set[str]:
    with psycopg.connect(url) as db:
        rows = db.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
        ).fetchall()
    return {r[0] for r in rows}


def _leader(url: str) -> tuple[str, int] | None:
    lead = [(n["node"], n["epoch"]) for n in _nodes(url) if n["leader"] and n["alive"]]
    return lead[0] if lead else None


@pytest.mark.peers
def test_killing_the_leading_node_hands_the_lead_to_another_within_10_s(
    tmp_path: Path, pg_store: tuple[str, OperatorStore]
) -> None:
    url, _ = pg_store
    procs: dict[str, subprocess.Popen[str]] = {}
    with mosquitto(tmp_path / "broker") as broker:
        try:
            for node in ("n1", "n2"):
                procs[node] = _serve(url, broker, node, tmp_path / f"{node}.log")
            wait_until(lambda: len(_nodes(url)) == 2 and _leader(url) is not None, 60, "a leader")
            first = _leader(url)
            assert first is not None
            leader, epoch = first
            # Each node makes the coming days' partitions at start (one of them does the work).
            today = time.strftime("%Y%m%d", time.gmtime())
            wait_until(
                lambda: f"messages_telemetry_{today}" in _tables(url), 30, "today's partition"
            )
            other = "n2" if leader == "n1" else "n1"
            human = CliRunner().invoke(app, ["nodes", "list", "--store", url])
            assert f"yes (epoch {epoch})" in human.stdout
            killed_at = time.monotonic()
            procs[leader].send_signal(signal.SIGKILL)
            procs[leader].wait(10)
            wait_until(lambda: (_leader(url) or ("", 0))[0] == other, 30, "the takeover")
            took = time.monotonic() - killed_at
            now = _leader(url)
            assert now == (other, epoch + 1)
            assert took <= 10.0, f"takeover took {took:.1f} s"
            # The killed node's row stays, marked gone once unseen for GONE_AFTER_S.
            wait_until(
                lambda: any(n["node"] == leader and not n["alive"] for n in _nodes(url)),
                GONE_AFTER_S + 10,
                "the killed node shown as gone",
            )
            log = (tmp_path / f"{other}.log").read_text()
            assert f"node {other} leads the rollouts (epoch {epoch + 1})" in log
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    p.communicate(timeout=60)
    # A clean stop removes a node's row.
    assert [n["node"] for n in _nodes(url)] == [leader]


@pytest.mark.peers
def test_a_second_fleet_serve_on_sqlite_is_refused_in_one_line(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'fleet.db'}"
    with mosquitto(tmp_path / "broker") as broker:
        first = _serve(url, broker, "solo", tmp_path / "solo.log")
        try:
            db = tmp_path / "fleet.db"
            wait_until(
                lambda: db.exists() and _leader(url) == ("solo", 1), 60, "the first node leading"
            )
            second = _serve(url, broker, "other", tmp_path / "other.log")
            second.communicate(timeout=60)
            assert second.returncode == 3
            lines = (tmp_path / "other.log").read_text().strip().splitlines()
            assert len(lines) == 1, lines
            assert "SQLite holds one node" in lines[0]
            assert "solo (host" in lines[0]
        finally:
            first.send_signal(signal.SIGTERM)
            first.communicate(timeout=60)
        assert first.returncode == 0


def test_every_node_serves_a_bundle_another_node_published(
    pg_store: tuple[str, OperatorStore], tmp_path: Path
) -> None:
    """Node A published a bundle (``fleet rollout create`` keeps it in the store too); node
    B, whose artifact directory never saw it, serves it over HTTP and CoAP by fetching it
    from the store once. Bytes in the store that do not hash to their name are not served."""
    _, st = pg_store
    data = os.urandom(300_000)
    (tmp_path / "bundle.efb").write_bytes(data)
    sha = publish(tmp_path / "node-a", tmp_path / "bundle.efb")
    st.put_bundle(sha, data, 1 * S)
    forged = "f" * 64
    st.put_bundle(forged, b"not what its name says", 2 * S)
    (tmp_path / "node-b").mkdir()

    async def main() -> tuple[bytes, bytes, ArtifactStats]:
        async with ArtifactServer(tmp_path / "node-b", fill=st.bundle) as srv:
            await fetch(srv.http_url(sha), tmp_path / "http.efb", length=len(data))
            await fetch(srv.coap_url(sha), tmp_path / "coap.efb", length=len(data))
            for url in (srv.http_url(forged), srv.coap_url(forged), srv.http_url("e" * 64)):
                with pytest.raises(FetchError):
                    await fetch(url, tmp_path / "no.efb", length=22, attempts=1)
            return (
                (tmp_path / "http.efb").read_bytes(),
                (tmp_path / "coap.efb").read_bytes(),
                srv.stats,
            )

    got_http, got_coap, stats = asyncio.run(asyncio.wait_for(main(), 60))
    assert got_http == data
    assert got_coap == data
    assert (tmp_path / "node-b" / f"{sha}.efb").read_bytes() == data  # cached: fetched once
    assert stats.filled == 1
    assert stats.fill_errors == 2  # the forged one, over HTTP and over CoAP
    assert sorted(p.name for p in (tmp_path / "node-b").iterdir()) == [f"{sha}.efb"]


def test_the_artifact_url_must_be_a_base_url() -> None:
    assert (
        check_artifact_url("https://bundles.plant:8700/edge") == "https://bundles.plant:8700/edge"
    )
    for bad, words in (
        ("ftp://x", "expected http"),
        ("https://", "expected http"),
        ("http://lb/?a=1", "query or fragment"),
    ):
        with pytest.raises(RolloutError, match=words):
            check_artifact_url(bad)
