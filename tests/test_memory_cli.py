"""``edge-agent memory``: query, stats, snapshots, with typer's CliRunner; and the config."""

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from edge_agent.memory import MemorySection
from edge_agent.memory.cli import memory_app, parse_time
from tests.support.memory import PERIOD, POINTS, feed, random_walk, run, stage

EXAMPLES = Path(__file__).parents[1] / "examples"
SIG = ("voltage", "current")
runner = CliRunner(env={"COLUMNS": "160"})


def now_ns() -> int:
    """Now on the grid, taken when a store is filled: the queries below are relative to the
    wall clock (``--since 1m``), and a module-level "now" goes stale in a long test run."""
    return time.time_ns() // PERIOD * PERIOD


def populated(tmp: Path, minutes: float = 2.0) -> tuple[Path, np.ndarray, int]:
    """A store with ``minutes`` of data ending about now, and one snapshot."""
    n_win = int(minutes * 60e9 / (POINTS * PERIOD))
    values = random_walk(np.random.default_rng(6), n_win, 2)
    now = now_ns()
    start = now - n_win * POINTS * PERIOD

    async def main() -> None:
        st = stage(tmp, SIG, clock=[now])
        async with st:
            feed(st, values, SIG, start_ns=start)
            await st.snapshot()

    run(main())
    return tmp / "memory.db", values, start


def test_query_json_gives_the_state_at_since_and_every_change(tmp_path: Path) -> None:
    db, values, start = populated(tmp_path)
    res = runner.invoke(
        memory_app, ["query", "--signal", "current", "--since", "90s", "--json", "--db", str(db)]
    )
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["signal"] == "current"
    since = doc["since_ns"]
    k0 = (since - start) // PERIOD
    assert doc["initial"] == pytest.approx(float(values[k0, 1]))
    changes = doc["changes"]
    assert changes
    assert all(since < c["t_ns"] <= doc["until_ns"] for c in changes)
    # Replaying the changes gives every grid value.
    state = doc["initial"]
    by_t = {c["t_ns"]: c["value"] for c in changes}
    for k in range(k0 + 1, values.shape[0]):
        state = by_t.get(start + k * PERIOD, state)
        assert state == pytest.approx(float(values[k, 1]))
    assert doc["gaps"] == []
    assert doc["truncated"] is False
    assert changes[0]["t"].endswith("Z")


def test_query_table_for_people_and_limit(tmp_path: Path) -> None:
    db, _, _ = populated(tmp_path)
    res = runner.invoke(
        memory_app, ["query", "-s", "voltage", "--since", "1m", "--limit", "3", "--db", str(db)]
    )
    assert res.exit_code == 0, res.stderr
    assert "voltage" in res.stdout
    assert "state at --since" in res.stdout
    assert "truncated at --limit 3" in res.stdout


def test_query_bad_input_is_exit_2_and_a_missing_store_exit_1(tmp_path: Path) -> None:
    db, _, _ = populated(tmp_path)
    unknown = runner.invoke(memory_app, ["query", "--signal", "nope", "--db", str(db)])
    assert unknown.exit_code == 2
    assert "unknown signal 'nope'; known: voltage, current" in unknown.stderr
    bad_time = runner.invoke(
        memory_app, ["query", "--signal", "voltage", "--since", "yesterday", "--db", str(db)]
    )
    assert bad_time.exit_code == 2
    assert "ISO 8601" in bad_time.stderr
    backwards = runner.invoke(
        memory_app,
        ["query", "-s", "voltage", "--since", "now", "--until", "1h", "--db", str(db)],
    )
    assert backwards.exit_code == 2
    missing = runner.invoke(
        memory_app, ["query", "--signal", "voltage", "--db", str(tmp_path / "none.db")]
    )
    assert missing.exit_code == 1
    assert "no memory store at" in missing.stderr
    assert not (tmp_path / "none.db").exists()  # a read never creates the file


def test_stats_json_and_table(tmp_path: Path) -> None:
    db, values, start = populated(tmp_path)
    res = runner.invoke(memory_app, ["stats", "--json", "--db", str(db)])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema_version"] == 1
    assert doc["rows"]["changes"] > 0
    assert doc["oldest_ns"]["changes"] == start
    assert doc["db_bytes"] >= doc["used_bytes"] > 0
    assert doc["snapshots"] == 1
    assert doc["last_snapshot"]["name"].startswith("memory-")
    assert doc["writer_pid"] is None
    names = [s["name"] for s in doc["signals"]]
    assert names == list(SIG)
    cur = doc["signals"][1]
    assert cur["mean"] == pytest.approx(float(values[:, 1].mean()), rel=0.2, abs=1.0)
    human = runner.invoke(memory_app, ["stats", "--db", str(db)])
    assert human.exit_code == 0, human.stderr
    assert "last snapshot" in human.stdout
    assert "not running" in human.stdout


def test_stats_while_the_agent_runs(tmp_path: Path) -> None:
    db, _, _ = populated(tmp_path)

    async def main() -> None:
        async with stage(tmp_path, SIG):
            res = runner.invoke(memory_app, ["stats", "--json", "--db", str(db)])
            assert res.exit_code == 0, res.stderr
            assert json.loads(res.stdout)["writer_pid"] is not None

    run(main())


