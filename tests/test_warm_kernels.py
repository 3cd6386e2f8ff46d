"""edge_agent.warm: the agent starts on the numpy path and switches to the compiled kernels
once they are loaded and checked; the decisions are the same before and after, bit for bit.

Real model, real numba kernels, real stage. The miscompiled kernel of one case stands in
for what cannot be produced here (a compiler fault): the real kernel with one cell wrong.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from drivers.sim.plant import parse_anomaly
from edge_agent.reasoning import ReasoningStage
from edge_agent.rules import RuleSet
from edge_agent.simwindows import plant_windows
from edge_agent.warm import check_windows, disagreement, in_thread, load_kernels, precompile_slot
from models import load_model
from models.input_stats import STAT_NAMES
from models.kernels import Kernels, kernels

pytestmark = pytest.mark.peers


def compiled() -> Kernels:
    k = kernels()
    assert k is not None, "numba is a dependency"
    return k


def test_a_stage_started_on_numpy_switches_to_the_kernels_and_decides_the_same() -> None:
    faults = [parse_anomaly(a) for a in ("spike:current@8+4x8", "stuck:speed@20+6")]
    windows = list(plant_windows(seed=4, seconds=32, anomalies=faults))
    started = ReasoningStage(load_model(jit=False), RuleSet())
    reference = ReasoningStage(load_model(jit=False), RuleSet())
    assert started.snapshot()["model"]["jit"] is False  # type: ignore[index]
    loaded: list[int] = []
    alarms = 0
    for i, w in enumerate(windows):
        if i == len(windows) // 3:
            assert asyncio.run(load_kernels(started, lambda: loaded.append(len(windows) // 3)))
            assert started.model_jit
            assert started.snapshot()["model"]["jit"] is True  # type: ignore[index]
        a, b = started.process(w, 0), reference.process(w, 0)
        assert (a.label, a.probabilities, a.top_signals, a.rules_fired, a.ood) == (
            b.label,
            b.probabilities,
            b.top_signals,
            b.rules_fired,
            b.ood,
        ), f"window {i}"
        alarms += a.label != "normal"
    assert loaded == [len(windows) // 3], "the hook runs once, after the switch"
    assert alarms >= 3, "the anomalies were decided on both paths"
    assert not reference.model_jit


def test_kernels_that_disagree_with_the_numpy_path_are_refused() -> None:
    stage = ReasoningStage(load_model(jit=False), RuleSet())
    good = compiled()
    assert disagreement(stage.prepared, good) == ""

    def one_cell_off(v: Any, p: Any, q: Any) -> None:
        good.features_int8(v, p, q)
        q[3, 0, 1] = q[3, 0, 1] + 1 if q[3, 0, 1] < 127 else 0

    bad = Kernels(one_cell_off, good.occlusion_batch_int8, good.input_out_mask)
    why = disagreement(stage.prepared, bad)
    assert why.startswith("check window 0: the compiled int8 input differs"), why

    def out_mask_off(v: Any, b: Any, s: Any) -> int:
        return good.input_out_mask(v, b, s) ^ 1

    wrong_ood = Kernels(good.features_int8, good.occlusion_batch_int8, out_mask_off)
    assert "input check differs" in disagreement(stage.prepared, wrong_ood)
    assert not stage.model_jit


def test_the_check_windows_reach_past_the_training_ranges() -> None:
    """The input check is exercised both ways: some windows in range, some out."""
    stage = ReasoningStage(load_model(jit=False), RuleSet())
    bounds = stage.prepared.input_bounds
    assert bounds is not None
    k = compiled()
    masks = []
    for w in check_windows(stage.prepared):
        stats = np.zeros((w.shape[1], len(STAT_NAMES)), dtype=np.float32)
        masks.append(k.input_out_mask(w, bounds, stats))
    assert any(m == 0 for m in masks), masks
    assert any(m != 0 for m in masks), masks


def test_a_model_swapped_in_meanwhile_is_left_as_it_was_loaded() -> None:
    stage = ReasoningStage(load_model(jit=False), RuleSet())
    first = stage.prepared
    stage.swap_model(load_model(jit=False))
    assert not stage.use_kernels(first, compiled())
    assert not stage.model_jit


# -- the load does not hold up the exit ------------------------------------------------------


def _python(code: str, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """``code`` run by a Python process of its own (its exit is what these cases watch)."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )


EXIT_WHILE_LOADING = """
import asyncio, sys, threading
from edge_agent.warm import in_thread

def load(stop: threading.Event) -> None:
    while not stop.wait(0.01):  # a load that ends only when asked (between its steps)
        pass
    print("stopped", file=sys.stderr, flush=True)

async def main() -> None:
    task = asyncio.create_task(in_thread(load, "stuck"))
    await asyncio.sleep(0.05)
    task.cancel()

asyncio.run(main())
print("exited", flush=True)
"""


def test_a_load_in_progress_is_stopped_when_its_task_is_cancelled() -> None:
    # asyncio.to_thread here would never return: asyncio.run joins its executor's threads,
    # and nothing would tell the load to stop.
    done = _python(EXIT_WHILE_LOADING, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    # The load saw its stop; the process then left (its exit joined the load's thread).
    assert done.stdout.split() == ["exited"]
    assert done.stderr.split() == ["stopped"]


STOPPED_LOAD = """
import threading
from models.errors import KernelsStopped
from models.kernels import kernels

stop = threading.Event()
stop.set()
try:
    kernels(stop)
except KernelsStopped:
    print("stopped")
print("loaded" if kernels() is not None else "none")
"""


def test_the_kernels_stop_between_compile_steps_and_load_again_later() -> None:
    # In a process of its own: this one has its kernels loaded already.
    done = _python(STOPPED_LOAD, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["stopped", "loaded"], "a stopped load records nothing"


def test_a_load_thread_hands_back_its_value_and_its_error() -> None:
    async def both() -> tuple[int, str]:
        value = await in_thread(lambda _stop: 6 * 7, "value")
        try:
            await in_thread(lambda _stop: int("x"), "error")
        except ValueError as exc:
            return value, str(exc)
        return value, ""

    value, error = asyncio.run(both())
    assert value == 42
    assert "invalid literal" in error


def test_a_slot_whose_kernels_cannot_compile_says_why_in_one_line(tmp_path: Path) -> None:
    # The slot's own models package comes first on the child's path, as at its boot.
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    (tmp_path / "models" / "kernels.py").write_text("raise ImportError('no kernels in 0.9')\n")
    assert precompile_slot(tmp_path) == "ImportError: no kernels in 0.9"
    assert precompile_slot(tmp_path, timeout_s=0.001) == "the compile took over 0.001 s"
