"""The systemd units say what docs/INSTALL.md and the agent rely on."""

from __future__ import annotations

import configparser
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.peers

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "firmware" / "systemd"
INSTALL = ROOT / "docs" / "INSTALL.md"


def load(name: str) -> configparser.ConfigParser:
    # systemd's syntax is close enough to INI for single-valued keys; keys keep their case.
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((UNITS / name).read_text(encoding="utf-8"), source=name)
    return unit


def words(value: str) -> set[str]:
    return set(value.split())


def config_path(exec_start: str) -> str:
    argv = shlex.split(exec_start)
    return argv[argv.index("--config") + 1]


def agent_args(exec_start: str) -> list[str]:
    """What the launcher passes on to edge-agent: everything after ``--``."""
    argv = shlex.split(exec_start)
    return argv[argv.index("--") + 1 :]


@pytest.fixture(scope="module")
def agent() -> configparser.ConfigParser:
    return load("edge-agent.service")


@pytest.fixture(scope="module")
def tsn() -> configparser.ConfigParser:
    return load("edge-agent-tsn.service")


def test_agent_unit_is_a_notify_service_with_a_watchdog(agent: configparser.ConfigParser) -> None:
    s = agent["Service"]
    assert s["Type"] == "notify"
    assert s["NotifyAccess"] == "main"
    assert s["WatchdogSec"] == "10s"
    assert s["Restart"] == "on-failure"
    assert s["RestartSec"] == "2s"
    # A bad config (exit 2) must not restart-loop.
    assert s["RestartPreventExitStatus"] == "2"
    assert s["KillSignal"] == "SIGTERM"
    assert s["TimeoutStopSec"] == "10s"
    assert agent_args(s["ExecStart"])[0] == "run"
    assert {"PYTHONUNBUFFERED=1", "PYTHONFAULTHANDLER=1"} <= words(s["Environment"])
    assert int(s["LimitNOFILE"]) >= 1024


def test_agent_unit_ordering(agent: configparser.ConfigParser) -> None:
    u = agent["Unit"]
    assert {"time-sync.target", "network-online.target"} <= words(u["After"])
    assert {"time-sync.target", "network-online.target"} <= words(u["Wants"])
    assert agent["Install"]["WantedBy"] == "multi-user.target"


def test_agent_unit_user_and_directories(agent: configparser.ConfigParser) -> None:
    s = agent["Service"]
    assert s["User"] == s["Group"] == "edge-agent"
    assert "dialout" in words(s["SupplementaryGroups"])
    assert s["StateDirectory"] == "edge-agent"
    assert s["ConfigurationDirectory"] == "edge-agent"
    assert "/var/lib/edge-agent" in words(s["ReadWritePaths"])


def test_agent_unit_hardening(agent: configparser.ConfigParser) -> None:
    s = agent["Service"]
    for key in (
        "ProtectHome",
        "PrivateTmp",
        "NoNewPrivileges",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectControlGroups",
        "RestrictSUIDSGID",
        "LockPersonality",
        "MemoryDenyWriteExecute",
    ):
        assert s[key] == "yes", key
    assert s["ProtectSystem"] == "strict"
    assert s["CapabilityBoundingSet"] == ""
    assert words(s["RestrictAddressFamilies"]) == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
        "AF_CAN",
        "AF_NETLINK",
    }
    # Either would hide the RTU serial ports in /dev.
    assert "PrivateDevices" not in s
    assert "ProtectClock" not in s


def test_exec_start_config_path_is_the_documented_one(
    agent: configparser.ConfigParser, tsn: configparser.ConfigParser
) -> None:
    path = config_path(agent["Service"]["ExecStart"])
    assert path == "/etc/edge-agent/agent.toml"
    assert config_path(tsn["Service"]["ExecStart"]) == path
    doc = INSTALL.read_text(encoding="utf-8")
    assert f"check-config {path}" in doc
    assert f"tsn render --config {path}" in doc
    # The unit file names the doc's venv and the doc installs the unit by that name.
    assert "python3 -m venv /opt/edge-agent" in doc
    assert "firmware/systemd/edge-agent.service" in doc
    assert "firmware/systemd/edge-agent-tsn.service" in doc


