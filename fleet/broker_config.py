"""Mosquitto 2.x configuration for the fleet: mutual TLS, the certificate CN as the username,
an ACL that confines every device to its own topic root under the site its certificate
names (a ``user`` block per device, site and name written out: no ``pattern``, no ``+``),
queues sized for an outage of ``fleet serve`` (``fleet.broker_sizing``) and durable
persistence. What Mosquitto 2.0.11 does with it (TLS refusals, ACL reloads on open
connections, unchecked subscriptions): ``docs/ARCHITECTURE.md``, "What the broker does with
its config".
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from fleet import pki
from fleet.broker_sizing import Sizing
from fleet.errors import PkiError
from fleet.ingest.config import MAX_PACKET_BYTES
from wire.topics import PREFIX, UPLINK_KINDS, device_root

CONF_NAME = "mosquitto.conf"
ACL_NAME = "acl"
DATA_NAME = "data"
DEFAULT_SERVER_NAME = "broker"
#: The ACL's header line naming the fleet identity (read back by ``fleet_identity_of``).
_IDENTITY_MARK = "# Fleet service identity: "


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
    persistence_dir: Path,
    sizing: Sizing | None = None,
    crl: Path | None = None,
    bind: str = "0.0.0.0",  # noqa: S104 - a broker listens for gateways on the site network
    plain_port: int | None = None,
    log_file: Path | None = None,
    run_as: str | None = None,
) -> str:
    """``mosquitto.conf`` text: one mutual-TLS listener on ``bind:port``.

    ``plain_port`` adds a loopback-only listener without TLS for local monitoring; anonymous
    clients there get only what the ACL grants anonymous users (``$SYS/#`` read), so it opens
    no path to device topics. ``log_file`` None logs to stderr (journald under systemd).
    ``crl``: the CA's revocation list, checked for every client certificate.
    ``sizing`` (default: ``Sizing()``) sets the queue limits of every persistent session and
    the autosave interval of the persistence file in ``persistence_dir``.

    Started as root, Mosquitto 2.x switches to ``run_as`` (default: the ``mosquitto`` user)
    *before* it opens the key and the log, so that user must be able to read the 0600 key.
    """
    for what, p in (("port", port), ("plain_port", plain_port)):
        if p is not None and not 0 < p < 65536:
            raise PkiError(f"broker config: {what} {p} is not a TCP port")
    if plain_port == port:
        raise PkiError(f"broker config: plain_port {plain_port} is also the TLS port")
    pki.check_name(fleet_identity)
    sizing = sizing or Sizing()
    lines = [
        "# EdgeFleet broker (Mosquitto 2.x), written by `fleet broker-config`.",
        f"# Fleet service identity (certificate CN): {fleet_identity}",
        # Each listener gets its own auth settings: the TLS one admits only certificate
        # holders, the optional loopback one only anonymous monitoring.
        "per_listener_settings true",
    ]
    if run_as is not None:
        lines.append(f"user {_value('run_as', run_as)}")
    lines += [
        "",
        "# What a persistent session (the ingest's, while `fleet serve` is down) may queue;",
        "# past it the broker drops messages the devices were already told it has.",
        *(f"# {line}" for line in sizing.summary()),
        f"max_queued_messages {sizing.messages}",
        f"max_queued_bytes {sizing.queued_bytes}",
        "persistence true",
        f"persistence_location {_value('persistence_dir', persistence_dir)}/",
        f"autosave_interval {sizing.autosave_s}",
        "",
        "# Nothing an agent sends is larger (its payload cap, twice over, as the ingest's",
        "# Maximum Packet Size): a client that sends more is disconnected and logged",
        "# ('disconnected due to oversize packet') instead of acknowledged and dropped unseen.",
        f"max_packet_size {MAX_PACKET_BYTES}",
        "",
    ]
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


def render_acl(fleet_identity: str = "fleet", devices: Sequence[pki.IssuedCert] = ()) -> str:
    """The ACL file for ``render_broker_config``'s listeners (Mosquitto ``acl_file`` syntax).

    Each valid device certificate of ``devices`` gets a ``user`` block naming its site and
    name literally; revoked ones, other kinds and device certificates without a site get
    nothing (the latter a comment saying so).
    """
    pki.check_name(fleet_identity)
    lines = [
        "# EdgeFleet broker ACL, written by `fleet broker-config`.",
        "# Usernames are certificate CNs (use_identity_as_username).",
        f"{_IDENTITY_MARK}{fleet_identity}",
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
        "# Every device: publish only its own uplink kinds under the site its certificate",
        "# names, read only its own commands. A device not listed may do nothing.",
    ]
    for cert in sorted(granted(devices, fleet_identity), key=lambda c: c.name):
        assert cert.site is not None  # granted() keeps only those with one
        root = device_root(cert.site, cert.name)
        lines += [
            "",
            f"user {cert.name}",
            *(f"topic write {root}/{kind}" for kind in UPLINK_KINDS),
            f"topic read {root}/cmd/#",
        ]
    for name in sorted(c.name for c in siteless(devices)):
        lines += ["", f"# {name}: its certificate names no site, so it gets no rights; re-issue it"]
    return "\n".join(lines) + "\n"


def granted(devices: Sequence[pki.IssuedCert], fleet_identity: str) -> list[pki.IssuedCert]:
    """The certificates of ``devices`` that get topic rights: valid device certificates with
    a site (never the fleet identity's name, which has rights of its own)."""
    return [
        c
        for c in devices
        if c.kind == "device" and not c.revoked and c.site is not None and c.name != fleet_identity
    ]


def siteless(devices: Sequence[pki.IssuedCert]) -> list[pki.IssuedCert]:
    """Valid device certificates that name no site (issued before sites were recorded)."""
    return [c for c in devices if c.kind == "device" and not c.revoked and c.site is None]


@dataclass(frozen=True)
class Access:
    """What ``write_access`` wrote: who may do what on the broker now."""

    acl: Path
    crl: Path
    fleet_identity: str
    #: Devices the ACL grants their own topics, as ``(name, site)``.
    devices: tuple[tuple[str, str], ...]
    #: Valid device certificates without a site: the ACL grants them nothing.
    siteless: tuple[str, ...]
    #: Entries on the revocation list.
    revoked: int


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
    persistence_dir: Path
    sizing: Sizing
    access: Access
    #: The user the persistence folder was handed to (this run created it, as root).
    data_owner: str | None = None


def write_access(
    pki_dir: Path, out_dir: Path, fleet_identity: str, *, passphrase: bytes | None = None
) -> Access:
    """Write the broker's ``crl.pem`` (the CA's list, signed now if the CA has none yet) and
    ``acl`` (from the CA's register as it is now) into ``out_dir``, durably, list first."""
    crl = pki.current_crl(pki_dir, passphrase=passphrase)
    local_crl = out_dir / pki.CRL
    if local_crl.resolve() != (pki_dir / pki.CRL).resolve():
        pki.write_durable(local_crl, crl.public_bytes(serialization.Encoding.PEM))
    issued = pki.list_issued(pki_dir)
    acl = out_dir / ACL_NAME
    pki.write_durable(acl, render_acl(fleet_identity, issued).encode())
    return Access(
        acl=acl,
        crl=local_crl,
        fleet_identity=fleet_identity,
        devices=tuple((c.name, c.site or "") for c in granted(issued, fleet_identity)),
        siteless=tuple(c.name for c in siteless(issued)),
        revoked=sum(1 for _ in crl),
    )


def fleet_identity_of(broker_dir: Path) -> str:
    """The fleet identity the ACL in ``broker_dir`` was written for; PkiError if that folder
    holds no ACL ``write_broker_config`` wrote."""
    acl = broker_dir / ACL_NAME
    try:
        text = acl.read_text()
    except OSError as exc:
        raise PkiError(
            f"{acl}: cannot read the broker's ACL ({exc.strerror}); run `fleet broker-config` "
            "for that folder first"
        ) from None
    found = [
        ln.removeprefix(_IDENTITY_MARK) for ln in text.splitlines() if ln.startswith(_IDENTITY_MARK)
    ]
    if len(found) != 1:
        raise PkiError(
            f"{acl}: not an ACL written by `fleet broker-config` (no {_IDENTITY_MARK.strip()!r} "
            "line); run `fleet broker-config` for that folder first"
        )
    return pki.check_name(found[0])


def refresh_access(pki_dir: Path, broker_dir: Path, *, passphrase: bytes | None = None) -> Access:
    """After ``fleet pki issue`` or ``revoke``: rewrite the ACL and the revocation list in a
    folder ``write_broker_config`` wrote, leaving its config alone (its ports, sizing and
    paths stay as the operator chose them). The broker applies both at its next reload
    (SIGHUP)."""
    identity = fleet_identity_of(broker_dir)
    return write_access(pki_dir, broker_dir.absolute(), identity, passphrase=passphrase)


def _own(path: Path, user: str | None) -> str | None:
    """As root, hand ``path`` to the user Mosquitto switches to (it writes its persistence
    file there after dropping root); the user's name, or None if nothing was changed."""
    name = user or "mosquitto"
    if os.geteuid() != 0 or name == "root":
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None  # mosquitto itself refuses to start as a user that does not exist
    os.chown(path, entry.pw_uid, entry.pw_gid)
    return name


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
    sizing: Sizing | None = None,
    plain_port: int | None = None,
    log_file: Path | None = None,
    run_as: str | None = None,
    passphrase: bytes | None = None,
) -> BrokerFiles:
    """Write ``mosquitto.conf``, ``acl``, ``ca.crt``, ``crl.pem`` and (if missing) a server
    certificate for ``hosts`` into ``out_dir``, all durably (``write_access`` for the ACL and
    the list). ``persistence_dir`` (default ``out_dir/data``) is created if missing, and, as
    root, handed to ``run_as`` (default ``mosquitto``). After ``fleet pki issue`` or
    ``revoke``, ``refresh_access`` rewrites just the ACL and the list. An existing server
    certificate is kept only if this CA issued it; one from another CA is an error, not
    silently replaced.

    Refuses a ``fleet_identity`` that the CA issued as a *device* certificate: that device
    would get the fleet's rights.
    """
    pki.check_name(fleet_identity)
    pki.check_name(server_name)
    sizing = sizing or Sizing()
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
    data = (persistence_dir or out_dir / DATA_NAME).absolute()
    owner = None
    if not data.exists():
        try:
            data.mkdir(mode=0o700, parents=True)
        except OSError as exc:
            raise PkiError(f"{data}: cannot create the persistence folder: {exc.strerror}") from exc
        owner = _own(data, run_as)
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
    access = write_access(pki_dir, out_dir, fleet_identity, passphrase=passphrase)
    conf = out_dir / CONF_NAME
    pki.write_durable(
        conf,
        render_broker_config(
            ca=local_ca,
            server_cert=server_cert,
            server_key=server_key,
            port=port,
            fleet_identity=fleet_identity,
            acl_path=access.acl,
            persistence_dir=data,
            sizing=sizing,
            crl=access.crl,
            bind=bind,
            plain_port=plain_port,
            log_file=log_file,
            run_as=run_as,
        ).encode(),
    )
    return BrokerFiles(
        conf,
        access.acl,
        local_ca,
        access.crl,
        server_cert,
        server_key,
        issued,
        data,
        sizing,
        access,
        owner,
    )
