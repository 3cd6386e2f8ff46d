"""Fetch a bundle onto the device: HTTP(S) with range requests, or CoAP block-wise (Block2).

``fetch()`` is the only public entry. Each scheme is a small transport (``_Transport``): it
opens the resource at a byte offset and yields ``(offset, bytes)`` chunks in order, nothing
else. ``fetch()`` adds everything that must not differ between schemes: the ``.part`` file
and resume from its size, the cap at the declared length, the stall timeout, retries with
jittered backoff, the durable rename, and every error as a :class:`~ota.errors.FetchError`
naming the URL (without credentials) and the offset. Design: ``docs/ARCHITECTURE.md``,
"OTA transport and artifact server".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import ssl as ssl_module
import urllib.parse
from collections import deque
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, Self

from ota.errors import FetchError, FetchStalled, FetchTooLarge

if TYPE_CHECKING:
    import aiohttp

__all__ = ["fetch", "redact_url"]

_log = logging.getLogger(__name__)

COAP_BLOCK_SZX = 6  # 1024-byte blocks: the largest non-BERT size, one datagram each
COAP_WINDOW = 16  # block requests in flight per transfer
# Retransmission timer of one block request (NON: aiocoap does not retransmit). Doubles per
# resend of the same block up to the cap; the stall timeout in fetch() bounds the total.
COAP_RTO_S = 1.0
COAP_RTO_MAX_S = 4.0
# A CoAP server deduplicates requests on (client address, message id) for EXCHANGE_LIFETIME
# (247 s) and message ids are 16 bit, so one client context must not send more than 65,536
# requests in that time: a bigger transfer would have its requests dropped as duplicates.
# A new context (new source port, so a new key on the server) is opened after this many.
COAP_REQUESTS_PER_CONTEXT = 30_000
HTTP_CHUNK = 64 * 1024


def redact_url(url: str) -> str:
    """The URL without user, password, query or fragment, fit for logs and error messages."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<unparsable URL>"
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    query = "?<redacted>" if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", "")) + query


def _scrub(text: str, url: str) -> str:
    """``text`` with the URL's secrets (userinfo, query) cut out, for foreign error messages."""
    safe = redact_url(url)
    text = text.replace(url, safe)
    parts = urllib.parse.urlsplit(url)
    for secret in (parts.query, parts.password, parts.username):
        if secret:
            text = text.replace(secret, "<redacted>")
    return text


class _Transport(Protocol):
    """One scheme. Entered once per fetch(); ``open`` once per attempt.

    ``open`` yields ``(offset, data)`` in file order, starting at ``offset`` or at 0 (a peer
    that refuses to resume restarts the file); it may yield past ``length`` (fetch() cuts
    there and raises FetchTooLarge) and may end early (fetch() resumes). It raises FetchError
    for protocol faults it recognises; ``errors`` lists the foreign exceptions fetch() maps.
    """

    errors: tuple[type[BaseException], ...]

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def open(
        self, url: str, offset: int, length: int
    ) -> AsyncGenerator[tuple[int, bytes], None]: ...


