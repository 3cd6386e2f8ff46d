"""Runtime adapter: load an INT8 TFLite model with its manifest, check it, run it on windows.

No TensorFlow here: the interpreter comes from LiteRT (``ai_edge_litert``) or
``tflite_runtime``, never by a silent fallback. :func:`load_model` checks everything before
use; any failure is :class:`ModelRejected` and the caller keeps the model it runs. A
:class:`LoadedModel` is not thread-safe (give each thread its own). Backends, XNNPACK vs
builtin kernels, occlusion and latencies: models/README.md, "Runtime and backends".
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Protocol, cast

import numpy as np
import numpy.typing as npt

from models.acquisition import Acquisition
from models.errors import BackendUnavailable, ModelRejected
from models.features import FEATURES_NAME, GROUPS, FeatureExtractor, FeatureSpec
from models.input_stats import InputStats
from models.kernels import (
    P_INV_STD,
    P_MEAN,
    P_RATIO,
    P_SCALARS,
    S_INV_SCALE,
    S_QHI,
    S_QLO,
    S_ZERO_POINT,
    Kernels,
    kernels,
    unavailable_reason,
)
from models.known_answers import KnownAnswers
from models.native_log import runtime_stderr_to_log

DEFAULT_MODEL_DIR: Final = Path(__file__).resolve().parent / "motor_drive"
MANIFEST_NAME: Final = "manifest.json"
MAX_MODEL_BYTES: Final = 16 * 1024 * 1024
MAX_MANIFEST_BYTES: Final = 1024 * 1024
BACKENDS: Final[Mapping[str, str]] = MappingProxyType(
    {"ai_edge_litert": "ai_edge_litert.interpreter", "tflite_runtime": "tflite_runtime.interpreter"}
)
BACKEND_ENV: Final = "EDGEFLEET_TFLITE_BACKEND"
NORMAL_LABEL: Final = "normal"

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_SEMVER_RE = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:[-+][0-9A-Za-z.+-]+)?")
_KNOWN_KEYS = frozenset(
    {
        "name",
        "version",
        "file",
        "sha256",
        "size_bytes",
        "signals",
        "window",
        "rate_hz",
        "features",
        "normalization",
        "input",
        "output",
        "labels",
        "thresholds",
        "decision",
        "seeds",
        "training",
        "metrics",
        "latency_us",
        "description",
        "known_answers",
    }
)

FloatArray = npt.NDArray[np.float32]
Int8Array = npt.NDArray[np.int8]


# -- manifest --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape, dtype and affine quantization (``real = scale * (q - zero_point)``)."""

    shape: tuple[int, ...]
    dtype: str
    scale: float
    zero_point: int


@dataclass(frozen=True, slots=True, eq=False)
class ModelManifest:
    """``manifest.json`` of a model directory, parsed and validated.

    Build it with :meth:`from_json` (raises :class:`ModelRejected` naming the key and value).
    ``thresholds`` maps each anomaly label to the probability at or above which it alarms;
    ``metrics``, ``training``, ``seeds`` and ``latency_us`` are informational and kept as
    read (the model card's numbers), except two entries of ``training`` the agent acts on,
    parsed and checked when present: ``acquisition`` (the input contract,
    :mod:`models.contract`) and ``input_stats`` (the training distribution the reasoning
    stage compares live inputs with, :mod:`models.input_stats`); None when absent.
    """

    name: str
    version: str
    file: str
    sha256: str
    size_bytes: int
    signals: tuple[str, ...]
    window: int
    rate_hz: float
    features: FeatureSpec
    mean: Mapping[str, float]
    std: Mapping[str, float]
    input: TensorSpec
    output: TensorSpec
    labels: tuple[str, ...]
    thresholds: Mapping[str, float]
    metrics: Mapping[str, Any]
    training: Mapping[str, Any]
    seeds: Mapping[str, Any]
    latency_us: Mapping[str, Any]
    acquisition: Acquisition | None = None
    input_stats: InputStats | None = None
    #: Golden windows and their exact int8 outputs (:mod:`models.known_answers`); None for
    #: a manifest without them (the self-test then reports ``absent``).
    known_answers: KnownAnswers | None = None

    @classmethod
    def from_json(cls, data: object, *, source: str = MANIFEST_NAME) -> ModelManifest:
        return _parse_manifest(data, source)

    @classmethod
    def load(cls, path: Path) -> ModelManifest:
        """Read and validate ``path`` (a ``manifest.json``). Raises ``ModelRejected``."""
        raw = _read_capped(path, MAX_MANIFEST_BYTES, what="manifest")
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelRejected(f"not valid JSON: {exc}", path=str(path)) from None
        return _parse_manifest(data, str(path))

    @property
    def anomaly_labels(self) -> tuple[str, ...]:
        return tuple(label for label in self.labels if label != NORMAL_LABEL)


