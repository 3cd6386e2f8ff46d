"""The broker `fleet broker-config` writes, run for real, with the fleet around it.

Mosquitto runs exactly the generated config (plus ``log_type subscribe``, so a test can see
when the ingest has subscribed); devices are the agent's real uplink in processes of their
own (``tests/support/uplink_device_proc.py``: outbox, QoS 1, mutual TLS), and the ingest is
``fleet serve`` as a process. What is measured here is what ``fleet.broker_sizing`` and
``fleet.broker_reload`` state about Mosquitto 2.0.11.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from fleet import pki
from fleet.broker_config import write_broker_config
from fleet.broker_sizing import Sizing
from fleet.pki_cli import pki_app
from fleet.store import Store, open_store
from tests.support.mosquitto import Mosquitto
from tests.support.mqtt_peer import ACCEPTED, NOT_AUTHORIZED, Peer, login_name
from tests.support.ports import free_port

pytestmark = pytest.mark.peers

REPO = Path(__file__).resolve().parents[1]
SITE = "plant1"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def wait_until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@dataclass
class Site:
    """A CA, its certificates and a broker running the generated config."""

    ca_dir: Path
    holders: Path
    broker: Mosquitto
    store_url: str

    def holder(self, name: str) -> tuple[str, str, str]:
        folder = self.holders / name
        return str(folder / "ca.crt"), str(folder / f"{name}.crt"), str(folder / f"{name}.key")

    def serve(self, *extra: str) -> subprocess.Popen[str]:
        """``fleet serve`` over mutual TLS as the fleet identity, JSON summary on stdout."""
        ca, cert, key = self.holder("fleet")
        cmd = [
            sys.executable,
            "-m",
            "fleet.cli",
            "serve",
            "--http",
            "127.0.0.1:0",
            "--store",
            self.store_url,
        ]
        cmd += ["--broker", f"127.0.0.1:{self.broker.port}", "--no-rollouts", "--json"]
        cmd += ["--tls-ca", ca, "--tls-cert", cert, "--tls-key", key, "--batch-ms", "20"]
        return subprocess.Popen(
            [*cmd, *extra],
            cwd=REPO,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def subscribed(self) -> int:
        """How many ingest sessions have subscribed to the last of the uplink kinds."""
        return self.broker.log().count(" $share/ingest/edgefleet/v1/+/+/ota/status")


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    ca_dir, holders = tmp_path / "ca", tmp_path / "holders"
    pki.init_ca(ca_dir)
    for name in ("gw-1", "gw-2"):
        pki.issue(ca_dir, name, holders / name, site=SITE)
    pki.issue(ca_dir, "fleet", holders / "fleet", kind="service")
    port = free_port()
    workdir = tmp_path / "broker"
    files = write_broker_config(
        ca_dir,
        workdir,
        port=port,
        plain_port=free_port(),
        hosts=["127.0.0.1"],
        log_file=workdir / "mosquitto.log",
        run_as=login_name(),
        # 1 device x 400 msg/min x 10 min = 4,000 messages (of up to 1,000 B: the test
        # device's decisions are ~800 B) a session may queue; an autosave every second.
        sizing=Sizing(devices=1, msgs_per_min=400, outage_min=10, msg_bytes=1000, autosave_s=1),
    )
    conf = files.conf.read_text() + "log_type subscribe\n"
    broker = Mosquitto(workdir, port=port, config=conf)
    broker.start()
    try:
        yield Site(ca_dir, holders, broker, f"sqlite://{tmp_path / 'fleet.db'}")
    finally:
        broker.stop()


class Device:
    """A device process running the real uplink; ``stats`` is its latest report."""

    def __init__(self, s: Site, name: str, state_dir: Path, count: int, rate: float) -> None:
        ca, cert, key = s.holder(name)
        args = ["--state-dir", str(state_dir), "--port", str(s.broker.port), "--device", name]
        args += ["--count", str(count), "--rate", str(rate), "--replay-rate", "2000"]
        args += ["--site", SITE, "--ca", ca, "--cert", cert, "--key", key]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.uplink_device_proc", *args],
            cwd=REPO,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        #: Its latest stats line (it reports once it has produced everything).
        self.stats: dict[str, Any] = {}
        self.produced = False
        #: When (monotonic) each "broker refused" warning of its uplink was read.
        self.refused_at: list[float] = []
        self._readers = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._read_log, daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            obj = json.loads(line)
            if obj["event"] == "produced":
                self.produced = True
            elif obj["event"] == "stats":
                self.stats = obj

    def _read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if "uplink: broker refused" in line:
                self.refused_at.append(time.monotonic())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        for t in self._readers:
            t.join(5)


def _stored(store: Store, device: str) -> list[int]:
    return sorted(seq for _, _, seq, _ in store.decisions(device=device, limit=100_000))


def _stop(proc: subprocess.Popen[str]) -> dict[str, Any]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    summary: dict[str, Any] = json.loads(out.splitlines()[-1])
    return summary


def test_the_generated_config_holds_an_outage_of_fleet_serve_across_broker_restarts(
    site: Site, tmp_path: Path
) -> None:
    """3,000 messages while `fleet serve` (two workers) is down, a broker SIGKILL after an
    autosave and a broker restart in the middle: every one stored. Before, the config set
    no queue limit: Mosquitto's default of 1,000 per session kept 2,000 (two sessions),
    dropped the rest ("Outgoing messages are being dropped"), and the devices had already
    deleted them."""
    total = 3000
    serve = site.serve("--workers", "2")
    try:
        # Both workers' persistent sessions exist and hold their shared subscriptions.
        wait_until(lambda: site.subscribed() == 2, 60, "both ingest workers to subscribe")
    finally:
        _stop(serve)
    device = Device(site, "gw-1", tmp_path / "gw-1", total, 0)
    try:
        wait_until(
            lambda: device.produced and device.stats.get("acked") == total,
            60,
            "the broker to acknowledge every message",
        )
        assert device.stats["outbox_rows"] == 0  # the device has let go of all of them
    finally:
        device.stop()
    # SIGKILL saves nothing: what survives is the last autosave (every second here).
    saves = site.broker.log().count("Saving in-memory database")
    wait_until(
        lambda: site.broker.log().count("Saving in-memory database") > saves + 1,
        10,
        "an autosave after the last acknowledgement",
    )
    site.broker.kill()
    site.broker.start()
    site.broker.restart()  # SIGTERM: saved on the way out
    store = open_store(site.store_url)
    serve = site.serve("--workers", "2")
    try:
        wait_until(lambda: len(_stored(store, "gw-1")) == total, 60, "every message stored")
    finally:
        summary = _stop(serve)
    try:
        assert _stored(store, "gw-1") == list(range(total))
        assert store.gaps("gw-1") == []
    finally:
        store.close()
    # The backlog was queued per session, split between the two (each held its share).
    workers = summary["workers"]
    assert len(workers) == 2
    assert sum(w["stored"] for w in workers) == total
    assert all(w["stored"] > 0 for w in workers), [w["stored"] for w in workers]
    assert "Outgoing messages are being dropped" not in site.broker.log()


def _app() -> typer.Typer:
    app = typer.Typer()
    app.add_typer(pki_app, name="pki")
    return app


def test_revoking_a_connected_device_refuses_its_next_publish_and_disturbs_no_one(
    site: Site, tmp_path: Path
) -> None:
    """`fleet pki revoke --broker-dir --reload` on a device that is connected and
    publishing: its publishes are refused within a moment, on the same connection, and
    nothing it sends after that is stored; the other device and the ingest stay connected
    and lose nothing. Before, a reload only refused new handshakes: a device already
    connected went on publishing."""
    total, rate = 600, 50.0
    store = open_store(site.store_url)
    serve = site.serve()
    devices: dict[str, Device] = {}
    try:
        wait_until(lambda: site.subscribed() == 1, 60, "the ingest to subscribe")
        for name in ("gw-1", "gw-2"):
            devices[name] = Device(site, name, tmp_path / name, total, rate)
        gw1, gw2 = devices["gw-1"], devices["gw-2"]
        wait_until(lambda: len(_stored(store, "gw-2")) >= 50, 60, "gw-2's data flowing")
        assert site.broker.proc is not None
        args = ["pki", "revoke", "gw-2", "--dir", str(site.ca_dir)]
        args += [
            "--broker-dir",
            str(site.broker.workdir),
            "--reload",
            f"pid:{site.broker.proc.pid}",
        ]
        revoked_at = time.monotonic()
        r = CliRunner().invoke(_app(), args)
        assert r.exit_code == 0, r.output
        assert f"reload  sent SIGHUP to mosquitto (pid {site.broker.proc.pid})" in r.output
        assert "effect  gw-2's open connection gets PUBACK 135 (not authorized)" in r.output
        assert "1 device granted their topics" in r.output
        wait_until(lambda: bool(gw2.refused_at), 10, "gw-2's publishes to be refused")
        took = gw2.refused_at[0] - revoked_at
        wait_until(
            lambda: gw1.produced and gw1.stats.get("acked") == total,
            60,
            "gw-1 to deliver everything",
        )
        # Done: nothing left to send. Rows the broker acked just before the revocation may
        # wait for a confirmation gw-2 may no longer read (its cmd/# went with its rights).
        wait_until(
            lambda: (
                gw2.produced
                and gw2.stats.get("outbox_rows") == gw2.stats.get("awaiting_confirmation")
            ),
            60,
            "gw-2 done",
        )
        wait_until(lambda: len(_stored(store, "gw-1")) == total, 60, "gw-1 all stored")
        gw2_stats = dict(gw2.stats)
        wait_until(
            lambda: len(_stored(store, "gw-2")) >= int(gw2_stats["acked"]),
            60,
            "what the broker accepted from gw-2 stored",
        )
    finally:
        for d in devices.values():
            d.stop()
        _stop(serve)
    try:
        print(f"\nrevocation effective after {took:.2f} s; gw-2: {gw2_stats['acked']} acked")
        assert took < 3
        # gw-1: every seq, and its connection was never touched.
        assert _stored(store, "gw-1") == list(range(total))
        assert devices["gw-1"].stats["reconnects"] == 0
        # gw-2: what the broker accepted before the reload, in order; nothing after it.
        acked = int(gw2_stats["acked"])
        assert 50 <= acked < total
        assert _stored(store, "gw-2") == list(range(acked))
        assert sum(gw2_stats["rejected"].values()) == total - acked
        # Refused on the connection it had: no reconnect was needed to stop it.
        assert gw2_stats["reconnects"] == 0
    finally:
        store.close()


def test_issue_and_revoke_apply_to_a_running_broker_and_refuse_a_wrong_target_first(
    site: Site, tmp_path: Path
) -> None:
    app, runner = _app(), CliRunner()
    assert site.broker.proc is not None
    broker_pid = site.broker.proc.pid
    b = str(site.broker.workdir)

    def revoked(name: str) -> bool:
        return {c.name: c.revoked for c in pki.list_issued(site.ca_dir)}[name]

    # A wrong target is refused before anything is revoked or rewritten.
    acl_before = (site.broker.workdir / "acl").read_text()
    for args, why in (
        (["--reload", f"pid:{broker_pid}"], "--reload needs --broker-dir"),
        (["--broker-dir", b, "--reload", f"pid:{os.getpid()}"], "not mosquitto"),
        (["--broker-dir", b, "--reload", "pidfile:/nonexistent/pid"], "cannot read the broker's"),
        (["--broker-dir", b, "--reload", "kill:1"], "expected pid:PID, pidfile:PATH or systemd"),
        (["--broker-dir", str(tmp_path)], "cannot read the broker's ACL"),
    ):
        r = runner.invoke(app, ["pki", "revoke", "gw-1", "--dir", str(site.ca_dir), *args])
        assert r.exit_code == 1, (args, r.output)
        assert why in r.output, (args, r.output)
        assert not revoked("gw-1")
    assert (site.broker.workdir / "acl").read_text() == acl_before

    # Without --reload the ACL is rewritten and the operator told to reload.
    r = runner.invoke(app, ["pki", "revoke", "gw-1", "--dir", str(site.ca_dir), "--broker-dir", b])
    assert r.exit_code == 0, r.output
    assert "1 device granted their topics" in r.output
    assert "next: reload the broker" in r.output
    assert "user gw-1" not in (site.broker.workdir / "acl").read_text()

    # A device issued with --broker-dir --reload may publish at once, on a broker that kept
    # running; under its own site only.
    holder = tmp_path / "gw-3"
    args = ["pki", "issue", "gw-3", "--site", "plant2", "--dir", str(site.ca_dir)]
    args += ["--out", str(holder), "--broker-dir", b, "--reload", f"pid:{broker_pid}"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "effect  gw-3 may publish under plant2" in r.output
    gw3 = Peer(
        site.broker.port,
        holder / "ca.crt",
        holder / "gw-3.crt",
        holder / "gw-3.key",
        client_id="gw-3",
    )
    gw3.start()
    try:
        assert gw3.publish("edgefleet/v1/plant2/gw-3/telemetry", b"x") in ACCEPTED
        assert gw3.publish("edgefleet/v1/plant1/gw-3/telemetry", b"x") == NOT_AUTHORIZED
    finally:
        gw3.stop()

    # Revoking the fleet identity says what it does and does not do.
    args = ["pki", "revoke", "fleet", "--dir", str(site.ca_dir), "--broker-dir", b]
    r = runner.invoke(app, [*args, "--reload", f"pid:{broker_pid}"])
    assert r.exit_code == 0, r.output
    assert "effect  fleet is the fleet identity: the ACL keeps its rights" in r.output


def test_an_oversized_publish_is_refused_at_the_broker_and_logged(site: Site) -> None:
    """Nothing an agent sends exceeds the packet limit the config sets; a foreign client's
    5 MB publish is not acknowledged and dropped unseen (Mosquitto's default) but ends its
    connection, with a line in the broker's log."""
    ca, cert, key = site.holder("gw-1")
    peer = Peer(site.broker.port, Path(ca), Path(cert), Path(key), client_id="gw-1").start()
    try:
        info = peer.client.publish(f"edgefleet/v1/{SITE}/gw-1/telemetry", b"x" * 5_000_000, qos=1)
        peer.wait("the broker to drop the connection", lambda: peer.disconnected)
        assert info.mid not in peer.pubacks
    finally:
        peer.client.loop_stop()
    wait_until(
        lambda: "disconnected due to oversize packet" in site.broker.log(), 10, "the log line"
    )