class _HttpTransport:
    """aiohttp: ``Range: bytes=N-`` to resume; a 200 answer restarts from 0."""

    def __init__(self, *, ssl: ssl_module.SSLContext | None) -> None:
        self._ssl = ssl
        self._session: aiohttp.ClientSession | None = None
        self.errors: tuple[type[BaseException], ...] = ()

    async def __aenter__(self) -> Self:
        import aiohttp  # noqa: PLC0415 - imported on use (STYLE.md #5)

        self.errors = (aiohttp.ClientError,)
        # No total timeout: fetch() owns the stall timeout, and a large bundle on a slow
        # link may legitimately take long. Raw bytes only: the cap counts what is stored.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
            headers={"Accept-Encoding": "identity"},
        )
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()

    async def open(
        self, url: str, offset: int, length: int
    ) -> AsyncGenerator[tuple[int, bytes], None]:
        assert self._session is not None
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        ssl: ssl_module.SSLContext | bool = self._ssl if self._ssl is not None else True
        async with self._session.get(url, headers=headers, ssl=ssl) as resp:
            if resp.status == 206 and offset:
                start, total = _content_range(resp.headers.get("Content-Range"), url, offset)
                if start != offset:
                    raise FetchError(
                        f"{redact_url(url)}: asked for bytes from {offset}, "
                        f"the server sent from {start}"
                    )
            elif resp.status == 200:
                # The server ignored the range (or none was asked): the body is the whole
                # file and replaces what the .part holds.
                offset, total = 0, resp.content_length
            else:
                raise FetchError(
                    f"{redact_url(url)} at offset {offset}: HTTP {resp.status} {resp.reason}"
                )
            if total is not None and total > length:
                raise FetchTooLarge(
                    f"{redact_url(url)}: the server has {total} bytes, the offer declared {length}"
                )
            pos = offset
            async for data in resp.content.iter_chunked(HTTP_CHUNK):
                yield pos, data
                pos += len(data)


def _content_range(value: str | None, url: str, offset: int) -> tuple[int, int | None]:
    """``bytes START-END/TOTAL`` -> (START, TOTAL or None for ``*``)."""
    unit, _, spec = (value or "").strip().partition(" ")
    span, _, total = spec.partition("/")
    start, _, _end = span.partition("-")
    if unit == "bytes" and start.isdigit() and (total == "*" or total.isdigit()):
        return int(start), (None if total == "*" else int(total))
    raise FetchError(f"{redact_url(url)} at offset {offset}: bad Content-Range {value!r} on a 206")


