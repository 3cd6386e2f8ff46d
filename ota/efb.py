"""The ``.efb`` container: a strict reader and the writer for uncompressed POSIX tar.

Python's ``tarfile`` is made to extract anything it can; a bundle reader must refuse
anything it did not expect, before it reads it. So this reads 512-byte headers itself:
checksum, octal size, member type and name are checked from the header alone, and the
caller decides from the declared size whether to read the data at all.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from ota.errors import MalformedBundle

BLOCK = 512
#: How a file that is not a bundle at all is reported (then why, in words).
NOT_A_BUNDLE = "not an EdgeFleet bundle (.efb)"
_COMPRESSED = (
    (b"\x1f\x8b", "it is gzip-compressed"),
    (b"BZh", "it is bzip2-compressed"),
    (b"\xfd7zXZ\x00", "it is xz-compressed"),
    (b"\x28\xb5\x2f\xfd", "it is zstd-compressed"),
    (b"PK\x03\x04", "it is a zip archive"),
)
_WHAT_A_BUNDLE_IS = "a bundle is an uncompressed POSIX tar, manifest.json first"
#: A pax header that sets times needs ~100 bytes; more is not from a tar we expect.
MAX_PAX_BYTES = 4096
_PAX_ALLOWED = {"mtime", "atime", "ctime", "uid", "gid", "uname", "gname"}
_TYPES = {
    b"1": "a hard link",
    b"2": "a symbolic link",
    b"3": "a character device",
    b"4": "a block device",
    b"5": "a directory",
    b"6": "a FIFO",
    b"7": "a contiguous file",
    b"L": "a GNU long name",
    b"K": "a GNU long link name",
    b"S": "a GNU sparse file",
}


@dataclass(frozen=True)
class Member:
    index: int
    name: str
    size: int
    #: Offset of the first data byte in the file.
    offset: int


def _octal(field: bytes, *, what: str) -> int:
    if field and field[0] & 0x80:
        raise MalformedBundle(f"{what}: base-256 numbers are not allowed")
    text = field.rstrip(b"\0 ").lstrip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise MalformedBundle(f"{what}: not an octal number: {text[:16]!r}") from None


def _checksum_ok(block: bytes, *, what: str) -> None:
    stored = _octal(block[148:156], what=f"{what} checksum")
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    signed = sum(b - 256 if b > 127 else b for b in block[:148] + block[156:]) + 8 * 32
    if stored not in (unsigned, signed):
        raise MalformedBundle(f"{what}: header checksum mismatch (not a tar header)")


def _compressed(head: bytes) -> str:
    return next((what for magic, what in _COMPRESSED if head.startswith(magic)), "")


def _not_a_tar(block: bytes) -> str:
    """Why the file's first block is no tar header at all, or ``""`` (then it is read as
    one, and any fault after this is reported member by member)."""
    packed = _compressed(block)
    if packed:
        return f"{packed}; {_WHAT_A_BUNDLE_IS}"
    if block[257:263] not in (b"ustar\x00", b"ustar "):
        return f"no tar header at its start; {_WHAT_A_BUNDLE_IS}"
    try:
        _checksum_ok(block, what="header")
    except MalformedBundle:
        return f"its first header's checksum does not match; {_WHAT_A_BUNDLE_IS}"
    return ""


def _decode_name(raw: bytes, index: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedBundle(f"member {index}: name is not UTF-8") from None


def name_problem(name: str) -> str:
    """What is wrong with ``name`` as a file in a bundle, in words, or ``""``.

    A bundle holds plain file names: no folder, no way out of the folder it is unpacked in.
    """
    if name.startswith(("/", "\\")) or name[1:3] in (":/", ":\\"):
        return "is an absolute path; a bundle holds plain file names only"
    if ".." in name.replace("\\", "/").split("/"):
        return "leaves the bundle folder ('..'); a bundle holds plain file names only"
    if "/" in name or "\\" in name:
        return "is in a folder; a bundle holds plain file names only"
    if name in ("", ".") or "\0" in name:
        return "is not a file name"
    return ""


def _check_name(name: str, index: int) -> str:
    why = name_problem(name)
    if why:
        raise MalformedBundle(f"member {index} name {name!r} {why}")
    return name


class BundleReader:
    """Walks the members of an open bundle file, one header at a time.

    Accepted: regular files (``0`` / NUL) in ustar, GNU (``ustar  ``) or pax layout, and pax
    ``x``/``g`` headers that carry only times and ownership (what ``tar --format=posix`` adds),
    plus ``path`` in an ``x`` header. Anything that other tar readers would name differently
    (a ``path`` in a global header, a GNU header with a name prefix) is refused too.
    Refused with the member's index and name: links, devices, FIFOs, directories, GNU long
    names, sparse files, base-256 sizes, names that are paths (said in words: absolute, ``..``,
    a folder), and any byte other than zero after the end-of-archive block (what appending to a
    bundle produces). A file whose first block is no tar header at all (random bytes, a
    compressed tar, a wheel) is :data:`NOT_A_BUNDLE`, with why.
    """

    def __init__(self, f: BinaryIO, size: int) -> None:
        self._f = f
        self._size = size
        self._pos = 0
        self._index = 0
        self._pending_data = 0

    def _read_block(self, *, what: str) -> bytes:
        block = self._f.read(BLOCK)
        if len(block) != BLOCK:
            raise MalformedBundle(f"{what}: truncated (the file ends inside a header)")
        self._pos += BLOCK
        return block

    def next_member(self) -> Member | None:  # noqa: PLR0915 - one tar header, field by field, each refused with its own reason
        """The next regular member, or ``None`` at a valid end of archive (checked)."""
        if self._pending_data:
            raise RuntimeError("read or skip the previous member's data first")
        pax_name: str | None = None
        pending_x = False
        while True:
            what = f"member {self._index}"
            first = self._pos == 0
            if first and self._size < BLOCK:
                head = self._f.read(BLOCK)
                why = _compressed(head) or (f"{self._size} bytes" if head else "an empty file")
                raise MalformedBundle(f"{NOT_A_BUNDLE}: {why}; {_WHAT_A_BUNDLE_IS}")
            if self._pos >= self._size:
                raise MalformedBundle(f"{what}: truncated (no end-of-archive block)")
            block = self._read_block(what=what)
            if block == bytes(BLOCK):
                self._check_trailer()
                return None
            why = _not_a_tar(block) if first else ""
            if why:
                raise MalformedBundle(f"{NOT_A_BUNDLE}: {why}")
            _checksum_ok(block, what=what)
            magic = block[257:263]
            if magic not in (b"ustar\x00", b"ustar "):
                raise MalformedBundle(f"{what}: not a POSIX/GNU tar header (magic {magic!r})")
            raw_name = block[:100].split(b"\0", 1)[0]
            # ustar's name prefix. A GNU header keeps other fields there, but Python's
            # tarfile reads it as a prefix whatever the magic: a bundle must not name its
            # members differently for different readers, so in a GNU header it stays empty.
            prefix = block[345:500].split(b"\0", 1)[0]
            if prefix and magic != b"ustar\x00":
                raise MalformedBundle(
                    f"{what}: a GNU header with data in the ustar name-prefix field "
                    f"({prefix[:32]!r}); other tar readers would see another name"
                )
            if prefix:
                raw_name = prefix + b"/" + raw_name
            size = _octal(block[124:136], what=f"{what} size")
            typeflag = block[156:157]
            if typeflag in (b"x", b"g"):
                if pending_x:
                    # Readers disagree on which one names the member (tarfile: the
                    # first; GNU tar: the last): one extended header per member.
                    raise MalformedBundle(f"{what}: a second pax header before its member")
                pending_x = typeflag == b"x"
                pax = self._read_pax(size, what=f"{what} pax header")
                if "path" in pax and typeflag == b"g":
                    # GNU tar and Python's tarfile name every later member by it.
                    raise MalformedBundle(
                        f"{what}: a global pax header sets path {pax['path'][:64]!r}; "
                        "tar readers would give every member that name"
                    )
                if "path" in pax:
                    pax_name = pax["path"]
                continue
            name = pax_name if pax_name is not None else _decode_name(raw_name, self._index)
            # The type first: a directory ("models/") or a GNU long name ("././@LongLink")
            # is reported as what it is, not as a name with a slash.
            if typeflag not in (b"0", b"\0"):
                kind = _TYPES.get(typeflag, f"of type {typeflag!r}")
                raise MalformedBundle(
                    f"member {self._index} {name!r}: is {kind}; only regular files allowed"
                )
            _check_name(name, self._index)
            if self._pos + size > self._size:
                raise MalformedBundle(
                    f"member {self._index} {name!r}: declares {size} bytes; "
                    f"only {self._size - self._pos} left in the file (truncated)"
                )
            member = Member(self._index, name, size, self._pos)
            self._index += 1
            self._pending_data = size
            return member

    def _read_pax(self, size: int, *, what: str) -> dict[str, str]:
        if size > MAX_PAX_BYTES:
            raise MalformedBundle(f"{what}: {size} bytes; at most {MAX_PAX_BYTES}")
        padded = -(-size // BLOCK) * BLOCK
        data = self._f.read(padded)
        if len(data) != padded:
            raise MalformedBundle(f"{what}: truncated")
        self._pos += padded
        out: dict[str, str] = {}
        buf = data[:size]
        while buf:
            length_text, sep, _ = buf.partition(b" ")
            try:
                length = int(length_text)
            except ValueError:
                raise MalformedBundle(f"{what}: malformed record") from None
            record = buf[:length]
            buf = buf[length:]
            if not sep or length <= 0 or not record.endswith(b"\n"):
                raise MalformedBundle(f"{what}: malformed record")
            key, eq, value = record[len(length_text) + 1 : -1].partition(b"=")
            k = key.decode("utf-8", "replace")
            if not eq or (k not in _PAX_ALLOWED and k != "path"):
                raise MalformedBundle(f"{what}: key {k!r} is not allowed")
            out[k] = value.decode("utf-8", "replace")
        return out

    def read(self, member: Member, chunk: int = 1 << 20) -> Iterator[memoryview]:
        """The member's data in chunks (views into one reused buffer: copy to keep them)."""
        if self._pending_data != member.size:
            raise RuntimeError("read the current member's data once")
        buf = bytearray(min(chunk, max(member.size, 1)))
        view = memoryview(buf)
        left = member.size
        while left:
            n = self._f.readinto(view[: min(left, len(buf))])  # type: ignore[attr-defined]
            if not n:
                raise MalformedBundle(f"member {member.index} {member.name!r}: truncated")
            left -= n
            self._pos += n
            yield view[:n]
        self._pending_data = 0
        self._skip_padding(member)

    def skip(self, member: Member) -> None:
        for _ in self.read(member):
            pass

    def _skip_padding(self, member: Member) -> None:
        pad = -member.size % BLOCK
        if pad:
            data = self._f.read(pad)
            if len(data) != pad:
                raise MalformedBundle(f"member {member.index} {member.name!r}: truncated")
            if data.strip(b"\0"):
                raise MalformedBundle(f"member {member.index} {member.name!r}: bad padding")
            self._pos += pad

    def _check_trailer(self) -> None:
        """After the first zero block only zeros may follow (tar pads to its record size)."""
        while True:
            data = self._f.read(1 << 16)
            if not data:
                return
            if data.count(0) != len(data):
                raise MalformedBundle(
                    "bytes after the end-of-archive block (data appended to the bundle)"
                )


def write_bundle(
    path: str | os.PathLike[str], manifest: bytes, payloads: list[tuple[str, BinaryIO | bytes]]
) -> None:
    """Write an ``.efb``: ``manifest.json`` first, then each payload, plain ustar.

    Used by the fleet's ``bundle build`` and by tests; any ``tar --format=ustar`` made the
    same way is equally valid.
    """
    with (
        open(path, "wb") as out,
        tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar,
    ):
        for name, data in [("manifest.json", manifest), *payloads]:
            fobj: BinaryIO = io.BytesIO(data) if isinstance(data, bytes) else data
            fobj.seek(0, os.SEEK_END)
            info = tarfile.TarInfo(name)
            info.size = fobj.tell()
            info.mode = 0o644
            info.mtime = 0
            fobj.seek(0)
            tar.addfile(info, fobj)
        tar.close()
        out.flush()
        os.fsync(out.fileno())
