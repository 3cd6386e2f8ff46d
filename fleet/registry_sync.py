"""The fleet store's registry brought in line with the CA: every device at the site its
certificate names (``fleet pki sync-registry``).

The ingest takes a device's site from the registry: the first site a device was seen at,
which the broker's ACL makes its certificate's, or the one registered here. Syncing is
needed where the first message is not the judge: with ``fleet serve --no-auto-register``
(a device must be registered before its first message is accepted), and for rows that an
older fleet let a state message move to another site.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleet import pki
from fleet.store import Store


@dataclass(frozen=True)
class SiteChange:
    """One registry row to write: ``before`` is the registered site, None if unregistered."""

    device: str
    site: str
    before: str | None


def plan(
    certs: Sequence[pki.IssuedCert], registered_site: Callable[[str], str | None]
) -> tuple[list[SiteChange], int]:
    """The changes that put every valid device certificate with a site at that site in the
    registry, and how many are there already. Revoked certificates, other kinds and device
    certificates without a site change nothing (the registry has no opinion to take)."""
    changes: list[SiteChange] = []
    unchanged = 0
    for c in certs:
        if c.kind != "device" or c.revoked or c.site is None:
            continue
        before = registered_site(c.name)
        if before == c.site:
            unchanged += 1
        else:
            changes.append(SiteChange(c.name, c.site, before))
    return changes, unchanged


def sync_registry(ca_dir: Path, store: Store) -> tuple[list[SiteChange], int]:
    """Apply :func:`plan` to ``store``: register the missing devices, move the others to
    their certificate's site (keeping their device type). Returns what it changed and how
    many were right already. A running ingest follows a moved device within a minute."""
    changes, unchanged = plan(pki.list_issued(ca_dir), store.device_site)
    for ch in changes:
        info = store.device(ch.device)
        store.register_device(ch.device, ch.site, info.device_type if info else "generic")
    return changes, unchanged
