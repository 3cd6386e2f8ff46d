"""Agent builds over OTA, end to end through the A/B launcher, as systemd would run it.

The agent runs as ``python -P -m firmware.boot --slots DIR -- run ...`` (the unit's
ExecStart); the test plays systemd's ``Restart=on-failure``: when the agent exits non-zero
it is started again. The bundles carry real wheels of this project (another version; for the
crash loop, one whose CLI exits 1 at once).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from firmware.slots import Slots
from tests.support.agent import EXAMPLES, example_text
from tests.support.firmware import crashing_cli, marker_cli, variant
from tests.support.ota import Signer
from tests.support.ports import free_port

pytestmark = pytest.mark.peers


def _config(tmp: Path, signer: Signer) -> tuple[Path, int, Path]:
    api = free_port()
    slots = tmp / "slots"
    text = example_text().replace("port = 15020", f"port = {free_port()}")
    text = text.replace('channel = "edgefleet-demo"', f'channel = "b-{uuid.uuid4().hex[:8]}"')
    text = text.replace("port = 0", f"port = {api}", 1)
    text = text.replace('"../', f'"{EXAMPLES.parent}/')
    root = signer.write_root(tmp / "root.json")
    text = text.replace(
        'permissions = ["model:swap", "config:write"]',
        f'permissions = ["model:swap", "config:write", "agent:replace"]\n'
        f'trust_root = "{root}"\nslots_dir = "{slots}"',
    )
    path = tmp / "agent.toml"
    path.write_text(text)
    return path, api, slots


def _start(cfg: Path, slots: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-P",
            "-m",
            "firmware.boot",
            "--slots",
            str(slots),
            "--",
            "run",
            "-c",
            str(cfg),
            "--simulate",
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        cwd="/",
    )


def _status(api: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{api}/v1/status", timeout=1) as r:
            doc: dict[str, Any] = json.loads(r.read())
            return doc
    except (OSError, ValueError):
        return None


def _wait_status(
    api: int, proc: subprocess.Popen[bytes], pred: Any, timeout: float, log: Path
) -> dict[str, Any]:
    """The agent's first status that satisfies ``pred``; on failure, say why with the last
    status seen and the end of the agent's log."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        st = _status(api)
        if st is not None:
            if pred(st):
                return st
            last = st
        elif proc.poll() is not None:
            why = f"agent exited with {proc.returncode}"
            break
        time.sleep(0.2)
    else:
        why = f"timed out after {timeout} s waiting for the agent's status"
    ota = None if last is None else last.get("ota")
    raise AssertionError(f"{why}; last ota status {ota}; log:\n{log.read_text()[-4000:]}")


def _install(api: int, bundle: Path) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{api}/v1/ota/install",
        data=json.dumps({"path": str(bundle)}).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _agent_bundle(
    signer: Signer, tmp: Path, wheel: Path, version: str, counter: int, **limits: int
) -> Path:
    return signer.bundle(
        tmp / f"agent-{version}.efb",
        [(wheel.name, wheel.read_bytes())],
        kind="agent",
        version=version,
        counter=counter,
        probation={"seconds": 3, "min_windows": 2, **limits},
    )


def _compiled_kernels(slot: Path) -> list[Path]:
    """numba's cache of the build's kernels, beside the slot's own models/kernels.py."""
    return sorted((slot / "models" / "__pycache__").glob("kernels.*.nbi"))


@dataclass(frozen=True)
class Installed:
    """An agent that took a build and exited for systemd to restart it into its slot."""

    cfg: Path
    api: int
    slots: Path
    log: Path

    def start(self) -> subprocess.Popen[bytes]:
        return _start(self.cfg, self.slots, self.log)

    def wait_last(self, proc: subprocess.Popen[bytes], result: str, timeout: float) -> Any:
        """The status once the last OTA outcome is ``result``."""
        return _wait_status(
            self.api,
            proc,
            lambda s: (s["ota"].get("last") or {}).get("result") == result,
            timeout,
            self.log,
        )


