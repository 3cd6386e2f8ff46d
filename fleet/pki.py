"""The fleet's private CA: one EC P-256 CA that issues device, service and broker certificates.

A certificate's Common Name is the MQTT username (the broker's ``use_identity_as_username``)
and so the device's identity: it must pass the topic layout's name rule (``wire.topics``). A
device certificate also names its site (a subjectAltName URI ``urn:edgefleet:site:{site}``).
Every file is written durably; ``revoke`` journals each revoked serial and re-signs
``crl.pem`` from the journal, which ``fleet broker-config`` pushes to the broker. The CA
folder's layout and how revocation reaches live connections: ``docs/ARCHITECTURE.md``, "The
fleet's CA".
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal, get_args

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleet.errors import PkiError
from ota.fsutil import fsync_dir
from wire.topics import device_root

Kind = Literal["device", "service", "server"]
KINDS: tuple[Kind, ...] = get_args(Kind)

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
CRL = "crl.pem"
REGISTRY = "certs"
BY_SERIAL = "by-serial"
REVOKED = "revoked"
_LOCK = ".lock"
_ORG = "EdgeFleet"
#: How a device certificate names its site (a subjectAltName URI).
SITE_URN = "urn:edgefleet:site:"
# Certificates are valid from a few minutes in the past: a gateway whose clock runs a little
# behind the CA host would otherwise reject a certificate issued "in its future".
_BACKDATE = timedelta(minutes=5)
# A revocation list "not yet valid" on a broker whose clock is behind would lock every
# device out, not one: its start is back-dated much further.
_CRL_BACKDATE = timedelta(days=1)


@dataclass(frozen=True)
class CaPaths:
    dir: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class IssuedPaths:
    name: str
    kind: Kind
    cert: Path
    key: Path
    #: The CA certificate next to them, which the holder needs to verify its peer.
    ca_cert: Path


@dataclass(frozen=True)
class IssuedCert:
    """One entry of the CA's register of issued certificates."""

    name: str
    kind: Kind
    fingerprint: str
    serial: int
    not_after: datetime
    path: Path
    #: On the CA's revocation list.
    revoked: bool = False
    #: The site a device certificate is bound to; None for other kinds (and for a device
    #: certificate issued before sites were recorded: it gets no rights on the broker).
    site: str | None = None


@dataclass(frozen=True)
class Revocation:
    """What ``revoke`` did: the serials it put on the list, and the list's file."""

    name: str
    serials: tuple[int, ...]
    crl: Path
    #: Entries on the list now, these included.
    entries: int


def check_name(name: str) -> str:
    """``name`` if it is a valid device/service name (the ``wire.topics`` rule), else PkiError."""
    try:
        # device_root applies exactly the topic layout's name rule; the site is a placeholder.
        device_root("site", name)
    except ValueError:
        raise PkiError(
            f"certificate name {name!r} is not a valid name ([A-Za-z0-9_.:-], 1-128 chars); "
            "it becomes the MQTT username and a topic level"
        ) from None
    return name


# --- durable files -----------------------------------------------------------------------


def write_durable(path: Path, data: bytes, *, mode: int = 0o644, overwrite: bool = True) -> None:
    """Write ``path`` so a crash leaves the old file or the complete new one, never a part.

    The temp file is created with ``mode`` already set (``mkstemp`` makes it 0600, then
    ``fchmod``), so a key is never readable by others, not even for an instant. With
    ``overwrite=False`` the final name is taken with ``link``, which fails atomically if the
    file appeared in the meantime (two ``init`` runs racing).
    """
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise PkiError(f"{path}: already exists; refusing to overwrite it") from None
            tmp.unlink()
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _mkdir_private(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise PkiError(f"{path}: cannot create folder: {exc.strerror}") from exc


# --- reading -----------------------------------------------------------------------------


def read_cert(path: Path) -> x509.Certificate:
    """The PEM certificate at ``path``; PkiError naming the file if it is missing or not one."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PkiError(f"{path}: cannot read certificate: {exc.strerror}") from exc
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise PkiError(f"{path}: not a PEM X.509 certificate ({exc})") from exc


def _read_key(path: Path, passphrase: bytes | None) -> ec.EllipticCurvePrivateKey:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PkiError(f"{path}: cannot read private key: {exc.strerror}") from exc
    try:
        key = serialization.load_pem_private_key(data, password=passphrase)
    except TypeError:
        # cryptography raises TypeError for "encrypted but no passphrase" and the reverse.
        if passphrase is None:
            raise PkiError(f"{path}: the key is encrypted; give its passphrase") from None
        raise PkiError(f"{path}: the key is not encrypted; give no passphrase") from None
    except ValueError:
        # Deliberately without the cause: it could quote key material.
        raise PkiError(f"{path}: not a readable PEM private key, or a wrong passphrase") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{path}: expected an EC private key, found {type(key).__name__}")
    return key


def fingerprint(cert_path: Path) -> str:
    """SHA-256 of the certificate's DER, as ``AB:CD:...`` (what ``openssl x509 -fingerprint
    -sha256`` prints, so an operator can compare the two by eye)."""
    return _fingerprint(read_cert(cert_path))


def _fingerprint(cert: x509.Certificate) -> str:
    return cert.fingerprint(hashes.SHA256()).hex(":").upper()


def cert_kind(cert: x509.Certificate, path: Path) -> Kind:
    """The kind ``issue`` stamped into the subject's OU. Raises ``PkiError``."""
    ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    kind = str(ous[0].value) if ous else ""
    for k in KINDS:
        if k == kind:
            return k
    raise PkiError(f"{path}: not issued by fleet.pki (subject OU {kind!r} is not a known kind)")


