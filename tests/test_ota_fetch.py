"""ota.fetch against real peers: the artifact server on loopback, real TCP/UDP proxies that cut
or black-hole the transfer, and small misbehaving servers (too long, stalled, wrong blocks)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiocoap
import aiocoap.resource
import aiohttp
import pytest
from aiocoap.numbers.codes import Code
from aiohttp import web
from typer.testing import CliRunner

import ota.fetch
from fleet import pki
from fleet.artifacts import ArtifactServer, bundle_path, publish
from fleet.artifacts_cli import app as artifacts_app
from ota.errors import FetchError, FetchStalled, FetchTooLarge
from ota.fetch import fetch, redact_url

pytestmark = [pytest.mark.peers, pytest.mark.timeout(90)]
T = TypeVar("T")

SIZE = 3 * 1024 * 1024 + 777  # a few MB, not a whole number of CoAP blocks


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


@pytest.fixture
def bundle(tmp_path: Path) -> tuple[Path, str, bytes]:
    """A served directory holding one random bundle: (directory, sha256, bytes)."""
    data = os.urandom(SIZE)
    src = tmp_path / "src.efb"
    src.write_bytes(data)
    served = tmp_path / "served"
    sha = publish(served, src)
    return served, sha, data


class TcpProxy:
    """Forwards one TCP port to another; cuts the first connection after ``cut_after`` bytes
    from the server. Records what each connection's client sent and how much it received."""

    def __init__(self, target_port: int, cut_after: int | None = None) -> None:
        self.target_port = target_port
        self.cut_after = cut_after
        self.requests: list[bytes] = []
        self.downstream_bytes: list[int] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        index = len(self.requests)
        self.requests.append(b"")
        self.downstream_bytes.append(0)
        limit = self.cut_after if index == 0 else None
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def up() -> None:
            while data := await cr.read(65536):
                self.requests[index] += data
                sw.write(data)
                await sw.drain()

        async def down() -> None:
            while data := await sr.read(65536):
                if limit is not None:
                    data = data[: limit - self.downstream_bytes[index]]
                self.downstream_bytes[index] += len(data)
                cw.write(data)
                await cw.drain()
                if limit is not None and self.downstream_bytes[index] >= limit:
                    return  # the cut: close both sides mid-body

        tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
        with contextlib.suppress(ConnectionError):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in (cw, sw):
            w.close()
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()


