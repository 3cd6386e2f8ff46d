"""Output piped to a file is not wrapped at 80 columns; on a terminal it still fits it."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.table import Table

from ota.journal import save
from ota.machine import Journal, Outcome
from tests.support.mosquitto import mosquitto

pytestmark = pytest.mark.peers

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
REASON = (
    "latency regression: reasoning median 349 µs per window against 121 µs before the "
    "update (allowed 171 µs: +15 %)"
)


def test_fleet_serve_summary_is_one_line_in_a_pipe(tmp_path: Path) -> None:
    with mosquitto(tmp_path / "broker") as broker:
        res = subprocess.run(
            [
                str(BIN / "fleet"), "serve", "--store", str(tmp_path / "fleet.db"), "--broker",
                f"127.0.0.1:{broker.port}", "--no-rollouts", "--duration", "1", "--http",
                "127.0.0.1:0",
            ],
            capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
        )  # fmt: skip
    assert res.returncode == 0, res.stderr
    summary = [line for line in res.stderr.splitlines() if line.startswith("worker 0:")]
    assert len(summary) == 1, res.stderr
    assert summary[0].endswith(
        "dropped 0 (redelivered), dropped QoS 0 0 (lost), gaps 0 (0 messages never arrived)"
    ), res.stderr
    assert "duplicates 0, conflicts 0 (quarantined), quarantined 0" in summary[0]


def test_ota_status_lines_and_table_are_not_wrapped_in_a_pipe(tmp_path: Path) -> None:
    state = tmp_path / "state-folder-with-a-rather-long-name-for-the-table-to-be-wide"
    text = (REPO / "examples" / "agent.toml").read_text()
    text = text.replace('state_dir = "../var/demo-gw-01"', f'state_dir = "{state}"')
    text = text.replace("port = 8080", "port = 9")  # nobody listens: status from the journal
    config = tmp_path / "agent.toml"
    config.write_text(text.replace('"../', f'"{REPO}/'))
    last = Outcome("rolled_back", "model-3.0.0-with-a-long-bundle-id", "3.0.0", REASON, 1)
    (state / "ota").mkdir(parents=True)
    save(state / "ota" / "journal.json", Journal(last=last, floors={"model": 3}))
    res = subprocess.run(
        [str(BIN / "edge-agent"), "ota", "status", "-c", str(config)],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert f"last: rolled_back model-3.0.0-with-a-long-bundle-id 3.0.0: {REASON}\n" in res.stdout
    assert all(len(line) > 0 for line in res.stdout.splitlines()), res.stdout


def test_a_console_wraps_on_a_terminal_only() -> None:
    from edge_agent.console import make_console  # noqa: PLC0415 - the unit under test

    long = "word " * 60
    table = Table("name", "value")
    table.add_row("reason", long.strip())

    piped = io.StringIO()
    console = make_console(file=piped)
    console.print(long.strip())
    console.print(table)
    lines = piped.getvalue().splitlines()
    assert lines[0] == long.strip()
    assert any(long.strip() in line for line in lines[1:]), piped.getvalue()

    tty = io.StringIO()
    console = make_console(file=tty, force_terminal=True, width=80)
    console.print(long.strip())
    assert max(len(line) for line in tty.getvalue().splitlines()) <= 80