def test_snapshots_lists_newest_first(tmp_path: Path) -> None:
    db, _, _ = populated(tmp_path)
    res = runner.invoke(memory_app, ["snapshots", "--json", "--verify", "--db", str(db)])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    (snap,) = doc["snapshots"]
    assert snap["verified"] is True
    assert snap["rows"]["changes"] > 0
    assert len(snap["sha256"]) == 64
    human = runner.invoke(memory_app, ["snapshots", "--db", str(db)])
    assert snap["name"] in human.stdout
    empty = runner.invoke(
        memory_app, ["snapshots", "--db", str(db), "--snapshot-dir", str(tmp_path / "x")]
    )
    assert empty.exit_code == 0
    assert "no snapshots" in empty.stdout


def test_the_store_is_found_through_the_agent_config(tmp_path: Path) -> None:
    state = tmp_path / "state"
    populated(state)
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        (EXAMPLES / "agent.toml")
        .read_text()
        .replace('state_dir = "../var/demo-gw-01"', f'state_dir = "{state}"')
        .replace(
            'dbc = "../drivers/sim/motor_drive.dbc"',
            f'dbc = "{EXAMPLES.parent}/drivers/sim/motor_drive.dbc"',
        )
    )
    res = runner.invoke(memory_app, ["stats", "--json", "--config", str(cfg)])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["path"] == str(state / "memory.db")
    bad = runner.invoke(memory_app, ["stats", "--config", str(tmp_path / "missing.toml")])
    assert bad.exit_code == 2
    assert "file not found" in bad.stderr


def test_a_relative_state_dir_is_found_from_any_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent resolves agent.state_dir against the config file's folder; so must the CLI.
    populated(tmp_path / "conf" / "state")
    cfg = tmp_path / "conf" / "agent.toml"
    cfg.write_text(
        (EXAMPLES / "agent.toml")
        .read_text()
        .replace('state_dir = "../var/demo-gw-01"', 'state_dir = "state"')
        .replace(
            'dbc = "../drivers/sim/motor_drive.dbc"',
            f'dbc = "{EXAMPLES.parent}/drivers/sim/motor_drive.dbc"',
        )
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    res = runner.invoke(memory_app, ["stats", "--json", "--config", str(cfg)])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["path"] == str(tmp_path / "conf" / "state" / "memory.db")


def test_parse_time_forms() -> None:
    now = 1_700_000_000 * 10**9
    assert parse_time("now", now) == now
    assert parse_time("10m", now) == now - 600 * 10**9
    assert parse_time("2h", now) == now - 7200 * 10**9
    assert parse_time("1.5s", now) == now - 1_500_000_000
    assert parse_time("500ms", now) == now - 500_000_000
    assert parse_time("1d", now) == now - 86_400 * 10**9
    assert parse_time("2023-11-14T22:13:20Z", now) == now
    assert parse_time("2023-11-14T22:13:20", now) == now  # no zone: UTC
    assert parse_time("2023-11-14T23:13:20+01:00", now) == now
    with pytest.raises(ValueError, match="relative age"):
        parse_time("10 parsecs", now)


# -- config -------------------------------------------------------------------------------------


def test_memory_section_defaults_and_paths() -> None:
    m = MemorySection()
    assert m.ttl_h == 72.0
    assert m.snapshot_interval_s == 900.0
    assert m.aging_step_ms == 1.0
    db, snaps = m.resolve("/var/lib/edge-agent")
    assert db == Path("/var/lib/edge-agent/memory.db")
    assert snaps == Path("/var/lib/edge-agent/memory-snapshots")
    absolute = MemorySection(path="/data/m.db", snapshot_dir="/data/snaps")
    assert absolute.resolve("/ignored") == (Path("/data/m.db"), Path("/data/snaps"))
    m2 = MemorySection(default_deadband=0.1, deadband={"current": 0.05})
    assert m2.deadbands_for(["voltage", "current"]) == (0.1, 0.05)
    assert m2.check(["voltage"]) == [
        "memory.deadband.current: 'current' is not a perception signal; known: voltage"
    ]
    assert m.ttl_ns == 72 * 3600 * 10**9
    assert not math.isnan(m.keyframe_interval_ns)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"ttl_hours": 1}, "Extra inputs are not permitted"),
        ({"ttl_h": "72"}, "valid number"),
        ({"ttl_h": 0}, "greater than 0"),
        ({"deadband": {"x": -1.0}}, "greater than or equal to 0"),
        ({"default_deadband": math.inf}, "finite number"),
        ({"keyframe_interval_s": 7200.0}, "aging_chunk_s (3600) must be at least"),
        ({"drift_half_life_s": 1e6}, "drift_half_life_s"),
        ({"max_bytes": 1000}, "greater than or equal to 65536"),
    ],
)
def test_memory_section_rejects_bad_values(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        MemorySection(**kw)


def test_memory_section_is_frozen() -> None:
    m = MemorySection()
    with pytest.raises(ValidationError):
        m.ttl_h = 1.0
