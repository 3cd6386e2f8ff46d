"""Where the agent writes: a state folder it cannot make or use is one line naming the key,
from ``check-config`` (which creates nothing) and from ``run`` (exit 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edge_agent.cli import app
from edge_agent.config import load_config
from edge_agent.statepaths import filesystem_of, path_problems, state_paths

pytestmark = pytest.mark.peers

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def write_config(tmp_path: Path, state_dir: str, *edits: tuple[str, str]) -> Path:
    text = (REPO / "examples" / "agent.toml").read_text()
    for old, new in (
        ('state_dir = "../var/demo-gw-01"', f'state_dir = "{state_dir}"'),
        ("port = 8080", "port = 0"),
        *edits,
    ):
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "agent.toml"
    path.write_text(text.replace('"../', f'"{REPO}/'))
    return path


def check(path: Path) -> tuple[int, str]:
    result = runner.invoke(app, ["check-config", str(path)])
    return result.exit_code, result.output


def test_a_state_dir_under_proc_is_refused_by_check_config_and_run(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "/proc/edgefleet-no-such-dir")
    line = (
        "agent.state_dir: cannot create /proc/edgefleet-no-such-dir: /proc is on a proc "
        "filesystem, which holds no files"
    )
    code, out = check(cfg)
    assert code == 2, out
    assert line in out
    # Reported once, not again for the memory store, the outbox and the OTA folder inside it.
    assert out.count("/proc/edgefleet-no-such-dir") == 1, out
    run = subprocess.run(
        [sys.executable, "-m", "edge_agent.cli", "run", "-c", str(cfg), "--duration", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == f"{cfg}: {line}"
    assert "Traceback" not in run.stderr


def test_a_regular_file_as_state_dir_or_on_its_path(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    code, out = check(write_config(tmp_path, str(a_file)))
    assert code == 2
    assert f"agent.state_dir: {a_file} exists and is not a directory" in out
    code, out = check(write_config(tmp_path, f"{a_file}/state"))
    assert code == 2
    assert f"agent.state_dir: cannot create {a_file}/state: {a_file} exists and is not a " in out
    run = runner.invoke(app, ["run", "-c", str(tmp_path / "agent.toml"), "--duration", "1"])
    assert run.exit_code == 2, run.output
    assert f"cannot create {a_file}/state: {a_file} exists and is not a directory" in run.output


def test_every_file_key_the_agent_writes_is_checked(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "memory.db").mkdir(parents=True)
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    cfg = write_config(
        tmp_path,
        str(state),
        ("[uplink]\nenabled = false", "[uplink]\nenabled = true"),
        ("[uplink.outbox]\n", f'[uplink.outbox]\npath = "{blocker}/outbox.db"\n'),
        ('permissions = ["model:swap", "config:write"]',
         'permissions = ["model:swap", "agent:replace"]\nslots_dir = "/proc/edgefleet-slots"'),
    )  # fmt: skip
    code, out = check(cfg)
    assert code == 2, out
    assert f"memory.path: {state}/memory.db is a directory, not a file" in out
    assert (
        f"uplink.outbox.path: cannot create {blocker}/outbox.db: {blocker} exists and is not "
        "a directory"
    ) in out
    assert "ota.slots_dir: cannot create /proc/edgefleet-slots: /proc is on a proc" in out


def test_check_config_creates_nothing_and_run_creates_the_folders(tmp_path: Path) -> None:
    state = tmp_path / "new" / "state"
    cfg = write_config(tmp_path, str(state))
    code, out = check(cfg)
    assert code == 0, out
    assert not (tmp_path / "new").exists()
    assert [p.key for p in state_paths(load_config(cfg))] == [
        "agent.state_dir",
        "memory.path",
        "memory.snapshot_dir",
        "agent.state_dir",
    ]
    assert path_problems(state_paths(load_config(cfg))) == []


MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
27 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 27 0:40 / /var/lib/my\\040data rw,relatime shared:9 master:2 - tmpfs tmpfs rw
31 22 0:41 / /proc/sys/fs/binfmt_misc rw,relatime - binfmt_misc binfmt_misc rw
"""


@pytest.mark.parametrize(
    ("path", "fs"),
    [
        ("/proc/x", "proc"),
        ("/proc", "proc"),
        ("/process", "ext4"),
        ("/sys/kernel", "sysfs"),
        ("/var/lib/my data/state", "tmpfs"),
        ("/var/lib/my", "ext4"),
        ("/proc/sys/fs/binfmt_misc/x", "binfmt_misc"),
        ("/", "ext4"),
    ],
)
def test_the_filesystem_of_a_path_is_its_deepest_mount(path: str, fs: str) -> None:
    assert filesystem_of(Path(path), MOUNTINFO) == fs


def test_without_mountinfo_nothing_is_known() -> None:
    assert filesystem_of(Path("/proc/x"), "") is None
