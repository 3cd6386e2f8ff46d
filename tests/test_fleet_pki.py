"""The fleet CA and the broker config, against a real Mosquitto running the generated config.

Every broker test starts Mosquitto with exactly what ``fleet.broker_config`` renders (plus a
log file and, when the tests run as root, ``user root`` so Mosquitto can read the 0600 key
after it drops privileges), and talks to it with paho MQTT 5 clients over mutual TLS.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import ssl
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import typer
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from paho.mqtt.enums import CallbackAPIVersion
from typer.testing import CliRunner

from fleet import pki
from fleet.broker_config import (
    BrokerFiles,
    render_acl,
    render_broker_config,
    write_broker_config,
)
from fleet.broker_sizing import Sizing, agent_msgs_per_min, default_agent_msgs_per_min
from fleet.errors import FleetError, PkiError
from fleet.pki import read_cert
from fleet.pki_cli import broker_config_cmd, pki_app
from fleet.store import open_store
from tests.support.mosquitto import Mosquitto
from tests.support.mqtt_peer import ACCEPTED, NOT_AUTHORIZED, SITE, TIMEOUT, Peer, login_name
from tests.support.ports import free_port
from wire.topics import shared_subscription, topic

pytestmark = pytest.mark.peers

# --- an MQTT 5 client over mutual TLS that records what the broker answered ----------------


def connect_fails(port: int, ca: Path, cert: Path | None, key: Path | None) -> str:
    """How a connection that must be refused ended; fails the test if a CONNACK arrives."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="intruder", protocol=mqtt.MQTTv5)
    client.tls_set(
        ca_certs=str(ca), certfile=str(cert) if cert else None, keyfile=str(key) if key else None
    )
    got_connack: list[int] = []
    client.on_connect = lambda c, u, f, rc, p: got_connack.append(rc.value)
    try:
        client.connect("127.0.0.1", port)
    except (ssl.SSLError, OSError) as exc:
        # TLS 1.2: the broker rejects the certificate inside the handshake.
        return f"handshake: {exc}"
    # TLS 1.3: the client's side of the handshake completes before the broker has checked
    # its certificate; the broker then closes the connection before any MQTT traffic.
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            rc = client.loop(0.1)
            assert not got_connack, f"the broker accepted the connection (CONNACK {got_connack})"
            if rc != mqtt.MQTT_ERR_SUCCESS:
                return f"closed: {mqtt.error_string(rc)}"
    except (ssl.SSLError, OSError) as exc:
        return f"closed: {exc}"
    finally:
        with contextlib.suppress(Exception):
            client.disconnect()
    raise AssertionError("the connection neither succeeded nor failed within the timeout")


# --- a CA, certificates and a broker running the generated config ---------------------------


@dataclass
class Fleet:
    ca_dir: Path
    ca: Path
    certs: dict[str, pki.IssuedPaths]
    broker: Mosquitto
    plain_port: int
    peers: list[Peer]
    #: ``write_broker_config`` again, as the fixture ran it (after a revocation).
    reconfigure: Callable[[], BrokerFiles]

    def peer(self, name: str, *, client_id: str | None = None, **kw: str) -> Peer:
        c = self.certs[name]
        p = Peer(self.broker.port, self.ca, c.cert, c.key, client_id=client_id or name, **kw)
        self.peers.append(p)
        return p.start()

    def wait_log(self, needle: str) -> str:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if needle in (log := self.broker.log()):
                return log
            time.sleep(0.05)
        raise AssertionError(f"{needle!r} not in the broker log:\n{self.broker.log()}")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    ca_dir = tmp_path / "ca"
    pki.init_ca(ca_dir)
    kinds: dict[str, pki.Kind] = {"gw-1": "device", "gw-2": "device", "fleet": "service"}
    certs = {
        name: pki.issue(
            ca_dir,
            name,
            tmp_path / "holders" / name,
            kind=kind,
            site=SITE if kind == "device" else None,
        )
        for name, kind in kinds.items()
    }
    port, plain_port = free_port(), free_port()
    workdir = tmp_path / "broker"
    reconfigure = functools.partial(
        write_broker_config,
        ca_dir,
        workdir,
        port=port,
        plain_port=plain_port,
        hosts=["localhost", "127.0.0.1"],
        log_file=workdir / "mosquitto.log",
        run_as=login_name(),
    )
    files = reconfigure()
    broker = Mosquitto(workdir, port=port, config=files.conf.read_text())
    broker.start()
    f = Fleet(ca_dir, ca_dir / pki.CA_CERT, certs, broker, plain_port, [], reconfigure)
    try:
        yield f
    finally:
        for p in f.peers:
            p.stop()
        broker.stop()


