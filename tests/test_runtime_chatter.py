"""The TFLite runtime's own INFO line stays out of our stderr; everything else on fd 2 stays."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from models.native_log import runtime_stderr_to_log

pytestmark = pytest.mark.peers

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CHATTER = "Created TensorFlow Lite XNNPACK delegate"


def test_commands_that_load_the_model_print_no_runtime_chatter() -> None:
    check = subprocess.run(
        [str(BIN / "edge-agent"), "check-config", "examples/agent.toml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert check.returncode == 0, check.stderr
    assert CHATTER not in check.stderr
    assert check.stderr == ""
    # Still delegated: the line is hidden, XNNPACK is not switched off.
    code = "from models import load_model; print(load_model().delegated)"
    load = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert load.returncode == 0, load.stderr
    assert load.stdout.strip() == "True"
    assert load.stderr == ""


def test_other_stderr_output_is_kept_and_the_chatter_is_a_debug_record(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="models.native_log")

    def other_thread() -> None:
        os.write(2, b"another thread's line\n")

    with runtime_stderr_to_log():
        os.write(2, b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\n")
        os.write(2, b"WARNING: a runtime warning stays\n")
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert err == "WARNING: a runtime warning stays\nanother thread's line\nafter\n"
    assert [r.getMessage() for r in caplog.records] == [
        "runtime: INFO: Created TensorFlow Lite XNNPACK delegate for CPU."
    ]


def _fail_while_held() -> None:
    with runtime_stderr_to_log():
        os.write(2, b"held\n")
        raise RuntimeError("boom")


def test_stderr_comes_back_when_the_body_fails(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        _fail_while_held()
    os.write(2, b"restored\n")
    assert capfd.readouterr().err == "held\nrestored\n"
