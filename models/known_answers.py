"""Known answers: golden windows and the exact INT8 outputs a model must give for them.

A model can pass every structural check and still compute wrong numbers on a device (an
emulated CPU feature, a broken delegate), so every manifest carries a few golden windows and
the int8 outputs recorded per machine and kernel set, compared with tolerance 0 before a
model is served (:mod:`models.selftest`); a machine with no answers of its own must equal
some recorded machine's exactly. Pure. The manifest entry: :class:`KnownAnswers`.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

KEY: Final = "known_answers"
#: The kernel sets a model can run on: LiteRT's XNNPACK delegate, or the builtin int8
#: kernels (``load_model(xnnpack=False)``; all that ``tflite_runtime`` runs).
KERNELS: Final = ("xnnpack", "builtin")
DEFINITION: Final = (
    "golden input windows (float32, little-endian, base64; windows x window x signals in the "
    "manifest's signal order) and, per kernel set, the exact int8 output tensor the build "
    "machine's runtime gave for each through predict() (features, quantization, invoke); "
    "the agent serves the model only when every output is within tolerance"
)
#: How many golden windows the recorders write (16: ~0.5 ms of invokes, ~33 KB of JSON).
DEFAULT_WINDOWS: Final = 16
MAX_WINDOWS: Final = 256

FloatArray = npt.NDArray[np.float32]
Int8Array = npt.NDArray[np.int8]
_MACHINE_RE = re.compile(r"[A-Za-z0-9_.-]{1,32}")


def _int8_rows(rows: object, n: int, labels: int) -> bool:
    return (
        isinstance(rows, list)
        and len(rows) == n
        and all(
            isinstance(r, list)
            and len(r) == labels
            and all(isinstance(v, int) and not isinstance(v, bool) and -128 <= v <= 127 for v in r)
            for r in rows
        )
    )


@dataclass(frozen=True, slots=True, eq=False)
class KnownAnswers:
    """Golden ``inputs`` ``(n, window, signals)`` and per machine (``platform.machine()``)
    and kernel set the int8 outputs ``(n, labels)``; an output passes when
    ``|actual - expected| <= tolerance``.

    A model can pass every structural check and still compute wrong numbers on a device (an
    emulated CPU feature, a broken delegate or driver), raising or missing alarms with full
    confidence; so every manifest carries a few golden input windows and the int8 outputs
    recorded per machine and kernel set (both change the arithmetic legitimately), compared with
    tolerance 0 before a model is served (:mod:`models.selftest`). A machine with no answers of
    its own passes only if its outputs equal some recorded machine's exactly (fail closed).
    Pure: parsing, describing and comparing. The measurements behind "per machine and kernel
    set": models/README.md, "Runtime and backends". The manifest entry::

    The manifest entry::

        "known_answers": {
          "definition": "...",
          "inputs_float32_le_b64": "<base64 of n x window x signals float32, little-endian>",
          "windows": 16,
          "tolerance": 0,
          "outputs": {"x86_64": {"xnnpack": [[int8 x labels] x n], "builtin": [...]},
                      "aarch64": {...}},
          "recorded_with": {"x86_64": {...}, ...}      # informational: where, with what
        }
    """

    inputs: FloatArray
    expected: Mapping[str, Mapping[str, Int8Array]]
    tolerance: int = 0
    recorded_with: Mapping[str, Any] = field(default_factory=dict)

    @property
    def windows(self) -> int:
        return int(self.inputs.shape[0])

    @classmethod
    def from_description(
        cls, data: object, *, window: int, signals: int, labels: int, where: str = KEY
    ) -> KnownAnswers:
        """Parse the manifest's ``known_answers``; ValueError names the key and the value."""
        if not isinstance(data, dict):
            raise ValueError(  # noqa: TRY004 - the manifest parser's one error type
                f"{where}: expected an object, got {type(data).__name__}"
            )
        raw = data.get("inputs_float32_le_b64")
        if not isinstance(raw, str):
            raise ValueError(  # noqa: TRY004 - the manifest parser's one error type
                f"{where}.inputs_float32_le_b64: expected a base64 string"
            )
        try:
            blob = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}.inputs_float32_le_b64: not valid base64") from None
        n = data.get("windows")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_WINDOWS:
            raise ValueError(f"{where}.windows: {n!r}; expected an integer in 1..{MAX_WINDOWS}")
        want = n * window * signals * 4
        if len(blob) != want:
            raise ValueError(
                f"{where}.inputs_float32_le_b64: {len(blob)} bytes; {n} windows of "
                f"{window} x {signals} float32 are {want}"
            )
        inputs = np.frombuffer(blob, dtype="<f4").astype(np.float32).reshape(n, window, signals)
        tol = data.get("tolerance", 0)
        if isinstance(tol, bool) or not isinstance(tol, int) or not 0 <= tol <= 255:
            raise ValueError(f"{where}.tolerance: {tol!r}; expected an integer in 0..255")
        outs = data.get("outputs")
        if not isinstance(outs, dict) or not outs:
            raise ValueError(f"{where}.outputs: expected an object keyed by machine")
        expected: dict[str, dict[str, Int8Array]] = {}
        for machine, sets in outs.items():
            if not _MACHINE_RE.fullmatch(machine) or not isinstance(sets, dict) or not sets:
                raise ValueError(
                    f"{where}.outputs.{machine}: expected a machine name (like x86_64) "
                    f"holding an object keyed by {list(KERNELS)}"
                )
            expected[machine] = {}
            for kernels, rows in sets.items():
                at = f"{where}.outputs.{machine}.{kernels}"
                if kernels not in KERNELS:
                    raise ValueError(f"{at}: unknown kernel set; expected one of {list(KERNELS)}")
                if not _int8_rows(rows, n, labels):
                    raise ValueError(f"{at}: expected {n} lists of {labels} int8 values")
                expected[machine][kernels] = np.array(rows, dtype=np.int8)
        info = data.get("recorded_with", {})
        return cls(
            inputs=inputs,
            expected=expected,
            tolerance=tol,
            recorded_with=dict(info) if isinstance(info, dict) else {},
        )

    def describe(self) -> dict[str, Any]:
        """The manifest entry (inverse of :meth:`from_description`)."""
        blob = np.ascontiguousarray(self.inputs, dtype="<f4").tobytes()
        return {
            "definition": DEFINITION,
            "windows": self.windows,
            "inputs_float32_le_b64": base64.b64encode(blob).decode("ascii"),
            "tolerance": self.tolerance,
            "outputs": {
                m: {k: v.astype(int).tolist() for k, v in sets.items()}
                for m, sets in self.expected.items()
            },
            "recorded_with": dict(self.recorded_with),
        }


