"""The fleet API as the console uses it: the devices list and a device's 24 h chart.

``python -m bench.console [--quick] [--json] [--pg]``

A store (a SQLite file; with ``--pg`` also a private PostgreSQL schema) gets 1,000 devices
and a day of telemetry at one message a second (six signals, the model's) for the charted
devices (``--charted``, 4 quick / 10 full; filling every device's day would be 86 M
messages), written through the store's own ingest. The API runs in a process of its own,
as ``fleet serve`` runs it (``fleet.services.build_api`` + uvicorn on a free port); one
client with keep-alive asks, one request at a time:

* ``baseline``: ``GET /api/v1/health`` (no sign-in, no store): the framework's floor;
* ``devices``: ``GET /api/v1/devices`` (the first page of 100, as the console shows it) and
  ``devices_all`` (``limit=1000``);
* ``chart``: a charted device's signal over 24 h in at most 500 buckets (each request a
  different device/signal pair, in turn); ``chart_1h``: the last hour.

Keys: ``devices_p99_ms``, ``chart_p99_ms`` (targets <= 100 ms and <= 200 ms), the P50s,
``baseline_p99_ms``, the load average before and after (the host is shared), data sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from fleet.access import Principal
from fleet.changes import Changes
from fleet.store import OperatorStore, Row, open_store
from tests.support.pg import private_schema
from tests.support.ports import free_port
from wire import SignalStats, StateMsg, TelemetryMsg, encode

SITE = "bench-plant"
SIGNALS = ("current", "frequency", "speed", "vibration", "temperature", "voltage")
S = 1_000_000_000
DAY_S = 86_400
PG_DEFAULT = "postgresql://postgres@127.0.0.1:5432/test"
TARGETS = {"devices_p99_ms": 100.0, "chart_p99_ms": 200.0}


def _state(device: str, boot: str, now_ns: int) -> StateMsg:
    return StateMsg(
        device=device, boot_id=boot, seq=0, t_ns=now_ns, state="online", clean=True, site=SITE,
        device_type="motor-drive-gw", agent_version="0.1.0", model_sha256="a" * 64,
    )  # fmt: skip


def _telemetry(device: str, boot: str, seq: int, t_ns: int) -> bytes:
    phase = seq / 600.0
    signals = {
        name: SignalStats(
            mean=10.0 * k + (seq % 97) * 0.01 + phase % 1.0,
            min=10.0 * k - 1.0,
            max=10.0 * k + 2.0,
            last=10.0 * k,
            n=100,
        )
        for k, name in enumerate(SIGNALS)
    }
    msg = TelemetryMsg(
        device=device, boot_id=boot, seq=seq, t_ns=t_ns, period_ns=S, keyframe=seq % 10 == 0,
        signals=signals,
    )  # fmt: skip
    return encode(msg)


def populate(st: OperatorStore, devices: int, charted: int, now_ns: int) -> dict[str, Any]:
    """``devices`` registered devices, the first ``charted`` with a day of telemetry."""
    started = time.perf_counter()
    boots = {}
    for i in range(devices):
        name = f"gw-{i:04d}"
        boots[name] = uuid.uuid4().hex
        st.record_state(name, SITE, _state(name, boots[name], now_ns - DAY_S * S), now_ns)
    rows = 0
    for i in range(charted):
        name = f"gw-{i:04d}"
        batch: list[Row] = []
        for seq in range(1, DAY_S + 1):
            t = now_ns - (DAY_S - seq) * S
            batch.append(Row(name, SITE, "telemetry", boots[name], seq, t,
                             _telemetry(name, boots[name], seq, t), t))  # fmt: skip
            if len(batch) == 5000:
                st.ingest(batch)
                rows += len(batch)
                batch = []
        if batch:
            st.ingest(batch)
            rows += len(batch)
    return {
        "devices": devices,
        "charted_devices": charted,
        "telemetry_messages": rows,
        "signal_minutes": charted * len(SIGNALS) * (DAY_S // 60 + 1),
        "populate_s": round(time.perf_counter() - started, 1),
    }


def _token(url: str) -> str:
    st = open_store(url)
    try:
        st.migrate()
        return (
            Changes(st, Principal("cli:bench", "admin", "cli"))
            .create_token(f"bench-{uuid.uuid4().hex[:8]}", "viewer")
            .text
        )
    finally:
        st.close()


def _serve(url: str, port: int) -> None:
    """The API as fleet serve runs it, until SIGTERM (the server process's entry)."""
    from fleet.api.server import HttpListen, serve_api  # noqa: PLC0415
    from fleet.services import build_api  # noqa: PLC0415

    listen = HttpListen("127.0.0.1", port)
    api = build_api(url, listen, artifacts=Path(tempfile.mkdtemp()), root_json=None)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    asyncio.run(serve_api(api.app, api.sock, listen, stop))


@contextlib.contextmanager
def server(url: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.console", "--serve", url, str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(base + "/api/v1/health", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read() if proc.stderr else ""
                    raise RuntimeError(f"the API server did not start: {err[-2000:]}") from None
                time.sleep(0.1)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _timed(n: int, request: Callable[[int], httpx.Response]) -> dict[str, float]:
    for i in range(min(20, n)):  # warm: connections, SQLite's page cache, Python's caches
        request(i).raise_for_status()
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        r = request(i)
        times.append((time.perf_counter() - t0) * 1000)
        r.raise_for_status()
    times.sort()
    return {
        "p50_ms": round(statistics.median(times), 2),
        "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))], 2),
        "max_ms": round(times[-1], 2),
        "n": n,
    }


def measure(url: str, n: int, charted: int, now_ns: int) -> dict[str, Any]:
    token = _token(url)
    until = now_ns // S
    with (
        server(url) as base,
        httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=60) as c,
    ):
        pairs = [(f"gw-{d:04d}", s) for d in range(charted) for s in SIGNALS]

        def chart(i: int, span: int) -> httpx.Response:
            device, sig = pairs[i % len(pairs)]
            params: dict[str, str | int] = {
                "signal": sig, "since": until - span, "until": until, "points": 500,
            }  # fmt: skip
            return c.get(f"/api/v1/devices/{device}/telemetry", params=params)

        out: dict[str, Any] = {
            "baseline": _timed(n, lambda _i: c.get("/api/v1/health")),
            "devices": _timed(n, lambda _i: c.get("/api/v1/devices")),
            "devices_all": _timed(n, lambda _i: c.get("/api/v1/devices", params={"limit": 1000})),
            "chart": _timed(n, lambda i: chart(i, DAY_S)),
            "chart_1h": _timed(n, lambda i: chart(i, 3600)),
        }
        sample = chart(0, DAY_S).json()
        out["chart_points"] = len(sample["points"])
        out["chart_points_per_request"] = sum(p["points"] for p in sample["points"])
    return out


def run_backend(name: str, url: str, args: argparse.Namespace, now_ns: int) -> dict[str, Any]:
    st = open_store(url)
    try:
        st.migrate()
        data = populate(st, args.devices, args.charted, now_ns)
    finally:
        st.close()
    print(f"{name}: {data}", file=sys.stderr)
    return {"data": data, **measure(url, args.requests, args.charted, now_ns)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 charted devices, 200 requests each")
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--pg", action="store_true", help="also PostgreSQL (EDGEFLEET_TEST_PG_URL)")
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--charted", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--serve", nargs=2, metavar=("URL", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        _serve(args.serve[0], int(args.serve[1]))
        return 0
    args.charted = args.charted or (4 if args.quick else 10)
    args.requests = args.requests or (200 if args.quick else 1000)
    now_ns = time.time_ns()
    load_before = os.getloadavg()
    result: dict[str, Any] = {"quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="bench-console-") as tmp:
        result["sqlite"] = run_backend("sqlite", f"sqlite://{tmp}/fleet.db", args, now_ns)
        if args.pg:
            base = os.environ.get("EDGEFLEET_TEST_PG_URL", PG_DEFAULT)
            with private_schema(base) as url:
                result["postgresql"] = run_backend("postgresql", url, args, now_ns)
    main_run = result["sqlite"]
    result.update(
        devices_p99_ms=main_run["devices"]["p99_ms"],
        chart_p99_ms=main_run["chart"]["p99_ms"],
        devices_p50_ms=main_run["devices"]["p50_ms"],
        chart_p50_ms=main_run["chart"]["p50_ms"],
        baseline_p99_ms=main_run["baseline"]["p99_ms"],
        targets=TARGETS,
        load_before=[round(x, 2) for x in load_before],
        load_after=[round(x, 2) for x in os.getloadavg()],
    )
    result["met"] = {k: result[k] <= v for k, v in TARGETS.items()}
    if not args.json:
        for k in ("baseline", "devices", "devices_all", "chart", "chart_1h"):
            print(f"{k:12s} {main_run[k]}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
