"""``edge-agent tsn``: render with CliRunner, the pre-flight checks, and a real ``apply`` on a
veth pair inside a throw-away network namespace."""

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edge_agent.errors import ConfigError
from edge_agent.tsn import apply_problem, schedule_from_config, tc_failure, tsn_app
from tests.support.netns import in_netns, netns, netns_problem

pytestmark = pytest.mark.peers

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner(env={"COLUMNS": "200"})

CONFIG = """\
[perception]
signals = ["current"]
rate_hz = 100.0
lateness_ms = 23.5

[[sources.modbus]]
name = "drive"
host = "127.0.0.1"
port = 5020

[[sources.modbus.registers]]
name = "current"
address = 0
type = "float32"

[schedule]
cycle_us = 10000

[[schedule.entries]]
name = "sense"
duration_us = 3000
gates = ["perception", "best_effort"]

[[schedule.entries]]
name = "store"
duration_us = 3000
gates = ["memory", "control"]

[[schedule.entries]]
name = "think"
duration_us = 4000
gates = ["reasoning", "uplink", "best_effort"]

[schedule.tsn]
interface = "enp3s0"
classes = [
    { name = "best_effort", priority = 0 },
    { name = "uplink", priority = 3 },
    { name = "control", priority = 5, queues = 2 },
]
"""

SOURCE = """
[[sources.modbus]]
name = "drive"
host = "127.0.0.1"
port = 5020

[[sources.modbus.registers]]
name = "current"
address = 0
type = "float32"
"""

RENDERED = (
    "tc qdisc replace dev {iface} parent root handle 100 taprio num_tc 3 "
    "map 0 0 0 1 0 2 0 0 0 0 0 0 0 0 0 0 queues 1@0 1@1 2@2 base-time 3500000 "
    "sched-entry S 01 3000000 sched-entry S 04 3000000 sched-entry S 03 4000000 "
    "clockid CLOCK_TAI\n"
)