class _CoapTransport:
    """aiocoap, Block2 requested block by block with a window of requests in flight."""

    def __init__(self, *, window: int = COAP_WINDOW, szx: int = COAP_BLOCK_SZX) -> None:
        if not 1 <= window <= 256 or not 0 <= szx <= 6:
            raise ValueError(f"CoAP window {window} (1..256) or szx {szx} (0..6) out of range")
        self._window = window
        self._szx = szx
        self._ctx: Any = None
        self._sent = 0  # requests sent on the current context
        self.errors: tuple[type[BaseException], ...] = ()

    async def __aenter__(self) -> Self:
        import aiocoap  # noqa: PLC0415 - imported on use (STYLE.md #5)

        self.errors = (aiocoap.error.Error,)
        self._ctx = await self._new_context()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._ctx is not None:
            await self._ctx.shutdown()
            self._ctx = None

    @staticmethod
    async def _new_context() -> Any:
        import aiocoap  # noqa: PLC0415

        # udp6 only: no OSCORE / TCP / WebSocket interfaces to consult on every request.
        return await aiocoap.Context.create_client_context(transports=["udp6"])

    async def _rotate_context(self) -> None:
        old, self._ctx = self._ctx, await self._new_context()
        self._sent = 0
        await old.shutdown()

    async def open(  # noqa: PLR0915 - one ranged request and its answer's checks, in order
        self, url: str, offset: int, length: int
    ) -> AsyncGenerator[tuple[int, bytes], None]:
        import aiocoap  # noqa: PLC0415
        from aiocoap.numbers.codes import Code  # noqa: PLC0415

        size = 2 ** (self._szx + 4)
        first_block = offset // size
        skip = offset - first_block * size
        last_block = max(0, (length - 1) // size)  # the block holding the declared last byte
        tuning = aiocoap.Unreliable()

        def by_uri(num: int) -> Any:
            m = aiocoap.Message(code=Code.GET, uri=url, transport_tuning=tuning)
            m.opt.block2 = (num, False, self._szx)
            return m

        template = by_uri(first_block)
        first = await self._request(template, url, first_block, size)
        remote = first.remote
        total = first.opt.size2
        if total is not None and total > length:
            raise FetchTooLarge(
                f"{redact_url(url)}: the server has {total} bytes (Size2), "
                f"the offer declared {length}"
            )
        if total is not None and total < length:
            raise FetchError(
                f"{redact_url(url)}: the server has only {total} bytes (Size2), "
                f"the offer declared {length}"
            )

        # The URI options of the first request, to set on every block request (only those
        # present: each option set costs an option object).
        uri_options = {
            name: value
            for name in ("uri_host", "uri_port", "uri_path", "uri_query")
            if (value := getattr(template.opt, name))
        }

        def by_remote(num: int) -> Any:
            # A fresh message per block with the first one's options and resolved peer:
            # Message.copy deep-copies, and resolving the URI again costs a socket per block.
            m = aiocoap.Message(code=Code.GET, transport_tuning=tuning, **uri_options)
            m.opt.block2 = (num, False, self._szx)
            m.remote = remote
            return m

        loop = asyncio.get_running_loop()
        inflight: deque[asyncio.Future[Any]] = deque()
        try:
            num, response, next_request = first_block, first, first_block + 1
            while True:
                payload, more = self._check_block(response, url, num, size)
                if more and num >= last_block:
                    raise FetchTooLarge(
                        f"{redact_url(url)}: block {num} says more follows, "
                        f"past the declared {length} bytes"
                    )
                # Keep the window full before handing the block over, so requests are in
                # flight while the caller writes.
                while more and len(inflight) < self._window and next_request <= last_block:
                    if self._sent >= COAP_REQUESTS_PER_CONTEXT:
                        if inflight:
                            break  # drain the window on the old context first
                        await self._rotate_context()
                        # The new context resolves the URI once; its peer object is its own.
                        resp = await self._request(by_uri(next_request), url, next_request, size)
                        remote = resp.remote
                        done: asyncio.Future[Any] = loop.create_future()
                        done.set_result(resp)
                        inflight.append(done)
                    else:
                        inflight.append(
                            asyncio.create_task(
                                self._request(by_remote(next_request), url, next_request, size),
                                name=f"coap-block-{next_request}",
                            )
                        )
                    next_request += 1
                if num == first_block:
                    yield offset, payload[skip:]
                else:
                    yield num * size, payload
                if not more:
                    return  # the peer's end; fetch() decides whether that is early
                num += 1
                response = await inflight.popleft()
        finally:
            for fut in inflight:
                fut.cancel()
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)

    async def _request(self, msg: Any, url: str, num: int, size: int) -> Any:
        """Send one block request, resending it until a response arrives (or we are cancelled)."""
        import aiocoap  # noqa: PLC0415

        rto = COAP_RTO_S
        while True:
            self._sent += 1
            req = self._ctx.request(msg, handle_blockwise=False)
            try:
                async with asyncio.timeout(rto * random.uniform(1.0, 1.25)):
                    response = await req.response
            except TimeoutError:
                # Cancelling the response future tells aiocoap to drop the request state.
                req.response.cancel()
                rto = min(rto * 2, COAP_RTO_MAX_S)
                msg = _clone_request(msg, aiocoap)
                continue
            except BaseException:
                req.response.cancel()
                raise
            if not response.code.is_successful():
                raise FetchError(
                    f"{redact_url(url)} at offset {num * size}: CoAP {response.code} "
                    f"{response.payload[:200].decode('utf-8', 'replace')}".rstrip()
                )
            return response

    def _check_block(self, response: Any, url: str, num: int, size: int) -> tuple[bytes, bool]:
        block2 = response.opt.block2
        offset = num * size
        payload: bytes = response.payload
        if block2 is None:
            # A server that ignores Block2 answers with the whole body: only acceptable when
            # the body fits one block (a tiny bundle) and we asked for the first block.
            if num != 0 or len(payload) > size:
                raise FetchError(
                    f"{redact_url(url)} at offset {offset}: response without Block2 "
                    f"({len(payload)} bytes)"
                )
            return payload, False
        if block2.block_number != num or block2.size_exponent != self._szx:
            raise FetchError(
                f"{redact_url(url)} at offset {offset}: asked for block {num} szx {self._szx}, "
                f"got block {block2.block_number} szx {block2.size_exponent}"
            )
        if (block2.more and len(payload) != size) or len(payload) > size:
            raise FetchError(
                f"{redact_url(url)} at offset {offset}: block {num} has {len(payload)} "
                f"bytes, expected {size}{'' if block2.more else ' at most'}"
            )
        return payload, bool(block2.more)


