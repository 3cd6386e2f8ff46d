"""The ``fleet`` CLI's read commands on a real SQLite store (typer's CliRunner).

The store is filled through its own API with messages built by the wire classes, as the
ingest would store them; ``fleet serve`` itself is exercised in ``test_fleet_ingest.py``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import typer
from typer.testing import CliRunner

from fleet.cli import app, parse_since
from fleet.cli_common import store_url
from fleet.store import Quarantined, Row, open_store
from tests.support.fleet import REPO, SITE, boot_id, decision, sqlite_url, state, telemetry
from wire import ModelHealth, encode

pytestmark = pytest.mark.peers

NOW = time.time_ns()
MIN = 60 * 10**9
BOOT_A = boot_id()
BOOT_B = boot_id()


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = sqlite_url(tmp_path / "fleet.db")
    store = open_store(url)
    store.migrate()
    try:
        store.ensure_device("gw-a", SITE, NOW - 60 * MIN, auto_register=True)
        store.ensure_device("gw-b", SITE, NOW - 60 * MIN, auto_register=True)
        sick = msgspec.structs.replace(
            state("gw-a", BOOT_A, 0), model_health=ModelHealth(ood=["current"])
        )
        store.record_state("gw-a", SITE, sick, NOW - 60 * MIN)
        store.record_state("gw-b", SITE, state("gw-b", BOOT_B, 0), NOW - 60 * MIN)
        rows = []
        # gw-a: seqs 0..10 except 4 and 5 (a gap); 0..8 telemetry, 9 and 10 decisions.
        for seq in (0, 1, 2, 3, 6, 7, 8):
            t = NOW - (30 - seq) * MIN
            rows.append(
                Row(
                    "gw-a",
                    SITE,
                    "telemetry",
                    BOOT_A,
                    seq,
                    t,
                    encode(telemetry("gw-a", BOOT_A, seq, t)),
                    t,
                )
            )
        old = NOW - 20 * MIN  # 20 minutes ago: outside --since 10m
        recent = NOW - 2 * MIN
        rows.append(
            Row(
                "gw-a",
                SITE,
                "decision",
                BOOT_A,
                9,
                old,
                encode(decision("gw-a", BOOT_A, 9, old, "overheat")),
                old,
            )
        )
        rows.append(
            Row(
                "gw-a",
                SITE,
                "decision",
                BOOT_A,
                10,
                recent,
                encode(decision("gw-a", BOOT_A, 10, recent)),
                recent,
            )
        )
        rows.append(
            Row(
                "gw-b",
                SITE,
                "decision",
                BOOT_B,
                0,
                recent,
                encode(decision("gw-b", BOOT_B, 0, recent, "overheat")),
                recent,
            )
        )
        store.ingest(rows)
        store.record_state(
            "gw-b", SITE, state("gw-b", BOOT_B, 1, online=False, clean=False), NOW - MIN
        )
        store.quarantine(
            [
                Quarantined(
                    "edgefleet/v1/plant1/gw-a/telemetry",
                    b"not json",
                    "not a JSON object: JSON is malformed",
                    "$",
                    NOW - 3 * MIN,
                    "gw-a",
                ),
                Quarantined(
                    "edgefleet/v1/plant1/gw-a/telemetry",
                    b'{"seq": -1}',
                    "Expected `int` >= 0",
                    "$.seq",
                    NOW - MIN,
                    "gw-a",
                ),
            ]
        )
    finally:
        store.close()
    return url


runner = CliRunner()


def run_json(*args: str) -> object:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_devices_list(url: str) -> None:
    listed = run_json("devices", "list", "--store", url)
    assert isinstance(listed, list)
    assert [(d["device"], d["online"]) for d in listed] == [("gw-a", True), ("gw-b", False)]
    assert listed[0]["boot_id"] == BOOT_A
    assert listed[0]["last_seq"] == 10
    assert listed[0]["agent_version"] == "0.1.0"
    # What gw-a's newest online state says about its model (gw-b is offline: nothing).
    assert listed[0]["model_health"]["ood"] == ["current"]
    assert listed[1]["model_health"] == {}
    human = runner.invoke(app, ["devices", "list", "--store", url], env={"COLUMNS": "200"})
    assert human.exit_code == 0
    assert "gw-a" in human.stdout
    assert "online" in human.stdout
    assert "offline" in human.stdout
    assert "out of distribution: current" in human.stdout


def test_devices_list_reads_the_store_from_the_environment(url: str) -> None:
    result = runner.invoke(app, ["devices", "list", "--json"], env={"FLEET_STORE": url})
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == 2


def test_devices_show(url: str) -> None:
    shown = run_json("devices", "show", "gw-a", "--store", url)
    assert isinstance(shown, dict)
    assert shown["device"] == "gw-a"
    assert shown["site"] == SITE
    assert shown["latency_ms"] == {"perception": 1.5, "reasoning": 0.25}
    assert shown["gaps"] == [
        {"device": "gw-a", "boot_id": BOOT_A, "first_missing": 4, "last_missing": 5, "missing": 2}
    ]
    human = runner.invoke(app, ["devices", "show", "gw-a", "--store", url])
    assert human.exit_code == 0
    assert "perception" in human.stdout
    assert "4..5" in human.stdout
    missing = runner.invoke(app, ["devices", "show", "gw-zz", "--store", url])
    assert missing.exit_code == 1
    assert "no device 'gw-zz'" in missing.stderr


def test_telemetry_tail(url: str) -> None:
    tail = run_json("telemetry", "tail", "gw-a", "--limit", "3", "--store", url)
    assert isinstance(tail, list)
    assert [r["seq"] for r in tail] == [6, 7, 8]  # newest last
    assert tail[-1]["body"]["signals"]["temp_c"] == [40.5, 40.0, 41.0, 40.7, 10]
    human = runner.invoke(app, ["telemetry", "tail", "gw-a", "--store", url])
    assert human.exit_code == 0
    assert "motor_rpm=1509" in human.stdout  # seq 8: last = 1501 + 8
    follow = runner.invoke(
        app,
        [
            *("telemetry", "tail", "gw-a", "--follow", "--follow-for", "0.3"),
            *("--interval", "0.1", "--json", "--limit", "2", "--store", url),
        ],
    )
    assert follow.exit_code == 0, follow.output
    lines = [json.loads(line) for line in follow.stdout.splitlines()]
    assert [r["seq"] for r in lines] == [7, 8]
    unknown = runner.invoke(app, ["telemetry", "tail", "nope", "--store", url])
    assert unknown.exit_code == 1


def test_decisions_list_since_device_label(url: str) -> None:
    everything = run_json("decisions", "list", "--store", url)
    assert isinstance(everything, list)
    assert len(everything) == 3
    recent = run_json("decisions", "list", "--since", "10m", "--store", url)
    assert isinstance(recent, list)
    assert sorted((r["device"], r["seq"]) for r in recent) == [("gw-a", 10), ("gw-b", 0)]
    overheat = run_json("decisions", "list", "--label", "overheat", "--store", url)
    assert isinstance(overheat, list)
    assert sorted((r["device"], r["seq"]) for r in overheat) == [("gw-a", 9), ("gw-b", 0)]
    one = run_json("decisions", "list", "--device", "gw-b", "--since", "1h", "--store", url)
    assert isinstance(one, list)
    assert [(r["device"], r["body"]["label"]) for r in one] == [("gw-b", "overheat")]
    human = runner.invoke(app, ["decisions", "list", "--since", "10m", "--store", url])
    assert human.exit_code == 0
    assert "overheat" in human.stdout
    assert "temp_high" in human.stdout
    bad = runner.invoke(app, ["decisions", "list", "--since", "yesterday", "--store", url])
    assert bad.exit_code == 2
    assert "expected a duration ago" in bad.output


def test_gaps(url: str) -> None:
    gaps = run_json("gaps", "--store", url)
    assert isinstance(gaps, list)
    assert [(g["device"], g["first_missing"], g["last_missing"]) for g in gaps] == [
        ("gw-a", 4, 5),
    ]
    assert run_json("gaps", "--device", "gw-b", "--store", url) == []
    human = runner.invoke(app, ["gaps", "--store", url])
    assert human.exit_code == 0
    assert "gw-a" in human.stdout


def test_quarantine_list(url: str) -> None:
    items = run_json("quarantine", "list", "--store", url)
    assert isinstance(items, list)
    assert [q["reason"] for q in items] == [
        "Expected `int` >= 0",
        "not a JSON object: JSON is malformed",
    ]
    assert items[0]["where"] == "$.seq"
    assert items[1]["payload"] == "not json"
    human = runner.invoke(app, ["quarantine", "list", "--store", url])
    assert human.exit_code == 0
    assert "$.seq" in human.stdout


def test_bad_store_url_is_a_clear_failure(tmp_path: Path) -> None:
    result = runner.invoke(app, ["devices", "list", "--store", "mysql://x/y"])
    assert result.exit_code == 3
    assert "mysql" in result.stderr


READ_COMMANDS = [
    ["devices", "list"],
    ["devices", "show", "gw-a"],
    ["devices", "label", "gw-a", "--tier", "canary"],
    ["telemetry", "tail", "gw-a"],
    ["decisions", "list"],
    ["gaps"],
    ["quarantine", "list"],
    ["rollout", "list"],
    ["rollout", "status", "r1"],
    ["rollout", "pause", "r1"],
    ["sessions", "list"],
    ["sessions", "retire", "node-a"],
]


@pytest.mark.parametrize("command", READ_COMMANDS, ids=" ".join)
def test_a_command_on_a_store_that_does_not_exist_names_it_and_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    """Run in the wrong folder, a read made an empty ./fleet.db and showed an empty fleet."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLEET_STORE", raising=False)
    result = runner.invoke(app, command)
    assert result.exit_code == 3, result.output
    default = tmp_path.resolve() / "fleet.db"
    assert result.stderr == (
        f"fleet: store {default} does not exist (the default ./fleet.db; name another with "
        "--store or FLEET_STORE)\n"
    )
    missing = tmp_path / "elsewhere" / "f.db"
    result = runner.invoke(app, [*command, "--store", str(missing)])
    assert result.exit_code == 3, result.output
    assert result.stderr == f"fleet: store {missing} does not exist (--store)\n"
    result = runner.invoke(app, command, env={"FLEET_STORE": f"sqlite://{missing}"})
    assert result.exit_code == 3, result.output
    assert result.stderr == f"fleet: store {missing} does not exist (FLEET_STORE)\n"
    assert list(tmp_path.iterdir()) == []