def test_device_publishes_its_own_uplink_and_the_fleet_receives_it(fleet: Fleet) -> None:
    ingest = fleet.peer("fleet")
    assert ingest.subscribe("edgefleet/v1/#") == [1]
    # The shared ingest subscriptions of wire.topics, from a second fleet worker.
    worker = fleet.peer("fleet", client_id="fleet-worker")
    for filt in shared_subscription("ingest"):
        assert worker.subscribe(filt) == [1]
    gw1 = fleet.peer("gw-1")
    sent = []
    for kind in ("state", "telemetry", "decision", "ota/status"):
        payload = f"gw-1 {kind}".encode()
        assert gw1.publish(topic(SITE, "gw-1", kind), payload) == 0
        sent.append(payload)
    # The certificate binds the device to its site: not even a retained birth elsewhere.
    # (Before sites were bound, the ACL had a `+` for the site and this got PUBACK 0.)
    assert gw1.publish(topic("site-b", "gw-1", "telemetry"), b"elsewhere") == NOT_AUTHORIZED
    assert gw1.publish(topic("site-b", "gw-1", "state"), b"birth", retain=True) == NOT_AUTHORIZED
    assert gw1.publish(topic(SITE, "gw-1", "telemetry"), b"marker") == 0
    sent.append(b"marker")
    ingest.wait("all uplinks", lambda: len(ingest.messages) == 5)
    worker.wait("all uplinks, shared", lambda: len(worker.messages) == 5)
    assert ingest.payloads() == sent
    assert worker.payloads() == sent
    assert ingest.messages[1][0] == "edgefleet/v1/site-a/gw-1/telemetry"


def test_device_cannot_publish_as_another_device_or_off_its_kinds(fleet: Fleet) -> None:
    ingest = fleet.peer("fleet")
    assert ingest.subscribe("edgefleet/v1/#") == [1]
    gw1 = fleet.peer("gw-1")
    forbidden = [
        "edgefleet/v1/site-a/gw-2/telemetry",  # another device
        "edgefleet/v1/site-a/gw-2/state",
        "edgefleet/v1/site-a/gw-1/cmd/ota",  # commands only come from the fleet
        "edgefleet/v1/site-a/gw-1/other",  # not an uplink kind
        "edgefleet/v1/site-a/gw-1/telemetry/extra",
        "edgefleet/v1/gw-1/telemetry",  # a different layout
        "somewhere/else",
    ]
    for name in forbidden:
        # Mosquitto 2.0.11 answers a denied QoS 1 publish with PUBACK 135 and drops it.
        assert gw1.publish(name, b"forged") == NOT_AUTHORIZED, name
    # The fleet may command devices but not forge their uplink.
    assert ingest.publish("edgefleet/v1/site-a/gw-1/telemetry", b"forged") == NOT_AUTHORIZED
    # A marker sent after the denied ones: once it is in, anything let through would be too.
    assert gw1.publish("edgefleet/v1/site-a/gw-1/telemetry", b"marker") == 0
    ingest.wait("the marker", lambda: b"marker" in ingest.payloads())
    assert ingest.payloads() == [b"marker"]
    assert gw1.client.is_connected()


def test_device_receives_only_its_own_commands(fleet: Fleet) -> None:
    commander = fleet.peer("fleet")
    # A retained command for gw-2, already on the broker when gw-1 snoops.
    assert (
        commander.publish("edgefleet/v1/site-a/gw-2/cmd/ota", b"retained-2", retain=True)
        in ACCEPTED
    )
    gw1, gw2 = fleet.peer("gw-1"), fleet.peer("gw-2")
    assert gw2.subscribe("edgefleet/v1/site-a/gw-2/cmd/#") == [1]
    assert gw1.subscribe("edgefleet/v1/site-a/gw-1/cmd/#") == [1]
    for snoop in ("edgefleet/v1/site-a/gw-2/cmd/#", "edgefleet/v1/+/+/cmd/#", "#"):
        # Mosquitto's acl_file does not check subscriptions (2.0.11 grants every SUBACK; a
        # broker that answers 135 is stricter still). What keeps gw-2's commands from gw-1
        # is the per-delivery read check asserted below.
        assert gw1.subscribe(snoop)[0] in (1, NOT_AUTHORIZED), snoop
    assert commander.publish("edgefleet/v1/site-a/gw-2/cmd/config", b"for-2") == 0
    assert commander.publish("edgefleet/v1/site-a/gw-1/cmd/config", b"for-1") == 0
    gw2.wait("gw-2's commands", lambda: {b"retained-2", b"for-2"} <= set(gw2.payloads()))
    gw1.wait("gw-1's command", lambda: b"for-1" in gw1.payloads())
    # Let anything else in flight arrive: the commands were published before gw-1's own one,
    # but gw-1 holds three overlapping subscriptions that match it.
    time.sleep(0.3)
    assert set(gw1.payloads()) == {b"for-1"}
    assert all(t == "edgefleet/v1/site-a/gw-1/cmd/config" for t, _, _ in gw1.messages)
    # Nor does a device see another's uplink.
    assert gw2.publish("edgefleet/v1/site-a/gw-2/telemetry", b"t2") == 0
    time.sleep(0.3)
    assert b"t2" not in gw1.payloads()


