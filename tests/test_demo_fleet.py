"""``make demo`` end to end (three gateways instead of five, to spare CI): the v2 rollout
completes on every gateway, the too-slow v3 halts at its first wave with a latency
regression and its canary is back on v2, and the demo leaves no process behind."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from fleet.store import open_store

pytestmark = pytest.mark.peers

REPO = Path(__file__).resolve().parents[1]


# The whole demo runs (about two minutes, more on a loaded machine): the subprocess's own
# 300 s bound decides, not the suite's 120 s default.
@pytest.mark.timeout(360)
def test_the_fleet_demo_tells_the_whole_story() -> None:
    before = {p.pid for p in psutil.process_iter()}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo_fleet.py"), "--agents", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "fleet keys init" in out
    assert "fleet rollout create" in out
    # Where to watch it: the console's address and a viewer token that the store knows.
    console = re.search(r"console: http://127\.0\.0\.1:(\d+)/  viewer token: (eft_\S+)", out)
    assert console, out[-3000:]
    serve_log = (REPO / "var" / "demo-fleet" / "logs" / "fleet-serve.log").read_text()
    assert f"api: http://127.0.0.1:{console[1]}/" in serve_log, serve_log[-2000:]
    store = open_store(f"sqlite://{REPO / 'var' / 'demo-fleet' / 'fleet.db'}")
    try:
        (token,) = [t for t in store.tokens() if t.name == "demo-viewer"]
    finally:
        store.close()
    assert token.role == "viewer"
    assert console[2].startswith(f"eft_{token.token_id}_")
    summary = out[out.index("summary") :]
    assert "gw-01 runs model 2.0.0, gw-02 runs model 2.0.0, gw-03 runs model 2.0.0" in summary
    assert "(model-2.0.0 2.0.0): completed; 3/3 committed" in summary
    # One line each, however long: the output is a pipe, not an 80-column terminal.
    halted = [line for line in summary.splitlines() if "(model-3.0.0 3.0.0): halted" in line]
    assert len(halted) == 1, summary
    assert "0/3 committed, 1 rolled back or failed; " in halted[0]
    assert "latency regression" in halted[0]
    # The logged output follows the rollouts: every wave, every device's outcome.
    for wave in (1, 2, 3):
        assert f"(2.0.0): wave {wave} started" in out, out
    for gw in ("gw-01", "gw-02", "gw-03"):
        assert f": {gw} committed 2.0.0" in out, out
    assert ": gw-01 rolled_back 3.0.0: latency regression" in out, out
    assert "(3.0.0): halted: " in out, out
    # The gateways' logs: no runtime chatter, and a clean stop is not a lost connection.
    for log in sorted((REPO / "var" / "demo-fleet" / "logs").glob("gw-*.log")):
        text = log.read_text()
        assert "XNNPACK" not in text, (log.name, text[-2000:])
        assert "lost" not in text, (log.name, text[-2000:])
    # This clone's demo only: another checkout may run its own demo at the same time.
    mine = str(REPO / "var" / "demo-fleet")
    left = [c for p in psutil.process_iter() if p.pid not in before and mine in (c := _cmd(p))]
    assert not left, left


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # gone meanwhile
        return ""
