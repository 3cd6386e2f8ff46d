"""The README's OTA example, run as written: keys, a signed model bundle, the example agent
(with its simulator) installing it, its status and a rollback.

The commands are read out of README.md, so this breaks when the README drifts. They run in a
temporary folder laid out like a clone (``examples/``, ``models/``, ``drivers/``, ``.venv/bin``)
with the example config copied; only its ports and CAN channel are changed, so that parallel
test runs do not meet on 8080 and 15020. The ``run`` line is the README's "second terminal":
it is started in the background, and the next command runs once the agent scores windows.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.support.ports import free_port

pytestmark = pytest.mark.peers

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: The paragraph that opens the README's OTA example; its first ``sh`` block follows.
MARKER = "OTA on this machine, end to end"


def readme_commands() -> list[str]:
    """The example's commands: continuation lines joined, comments dropped."""
    text = (REPO / "README.md").read_text()
    start = text.index(MARKER)
    block = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    assert block is not None, "the OTA example has no sh block"
    joined = block.group(1).replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        code = line.split("  #", 1)[0].strip()
        if code:
            commands.append(" ".join(code.split()))
    return commands


def clone_layout(tmp: Path) -> tuple[int, str]:
    """``tmp`` as a clone's root for the commands; returns the agent's API port."""
    (tmp / "examples").mkdir()
    (tmp / ".venv").mkdir()
    (tmp / ".venv" / "bin").symlink_to(BIN)
    for shared in ("models", "drivers"):
        (tmp / shared).symlink_to(REPO / shared)
    api, channel = free_port(), f"readme-{uuid.uuid4().hex[:8]}"
    text = (REPO / "examples" / "agent.toml").read_text()
    for old, new in (
        ("port = 8080", f"port = {api}"),
        ("port = 15020", f"port = {free_port()}"),
        ('channel = "edgefleet-demo"', f'channel = "{channel}"'),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (tmp / "examples" / "agent.toml").write_text(text)
    return api, channel


def wait_for_windows(api: int, agent: subprocess.Popen[bytes], log: Path) -> None:
    """As a person waits for the second terminal: until the agent answers and scores."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if agent.poll() is not None:
            raise AssertionError(f"the agent exited {agent.returncode}: {log.read_text()[-3000:]}")
        try:
            url = f"http://127.0.0.1:{api}/v1/status"
            with urllib.request.urlopen(url, timeout=2) as r:
                if json.loads(r.read()).get("windows", 0) >= 3:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the agent scored no window in 120 s: {log.read_text()[-3000:]}")


@pytest.mark.timeout(400)
def test_the_readme_ota_example_commits_as_written(tmp_path: Path) -> None:
    commands = readme_commands()
    names = [" ".join(shlex.split(c)[:3]) for c in commands]
    assert names == [
        ".venv/bin/fleet keys init",
        ".venv/bin/fleet bundle build",
        "install -D -m",
        ".venv/bin/edge-agent run -c",
        ".venv/bin/edge-agent ota install",
        ".venv/bin/edge-agent ota status",
        ".venv/bin/edge-agent ota rollback",
    ], commands
    api, _ = clone_layout(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "FLEET_KEY_PASSPHRASE"}
    log = tmp_path / "agent.log"
    agent: subprocess.Popen[bytes] | None = None
    outputs: dict[str, subprocess.CompletedProcess[str]] = {}
    try:
        for command, name in zip(commands, names, strict=True):
            if name.startswith(".venv/bin/edge-agent run"):
                with log.open("wb") as out:
                    agent = subprocess.Popen(
                        command,
                        shell=True,
                        cwd=tmp_path,
                        env=env,
                        stdout=out,
                        stderr=out,
                        start_new_session=True,  # its own group: the shell and the agent
                    )
                wait_for_windows(api, agent, log)
                continue
            done = subprocess.run(
                command,
                shell=True,
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
                check=False,
            )
            assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
            outputs[name] = done
    finally:
        if agent is not None:
            os.killpg(agent.pid, signal.SIGTERM)  # Ctrl-C in the second terminal
            agent.wait(timeout=30)

    built = outputs[".venv/bin/fleet bundle build"].stdout
    assert "probation 20 s: ~31 windows at 1.56 windows/s" in built
    installed = outputs[".venv/bin/edge-agent ota install"].stdout
    assert installed.startswith("committed: "), installed
    status = outputs[".venv/bin/edge-agent ota status"].stdout
    assert re.search(r"model\s.*1\.1\.0", status), status
    rolled = outputs[".venv/bin/edge-agent ota rollback"].stdout
    assert rolled.startswith("rolled_back: "), rolled
