"""The uplink against a real Mosquitto: delivery, outages, kill -9, Last Will, auth.

A paho subscriber in the test plays the fleet: persistent MQTT 5 session (clean_start=False,
session expiry), QoS 1, dedup by ``(boot_id, seq)`` as the fleet's ingest does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edge_agent.uplink.publisher import Uplink
from tests.support.mosquitto import Mosquitto, mosquitto
from tests.support.ports import free_port
from tests.support.uplink import (
    DEVICE,
    ROOT,
    SITE,
    kill9,
    section,
    spawn_device,
    stop,
    subscriber,
    until,
    uplink,
    wait_line,
)
from tests.support.uplink_device_proc import MODEL_SHA, make_decision

pytestmark = pytest.mark.peers


def test_end_to_end_500_decisions_in_order(tmp_path: Path) -> None:
    with mosquitto(tmp_path / "broker") as broker, subscriber(broker.port) as sub:
        up = uplink(section(broker.port), tmp_path / "state")

        async def main() -> None:
            task = asyncio.create_task(up.run())
            for i in range(500):
                assert up.publish_decision(make_decision(i))
            await until(lambda: len(sub.of("decision")) >= 500, 20, "500 decisions")
            await until(lambda: up.stats()["outbox_rows"] == 0, 5, "an empty outbox")
            await stop(task)

        asyncio.run(main())
        decisions = sub.of("decision")
        assert [d.seq for d in decisions] == list(range(500))
        assert {d.boot_id for d in decisions} == {up.session.boot_id}
        assert decisions[7].label == "bearing_wear"
        assert decisions[7].window.seq == 7
        stats = up.stats()
        assert stats["acked"] == 500
        assert stats["dropped"] == {}
        sub.wait(lambda: len(sub.states()) >= 2, 5, "birth and clean offline")
        states = sub.states()
        assert states[0][0].state == "online"
        assert states[0][0].boot_id == up.session.boot_id
        assert states[0][0].model_sha256 == MODEL_SHA
        assert states[0][0].site == SITE
        assert states[-1][0].state == "offline"
        assert states[-1][0].clean is True
        assert states[-1][0].seq == 500  # the watermark: 500 numbered (0..499)
    # The birth was retained: a new subscriber after the fact still sees the device's state.
    with mosquitto(tmp_path / "broker2") as broker:
        up = uplink(section(broker.port), tmp_path / "state2")

        async def birth_only() -> None:
            task = asyncio.create_task(up.run())
            await until(lambda: up.stats()["connected"] is True, 10, "connect")
            with subscriber(broker.port, "late") as late:
                await until(lambda: bool(late.states()), 5, "the retained birth")
                st, retained = late.states()[0]
                assert retained
                assert st.state == "online"
                assert st.boot_id == up.session.boot_id
            await stop(task)

        asyncio.run(birth_only())


def test_messages_nobody_subscribed_to_stay_until_the_fleet_subscribes(tmp_path: Path) -> None:
    """Mosquitto 2.0 forgets shared subscriptions of persistent sessions over a restart; a
    PUBACK "no matching subscribers" must not cost the message: it is sent again later."""
    with mosquitto(tmp_path / "broker") as broker:
        up = uplink(section(broker.port), tmp_path / "state")

        async def main() -> None:
            task = asyncio.create_task(up.run())
            await until(lambda: up.stats()["connected"] is True, 10, "connect")
            for i in range(20):
                up.publish_decision(make_decision(i))
            await until(lambda: up.pump.no_subscribers >= 1, 5, "PUBACK 16")
            assert up.stats()["outbox_rows"] == 20  # nobody got them: all kept
            with subscriber(broker.port, "fleet-late") as sub:
                await until(lambda: len(sub.of("decision")) >= 20, 10, "20 decisions")
                await until(lambda: up.stats()["outbox_rows"] == 0, 5, "an empty outbox")
                assert sorted({d.seq for d in sub.of("decision")}) == list(range(20))
            await stop(task)

        asyncio.run(main())


def test_broker_outage_10s_every_seq_exactly_once(tmp_path: Path) -> None:
    with mosquitto(tmp_path / "broker") as broker, subscriber(broker.port) as sub:
        up = uplink(section(broker.port, replay_rate_per_s=500.0), tmp_path / "state")
        produced = 0

        async def main() -> None:
            nonlocal produced
            task = asyncio.create_task(up.run())
            await until(lambda: up.stats()["connected"] is True, 10, "connect")
            t0 = time.monotonic()
            t_down: float | None = None
            restarted = False
            while time.monotonic() - t0 < 16:  # ~100 decisions/s throughout
                up.publish_decision(make_decision(produced))
                produced += 1
                if t_down is None and time.monotonic() - t0 >= 2:
                    await asyncio.to_thread(broker.stop)  # SIGTERM: persistence saved
                    t_down = time.monotonic()
                if t_down is not None and not restarted and time.monotonic() - t_down >= 10:
                    await asyncio.to_thread(broker.start)
                    restarted = True
                await asyncio.sleep(0.01)
            await until(lambda: up.stats()["outbox_rows"] == 0, 30, "the backlog to drain")
            await stop(task)

        asyncio.run(main())
        try:
            sub.wait(lambda: len(sub.unique_decisions()) >= produced, 30, "every decision")
        except AssertionError:
            missing = sorted(set(range(produced)) - {k[1] for k in sub.unique_decisions()})
            raise AssertionError(
                f"missing {len(missing)} seqs: {missing[:5]}..{missing[-5:]}; subscriber "
                f"connects (t, session_present): {sub.connects}; uplink: {up.stats()}"
            ) from None
        got = sub.of("decision")
        unique = sub.unique_decisions()
        assert sorted(k[1] for k in unique) == list(range(produced))
        assert {k[0] for k in unique} == {up.session.boot_id}
        duplicates = len(got) - len(unique)
        stats = up.stats()
        print(
            f"\noutage: produced={produced} received={len(got)} duplicates={duplicates} "
            f"sent={stats['sent']} reconnects={stats['reconnects']}"
        )
        assert int(str(stats["reconnects"])) >= 1
        assert stats["dropped"] == {}
        # The fleet's session outlived the broker restart (the premise of "nothing lost").
        assert [present for _, present in sub.connects] == [False, True]
        # Outage 10 s at ~100/s: about 1000 messages waited in the outbox.
        assert produced > 1000


def test_sigkill_with_full_outbox_then_restart_drains_old_boot_first(tmp_path: Path) -> None:
    state = tmp_path / "state"
    broker = Mosquitto(tmp_path / "broker")  # its port, not running yet: the broker is down
    first = spawn_device(state, broker.port, 300)
    try:
        produced = wait_line(first, lambda o: o["event"] == "produced")
        stats = wait_line(first, lambda o: o["event"] == "stats")
        assert stats["outbox_rows"] == 300
        assert stats["connected"] is False
        old_boot = produced["boot_id"]
    finally:
        kill9(first)
    broker.start()
    try:
        with subscriber(broker.port) as sub:
            second = spawn_device(state, broker.port, 100)
            try:
                new_boot = wait_line(second, lambda o: o["event"] == "produced")["boot_id"]
                sub.wait(lambda: len(sub.unique_decisions()) >= 400, 30, "400 decisions")
                second.send_signal(signal.SIGTERM)
                wait_line(second, lambda o: o["event"] == "stopped")
                second.wait(10)
            finally:
                if second.poll() is None:
                    kill9(second)
                elif second.stdout is not None:
                    second.stdout.close()
            assert new_boot != old_boot
            unique = sub.unique_decisions()
            assert sorted(s for b, s in unique if b == old_boot) == list(range(300))
            assert sorted(s for b, s in unique if b == new_boot) == list(range(100))
            order = [(d.boot_id, d.seq) for d in sub.of("decision")]
            first_new = next(i for i, k in enumerate(order) if k[0] == new_boot)
            assert all(k[0] == old_boot for k in order[:first_new])
            assert [k[1] for k in order[:300]] == list(range(300))
            sub.wait(lambda: sub.states()[-1][0].state == "offline", 5, "clean offline")
            births = [s for s, _ in sub.states() if s.state == "online"]
            assert births[0].boot_id == new_boot
            assert sub.states()[-1][0].clean is True
    finally:
        broker.stop()


def test_last_will_marks_a_killed_device_offline(tmp_path: Path) -> None:
    with mosquitto(tmp_path / "broker") as broker, subscriber(broker.port) as sub:
        proc = spawn_device(tmp_path / "state", broker.port, 5)
        try:
            boot = wait_line(proc, lambda o: o["event"] == "produced")["boot_id"]
            sub.wait(lambda: len(sub.of("decision")) >= 5, 15, "5 decisions")
            sub.wait(lambda: any(s.state == "online" for s, _ in sub.states()), 5, "birth")
        finally:
            kill9(proc)
        sub.wait(lambda: sub.states()[-1][0].state == "offline", 10, "the Last Will after kill -9")
        will, _ = sub.states()[-1]
        assert will.clean is False
        assert will.boot_id == boot
        with subscriber(broker.port, "late") as late:
            late.wait(lambda: bool(late.states()), 5, "the retained will")
            st, retained = late.states()[0]
            assert retained
            assert st.state == "offline"
            assert st.clean is False


def _auth_broker(workdir: Path, user: str, password: str) -> tuple[int, str]:
    workdir.mkdir(parents=True)
    pwfile = workdir / "passwd"
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(pwfile), user, password],
        check=True,
        capture_output=True,
    )
    pwfile.chmod(0o600)
    port = free_port()
    conf = Mosquitto(workdir, port=port).config_text()
    conf = conf.replace(
        "allow_anonymous true\n", f"allow_anonymous false\npassword_file {pwfile}\n"
    )
    return port, conf


def test_username_password_auth(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "s3cret-Pa55word"
    wrong = "wr0ng-Pa55word"
    port, conf = _auth_broker(tmp_path / "broker", "press-7", secret)
    good_file = tmp_path / "good.pass"
    good_file.write_text(secret + "\n")
    bad_file = tmp_path / "bad.pass"
    bad_file.write_text(wrong + "\n")
    with mosquitto(tmp_path / "broker", port=port, config=conf) as broker:
        # The test's subscriber needs credentials too.
        pw_sub = tmp_path / "broker" / "passwd"
        subprocess.run(["mosquitto_passwd", "-b", str(pw_sub), "fleet", "fleetpw"], check=True)
        broker.restart()
        sub_client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id="fleet-auth", protocol=mqtt.MQTTv5
        )
        sub_client.username_pw_set("fleet", "fleetpw")
        got: list[bytes] = []
        sub_client.on_connect = lambda c, u, f, rc, p: c.subscribe(f"{ROOT}/decision", qos=1)
        sub_client.on_message = lambda c, u, m: got.append(bytes(m.payload))
        sub_client.connect("127.0.0.1", port)
        sub_client.loop_start()
        try:
            good = uplink(
                section(port, username="press-7", password_file=str(good_file)),
                tmp_path / "good",
            )
            bad = uplink(
                section(port, username="press-7", password_file=str(bad_file), client_id="x"),
                tmp_path / "bad",
            )

            async def main() -> None:
                t_good = asyncio.create_task(good.run())
                t_bad = asyncio.create_task(bad.run())
                for i in range(10):
                    good.publish_decision(make_decision(i))
                    bad.publish_decision(make_decision(i))
                await until(lambda: len(got) >= 10, 15, "10 authenticated decisions")
                await until(
                    lambda: int(str(bad.stats()["connect_failures"])) >= 3, 15, "bad retries"
                )
                assert not t_bad.done()
                assert bad.stats()["connected"] is False
                await stop(t_good)
                await stop(t_bad)

            asyncio.run(main())
        finally:
            sub_client.disconnect()
            sub_client.loop_stop()
        assert len(got) == 10
        bs = bad.stats()
        last_error = str(bs["last_error"]).lower()
        assert "not authorized" in last_error or "bad user name or password" in last_error
        assert bs["outbox_rows"] == 10  # nothing lost: kept for when the credentials work
        for record in caplog.records:
            text = record.getMessage() + str(record.args)
            assert secret not in text
            assert wrong not in text
        assert secret not in json.dumps(good.stats())
        assert wrong not in json.dumps(bs)


def test_commands_reach_the_handler_and_socket_gets_priority(tmp_path: Path) -> None:
    with mosquitto(tmp_path / "broker") as broker:
        commands: list[tuple[str, bytes]] = []
        up = Uplink(
            section(broker.port),
            site=SITE,
            device=DEVICE,
            device_type="press",
            agent_version="0.1.0",
            state_dir=tmp_path / "state",
            model_sha256=lambda: MODEL_SHA,
            priority=3,  # <= 6: no CAP_NET_ADMIN needed
            on_command=lambda name, payload: commands.append((name, payload)),
        )
        fleet = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="cmd", protocol=mqtt.MQTTv5)
        fleet.connect("127.0.0.1", broker.port)
        fleet.loop_start()

        async def main() -> None:
            task = asyncio.create_task(up.run())
            await until(lambda: up.stats()["connected"] is True, 10, "connect")
            await asyncio.sleep(0.2)  # the SUBSCRIBE is on its way
            fleet.publish(f"{ROOT}/cmd/ota.offer", b'{"bundle": 1}', qos=1).wait_for_publish(5)
            await until(lambda: bool(commands), 5, "the command")
            sock = up._client.socket() if up._client is not None else None
            assert isinstance(sock, socket.socket)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY) == 3
            await stop(task)

        try:
            asyncio.run(main())
        finally:
            fleet.disconnect()
            fleet.loop_stop()
        assert commands == [("ota.offer", b'{"bundle": 1}')]
        assert up.stats()["socket_priority"] == 3
        assert up.stats()["commands"] == 1


def _pki(d: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a device (client) certificate."""
    import datetime as dt  # noqa: PLC0415
    import ipaddress  # noqa: PLC0415

    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        (d / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{stem}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        (d / f"{stem}.key").chmod(0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("edgefleet test CA"))
        .issuer_name(name("edgefleet test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    write("ca", ca_key, ca)

    def leaf(stem: str, cn: str, san: x509.GeneralName | None) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
        )
        if san is not None:
            b = b.add_extension(x509.SubjectAlternativeName([san]), critical=False)
        write(stem, key, b.sign(ca_key, hashes.SHA256()))

    leaf("server", "127.0.0.1", x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    leaf("device", DEVICE, None)
    return {k: d / f"{k}.pem" for k in ("ca", "server", "device")} | {
        "server_key": d / "server.key",
        "device_key": d / "device.key",
    }


def test_mutual_tls(tmp_path: Path) -> None:
    pki = _pki(tmp_path / "pki")
    plain, tls_port = free_port(), free_port()
    work = tmp_path / "broker"
    conf = Mosquitto(work, port=plain).config_text() + (
        f"listener {tls_port} 127.0.0.1\n"
        f"cafile {pki['ca']}\ncertfile {pki['server']}\nkeyfile {pki['server_key']}\n"
        "require_certificate true\n"
    )
    with mosquitto(work, port=plain, config=conf) as broker, subscriber(broker.port) as sub:
        mtls = uplink(
            section(
                tls_port,
                tls={
                    "ca_file": str(pki["ca"]),
                    "cert_file": str(pki["device"]),
                    "key_file": str(pki["device_key"]),
                },
            ),
            tmp_path / "mtls",
        )
        assert mtls.section.check() == []
        no_cert = Uplink(
            section(tls_port, tls={"ca_file": str(pki["ca"])}, client_id="no-cert"),
            site=SITE,
            device="press-8",
            device_type="press",
            agent_version="0.1.0",
            state_dir=tmp_path / "nocert",
            model_sha256=lambda: MODEL_SHA,
        )

        async def main() -> None:
            t1 = asyncio.create_task(mtls.run())
            t2 = asyncio.create_task(no_cert.run())
            for i in range(5):
                mtls.publish_decision(make_decision(i))
            await until(lambda: len(sub.of("decision")) >= 5, 15, "5 decisions over mTLS")
            await until(lambda: int(str(no_cert.stats()["connect_failures"])) >= 2, 15, "fails")
            assert not t2.done()
            await stop(t1)
            await stop(t2)

        asyncio.run(main())
        assert [d.seq for d in sub.of("decision")] == list(range(5))
        assert no_cert.stats()["connected"] is False
        assert no_cert.stats()["last_error"]


def test_the_next_boot_tells_the_fleet_how_many_seqs_a_killed_boot_numbered(
    tmp_path: Path,
) -> None:
    """A killed boot's Last Will carries the watermark of its last connect (or there is no
    will at all): the fleet could not see a tail the broker dropped. The next boot sends
    the killed boot's final count (an epitaph) before its own birth, once."""
    state = tmp_path / "state"
    killed = uplink(section(free_port()), state)  # no broker there: it never connects
    for i in range(5):
        assert killed.publish_decision(make_decision(i))
    old = killed.session.boot_id
    killed.outbox.close()  # kill -9: no clean stop, no offline
    with mosquitto(tmp_path / "broker") as broker, subscriber(broker.port) as sub:
        for run in range(2):
            up = uplink(section(broker.port), state)

            async def main(up: Uplink = up) -> None:
                task = asyncio.create_task(up.run())
                await until(lambda: up.stats()["outbox_rows"] == 0, 10, "the backlog sent")
                await stop(task)

            asyncio.run(main())
            sub.wait(lambda: len(sub.unique_decisions()) == 5, 10, "the killed boot's rows")
            sub.wait(lambda: sub.states()[-1][0].state == "offline", 5, "the clean offline")
            assert up.stats()["epitaphs"] == (1 if run == 0 else 0)
        states = [s for s, _ in sub.states()]
        epitaphs = [s for s in states if s.boot_id == old]
        assert len(epitaphs) == 1, "acknowledged once, never sent again"
        (epitaph,) = epitaphs
        assert (epitaph.state, epitaph.clean, epitaph.seq) == ("offline", False, 5)
        birth = states[states.index(epitaph) + 1]
        assert birth.state == "online"
        assert birth.boot_id != old
        assert epitaph.t_ns < birth.t_ns, "older than the birth: it never marks it offline"