def test_documented_exit_codes_match_the_unit(agent: configparser.ConfigParser) -> None:
    doc = INSTALL.read_text(encoding="utf-8")
    assert re.search(r"^\| 2 \| bad config.*not restarted", doc, re.MULTILINE)
    assert "WatchdogSec=10s" in doc
    assert agent["Service"]["RestartPreventExitStatus"] == "2"


def test_tsn_unit_runs_once_as_root_before_the_agent(tsn: configparser.ConfigParser) -> None:
    u, s = tsn["Unit"], tsn["Service"]
    assert "edge-agent.service" in words(u["Before"])
    assert s["Type"] == "oneshot"
    assert s["RemainAfterExit"] == "yes"
    assert "User" not in s  # root: tc needs CAP_NET_ADMIN
    assert words(s["CapabilityBoundingSet"]) == {"CAP_NET_ADMIN"}
    assert s["ExecStart"].split()[:3] == ["/opt/edge-agent/bin/edge-agent", "tsn", "apply"]
    # The agent must start even when the schedule cannot be installed.
    agent = load("edge-agent.service")["Unit"]
    assert "edge-agent-tsn.service" not in agent.get("Requires", "")


def test_agent_starts_through_the_ab_slot_launcher(agent: configparser.ConfigParser) -> None:
    s = agent["Service"]
    argv = shlex.split(s["ExecStart"])
    # The venv's interpreter runs the launcher (never a slot's copy of it), with -P so the
    # working directory cannot shadow the slot's packages.
    assert argv[:4] == ["/opt/edge-agent/bin/python", "-P", "-m", "firmware.boot"]
    slots = Path(argv[argv.index("--slots") + 1])
    # The slots live in the state directory: writable by the agent, kept across upgrades.
    assert slots.parent == Path("/var/lib") / s["StateDirectory"]
    assert str(slots.parent) in words(s["ReadWritePaths"])
    # The launcher execs the agent: the main PID stays the one that sends READY and WATCHDOG.
    assert s["Type"] == "notify"
    assert s["NotifyAccess"] == "main"
    # Crashes of a new build must come back to the launcher for the boot counter to count.
    assert s["Restart"] == "on-failure"
    assert agent["Unit"]["StartLimitIntervalSec"] == "0"


def test_unit_launcher_line_runs_for_real(tmp_path: Path) -> None:
    """The unit's launcher arguments, with only the paths swapped, start the agent's CLI."""
    argv = shlex.split(load("edge-agent.service")["Service"]["ExecStart"])
    argv[0] = sys.executable
    argv[argv.index("--slots") + 1] = str(tmp_path / "slots")
    argv[argv.index("--") + 1 :] = ["--help"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/", check=False)
    assert proc.returncode == 0, proc.stderr
    assert "check-config" in proc.stdout
    assert "the base install" in proc.stderr


def test_install_doc_describes_the_slots(agent: configparser.ConfigParser) -> None:
    doc = INSTALL.read_text(encoding="utf-8")
    argv = shlex.split(agent["Service"]["ExecStart"])
    assert "Agent updates: A/B slots" in doc
    assert argv[argv.index("--slots") + 1] in doc
    assert "python -m firmware.boot" in doc or "-m firmware.boot" in doc


def test_jit_drop_in_lifts_only_the_write_execute_ban(agent: configparser.ConfigParser) -> None:
    """The hardened unit keeps numba from mapping code (the agent falls back to numpy);
    the documented drop-in lifts exactly that and gives numba a writable cache."""
    drop_in = load("edge-agent-jit.conf")
    s = drop_in["Service"]
    assert agent["Service"]["MemoryDenyWriteExecute"] == "yes"
    assert s["MemoryDenyWriteExecute"] == "no"
    cache = s["Environment"].split("=", 1)
    assert cache[0] == "NUMBA_CACHE_DIR"
    # Under ProtectSystem=strict only the state directory is writable.
    assert cache[1].startswith("/var/lib/edge-agent/")
    assert set(s) == {"MemoryDenyWriteExecute", "Environment"}
    assert "edge-agent-jit.conf" in INSTALL.read_text(encoding="utf-8")