def test_will_on_another_devices_topic_is_never_delivered(fleet: Fleet) -> None:
    ingest = fleet.peer("fleet")
    assert ingest.subscribe("edgefleet/v1/#") == [1]
    wills = {"gw-1-forged": "edgefleet/v1/site-a/gw-2/state"}
    wills["gw-1-own"] = "edgefleet/v1/site-a/gw-1/state"
    for client_id, will in wills.items():
        c = fleet.certs["gw-1"]
        p = Peer(fleet.broker.port, fleet.ca, c.cert, c.key, client_id=client_id, will_topic=will)
        # Mosquitto 2.0.11 accepts the CONNECT whatever the will topic ...
        p.start()
        # ... and checks the will against the ACL when it fires: drop the connection without
        # a DISCONNECT, as a gateway losing power would.
        p.client.loop_stop()
        sock = p.client.socket()
        assert sock is not None
        sock.close()
    ingest.wait("gw-1's own will", lambda: len(ingest.messages) >= 1)
    time.sleep(0.5)
    assert [(t, m) for t, m, _ in ingest.messages] == [(wills["gw-1-own"], b"offline")]


def test_client_without_certificate_cannot_connect(fleet: Fleet) -> None:
    how = connect_fails(fleet.broker.port, fleet.ca, None, None)
    assert how
    fleet.wait_log("peer did not return a certificate")


def test_certificate_from_another_ca_cannot_connect(fleet: Fleet, tmp_path: Path) -> None:
    # Same CN as a real device: only the issuer differs.
    rogue = tmp_path / "rogue"
    pki.init_ca(rogue, name="EdgeFleet CA")
    forged = pki.issue(rogue, "gw-1", rogue / "gw-1", site=SITE)
    assert connect_fails(fleet.broker.port, fleet.ca, forged.cert, forged.key)
    fleet.wait_log("certificate verify failed")