class _Fields:
    """Typed access to a JSON object; every error names ``source`` and the key path."""

    def __init__(self, data: object, source: str, prefix: str = "") -> None:
        self.source = source
        self.prefix = prefix
        if not isinstance(data, dict):
            raise self.error(prefix or "(top level)", data, "a JSON object")
        self.data: dict[str, object] = data

    def error(self, key: str, value: object, expected: str) -> ModelRejected:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return ModelRejected(f"{key}: expected {expected}; got {shown}", path=self.source)

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def get(self, key: str) -> object:
        if key not in self.data:
            raise ModelRejected(f"{self.path(key)}: missing key", path=self.source)
        return self.data[key]

    def obj(self, key: str) -> _Fields:
        return _Fields(self.get(key), self.source, self.path(key))

    def str_(self, key: str, pattern: re.Pattern[str] | None = None, expected: str = "") -> str:
        value = self.get(key)
        if not isinstance(value, str) or not value:
            raise self.error(self.path(key), value, "a non-empty string")
        if pattern is not None and not pattern.fullmatch(value):
            raise self.error(self.path(key), value, expected)
        return value

    def int_(self, key: str, minimum: int = 0) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(self.path(key), value, f"an integer >= {minimum}")
        return value

    def number(self, key: str, *, positive: bool = False) -> float:
        return self.number_value(self.path(key), self.get(key), positive=positive)

    def number_value(self, where: str, value: object, *, positive: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(where, value, "a number")
        number = float(value)
        if not math.isfinite(number) or (positive and number <= 0):
            raise self.error(where, value, "a positive finite number" if positive else "finite")
        return number

    def str_list(self, key: str) -> tuple[str, ...]:
        value = self.get(key)
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(v, str) and v for v in value)
        ):
            raise self.error(self.path(key), value, "a non-empty list of strings")
        if len(set(value)) != len(value):
            raise self.error(self.path(key), value, "names without duplicates")
        return tuple(cast(list[str], value))

    def per_signal(self, key: str, signals: Sequence[str], *, positive: bool) -> dict[str, float]:
        sub = self.obj(key)
        if set(sub.data) != set(signals):
            raise sub.error(sub.prefix, sorted(sub.data), f"exactly the keys {list(signals)}")
        return {s: sub.number(s, positive=positive) for s in signals}

    def number_list(self, key: str, length: int, *, positive: bool) -> list[float]:
        value = self.get(key)
        if not isinstance(value, list) or len(value) != length:
            raise self.error(self.path(key), value, f"a list of {length} numbers")
        return [
            self.number_value(f"{self.path(key)}[{i}]", v, positive=positive)
            for i, v in enumerate(value)
        ]

    def info(self, key: str) -> Mapping[str, Any]:
        if key not in self.data:
            return MappingProxyType({})
        return MappingProxyType(self.obj(key).data)


def _tensor_spec(fields: _Fields, key: str) -> TensorSpec:
    sub = fields.obj(key)
    shape_value = sub.get("shape")
    if (
        not isinstance(shape_value, list)
        or not shape_value
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape_value)
    ):
        raise sub.error(sub.path("shape"), shape_value, "a list of positive integers")
    dtype = sub.str_("dtype")
    if dtype != "int8":
        raise sub.error(sub.path("dtype"), dtype, "'int8' (a fully integer-quantized model)")
    zero_point = sub.get("zero_point")
    if isinstance(zero_point, bool) or not isinstance(zero_point, int):
        raise sub.error(sub.path("zero_point"), zero_point, "an integer in [-128, 127]")
    if not -128 <= zero_point <= 127:
        raise sub.error(sub.path("zero_point"), zero_point, "an integer in [-128, 127]")
    return TensorSpec(
        shape=tuple(cast(list[int], shape_value)),
        dtype=dtype,
        scale=sub.number("scale", positive=True),
        zero_point=zero_point,
    )