def _install_build(
    tmp: Path,
    real_wheel: Path,
    version: str,
    cli: Callable[[str], str] = marker_cli,
    **limits: int,
) -> Installed:
    """Start the base install, hand it a signed build of ``version`` (``cli`` rewrites the
    build's CLI module) and wait for its "restart me" exit (3, for systemd)."""
    signer = Signer()
    cfg, api, slots = _config(tmp, signer)
    out = tmp / f"edgefleet-{version}-py3-none-any.whl"
    wheel = variant(real_wheel, out, version=version, cli=cli)
    bundle = _agent_bundle(signer, tmp, wheel, version, 1, **limits)
    log = tmp / "agent.log"
    proc = _start(cfg, slots, log)
    try:
        _wait_status(api, proc, lambda s: s["windows"] >= 2, 60, log)
        code, outcome = _install(api, bundle)
        assert (code, outcome["result"]) == (202, "restart"), outcome
        assert proc.wait(30) == 3, log.read_text()[-3000:]
    finally:
        proc.terminate()
        proc.wait(20)
    return Installed(cfg, api, slots, log)


def test_a_new_agent_build_installs_restarts_into_its_slot_and_commits(
    tmp_path: Path,
    real_wheel: Path,
) -> None:
    it = _install_build(tmp_path, real_wheel, "0.1.1")
    state = Slots(it.slots).load()
    assert state.active is not None
    assert state.slot(state.active).status == "trying"
    # Its kernels were compiled at install: its first start loads them like any other.
    assert _compiled_kernels(it.slots / state.active), list((it.slots / state.active).iterdir())
    # systemd starts it again: the launcher runs the new slot; its probation commits.
    proc = it.start()
    try:
        st = it.wait_last(proc, "committed", 90)
        assert st["ota"]["active"]["agent"]["version"] == "0.1.1"
        assert st["ota"]["state"] == "idle"
        assert st["ota"]["floors"] == {"agent": 1}
        state = Slots(it.slots).load()
        assert state.active is not None
        assert state.slot(state.active).status == "good"
        assert state.slot(state.active).version == "0.1.1"
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_crash_looping_build_gives_way_after_max_boots_and_is_reported_rolled_back(
    tmp_path: Path,
    real_wheel: Path,
) -> None:
    it = _install_build(tmp_path, real_wheel, "0.1.2", cli=crashing_cli)
    # systemd's Restart=on-failure: the new build dies at once, boot after boot.
    for _ in range(Slots(it.slots).max_boots):
        assert it.start().wait(60) == 1
    proc = it.start()  # the launcher gives up on it: the base install runs
    try:
        st = it.wait_last(proc, "rolled_back", 60)
        assert "did not become healthy" in st["ota"]["last"]["reason"]
        assert "agent" not in st["ota"]["active"]
        state = Slots(it.slots).load()
        assert state.active is None
        assert state.last_event is not None
        assert state.last_event.kind == "fell_back_to_base"
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_build_that_fails_its_probation_restarts_the_agent_into_the_base_install(
    tmp_path: Path,
    real_wheel: Path,
) -> None:
    # A reasoning P99 of 1 µs: no build keeps it, so the probation fails once scored.
    it = _install_build(tmp_path, real_wheel, "0.1.3", p99_us=1)
    # The new build: its probation fails and the agent restarts itself ("restart me")
    # to go back to the base install.
    assert it.start().wait(60) == 3, it.log.read_text()[-3000:]
    assert Slots(it.slots).load().active is None
    proc = it.start()
    try:
        st = it.wait_last(proc, "rolled_back", 60)
        assert "reasoning P99" in st["ota"]["last"]["reason"], st["ota"]["last"]
        assert "agent" not in st["ota"]["active"]
        assert st["ota"]["state"] == "idle"
        assert "rolling back to base" in it.log.read_text()
    finally:
        proc.terminate()
        proc.wait(20)
