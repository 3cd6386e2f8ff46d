"""Train the motor-drive anomaly classifier, quantize it to INT8 and write ``models/motor_drive``.

Run in the training venv (``make model``; TensorFlow is an optional extra, imported only
inside functions here, never needed on a device). Steps: labelled windows from the plant
simulator (:mod:`models.dataset`, disjoint seeds per set), normalisation constants, a small
seeded 1-D CNN, full-integer INT8 conversion, then, through :mod:`models.runtime` on the
written ``.tflite``: thresholds, test metrics, false alarms per hour, latency, known
answers; all into ``manifest.json``. ``--variant slow`` writes the slow OTA test model;
``--acquisition-from AGENT_TOML`` trains for that config's acquisition. Commands, times
and what each writes: ``models/README.md``, "Retraining".
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from models import dataset, input_stats, known_answers, selftest
from models.features import FeatureSpec, compute_features
from models.input_stats import InputStats
from models.native_log import runtime_stderr_to_log
from models.runtime import (
    DEFAULT_MODEL_DIR,
    MANIFEST_NAME,
    LoadedModel,
    ModelManifest,
    decide,
    load_model,
)

REPO = Path(__file__).resolve().parent.parent
REFERENCE_PATH = REPO / "tests" / "data" / "model_reference.npz"
CARD_PATH = Path(__file__).resolve().parent / "README.md"
CARD_BEGIN = "<!-- metrics:begin (written by models/train.py) -->"
CARD_END = "<!-- metrics:end -->"

MODEL_NAME = "motor_drive_anomaly"
MODEL_VERSION = "1.0.0"
DESCRIPTION = (
    "INT8 1-D CNN that classifies one 64-step (0.64 s at 100 Hz) window of the "
    "motor drive's six signals as normal or as one sensor anomaly: drift, spike, "
    "stuck, noise. Dropout (a missing signal) is not a model label."
)
TF_SEED = 20240611
DATA_RNG_SEED = 7
PER_SEED = 40
TRAIN_SEEDS = range(1, 601)
VAL_SEEDS = range(100_001, 100_081)
TEST_SEEDS = range(200_001, 200_151)
OUT_OF_SCOPE_SEEDS = range(210_001, 210_011)
#: Continuous normal operation (back-to-back windows, hop = window) for alarm thresholds
#: (validation) and the reported false alarms per hour (test).
#: Each run is (plant seed, start s, hours).
ContRun = tuple[int, float, float]
CONT_TRAIN: tuple[ContRun, ...] = tuple((160_001 + i, 150.0 * i, 0.5) for i in range(12))
CONT_VAL: tuple[ContRun, ...] = ((150_001, 0.0, 1.0), (150_002, 600.0, 1.0))
CONT_TEST: tuple[ContRun, ...] = (
    (250_001, 0.0, 1.0),
    (250_002, 300.0, 1.0),
    (250_003, 900.0, 1.0),
    (250_004, 1800.0, 1.0),
)
CLIP = 8.0

EPOCHS = 60
PATIENCE = 10
NORMAL_WEIGHT = 2.0
BATCH = 128
LEARNING_RATE = 3e-3
#: Threshold choice: the lowest candidate (best recall) whose false alarms on the validation
#: continuous run stay under this rate and whose false-positive rate on validation normal
#: windows stays under MAX_VAL_FPR.
MAX_FALSE_ALARMS_PER_HOUR_PER_LABEL = 0.5
MAX_VAL_FPR = 0.01
THRESHOLD_CANDIDATES = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99)

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]

#: One Conv1D layer: (filters, kernel size, stride); "same" padding, ReLU.
ConvLayer = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Variant:
    """What a variant changes; data, features, labels, quantization and manifest are shared.

    ``default_out`` is where it is written without ``--out``. Only a variant with
    ``owns_reference`` rewrites ``tests/data/model_reference.npz`` and the model card's
    metrics: those describe the default model. Thresholds are chosen by the same rule for
    every variant.
    """

    name: str
    version: str
    description: str
    conv: tuple[ConvLayer, ...]
    epochs: int
    patience: int
    default_out: Path
    owns_reference: bool
    #: Train on this many windows drawn at random from the training set (None: all).
    fit_windows: int | None = None
    #: Raise each threshold to the committed default model's where the rule chose lower.
    floor_at_default: bool = False

    def architecture(self, n_labels: int) -> str:
        convs = [f"Conv1D({f},k{k}{f',stride{s}' if s > 1 else ''},relu)" for f, k, s in self.conv]
        return " > ".join([*convs, "[GlobalMax, GlobalAvg]", f"Dense({n_labels})", "Softmax"])


VARIANTS: Mapping[str, Variant] = {
    "default": Variant(
        name="default",
        version=MODEL_VERSION,
        description=DESCRIPTION,
        conv=((16, 5, 1), (24, 5, 2), (32, 3, 1)),
        epochs=EPOCHS,
        patience=PATIENCE,
        default_out=DEFAULT_MODEL_DIR,
        owns_reference=True,
    ),
    # A test model for OTA probation and the rollout demo: it loads, fits the agent and
    # mostly says the right thing, but its invoke is tens of times slower than the default's
    # (~150x the multiply-accumulates: 256 channels at the full 64-step resolution), so the
    # reasoning stage's latency regresses while a 100 Hz agent still keeps up. A few epochs
    # suffice: accuracy is not what it is for.
    "slow": Variant(
        name="slow",
        version="3.0.0",
        description=(
            "Deliberately slow variant (an OTA probation test model, not for production): "
            "same windows, features, labels and decision rule as the default motor_drive "
            "model, with a much wider and deeper INT8 1-D CNN whose invoke is tens of times "
            "slower. " + DESCRIPTION
        ),
        conv=((64, 5, 1), (128, 5, 1), (256, 5, 1), (256, 5, 1)),
        epochs=4,
        patience=2,
        default_out=DEFAULT_MODEL_DIR.parent / "motor_drive_slow",
        owns_reference=False,
        floor_at_default=True,
    ),
}


# -- data ------------------------------------------------------------------------------------


def _make_set(
    seeds: Sequence[int],
    workers: int,
    acquisition: dataset.Acquisition = dataset.DEFAULT_ACQUISITION,
) -> dataset.WindowSet:
    job = partial(
        dataset.generate_seed,
        n_windows=PER_SEED,
        rng_seed=DATA_RNG_SEED,
        acquisition=acquisition,
    )
    with ProcessPoolExecutor(max_workers=workers) as pool:
        parts = list(pool.map(job, seeds, chunksize=4))
    return dataset.concat(parts)


def _continuous(
    runs: Sequence[ContRun],
    workers: int,
    acquisition: dataset.Acquisition = dataset.DEFAULT_ACQUISITION,
) -> FloatArray:
    with ProcessPoolExecutor(max_workers=workers) as pool:
        parts = list(pool.map(partial(_continuous_one, acquisition=acquisition), runs))
    return np.concatenate(parts)


def _continuous_one(
    run: ContRun, acquisition: dataset.Acquisition = dataset.DEFAULT_ACQUISITION
) -> FloatArray:
    seed, start_s, hours = run
    n_windows = round(hours * 3600 * dataset.RATE_HZ / dataset.WINDOW)
    return dataset.continuous_normal(seed, start_s, n_windows, acquisition)


def acquisition_from(path: Path) -> dataset.Acquisition:
    """The acquisition the agent config at ``path`` delivers for the model's six signals
    (``--acquisition-from``): per signal, its source's period, resolution, range, deadband
    and heartbeat, as ``edge-agent check-config`` sees them
    (:func:`edge_agent.acquisition.config_acquisition`), so the trained model's
    ``training.acquisition`` is exactly what the input contract will compare with that
    config. Raises ValueError naming what does not fit (a signal no source gives, another
    grid or window than the data sets are made on, a config the agent would refuse).

    edge_agent is imported here, not at the top: the training tool reads an agent config
    through the agent's own parser, while the ``models`` package never depends on the
    agent (edge_agent imports models).
    """
    from drivers.errors import DriverConfigError  # noqa: PLC0415
    from edge_agent.acquisition import config_acquisition  # noqa: PLC0415
    from edge_agent.config import load_config  # noqa: PLC0415
    from edge_agent.errors import ConfigError  # noqa: PLC0415

    try:
        cfg = load_config(path)
        delivered = config_acquisition(cfg.sources)
    except (ConfigError, DriverConfigError) as exc:
        raise ValueError(f"--acquisition-from {path}: {exc}") from None
    per = cfg.perception
    if per.rate_hz != dataset.RATE_HZ or per.window != dataset.WINDOW:
        raise ValueError(
            f"--acquisition-from {path}: perception is {per.window} steps at "
            f"{per.rate_hz:g} Hz; the data sets are {dataset.WINDOW} steps at "
            f"{dataset.RATE_HZ} Hz"
        )
    missing = [s for s in dataset.SIGNALS if s not in delivered]
    if missing:
        raise ValueError(
            f"--acquisition-from {path}: no source gives {', '.join(missing)} "
            f"(the model reads {', '.join(dataset.SIGNALS)})"
        )
    unknown = [s for s in dataset.SIGNALS if math.isnan(delivered[s].acquisition.period_ms)]
    if unknown:
        raise ValueError(
            f"--acquisition-from {path}: no period for {', '.join(unknown)} "
            "(a DBC message without a cycle time, or a poll of 0 ms): nothing to simulate"
        )
    return dataset.Acquisition(path.name, {s: delivered[s].acquisition for s in dataset.SIGNALS})


def _dir_name(variant: Variant, config: Path) -> str:
    """``motor_drive_<config name>`` (``_slow`` for the slow variant)."""
    stem = "".join(c if c.isalnum() else "_" for c in config.stem).strip("_") or "config"
    return "motor_drive" + ("_slow" if variant.name == "slow" else "") + f"_{stem}"


def acquisition_key(acquisition: dataset.Acquisition) -> str:
    """A short name for an acquisition's data sets in the cache (its description's hash)."""
    text = json.dumps(acquisition.describe(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _hours(runs: Sequence[ContRun]) -> float:
    return sum(run[2] for run in runs)


def _cached(cache: Path | None, name: str, make: Any) -> Any:
    """``make()``, saved to / loaded from ``cache/name.npz`` when a cache folder is given."""
    if cache is None:
        return make()
    path = cache / f"{name}.npz"
    if path.exists():
        with np.load(path) as z:
            if "windows" in z:
                return z["windows"]
            return dataset.WindowSet(
                values=z["values"],
                labels=z["labels"],
                signal=z["signal"],
                seed=z["seed"],
                start_step=z["start_step"],
            )
    result = make()
    cache.mkdir(parents=True, exist_ok=True)
    if isinstance(result, dataset.WindowSet):
        np.savez(
            path,
            values=result.values,
            labels=result.labels,
            signal=result.signal,
            seed=result.seed,
            start_step=result.start_step,
        )
    else:
        np.savez(path, windows=result)
    return result


def input_stats_of(train: dataset.WindowSet, cont_train: FloatArray) -> InputStats:
    """``training.input_stats``: the statistics of every normal window trained on (the
    training set's normal windows and the continuous training runs)."""
    normal = np.concatenate([train.values[train.labels == 0], cont_train])
    source = (
        f"the normal training windows: plant seeds {TRAIN_SEEDS.start}-{TRAIN_SEEDS.stop - 1} "
        f"(label normal) and the continuous training runs ({_hours(CONT_TRAIN):g} h)"
    )
    return input_stats.compute(normal, dataset.SIGNALS, source)


def feature_spec_from(normal: FloatArray) -> FeatureSpec:
    """Per-signal mean/std of normal windows; diff scale = robust std of step differences."""
    flat = normal.reshape(-1, normal.shape[-1]).astype(np.float64)
    mean = flat.mean(axis=0)
    std = flat.std(axis=0)
    diffs = np.diff(normal.astype(np.float64), axis=1).reshape(-1, normal.shape[-1])
    mad = np.median(np.abs(diffs - np.median(diffs, axis=0)), axis=0)
    diff_scale = 1.4826 * mad
    # A signal clamped at 0 while stopped has many zero steps; never let that collapse it.
    diff_scale = np.maximum(diff_scale, 1e-3 * std)
    return FeatureSpec.from_lists(
        [float(v) for v in mean],
        [float(v) for v in std],
        [float(v) for v in diff_scale],
        CLIP,
    )


# -- model -----------------------------------------------------------------------------------


def _tf() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return importlib.import_module("tensorflow")


def build_model(
    tf: Any, window: int, channels: int, n_labels: int, conv: Sequence[ConvLayer]
) -> Any:
    layers = tf.keras.layers
    inp = layers.Input((window, channels), name="features")
    x = inp
    for filters, kernel, stride in conv:
        x = layers.Conv1D(filters, kernel, strides=stride, padding="same", activation="relu")(x)
    pooled = layers.Concatenate()(
        [layers.GlobalMaxPooling1D()(x), layers.GlobalAveragePooling1D()(x)]
    )
    logits = layers.Dense(n_labels)(pooled)
    out = layers.Softmax(name="probs")(logits)
    return tf.keras.Model(inp, out, name=MODEL_NAME)


def train_keras(
    tf: Any,
    x_train: FloatArray,
    y_train: IntArray,
    x_val: FloatArray,
    y_val: IntArray,
    *,
    variant: Variant,
) -> tuple[Any, dict[str, Any]]:
    tf.keras.utils.set_random_seed(TF_SEED)
    tf.config.experimental.enable_op_determinism()
    n_labels = len(dataset.LABELS)
    model = build_model(tf, x_train.shape[1], x_train.shape[2], n_labels, variant.conv)
    counts = np.bincount(y_train, minlength=len(dataset.LABELS))
    class_weight = {i: float(len(y_train) / (len(counts) * c)) for i, c in enumerate(counts)}
    # False alarms cost more than a missed window (anomalies last many windows).
    class_weight[0] *= NORMAL_WEIGHT
    model.compile(
        optimizer=tf.keras.optimizers.Adam(LEARNING_RATE),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    callbacks = [
        tf.keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=4),
        tf.keras.callbacks.EarlyStopping(
            monitor="val_loss", patience=variant.patience, restore_best_weights=True
        ),
    ]
    history = model.fit(
        x_train,
        y_train,
        validation_data=(x_val, y_val),
        epochs=variant.epochs,
        batch_size=BATCH,
        class_weight=class_weight,
        callbacks=callbacks,
        verbose=2,
    )
    val_loss, val_acc = model.evaluate(x_val, y_val, verbose=0)
    info = {
        "framework": f"tensorflow {tf.__version__} / keras {tf.keras.__version__}",
        "architecture": variant.architecture(n_labels),
        "params": int(model.count_params()),
        "optimizer": (
            f"Adam(lr={LEARNING_RATE}), ReduceLROnPlateau(0.5, 4), "
            f"EarlyStopping({variant.patience})"
        ),
        "loss": (
            f"sparse categorical cross-entropy, class-balanced weights, normal x{NORMAL_WEIGHT:g}"
        ),
        "epochs_run": len(history.history["loss"]),
        "batch_size": BATCH,
        "float_val_accuracy": round(float(val_acc), 4),
        "float_val_loss": round(float(val_loss), 4),
    }
    return model, info


def convert_int8(tf: Any, model: Any, representative: FloatArray) -> bytes:
    def rep() -> Iterator[list[FloatArray]]:
        for i in range(representative.shape[0]):
            yield [representative[i : i + 1]]

    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = rep
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = tf.int8
    converter.inference_output_type = tf.int8
    return bytes(converter.convert())


# -- evaluation through the runtime ----------------------------------------------------------


def predict_all(model: LoadedModel, windows: FloatArray) -> FloatArray:
    return np.stack([model.predict(w) for w in windows])


def class_metrics(y_true: IntArray, y_pred: IntArray) -> dict[str, dict[str, float | int]]:
    out: dict[str, dict[str, float | int]] = {}
    for i, name in enumerate(dataset.LABELS):
        tp = int(((y_pred == i) & (y_true == i)).sum())
        fp = int(((y_pred == i) & (y_true != i)).sum())
        fn = int(((y_pred != i) & (y_true == i)).sum())
        p = tp / (tp + fp) if tp + fp else 0.0
        r = tp / (tp + fn) if tp + fn else 0.0
        f1 = 2 * p * r / (p + r) if p + r else 0.0
        out[name] = {
            "precision": round(p, 4),
            "recall": round(r, 4),
            "f1": round(f1, 4),
            "support": int((y_true == i).sum()),
        }
    return out


def decisions(probs: FloatArray, thresholds: Mapping[str, float]) -> IntArray:
    arr = np.array([thresholds.get(label, np.inf) for label in dataset.LABELS], dtype=np.float32)
    return np.array([decide(p, arr, 0) for p in probs], dtype=np.int64)


def choose_thresholds(
    val_probs: FloatArray, val_labels: IntArray, cont_probs: FloatArray, cont_hours: float
) -> tuple[dict[str, float], dict[str, Any]]:
    thresholds: dict[str, float] = {}
    report: dict[str, Any] = {}
    normal = val_labels == 0
    for i, label in enumerate(dataset.LABELS):
        if i == 0:
            continue
        best: tuple[float, float] | None = None  # (f1, threshold)
        for t in THRESHOLD_CANDIDATES:
            fa_per_hour = float((cont_probs[:, i] >= t).sum()) / cont_hours
            fpr = float((val_probs[normal, i] >= t).mean())
            if fa_per_hour > MAX_FALSE_ALARMS_PER_HOUR_PER_LABEL or fpr > MAX_VAL_FPR:
                continue
            pred = val_probs[:, i] >= t
            tp = float((pred & (val_labels == i)).sum())
            p = tp / max(1.0, float(pred.sum()))
            r = tp / max(1.0, float((val_labels == i).sum()))
            f1 = 2 * p * r / (p + r) if p + r else 0.0
            if best is None or f1 > best[0] + 1e-9:
                best = (f1, t)
        chosen = best[1] if best is not None else 0.996
        thresholds[label] = chosen
        report[label] = {
            "threshold": chosen,
            "val_f1_one_vs_rest": round(best[0], 4) if best else None,
            "val_cont_false_alarms_per_hour": float((cont_probs[:, i] >= chosen).sum())
            / cont_hours,
        }
    return thresholds, report


def per_signal_recall(
    y_true: IntArray, y_pred: IntArray, signal: IntArray
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for i, label in enumerate(dataset.LABELS):
        if i == 0:
            continue
        row: dict[str, float] = {}
        for j, name in enumerate(dataset.SIGNALS):
            mask = (y_true == i) & (signal == j)
            row[name] = round(float((y_pred[mask] == i).mean()), 3) if mask.any() else float("nan")
        out[label] = row
    return out


def latency(model: LoadedModel, windows: FloatArray, n: int = 5000) -> dict[str, Any]:
    q = [model.quantize(model.features(w)) for w in windows[:64]]
    for i in range(300):
        model.invoke_int8(q[i % len(q)])
        model.predict(windows[i % len(windows)])
    t_invoke = np.empty(n)
    t_predict = np.empty(n)
    for i in range(n):
        x = q[i % len(q)]
        t0 = time.perf_counter_ns()
        model.invoke_int8(x)
        t_invoke[i] = time.perf_counter_ns() - t0
    for i in range(n):
        w = windows[i % len(windows)]
        t0 = time.perf_counter_ns()
        model.predict(w)
        t_predict[i] = time.perf_counter_ns() - t0
    return {
        "invoke_p50": round(float(np.percentile(t_invoke, 50)) / 1e3, 1),
        "invoke_p99": round(float(np.percentile(t_invoke, 99)) / 1e3, 1),
        "predict_p50": round(float(np.percentile(t_predict, 50)) / 1e3, 1),
        "predict_p99": round(float(np.percentile(t_predict, 99)) / 1e3, 1),
        "calls": n,
        "backend": model.backend,
        "threads": model.threads,
        "xnnpack_delegate": model.delegated,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "note": "measured at training time on the training host; predict = features + "
        "quantize + invoke + dequantize",
    }


# -- manifest --------------------------------------------------------------------------------


def build_manifest(
    tflite: bytes,
    spec: FeatureSpec,
    io: Mapping[str, Any],
    thresholds: Mapping[str, float],
    extra: Mapping[str, Any],
    *,
    variant: Variant = VARIANTS["default"],
) -> dict[str, Any]:
    signals = list(dataset.SIGNALS)
    manifest: dict[str, Any] = {
        "name": MODEL_NAME,
        "version": variant.version,
        "description": variant.description,
        "file": "model.tflite",
        "sha256": hashlib.sha256(tflite).hexdigest(),
        "size_bytes": len(tflite),
        "signals": signals,
        "window": dataset.WINDOW,
        "rate_hz": dataset.RATE_HZ,
        "features": spec.describe(),
        "normalization": {
            "mean": {s: float(v) for s, v in zip(signals, spec.mean, strict=True)},
            "std": {s: float(v) for s, v in zip(signals, spec.std, strict=True)},
        },
        "input": io["input"],
        "output": io["output"],
        "labels": list(dataset.LABELS),
        "thresholds": dict(thresholds),
        "decision": (
            "alarm the most probable anomaly label whose probability >= its threshold; "
            "otherwise normal"
        ),
    }
    manifest.update(extra)
    return manifest


def _io_details(tflite: bytes) -> dict[str, Any]:
    interpreter_mod = importlib.import_module("ai_edge_litert.interpreter")
    with runtime_stderr_to_log():
        interp = interpreter_mod.Interpreter(model_content=tflite)
        interp.allocate_tensors()
    out: dict[str, Any] = {}
    for kind, details in (
        ("input", interp.get_input_details()),
        ("output", interp.get_output_details()),
    ):
        d = details[0]
        scale, zero_point = d["quantization"]
        out[kind] = {
            "shape": [int(v) for v in d["shape"]],
            "dtype": np.dtype(d["dtype"]).name,
            "scale": float(scale),
            "zero_point": int(zero_point),
        }
    return out


def write_manifest(out_dir: Path, manifest: Mapping[str, Any]) -> None:
    text = json.dumps(manifest, indent=2, allow_nan=False) + "\n"
    tmp = out_dir / "manifest.json.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out_dir / "manifest.json")


def write_reference(model_dir: Path, windows: FloatArray, path: Path) -> None:
    """Int8 inputs and outputs of ~50 fixed windows, for the cross-backend tests.

    ``outputs_xnnpack``: LiteRT with its default XNNPACK delegate; ``outputs_builtin``:
    the builtin int8 kernels (what every backend gives with ``xnnpack=False``).
    """
    fast = load_model(model_dir, backend="ai_edge_litert")
    plain = load_model(model_dir, backend="ai_edge_litert", xnnpack=False)
    assert fast.delegated
    assert not plain.delegated
    q = np.stack([fast.quantize(fast.features(w)) for w in windows])
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path,
        values=windows.astype(np.float32),
        inputs=q,
        outputs_xnnpack=np.stack([fast.invoke_int8(x) for x in q]),
        outputs_builtin=np.stack([plain.invoke_int8(x) for x in q]),
        sha256=np.array(fast.sha256),
    )


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj


def _render_acquisition(acq: Mapping[str, Any] | None) -> str:
    """One line: the acquisition every window was made through (``training.acquisition``)."""
    if not acq:
        return "Acquisition: not recorded (every signal fresh at every grid step)."
    parts = []
    for name, a in acq["signals"].items():
        text = f"{name} {a['source']} every {a['period_ms']:g} ms"
        text += f", quantum {a['quantum']:g}" if a["quantum"] else ", float32"
        if a.get("deadband"):
            text += f", deadband {a['deadband']:g} + heartbeat {a['heartbeat_ms']:g} ms"
        parts.append(text)
    jitter = sorted({a["jitter_ms"] for a in acq["signals"].values()})
    return (
        f"Acquisition trained and evaluated for (`{acq['name']}`, held onto the grid like "
        f"perception; arrival jitter mean {'/'.join(f'{j:g}' for j in jitter)} ms): "
        + "; ".join(parts)
        + "."
    )


def render_card_metrics(manifest: Mapping[str, Any]) -> str:
    """The model card's numbers, as markdown, from the manifest."""
    m = manifest["metrics"]
    lat = manifest["latency_us"]
    lines = [
        f"Model `{manifest['name']}` {manifest['version']}, sha256 "
        f"`{manifest['sha256'][:16]}...`, {manifest['size_bytes']} bytes, "
        f"{manifest['training']['params']} parameters.",
        "",
        f"Held-out test set: plant seeds {m['test_set']['plant_seeds'][0]}-"
        f"{m['test_set']['plant_seeds'][1]} ({sum(m['test_set']['windows'].values())} windows), "
        f"evaluated with the {m['evaluated_with']}.",
        "",
        _render_acquisition(manifest["training"].get("acquisition")),
        "",
        "| label | threshold | precision | recall | F1 | windows |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, row in m["per_class"].items():
        th = manifest["thresholds"].get(label)
        lines.append(
            f"| {label} | {'-' if th is None else f'{th:g}'} | {row['precision']:.3f} | "
            f"{row['recall']:.3f} | {row['f1']:.3f} | {row['support']} |"
        )
    fa = m["false_alarms"]
    n_runs = len(manifest["seeds"]["continuous_test_runs"])
    lines += [
        "",
        f"Accuracy {m['accuracy']:.3f}. False alarms in continuous normal running "
        f"(back-to-back windows, {fa['hours']:g} h over {n_runs} "
        f"plant seeds): **{fa['per_hour']:g} per hour** ({fa['alarmed_windows']} of "
        f"{fa['windows']} windows; by label {fa['by_label']}).",
        "",
        "Recall by anomalous signal (test set):",
        "",
        "| label | " + " | ".join(dataset.SIGNALS) + " |",
        "| --- |" + " --- |" * len(dataset.SIGNALS),
    ]
    for label, row in m["recall_by_signal"].items():
        cells = ["n/a" if row[s] is None else f"{row[s]:.2f}" for s in dataset.SIGNALS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    oos = m["out_of_scope"]["temperature_drift"]
    lines += [
        "",
        f"Out of scope, measured anyway: temperature drift windows ({oos['windows']}) are "
        f"alarmed as drift {oos['alarmed_as_drift']:.1%} and as any anomaly "
        f"{oos['alarmed_as_any']:.1%} of the time.",
        "",
        f"Latency on the training host ({lat['machine']}, Python {lat['python']}, "
        f"{lat['backend']}, {lat['threads']} thread, XNNPACK delegate "
        f"{'on' if lat['xnnpack_delegate'] else 'off'}, {lat['calls']} calls): "
        f"invoke P50 {lat['invoke_p50']} us / P99 {lat['invoke_p99']} us; "
        f"predict (features + quantize + invoke + dequantize) P50 {lat['predict_p50']} us / "
        f"P99 {lat['predict_p99']} us.",
    ]
    return "\n".join(lines)


def write_card(manifest: Mapping[str, Any], path: Path = CARD_PATH) -> bool:
    """Replace the metrics block of the model card; False when the markers are missing."""
    if not path.exists():
        return False
    text = path.read_text(encoding="utf-8")
    begin, end = text.find(CARD_BEGIN), text.find(CARD_END)
    if begin < 0 or end < begin:
        return False
    body = render_card_metrics(manifest)
    new = text[: begin + len(CARD_BEGIN)] + "\n" + body + "\n" + text[end:]
    path.write_text(new, encoding="utf-8")
    return True


# -- main ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:  # noqa: PLR0915 - the training pipeline, step by step, as make model runs it
    parser = argparse.ArgumentParser(prog="python -m models.train", description=__doc__)
    parser.add_argument(
        "--variant",
        choices=sorted(VARIANTS),
        default="default",
        help="default: the agent's model; slow: the deliberately slow OTA test model",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="model directory (default: models/motor_drive, or models/motor_drive_slow)",
    )
    parser.add_argument("--cache", type=Path, default=None, help="keep generated data sets here")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--no-reference", action="store_true", help="do not rewrite tests/data/model_reference.npz"
    )
    parser.add_argument(
        "--acquisition-from",
        type=Path,
        default=None,
        metavar="AGENT_TOML",
        help=(
            "train for the acquisition this agent config describes (each signal's source, "
            "period, resolution, deadband); default out: models/motor_drive_<config name>"
        ),
    )
    args = parser.parse_args(argv)
    variant = VARIANTS[args.variant]
    acquisition = dataset.DEFAULT_ACQUISITION
    if args.acquisition_from is not None:
        try:
            acquisition = acquisition_from(args.acquisition_from)
        except ValueError as exc:
            parser.error(str(exc))
    out_dir: Path = args.out if args.out is not None else variant.default_out
    if args.acquisition_from is not None and args.out is None:
        out_dir = DEFAULT_MODEL_DIR.parent / _dir_name(variant, args.acquisition_from)
    if not variant.owns_reference and out_dir.resolve() == DEFAULT_MODEL_DIR:
        parser.error(f"--variant {variant.name} must not overwrite the default model {out_dir}")
    # The test suite's reference outputs and the card's metrics describe the shipped model:
    # a model for another acquisition writes them only when it replaces it (--out).
    owns_reference = variant.owns_reference and (
        args.acquisition_from is None or out_dir.resolve() == DEFAULT_MODEL_DIR
    )
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {msg}", file=sys.stderr, flush=True)

    cache: Path | None = args.cache
    if cache is not None and acquisition is not dataset.DEFAULT_ACQUISITION:
        cache = cache / f"acquisition-{acquisition_key(acquisition)}"
    acq, workers = acquisition, args.workers
    log(f"generating data sets (acquisition {acq.name})")
    train = _cached(cache, "train", lambda: _make_set(TRAIN_SEEDS, workers, acq))
    val = _cached(cache, "val", lambda: _make_set(VAL_SEEDS, workers, acq))
    test = _cached(cache, "test", lambda: _make_set(TEST_SEEDS, workers, acq))
    cont_train = _cached(cache, "cont_train", lambda: _continuous(CONT_TRAIN, workers, acq))
    cont_val = _cached(cache, "cont_val", lambda: _continuous(CONT_VAL, workers, acq))
    cont_test = _cached(cache, "cont_test", lambda: _continuous(CONT_TEST, workers, acq))
    log(f"train {train.counts()}, val {val.counts()}, test {test.counts()}")

    spec = feature_spec_from(train.values[train.labels == 0])
    # Slot windows of every label, plus back-to-back normal running: the rare normal
    # transients (a ramp starting: current and slip step at once) are what false alarms
    # are made of, and random slots see too few of them.
    x_train = np.concatenate(
        [compute_features(train.values, spec), compute_features(cont_train, spec)]
    )
    y_train = np.concatenate([train.labels, np.zeros(len(cont_train), dtype=np.int64)])
    x_val = compute_features(val.values, spec)

    tf = _tf()
    log("training")
    x_fit, y_fit = x_train, y_train
    if variant.fit_windows is not None and variant.fit_windows < len(x_train):
        # A wide model costs its width in training time too: fit on a fixed random subset.
        pick = np.random.default_rng(TF_SEED).choice(len(x_train), variant.fit_windows, False)
        x_fit, y_fit = x_train[np.sort(pick)], y_train[np.sort(pick)]
    keras_model, train_info = train_keras(tf, x_fit, y_fit, x_val, val.labels, variant=variant)
    if not variant.owns_reference:
        train_info = {"variant": variant.name, "fit_windows": len(x_fit), **train_info}
    log(f"float model: {train_info}")

    rng = np.random.default_rng(TF_SEED)
    rep_idx = rng.choice(len(x_train), size=1000, replace=False)
    tflite = convert_int8(tf, keras_model, x_train[rep_idx])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "model.tflite").write_bytes(tflite)
    io = _io_details(tflite)
    log(f"int8 model: {len(tflite)} bytes, io {io}")

    seeds = {
        "tensorflow": TF_SEED,
        "data_rng": DATA_RNG_SEED,
        "windows_per_plant_seed": PER_SEED,
        "train_plant_seeds": [TRAIN_SEEDS.start, TRAIN_SEEDS.stop - 1],
        "val_plant_seeds": [VAL_SEEDS.start, VAL_SEEDS.stop - 1],
        "test_plant_seeds": [TEST_SEEDS.start, TEST_SEEDS.stop - 1],
        "continuous_train_runs_seed_start_s_hours": [list(r) for r in CONT_TRAIN],
        "continuous_val_runs": [list(r) for r in CONT_VAL],
        "continuous_test_runs": [list(r) for r in CONT_TEST],
    }
    training = {
        **train_info,
        "train_windows": train.counts(),
        "train_continuous_normal_windows": len(cont_train),
        "val_windows": val.counts(),
        "representative_windows": int(rep_idx.size),
        "acquisition": acquisition.describe(),
        "input_stats": input_stats_of(train, cont_train).describe(),
        "anomaly_ranges": {
            "drift": {
                k: list(v) for k, v in dataset.DRIFT_RANGE.items() if k in dataset.DRIFT_SIGNALS
            },
            "spike": {k: list(v) for k, v in dataset.SPIKE_RANGE.items()},
            "noise_multiplier": list(dataset.NOISE_RANGE),
        },
    }
    provisional = {label: 0.5 for label in dataset.LABELS[1:]}
    extra: dict[str, Any] = {"seeds": seeds, "training": training}
    write_manifest(out_dir, build_manifest(tflite, spec, io, provisional, extra, variant=variant))
    model = load_model(out_dir, backend="ai_edge_litert")

    log("thresholds on validation")
    val_probs = predict_all(model, val.values)
    cont_val_probs = predict_all(model, cont_val)
    thresholds, threshold_report = choose_thresholds(
        val_probs, val.labels, cont_val_probs, _hours(CONT_VAL)
    )
    training["thresholds"] = {
        "rule": (
            f"per label, the candidate with the best one-vs-rest validation F1 among those "
            f"with <= {MAX_FALSE_ALARMS_PER_HOUR_PER_LABEL} false alarms/h on "
            f"{_hours(CONT_VAL):g} h of continuous normal validation runs and <= "
            f"{MAX_VAL_FPR:.0%} false positives on validation normal windows"
        ),
        "per_label": threshold_report,
    }
    if variant.floor_at_default:
        # Validation's 2 h of running miss operating points where a briefly trained wide
        # model reads normal as drift at 0.8-0.97: never alarm more readily than the
        # default model, whose thresholds held on the test runs.
        floor = ModelManifest.load(DEFAULT_MODEL_DIR / MANIFEST_NAME).thresholds
        for label, chosen in list(thresholds.items()):
            if floor.get(label, 0.0) > chosen:
                thresholds[label] = floor[label]
                threshold_report[label]["threshold"] = floor[label]
                threshold_report[label]["raised_to_default_model_threshold_from"] = chosen
        training["thresholds"]["rule"] += ", then raised to the default model's where lower"
    log(f"thresholds {thresholds}")

    log("test metrics")
    test_probs = predict_all(model, test.values)
    test_pred = decisions(test_probs, thresholds)
    cont_pred = decisions(predict_all(model, cont_test), thresholds)
    hours = _hours(CONT_TEST)
    alarms = cont_pred != 0
    metrics: dict[str, Any] = {
        "evaluated_with": (
            f"INT8 .tflite through models.runtime ({model.backend}, XNNPACK "
            f"{'on' if model.delegated else 'off'})"
        ),
        "test_set": {
            "plant_seeds": seeds["test_plant_seeds"],
            "windows": test.counts(),
        },
        "per_class": class_metrics(test.labels, test_pred),
        "accuracy": round(float((test_pred == test.labels).mean()), 4),
        "confusion": {
            "rows_true_cols_pred": list(dataset.LABELS),
            "matrix": [
                [int(((test.labels == i) & (test_pred == j)).sum()) for j in range(5)]
                for i in range(5)
            ],
        },
        "recall_by_signal": per_signal_recall(test.labels, test_pred, test.signal),
        "false_alarms": {
            "per_hour": round(float(alarms.sum()) / hours, 3),
            "alarmed_windows": int(alarms.sum()),
            "windows": int(alarms.size),
            "hours": hours,
            "by_label": {
                label: int((cont_pred == i).sum()) for i, label in enumerate(dataset.LABELS) if i
            },
        },
    }
    # Out of scope by design (see models.dataset): drift on temperature. Report what the
    # model does with it anyway.
    temp_drift = dataset.generate(
        OUT_OF_SCOPE_SEEDS,
        PER_SEED,
        rng_seed=DATA_RNG_SEED,
        weights={"drift": 1.0},
        drift_signals=("temperature",),
        acquisition=acquisition,
    )
    temp_pred = decisions(predict_all(model, temp_drift.values), thresholds)
    metrics["out_of_scope"] = {
        "temperature_drift": {
            "windows": len(temp_drift),
            "plant_seeds": [OUT_OF_SCOPE_SEEDS.start, OUT_OF_SCOPE_SEEDS.stop - 1],
            "alarmed_as_drift": round(float((temp_pred == 1).mean()), 4),
            "alarmed_as_any": round(float((temp_pred != 0).mean()), 4),
        }
    }
    log(json.dumps(metrics["per_class"]))
    log(json.dumps(metrics["out_of_scope"]))
    log(f"false alarms {metrics['false_alarms']}")

    lat = latency(model, test.values)
    log(f"latency {lat}")
    extra = {
        "seeds": seeds,
        "training": training,
        "metrics": _nan_to_none(metrics),
        "latency_us": lat,
    }
    manifest = build_manifest(tflite, spec, io, thresholds, extra, variant=variant)
    write_manifest(out_dir, manifest)
    # The golden windows and their exact outputs on both kernel sets (models.selftest).
    manifest[known_answers.KEY] = selftest.record(out_dir, fresh=True).describe()
    write_manifest(out_dir, manifest)
    final = load_model(out_dir, backend="ai_edge_litert")
    assert final.manifest.known_answers is not None
    assert final.manifest.thresholds == thresholds
    # The reference outputs and the card's metrics describe the default model only.
    if owns_reference and not args.no_reference:
        ref_rng = np.random.default_rng(12345)
        idx = np.sort(ref_rng.choice(len(test), size=50, replace=False))
        write_reference(out_dir, test.values[idx], REFERENCE_PATH)
        log(f"wrote {REFERENCE_PATH}")
    if owns_reference and out_dir.resolve() == DEFAULT_MODEL_DIR and write_card(manifest):
        log(f"updated the metrics in {CARD_PATH}")
    log(f"wrote {out_dir} ({len(tflite)} bytes, sha256 {final.sha256[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
