"""ECDSA P-256 keys, key ids and signatures in the formats of DESIGN.md section 5.

A signature is base64 of the DER ``ECDSA-Sig-Value`` over SHA-256 of the signed bytes,
which is what ``openssl dgst -sha256 -sign key.pem`` writes; a key id is the hex sha256 of
the key's DER SubjectPublicKeyInfo (``openssl pkey -pubout -outform DER | sha256sum``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ota.errors import SignatureInvalid, TrustError

#: A DER P-256 signature is at most 72 bytes; base64 of that is 96 characters.
MAX_SIG_B64 = 128
#: A PEM P-256 public key is ~180 characters.
MAX_PUBLIC_PEM = 1024


def keyid(public: ec.EllipticCurvePublicKey) -> str:
    der = public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()


def public_pem(public: ec.EllipticCurvePublicKey) -> str:
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def load_public_pem(text: str, *, where: str) -> ec.EllipticCurvePublicKey:
    """A P-256 public key from PEM; any other key type or curve is a :class:`TrustError`."""
    if len(text) > MAX_PUBLIC_PEM:
        raise TrustError(f"{where}: public key is {len(text)} characters; at most {MAX_PUBLIC_PEM}")
    try:
        key = serialization.load_pem_public_key(text.encode())
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise TrustError(f"{where}: not a PEM public key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise TrustError(f"{where}: expected an ECDSA P-256 key; got {_describe(key)}")
    return key


def _describe(key: object) -> str:
    if isinstance(key, ec.EllipticCurvePublicKey):
        return f"ECDSA on {key.curve.name}"
    return type(key).__name__


def generate() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def private_pem(key: ec.EllipticCurvePrivateKey, passphrase: bytes | None = None) -> bytes:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase)
        if passphrase
        else serialization.NoEncryption()
    )
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )


def load_private_pem(data: bytes, passphrase: bytes | None = None) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=passphrase)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise TrustError(f"not a usable private key (or a wrong passphrase): {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise TrustError("expected an ECDSA P-256 private key")
    return key


def sign(key: ec.EllipticCurvePrivateKey, data: bytes) -> str:
    """Base64 DER signature of ``data``: the same bytes ``openssl dgst -sha256 -sign`` writes."""
    return base64.b64encode(key.sign(data, ec.ECDSA(hashes.SHA256()))).decode()


def decode_sig(sig: object, *, where: str) -> bytes:
    """The DER bytes of a base64 signature; anything else is :class:`SignatureInvalid`."""
    if not isinstance(sig, str) or not sig:
        raise SignatureInvalid(f"{where}: expected base64 of a DER signature")
    if len(sig) > MAX_SIG_B64:
        # A P-384 or RSA signature, or junk: too long to be P-256, whatever it is.
        raise SignatureInvalid(
            f"{where}: {len(sig)} characters; base64 of a P-256 DER signature has at most "
            f"{MAX_SIG_B64}"
        )
    try:
        return base64.b64decode(sig, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureInvalid(f"{where}: not valid base64") from None


def verifies(public: ec.EllipticCurvePublicKey, der: bytes, data: bytes) -> bool:
    """True when ``der`` is a valid signature of ``data`` by ``public``.

    Malformed DER (truncated, r or s zero or out of range) is simply not valid.
    """
    try:
        public.verify(der, data, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True