def _clone_request(msg: Any, aiocoap: Any) -> Any:
    """The same request for a resend: aiocoap stamps token/mid on a message it sends."""
    options = {
        name: value
        for name in ("uri_host", "uri_port", "uri_path", "uri_query")
        if (value := getattr(msg.opt, name))
    }
    clone = aiocoap.Message(code=msg.code, transport_tuning=msg.transport_tuning, **options)
    clone.opt.block2 = msg.opt.block2
    clone.remote = msg.remote
    return clone


def _http(**options: Any) -> _Transport:
    return _HttpTransport(ssl=options.get("ssl"))


def _coap(**options: Any) -> _Transport:
    return _CoapTransport(window=options.get("coap_window", COAP_WINDOW))


# Scheme -> transport factory; each transport imports its library only when entered.
_TRANSPORTS: dict[str, Callable[..., _Transport]] = {
    "http": _http,
    "https": _http,
    "coap": _coap,
}


async def fetch(
    url: str,
    dest: Path,
    *,
    length: int,
    stall_timeout_s: float = 10.0,
    attempts: int = 5,
    backoff_s: float = 0.5,
    progress: Callable[[int], None] | None = None,
    ssl: ssl_module.SSLContext | None = None,
    coap_window: int = COAP_WINDOW,
) -> Path:
    """Download ``url`` to ``dest`` (exactly ``length`` bytes, the offer's declared length).

    Bytes go to ``dest`` + ``.part``; an existing ``.part`` is resumed from its size (a
    ``.part`` longer than ``length`` is not ours and is restarted). No byte past ``length``
    is ever written: a peer with more raises :class:`FetchTooLarge` at once (permanent, not
    retried). A dropped connection, an early end, a transport error or ``stall_timeout_s``
    without a byte (:class:`FetchStalled`) is retried, resuming, after
    ``uniform(0, backoff_s * 1.5 ** n)``; ``attempts`` failures in a row that brought no new
    byte raise the last error. ``progress`` gets the byte count stored so far. When complete
    the file is fsynced, renamed to ``dest`` and the directory fsynced; ``dest`` is returned.
    ``ssl`` is the TLS context for ``https``; ``coap_window`` the CoAP requests in flight.

    Bundles are content-addressed (the URL names the sha256) and the updater names each
    download by a hash of its URL and length (:func:`ota.updater.download_name`), so a resumed
    transfer can never splice two files together; the verifier checks length and sha256 anyway.

    CoAP: aiocoap's automatic Block2 reassembly copies the growing body for every block
    (quadratic) and sends one request at a time. Here each block is requested explicitly, as a
    NON request (aiocoap serialises CON requests to one in flight per peer: NSTART=1), with up
    to ``window`` requests in flight, our own per-block retransmission timer, and in-order
    reassembly. Requests after the first reuse the peer's resolved address: resolving the URI
    again per block (a socket connect per route check) cost more than the transfer itself.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    factory = _TRANSPORTS.get(scheme)
    if factory is None:
        raise FetchError(
            f"{redact_url(url)}: unsupported scheme {scheme!r} "
            f"(expected one of {', '.join(sorted(_TRANSPORTS))})"
        )
    part = dest.with_suffix(dest.suffix + ".part")
    transport = factory(ssl=ssl, coap_window=coap_window)
    failures = 0
    try:
        async with transport:
            while True:
                start = _part_size(part, length)
                try:
                    await _attempt(
                        transport,
                        url,
                        _PartWriter(part, start, length, url),
                        stall_timeout_s=stall_timeout_s,
                        progress=progress,
                    )
                    break
                except FetchError as exc:
                    if exc.permanent:
                        raise
                    progressed = _part_size(part, length) > start
                    failures = 0 if progressed else failures + 1
                    if failures >= attempts:
                        raise
                    delay = random.uniform(0, backoff_s * 1.5 ** min(10, failures))
                    _log.warning(
                        "%s (%s); resuming at offset %d in %.2f s (%d/%d without progress)",
                        exc,
                        exc.code,
                        _part_size(part, length),
                        delay,
                        failures,
                        attempts,
                    )
                    await asyncio.sleep(delay)
    except FetchError:
        raise
    except _foreign_errors(transport) as exc:  # entering or leaving the transport
        raise _foreign(exc, url, None) from exc
    try:
        await asyncio.to_thread(_finish, part, dest)  # fsyncs block: off the loop (STYLE.md #9)
    except OSError as exc:
        raise _foreign(exc, url, length) from exc
    return dest


def _foreign_errors(transport: _Transport) -> tuple[type[BaseException], ...]:
    return (*transport.errors, OSError)


def _foreign(exc: BaseException, url: str, offset: int | None) -> FetchError:
    where = "" if offset is None else f" at offset {offset}"
    return FetchError(f"{redact_url(url)}{where}: {type(exc).__name__}: {_scrub(str(exc), url)}")


def _part_size(part: Path, length: int) -> int:
    try:
        size = part.stat().st_size
    except FileNotFoundError:
        return 0
    return size if size <= length else 0


async def _attempt(
    transport: _Transport,
    url: str,
    writer: _PartWriter,
    *,
    stall_timeout_s: float,
    progress: Callable[[int], None] | None,
) -> None:
    """One connection, appending to the ``.part`` until ``length`` bytes are in."""
    try:
        with writer:
            if writer.pos >= writer.length:
                return  # a complete .part left by a run that died before the rename
            chunks = transport.open(url, writer.pos, writer.length)
            async with contextlib.aclosing(chunks):
                while (item := await _next(chunks, stall_timeout_s, url, writer.pos)) is not None:
                    writer.write(*item)
                    if progress is not None:
                        progress(writer.pos)
    except FetchError:
        raise
    except _foreign_errors(transport) as exc:
        raise _foreign(exc, url, writer.pos) from exc
    if writer.pos < writer.length:
        raise FetchError(
            f"{redact_url(url)}: the transfer ended at offset {writer.pos} of {writer.length}"
        )


async def _next(
    chunks: AsyncGenerator[tuple[int, bytes], None], stall_timeout_s: float, url: str, pos: int
) -> tuple[int, bytes] | None:
    try:
        async with asyncio.timeout(stall_timeout_s):
            return await anext(chunks, None)
    except TimeoutError:
        raise FetchStalled(
            f"{redact_url(url)}: no data for {stall_timeout_s:g} s at offset {pos}"
        ) from None


class _PartWriter:
    """The ``.part`` file from ``pos`` on, refusing to grow past ``length``."""

    def __init__(self, part: Path, pos: int, length: int, url: str) -> None:
        self.part, self.pos, self.length, self._url = part, pos, length, url
        self._f: BinaryIO | None = None

    def __enter__(self) -> Self:
        self._f = open(self.part, "r+b" if self.part.exists() else "w+b")
        self._f.seek(self.pos)
        self._f.truncate()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def write(self, at: int, data: bytes) -> None:
        assert self._f is not None
        if at != self.pos:
            if at != 0:
                raise FetchError(
                    f"{redact_url(self._url)}: transport jumped from offset {self.pos} to {at}"
                )
            self._f.seek(0)  # the peer restarted the file (a 200 to a range request)
            self._f.truncate()
            self.pos = 0
        room = self.length - self.pos
        # Page-cache writes of one chunk take microseconds: inline. The fsync is not.
        self._f.write(data[:room])
        self.pos += min(len(data), room)
        if len(data) > room:
            self._f.flush()
            raise FetchTooLarge(
                f"{redact_url(self._url)}: the peer sent more than the declared "
                f"{self.length} bytes; cut at offset {self.length}"
            )


def _finish(part: Path, dest: Path) -> None:
    with open(part, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(part, dest)
    fd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