def cert_site(cert: x509.Certificate, path: Path) -> str | None:
    """The site ``issue`` bound a device certificate to, or None if it names none.
    Raises ``PkiError``."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    sites = [
        u.removeprefix(SITE_URN)
        for u in san.get_values_for_type(x509.UniformResourceIdentifier)
        if u.startswith(SITE_URN)
    ]
    if len(sites) > 1:
        raise PkiError(f"{path}: the certificate names {len(sites)} sites; a device has one")
    if sites:
        try:
            device_root(sites[0], "device")
        except ValueError:
            raise PkiError(
                f"{path}: site {sites[0]!r} in the certificate is not a valid name"
            ) from None
    return sites[0] if sites else None


def cert_name(cert: x509.Certificate, path: Path) -> str:
    """The certificate's Common Name; ``PkiError`` (naming ``path``) when it has none."""
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not cns:
        raise PkiError(f"{path}: certificate has no Common Name")
    return str(cns[0].value)


def verify_issued_by(cert_path: Path, ca_cert_path: Path) -> x509.Certificate:
    """The certificate at ``cert_path`` if the CA at ``ca_cert_path`` signed it, else PkiError."""
    cert, ca = read_cert(cert_path), read_cert(ca_cert_path)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise PkiError(f"{cert_path}: not issued by the CA {ca_cert_path} ({exc})") from exc
    return cert


# --- the CA ------------------------------------------------------------------------------


def _key_pem(key: ec.EllipticCurvePrivateKey, passphrase: bytes | None) -> bytes:
    enc: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase)
        if passphrase
        else serialization.NoEncryption()
    )
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)


def init_ca(
    dir: Path,
    *,
    name: str = "EdgeFleet CA",
    days: int = 3650,
    passphrase: bytes | None = None,
    force: bool = False,
    now: datetime | None = None,
) -> CaPaths:
    """Create a CA in ``dir``: an EC P-256 key (0600, encrypted if ``passphrase``) and a
    self-signed certificate (CA:true, pathlen 0: it signs leaves, never other CAs).

    Refuses (PkiError) if ``dir`` already holds a CA key or certificate, unless ``force`` —
    replacing a CA orphans every certificate it issued.
    """
    if days <= 0:
        raise PkiError(f"{dir}: CA validity must be at least one day, got {days}")
    if passphrase is not None and not passphrase:
        raise PkiError(f"{dir}: the CA key passphrase is empty")
    paths = CaPaths(dir, dir / CA_CERT, dir / CA_KEY)
    if not force:
        for existing in (paths.key, paths.cert):
            if existing.exists():
                raise PkiError(
                    f"{existing}: a CA already exists here; refusing to overwrite it "
                    "(every certificate it issued would stop working); use force to replace it"
                )
    _mkdir_private(dir)
    now = now or datetime.now(UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORG),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    # Key first: a crash between the two leaves a key without a certificate, which the next
    # init refuses loudly, rather than a certificate whose key is lost.
    write_durable(paths.key, _key_pem(key, passphrase), mode=0o600, overwrite=force)
    write_durable(
        paths.cert, cert.public_bytes(serialization.Encoding.PEM), mode=0o644, overwrite=True
    )
    # An empty list from the start: a broker configured with crlfile needs one to exist.
    write_durable(dir / CRL, _sign_crl(cert, key, [], now))
    return paths


