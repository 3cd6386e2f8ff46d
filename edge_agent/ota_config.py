"""``[ota]``: what this device accepts from OTA and from whom (see :mod:`edge_agent.ota`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field

from edge_agent._schema import Name, StrictModel

#: What a bundle may ask for (``required_permissions``) and a device may grant.
PERMISSIONS = frozenset({"model:swap", "config:write", "agent:replace"})


def ota_dir(state_dir: Path) -> Path:
    """Where OTA keeps its journal, trust root, content store and models."""
    return state_dir / "ota"


class OtaSection(StrictModel):
    """``[ota]``: what this device accepts and from whom."""

    enabled: bool = True
    #: The provisioned trust root; copied into ``state_dir/ota/root.json`` at first start,
    #: where rotations replace it. No root anywhere: every bundle is refused.
    trust_root: Annotated[str, Field(min_length=1)] | None = None
    #: What bundles may do here; ``agent:replace`` is not granted unless listed.
    permissions: Annotated[list[Name], Field(max_length=64)] = Field(
        default_factory=lambda: ["model:swap", "config:write"]
    )
    max_bundle_mb: Annotated[int, Field(ge=1, le=4096)] = 512
    stall_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    #: A/B slots for agent builds (the launcher's --slots); default: state_dir/slots.
    slots_dir: Annotated[str, Field(min_length=1)] | None = None

    def resolve_slots(self, state_dir: Path, config_dir: Path) -> Path:
        """The A/B slots folder: ``slots_dir`` (relative: to the config's folder, as the
        launcher's --slots), else ``state_dir/slots``."""
        if self.slots_dir is None:
            return state_dir / "slots"
        root = Path(self.slots_dir)
        return root if root.is_absolute() else config_dir / root

    def check(self, base: Path) -> list[str]:
        """What a typo here would make fail only at the first update."""
        errors: list[str] = []
        if self.trust_root is not None:
            root = Path(self.trust_root)
            root = root if root.is_absolute() else base / root
            if not root.is_file():
                errors.append(
                    f"ota.trust_root: file not found: {self.trust_root!r} (resolved to {root})"
                )
        unknown = sorted(set(self.permissions) - PERMISSIONS)
        if unknown:
            errors.append(
                f"ota.permissions: unknown {unknown}; expected some of {sorted(PERMISSIONS)}"
            )
        return errors