def test_store_url_and_since_parsing(tmp_path: Path) -> None:
    assert store_url(str(tmp_path / "f.db")) == f"sqlite://{tmp_path / 'f.db'}"
    assert store_url("postgresql://u@h/db") == "postgresql://u@h/db"
    assert store_url(None).endswith("/fleet.db")
    now = 1_800_000_000 * 10**9
    assert parse_since("10m", now) == now - 600 * 10**9
    assert parse_since("1.5h", now) == now - 5400 * 10**9
    assert parse_since("2026-12-02T13:00:00Z", now) == 1_796_216_400 * 10**9
    assert parse_since("2026-12-02T13:00:00", now) == 1_796_216_400 * 10**9
    assert parse_since("12345", now) == 12345
    with pytest.raises(typer.BadParameter):
        parse_since("soon", now)
    # Out of the stores' signed 64-bit ns, or digits int() refuses: a usage error, no trace.
    for text in ("99999999999999999999", "9999999999999999d", "0001-01-01T00:00:00Z", "²"):
        with pytest.raises(typer.BadParameter):
            parse_since(text, now)


def test_bad_since_and_interval_are_usage_errors(url: str) -> None:
    result = runner.invoke(
        app, ["decisions", "list", "--store", url, "--since", "99999999999999999999"]
    )
    assert result.exit_code == 2, result.output
    assert "after 2262" in result.stderr
    args = ["telemetry", "tail", "gw-a", "--store", url, "-f", "--interval", "-1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "--interval" in result.stderr


def test_label_refuses_a_group_no_selector_could_name(url: str) -> None:
    result = runner.invoke(app, ["devices", "label", "gw-a", "--group", "line 1", "--store", url])
    assert result.exit_code == 2, result.output
    assert "--group 'line 1'" in result.stderr
    result = runner.invoke(app, ["devices", "label", "gw-a", "--group", "line-1", "--store", url])
    assert result.exit_code == 0, result.output


def test_a_store_failing_after_it_opened_is_one_line_not_a_traceback(url: str) -> None:
    # A table gone under the CLI (a half-restored backup): the command's store call fails
    # after open_cli_store succeeded; the entry point turns that into the store's message.
    with sqlite3.connect(url.removeprefix("sqlite://")) as db:
        db.execute("DROP TABLE devices")
    done = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "devices", "list", "--store", url],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("fleet: store "), done.stderr
    assert "no such table: devices" in done.stderr


