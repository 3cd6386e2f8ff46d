"""The known-answer self-test: run a model on its golden windows before serving it.

:func:`load_checked` is what the agent calls wherever it loads a model: golden windows on the
preferred kernels, then on the builtin ones, and :class:`KnownAnswersFailed` if both answer
wrong. :func:`record` computes the known answers of a model directory on this machine.

Costs: 16 windows take well under 1 ms on x86 (two loads when falling back), run in the
caller's thread (the agent calls it from a worker thread).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from models import dataset
from models.errors import ModelRejected
from models.known_answers import DEFAULT_WINDOWS, KnownAnswers, Verdict, compare
from models.runtime import DEFAULT_MODEL_DIR, MANIFEST_NAME, LoadedModel, load_model

#: Plant seeds of the golden-window pool: none of training, validation or test.
GOLDEN_PLANT_SEEDS: Final = range(300001, 300005)
GOLDEN_PER_SEED: Final = 40
GOLDEN_RNG_SEED: Final = 21


class KnownAnswersFailed(ModelRejected):
    """The model gave wrong outputs for its golden windows on every kernel set tried."""

    def __init__(self, message: str, *, path: str | None = None, verdicts: tuple[Verdict, ...]):
        super().__init__(message, path=path)
        self.verdicts = verdicts


@dataclass(frozen=True, slots=True)
class SelfTest:
    """What the self-test found for the model that serves.

    ``result``: ``passed`` (every golden window exact on ``kernels``) or ``absent`` (the
    manifest has no known answers: served, with a warning). ``fallback``: why the
    preferred kernels were not used (their failed verdict), else None.
    """

    result: str
    backend: str
    kernels: str
    windows: int
    fallback: str | None
    verdicts: tuple[Verdict, ...]

    def status(self) -> dict[str, Any]:
        """JSON for /v1/status (no per-window detail)."""
        return {
            "result": self.result,
            "backend": self.backend,
            "kernels": self.kernels,
            "windows": self.windows,
            "fallback": self.fallback,
        }

    def line(self) -> str:
        """One log line."""
        if self.result == "absent":
            return (
                f"self-test: the manifest has no known answers; serving untested on "
                f"{self.backend}/{self.kernels}"
            )
        text = f"self-test passed: {self.windows} golden windows exact on {self.backend}/"
        text += self.kernels
        if self.fallback:
            text += f" (fell back from xnnpack: {self.fallback})"
        return text

    def to_json(self) -> dict[str, Any]:
        """Everything, per golden window expected and actual (``edge-agent selftest``)."""
        return {**self.status(), "verdicts": [v.to_json() for v in self.verdicts]}


def run(model: LoadedModel) -> Verdict | None:
    """The model's golden windows on its own kernels; None without known answers."""
    answers = model.manifest.known_answers
    if answers is None:
        return None
    actual = np.stack([model.predict_int8(w) for w in answers.inputs])
    return compare(answers, model.kernels, actual, platform.machine())


def load_checked(
    model_dir: Path | str | None = None,
    *,
    backend: str | None = None,
    threads: int = 1,
    jit: bool | None = None,
) -> LoadedModel:
    """:func:`~models.runtime.load_model`, then the self-test, falling back to the builtin
    kernels when the delegate's answers are wrong. ``model.selftest`` says what passed.

    Raises :class:`KnownAnswersFailed` (a :class:`ModelRejected`) when no kernel set gives
    the known answers, and whatever ``load_model`` raises.

    :func:`load_checked` is what the agent calls wherever it loads a model (start, hot swap,
    OTA install, rollback): it loads the model as configured (XNNPACK where the runtime has it),
    runs the manifest's golden windows (:mod:`models.known_answers`) and compares the int8
    outputs with the ones recorded for those kernels. When they differ it loads the same bytes
    on the runtime's builtin int8 kernels (``load_model(xnnpack=False)``) and tests again; if
    that fails too it raises :class:`KnownAnswersFailed` and the caller does not serve the
    model (the agent does not start, or keeps its old model). The result rides on the model as
    ``model.selftest`` (:class:`SelfTest`): status, metrics and the log say which kernels serve
    and why.
    """
    where = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
    model = load_model(where, backend=backend, threads=threads, jit=jit)
    return check(
        model,
        reload=lambda: load_model(where, backend=backend, threads=threads, jit=jit, xnnpack=False),
    )


def check(model: LoadedModel, *, reload: Any = None) -> LoadedModel:
    """Self-test an already loaded ``model`` (a rollback to a retired model does this);
    ``reload()`` gives the same model on the builtin kernels (default: from its path)."""
    first = run(model)
    if first is None:
        model.selftest = SelfTest("absent", model.backend, model.kernels, 0, None, ())
        return model
    if first.passed:
        model.selftest = SelfTest(
            "passed", model.backend, model.kernels, len(first.checks), None, (first,)
        )
        return model
    if model.kernels == "builtin":
        raise KnownAnswersFailed(
            f"known-answer self-test failed: {first.reason()}",
            path=str(model.path),
            verdicts=(first,),
        )
    if reload is None:

        def reload() -> LoadedModel:
            return load_model(
                model.path.parent,
                backend=model.backend,
                threads=model.threads,
                jit=model.jit,
                xnnpack=False,
            )

    plain: LoadedModel = reload()
    second = run(plain)
    if second is None or not second.passed:
        why = second.reason() if second is not None else "builtin: no known answers"
        raise KnownAnswersFailed(
            f"known-answer self-test failed: {first.reason()}; {why}",
            path=str(model.path),
            verdicts=(first,) if second is None else (first, second),
        )
    plain.selftest = SelfTest(
        "passed",
        plain.backend,
        plain.kernels,
        len(second.checks),
        first.reason(),
        (first, second),
    )
    return plain


