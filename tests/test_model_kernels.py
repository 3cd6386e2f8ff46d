"""The compiled kernels (models/kernels.py) against the numpy path they stand in for.

Both paths must give the same int8 cells, bit for bit: the model's outputs, and so every
decision and attribution, must not depend on whether numba is there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from drivers.sim.plant import parse_anomaly
from edge_agent.reasoning import ReasoningStage
from edge_agent.rules import RuleSet
from edge_agent.simwindows import plant_windows
from models import load_model
from models.dataset import continuous_normal
from models.errors import BackendUnavailable
from models.kernels import JIT_ENV, features_int8, kernels
from models.runtime import ColumnMedian, LoadedModel

pytestmark = pytest.mark.peers


@pytest.fixture(scope="module")
def jitted() -> LoadedModel:
    model = load_model(jit=True)
    assert model.jit
    return model


@pytest.fixture(scope="module")
def plain() -> LoadedModel:
    model = load_model(jit=False)
    assert not model.jit
    return model


def hard_windows() -> list[npt.NDArray[np.float32]]:
    """Normal windows, and the same with what the numpy path treats specially: never-seen
    (NaN) and infinite cells, values far past the clip, flat and repeated columns."""
    rng = np.random.default_rng(21)
    base = [w.astype(np.float32) for w in continuous_normal(seed=31337, start_s=5.0, n_windows=40)]
    out = list(base)
    for k, w in enumerate(base):
        x = w.copy()
        i = k % x.shape[1]
        kind = k % 6
        if kind == 0:
            x[: 1 + k % 20, i] = np.nan
        elif kind == 1:
            x[10 + k % 30, i] = np.inf if k % 2 else -np.inf
        elif kind == 2:
            x[20:23, i] *= 1e6
        elif kind == 3:
            x[:, i] = x[0, i]
        elif kind == 4:
            x[::2, i] = x[1::2, i]
        else:
            x += rng.standard_normal(x.shape).astype(np.float32) * x.std(axis=0) * 5
        out.append(x)
    return out


def test_features_kernel_is_the_numpy_path(jitted: LoadedModel, plain: LoadedModel) -> None:
    got = np.empty_like(jitted._q3)
    want = np.empty_like(plain._q3)
    for x in hard_windows():
        jitted._features_into(x, got)
        plain._features_into(x, want)
        np.testing.assert_array_equal(got, want)
        # Through predict(): the same probabilities.
        np.testing.assert_array_equal(jitted.predict(x), plain.predict(x))
    # A strided (column-picked) window takes the kernel too.
    wide = np.concatenate([hard_windows()[0], hard_windows()[1]], axis=1)[:, ::2]
    jitted._features_into(wide, got)
    plain._features_into(np.ascontiguousarray(wide), want)
    np.testing.assert_array_equal(got, want)


def test_features_kernel_runs_as_plain_python_too(plain: LoadedModel) -> None:
    """The kernel's source is ordinary Python: the same cells uncompiled (what numba
    compiles is what is read here)."""
    x = hard_windows()[40]  # a NaN case
    got = np.empty_like(plain._q3)
    want = np.empty_like(plain._q3)
    features_int8(x, plain._kparams, got)
    plain._features_into(x, want)
    np.testing.assert_array_equal(got, want)


def test_occlusion_kernel_is_the_numpy_path(jitted: LoadedModel, plain: LoadedModel) -> None:
    m = plain.manifest
    rng = np.random.default_rng(2)
    noise = (rng.standard_normal((m.window, len(m.signals))) * m.features.diff_scale).astype(
        np.float32
    )
    base = np.asarray([m.mean[s] for s in m.signals], dtype=np.float32)
    fast, slow = jitted.level_occlusion(noise, base), plain.level_occlusion(noise, base)
    median = ColumnMedian(m.window, len(m.signals))
    for case in hard_windows():
        x = np.where(np.isfinite(case), case, base).astype(np.float32)
        jitted.predict(x)
        plain.predict(x)
        np.testing.assert_array_equal(fast.at_median(x, x), slow.at_median(x, x))
        np.testing.assert_array_equal(jitted._occ_q, plain._occ_q)
        # And the numpy path's at_median is at() of the column median.
        plain.predict(x)
        np.testing.assert_array_equal(slow.at(x, median(x)), slow.at_median(x, x))


def test_stage_decides_the_same_with_and_without_the_kernels(
    jitted: LoadedModel, plain: LoadedModel
) -> None:
    faults = [
        parse_anomaly(a)
        for a in ("spike:current@10+4x8", "stuck:speed@22+6", "noise:vibration@34+6x2")
    ]
    windows = list(plant_windows(seed=9, seconds=45, anomalies=faults))
    a, b = ReasoningStage(jitted, RuleSet()), ReasoningStage(plain, RuleSet())
    alarms = 0
    for w in windows:
        da, db = a.process(w, 0), b.process(w, 0)
        assert (da.label, da.probabilities, da.top_signals) == (
            db.label,
            db.probabilities,
            db.top_signals,
        )
        alarms += da.label != "normal"
    assert alarms >= 3


def test_jit_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels() is not None  # numba is a dependency: CI runs the compiled path
    monkeypatch.setenv(JIT_ENV, "0")
    assert kernels() is None
    assert not load_model().jit
    with pytest.raises(BackendUnavailable, match="EDGEFLEET_JIT=0"):
        load_model(jit=True)


_MDWE_CHILD = """
import ctypes, json, sys
import numpy as np
# PR_SET_MDWE = 65, PR_MDWE_REFUSE_EXEC_GAIN = 1: what MemoryDenyWriteExecute=yes sets.
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:
    sys.exit(f"prctl(PR_SET_MDWE) failed: errno {ctypes.get_errno()}")
from models import load_model
from models.errors import BackendUnavailable
try:
    load_model(jit=True)
    refused = ""
except BackendUnavailable as exc:
    refused = str(exc)
model = load_model()
x = np.load(sys.argv[1])
print(json.dumps({"jit": model.jit, "refused": refused, "p": model.predict(x).tolist()}))
"""


def test_under_memory_deny_write_execute_the_numpy_path_serves(
    jitted: LoadedModel, tmp_path: Path
) -> None:
    """The agent's unit sets MemoryDenyWriteExecute=yes: numba cannot map code there. The
    model must still load (numpy path, same outputs) and jit=True must say why not."""
    x = hard_windows()[3]
    np.save(tmp_path / "x.npy", x)
    env = {k: v for k, v in os.environ.items() if k != JIT_ENV}
    out = subprocess.run(
        [sys.executable, "-c", _MDWE_CHILD, str(tmp_path / "x.npy")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["jit"] is False
    assert "cannot map executable memory" in r["refused"], r["refused"]
    assert r["p"] == jitted.predict(x).tolist()


def test_stage_snapshot_says_which_path_runs(jitted: LoadedModel, plain: LoadedModel) -> None:
    model_a = ReasoningStage(jitted, RuleSet()).snapshot()["model"]
    model_b = ReasoningStage(plain, RuleSet()).snapshot()["model"]
    assert isinstance(model_a, dict)
    assert isinstance(model_b, dict)
    assert (model_a["jit"], model_b["jit"]) == (True, False)
