"""Mosquitto 2.x configuration for the fleet: mutual TLS, the certificate CN as the username,
and an ACL that confines every device to its own topic root.

What Mosquitto 2.0.11 does with it (pinned by ``tests/test_fleet_pki.py``):

- A client without a certificate, with one from another CA, or with one on the CA's
  revocation list (``crlfile``; reloaded with the certificates on SIGHUP), is refused during
  TLS: with
  TLS 1.3 the client's handshake completes and the broker then drops the connection ("peer
  did not return a certificate" / "certificate verify failed"), so no CONNACK ever arrives.
- ``use_identity_as_username`` makes the CN the username, whatever CONNECT says, so
  ``pattern ... %u`` lines give each device exactly its own ``edgefleet/v1/{site}/{CN}/...``.
  ``+`` inside a pattern line is an ordinary wildcard once ``%u`` is substituted.
- A publish outside the ACL is dropped; at QoS 1 over MQTT 5 the broker answers PUBACK with
  reason code 135 (Not authorized) and keeps the client connected. (An allowed publish that
  nobody is subscribed to gets 16, No matching subscribers, not 0.)
- A Last Will outside the ACL is accepted at CONNECT (CONNACK 0) and dropped when it fires.
- Subscriptions are NOT checked against ``acl_file`` (its check returns success for
  SUBSCRIBE, "FIXME - implement ACL subscription strings", in 2.0 and in 2.1's acl-file
  plugin): every SUBACK grants. Instead each message, retained ones included, is checked
  against the receiver's ``read`` rules on delivery, so a device subscribed to another
  device's ``cmd/#``, or to ``#``, receives nothing that is not its own. The same holds for
  ``$share/{group}/...``: the real topic is checked on delivery, so the fleet needs no
  ``$share`` rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from fleet import pki
from fleet.errors import PkiError
from wire.topics import PREFIX, UPLINK_KINDS

CONF_NAME = "mosquitto.conf"
ACL_NAME = "acl"
DEFAULT_SERVER_NAME = "broker"


def _value(what: str, value: object) -> str:
    # Mosquitto reads one option per line; a newline in a path would inject another option.
    text = str(value)
    if not text or "\n" in text or "\r" in text:
        raise PkiError(f"broker config: {what} {text!r} is empty or spans lines")
    return text


def render_broker_config(
    *,
    ca: Path,
    server_cert: Path,
    server_key: Path,
    port: int = 8883,
    fleet_identity: str = "fleet",
    acl_path: Path,
    crl: Path | None = None,
    bind: str = "0.0.0.0",  # noqa: S104 - a broker listens for gateways on the site network
    persistence_dir: Path | None = None,
    plain_port: int | None = None,
    log_file: Path | None = None,
    run_as: str | None = None,
) -> str:
    """``mosquitto.conf`` text: one mutual-TLS listener on ``bind:port``.

    ``plain_port`` adds a loopback-only listener without TLS for local monitoring; anonymous
    clients there get only what the ACL grants anonymous users (``$SYS/#`` read), so it opens
    no path to device topics. ``log_file`` None logs to stderr (journald under systemd).
    ``crl``: the CA's revocation list, checked for every client certificate.

    Started as root, Mosquitto 2.x switches to ``run_as`` (default: the ``mosquitto`` user)
    *before* it opens the key and the log, so that user must be able to read the 0600 key.
    """
    for what, p in (("port", port), ("plain_port", plain_port)):
        if p is not None and not 0 < p < 65536:
            raise PkiError(f"broker config: {what} {p} is not a TCP port")
    if plain_port == port:
        raise PkiError(f"broker config: plain_port {plain_port} is also the TLS port")
    pki.check_name(fleet_identity)
    lines = [
        "# EdgeFleet broker (Mosquitto 2.x), written by `fleet broker-config`.",
        f"# Fleet service identity (certificate CN): {fleet_identity}",
        # Each listener gets its own auth settings: the TLS one admits only certificate
        # holders, the optional loopback one only anonymous monitoring.
        "per_listener_settings true",
    ]
    if run_as is not None:
        lines.append(f"user {_value('run_as', run_as)}")
    if persistence_dir is not None:
        lines += [
            "persistence true",
            f"persistence_location {_value('persistence_dir', persistence_dir)}/",
        ]
    else:
        lines.append("persistence false")
    if log_file is not None:
        lines.append(f"log_dest file {_value('log_file', log_file)}")
    else:
        lines.append("log_dest stderr")
    lines += [
        "log_type error",
        "log_type warning",
        "log_type notice",
        "log_type information",
        "",
        f"listener {port} {_value('bind', bind)}",
        f"cafile {_value('ca', ca)}",
        *([f"crlfile {_value('crl', crl)}"] if crl is not None else []),
        f"certfile {_value('server_cert', server_cert)}",
        f"keyfile {_value('server_key', server_key)}",
        # The minimum version in Mosquitto 2.x (1.6 took it as the only one); 1.3 still works.
        "tls_version tlsv1.2",
        "require_certificate true",
        "use_identity_as_username true",
        "allow_anonymous false",
        f"acl_file {_value('acl_path', acl_path)}",
    ]
    if plain_port is not None:
        lines += [
            "",
            f"listener {plain_port} 127.0.0.1",
            "allow_anonymous true",
            f"acl_file {_value('acl_path', acl_path)}",
        ]
    return "\n".join(lines) + "\n"


def render_acl(fleet_identity: str = "fleet") -> str:
    """The ACL file for ``render_broker_config``'s listeners (Mosquitto ``acl_file`` syntax)."""
    pki.check_name(fleet_identity)
    root = f"{PREFIX}/+/%u"
    lines = [
        "# EdgeFleet broker ACL, written by `fleet broker-config`.",
        "# Usernames are certificate CNs (use_identity_as_username).",
        "",
        "# Anonymous clients (only the loopback monitoring listener admits any): broker stats.",
        "topic read $SYS/#",
        "",
        "# The fleet service reads every uplink and sends commands to any device. Shared",
        "# subscriptions ($share/<group>/...) need no rule of their own: Mosquitto checks",
        "# each delivery against its real topic.",
        f"user {fleet_identity}",
        f"topic read {PREFIX}/#",
        f"topic write {PREFIX}/+/+/cmd/#",
        "topic read $SYS/#",
        "",
        "# Every device: publish only its own uplink kinds, read only its own commands.",
        *(f"pattern write {root}/{kind}" for kind in UPLINK_KINDS),
        f"pattern read {root}/cmd/#",
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class BrokerFiles:
    conf: Path
    acl: Path
    ca_cert: Path
    crl: Path
    server_cert: Path
    server_key: Path
    #: True if this run issued the server certificate (it was missing).
    issued_server_cert: bool


def write_broker_config(
    pki_dir: Path,
    out_dir: Path,
    *,
    port: int = 8883,
    fleet_identity: str = "fleet",
    server_name: str = DEFAULT_SERVER_NAME,
    hosts: list[str] | None = None,
    bind: str = "0.0.0.0",  # noqa: S104 - see render_broker_config
    persistence_dir: Path | None = None,
    plain_port: int | None = None,
    log_file: Path | None = None,
    run_as: str | None = None,
    passphrase: bytes | None = None,
) -> BrokerFiles:
    """Write ``mosquitto.conf``, ``acl``, ``ca.crt``, ``crl.pem`` (the CA's revocation list,
    signed now if the CA has none yet) and (if missing) a server certificate for ``hosts``
    into ``out_dir``, all durably. Run it again after ``fleet pki revoke``, then reload the
    broker. An existing server certificate is kept only if
    this CA issued it; one from another CA is an error, not silently replaced.

    Refuses a ``fleet_identity`` that the CA issued as a *device* certificate: that device
    would get the fleet's rights.
    """
    pki.check_name(fleet_identity)
    pki.check_name(server_name)
    ca_cert = pki_dir / pki.CA_CERT
    if not ca_cert.exists():
        raise PkiError(f"{pki_dir}: no CA here ({pki.CA_CERT}); run `fleet pki init`")
    recorded = pki_dir / pki.REGISTRY / f"{fleet_identity}.crt"
    if recorded.exists():
        kind = pki.cert_kind(pki.read_cert(recorded), recorded)
        if kind != "service":
            raise PkiError(
                f"{recorded}: the fleet identity {fleet_identity!r} was issued as a {kind} "
                "certificate; the fleet identity must be a service certificate"
            )
    out_dir = out_dir.absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    server_cert, server_key = out_dir / f"{server_name}.crt", out_dir / f"{server_name}.key"
    issued = False
    revoked = pki.revoked_serials(pki_dir)
    keep = (
        server_cert.exists()
        and server_key.exists()
        # Devices do not check the revocation list: a revoked broker certificate is replaced.
        and pki.verify_issued_by(server_cert, ca_cert).serial_number not in revoked
    )
    if not keep:
        pki.issue(
            pki_dir,
            server_name,
            out_dir,
            kind="server",
            hosts=hosts or ["localhost", "127.0.0.1", "::1"],
            passphrase=passphrase,
            force=True,
        )
        issued = True
    local_ca = out_dir / pki.CA_CERT
    if local_ca.resolve() != ca_cert.resolve():
        pki.write_durable(local_ca, ca_cert.read_bytes())
    crl = pki.current_crl(pki_dir, passphrase=passphrase)
    local_crl = out_dir / pki.CRL
    if local_crl.resolve() != (pki_dir / pki.CRL).resolve():
        pki.write_durable(local_crl, crl.public_bytes(serialization.Encoding.PEM))
    acl = out_dir / ACL_NAME
    conf = out_dir / CONF_NAME
    pki.write_durable(acl, render_acl(fleet_identity).encode())
    pki.write_durable(
        conf,
        render_broker_config(
            ca=local_ca,
            server_cert=server_cert,
            server_key=server_key,
            port=port,
            fleet_identity=fleet_identity,
            acl_path=acl,
            crl=local_crl,
            bind=bind,
            persistence_dir=persistence_dir,
            plain_port=plain_port,
            log_file=log_file,
            run_as=run_as,
        ).encode(),
    )
    return BrokerFiles(conf, acl, local_ca, local_crl, server_cert, server_key, issued)