def write_config(tmp_path: Path, text: str = CONFIG) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def test_render_prints_the_exact_command(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    res = runner.invoke(tsn_app, ["render", "--config", str(cfg)])
    assert res.exit_code == 0, res.stderr
    assert res.stdout == RENDERED.format(iface="enp3s0")
    assert res.stderr == ""
    other = runner.invoke(tsn_app, ["render", "-c", str(cfg), "-i", "eth1"])
    assert other.stdout == RENDERED.format(iface="eth1")


def test_render_with_defaults_only(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[perception]\nsignals = ["current"]\n' + SOURCE)
    res = runner.invoke(tsn_app, ["render", "-c", str(cfg)])
    assert res.exit_code == 0, res.stderr
    # lateness_ms defaults to 20 ms: two whole cycles, so the base phase is 0.
    assert res.stdout == (
        "tc qdisc replace dev eth0 parent root handle 100 taprio num_tc 2 "
        "map 0 0 0 1 0 0 0 0 0 0 0 0 0 0 0 0 queues 1@0 1@1 base-time 0 "
        "sched-entry S 01 6000000 sched-entry S 03 4000000 clockid CLOCK_TAI\n"
    )


def test_config_errors_name_the_file_and_key_path(tmp_path: Path) -> None:
    text = (
        CONFIG.replace('"reasoning", "uplink"', '"reasonin", "uplink"')
        .replace("lateness_ms = 23.5", 'lateness_ms = "late"')
        .replace("cycle_us = 10000", "cycle_us = 10000\nspin = 3")
    )
    cfg = write_config(tmp_path, text)
    res = runner.invoke(tsn_app, ["render", "-c", str(cfg)])
    assert res.exit_code == 2
    assert res.stdout == ""
    assert res.stderr.splitlines() == [
        f"{cfg}: perception.lateness_ms: expected a valid number; got 'late'",
        f"{cfg}: schedule.spin: unknown key; expected one of: "
        "cycle_us, base_time_ns, spin_us, entries, tsn",
    ]
    fixed = text.replace("spin = 3\n", "").replace('"late"', "1")
    res = runner.invoke(tsn_app, ["render", "-c", str(write_config(tmp_path, fixed))])
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [
        f"{cfg}: schedule.entries[2].gates: unknown gate 'reasonin'; expected one of "
        "perception, memory, reasoning, best_effort, uplink, control (entry 'think')",
        f"{cfg}: schedule.entries: stage 'reasoning' has no entry; "
        "expected at least one entry whose gates include 'reasoning'",
    ]


def test_unreadable_configs(tmp_path: Path) -> None:
    missing = runner.invoke(tsn_app, ["render", "-c", str(tmp_path / "nope.toml")])
    assert missing.exit_code == 2
    assert missing.stderr == f"{tmp_path / 'nope.toml'}: file not found\n"
    broken = tmp_path / "broken.toml"
    broken.write_text("[schedule\n")
    res = runner.invoke(tsn_app, ["render", "-c", str(broken)])
    assert res.exit_code == 2
    assert res.stderr.startswith(f"{broken}: not valid TOML: ")
    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"#" * ((1 << 20) + 1))
    with pytest.raises(ConfigError, match="expected at most 1048576"):
        schedule_from_config(huge)


def test_notes_go_to_stderr(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        '[perception]\nsignals = ["current"]\n'
        + SOURCE
        + '[schedule]\ncycle_us = 3000\n[[schedule.entries]]\nname = "all"\nduration_us = 3000\n'
        'gates = ["perception", "memory", "reasoning", "best_effort", "uplink"]\n'
    )
    res = runner.invoke(tsn_app, ["render", "-c", str(cfg)])
    assert res.exit_code == 0
    assert "sched-entry S 03 3000000" in res.stdout
    assert f"{cfg}: note: schedule.cycle_us: 3000 does not divide 1 s" in res.stderr


def test_schedule_from_config(tmp_path: Path) -> None:
    gcl = schedule_from_config(write_config(tmp_path))
    assert [e.name for e in gcl.entries] == ["sense", "store", "think"]
    assert gcl.base_time_ns == 3_500_000
    assert gcl.interface == "enp3s0"
    assert gcl.tx_queues == 4


def test_apply_problem() -> None:
    assert apply_problem(0, "/usr/sbin/tc", iface_exists=True) is None
    not_root = apply_problem(1000, "/usr/sbin/tc", iface_exists=True)
    assert not_root is not None
    assert "needs root (or CAP_NET_ADMIN)" in not_root
    assert "`edge-agent tsn render`" in not_root
    assert apply_problem(0, None, iface_exists=True) == "`tc` is not on PATH; install iproute2"
    assert apply_problem(0, "/sbin/tc", iface_exists=False, interface="eth9") == (
        "no network interface 'eth9' (see `ip link`); pick one with --interface"
    )


def test_tc_failure_messages() -> None:
    unknown = tc_failure(
        "Error: Specified qdisc kind is unknown.\n", 2, interface="eth0", needed_queues=2
    )
    assert unknown == (
        "the kernel lacks the taprio qdisc (CONFIG_NET_SCH_TAPRIO; try `modprobe sch_taprio`); "
        "tc said: Error: Specified qdisc kind is unknown."
    )
    unsupported = tc_failure(
        "RTNETLINK answers: Operation not supported", 2, interface="eth0", needed_queues=3
    )
    assert unsupported.startswith(
        "the kernel lacks taprio (CONFIG_NET_SCH_TAPRIO) or eth0 has too few TX queues "
        "(the schedule needs 3; see `ethtool -l eth0`); tc said: RTNETLINK answers:"
    )
    other = tc_failure("", 1, interface="eth0", needed_queues=2)
    assert other == "tc failed with exit code 1; tc said: (no output)"


def test_apply_checks_the_interface_before_running_tc(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    res = runner.invoke(tsn_app, ["apply", "-c", str(cfg)])  # enp3s0 is not on this box
    assert res.exit_code == 1
    assert res.stderr == (
        "cannot apply: no network interface 'enp3s0' (see `ip link`); pick one with --interface\n"
    )


# -- a real apply, in a namespace ------------------------------------------------------------


@contextmanager
def veth_namespace(tx_queues: int) -> Iterator[tuple[str, str]]:
    """A fresh namespace holding a veth pair ``va``/``vb`` with ``tx_queues`` TX queues each;
    the namespace (and with it the pair) is deleted on the way out."""
    problem = netns_problem()
    if problem is not None:
        pytest.fail(f"the taprio test needs a network namespace: {problem}")
    with netns("eftsn") as ns:
        q = str(tx_queues)
        subprocess.run(
            ["ip", "-n", ns, "link", "add", "va", "numtxqueues", q, "numrxqueues", q,
             "type", "veth", "peer", "name", "vb", "numtxqueues", q, "numrxqueues", q],
            check=True, capture_output=True,
        )  # fmt: skip
        subprocess.run(["ip", "-n", ns, "link", "set", "va", "up"], check=True)
        yield ns, "va"


def apply_in(ns: str, cfg: Path, iface: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "edge_agent.tsn", "apply", "-c", str(cfg), "-i", iface]
    return subprocess.run(
        in_netns(ns, argv), cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )


def test_apply_installs_taprio_or_says_the_kernel_lacks_it(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    with veth_namespace(tx_queues=4) as (ns, iface):
        done = apply_in(ns, cfg, iface)
        shown = subprocess.run(
            in_netns(ns, ["tc", "qdisc", "show", "dev", iface]),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    if done.returncode == 0:
        assert done.stdout == f"taprio installed on {iface}: 3 entries, 10000000 ns cycle\n"
        assert "qdisc taprio 100: root" in shown, shown
    else:
        # This kernel (CONFIG_NET_SCH_TAPRIO unset) says so; tc's own words follow ours.
        assert done.returncode == 1, done.stderr
        lines = done.stderr.splitlines()
        assert lines[0] == (
            "cannot apply: the kernel lacks the taprio qdisc (CONFIG_NET_SCH_TAPRIO; try "
            "`modprobe sch_taprio`); tc said: Error: Specified qdisc kind is unknown."
        )
        assert lines[1].startswith("command: tc qdisc replace dev va parent root handle 100")
        assert "taprio" not in shown


def test_apply_on_a_nic_with_too_few_queues_says_how_many_it_needs(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    with veth_namespace(tx_queues=2) as (ns, iface):
        done = apply_in(ns, cfg, iface)
    assert done.returncode == 1, done.stdout
    assert "(va has 2 TX queue(s); the schedule needs 4)" in done.stderr