def _parse_manifest(data: object, source: str) -> ModelManifest:  # noqa: PLR0915 - loading a model: each manifest key checked where it is read
    top = _Fields(data, source)
    unknown = sorted(set(top.data) - _KNOWN_KEYS)
    if unknown:
        raise top.error(unknown[0], top.data[unknown[0]], f"one of the keys {sorted(_KNOWN_KEYS)}")
    name = top.str_("name")
    version = top.str_("version", _SEMVER_RE, "a semantic version like '1.0.0'")
    file = top.data.get("file", "model.tflite")
    if not isinstance(file, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+\.tflite", file):
        raise top.error("file", file, "a plain file name ending in .tflite")
    sha256 = top.str_("sha256", _SHA256_RE, "64 lowercase hex digits")
    size_bytes = top.int_("size_bytes", minimum=1)
    if size_bytes > MAX_MODEL_BYTES:
        raise top.error("size_bytes", size_bytes, f"at most {MAX_MODEL_BYTES} bytes")
    signals = top.str_list("signals")
    window = top.int_("window", minimum=2)
    rate_hz = top.number("rate_hz", positive=True)

    normalization = top.obj("normalization")
    mean = normalization.per_signal("mean", signals, positive=False)
    std = normalization.per_signal("std", signals, positive=True)
    feats = top.obj("features")
    feature_name = feats.str_("name")
    if feature_name != FEATURES_NAME:
        raise feats.error(feats.path("name"), feature_name, f"{FEATURES_NAME!r} (this runtime)")
    channels = feats.int_("channels", minimum=1)
    if channels != GROUPS * len(signals):
        raise feats.error(feats.path("channels"), channels, f"{GROUPS} x {len(signals)} signals")
    diff_scale = feats.number_list("diff_scale", len(signals), positive=True)
    clip = feats.number("clip", positive=True)
    spec = FeatureSpec.from_lists(
        [mean[s] for s in signals], [std[s] for s in signals], diff_scale, clip
    )

    labels = top.str_list("labels")
    if NORMAL_LABEL not in labels:
        raise top.error("labels", list(labels), f"a list that includes {NORMAL_LABEL!r}")
    th = top.obj("thresholds")
    wanted = [label for label in labels if label != NORMAL_LABEL]
    if set(th.data) != set(wanted):
        raise th.error("thresholds", sorted(th.data), f"exactly the keys {wanted}")
    thresholds: dict[str, float] = {}
    for label in wanted:
        value = th.number(label)
        if not 0.0 < value <= 1.0:
            raise th.error(th.path(label), value, "a probability in (0, 1]")
        thresholds[label] = value

    input_spec = _tensor_spec(top, "input")
    expected_in = (1, window, channels)
    if input_spec.shape != expected_in:
        raise top.error("input.shape", list(input_spec.shape), f"{list(expected_in)}")
    output_spec = _tensor_spec(top, "output")
    expected_out = (1, len(labels))
    if output_spec.shape != expected_out:
        raise top.error("output.shape", list(output_spec.shape), f"{list(expected_out)}")

    training = top.info("training")
    try:
        acquisition = (
            Acquisition.from_description(training["acquisition"])
            if "acquisition" in training
            else None
        )
        stats = (
            InputStats.from_description(training["input_stats"], signals)
            if "input_stats" in training
            else None
        )
        known = (
            KnownAnswers.from_description(
                top.data["known_answers"],
                window=window,
                signals=len(signals),
                labels=len(labels),
            )
            if "known_answers" in top.data
            else None
        )
    except ValueError as exc:
        raise ModelRejected(str(exc), path=source) from None
    return ModelManifest(
        name=name,
        version=version,
        file=file,
        sha256=sha256,
        size_bytes=size_bytes,
        signals=signals,
        window=window,
        rate_hz=rate_hz,
        features=spec,
        mean=MappingProxyType(mean),
        std=MappingProxyType(std),
        input=input_spec,
        output=output_spec,
        labels=labels,
        thresholds=MappingProxyType(thresholds),
        metrics=top.info("metrics"),
        training=training,
        seeds=top.info("seeds"),
        latency_us=top.info("latency_us"),
        acquisition=acquisition,
        input_stats=stats,
        known_answers=known,
    )


def _read_capped(path: Path, limit: int, *, what: str) -> bytes:
    """Read at most ``limit`` bytes, refusing larger files before reading them."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise ModelRejected(
                f"{what} file is {size} bytes, more than the {limit} allowed", path=str(path)
            )
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ModelRejected(
            f"cannot read {what} file: {exc.strerror or exc}", path=str(path)
        ) from None
    if len(data) > limit:  # grew between stat() and read()
        raise ModelRejected(f"{what} file is more than the {limit} bytes allowed", path=str(path))
    return data


# -- backends --------------------------------------------------------------------------------


class _Interpreter(Protocol):
    """The part of ``tf.lite.Interpreter`` we use; both backends provide it."""

    def allocate_tensors(self) -> None: ...
    def resize_tensor_input(self, input_index: int, tensor_size: Sequence[int]) -> None: ...
    def get_input_details(self) -> list[dict[str, Any]]: ...
    def get_output_details(self) -> list[dict[str, Any]]: ...
    def set_tensor(self, tensor_index: int, value: npt.NDArray[Any]) -> None: ...
    def invoke(self) -> None: ...
    def get_tensor(self, tensor_index: int) -> npt.NDArray[Any]: ...


def available_backends() -> tuple[str, ...]:
    """Backends importable here, in preference order."""
    found = []
    for name, module in BACKENDS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        found.append(name)
    return tuple(found)


def _interpreter_module(backend: str | None) -> tuple[str, Any]:
    requested = backend or os.environ.get(BACKEND_ENV) or None
    if requested is not None and requested not in BACKENDS:
        raise BackendUnavailable(
            f"unknown TFLite backend {requested!r}; expected one of {', '.join(BACKENDS)}"
        )
    candidates = [requested] if requested else list(BACKENDS)
    errors = []
    for name in candidates:
        try:
            module = importlib.import_module(BACKENDS[name])
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        return name, module
    how = f"requested by {'argument' if backend else BACKEND_ENV}" if requested else "none"
    raise BackendUnavailable(
        f"no TFLite interpreter ({how}); install ai-edge-litert or tflite-runtime: "
        + "; ".join(errors)
    )


# -- the loaded model ------------------------------------------------------------------------


def decide(probs: npt.NDArray[np.float32], thresholds: FloatArray, default: int) -> int:
    """Index of the alarmed label, or ``default`` (the normal label's index) when none alarms.

    ``thresholds[i]`` is the alarm threshold of label ``i`` (``inf`` for the normal label):
    among labels whose probability reaches its threshold, the most probable wins.
    """
    hit = probs >= thresholds
    if not hit.any():
        return default
    return int(np.argmax(np.where(hit, probs, -1.0)))


class LoadedModel:
    """A checked model ready to run. Made by :func:`load_model` only.

    ``predict(values)`` is ``dequantize(invoke_int8(quantize(features(values))))`` done on
    buffers allocated once; it returns the label probabilities in ``manifest.labels`` order.
    Making one raises ``BackendUnavailable`` when the asked-for backend cannot run here.
    """

    __slots__ = (
        "_dequant_lut",
        "_extract",
        "_in_index",
        "_in_inv_scale",
        "_in_shape",
        "_in_zp",
        "_interp",
        "_kernels",
        "_kparams",
        "_last",
        "_normal_index",
        "_occ",
        "_occ_diag",
        "_occ_in",
        "_occ_out",
        "_occ_q",
        "_occ_q4",
        "_occluded",
        "_out_index",
        "_out_scale",
        "_out_zp",
        "_q",
        "_q3",
        "_qf",
        "_qhi",
        "_qlo",
        "_ref_q3",
        "_ref_t",
        "_threshold_array",
        "_window_shape",
        "backend",
        "delegated",
        "jit",
        "manifest",
        "occlusion_batched",
        "path",
        "selftest",
        "sha256",
        "threads",
    )

    def __init__(  # noqa: PLR0915 - one occlusion batch on the hot path
        self,
        *,
        manifest: ModelManifest,
        path: Path,
        backend: str,
        threads: int,
        interpreter: _Interpreter,
        delegated: bool,
        occluder: _Interpreter | None = None,
        jit: bool | None = None,
    ) -> None:
        self.manifest = manifest
        self.sha256 = manifest.sha256
        self.backend = backend
        self.path = path
        self.threads = threads
        self.delegated = delegated
        #: What the known-answer self-test found (:class:`models.selftest.SelfTest`), set
        #: by :func:`models.selftest.load_checked`; None when the model was not tested.
        self.selftest: Any = None
        self._interp = interpreter
        self._in_index = int(interpreter.get_input_details()[0]["index"])
        self._out_index = int(interpreter.get_output_details()[0]["index"])
        self._in_shape = manifest.input.shape
        self._window_shape = (manifest.window, len(manifest.signals))
        self._in_inv_scale = np.float32(1.0 / manifest.input.scale)
        self._in_zp = np.float32(manifest.input.zero_point)
        self._out_scale = np.float32(manifest.output.scale)
        self._out_zp = np.float32(manifest.output.zero_point)
        self._extract = FeatureExtractor(manifest.features, manifest.window)
        window, channels = self._in_shape[1:]
        groups = channels // len(manifest.signals)
        self._qf = np.empty((window, groups, len(manifest.signals)), dtype=np.float32)
        self._q = np.empty(self._in_shape, dtype=np.int8)
        self._q3 = self._q.reshape(window, groups, len(manifest.signals))
        # clip-then-quantize == quantize-then-clip to the quantized clip bounds (quantization
        # is monotonic), so predict() skips the float clip.
        clip = np.array([manifest.features.clip, -manifest.features.clip], dtype=np.float32)
        qhi, qlo = self._quantize(clip)
        self._qhi, self._qlo = np.float32(qhi), np.float32(qlo)
        # The compiled features-and-quantization (models.kernels), fed the same constants
        # as the numpy path; None: numpy. jit None follows EDGEFLEET_JIT.
        self._kernels = kernels() if jit is not False else None
        if jit and self._kernels is None:
            raise BackendUnavailable(
                f"compiled kernels required (jit=True) but unavailable: {unavailable_reason()}"
            )
        self.jit = self._kernels is not None
        kp = np.zeros((4, len(manifest.signals)), dtype=np.float32)
        kp[P_MEAN] = self._extract.mean
        kp[P_INV_STD] = self._extract.inv_std
        kp[P_RATIO] = self._extract.ratio
        kp[P_SCALARS, [S_INV_SCALE, S_ZERO_POINT, S_QLO, S_QHI]] = (
            self._in_inv_scale,
            self._in_zp,
            self._qlo,
            self._qhi,
        )
        self._kparams = kp
        # Indexed by the int8 value's bit pattern (q.view(uint8)).
        self._dequant_lut = self._dequantize(np.arange(256, dtype=np.uint8).view(np.int8))
        self._threshold_array = np.array(
            [manifest.thresholds.get(label, np.inf) for label in manifest.labels],
            dtype=np.float32,
        )
        self._normal_index = manifest.labels.index(NORMAL_LABEL)
        # predict_occluded(): the reference's int8 input, and the batch of one occluded
        # input per signal (signal occluded, step, group, signal) built from it and _q3.
        n = len(manifest.signals)
        self._last: object = None  # the values of the latest predict() (identity only)
        # Whether the occlusion batch holds the last predicted window's (keep_one_in).
        self._occluded = False
        self._ref_q3 = np.empty((window, groups, n), dtype=np.int8)
        self._occ_q = np.empty((n, window, channels), dtype=np.int8)
        self._occ_q4 = self._occ_q.reshape(n, window, groups, n)
        # The diagonal of _occ_q4 over its two signal axes as one writable view (n, step,
        # group), and the reference in that order: one strided copy puts each occluded
        # signal's channels in place (an indexed assignment costs several times more).
        b = self._occ_q4.strides
        self._occ_diag = np.lib.stride_tricks.as_strided(
            self._occ_q4, shape=(n, window, groups), strides=(b[0] + b[3], b[1], b[2])
        )
        self._ref_t = self._ref_q3.transpose(2, 0, 1)
        self._occ = occluder
        self.occlusion_batched = occluder is not None
        if occluder is not None:
            self._occ_in = int(occluder.get_input_details()[0]["index"])
            self._occ_out = int(occluder.get_output_details()[0]["index"])
        else:
            self._occ_in = self._occ_out = -1

    @property
    def labels(self) -> tuple[str, ...]:
        return self.manifest.labels

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"LoadedModel({m.name} {m.version}, sha256={self.sha256[:12]}, "
            f"backend={self.backend}, threads={self.threads})"
        )

    def _check_values(self, values: npt.NDArray[Any]) -> None:
        expected = (self.manifest.window, len(self.manifest.signals))
        if values.shape != expected:
            raise ValueError(f"expected a window of shape {expected}, got {values.shape}")

    def features(self, values: npt.NDArray[Any]) -> FloatArray:
        """The model's float input features of one ``(window, n_signals)`` window (a copy)."""
        self._check_values(values)
        return self._extract(values).copy()

    def quantize(self, features: npt.NDArray[Any]) -> Int8Array:
        """Features to the int8 input tensor: ``clip(rint(f * (1 / scale) + zero_point))``.

        Computed in float32 exactly as :meth:`predict` does (round half to even, saturating
        at -128 and 127).
        Raises ``ValueError`` for features of the wrong shape.
        """
        f = np.asarray(features, dtype=np.float32)
        if f.size != self._q.size:
            raise ValueError(f"expected features of shape {self._in_shape[1:]}, got {f.shape}")
        return self._quantize(f).reshape(self._in_shape)

    def _quantize(self, f: FloatArray) -> Int8Array:
        q = np.rint(f * self._in_inv_scale + self._in_zp)
        np.clip(q, -128, 127, out=q)
        return cast(Int8Array, q.astype(np.int8))

    def invoke_int8(self, x: Int8Array) -> Int8Array:
        """The bare interpreter call on an int8 input of the input shape."""
        self._interp.set_tensor(self._in_index, x.reshape(self._in_shape))
        self._interp.invoke()
        return cast(Int8Array, self._interp.get_tensor(self._out_index))

    def dequantize(self, q: npt.NDArray[Any]) -> FloatArray:
        """Int8 output to probabilities: ``scale * (q - zero_point)``, flattened (a new array)."""
        if q.dtype == np.int8:
            # A 256-entry table made with the same float32 arithmetic: one take() per call.
            return self._dequant_lut.take(np.ravel(q).view(np.uint8))
        return self._dequantize(np.ravel(q))

    def _dequantize(self, q: npt.NDArray[Any]) -> FloatArray:
        out: FloatArray = np.subtract(q, self._out_zp, dtype=np.float32)
        np.multiply(out, self._out_scale, out=out)
        return out

    def predict(self, values: npt.NDArray[Any]) -> FloatArray:
        """Label probabilities ``(n_labels,)`` for one window ``(window, n_signals)``."""
        if values.shape != self._window_shape:
            self._check_values(values)
        self._features_into(values, self._q3)
        self._last = values
        self._occluded = False
        interp = self._interp
        interp.set_tensor(self._in_index, self._q)
        interp.invoke()
        # dequantize() without its checks: the output is int8 of shape (1, n_labels).
        return cast(
            FloatArray, self._dequant_lut.take(interp.get_tensor(self._out_index).view(np.uint8)[0])
        )

    def predict_int8(self, values: npt.NDArray[Any]) -> Int8Array:
        """The int8 output ``(n_labels,)`` of :meth:`predict` (same path, a copy): what the
        known-answer self-test compares (:mod:`models.selftest`)."""
        self.predict(values)
        return cast(Int8Array, self._interp.get_tensor(self._out_index)[0].copy())

    @property
    def kernels(self) -> str:
        """``xnnpack`` when the delegate took the graph, else ``builtin`` (int8 kernels)."""
        return "xnnpack" if self.delegated else "builtin"

    def input_int8(self, values: npt.NDArray[Any], k: Kernels | None = None) -> Int8Array:
        """The int8 input of one ``(window, n_signals)`` window, ``(window, groups, n)``, in
        buffers of its own: on the compiled ``k`` when given, else on the numpy path. Safe beside
        :meth:`predict` on another thread: what checks a kernel set before
        :meth:`use_kernels`."""
        v = np.ascontiguousarray(values, dtype=np.float32)
        self._check_values(v)
        q = np.empty_like(self._q3)
        if k is not None:
            k.features_int8(v, self._kparams, q)
        else:
            extract = FeatureExtractor(self.manifest.features, self.manifest.window)
            self._quantize_into(extract.groups(v), np.empty_like(self._qf), q)
        return q

    def use_kernels(self, k: Kernels) -> None:
        """Run on the compiled kernels ``k`` from the next call on (the agent loads them
        after it is ready: edge_agent.warm). Call it on the thread that predicts."""
        self._kernels = k
        self.jit = True

    def _features_into(self, values: npt.NDArray[Any], q: Int8Array) -> None:
        """``q`` = the int8 input of ``values``: compiled when it can be, else numpy."""
        k = self._kernels
        if k is not None and values.dtype == np.float32:
            k.features_int8(values, self._kparams, q)
        else:
            self._quantize_into(self._extract.groups(values), self._qf, q)

    def _quantize_into(self, features: FloatArray, qf: FloatArray, q: Int8Array) -> None:
        """``q = quantize(clip(features))`` through the float buffer ``qf`` (same shapes)."""
        np.multiply(features, self._in_inv_scale, out=qf)
        np.add(qf, self._in_zp, out=qf)
        # Clip to the quantized clip bounds, then round: the bounds are integers, so this
        # is round-then-clip exactly (rint is monotonic and keeps integers), and rint can
        # write the int8 input directly (exact: integers in [-128, 127]).
        np.maximum(qf, self._qlo, out=qf)  # two ufuncs: several times cheaper than np.clip
        np.minimum(qf, self._qhi, out=qf)
        np.rint(qf, out=q, casting="unsafe")

    def predict_occluded(
        self, values: npt.NDArray[Any], ref: npt.NDArray[Any], *, after_predict: bool = False
    ) -> FloatArray:
        """Probabilities ``(n_signals, n_labels)``: row ``i`` is :meth:`predict` of ``values``
        with its column ``i`` replaced by column ``i`` of ``ref`` (occlusion attribution).

        Every feature channel reads one signal's column, so each occluded input is the int8
        input of ``values`` with one signal's channels taken from that of ``ref``: features
        of two windows instead of ``n_signals``, and one invoke of a second interpreter whose
        input holds ``n_signals`` windows instead of ``n_signals`` invokes (one by one when
        the model does not take that batch: :attr:`occlusion_batched` False). The rows equal
        the ``n_signals`` :meth:`predict` calls exactly (the test suite checks it).

        ``after_predict=True``: ``values`` is the very array of the latest :meth:`predict`
        call, unchanged since, and its int8 input is reused instead of computed again (the
        reasoning stage's alarm path). Another array raises ``ValueError``.
        """
        if after_predict:
            if values is not self._last:
                raise ValueError("after_predict: values is not the window of the last predict()")
        else:
            self._check_values(values)
            self._features_into(values, self._q3)
            self._last = values
        if ref.shape != self._window_shape:
            self._check_values(ref)
        self._features_into(ref, self._ref_q3)
        return self._occluded_int8(self._ref_t)

    def level_occlusion(self, noise: npt.NDArray[Any], base: npt.NDArray[Any]) -> LevelOcclusion:
        """Occlusion by ``level + noise`` columns, the reasoning stage's alarm path: see
        :class:`LevelOcclusion`. ``base`` is the per-signal level computed exactly."""
        return LevelOcclusion(self, noise, base)

    def _occluded_int8(self, ref_t: Int8Array) -> FloatArray:
        """Rows of :meth:`predict_occluded` for the last predicted window and a reference
        given as int8 features in ``(signal, step, group)`` order."""
        np.copyto(self._occ_q4, self._q3)
        np.copyto(self._occ_diag, ref_t)
        return self._run_occluded()

    def keep_one_in(self) -> FloatArray:
        """The converse of the last occlusion: row ``i`` is the probabilities with *every*
        signal replaced by its reference except signal ``i``, which keeps its own channels.

        Call it right after an occlusion of the last predicted window (it reuses the
        references that run put in place, and overwrites its batch). Where occlusion asks
        "does the score fall without this signal?", this asks "does this signal alone
        carry it?": the question that still has an answer when the cause is joint (several
        signals stuck at once, where replacing any one of them leaves a stuck window).
        Raises ``ValueError`` when no occlusion of the last predicted window was run.
        """
        if not self._occluded:
            raise ValueError("keep_one_in() needs an occlusion of the last predicted window")
        ref_t = self._occ_diag.copy()  # (signal, step, group): each signal's reference
        np.copyto(self._occ_q4, ref_t.transpose(1, 2, 0))  # every row: all references
        np.copyto(self._occ_diag, self._q3.transpose(2, 0, 1))  # row i keeps signal i
        rows = self._run_occluded()
        self._occluded = False  # the batch no longer holds the references
        return rows

    def _run_occluded(self) -> FloatArray:
        """The probabilities of the batch of occluded inputs already in place."""
        self._occluded = True
        occ = self._occ
        if occ is not None:
            occ.set_tensor(self._occ_in, self._occ_q)
            occ.invoke()
            out = occ.get_tensor(self._occ_out)
        else:
            out = self._invoke_one_by_one(self._occ_q)
        return self._dequant_lut.take(out.view(np.uint8))

    def _invoke_one_by_one(self, batch: Int8Array) -> Int8Array:
        """The int8 outputs ``(len(batch), n_labels)`` of the batch-1 interpreter, row by row."""
        out = np.empty((len(batch), len(self.manifest.labels)), dtype=np.int8)
        interp = self._interp
        for i in range(len(batch)):
            interp.set_tensor(self._in_index, batch[i : i + 1])
            interp.invoke()
            out[i] = interp.get_tensor(self._out_index)[0]
        return out

    def decide(self, probs: npt.NDArray[np.float32]) -> str:
        """The label ``probs`` alarms with under the manifest's thresholds, else ``normal``.

        Among anomaly labels whose probability reaches its threshold, the most probable
        one; ``normal`` when none does.
        """
        return self.manifest.labels[decide(probs, self._threshold_array, self._normal_index)]

    @property
    def threshold_array(self) -> FloatArray:
        """Per-label thresholds in label order (``inf`` for ``normal``), for :func:`decide`."""
        return self._threshold_array.copy()


class LevelOcclusion:
    """Occlusion with each signal in turn replaced by ``level + noise``, in one batched run.

    ``noise`` is a fixed ``(window, n_signals)`` pattern of normal step noise; ``level`` a
    per-signal value. Both methods return what :meth:`LoadedModel.predict_occluded` returns
    and must be called right after :meth:`LoadedModel.predict` of ``values`` (they reuse its
    int8 input; another array raises ``ValueError``, as do ``noise`` and ``base`` of shapes
    other than the model's window and signals).

    * :meth:`at_base`: the level is ``base``, fixed at construction. The reference's int8
      features are computed once, exactly: rows equal ``predict_occluded(values, base +
      noise)`` bit for bit.
    * :meth:`at`: any level, e.g. the window's own median. A feature channel either reads the
      standardized value (the level channel) or a step between two samples (the step
      channels: difference, "unchanged"). The steps of ``level + noise`` are the steps of
      ``noise`` whatever the level, so they are taken from ``base + noise``, and only the
      level channel is computed per call, with the standardization and the int8 scale
      folded into one multiply-add. Why: the alarm path is rare and runs cold, and this
      is five numpy calls where computing the reference's features and quantizing them
      took eighteen. The price: float32 rounds ``level + noise`` differently from ``base +
      noise``, so on some windows a few reference cells differ by one int8 step from
      ``predict_occluded(values, level + noise)`` (the test suite bounds it).
    """

    __slots__ = (
        "_base_q3",
        "_base_t",
        "_bounds",
        "_c",
        "_gain",
        "_median",
        "_model",
        "_qz",
        "_ref_t",
        "_ref_z",
        "_tmp",
    )

    def __init__(self, model: LoadedModel, noise: npt.NDArray[Any], base: npt.NDArray[Any]) -> None:
        shape = model._window_shape
        noise = np.asarray(noise, dtype=np.float32)
        base = np.asarray(base, dtype=np.float32)
        if noise.shape != shape or base.shape != shape[1:]:
            raise ValueError(
                f"expected noise of shape {shape} and base of shape {shape[1:]}, "
                f"got {noise.shape} and {base.shape}"
            )
        self._model = model
        window, groups, n = model._q3.shape
        base_q3 = np.empty((window, groups, n), dtype=np.int8)
        model._quantize_into(model._extract.groups(base + noise), model._qf, base_q3)
        self._base_q3 = base_q3
        self._base_t = base_q3.transpose(2, 0, 1)
        # at()'s reference: the base's step channels, its level channel rewritten per call.
        ref_q3 = base_q3.copy()
        self._ref_t = ref_q3.transpose(2, 0, 1)
        self._ref_z = ref_q3[:, 0, :]
        # The level channel in int8 units before rounding and clipping:
        # ((level + noise) - mean) / std / scale + zero_point == level * gain + c.
        spec = model.manifest.features
        self._gain = (np.float32(1.0) / spec.std).astype(np.float32) * model._in_inv_scale
        mean = spec.mean.astype(np.float32)
        self._c = ((noise - mean) * self._gain + model._in_zp).astype(np.float32)
        self._tmp = np.empty(n, dtype=np.float32)
        self._qz = np.empty((window, n), dtype=np.float32)
        self._bounds = np.array([model._qlo, model._qhi], dtype=np.float32)
        self._median = ColumnMedian(window, n)

    def _check(self, values: npt.NDArray[Any]) -> LoadedModel:
        model = self._model
        if values is not model._last:
            raise ValueError("values is not the window of the model's last predict()")
        return model

    def at_base(self, values: npt.NDArray[Any]) -> FloatArray:
        """Rows of ``predict_occluded(values, base + noise)``, exactly."""
        return self._check(values)._occluded_int8(self._base_t)

    def at(self, values: npt.NDArray[Any], level: npt.NDArray[Any]) -> FloatArray:
        """Rows with signal ``i`` replaced by ``level[i] + noise[:, i]`` (see the class)."""
        model = self._check(values)
        qz = self._qz
        np.multiply(level, self._gain, out=self._tmp)
        np.add(self._c, self._tmp, out=qz)
        np.maximum(qz, model._qlo, out=qz)
        np.minimum(qz, model._qhi, out=qz)
        np.rint(qz, out=self._ref_z, casting="unsafe")
        return model._occluded_int8(self._ref_t)

    def at_median(self, values: npt.NDArray[Any], x: npt.NDArray[Any]) -> FloatArray:
        """:meth:`at` with the level ``np.median(x, axis=0)``; ``x`` has no NaN (usually
        ``values`` itself). Median, level channel and the batch of occluded inputs are one
        compiled call when the model has the kernels (the same int8 cells, see
        :mod:`models.kernels`)."""
        model = self._check(values)
        k = model._kernels
        if k is None or x.dtype != np.float32:
            return self.at(values, self._median(x))
        k.occlusion_batch_int8(
            x, self._gain, self._c, self._bounds, model._q3, self._base_q3, model._occ_q4
        )
        return model._run_occluded()


class ColumnMedian:
    """``np.median(x, axis=0)`` for NaN-free float32 ``(rows, n)`` windows, bit for bit.

    One in-place partition of each column and the mean of the middle pair, as numpy's
    median does, into buffers made once: four numpy calls instead of numpy's
    general-purpose median (axis handling, NaN checks, temporaries: tens of µs). The
    occlusion path is rare, so its code and data are cold when it runs, and every call it
    makes costs several times its warm price. The result is a buffer the next call
    overwrites.
    """

    __slots__ = ("_cols", "_hi", "_kth", "_lo", "_mid")

    def __init__(self, rows: int, n: int) -> None:
        half = rows // 2
        self._cols = np.empty((n, rows), dtype=np.float32)
        self._kth = (half,) if rows % 2 else (half - 1, half)
        self._lo = self._cols[:, self._kth[0]]
        self._hi = self._cols[:, half]
        self._mid = np.empty(n, dtype=np.float32)

    def __call__(self, x: npt.NDArray[Any]) -> FloatArray:
        cols = self._cols
        np.copyto(cols, x.T)
        cols.partition(self._kth, axis=1)
        if len(self._kth) == 1:
            np.copyto(self._mid, self._hi)
            return self._mid
        mid = self._mid
        np.add(self._lo, self._hi, out=mid)
        np.multiply(mid, 0.5, out=mid)  # == / 2 exactly (a power of two)
        return mid


def _is_delegated(interpreter: _Interpreter) -> bool:
    """Whether a delegate (XNNPACK) took over nodes of the execution plan."""
    ops = getattr(interpreter, "_get_ops_details", None)
    if ops is None:
        return False
    try:
        details = ops()
    except (RuntimeError, ValueError):
        return False
    return any("DELEGATE" in str(op.get("op_name", "")).upper() for op in details)


def load_model(
    model_dir: Path | str | None = None,
    *,
    backend: str | None = None,
    threads: int = 1,
    xnnpack: bool = True,
    jit: bool | None = None,
) -> LoadedModel:
    """Load and check the model in ``model_dir`` (default: :data:`DEFAULT_MODEL_DIR`).

    ``jit``: features and quantization through the compiled kernels of
    :mod:`models.kernels` (identical int8 input, ~10 µs less per window): None (default)
    when numba is importable and ``EDGEFLEET_JIT`` is not ``0``; False never; True or
    :class:`BackendUnavailable`. :attr:`LoadedModel.jit` says which path runs.

    ``xnnpack=False`` builds the interpreter without the default delegate: slower, but its
    builtin int8 kernels give bit-identical outputs on every backend and version we test,
    while XNNPACK rounds some intermediate requantizations differently (a few output
    steps on some windows; see the module docstring).

    Raises :class:`ModelRejected` when the manifest or the model file fails a check (see the
    module docstring) and :class:`BackendUnavailable` when no interpreter can be imported.
    Reading and hashing a few tens of KB is quick, but it is file I/O: an asyncio caller
    should run this in a thread.

    No TensorFlow here: the interpreter comes from LiteRT (``ai_edge_litert``) or
    ``tflite_runtime`` (the ``backend`` argument, else ``EDGEFLEET_TFLITE_BACKEND``, else LiteRT
    when importable; a backend asked for by name that cannot be imported raises
    :class:`BackendUnavailable`, never a silent fallback). :func:`load_model` checks the manifest
    (size cap, types and ranges, naming the key), the model file (size cap before reading, size
    and sha256), that the interpreter accepts those very bytes (for ``tflite_runtime``, which
    crashes on a malformed flatbuffer, first in a child process) and the tensors' shapes, dtypes
    and quantization; any failure is :class:`ModelRejected` and the caller keeps the model it
    runs. A :class:`LoadedModel` is not thread-safe (give each thread its own). Backends, XNNPACK
    vs builtin kernels, occlusion and latencies: models/README.md, "Runtime and backends".
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    directory = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
    backend_name, module = _interpreter_module(backend)
    manifest = ModelManifest.load(directory / MANIFEST_NAME)
    path = directory / manifest.file
    data = _read_capped(path, MAX_MODEL_BYTES, what="model")
    if len(data) != manifest.size_bytes:
        raise ModelRejected(
            f"model file has {len(data)} bytes, manifest size_bytes says {manifest.size_bytes}",
            path=str(path),
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != manifest.sha256:
        raise ModelRejected(
            f"sha256 {digest} differs from the manifest's {manifest.sha256}", path=str(path)
        )
    if backend_name in _UNVERIFIED_BACKENDS:
        _probe_in_child(backend_name, data, path)
    options: dict[str, Any] = {}
    if not xnnpack:
        options["experimental_op_resolver_type"] = (
            module.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
        )
    # The runtime announces its delegate on fd 2 as it builds: a DEBUG record instead.
    with runtime_stderr_to_log():
        try:
            interpreter = cast(
                _Interpreter,
                module.Interpreter(model_content=data, num_threads=threads, **options),
            )
            interpreter.allocate_tensors()
            inputs = interpreter.get_input_details()
            outputs = interpreter.get_output_details()
        except (ValueError, RuntimeError) as exc:
            raise ModelRejected(
                f"the {backend_name} interpreter refused it: {exc}", path=str(path)
            ) from None
        _check_io("input", inputs, manifest.input, path)
        _check_io("output", outputs, manifest.output, path)
        delegated = _is_delegated(interpreter)
        occluder = _occlusion_interpreter(
            module, data, threads=threads, options=options, manifest=manifest, delegated=delegated
        )
    return LoadedModel(
        manifest=manifest,
        path=path,
        backend=backend_name,
        threads=threads,
        interpreter=interpreter,
        delegated=delegated,
        occluder=occluder,
        jit=jit,
    )


def _occlusion_interpreter(
    module: Any,
    data: bytes,
    *,
    threads: int,
    options: Mapping[str, Any],
    manifest: ModelManifest,
    delegated: bool,
) -> _Interpreter | None:
    """A second interpreter of the same bytes taking one window per signal, or None.

    None when the model's input does not resize to that batch (a fixed batch dimension), or
    when the result is not delegated like the main interpreter: XNNPACK and the builtin
    kernels round differently, and occlusion compares its outputs with the main one's.
    """
    n = len(manifest.signals)
    try:
        interp = cast(
            _Interpreter, module.Interpreter(model_content=data, num_threads=threads, **options)
        )
        interp.resize_tensor_input(
            int(interp.get_input_details()[0]["index"]), [n, *manifest.input.shape[1:]]
        )
        interp.allocate_tensors()
        shape = tuple(int(v) for v in interp.get_output_details()[0]["shape"])
    except (ValueError, RuntimeError):
        return None
    if shape != (n, manifest.output.shape[1]) or _is_delegated(interp) != delegated:
        return None
    return interp


#: Backends whose interpreter does not verify the flatbuffer (a bad one crashes the process).
_UNVERIFIED_BACKENDS: Final = frozenset({"tflite_runtime"})
_PROBE_TIMEOUT_S: Final = 60.0
_PROBE_CODE: Final = (
    "import sys\n"
    "from {module} import Interpreter\n"
    "interpreter = Interpreter(model_content=sys.stdin.buffer.read())\n"
    "interpreter.allocate_tensors()\n"
    "interpreter.invoke()\n"
)


def _probe_in_child(backend: str, data: bytes, path: Path) -> None:
    """Load and invoke ``data`` once in a child process; a crash or error there rejects it."""
    code = _PROBE_CODE.format(module=BACKENDS[backend])
    try:
        result = subprocess.run(
            [sys.executable, "-c", code],
            input=data,
            capture_output=True,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ModelRejected(
            f"the {backend} probe process did not load it within {_PROBE_TIMEOUT_S:g} s",
            path=str(path),
        ) from None
    except OSError as exc:
        raise ModelRejected(
            f"cannot start the {backend} probe process: {exc.strerror or exc}", path=str(path)
        ) from None
    if result.returncode == 0:
        return
    if result.returncode < 0:
        reason = f"it crashed the interpreter (signal {-result.returncode})"
    else:
        lines = result.stderr.decode("utf-8", "replace").strip().splitlines()
        reason = lines[-1] if lines else f"exit status {result.returncode}"
    raise ModelRejected(
        f"the {backend} interpreter refused it in a probe process: {reason}", path=str(path)
    )


def _check_io(
    kind: str, details: Sequence[Mapping[str, Any]], spec: TensorSpec, path: Path
) -> None:
    if len(details) != 1:
        raise ModelRejected(f"model has {len(details)} {kind} tensors, expected 1", path=str(path))
    d = details[0]
    shape = tuple(int(v) for v in d["shape"])
    if shape != spec.shape:
        raise ModelRejected(
            f"model {kind} shape {list(shape)} differs from manifest {kind}.shape "
            f"{list(spec.shape)}",
            path=str(path),
        )
    dtype = np.dtype(d["dtype"]).name
    if dtype != spec.dtype:
        raise ModelRejected(
            f"model {kind} dtype {dtype} differs from manifest {kind}.dtype {spec.dtype}",
            path=str(path),
        )
    scale, zero_point = d["quantization"]
    if (
        not math.isclose(float(scale), spec.scale, rel_tol=1e-6)
        or int(zero_point) != spec.zero_point
    ):
        raise ModelRejected(
            f"model {kind} quantization (scale={float(scale)!r}, zero_point={int(zero_point)}) "
            f"differs from manifest {kind} (scale={spec.scale!r}, zero_point={spec.zero_point})",
            path=str(path),
        )


__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "DEFAULT_MODEL_DIR",
    "MAX_MANIFEST_BYTES",
    "MAX_MODEL_BYTES",
    "ColumnMedian",
    "LevelOcclusion",
    "LoadedModel",
    "ModelManifest",
    "TensorSpec",
    "available_backends",
    "decide",
    "load_model",
]