@dataclass(frozen=True, slots=True)
class WindowCheck:
    """One golden window: what it should give, what it gave, by how much they differ."""

    index: int
    expected: tuple[int, ...]
    actual: tuple[int, ...]
    diff: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """The known answers on one kernel set."""

    kernels: str
    tolerance: int
    checks: tuple[WindowCheck, ...]
    #: Whose answers were compared: this machine's, or (none recorded for it) the closest
    #: recorded machine's; ``note`` says so.
    machine: str = ""
    note: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.diff <= self.tolerance for c in self.checks)

    @property
    def max_diff(self) -> int:
        return max((c.diff for c in self.checks), default=0)

    @property
    def failed(self) -> tuple[WindowCheck, ...]:
        return tuple(c for c in self.checks if c.diff > self.tolerance)

    def reason(self) -> str:
        """One line: passed, or how many windows differ and the first one."""
        note = f" ({self.note})" if self.note else ""
        if self.passed:
            return f"{self.kernels}: {len(self.checks)} golden windows exact{note}"
        bad = self.failed
        if not bad:
            return f"{self.kernels}: no golden windows{note}"
        first = bad[0]
        return (
            f"{self.kernels}: {len(bad)} of {len(self.checks)} golden windows differ "
            f"(max {self.max_diff}/256 > tolerance {self.tolerance}); window {first.index} "
            f"gave {list(first.actual)}, expected {list(first.expected)}{note}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kernels": self.kernels,
            "machine": self.machine,
            "note": self.note,
            "passed": self.passed,
            "tolerance": self.tolerance,
            "max_diff": self.max_diff,
            "windows": [
                {"index": c.index, "expected": list(c.expected), "actual": list(c.actual)}
                for c in self.checks
            ],
        }


def compare(answers: KnownAnswers, kernels: str, actual: npt.NDArray[Any], machine: str) -> Verdict:
    """Compare ``actual`` ``(n, labels)`` int8 outputs of ``kernels`` on ``machine`` with
    that machine's recorded ones. A machine with none recorded is compared with every
    recorded machine's (same kernels) and reported against the closest: it passes only
    on an exact match. A kernel set without answers fails every window."""
    out = np.asarray(actual, dtype=np.int16)
    if machine in answers.expected:
        return _against(answers, kernels, out, machine, "")
    others = sorted(answers.expected)
    note = f"no answers recorded for {machine}; compared with {', '.join(others)}"
    verdicts = [_against(answers, kernels, out, m, note) for m in others]
    return min(verdicts, key=lambda v: (len(v.failed), v.max_diff))


def _against(
    answers: KnownAnswers, kernels: str, out: npt.NDArray[np.int16], machine: str, note: str
) -> Verdict:
    expected = answers.expected[machine].get(kernels)
    if expected is None:
        note = "; ".join(filter(None, [note, f"no {kernels} answers recorded for {machine}"]))
    checks = []
    for i in range(answers.windows):
        got = tuple(int(v) for v in out[i])
        if expected is None:
            checks.append(WindowCheck(i, (), got, 256))
            continue
        want = expected[i].astype(np.int16)
        diff = int(np.abs(out[i] - want).max()) if out[i].shape == want.shape else 256
        checks.append(WindowCheck(i, tuple(int(v) for v in want), got, diff))
    return Verdict(kernels, answers.tolerance, tuple(checks), machine, note)


__all__ = [
    "DEFAULT_WINDOWS",
    "DEFINITION",
    "KERNELS",
    "KEY",
    "KnownAnswers",
    "Verdict",
    "WindowCheck",
    "compare",
]