def test_a_revoked_device_is_refused_after_a_reload_and_a_reissued_one_gets_in(
    fleet: Fleet, tmp_path: Path
) -> None:
    gw2 = fleet.certs["gw-2"]
    before = fleet.peer("gw-2", client_id="gw-2-before")  # valid until revoked
    before.stop()
    done = pki.revoke(fleet.ca_dir, "gw-2")
    assert done.serials == (read_cert(gw2.cert).serial_number,)
    files = fleet.reconfigure()
    assert f"crlfile {files.crl}" in files.conf.read_text()
    fleet.broker.reload()
    fleet.wait_log("Reloading config")
    assert connect_fails(fleet.broker.port, fleet.ca, gw2.cert, gw2.key)
    log = fleet.wait_log("certificate verify failed")
    assert "certificate verify failed" in log.split("Reloading config")[-1]
    # Mosquitto logs no reason; OpenSSL, on the same files, says which.
    openssl = ["openssl", "verify", "-crl_check", "-CAfile", str(files.ca_cert)]
    why = subprocess.run(
        [*openssl, "-CRLfile", str(files.crl), str(gw2.cert)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert why.returncode != 0
    assert "certificate revoked" in why.stdout + why.stderr, why
    fleet.peer("gw-1")  # the others are untouched
    # A new key and certificate for the same device (a new serial) is let in again.
    fresh = pki.issue(fleet.ca_dir, "gw-2", tmp_path / "gw-2-new", site=SITE, force=True)
    p = Peer(fleet.broker.port, fleet.ca, fresh.cert, fresh.key, client_id="gw-2")
    fleet.peers.append(p)
    p.start()
    listed = {c.name: c.revoked for c in pki.list_issued(fleet.ca_dir)}
    assert listed == {"fleet": False, "gw-1": False, "gw-2": False, "broker": False}
    # Revoking the name again takes the new certificate; the old one is listed once.
    again = pki.revoke(fleet.ca_dir, "gw-2")
    assert again.serials == (read_cert(fresh.cert).serial_number,)
    assert again.entries == 2


def test_broker_certificate_is_not_a_client_certificate(fleet: Fleet) -> None:
    # serverAuth only: a copy of the broker's key must not let anyone in as "broker".
    server = fleet.broker.workdir
    how = connect_fails(fleet.broker.port, fleet.ca, server / "broker.crt", server / "broker.key")
    assert how
    # OpenSSL checks the client certificate's purpose while verifying it.
    fleet.wait_log("certificate verify failed")


def test_plain_listener_is_loopback_and_sys_only(fleet: Fleet) -> None:
    anon = Peer(fleet.plain_port, None, None, None, client_id="monitor")
    fleet.peers.append(anon.start())
    assert anon.publish("edgefleet/v1/site-a/gw-1/telemetry", b"anon") == NOT_AUTHORIZED
    anon.subscribe("edgefleet/v1/#")
    anon.subscribe("$SYS/broker/version")
    anon.wait("$SYS", lambda: any(t == "$SYS/broker/version" for t, _, _ in anon.messages))
    gw1 = fleet.peer("gw-1")
    assert gw1.publish("edgefleet/v1/site-a/gw-1/telemetry", b"t1") == 0
    time.sleep(0.3)
    assert all(t.startswith("$SYS/") for t, _, _ in anon.messages)
    assert f"listener {fleet.plain_port} 127.0.0.1" in fleet.broker.config_text()


# --- the CA itself --------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_are_private_and_certificates_have_the_right_shape(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca", days=30)
    dev = pki.issue(ca.dir, "gw-1", tmp_path / "gw-1", site="plant-1")
    svc = pki.issue(ca.dir, "fleet", tmp_path / "fleet", kind="service")
    srv = pki.issue(
        ca.dir, "broker", tmp_path / "srv", kind="server", hosts=["mqtt.site", "127.0.0.1"]
    )
    for key in (ca.key, dev.key, svc.key, srv.key):
        assert _mode(key) == 0o600, key
    assert _mode(ca.dir) == 0o700
    # No temp files left behind by the durable writes.
    for folder in (ca.dir, ca.dir / pki.REGISTRY, dev.cert.parent, srv.cert.parent):
        assert not [p for p in folder.iterdir() if p.name.startswith(".")], folder

    ca_cert = pki.read_cert(ca.cert)
    bc = ca_cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical
    assert bc.value.ca
    assert bc.value.path_length == 0
    ku = ca_cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign
    assert ku.crl_sign

    leaf = pki.verify_issued_by(dev.cert, ca.cert)
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gw-1"
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # A leaf never outlives its CA.
    assert leaf.not_valid_after_utc <= ca_cert.not_valid_after_utc

    server = pki.verify_issued_by(srv.cert, ca.cert)
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["mqtt.site"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]

    # The fingerprint is what openssl prints, so an operator can compare by eye.
    out = subprocess.run(
        ["openssl", "x509", "-in", str(dev.cert), "-noout", "-fingerprint", "-sha256"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out.strip().split("=", 1)[1] == pki.fingerprint(dev.cert)
    # And openssl agrees on the chain and the purpose.
    subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca.cert), "-purpose", "sslclient", str(dev.cert)],
        check=True,
        capture_output=True,
    )

    listed = {c.name: c for c in pki.list_issued(ca.dir)}
    assert {n: c.kind for n, c in listed.items()} == {
        "broker": "server",
        "fleet": "service",
        "gw-1": "device",
    }
    assert listed["gw-1"].fingerprint == pki.fingerprint(dev.cert)
    # The device's site is in its certificate, signed with it, and in the register.
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["urn:edgefleet:site:plant-1"]
    assert {n: c.site for n, c in listed.items()} == {
        "broker": None,
        "fleet": None,
        "gw-1": "plant-1",
    }


def test_init_refuses_to_overwrite_a_ca(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca")
    before = ca.cert.read_bytes()
    with pytest.raises(PkiError, match=r"ca\.key: a CA already exists here"):
        pki.init_ca(ca.dir)
    assert ca.cert.read_bytes() == before
    # A half-written CA (key without certificate) is refused too, not silently completed.
    ca.cert.unlink()
    with pytest.raises(PkiError, match="already exists"):
        pki.init_ca(ca.dir)
    again = pki.init_ca(ca.dir, force=True)
    assert again.cert.read_bytes() != before
    assert _mode(again.key) == 0o600


@pytest.mark.parametrize("bad", ["gw/1", "gw+1", "gw#", "", "gw 1", "x" * 129, "gw-1/#"])
def test_names_that_could_escape_a_topic_root_are_refused(tmp_path: Path, bad: str) -> None:
    ca = pki.init_ca(tmp_path / "ca")
    with pytest.raises(PkiError, match="not a valid name"):
        pki.issue(ca.dir, bad, tmp_path / "out", site=SITE)
    assert not (tmp_path / "out").exists()
    with pytest.raises(PkiError):
        render_acl(fleet_identity=bad)


def test_issue_errors_name_what_is_wrong(tmp_path: Path) -> None:
    secret = b"correct horse"
    ca = pki.init_ca(tmp_path / "ca", passphrase=secret)
    assert b"ENCRYPTED" in ca.key.read_bytes()
    with pytest.raises(PkiError, match=r"ca\.key: the key is encrypted"):
        pki.issue(ca.dir, "gw-1", tmp_path / "o", site=SITE)
    with pytest.raises(PkiError, match=r"ca\.key: .*wrong passphrase") as info:
        pki.issue(ca.dir, "gw-1", tmp_path / "o", site=SITE, passphrase=b"wrong")
    assert "correct horse" not in str(info.value)
    pki.issue(ca.dir, "gw-1", tmp_path / "o", site=SITE, passphrase=secret)
    with pytest.raises(PkiError, match="already issued as a device"):
        pki.issue(ca.dir, "gw-1", tmp_path / "o2", kind="service", passphrase=secret)
    pki.issue(ca.dir, "gw-1", tmp_path / "o2", site=SITE, passphrase=secret, force=True)
    with pytest.raises(PkiError, match="reserved"):
        pki.issue(ca.dir, "ca", ca.dir, site=SITE, passphrase=secret)
    with pytest.raises(PkiError, match="needs at least one host"):
        pki.issue(ca.dir, "broker", tmp_path / "s", kind="server", passphrase=secret)
    with pytest.raises(PkiError, match="only for server"):
        pki.issue(ca.dir, "gw-3", tmp_path / "s", hosts=["x"], site=SITE, passphrase=secret)
    with pytest.raises(PkiError, match=r"gw-3: a device certificate needs its site"):
        pki.issue(ca.dir, "gw-3", tmp_path / "s", passphrase=secret)
    with pytest.raises(PkiError, match=r"site 'a/b' is not a valid name"):
        pki.issue(ca.dir, "gw-3", tmp_path / "s", site="a/b", passphrase=secret)
    with pytest.raises(PkiError, match="a site is only for device certificates, not service"):
        pki.issue(ca.dir, "svc", tmp_path / "s", kind="service", site=SITE, passphrase=secret)
    assert not (tmp_path / "s").exists()
    with pytest.raises(PkiError, match="no CA here"):
        pki.issue(tmp_path / "nowhere", "gw-1", tmp_path / "o", site=SITE)
    (tmp_path / "junk.crt").write_text("not a cert")
    with pytest.raises(PkiError, match=r"junk\.crt: not a PEM"):
        pki.fingerprint(tmp_path / "junk.crt")
    assert issubclass(PkiError, FleetError)


def test_validity_follows_the_given_clock(tmp_path: Path) -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    ca = pki.init_ca(tmp_path / "ca", now=now, days=10)
    dev = pki.issue(ca.dir, "gw-1", tmp_path / "o", site=SITE, days=825, now=now)
    cert = pki.read_cert(dev.cert)
    # Capped at the CA's expiry, and backdated a little for gateways with slow clocks.
    assert cert.not_valid_after_utc == now + timedelta(days=10)
    assert now - timedelta(minutes=10) < cert.not_valid_before_utc < now


def _issued(
    name: str, site: str | None, *, kind: pki.Kind = "device", revoked: bool = False
) -> pki.IssuedCert:
    return pki.IssuedCert(
        name, kind, "AB", 1, datetime(2030, 1, 1, tzinfo=UTC), Path(name), revoked, site
    )


def test_rendered_config_and_acl() -> None:
    conf = render_broker_config(
        ca=Path("/etc/ef/ca.crt"),
        server_cert=Path("/etc/ef/broker.crt"),
        server_key=Path("/etc/ef/broker.key"),
        acl_path=Path("/etc/ef/acl"),
        persistence_dir=Path("/var/lib/ef"),
        sizing=Sizing(devices=10, msgs_per_min=100, outage_min=3, msg_bytes=500, autosave_s=7),
    )
    for line in (
        "listener 8883 0.0.0.0",
        "require_certificate true",
        "use_identity_as_username true",
        "tls_version tlsv1.2",
        "allow_anonymous false",
        "acl_file /etc/ef/acl",
        # Durable, and sized: 10 devices x 100 msg/min x 3 min.
        "persistence true",
        "persistence_location /var/lib/ef/",
        "autosave_interval 7",
        "max_queued_messages 3000",
        "max_queued_bytes 1500000",
    ):
        assert line in conf.splitlines(), line
    assert "127.0.0.1" not in conf  # no plain listener unless asked for
    with pytest.raises(PkiError, match="spans lines"):
        render_broker_config(
            ca=Path("/x\nallow_anonymous true"),
            server_cert=Path("/c"),
            server_key=Path("/k"),
            acl_path=Path("/a"),
            persistence_dir=Path("/d"),
        )
    with pytest.raises(PkiError, match="also the TLS port"):
        render_broker_config(
            ca=Path("/c"),
            server_cert=Path("/c"),
            server_key=Path("/k"),
            acl_path=Path("/a"),
            persistence_dir=Path("/d"),
            plain_port=8883,
        )
    devices = [
        _issued("gw-1", "plant-1"),
        _issued("gw-2", "plant-2"),
        _issued("gw-3", "plant-1", revoked=True),
        _issued("gw-old", None),
        _issued("svc", None, kind="service"),
    ]
    text = render_acl("fleet-svc", devices)
    acl = text.splitlines()
    assert "user fleet-svc" in acl
    assert "topic write edgefleet/v1/+/+/cmd/#" in acl
    # Each device: its site and name written out, no pattern, no `+`.
    gw1 = acl[acl.index("user gw-1") + 1 : acl.index("user gw-1") + 6]
    assert gw1 == [
        "topic write edgefleet/v1/plant-1/gw-1/state",
        "topic write edgefleet/v1/plant-1/gw-1/telemetry",
        "topic write edgefleet/v1/plant-1/gw-1/decision",
        "topic write edgefleet/v1/plant-1/gw-1/ota/status",
        "topic read edgefleet/v1/plant-1/gw-1/cmd/#",
    ]
    assert "topic write edgefleet/v1/plant-2/gw-2/state" in acl
    assert not [ln for ln in acl if ln.startswith("pattern")]
    # Revoked, site-less and service certificates get nothing.
    assert "gw-3" not in text
    assert "user gw-old" not in acl
    assert "# gw-old: its certificate names no site, so it gets no rights; re-issue it" in acl
    assert "user svc" not in acl


def test_sizing_follows_the_fleet_and_the_agent_defaults() -> None:
    # An agent on its defaults: 1 telemetry message a second, a decision per window.
    derived = default_agent_msgs_per_min()
    assert derived == pytest.approx(60 + 100 / 64 * 60)
    assert Sizing().msgs_per_min == math.ceil(derived)
    assert agent_msgs_per_min(
        telemetry_period_ms=50, telemetry_batch=4, rate_hz=200, hop=32
    ) == pytest.approx(300 + 375)
    default = Sizing()
    assert default.messages == 1000 * 154 * 30
    assert default.queued_bytes == default.messages * 640
    first, cost = default.summary()
    assert first.startswith("1,000 devices x 154 msg/min x 30 min without `fleet serve` = ")
    assert "4,620,000 messages queued per ingest session" in first
    assert "2.8 GiB at 640 B each" in first
    assert "about 4.3 GiB of broker memory" in cost
    assert "a crash or power cut what arrived in the last 60 s" in cost
    for bad in ({"devices": 0}, {"outage_min": -1}, {"msgs_per_min": float("nan")}):
        with pytest.raises(PkiError, match="broker sizing: "):
            Sizing(**bad)


# --- the CLI --------------------------------------------------------------------------------


def _app() -> typer.Typer:
    # Mounted the way fleet.cli mounts them.
    app = typer.Typer()
    app.add_typer(pki_app, name="pki")
    app.command("broker-config")(broker_config_cmd)
    return app


def test_cli_init_issue_list_and_broker_config(tmp_path: Path) -> None:
    runner = CliRunner()
    app = _app()
    d = str(tmp_path / "pki")
    pw = tmp_path / "pw"
    pw.write_text("s3cret passphrase\n")

    r = runner.invoke(app, ["pki", "init", "--dir", d, "--passphrase-file", str(pw)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["pki", "init", "--dir", d])
    assert r.exit_code == 1
    assert "refusing to overwrite" in r.output

    r = runner.invoke(app, ["pki", "issue", "gw-1", "--dir", d, "--passphrase-file", str(pw)])
    assert r.exit_code == 1
    assert "gw-1: a device certificate needs its site" in r.output
    r = runner.invoke(
        app, ["pki", "issue", "gw-1", "--site", "s", "--dir", d, "--passphrase-file", str(pw)]
    )
    assert r.exit_code == 0, r.output
    assert "site               s (edgefleet/v1/s/gw-1/...)" in r.output
    assert "the broker grants gw-1 nothing until its ACL names it" in r.output
    assert _mode(tmp_path / "pki" / "issued" / "gw-1" / "gw-1.key") == 0o600
    r = runner.invoke(
        app,
        ["pki", "issue", "fleet", "--dir", d, "--kind", "service", "--passphrase-file", str(pw)],
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["pki", "issue", "gw+1", "--dir", d, "--passphrase-file", str(pw)])
    assert r.exit_code == 1
    assert "not a valid name" in r.output
    r = runner.invoke(app, ["pki", "issue", "gw-2", "--dir", d, "--kind", "robot"])
    assert r.exit_code == 2

    r = runner.invoke(app, ["pki", "list", "--dir", d, "--json"])
    assert r.exit_code == 0, r.output
    listed = json.loads(r.stdout)
    assert [(c["name"], c["kind"], c["site"]) for c in listed] == [
        ("fleet", "service", None),
        ("gw-1", "device", "s"),
    ]
    assert listed[1]["fingerprint"] == pki.fingerprint(
        tmp_path / "pki" / "issued" / "gw-1" / "gw-1.crt"
    )
    assert datetime.strptime(listed[1]["not_after"], "%Y-%m-%dT%H:%M:%SZ")
    r = runner.invoke(app, ["pki", "list", "--dir", d])
    assert r.exit_code == 0
    assert "gw-1" in r.output
    assert "revoked" not in r.output

    r = runner.invoke(app, ["pki", "revoke", "gw-1", "--dir", d])
    assert r.exit_code == 1  # the CA key is encrypted
    assert "give its passphrase" in r.output
    r = runner.invoke(app, ["pki", "revoke", "gw-1", "--dir", d, "--passphrase-file", str(pw)])
    assert r.exit_code == 0, r.output
    assert "revoked gw-1 (serial " in r.output
    assert "1 revoked in all" in r.output
    r = runner.invoke(app, ["pki", "revoke", "gw-1", "--dir", d, "--passphrase-file", str(pw)])
    assert r.exit_code == 1
    assert "revoked already" in r.output
    r = runner.invoke(app, ["pki", "list", "--dir", d, "--json"])
    assert [(c["name"], c["revoked"]) for c in json.loads(r.stdout)] == [
        ("fleet", False),
        ("gw-1", True),
    ]
    r = runner.invoke(app, ["pki", "list", "--dir", d])
    assert "revoked" in r.output
    r = runner.invoke(
        app,
        [
            "pki",
            "issue",
            "gw-1",
            "--site",
            "s",
            "--dir",
            d,
            "--passphrase-file",
            str(pw),
            "--force",
        ],
    )
    assert r.exit_code == 0, r.output

    out = tmp_path / "broker"
    port = free_port()
    args = ["broker-config", "--pki-dir", d, "--out-dir", str(out), "--port", str(port)]
    args += ["--host", "127.0.0.1", "--run-as", login_name(), "--passphrase-file", str(pw)]
    args += ["--log-file", str(out / "mosquitto.log")]
    args += ["--devices", "20", "--outage-min", "10", "--msgs-per-min", "12.5"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "(issued)" in r.output
    assert "(1 device granted their topics)" in r.output
    # What the queues were sized for, and what that costs the broker.
    assert "sized   20 devices x 12.5 msg/min x 10 min without `fleet serve` = 2,500 " in r.output
    assert "memory  a full backlog takes about 2.4 MiB of broker memory" in r.output
    assert f"data    {out / 'data'} (persistence" in r.output
    assert "max_queued_messages 2500\n" in (out / "mosquitto.conf").read_text()
    assert _mode(out / "broker.key") == 0o600
    # A second run keeps the broker's certificate (it was issued by this CA).
    first = (out / "broker.crt").read_bytes()
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "(kept)" in r.output
    assert (out / "broker.crt").read_bytes() == first

    # The CLI's files run as they are, and admit gw-1.
    broker = Mosquitto(out, port=port, config=(out / "mosquitto.conf").read_text())
    broker.start()
    try:
        holder = tmp_path / "pki" / "issued" / "gw-1"
        gw1 = Peer(port, out / "ca.crt", holder / "gw-1.crt", holder / "gw-1.key", client_id="g")
        gw1.start()
        assert gw1.publish("edgefleet/v1/s/gw-1/telemetry", b"x") in ACCEPTED
        assert gw1.publish("edgefleet/v1/s/gw-2/telemetry", b"x") == NOT_AUTHORIZED
        gw1.stop()
    finally:
        broker.stop()


def test_revocation_errors_and_the_list_is_checked_before_use(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca")
    assert pki.revoked_serials(ca.dir) == frozenset()  # init made an empty, signed list
    with pytest.raises(PkiError, match="never issued a certificate named 'gw-9'"):
        pki.revoke(ca.dir, "gw-9")
    with pytest.raises(PkiError, match="not a valid name"):
        pki.revoke(ca.dir, "gw/1")
    first = pki.issue(ca.dir, "gw-1", tmp_path / "a", site=SITE)
    # A forced re-issue (a lost key) keeps the replaced certificate for revocation.
    second = pki.issue(ca.dir, "gw-1", tmp_path / "b", site=SITE, force=True)
    done = pki.revoke(ca.dir, "gw-1")
    assert set(done.serials) == {
        read_cert(first.cert).serial_number,
        read_cert(second.cert).serial_number,
    }
    assert pki.revoked_serials(ca.dir) == frozenset(done.serials)
    # The list names the CA as issuer and verifies with its key (what OpenSSL checks).
    crl = x509.load_pem_x509_crl((ca.dir / pki.CRL).read_bytes())
    assert crl.issuer == read_cert(ca.cert).subject
    assert crl.next_update_utc == read_cert(ca.cert).not_valid_after_utc
    # A list signed by another CA, or damaged, is never trusted (it could un-revoke).
    rogue = pki.init_ca(tmp_path / "rogue", name="EdgeFleet CA")
    (ca.dir / pki.CRL).write_bytes((rogue.dir / pki.CRL).read_bytes())
    with pytest.raises(PkiError, match="not signed by the CA"):
        pki.list_issued(ca.dir)
    with pytest.raises(PkiError, match="not signed by the CA"):
        pki.revoke(ca.dir, "gw-1")
    (ca.dir / pki.CRL).write_bytes(b"-----BEGIN X509 CRL-----\ngarbage\n-----END X509 CRL-----\n")
    with pytest.raises(PkiError, match="not a PEM certificate revocation list"):
        pki.revoked_serials(ca.dir)
    # A lost list is signed again from the journal by broker-config: nothing un-revoked.
    (ca.dir / pki.CRL).unlink()
    files = write_broker_config(ca.dir, tmp_path / "broker")
    rebuilt = x509.load_pem_x509_crl(files.crl.read_bytes())
    assert {e.serial_number for e in rebuilt} == set(done.serials)
    assert files.crl.read_bytes() == (ca.dir / pki.CRL).read_bytes()
    assert f"crlfile {files.crl}\n" in files.conf.read_text()
    # A CA made before revocation existed (no list, no journal) gets an empty one.
    old_ca = pki.init_ca(tmp_path / "old")
    (old_ca.dir / pki.CRL).unlink()
    old_files = write_broker_config(old_ca.dir, tmp_path / "old-broker")
    assert list(x509.load_pem_x509_crl(old_files.crl.read_bytes())) == []
    # Devices do not check the list: a revoked broker certificate is replaced, not kept.
    server = read_cert(files.server_cert).serial_number
    pki.revoke(ca.dir, "broker")
    again = write_broker_config(ca.dir, tmp_path / "broker")
    assert again.issued_server_cert
    assert read_cert(again.server_cert).serial_number != server


def test_broker_config_refuses_a_device_as_the_fleet_identity(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca")
    pki.issue(ca.dir, "fleet", tmp_path / "o", site=SITE)  # a *device* named fleet
    with pytest.raises(PkiError, match="must be a service certificate"):
        write_broker_config(ca.dir, tmp_path / "b")
    r = CliRunner().invoke(
        _app(), ["broker-config", "--pki-dir", str(ca.dir), "--out-dir", str(tmp_path / "b")]
    )
    assert r.exit_code == 1
    assert "must be a service certificate" in r.output


def test_broker_config_refuses_a_server_certificate_from_another_ca(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca")
    other = pki.init_ca(tmp_path / "other")
    pki.issue(other.dir, "broker", tmp_path / "b", kind="server", hosts=["localhost"])
    with pytest.raises(PkiError, match="not issued by the CA"):
        write_broker_config(ca.dir, tmp_path / "b")


def test_sync_registry_puts_every_device_at_its_certificates_site(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca")
    for name, site in (("gw-1", "plant1"), ("gw-2", "plant2"), ("gw-3", "plant1")):
        pki.issue(ca.dir, name, tmp_path / name, site=site)
    pki.issue(ca.dir, "fleet", tmp_path / "fleet", kind="service")
    pki.revoke(ca.dir, "gw-3")
    url = f"sqlite://{tmp_path / 'fleet.db'}"
    store = open_store(url)
    store.migrate()
    # gw-2 was moved by a forged birth before sites were fixed; gw-3 is revoked.
    store.register_device("gw-2", "other-site", "press")
    store.register_device("gw-3", "elsewhere")
    store.close()
    runner, app = CliRunner(), _app()
    args = ["pki", "sync-registry", "--dir", str(ca.dir), "--store", url]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split() == ["gw-1", "plant1", "registered"]
    assert lines[1].split() == ["gw-2", "plant2", "moved", "from", "other-site"]
    assert lines[2] == (
        "2 changed, 0 already at their certificate's site, 1 revoked or without a site left alone"
    )
    store = open_store(url)
    try:
        got = {d.device: (d.site, d.device_type) for d in store.devices()}
        assert got == {
            "gw-1": ("plant1", "generic"),
            "gw-2": ("plant2", "press"),  # its type kept
            "gw-3": ("elsewhere", "generic"),  # revoked: left alone
        }
    finally:
        store.close()
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert r.output.startswith("0 changed, 2 already at their certificate's site")
    r = runner.invoke(
        app, ["pki", "sync-registry", "--dir", str(tmp_path / "no-ca"), "--store", url]
    )
    assert r.exit_code == 1
    assert "no CA here" in r.output
    assert runner.invoke(app, ["pki", "sync-registry", "--dir", str(ca.dir)]).exit_code == 2