# -- recording -------------------------------------------------------------------------------


def golden_inputs(model: LoadedModel, n: int = DEFAULT_WINDOWS) -> npt.NDArray[np.float32]:
    """``n`` golden windows for ``model``: the all-zeros window, then plant windows whose
    outputs (on ``model``) have the most values away from -128/127, one label at a time
    in turn so that every kind of window is in.

    Deterministic (fixed plant and RNG seeds). A model whose signals are not the simulated
    plant's gets windows of its normalization means with seeded noise instead.
    """
    m = model.manifest
    zeros = np.zeros((1, m.window, len(m.signals)), dtype=np.float32)
    if set(m.signals) <= set(dataset.SIGNALS) and m.window == dataset.WINDOW:
        pool = dataset.generate(GOLDEN_PLANT_SEEDS, GOLDEN_PER_SEED, rng_seed=GOLDEN_RNG_SEED)
        cols = [dataset.SIGNALS.index(s) for s in m.signals]
        values = pool.values[:, :, cols].astype(np.float32)
        labels = pool.labels
    else:
        rng = np.random.default_rng(GOLDEN_RNG_SEED)
        mean = np.array([m.mean[s] for s in m.signals], dtype=np.float64)
        std = np.array([m.std[s] for s in m.signals], dtype=np.float64)
        shape = (8 * n, m.window, len(m.signals))
        scale = rng.uniform(0.05, 2.0, (shape[0], 1, 1))
        values = (mean + std * scale * rng.standard_normal(shape)).astype(np.float32)
        labels = np.zeros(shape[0], dtype=np.int64)
    outs = np.stack([model.predict_int8(w) for w in values]).astype(np.int16)
    interior = ((outs > -128) & (outs < 127)).sum(axis=1)
    # Per label, best first (most unsaturated outputs; ties: pool order).
    queues = {
        int(lab): [
            int(i)
            for i in np.flatnonzero(labels == lab)[
                np.argsort(-interior[labels == lab], kind="stable")
            ]
        ]
        for lab in np.unique(labels)
    }
    chosen: list[int] = []
    while len(chosen) < n - 1 and any(queues.values()):
        for q in queues.values():
            if q and len(chosen) < n - 1:
                chosen.append(q.pop(0))
    return np.concatenate([zeros, values[sorted(chosen)]]).astype(np.float32)


def record(model_dir: Path | str, n: int = DEFAULT_WINDOWS, *, fresh: bool = False) -> KnownAnswers:
    """The known answers of the model in ``model_dir`` with this machine's outputs (LiteRT,
    XNNPACK and builtin kernels) added.

    When the manifest already has known answers (and not ``fresh``) their golden inputs and
    the other machines' outputs are kept: the inputs must be the same bytes everywhere, and
    the plant simulation that makes new ones may round differently on another machine.
    ``fresh`` (a newly trained model: old answers mean nothing) makes new inputs.

    :func:`record` computes the known answers of a model directory on this machine (both kernel
    sets, LiteRT): ``models.train``, ``scripts/record_known_answers.py`` and ``fleet bundle
    build --kind model`` call it. Golden inputs come from :func:`golden_inputs`: windows of the
    simulated plant (the signals the committed models read) chosen for outputs away from
    saturation, so a wrong sum shows, plus the all-zeros window.
    """
    fast = load_model(model_dir, backend="ai_edge_litert")
    plain = load_model(model_dir, backend="ai_edge_litert", xnnpack=False)
    if not fast.delegated:
        raise ModelRejected(
            "XNNPACK did not take the graph here: cannot record its known answers",
            path=str(Path(model_dir) / MANIFEST_NAME),
        )
    old = None if fresh else fast.manifest.known_answers
    inputs = old.inputs if old is not None else golden_inputs(fast, n)
    mine = {
        "xnnpack": np.stack([fast.predict_int8(w) for w in inputs]),
        "builtin": np.stack([plain.predict_int8(w) for w in inputs]),
    }
    diff = np.abs(mine["xnnpack"].astype(np.int16) - mine["builtin"]).max(axis=1)
    machine = platform.machine()
    info = {
        "backend": f"ai_edge_litert {_version('ai-edge-litert')}",
        "numpy": _version("numpy"),
        "xnnpack_vs_builtin": {
            "windows_differing": int((diff > 0).sum()),
            "max_abs_int8_diff": int(diff.max()),
        },
    }
    if os.environ.get("QEMU_CPU"):
        info["emulated"] = f"qemu-user, QEMU_CPU={os.environ['QEMU_CPU']}"
    expected = {**(old.expected if old is not None else {}), machine: mine}
    recorded = {**(old.recorded_with if old is not None else {}), machine: info}
    return KnownAnswers(
        inputs=inputs,
        expected=dict(sorted(expected.items())),
        tolerance=0,
        recorded_with=dict(sorted(recorded.items())),
    )


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


__all__ = [
    "KnownAnswersFailed",
    "SelfTest",
    "check",
    "golden_inputs",
    "load_checked",
    "record",
    "run",
]
