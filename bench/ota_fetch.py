"""OTA transport throughput on loopback: ``ota.fetch`` over HTTP and CoAP vs bare clients.

A random file (10 MB; 2 MB with ``--quick``) is published into a temporary directory and
served by ``fleet.artifacts.ArtifactServer`` in a child process (the device does not serve
itself, and the two processes may use both cores). The device side, in this process:

- ``http_mb_per_s`` — ``ota.fetch`` over HTTP (best of 3): .part file, cap, stall timer,
  fsync + rename + directory fsync included.
- ``bare_http_mb_per_s`` — the baseline: a bare aiohttp GET reading the body in 64 KB
  chunks and discarding it (best of 3), same server; ``bare_http_disk_mb_per_s`` the same
  loop writing the chunks to a file and fsyncing it, which is most of the gap.
- ``coap_mb_per_s`` — ``ota.fetch`` over CoAP: explicit Block2 requests, ``coap_block_bytes``
  blocks, ``coap_window`` requests in flight, ``coap_blocks`` blocks (one run: it is slow
  enough to average itself).
- ``coap_same_process_mb_per_s`` — the same CoAP fetch with the server in this process:
  less CPU per block in all (no wake-up of another process per datagram) but one core; on
  a loaded machine it can come out ahead of the two-process figure.
- ``coap_auto_mb_per_s`` — aiocoap's own Block2 reassembly on ``coap_auto_size_mb`` (1 MB:
  it is quadratic, a 10 MB transfer takes about a minute), the client the issue replaced.

    python -m bench.ota_fetch [--quick] [--json]

Target: coap_mb_per_s >= 0.8 (issue 7). ``measure(size_bytes)`` is what the OTA benchmark
calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import aiocoap
import aiohttp
from aiocoap.numbers.codes import Code

from fleet.artifacts import ArtifactServer, publish
from ota.fetch import COAP_BLOCK_SZX, COAP_WINDOW, fetch

MB = 1_000_000
AUTO_SIZE = 1 * MB


def _serve(directory: str, conn: Connection) -> None:
    """Child process: serve ``directory`` until the parent sends anything."""

    async def main() -> None:
        async with ArtifactServer(Path(directory)) as srv:
            conn.send((srv.http_port, srv.coap_port))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main())


async def _bare_http(url: str) -> int:
    n = 0
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        r.raise_for_status()
        async for chunk in r.content.iter_chunked(64 * 1024):
            n += len(chunk)
    return n


async def _bare_http_disk(url: str, dest: Path) -> int:
    n = 0
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        r.raise_for_status()
        with open(dest, "wb") as out:  # noqa: ASYNC230 - inline writes, as ota.fetch does
            async for chunk in r.content.iter_chunked(64 * 1024):
                out.write(chunk)
                n += len(chunk)
            os.fsync(out.fileno())
    return n


async def _auto_coap(url: str) -> int:
    ctx = await aiocoap.Context.create_client_context(transports=["udp6"])
    try:
        r = await ctx.request(aiocoap.Message(code=Code.GET, uri=url)).response
        return len(r.payload)
    finally:
        await ctx.shutdown()


async def _timed(coro_factory: object, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        await coro_factory()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return best


def measure(size_bytes: int) -> dict[str, float]:
    """Loopback throughput of ``ota.fetch`` (HTTP, CoAP) and the bare baselines, in MB/s."""
    with tempfile.TemporaryDirectory(prefix="bench-ota-fetch-") as tmp:
        root = Path(tmp)
        src = root / "src"
        src.write_bytes(os.urandom(size_bytes))
        sha = publish(root / "served", src)
        (root / "small").write_bytes(os.urandom(min(AUTO_SIZE, size_bytes)))
        small_sha = publish(root / "served", root / "small")

        parent, child = multiprocessing.get_context("spawn").Pipe()
        proc = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(str(root / "served"), child), daemon=True
        )
        proc.start()
        try:
            http_port, coap_port = parent.recv()
            http_url = f"http://127.0.0.1:{http_port}/v1/bundles/{sha}"
            coap_url = f"coap://127.0.0.1:{coap_port}/bundles/{sha}"
            dest = root / "got.efb"

            async def run() -> dict[str, float]:
                async def via_http() -> None:
                    await fetch(http_url, dest, length=size_bytes)
                    dest.unlink()

                async def via_coap() -> None:
                    await fetch(coap_url, dest, length=size_bytes)
                    if dest.stat().st_size != size_bytes:
                        raise AssertionError("CoAP transfer incomplete")
                    dest.unlink()

                async def bare() -> None:
                    if await _bare_http(http_url) != size_bytes:
                        raise AssertionError("bare GET incomplete")

                async def bare_disk() -> None:
                    if await _bare_http_disk(http_url, dest) != size_bytes:
                        raise AssertionError("bare GET incomplete")
                    dest.unlink()

                async def auto() -> None:
                    small = f"coap://127.0.0.1:{coap_port}/bundles/{small_sha}"
                    await _auto_coap(small)

                async def same_process() -> None:
                    async with ArtifactServer(root / "served") as local:
                        await fetch(local.coap_url(sha), dest, length=size_bytes)
                    dest.unlink()

                bare_s = await _timed(bare, 3)
                bare_disk_s = await _timed(bare_disk, 3)
                http_s = await _timed(via_http, 3)
                coap_s = await _timed(via_coap, 1)
                same_s = await _timed(same_process, 1)
                auto_s = await _timed(auto, 1)
                size_mb = size_bytes / MB
                block = 2 ** (COAP_BLOCK_SZX + 4)
                return {
                    "size_mb": round(size_mb, 3),
                    "http_mb_per_s": round(size_mb / http_s, 2),
                    "bare_http_mb_per_s": round(size_mb / bare_s, 2),
                    "bare_http_disk_mb_per_s": round(size_mb / bare_disk_s, 2),
                    "coap_mb_per_s": round(size_mb / coap_s, 3),
                    "coap_same_process_mb_per_s": round(size_mb / same_s, 3),
                    "coap_blocks": float(-(-size_bytes // block)),
                    "coap_block_bytes": float(block),
                    "coap_window": float(COAP_WINDOW),
                    "coap_auto_size_mb": round(min(AUTO_SIZE, size_bytes) / MB, 3),
                    "coap_auto_mb_per_s": round(min(AUTO_SIZE, size_bytes) / MB / auto_s, 3),
                }

            return asyncio.run(run())
        finally:
            parent.send("stop")
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 MB instead of 10 MB")
    ap.add_argument("--json", action="store_true", help="print the JSON result as the last line")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    r = measure(2 * MB if args.quick else 10 * MB)
    print(f"ota fetch, {r['size_mb']:g} MB on loopback (server in a child process)")
    print(
        f"  HTTP  ota.fetch {r['http_mb_per_s']:g} MB/s   bare aiohttp GET "
        f"{r['bare_http_mb_per_s']:g} MB/s, to disk + fsync {r['bare_http_disk_mb_per_s']:g} MB/s"
    )
    print(
        f"  CoAP  ota.fetch {r['coap_mb_per_s']:g} MB/s ({r['coap_blocks']:g} blocks of "
        f"{r['coap_block_bytes']:g} B, {r['coap_window']:g} in flight; target >= 0.8)"
    )
    print(f"        server in this process {r['coap_same_process_mb_per_s']:g} MB/s")
    print(
        f"        aiocoap automatic Block2 {r['coap_auto_mb_per_s']:g} MB/s "
        f"on {r['coap_auto_size_mb']:g} MB"
    )
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