class UdpProxy(asyncio.DatagramProtocol):
    """A NAT between CoAP clients and a UDP server: one upstream socket per client address (so
    the server tells clients apart, as it would without the proxy); drops everything while
    ``dropping``. Decodes the requests it forwards to record the Block2 numbers asked for."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.dropping = False
        self.dropped = 0
        self.blocks_asked: list[int] = []
        self.clients: list[Any] = []
        self.port = 0
        self._down: asyncio.DatagramTransport | None = None
        self._up: dict[Any, socket.socket] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> UdpProxy:
        self._loop = asyncio.get_running_loop()
        self._down, _ = await self._loop.create_datagram_endpoint(
            lambda: self, local_addr=("127.0.0.1", 0)
        )
        self.port = self._down.get_extra_info("sockname")[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._loop is not None
        for sock in self._up.values():
            self._loop.remove_reader(sock.fileno())
            sock.close()
        if self._down is not None:
            self._down.close()

    def _upstream(self, client: Any) -> socket.socket:
        sock = self._up.get(client)
        if sock is None:
            assert self._loop is not None
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setblocking(False)
            sock.bind(("127.0.0.1", 0))
            self._loop.add_reader(sock.fileno(), self._from_server, sock, client)
            self._up[client] = sock
            self.clients.append(client)
        return sock

    def _from_server(self, sock: socket.socket, client: Any) -> None:
        while True:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                return
            if self.dropping:
                self.dropped += 1
            elif self._down is not None:
                self._down.sendto(data, client)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if self.dropping:
            self.dropped += 1
            return
        message = aiocoap.Message.decode(data)
        if message.opt.block2 is not None:
            self.blocks_asked.append(message.opt.block2.block_number)
        with contextlib.suppress(BlockingIOError):
            self._upstream(addr).sendto(data, self.target)


@contextlib.asynccontextmanager
async def http_app(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
    """A one-route aiohttp server on loopback; yields its base URL."""
    app = web.Application()
    app.router.add_get("/b", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/b"
    finally:
        await runner.cleanup()


# -- whole transfers ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["http", "coap"])
def test_whole_file_is_byte_identical(
    bundle: tuple[Path, str, bytes], tmp_path: Path, scheme: str
) -> None:
    served, sha, data = bundle
    seen: list[int] = []

    async def main() -> Path:
        async with ArtifactServer(served) as srv:
            url = srv.http_url(sha) if scheme == "http" else srv.coap_url(sha)
            return await fetch(url, tmp_path / "got.efb", length=SIZE, progress=seen.append)

    out = run(main())
    assert out == tmp_path / "got.efb"
    assert out.read_bytes() == data
    assert not (tmp_path / "got.efb.part").exists()
    assert seen == sorted(seen)
    assert seen[-1] == SIZE


def test_https_with_the_fleet_ca(bundle: tuple[Path, str, bytes], tmp_path: Path) -> None:
    served, sha, data = bundle
    ca = pki.init_ca(tmp_path / "pki")
    cert = pki.issue(ca.dir, "artifacts", tmp_path / "srv", kind="server", hosts=["127.0.0.1"])
    server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ssl.load_cert_chain(cert.cert, cert.key)
    device_ssl = ssl.create_default_context(cafile=str(ca.cert))

    async def main() -> None:
        async with ArtifactServer(served, http_ssl=server_ssl) as srv:
            url = srv.http_url(sha)
            assert url.startswith("https://")
            await fetch(url, tmp_path / "got.efb", length=SIZE, ssl=device_ssl)
            # Without the fleet CA the device must refuse the server, as a FetchError.
            with pytest.raises(FetchError, match=r"(?i)certificate"):
                await fetch(url, tmp_path / "no.efb", length=SIZE, attempts=1)

    run(main())
    assert (tmp_path / "got.efb").read_bytes() == data
    assert not (tmp_path / "no.efb").exists()


def test_empty_bundle(tmp_path: Path) -> None:
    (tmp_path / "e").write_bytes(b"")
    sha = publish(tmp_path / "served", tmp_path / "e")

    async def main() -> tuple[bytes, bytes]:
        async with ArtifactServer(tmp_path / "served") as srv:
            a = await fetch(srv.http_url(sha), tmp_path / "a.efb", length=0)
            b = await fetch(srv.coap_url(sha), tmp_path / "b.efb", length=0)
            return a.read_bytes(), b.read_bytes()

    assert run(main()) == (b"", b"")


# -- drops and resume --------------------------------------------------------------------------


def test_http_cut_midway_resumes_with_a_range_request(
    bundle: tuple[Path, str, bytes], tmp_path: Path
) -> None:
    served, sha, data = bundle

    async def main() -> tuple[TcpProxy, ArtifactServer]:
        async with (
            ArtifactServer(served) as srv,
            TcpProxy(srv.http_port, cut_after=1_000_000) as proxy,
        ):
            url = f"http://127.0.0.1:{proxy.port}/v1/bundles/{sha}"
            await fetch(url, tmp_path / "got.efb", length=SIZE, backoff_s=0.05)
            return proxy, srv

    proxy, srv = run(main())
    assert (tmp_path / "got.efb").read_bytes() == data
    assert len(proxy.requests) == 2
    assert b"range:" not in proxy.requests[0].lower()
    m = re.search(rb"(?i)range: bytes=(\d+)-", proxy.requests[1])
    assert m is not None
    resumed_at = int(m.group(1))
    assert 0 < resumed_at < 1_000_000
    assert srv.stats.http_range_requests == 1
    # The second connection carried the rest, not the whole file again.
    assert proxy.downstream_bytes[1] < SIZE - resumed_at + 2000


def test_coap_blackout_midway_resumes(
    bundle: tuple[Path, str, bytes], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    served, sha, data = bundle
    caplog.set_level(logging.WARNING, logger="ota.fetch")

    async def main() -> UdpProxy:
        async with ArtifactServer(served) as srv, UdpProxy(srv.coap_port) as proxy:
            url = f"coap://127.0.0.1:{proxy.port}/bundles/{sha}"
            blackout = asyncio.Event()

            def progress(n: int) -> None:
                if n > SIZE // 3 and not blackout.is_set():
                    blackout.set()
                    proxy.dropping = True

            task = asyncio.create_task(
                fetch(
                    url,
                    tmp_path / "got.efb",
                    length=SIZE,
                    stall_timeout_s=0.5,
                    attempts=20,
                    backoff_s=0.05,
                    progress=progress,
                )
            )
            await blackout.wait()
            await asyncio.sleep(1.5)  # three stall timeouts: attempts fail with nothing in
            proxy.dropping = False
            asked_before[:] = proxy.blocks_asked
            await task
            return proxy

    asked_before: list[int] = []
    proxy = run(main())
    assert (tmp_path / "got.efb").read_bytes() == data
    assert proxy.dropped > 0
    # Resumed, not restarted: after the blackout no request went back to the first blocks.
    asked_after = proxy.blocks_asked[len(asked_before) :]
    assert asked_after
    assert min(asked_after) > (SIZE // 3) // 1024 - 32
    # The blackout outlasted the stall timeout: attempts failed as stalled and the next ones
    # opened at the .part's size.
    retries = [r.getMessage() for r in caplog.records if r.name == "ota.fetch"]
    assert retries
    assert all("fetch_stalled" in m for m in retries), retries
    offsets = {int(m.group(1)) for r in retries if (m := re.search(r"offset (\d+) in", r))}
    assert offsets
    assert max(offsets) > SIZE // 3


def test_coap_changes_client_context_before_message_ids_wrap(
    bundle: tuple[Path, str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real budget (30,000 requests) needs a 30 MB bundle; a small one shows the same
    # hand-over: the window drains, a new context (new source port) resolves and goes on.
    monkeypatch.setattr(ota.fetch, "COAP_REQUESTS_PER_CONTEXT", 700)
    served, sha, data = bundle

    async def main() -> UdpProxy:
        async with ArtifactServer(served) as srv, UdpProxy(srv.coap_port) as proxy:
            url = f"coap://127.0.0.1:{proxy.port}/bundles/{sha}"
            await fetch(url, tmp_path / "got.efb", length=SIZE)
            return proxy

    proxy = run(main())
    assert (tmp_path / "got.efb").read_bytes() == data
    # Every block asked for (a few more when a slow reply was resent), from one new source
    # port per 700 requests.
    assert set(proxy.blocks_asked) == set(range(SIZE // 1024 + 1))
    assert len(proxy.clients) >= -(-(SIZE // 1024 + 1) // 700)


@pytest.mark.parametrize("scheme", ["http", "coap"])
def test_existing_part_file_is_resumed(
    bundle: tuple[Path, str, bytes], tmp_path: Path, scheme: str
) -> None:
    served, sha, data = bundle
    have = 1_500_001  # not on a block boundary: CoAP skips into its first block
    dest = tmp_path / "got.efb"
    dest.with_suffix(".efb.part").write_bytes(data[:have])

    async def main() -> tuple[ArtifactServer, TcpProxy | None]:
        async with ArtifactServer(served) as srv:
            if scheme == "coap":
                await fetch(srv.coap_url(sha), dest, length=SIZE)
                return srv, None
            async with TcpProxy(srv.http_port) as proxy:
                await fetch(f"http://127.0.0.1:{proxy.port}/v1/bundles/{sha}", dest, length=SIZE)
                return srv, proxy

    srv, proxy = run(main())
    assert dest.read_bytes() == data
    if proxy is not None:
        assert re.search(rb"(?i)range: bytes=1500001-", proxy.requests[0])
        assert SIZE - have < proxy.downstream_bytes[0] < SIZE - have + 2000
    else:
        # From the block holding byte 1,500,001 on (a resend under load may add a block).
        assert SIZE - (have // 1024) * 1024 <= srv.stats.coap_bytes < SIZE - have + 64 * 1024


def test_a_complete_part_file_is_only_renamed(tmp_path: Path) -> None:
    dest = tmp_path / "got.efb"
    dest.with_suffix(".efb.part").write_bytes(b"x" * 10)
    # Nothing listens on port 9: a request would fail.
    run(fetch("http://127.0.0.1:9/v1/bundles/x", dest, length=10, attempts=1))
    assert dest.read_bytes() == b"x" * 10


def test_200_answer_to_a_range_request_restarts_from_zero(tmp_path: Path) -> None:
    data = os.urandom(200_000)
    dest = tmp_path / "got.efb"
    dest.with_suffix(".efb.part").write_bytes(b"\xff" * 50_000)  # not a prefix of data
    ranges: list[str | None] = []

    async def whole(request: web.Request) -> web.Response:
        ranges.append(request.headers.get("Range"))
        return web.Response(body=data)

    async def main() -> None:
        async with http_app(whole) as url:
            await fetch(url, dest, length=len(data))

    run(main())
    assert ranges == ["bytes=50000-"]
    assert dest.read_bytes() == data


# -- limits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_http_peer_sending_more_than_declared(tmp_path: Path, declared: bool) -> None:
    length = 100_000
    body = os.urandom(length + 5000)

    async def too_long(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        if declared:
            resp.content_length = len(body)
        else:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(body), 7000):
            await resp.write(body[i : i + 7000])
        await resp.write_eof()
        return resp

    dest = tmp_path / "got.efb"

    async def main() -> None:
        async with http_app(too_long) as url:
            await fetch(url, dest, length=length, attempts=5, backoff_s=0.01)

    with pytest.raises(FetchTooLarge, match="100000"):
        run(main())
    assert not dest.exists()
    part = dest.with_suffix(".efb.part")
    if declared:
        assert not part.exists() or part.stat().st_size == 0  # refused before the body
    else:
        assert part.read_bytes() == body[:length]  # cut exactly at the declared length


def test_coap_bundle_larger_than_declared(bundle: tuple[Path, str, bytes], tmp_path: Path) -> None:
    served, sha, _ = bundle
    dest = tmp_path / "got.efb"

    async def main() -> None:
        async with ArtifactServer(served) as srv:
            await fetch(srv.coap_url(sha), dest, length=SIZE - 1)

    with pytest.raises(FetchTooLarge, match="Size2"):
        run(main())
    part = dest.with_suffix(".efb.part")
    assert not part.exists() or part.stat().st_size <= SIZE - 1


def test_http_stalled_peer_raises_fetch_stalled(tmp_path: Path) -> None:
    async def main() -> float:
        release = asyncio.Event()

        async def stall(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            resp.content_length = 1000
            await resp.prepare(request)  # headers out, then not a byte of the body
            await release.wait()
            return resp

        async with http_app(stall) as url:
            t0 = time.monotonic()
            try:
                with pytest.raises(FetchStalled, match=r"no data for 0\.3 s at offset 0"):
                    await fetch(
                        url, tmp_path / "x.efb", length=1000, stall_timeout_s=0.3, attempts=2
                    )
                return time.monotonic() - t0
            finally:
                release.set()

    elapsed = run(main(), timeout=30)
    assert elapsed >= 0.6  # two attempts, each waited out its stall timeout


def test_coap_silent_peer_raises_fetch_stalled(tmp_path: Path) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        hole, _ = await loop.create_datagram_endpoint(
            asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0)
        )
        port = hole.get_extra_info("sockname")[1]
        try:
            await fetch(
                f"coap://127.0.0.1:{port}/bundles/{'a' * 64}",
                tmp_path / "x.efb",
                length=5000,
                stall_timeout_s=0.3,
                attempts=2,
                backoff_s=0.01,
            )
        finally:
            hole.close()

    with pytest.raises(FetchStalled, match="offset 0"):
        run(main(), timeout=30)


class _ShortBlock(aiocoap.resource.Resource):  # type: ignore[misc]
    """Block 1 is 1000 bytes although more follow: a broken Block2 server."""

    async def needs_blockwise_assembly(self, request: Any) -> bool:
        return False

    async def render_get(self, request: Any) -> Any:
        num = request.opt.block2.block_number
        m = aiocoap.Message(code=Code.CONTENT, payload=b"z" * (1000 if num == 1 else 1024))
        m.opt.block2 = (num, True, 6)
        return m


def test_coap_block_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        site = aiocoap.resource.Site()
        site.add_resource(["b"], _ShortBlock())
        ctx = await aiocoap.Context.create_server_context(
            site, bind=("127.0.0.1", 0), transports=["udp6"]
        )
        try:
            port = ctx.request_interfaces[0].token_interface.message_interface._local_port()
            await fetch(f"coap://127.0.0.1:{port}/b", tmp_path / "x.efb", length=10_000, attempts=1)
        finally:
            await ctx.shutdown()

    with pytest.raises(FetchError, match="block 1 has 1000 bytes, expected 1024"):
        run(main())


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["http", "coap"])
def test_unknown_bundle_is_a_fetch_error(tmp_path: Path, scheme: str) -> None:
    (tmp_path / "served").mkdir()
    sha = "0" * 64

    async def main() -> None:
        async with ArtifactServer(tmp_path / "served") as srv:
            url = srv.http_url(sha) if scheme == "http" else srv.coap_url(sha)
            await fetch(url, tmp_path / "x.efb", length=10, attempts=2, backoff_s=0.01)

    with pytest.raises(FetchError, match="404" if scheme == "http" else "4.04") as info:
        run(main())
    assert type(info.value) is FetchError
    assert "offset 0" in str(info.value)


def test_error_messages_carry_no_credentials_or_query(tmp_path: Path) -> None:
    url = "http://admin:s3cret@127.0.0.1:9/v1/bundles/x?token=hunter2"
    with pytest.raises(FetchError) as info:
        run(fetch(url, tmp_path / "x.efb", length=10, attempts=1))
    text = str(info.value)
    for secret in ("s3cret", "hunter2", "admin"):
        assert secret not in text
    assert "127.0.0.1:9/v1/bundles/x?<redacted>" in text
    assert "offset 0" in text
    assert redact_url(url) == "http://127.0.0.1:9/v1/bundles/x?<redacted>"


def test_unsupported_scheme(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="unsupported scheme 'ftp'"):
        run(fetch("ftp://host/x", tmp_path / "x", length=1))


# -- the artifact server itself ----------------------------------------------------------------


def test_http_server_ranges_head_and_names(bundle: tuple[Path, str, bytes]) -> None:
    served, sha, data = bundle

    async def main() -> None:
        async with ArtifactServer(served) as srv, aiohttp.ClientSession() as s:
            url = srv.http_url(sha)
            async with s.get(url, headers={"Range": "bytes=100-199"}) as r:
                assert r.status == 206
                assert r.headers["Content-Range"] == f"bytes 100-199/{SIZE}"
                assert await r.read() == data[100:200]
            async with s.get(url, headers={"Range": f"bytes={SIZE}-"}) as r:
                assert r.status == 416
            async with s.head(url) as r:
                assert r.status == 200
                assert r.content_length == SIZE
                assert await r.read() == b""
            base = f"http://127.0.0.1:{srv.http_port}/v1/bundles/"
            for bad in ("xyz", sha.upper(), sha[:-1], sha + "0", "..%2F..%2Fetc%2Fpasswd"):
                async with s.get(base + bad) as r:
                    assert r.status == 400, bad
            async with s.get(base + "f" * 64) as r:
                assert r.status == 404
            assert srv.stats.http_bad_name == 5
            assert srv.stats.http_not_found == 1

    run(main())


def test_coap_server_names_blocks_and_size2(bundle: tuple[Path, str, bytes]) -> None:
    served, sha, data = bundle

    async def main() -> None:
        async with ArtifactServer(served) as srv:
            ctx = await aiocoap.Context.create_client_context(transports=["udp6"])
            try:

                async def get(path: str, block: tuple[int, bool, int] | None = None) -> Any:
                    m = aiocoap.Message(
                        code=Code.GET, uri=f"coap://127.0.0.1:{srv.coap_port}/{path}"
                    )
                    if block is not None:
                        m.opt.block2 = block
                    return await ctx.request(m, handle_blockwise=False).response

                r = await get(f"bundles/{sha}", (3, False, 6))
                assert r.code == Code.CONTENT
                assert r.payload == data[3072:4096]
                assert r.opt.size2 == SIZE
                assert tuple(r.opt.block2) == (3, True, 6)
                last = (SIZE - 1) // 256
                r = await get(f"bundles/{sha}", (last, False, 4))  # 256-byte blocks
                assert r.payload == data[last * 256 :]
                assert not r.opt.block2.more
                r = await get(f"bundles/{sha}", (last + 1, False, 4))
                assert r.code == Code.BAD_OPTION
                for bad in ("xyz", sha.upper(), f"{sha}/extra"):
                    r = await get(f"bundles/{bad}")
                    assert r.code == Code.BAD_REQUEST, bad
                r = await get(f"bundles/{'e' * 64}")
                assert r.code == Code.NOT_FOUND
            finally:
                await ctx.shutdown()

    run(main())


def test_publish_names_the_file_by_its_sha256(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"bundle bytes")
    sha = publish(tmp_path / "served", tmp_path / "f")
    assert sha == hashlib.sha256(b"bundle bytes").hexdigest()
    assert bundle_path(tmp_path / "served", sha).read_bytes() == b"bundle bytes"
    assert [p.name for p in (tmp_path / "served").iterdir()] == [f"{sha}.efb"]
    with pytest.raises(ValueError, match="not a sha256"):
        bundle_path(tmp_path, "../etc/passwd")


# -- the CLI -----------------------------------------------------------------------------------


def test_cli_add_and_serve(tmp_path: Path) -> None:
    data = os.urandom(300_000)
    (tmp_path / "b.efb").write_bytes(data)
    served = tmp_path / "served"
    r = CliRunner().invoke(artifacts_app, ["add", str(tmp_path / "b.efb"), "--dir", str(served)])
    assert r.exit_code == 0, r.output
    sha = r.output.split()[0]
    assert sha == hashlib.sha256(data).hexdigest()

    proc = subprocess.Popen(
        [
            *(sys.executable, "-c", "from fleet.artifacts_cli import app; app()", "serve"),
            *("--dir", str(served), "--http-port", "0", "--coap-port", "0", "--json"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ports = json.loads(proc.stdout.readline())

        async def main() -> None:
            for url in (
                f"http://127.0.0.1:{ports['http_port']}/v1/bundles/{sha}",
                f"coap://127.0.0.1:{ports['coap_port']}/bundles/{sha}",
            ):
                got = await fetch(url, tmp_path / "got.efb", length=len(data))
                assert got.read_bytes() == data

        run(main())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["http_requests"] == 1
    assert stats["coap_bytes"] == len(data)


def test_cli_serve_missing_dir(tmp_path: Path) -> None:
    r = CliRunner().invoke(
        artifacts_app, ["serve", "--dir", str(tmp_path / "nope"), "--http-port", "0"]
    )
    assert r.exit_code == 1
    assert "does not exist" in r.output
