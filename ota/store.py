"""The content-addressed store of verified payloads: ``store/<sha256>``.

A payload is stored once, under its sha256, and never changed. Two shapes:

- ``store/<sha256>`` — the payload's bytes (a delta's result, a file written here);
- ``store/<sha256>.ref`` — ``{"bundle", "offset", "length"}``: the bytes are a byte range
  of a verified bundle kept whole in ``store/bundles/`` (named by its manifest's sha256
  and its layout). Staging a 50 MB bundle therefore writes no payload byte a second time:
  the fetched file is renamed into the store, which spares the device's flash a second
  50 MB write and keeps verify+stage at about the cost of hashing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ota.errors import StorageError
from ota.fsutil import atomic_write, fsync_dir, write_all

_SHA = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Extent:
    """Where a payload's bytes are: a whole file or a range of one."""

    path: Path
    offset: int
    length: int


def _check_sha(sha: str) -> str:
    if not _SHA.match(sha):
        raise ValueError(f"not a sha256: {sha[:80]!r}")
    return sha


class ContentStore:
    """Readers (:meth:`ContentStore.read`, :meth:`ContentStore.copy_to`) hash what they hand out
    again and refuse a mismatch (:class:`~ota.errors.StorageError`: the disk's fault), so a
    file damaged at rest is never used. The store is written only by the verifier (through
    :meth:`stage`) and cleaned by :meth:`gc`.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bundles = root / "bundles"
        self.incoming = root.parent / "incoming"

    def ensure(self) -> None:
        for d in (self.root, self.bundles, self.incoming):
            d.mkdir(parents=True, exist_ok=True, mode=0o750)

    # -- reading ----------------------------------------------------------------------------

    def extent(self, sha: str) -> Extent | None:
        blob = self.root / _check_sha(sha)
        if blob.is_file():
            return Extent(blob, 0, blob.stat().st_size)
        ref = blob.with_name(sha + ".ref")
        try:
            data = json.loads(ref.read_bytes()[:4096])
            bundle = self.bundles / Path(str(data["bundle"])).name
            return Extent(bundle, int(data["offset"]), int(data["length"]))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, OSError):
            return None

    def has(self, sha: str) -> bool:
        ext = self.extent(sha)
        return ext is not None and ext.path.is_file()

    def _chunks(self, sha: str, max_bytes: int) -> Iterable[bytes]:
        ext = self.extent(sha)
        if ext is None:
            raise StorageError(f"store: payload {sha[:12]} is not on this device")
        if ext.length > max_bytes:
            raise StorageError(f"store: payload {sha[:12]} is {ext.length} bytes; cap {max_bytes}")
        h = hashlib.sha256()
        try:
            with ext.path.open("rb") as f:
                f.seek(ext.offset)
                left = ext.length
                while left:
                    block = f.read(min(left, _CHUNK))
                    if not block:
                        break
                    left -= len(block)
                    h.update(block)
                    yield block
        except OSError as exc:
            raise StorageError(f"store: cannot read payload {sha[:12]}: {exc}") from None
        if left or h.hexdigest() != sha:
            # The device's disk is at fault, not the bundle (verified when it was staged).
            raise StorageError(f"store: payload {sha[:12]} is damaged on disk")

    def read(self, sha: str, *, max_bytes: int) -> bytes:
        """The payload's bytes, hashed again; :class:`StorageError` when absent, too big or
        damaged."""
        return b"".join(self._chunks(sha, max_bytes))

    def copy_to(self, sha: str, dest: Path, *, mode: int = 0o640) -> None:
        """Write the payload to ``dest`` durably (temp, fsync, rename); checked on the way."""
        tmp = dest.with_name(f".tmp-{os.getpid()}-{dest.name}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            try:
                for block in self._chunks(sha, 1 << 40):
                    write_all(fd, block)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, dest)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"store: cannot write {dest}: {exc}") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(dest.parent)

    # -- writing (the verifier only) --------------------------------------------------------

    def stage(
        self,
        bundle: Path,
        name: str,
        refs: dict[str, tuple[int, int]],
        blobs: dict[str, bytes],
        *,
        keep_source: bool,
    ) -> Path:
        """Keep ``bundle`` as ``bundles/<name>-<layout>.efb`` and index its payloads.

        ``layout`` digests the payloads' byte ranges: one manifest packed by two tars has
        two layouts, and a ref must point into the file whose offsets it holds. The same
        layout again is the same bytes at the same ranges (each range's sha256 was
        checked), so that file is shared.

        ``refs``: sha -> (offset, length) inside the bundle; ``blobs``: sha -> bytes made
        here (delta results). A bundle already in ``incoming/`` is renamed (no copy); any
        other file (``edge-agent ota install FILE``) is copied, so the user's file stays.
        Any ``OSError`` (a full disk) removes what this call wrote and raises StorageError.
        """
        self.ensure()
        layout = hashlib.sha256(json.dumps(sorted(refs.items())).encode()).hexdigest()[:16]
        dest = self.bundles / f"{name}-{layout}.efb"
        written: list[Path] = []
        try:
            if not dest.exists():
                if not keep_source and bundle.parent.resolve() == self.incoming.resolve():
                    os.replace(bundle, dest)
                else:
                    tmp = dest.with_name(f".tmp-{os.getpid()}-{dest.name}")
                    written.append(tmp)
                    with bundle.open("rb") as src, tmp.open("wb") as out:
                        shutil.copyfileobj(src, out, _CHUNK)
                        out.flush()
                        os.fsync(out.fileno())
                    os.replace(tmp, dest)
                    written.remove(tmp)
                written.append(dest)
                fsync_dir(self.bundles)
            for sha, data in blobs.items():
                blob = self.root / _check_sha(sha)
                if not blob.exists():
                    atomic_write(blob, data)
                    written.append(blob)
            repoint: list[tuple[Path, bytes]] = []
            for sha, (offset, length) in refs.items():
                ref = self.root / f"{_check_sha(sha)}.ref"
                doc = json.dumps(
                    {"bundle": dest.name, "offset": offset, "length": length}, sort_keys=True
                ).encode()
                if self.has(sha):
                    ext = self.extent(sha)
                    if ext is not None and ext.path.parent == self.bundles and ext.path != dest:
                        repoint.append((ref, doc))
                    continue
                atomic_write(ref, doc)
                written.append(ref)
        except OSError as exc:
            for p in written:
                p.unlink(missing_ok=True)
            raise StorageError(f"store: staging {bundle.name} failed: {exc}") from None
        # A payload this bundle shares with an older one (an unchanged model.json) now points
        # into this bundle: else the older bundle, whole, stays live for that one small file
        # as long as the new version is kept. Best effort: the old pointer is still correct.
        for ref, doc in repoint:
            try:
                atomic_write(ref, doc)
            except OSError:
                break
        return dest

    def gc(self, keep: set[str], *, in_flight: Iterable[str] = ()) -> list[str]:
        """Remove payloads not in ``keep``, bundles no kept payload points into, and every
        file in ``incoming/`` but those named in ``in_flight`` (the update being fetched:
        its ``.part``). A ``.part`` of an abandoned offer would otherwise stay forever."""
        removed: list[str] = []
        live_bundles: set[str] = set()
        for sha in keep:
            ext = self.extent(sha)
            if ext is not None and ext.path.parent == self.bundles:
                live_bundles.add(ext.path.name)
        if not self.root.is_dir():
            return removed
        for entry in self.root.iterdir():
            sha = entry.name.removesuffix(".ref")
            if entry.is_file() and _SHA.match(sha) and sha not in keep:
                entry.unlink(missing_ok=True)
                removed.append(sha)
        if self.bundles.is_dir():
            for entry in self.bundles.iterdir():
                if entry.name not in live_bundles:
                    entry.unlink(missing_ok=True)
        if self.incoming.is_dir():
            spare = set(in_flight)
            for entry in self.incoming.iterdir():
                if entry.is_file() and entry.name not in spare:
                    entry.unlink(missing_ok=True)
        return removed
