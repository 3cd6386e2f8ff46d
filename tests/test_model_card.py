"""The committed INT8 model still meets its card on data it has never seen.

A fresh held-out set is generated with :mod:`models.dataset` from plant seeds used nowhere in
training, validation or the card's own test set, run through the committed model with
:mod:`models.runtime` (no TensorFlow), and compared with ``manifest.json``'s metrics.

Tolerance, per class: ``max(0.05, 3 * sqrt(F1 * (1 - F1) / n))`` where ``n`` is the class's
support here: 0.05 for the well-separated classes, wider only where a small sample of a
hard class (drift) makes F1 itself uncertain. False alarms over 10 minutes of continuous
normal running must stay within the Poisson 99.9 % bound of the card's rate.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest

from models import LoadedModel, load_model
from models.dataset import LABELS, WindowSet, continuous_normal, generate

CARD_SEEDS = range(300_001, 300_026)  # 25 plant seeds x 40 windows
PER_SEED = 40
RNG_SEED = 99
CONT_SEED = 350_001
CONT_MINUTES = 10


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def held_out() -> WindowSet:
    return generate(CARD_SEEDS, PER_SEED, rng_seed=RNG_SEED)


def _decide_all(model: LoadedModel, windows: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
    return np.array([LABELS.index(model.decide(model.predict(w))) for w in windows], dtype=np.int64)


def _f1(y_true: npt.NDArray[np.int64], y_pred: npt.NDArray[np.int64], i: int) -> float:
    tp = int(((y_pred == i) & (y_true == i)).sum())
    fp = int(((y_pred == i) & (y_true != i)).sum())
    fn = int(((y_pred != i) & (y_true == i)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def test_held_out_set_is_fresh_and_covers_every_label(held_out: WindowSet) -> None:
    counts = held_out.counts()
    assert set(counts) == set(LABELS)
    assert min(counts.values()) >= 100
    assert held_out.values.shape[1:] == (64, 6)
    assert np.isfinite(held_out.values).all()


def test_per_class_f1_matches_the_card(model: LoadedModel, held_out: WindowSet) -> None:
    card = model.manifest.metrics["per_class"]
    pred = _decide_all(model, held_out.values)
    report = []
    failures = []
    for i, label in enumerate(LABELS):
        n = int((held_out.labels == i).sum())
        f1 = _f1(held_out.labels, pred, i)
        expected = float(card[label]["f1"])
        tolerance = max(0.05, 3 * math.sqrt(max(expected * (1 - expected), 0.0) / n))
        report.append(f"{label}: F1 {f1:.3f} (card {expected:.3f} +- {tolerance:.3f}, n={n})")
        if f1 < expected - tolerance:
            failures.append(label)
    assert not failures, "below the model card:\n" + "\n".join(report)


def test_false_alarms_on_continuous_normal_running(model: LoadedModel) -> None:
    n_windows = CONT_MINUTES * 60 * 100 // 64
    windows = continuous_normal(CONT_SEED, start_s=120.0, n_windows=n_windows)
    alarms = int((_decide_all(model, windows) != 0).sum())
    rate = float(model.manifest.metrics["false_alarms"]["per_hour"])
    mean = max(rate, 0.5) * CONT_MINUTES / 60
    # Smallest k with P(Poisson(mean) <= k) >= 0.999.
    k, term, cdf = 0, math.exp(-mean), math.exp(-mean)
    while cdf < 0.999:
        k += 1
        term *= mean / k
        cdf += term
    assert alarms <= k, f"{alarms} alarms in {CONT_MINUTES} min; card says {rate}/h"
