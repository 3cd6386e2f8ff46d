"""Keys, roots and bundles for OTA tests: real P-256 keys and real ``.efb`` files."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from models.copies import copy_with_new_sha
from ota import build, keys

DEVICE_TYPE = "motor-drive-gw"


@dataclass
class Signer:
    """A root key and a bundle key, and the root.json they make."""

    root_key: ec.EllipticCurvePrivateKey = field(default_factory=keys.generate)
    bundle_key: ec.EllipticCurvePrivateKey = field(default_factory=keys.generate)

    def root_json(self, *, version: int = 1, days: int = 365) -> bytes:
        signed = build.root_signed(
            version=version,
            expires=datetime.now(UTC) + timedelta(days=days),
            root_keys=[self.root_key.public_key()],
            bundle_keys=[self.bundle_key.public_key()],
        )
        return build.sign_envelope(signed, [self.root_key])

    def write_root(self, path: Path) -> Path:
        path.write_bytes(self.root_json())
        return path

    def bundle(
        self,
        out: Path,
        members: list[tuple[str, bytes]],
        *,
        kind: str = "model",
        version: str = "1.1.0",
        counter: int = 2,
        probation: dict[str, int] | None = None,
        bundle_id: str | None = None,
        **extra: Any,
    ) -> Path:
        entries = [build.payload_entry(name, data)[0] for name, data in members]
        signed = build.bundle_signed(
            bundle_id=bundle_id or f"{kind}-{version}",
            kind=kind,
            version=version,
            counter=counter,
            expires=datetime.now(UTC) + timedelta(days=30),
            device_types=[DEVICE_TYPE],
            payloads=entries,
            required_permissions=build.default_permissions(kind),
            probation=probation or {"seconds": 2, "min_windows": 3},
            **extra,
        )
        return build.write(out, signed, members, [self.bundle_key])


def model_members(tmp: Path, tag: str) -> tuple[list[tuple[str, bytes]], str]:
    """A copy of the committed model with its own sha (it scores the same), as payloads."""
    d = copy_with_new_sha(tmp / f"model-{tag}", tag)
    members = build.model_bundle_payloads(d)
    return members, hashlib.sha256(members[0][1]).hexdigest()
