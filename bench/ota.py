"""OTA on the device: verify+stage cost, hot-swap pause, rollback time, transfer rates.

- **verify+stage** of a 1 MB and a 50 MB model bundle (one big ``model.tflite`` payload):
  :func:`ota.verify.verify_bundle` from ``incoming/`` into the content store (header and
  manifest checks, the signature, every payload hashed while streaming, then the bundle
  renamed into the store and its payloads indexed, with fsyncs), against a bare sha256 of
  the same file's bytes in the same run (page cache warm for both). Median of N runs.
- **swap pause and missed windows**: the real agent (simulator, a window every grid step,
  100 windows/s) installs model bundles through its updater. As in ``bench.hot_swap``, the
  pause of a swap is what the swap call held the loop (``Agent.last_swap_ns``) plus what
  the first window scored by the new model took beyond the median reasoning latency (a
  cold model could be slower). A 1 ms ticker on the loop is reported too, during the swaps
  and over the quiet seconds before, to show how busy the loop is anyway. Missed windows:
  windows lost around each swap (from the ``activate`` step to 100 ms after the new model
  went live): reasoning-queue drops and gaps in the decided window sequence in that span.
  ``missed_windows_all`` counts the same over the whole run, swaps or not (the loaded
  loop drops a few windows at 100 windows/s by itself, as ``bench.e2e`` shows).
- **rollback**: a bundle whose probation fails at once (its ``p99_us`` limit is 1 µs);
  time from the failed check to the previous model serving (the updater's own figure).
- **transfer**: :func:`bench.ota_fetch.measure` (HTTP with ranges, CoAP block-wise).

    python -m bench.ota [--quick] [--json]

Keys: verify_ratio_50mb, verify_ratio_1mb, verify_ms_50mb, sha256_ms_50mb, swap_pause_us,
loop_lateness_quiet_us, missed_windows, rollback_ms, coap_mb_per_s, http_mb_per_s.
Targets: ratio <= 1.3; pause <= 1,000 µs with zero missed; rollback <= 1,000 ms;
CoAP >= 0.8 MB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.ota_fetch import measure
from drivers.sim.server import PlantSimulator
from edge_agent.compose import build_agent
from edge_agent.config import parse_config
from edge_agent.rules import Decision
from models.copies import copy_with_new_sha
from ota import build, keys
from ota.machine import Journal
from ota.store import ContentStore
from ota.trust import load_root
from ota.verify import Policy, verify_bundle
from tests.support.ports import free_port

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEVICE = "motor-drive-gw"


class Keys:
    def __init__(self) -> None:
        self.root = keys.generate()
        self.bundle = keys.generate()

    def root_json(self) -> bytes:
        signed = build.root_signed(
            version=1,
            expires=datetime.now(UTC) + timedelta(days=30),
            root_keys=[self.root.public_key()],
            bundle_keys=[self.bundle.public_key()],
        )
        return build.sign_envelope(signed, [self.root])

    def bundle_file(
        self,
        out: Path,
        members: list[tuple[str, bytes]],
        counter: int,
        probation: dict[str, int] | None = None,
    ) -> Path:
        entries = [build.payload_entry(n, d)[0] for n, d in members]
        signed = build.bundle_signed(
            bundle_id=f"bench-{counter}",
            kind="model",
            version=f"1.{counter}.0",
            counter=counter,
            expires=datetime.now(UTC) + timedelta(days=1),
            device_types=[DEVICE],
            payloads=entries,
            required_permissions=["model:swap"],
            # The swap is measured here, not the model: a loaded machine's noise must not
            # roll a good swap back (the +15 % rule has its own tests).
            probation=probation or {"seconds": 1, "min_windows": 5, "regression_pct": 1000},
        )
        return build.write(out, signed, members, [self.bundle])


def _sha256_file(path: Path) -> float:
    t = time.perf_counter()
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    h.hexdigest()
    return time.perf_counter() - t


def verify_cost(k: Keys, size: int, runs: int) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-ota-verify-"))
    try:
        members = [("model.tflite", os.urandom(size)), ("model.json", b"{}")]
        src = k.bundle_file(tmp / "src.efb", members, counter=2)
        root = load_root(k.root_json(), datetime.now(UTC))
        policy = Policy(DEVICE, "0.1.0", frozenset({"model:swap"}))
        verify_s: list[float] = []
        bare_s: list[float] = []
        for i in range(runs):
            store = ContentStore(tmp / f"s{i}" / "store")
            store.ensure()
            path = store.incoming / "b.efb"
            shutil.copyfile(src, path)
            os.sync()
            bare_s.append(_sha256_file(path))  # warms the page cache for both
            t = time.perf_counter()
            verify_bundle(
                path, root=root, policy=policy, floors={}, now=datetime.now(UTC), store=store
            )
            verify_s.append(time.perf_counter() - t)
            shutil.rmtree(tmp / f"s{i}")
        v, b = statistics.median(verify_s), statistics.median(bare_s)
        return {"verify_ms": v * 1000, "sha256_ms": b * 1000, "ratio": v / b}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def _until(pred: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("the agent decided too few windows")
        await asyncio.sleep(0.05)


async def agent_run(k: Keys, swaps: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-ota-agent-"))
    port, channel = free_port(), f"bench-ota-{uuid.uuid4().hex[:8]}"
    (tmp / "root.json").write_bytes(k.root_json())
    text = (EXAMPLES / "agent.toml").read_text()
    text = text.replace('state_dir = "../var/demo-gw-01"', f'state_dir = "{tmp / "state"}"')
    text = text.replace("port = 8080", "port = 0").replace("port = 15020", f"port = {port}")
    text = text.replace('channel = "edgefleet-demo"', f'channel = "{channel}"')
    text = text.replace("# hop = 64 ", "hop = 1 ")
    text = text.replace(
        "[ota]\nenabled = true\n", f'[ota]\nenabled = true\ntrust_root = "{tmp / "root.json"}"\n'
    )
    cfg = parse_config(text, base_dir=EXAMPLES)
    decisions: list[Decision] = []
    decided_at: list[float] = []

    def on_decision(d: Decision) -> None:
        decisions.append(d)
        decided_at.append(time.monotonic())

    agent = build_agent(cfg, on_decision=on_decision)
    assert agent.ota is not None
    ota = agent.ota
    lateness: list[tuple[float, float, int]] = []  # (monotonic, lateness s, queue drops)
    marks: list[tuple[str, float, int]] = []
    report = ota.updater.on_transition

    def hook(j: Journal, reason: str, detail: dict[str, Any]) -> None:
        marks.append((j.state, time.monotonic(), agent.reasoning_queue.dropped))
        if report is not None:
            report(j, reason, detail)

    ota.updater.on_transition = hook
    stop = asyncio.Event()
    result: dict[str, Any] = {}
    swap_us: list[float] = []
    new_shas: list[str] = []

    async def ticker() -> None:
        while not stop.is_set():
            t = time.monotonic()
            await asyncio.sleep(0.001)
            late = time.monotonic() - t - 0.001
            lateness.append((t, late, agent.reasoning_queue.dropped))

    async def drive() -> None:
        try:
            await _until(lambda: len(decisions) >= 200)
            quiet_from = time.monotonic()
            await asyncio.sleep(2.0)
            quiet_to = time.monotonic()
            dropped0 = agent.reasoning_queue.dropped
            for i in range(swaps):
                tag = f"b{i}"
                d = copy_with_new_sha(tmp / f"m{i}", tag)
                b = k.bundle_file(tmp / f"{tag}.efb", build.model_bundle_payloads(d), counter=i + 2)
                out = await ota.install_file(b)
                assert out.result == "committed", out
                swap_us.append(agent.last_swap_ns / 1000)
                new_shas.append(agent.model_sha256())
            bad_dir = copy_with_new_sha(tmp / "bad", "bad")
            bad = k.bundle_file(
                tmp / "bad.efb",
                build.model_bundle_payloads(bad_dir),
                counter=swaps + 2,
                probation={"seconds": 3, "p99_us": 1, "min_windows": 1},
            )
            out = await ota.install_file(bad)
            assert out.result == "rolled_back", out
            result["rollback_ms"] = ota.updater.last_rollback_ms
            result["queue_dropped"] = agent.reasoning_queue.dropped - dropped0
            result["quiet"] = (quiet_from, quiet_to)
            await asyncio.sleep(0.5)
        finally:
            stop.set()

    try:
        async with (
            PlantSimulator(seed=3, modbus_port=port, can_channel=channel),
            asyncio.TaskGroup() as tg,
        ):
            tg.create_task(ticker())
            tg.create_task(drive())
            await agent.run(stop)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    q0, q1 = result["quiet"]
    quiet = max((lat for t, lat, _ in lateness if q0 <= t < q1), default=0.0)
    during: list[float] = []
    swap_missed = 0
    seqs = [d.window_seq for d in decisions]
    for (state, t0, d0), (nxt, t1, _) in itertools.pairwise(marks):
        if state == "activating" and nxt == "probation":
            during.append(
                max((lat for t, lat, _ in lateness if t0 <= t <= t1 + 0.002), default=0.0)
            )
            end = t1 + 0.1
            d1 = max((dr for t, _, dr in lateness if t <= end), default=d0)
            span = [s for s, at in zip(seqs, decided_at, strict=True) if t0 <= at <= end]
            gaps_in = sum(b - a - 1 for a, b in itertools.pairwise(span) if b > a + 1)
            swap_missed += (d1 - d0) + gaps_in
    reasoning_us = [d.stage_latency_ms["reasoning"] * 1000 for d in decisions]
    median_us = statistics.median(reasoning_us)
    pauses: list[float] = []
    for call_us, sha in zip(swap_us, new_shas, strict=True):
        first = next(d for d in decisions if d.model_sha256 == sha)
        extra = max(0.0, first.stage_latency_ms["reasoning"] * 1000 - median_us)
        pauses.append(call_us + extra)
    gaps = sum(b - a - 1 for a, b in itertools.pairwise(seqs) if b > a + 1)
    return {
        "swap_pause_us": round(max(pauses), 1) if pauses else None,
        "swap_pause_p50_us": round(statistics.median(pauses), 1) if pauses else None,
        "swap_call_max_us": round(max(swap_us), 1) if swap_us else None,
        "loop_lateness_during_swap_us": round(max(during) * 1e6, 1) if during else None,
        "loop_lateness_quiet_us": round(quiet * 1e6, 1),
        "missed_windows": swap_missed,
        "missed_windows_all": gaps + result["queue_dropped"],
        "swaps": len(pauses),
        "windows": len(decisions),
        "rollback_ms": round(result["rollback_ms"], 1) if result.get("rollback_ms") else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ota", description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    k = Keys()
    runs = 3 if args.quick else 7
    one = verify_cost(k, 1 << 20, runs)
    fifty = verify_cost(k, 50 << 20, runs)
    agent = asyncio.run(agent_run(k, swaps=3 if args.quick else 10))
    out: dict[str, Any] = {
        "verify_ratio_50mb": round(fifty["ratio"], 3),
        "verify_ms_50mb": round(fifty["verify_ms"], 1),
        "sha256_ms_50mb": round(fifty["sha256_ms"], 1),
        "verify_ratio_1mb": round(one["ratio"], 3),
        "verify_ms_1mb": round(one["verify_ms"], 2),
        "sha256_ms_1mb": round(one["sha256_ms"], 2),
        **agent,
    }
    rates = measure((2 if args.quick else 10) * 1024 * 1024)
    out["coap_mb_per_s"] = rates.get("coap_mb_per_s")
    out["http_mb_per_s"] = rates.get("http_mb_per_s")
    if not args.json:
        for key, value in out.items():
            print(f"{key:>24}: {value}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
