"""The artifact server: bundles by sha256 over HTTP (range requests) and CoAP (Block2).

A bundle lives in the served directory as ``<sha256>.efb`` (64 lowercase hex digits, the
sha256 of the file's bytes); :func:`publish` puts a file there under that name. Names are
checked against that pattern before any path is built, so no request can reach another file.

Design: ``docs/ARCHITECTURE.md``, "OTA transport and artifact server".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import hashlib
import logging
import os
import re
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiocoap
import aiocoap.resource
from aiocoap.numbers.codes import Code
from aiohttp import web

from fleet.errors import ArtifactError, ArtifactPortInUse, FleetError
from ota.fsutil import fsync_dir

__all__ = [
    "BUNDLE_SUFFIX",
    "STORED_BUNDLE_MAX_BYTES",
    "ArtifactServer",
    "ArtifactStats",
    "bundle_path",
    "publish",
]

log = logging.getLogger(__name__)

BUNDLE_SUFFIX = ".efb"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_SZX = 6  # 1024-byte blocks; BERT (szx 7) is for CoAP over TCP only
_OPEN_FILES = 32  # descriptors kept open for CoAP block reads (LRU)
#: Largest bundle kept in the store for the other nodes (a model or agent patch is a few
#: MB; a whole image beyond this needs the artifact directory shared between nodes).
STORED_BUNDLE_MAX_BYTES = 256 * 1024 * 1024


def is_sha256(name: str) -> bool:
    return _SHA256.fullmatch(name) is not None


def bundle_path(directory: Path, sha256: str) -> Path:
    """The file serving ``sha256`` in ``directory``; ValueError for a malformed name."""
    if not is_sha256(sha256):
        raise ValueError(f"not a sha256 (64 lowercase hex digits): {sha256[:80]!r}")
    return directory / f"{sha256}{BUNDLE_SUFFIX}"


def publish(directory: Path, source: Path) -> str:
    """Copy ``source`` into ``directory`` as ``<sha256>.efb``, durably; return the sha256.

    Blocking (hashing and copying a file): call it from a thread in async code.
    Raises ``ArtifactError``.
    """
    try:
        with open(source, "rb") as src:
            return _place(directory, iter(lambda: src.read(1 << 20), b""))
    except OSError as exc:
        raise ArtifactError(f"cannot publish {source} into {directory}: {exc}") from exc


def _place(directory: Path, blocks: Iterator[bytes]) -> str:
    """Write ``blocks`` into ``directory`` as ``<their sha256>.efb``: a temporary file,
    fsynced, renamed, the directory fsynced. Raises OSError."""
    digest = hashlib.sha256()
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".publish-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for block in blocks:
                digest.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        sha = digest.hexdigest()
        os.replace(tmp, bundle_path(directory, sha))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
    return sha


@dataclass
class ArtifactStats:
    """Requests served, for ``fleet artifacts serve`` and tests (plain counters)."""

    http_requests: int = 0
    http_range_requests: int = 0
    http_not_found: int = 0
    http_bad_name: int = 0
    coap_requests: int = 0
    coap_bytes: int = 0
    coap_not_found: int = 0
    coap_bad_name: int = 0
    #: Bundles fetched from the store into the directory; fetches that failed or whose
    #: bytes did not hash to their name (not served).
    filled: int = 0
    fill_errors: int = 0


class _BlockFiles:
    """Open descriptors of served bundles, least recently used closed first."""

    def __init__(self, directory: Path, capacity: int = _OPEN_FILES) -> None:
        self._directory = directory
        self._capacity = capacity
        self._open: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()

    def get(self, sha256: str) -> tuple[int, int] | None:
        """(fd, size) of the bundle, or None when the directory does not hold it."""
        hit = self._open.get(sha256)
        if hit is not None:
            self._open.move_to_end(sha256)
            return hit
        try:
            fd = os.open(bundle_path(self._directory, sha256), os.O_RDONLY)
        except FileNotFoundError:
            return None
        entry = (fd, os.fstat(fd).st_size)
        self._open[sha256] = entry
        if len(self._open) > self._capacity:
            _, (old_fd, _) = self._open.popitem(last=False)
            os.close(old_fd)
        return entry

    def close(self) -> None:
        while self._open:
            _, (fd, _) = self._open.popitem()
            os.close(fd)


class _CoapBundles(aiocoap.resource.Resource):  # type: ignore[misc]
    """The whole CoAP site: ``bundles/{sha256}``, one Block2 block per request.

    It is the server's root resource rather than a child of an ``aiocoap.resource.Site``:
    the Site deep-copies every request to strip the path, which cost a fifth of the CPU of
    a block transfer.
    """

    def __init__(
        self,
        files: _BlockFiles,
        stats: ArtifactStats,
        fill: Callable[[str], Awaitable[bool]],
    ) -> None:
        super().__init__()
        self._files = files
        self._stats = stats
        self._fill = fill

    async def needs_blockwise_assembly(self, request: Any) -> bool:
        return False  # we answer Block2 ourselves; aiocoap would render whole files

    async def render_get(self, request: Any) -> Any:
        self._stats.coap_requests += 1
        path = request.opt.uri_path
        if not path or path[0] != "bundles":
            return _coap_error(Code.NOT_FOUND, "only bundles/<sha256> is served here")
        if len(path) != 2 or not is_sha256(path[1]):
            self._stats.coap_bad_name += 1
            return _coap_error(Code.BAD_REQUEST, "expected bundles/<sha256, 64 lowercase hex>")
        entry = self._files.get(path[1])
        if entry is None and await self._fill(path[1]):
            entry = self._files.get(path[1])
        if entry is None:
            self._stats.coap_not_found += 1
            return _coap_error(Code.NOT_FOUND, f"no bundle {path[1]}")
        fd, size = entry
        block2 = request.opt.block2
        num, szx = (0, _MAX_SZX) if block2 is None else (block2.block_number, block2.size_exponent)
        szx = min(szx, _MAX_SZX)
        block_size = 2 ** (szx + 4)
        start = num * block_size
        if start >= size and num > 0:
            return _coap_error(Code.BAD_OPTION, f"block {num} is past the end ({size} bytes)")
        # A 1 KB pread from the page cache takes microseconds: inline, not in a thread.
        data = os.pread(fd, block_size, start)
        self._stats.coap_bytes += len(data)
        more = start + len(data) < size
        response = aiocoap.Message(code=Code.CONTENT, payload=data)
        response.opt.block2 = (num, more, szx)
        response.opt.size2 = size
        return response


class _ServerContext(aiocoap.Context):  # type: ignore[misc]
    """aiocoap's server context without the eager ``repr`` of every request.

    ``Context.render_to_pipe`` names each rendering task ``"Rendering for %r" % request``;
    that repr parses the peer's address and asks the kernel for the interface name, about a
    fifth of the server's CPU per block. Same steps (aiocoap 0.4.17), a constant task name.
    """

    def render_to_pipe(self, pipe: Any) -> None:
        from aiocoap.pipe import error_to_message, run_driving_pipe  # noqa: PLC0415

        run_driving_pipe(
            error_to_message(pipe, self.log), self._render_to_pipe(pipe), name="coap-render"
        )


def _coap_error(code: Any, text: str) -> Any:
    return aiocoap.Message(code=code, payload=text.encode())


def _udp_port(ctx: Any) -> int:
    """The UDP port a server context bound (aiocoap 0.4.17 keeps it behind its layers)."""
    for interface in ctx.request_interfaces:
        message_interface = getattr(
            getattr(interface, "token_interface", None), "message_interface", None
        )
        port = getattr(message_interface, "_local_port", None)
        if port is not None:
            return int(port())
    raise ArtifactError("the CoAP server context has no UDP socket (aiocoap layout changed?)")


class ArtifactServer:
    """Serve ``directory``'s bundles over HTTP and CoAP while the context is entered.

    ``http_ssl`` makes the HTTP side HTTPS. Ports 0 pick free ones; after entering,
    ``http_port`` / ``coap_port`` are the bound ports and ``http_url(sha)`` /
    ``coap_url(sha)`` the URLs a device fetches.

    - HTTP (aiohttp): ``GET`` / ``HEAD /v1/bundles/{sha256}``. aiohttp's ``FileResponse`` does
      the ranges (``206`` + ``Content-Range``, ``416`` for an unsatisfiable range) and sends the
      file with ``sendfile``. ``400`` for a malformed name, ``404`` for an unknown bundle.
    - CoAP (aiocoap, UDP): ``GET coap://host:port/bundles/{sha256}`` with Block2. Each request
      is answered with the one block it names, read with ``os.pread`` from a cached descriptor
      (no whole-file reads; a device fetching 10 MB asks ~10,000 times), with ``Size2``.
      ``4.00`` for a malformed name, ``4.04`` unknown, ``4.02`` a block past the end.

    Files are immutable (content-addressed), so cached descriptors and sizes never go stale;
    a bundle removed from the directory is served until its descriptor leaves the cache.

    Several ``fleet serve`` nodes: ``fleet rollout create`` also keeps the bundle in the store
    (up to ``STORED_BUNDLE_MAX_BYTES``), and a server given ``fill`` fetches a bundle its
    directory lacks from there (hash checked, written atomically) before serving it, so every
    node serves every bundle and offers can name a load balancer in front of them all.
    """

    def __init__(
        self,
        directory: Path,
        *,
        http_host: str = "127.0.0.1",
        http_port: int = 0,
        coap_host: str = "127.0.0.1",
        coap_port: int = 0,
        http_ssl: ssl.SSLContext | None = None,
        fill: Callable[[str], bytes | None] | None = None,
    ) -> None:
        self.directory = directory
        #: Blocking: the bytes of a bundle the directory lacks (the store's), or None.
        self._fill_from = fill
        self._http_ssl = http_ssl
        self._http_host, self._http_port = http_host, http_port
        self._coap_host, self._coap_port = coap_host, coap_port
        self.stats = ArtifactStats()
        self._files = _BlockFiles(directory)
        self._runner: web.AppRunner | None = None
        self._coap: Any = None

    @property
    def http_port(self) -> int:
        return self._http_port

    @property
    def coap_port(self) -> int:
        return self._coap_port

    def http_url(self, sha256: str) -> str:
        scheme = "https" if self._http_ssl is not None else "http"
        return f"{scheme}://{_url_host(self._http_host)}:{self._http_port}/v1/bundles/{sha256}"

    def coap_url(self, sha256: str) -> str:
        return f"coap://{_url_host(self._coap_host)}:{self._coap_port}/bundles/{sha256}"

    async def __aenter__(self) -> Self:
        if not self.directory.is_dir():
            raise ArtifactError(f"artifact directory {self.directory} does not exist")
        try:
            await self._start_http()
            await self._start_coap()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stop()

    async def _start_http(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/bundles/{sha256}", self._http_bundle)  # HEAD too
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self._http_host, self._http_port, ssl_context=self._http_ssl
        )
        try:
            await site.start()
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ArtifactPortInUse("HTTP", self._http_host, self._http_port) from exc
            raise ArtifactError(
                f"cannot listen for HTTP on {self._http_host}:{self._http_port}: {exc}"
            ) from exc
        self._http_port = int(self._runner.addresses[0][1])

    async def _start_coap(self) -> None:
        root = _CoapBundles(self._files, self.stats, self._fill)
        try:
            self._coap = await _ServerContext.create_server_context(
                root, bind=(self._coap_host, self._coap_port), transports=["udp6"]
            )
        except (OSError, aiocoap.error.Error) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
                raise ArtifactPortInUse("CoAP", self._coap_host, self._coap_port) from exc
            raise ArtifactError(
                f"cannot listen for CoAP on {self._coap_host}:{self._coap_port}: {exc}"
            ) from exc
        self._coap_port = _udp_port(self._coap)

    async def _stop(self) -> None:
        if self._coap is not None:
            await self._coap.shutdown()
            self._coap = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._files.close()

    async def _http_bundle(self, request: web.Request) -> web.StreamResponse:
        self.stats.http_requests += 1
        if "Range" in request.headers:
            self.stats.http_range_requests += 1
        sha = request.match_info["sha256"]
        try:
            path = bundle_path(self.directory, sha)
        except ValueError as exc:
            self.stats.http_bad_name += 1
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        # A stat, not I/O worth a thread; FileResponse does its own in the executor.
        if not path.is_file() and not await self._fill(sha):
            self.stats.http_not_found += 1
            raise web.HTTPNotFound(text=f"no bundle {sha}\n")
        return web.FileResponse(
            path,
            headers={
                "Content-Type": "application/octet-stream",
                # Content-addressed: a name never changes its bytes.
                "Cache-Control": "public, max-age=31536000, immutable",
            },
        )

    async def _fill(self, sha: str) -> bool:
        """Fetch a bundle the directory lacks from ``fill`` into it; True once it is there.
        Bytes that do not hash to ``sha`` are refused (logged, counted, not served)."""
        if self._fill_from is None:
            return False
        try:
            data = await asyncio.to_thread(self._fill_from, sha)
            if data is None:
                return False
            placed = await asyncio.to_thread(_place, self.directory, iter((data,)))
        except (FleetError, OSError) as exc:  # the store or the disk: this request fails
            self.stats.fill_errors += 1
            log.error("artifacts: cannot fetch bundle %s from the store: %s", sha, exc)
            return False
        if placed != sha:
            with contextlib.suppress(OSError):
                os.unlink(bundle_path(self.directory, placed))
            self.stats.fill_errors += 1
            log.error("artifacts: the store's bundle %s hashes to %s: not served", sha, placed)
            return False
        self.stats.filled += 1
        log.info("artifacts: bundle %s fetched from the store (%d bytes)", sha, len(data))
        return True


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