def _load_ca(
    ca_dir: Path, passphrase: bytes | None
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = ca_dir / CA_CERT, ca_dir / CA_KEY
    if not cert_path.exists() or not key_path.exists():
        raise PkiError(f"{ca_dir}: no CA here ({CA_CERT} and {CA_KEY}); run `fleet pki init`")
    cert, key = read_cert(cert_path), _read_key(key_path, passphrase)
    if cert.public_key() != key.public_key():
        raise PkiError(f"{key_path}: this key does not belong to {cert_path}")
    return cert, key


def issue(
    ca_dir: Path,
    name: str,
    out_dir: Path,
    *,
    kind: Kind = "device",
    days: int = 825,
    hosts: list[str] | None = None,
    site: str | None = None,
    passphrase: bytes | None = None,
    force: bool = False,
    now: datetime | None = None,
) -> IssuedPaths:
    """Issue a certificate with CN ``name`` and write ``{name}.crt``, ``{name}.key`` (0600,
    unencrypted: a device starts unattended) and ``ca.crt`` into ``out_dir``.

    ``kind`` ``device`` and ``service`` get the clientAuth EKU, ``server`` gets serverAuth and a
    subjectAltName of ``hosts`` (DNS names, or IP addresses where they parse as one; at least
    one is required). A ``device`` needs its ``site`` (see the module docstring); the other
    kinds take none. ``passphrase`` unlocks the CA key. A name already in the CA's register is
    refused unless ``force`` (re-issue, e.g. a lost key, or a move to another site): two
    certificates of different kinds with one CN would share one MQTT identity.
    """
    _check_request(name, kind, days, list(hosts or []), site)
    ca_cert, ca_key = _load_ca(ca_dir, passphrase)
    registry = ca_dir / REGISTRY
    recorded = registry / f"{name}.crt"
    if recorded.exists() and not force:
        old = read_cert(recorded)
        raise PkiError(
            f"{recorded}: {name!r} was already issued as a {cert_kind(old, recorded)} "
            "certificate; refusing to issue it again (use force to re-issue)"
        )
    sans = _alt_names(name, list(hosts or []), site)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _leaf(
        ca_cert,
        ca_key,
        key,
        name=name,
        kind=kind,
        sans=sans,
        days=days,
        now=now or datetime.now(UTC),
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)

    _mkdir_private(out_dir)
    _mkdir_private(registry / BY_SERIAL)
    # Recorded before anyone can hold it: a crash after this leaves a certificate that
    # `revoke` can still find; one before leaves a certificate nobody has.
    write_durable(registry / BY_SERIAL / f"{name}.{cert.serial_number:x}.crt", cert_pem)
    paths = IssuedPaths(
        name, kind, out_dir / f"{name}.crt", out_dir / f"{name}.key", out_dir / CA_CERT
    )
    write_durable(paths.key, _key_pem(key, None), mode=0o600)
    write_durable(paths.cert, cert_pem)
    if paths.ca_cert.resolve() != (ca_dir / CA_CERT).resolve():
        write_durable(paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    # The register entry goes last: it is what makes a name "taken", so it must only exist
    # once the holder's files are complete.
    write_durable(recorded, cert_pem)
    return paths


def _check_request(name: str, kind: Kind, days: int, hosts: list[str], site: str | None) -> None:
    """What :func:`issue` refuses before it touches the CA: names, kinds, hosts and sites."""
    check_name(name)
    if f"{name}.crt" == CA_CERT:
        # Its files would be ca.crt/ca.key, next to (or over) the CA's own.
        raise PkiError(f"certificate name {name!r} is reserved for the CA's own files")
    if kind not in KINDS:
        raise PkiError(f"certificate kind {kind!r} is not one of {', '.join(KINDS)}")
    if days <= 0:
        raise PkiError(f"{name}: certificate validity must be at least one day, got {days}")
    if kind == "server" and not hosts:
        raise PkiError(f"{name}: a server certificate needs at least one host name or address")
    if kind != "server" and hosts:
        raise PkiError(f"{name}: hosts are only for server certificates, not {kind}")
    if kind == "device":
        if site is None:
            raise PkiError(
                f"{name}: a device certificate needs its site (it may publish only under "
                f"edgefleet/v1/SITE/{name}/...)"
            )
        try:
            device_root(site, name)
        except ValueError:
            raise PkiError(
                f"{name}: site {site!r} is not a valid name ([A-Za-z0-9_.:-], 1-128 chars)"
            ) from None
    elif site is not None:
        raise PkiError(f"{name}: a site is only for device certificates, not {kind}")


def _alt_names(name: str, hosts: list[str], site: str | None) -> list[x509.GeneralName]:
    """The subjectAltName entries: each host as an IP address or a DNS name, and the site."""
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not host or any(c.isspace() or c in "/@:" for c in host):
                raise PkiError(
                    f"{name}: {host!r} is neither a DNS name nor an IP address"
                ) from None
            sans.append(x509.DNSName(host))
    if site is not None:
        sans.append(x509.UniformResourceIdentifier(SITE_URN + site))

    return sans


def _leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    key: ec.EllipticCurvePrivateKey,
    *,
    name: str,
    kind: Kind,
    sans: list[x509.GeneralName],
    days: int,
    now: datetime,
) -> x509.Certificate:
    """The certificate itself, signed by the CA (never valid past the CA)."""
    eku = ExtendedKeyUsageOID.SERVER_AUTH if kind == "server" else ExtendedKeyUsageOID.CLIENT_AUTH
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORG),
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, kind),
                    x509.NameAttribute(NameOID.COMMON_NAME, name),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(min(now + timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def list_issued(ca_dir: Path) -> list[IssuedCert]:
    """Every certificate in the CA's register, sorted by name. Raises ``PkiError``."""
    if not (ca_dir / CA_CERT).exists():
        raise PkiError(f"{ca_dir}: no CA here ({CA_CERT}); run `fleet pki init`")
    revoked = revoked_serials(ca_dir)
    registry = ca_dir / REGISTRY
    found: list[IssuedCert] = []
    for path in sorted(registry.glob("*.crt")) if registry.is_dir() else []:
        cert = read_cert(path)
        kind = cert_kind(cert, path)
        found.append(
            IssuedCert(
                name=cert_name(cert, path),
                kind=kind,
                fingerprint=_fingerprint(cert),
                serial=cert.serial_number,
                not_after=cert.not_valid_after_utc,
                path=path,
                revoked=cert.serial_number in revoked,
                site=cert_site(cert, path) if kind == "device" else None,
            )
        )
    return found


# --- revocation ----------------------------------------------------------------------------


def _sign_crl(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    entries: list[x509.RevokedCertificate],
    now: datetime,
    number: int = 1,
) -> bytes:
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - _CRL_BACKDATE)
        # See the module docstring: a list that expires would lock every device out.
        .next_update(ca_cert.not_valid_after_utc)
        .add_extension(x509.CRLNumber(number), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
    )
    for entry in entries:
        builder = builder.add_revoked_certificate(entry)
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def read_crl(ca_dir: Path) -> x509.CertificateRevocationList | None:
    """The CA's revocation list, checked against the CA's key; None if there is none yet.

    A list that does not parse, names another issuer or is not signed by this CA is a
    PkiError: trusting it could un-revoke a device.
    """
    path = ca_dir / CRL
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PkiError(f"{path}: cannot read the revocation list: {exc.strerror}") from exc
    try:
        crl = x509.load_pem_x509_crl(data)
    except ValueError as exc:
        raise PkiError(f"{path}: not a PEM certificate revocation list ({exc})") from exc
    ca_cert = read_cert(ca_dir / CA_CERT)
    public = ca_cert.public_key()
    if (
        crl.issuer != ca_cert.subject
        or not isinstance(public, ec.EllipticCurvePublicKey)
        or not crl.is_signature_valid(public)
    ):
        raise PkiError(f"{path}: the revocation list is not signed by the CA in {ca_dir}")
    return crl


def revoked_serials(ca_dir: Path) -> frozenset[int]:
    """Serial numbers revoked: on the CA's revocation list or in its journal."""
    return _serials(read_crl(ca_dir), _journal(ca_dir))


def _serials(
    crl: x509.CertificateRevocationList | None, journal: dict[int, datetime]
) -> frozenset[int]:
    listed = {e.serial_number for e in crl} if crl is not None else set()
    return frozenset(listed | journal.keys())


@contextlib.contextmanager
def _locked(ca_dir: Path) -> Iterator[None]:
    """One writer of the CA's lists at a time (two `revoke` runs must not lose an entry)."""
    try:
        fd = os.open(ca_dir / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise PkiError(f"{ca_dir}: cannot lock the CA folder: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _journal(ca_dir: Path) -> dict[int, datetime]:
    """Revoked serials and when, from ``certs/revoked/`` (see the module docstring)."""
    folder = ca_dir / REGISTRY / REVOKED
    out: dict[int, datetime] = {}
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.name.startswith("."):
            continue  # a temp file of write_durable
        try:
            out[int(path.name, 16)] = datetime.fromisoformat(path.read_text().strip())
        except (OSError, ValueError) as exc:
            raise PkiError(f"{path}: not a revocation record ({exc})") from exc
    return out


def _entries(
    crl: x509.CertificateRevocationList | None, journal: dict[int, datetime]
) -> list[x509.RevokedCertificate]:
    """The list's entries plus any the journal has and the list lacks (never fewer)."""
    entries = list(crl) if crl is not None else []
    listed = {e.serial_number for e in entries}
    for serial, when in sorted(journal.items()):
        if serial not in listed:
            entries.append(
                x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
            )
    return entries


def current_crl(
    ca_dir: Path, *, passphrase: bytes | None = None, now: datetime | None = None
) -> x509.CertificateRevocationList:
    """The CA's revocation list as a broker must get it.

    Signed again first when it is missing (a CA made before revocation existed, or a lost
    file) or lacks a serial of the journal: every journaled serial stays revoked, and the
    list is never emptier than the journal. Signing needs the CA key (``passphrase``).
    Raises ``PkiError``.
    """
    with _locked(ca_dir):
        crl = read_crl(ca_dir)
        journal = _journal(ca_dir)
        if crl is not None and journal.keys() <= {e.serial_number for e in crl}:
            return crl
        try:
            ca = _load_ca(ca_dir, passphrase)
        except PkiError as exc:
            raise PkiError(f"signing the revocation list {ca_dir / CRL}: {exc}") from None
        _sign_into(ca_dir, ca, crl, journal, now or datetime.now(UTC))
    fresh = read_crl(ca_dir)
    assert fresh is not None
    return fresh


def _sign_into(
    ca_dir: Path,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    crl: x509.CertificateRevocationList | None,
    journal: dict[int, datetime],
    now: datetime,
) -> int:
    """Write ``crl.pem``: the old list's entries and the journal's, numbered after the old
    list. Returns the number of entries. Call it holding ``_locked``."""
    entries = _entries(crl, journal)
    number = _crl_number(crl) + 1 if crl is not None else len(entries) + 1
    write_durable(ca_dir / CRL, _sign_crl(*ca, entries, now, number))
    return len(entries)


def _crl_number(crl: x509.CertificateRevocationList) -> int:
    try:
        return crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        return 0


def revoke(
    ca_dir: Path,
    name: str,
    *,
    passphrase: bytes | None = None,
    now: datetime | None = None,
) -> Revocation:
    """Put every certificate ever issued for ``name`` (the current one and those a forced
    re-issue replaced) on the CA's revocation list.

    PkiError if the CA never issued ``name``, or if all of them are on the list already.
    A new certificate for the name (``issue(..., force=True)``) is not affected: it has a
    new serial number. The journal entry of each serial is written before the list.
    """
    check_name(name)
    registry = ca_dir / REGISTRY
    recorded = registry / f"{name}.crt"
    paths = [recorded] if recorded.exists() else []
    if (registry / BY_SERIAL).is_dir():
        paths += sorted((registry / BY_SERIAL).glob(f"{name}.*.crt"))
    if not paths:
        raise PkiError(f"{recorded}: this CA never issued a certificate named {name!r}")
    ca = _load_ca(ca_dir, passphrase)
    now = now or datetime.now(UTC)
    with _locked(ca_dir):
        crl = read_crl(ca_dir)
        journal = _journal(ca_dir)
        listed = set(_serials(crl, journal))
        added: list[int] = []
        for path in paths:
            cert = read_cert(path)
            # A glob for "gw" also matches "gw.1.*": the CN decides.
            if cert_name(cert, path) != name or cert.serial_number in listed:
                continue
            listed.add(cert.serial_number)
            added.append(cert.serial_number)
        if not added:
            raise PkiError(f"{name!r}: every certificate issued for it is revoked already")
        _mkdir_private(registry / REVOKED)
        for serial in added:
            write_durable(registry / REVOKED / f"{serial:x}", now.isoformat().encode())
            journal[serial] = now
        entries = _sign_into(ca_dir, ca, crl, journal, now)
    return Revocation(name, tuple(added), ca_dir / CRL, entries)