def test_version() -> None:
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0
    assert result.stdout.strip()


def _counts(url: str) -> dict[str, int]:
    st = open_store(url)
    try:
        return st.counts()
    finally:
        st.close()


def test_history_expire_cuts_by_kind_audits_and_refuses_a_bad_spec(url: str) -> None:
    st = open_store(url)
    try:
        day_old = time.time_ns() - 25 * 3600 * 10**9
        boot = "f" * 32
        old = [telemetry("gw-a", boot, s, day_old + s) for s in range(3)]
        st.ingest(
            [Row("gw-a", SITE, "telemetry", boot, m.seq, m.t_ns, encode(m), day_old) for m in old]
        )
    finally:
        st.close()
    before = _counts(url)
    # The fixture's rows are minutes old, these three a day old.
    kept = run_json("history", "expire", "--retention", "telemetry=2d", "--store", url)
    assert kept == {"deleted": {"telemetry": 0}, "keep_s": {"telemetry": 2 * 86400}}
    res = runner.invoke(
        app, ["history", "expire", "--retention", "telemetry=1d,decisions=30d", "--store", url]
    )
    assert res.exit_code == 0, res.output
    assert "telemetry: 3 deleted" in res.stdout
    assert "decision: 0 deleted" in res.stdout
    after = _counts(url)
    assert after["telemetry"] == before["telemetry"] - 3
    assert after["decision"] == before["decision"]
    audit = run_json("audit", "list", "--store", url)
    assert isinstance(audit, list)
    assert audit[0]["action"] == "history.expire"
    assert audit[0]["detail"]["deleted"] == {"telemetry": 3, "decision": 0}
    for spec, words in (
        ("telemetry=30", "expected whole days or hours"),
        ("logs=3d", "unknown kind 'logs'"),
        ("telemetry", "expected KIND=AGE"),
        ("telemetry=1d,telemetry=2d", "telemetry is given twice"),
        ("", "names no kind"),
    ):
        res = runner.invoke(app, ["history", "expire", "--retention", spec, "--store", url])
        assert res.exit_code == 2, (spec, res.output)
        assert words in res.output, (spec, res.output)
