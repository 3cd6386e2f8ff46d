"""Compiled kernels (numba) for the two numpy-heavy steps around ``invoke()``.

The reasoning stage's budget is ~100 µs per window, and ``invoke()`` of the INT8 model takes
~4 µs: the rest is Python and numpy. Each numpy call costs ~1 µs on a window this small
(64 x 6) whatever it computes, and features plus quantization take thirteen of them; the
alarm path's occlusion reference took nine more, cold. One compiled loop does each step in
one call. The numpy code in :mod:`models.features` and :mod:`models.runtime` stays the
reference and the fallback: the kernels repeat its float32 operations in the same order
(no fused multiply-add: numba's default keeps each rounding), so the int8 results are the
same bit for bit, which the test suite checks on both paths.
"""

from __future__ import annotations

import logging
import os
import threading
import types
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from models.errors import KernelsStopped

JIT_ENV: Final = "EDGEFLEET_JIT"

log = logging.getLogger(__name__)

FeaturesKernel = Callable[[npt.NDArray[np.float32], npt.NDArray[np.float32], Any], None]
OcclusionKernel = Callable[
    [
        npt.NDArray[np.float32],
        npt.NDArray[np.float32],
        npt.NDArray[np.float32],
        npt.NDArray[np.float32],
        Any,
        Any,
        Any,
    ],
    None,
]

OutMaskKernel = Callable[
    [npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.float32]], int
]

#: Rows of the ``params`` array of :func:`features_int8`.
P_MEAN, P_INV_STD, P_RATIO, P_SCALARS = 0, 1, 2, 3
#: Columns of row ``P_SCALARS``: 1 / input scale, input zero point, int8 clip bounds.
S_INV_SCALE, S_ZERO_POINT, S_QLO, S_QHI = 0, 1, 2, 3


def features_int8(v: Any, p: Any, q: Any) -> None:
    """``q[t, g, i]``: int8 feature ``g`` (level, step, unchanged) of signal ``i`` at ``t``.

    ``v`` is ``(window, n)`` float32; ``p`` is ``(4, n)`` float32 (rows ``P_*``, scalars in
    row ``P_SCALARS``); ``q`` is ``(window, 3, n)`` int8. Plain Python here; :func:`kernels`
    compiles it.
    """
    rows, n = v.shape
    inv_scale = p[P_SCALARS, S_INV_SCALE]
    zp = p[P_SCALARS, S_ZERO_POINT]
    qlo = p[P_SCALARS, S_QLO]
    qhi = p[P_SCALARS, S_QHI]
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for i in range(n):
        mean = p[P_MEAN, i]
        inv_std = p[P_INV_STD, i]
        ratio = p[P_RATIO, i]
        before = zero
        for t in range(rows):
            z = (v[t, i] - mean) * inv_std
            if not np.isfinite(z):  # a never-seen signal (NaN) sits at its normal mean
                z = zero
            # np.maximum / np.minimum in the numpy path: NaN cannot reach here.
            q[t, 0, i] = np.int8(np.rint(min(max(z * inv_scale + zp, qlo), qhi)))
            if t == 0:
                step = zero
                same = zero
            else:
                step = np.arcsinh((z - before) * ratio)
                same = one if z == before else zero
            q[t, 1, i] = np.int8(np.rint(min(max(step * inv_scale + zp, qlo), qhi)))
            q[t, 2, i] = np.int8(np.rint(min(max(same * inv_scale + zp, qlo), qhi)))
            before = z


def _select(a: Any, k: int) -> Any:
    """The value of rank ``k`` in ``a`` (no NaN), partitioning ``a`` in place so that
    ``a[:k]`` holds the smaller values: Hoare's selection with a median-of-three pivot."""
    lo = 0
    hi = a.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        # Median of three as pivot: sorted a[lo] <= a[mid] <= a[hi].
        if a[mid] < a[lo]:
            a[mid], a[lo] = a[lo], a[mid]
        if a[hi] < a[lo]:
            a[hi], a[lo] = a[lo], a[hi]
        if a[hi] < a[mid]:
            a[hi], a[mid] = a[mid], a[hi]
        pivot = a[mid]
        i = lo
        j = hi
        while i <= j:
            while a[i] < pivot:
                i += 1
            while pivot < a[j]:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        # Now a[lo..j] <= pivot <= a[i..hi], and a[j+1..i-1] == pivot.
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:
            return a[k]
    return a[k]


def occlusion_batch_int8(  # noqa: PLR0917 - a numba kernel takes its arrays positionally
    x: Any, gain: Any, c: Any, bounds: Any, q: Any, base: Any, occ: Any
) -> None:
    """The batch of occluded int8 inputs for the ``median + noise`` reference.

    ``occ[j]`` is the window's int8 input ``q`` (``(window, 3, n)``) with signal ``j``'s
    channels replaced: its level channel by ``rint(clip(median(x[:, j]) * gain[j] +
    c[:, j]))``, its step channels by those of ``base`` (``(window, 3, n)``, the reference
    at the normal mean). ``x`` is ``(window, n)`` float32 without NaN; ``gain`` ``(n,)``;
    ``c`` ``(window, n)``; ``bounds`` = (qlo, qhi); ``occ`` ``(n, window, 3, n)`` int8.
    The median is numpy's: the middle value, or the mean of the middle pair computed as
    ``(lo + hi) * 0.5`` in float32. Plain Python here; :func:`kernels` compiles it.
    """
    rows, n = x.shape
    groups = q.shape[1]
    half = rows // 2
    col = np.empty(rows, dtype=np.float32)
    qlo = bounds[0]
    qhi = bounds[1]
    # Flat copies: numba's whole-array assignment goes through a generic strided iterator,
    # several times slower than this loop on contiguous memory.
    flat_q = q.reshape(-1)
    flat_occ = occ.reshape(n, -1)
    size = flat_q.size
    for j in range(n):
        for e in range(size):
            flat_occ[j, e] = flat_q[e]
        for t in range(rows):
            col[t] = x[t, j]
        # The order statistics numpy's median takes: the value of rank `half`, and for an
        # even count the largest value below it (rank half - 1). A full sort costs ~1 µs
        # per column here; a selection ~0.2.
        hi = _select(col, half)
        if rows % 2:
            med = hi
        else:
            lo = col[0]
            for t in range(1, half):  # after _select, ranks < half are in col[:half]
                lo = max(lo, col[t])
            med = (lo + hi) * np.float32(0.5)
        level = med * gain[j]
        for t in range(rows):
            occ[j, t, 0, j] = np.int8(np.rint(min(max(c[t, j] + level, qlo), qhi)))
            for g in range(1, groups):
                occ[j, t, g, j] = base[t, g, j]


def input_out_mask(v: Any, bounds: Any, stats: Any) -> int:
    """Bit ``i`` set: signal ``i`` of window ``v`` (``(window, n)`` float32) is outside its
    row of ``bounds`` (``(n, 7)`` float32, :meth:`models.input_stats.InputStats.bounds`)
    on any statistic; ``stats`` (``(n, 5)`` float32) receives the window's statistics.
    Exactly :func:`models.input_stats.out_of_training` (the test suite checks it): levels
    compared in float32, changes and shares computed in float64. Plain Python here;
    :func:`kernels` compiles it.
    """
    rows, n = v.shape
    mask = 0
    steps = rows - 1
    for i in range(n):
        lo = np.float32(np.inf)
        hi = np.float32(-np.inf)
        same = 0
        run = 0
        longest = 0
        changed = 0
        total = 0.0
        for t in range(rows):
            x = v[t, i]
            if np.isfinite(x):
                lo = min(lo, x)
                hi = max(hi, x)
            if t == 0:
                continue
            prev = v[t - 1, i]
            if x == prev:
                same += 1
                run += 1
                longest = max(longest, run)
            else:
                run = 0
                d = abs(np.float64(x) - np.float64(prev))
                if np.isfinite(d):
                    changed += 1
                    total += d
        share = same / steps if steps > 0 else np.nan
        step = total / changed if changed > 0 else 0.0
        finite = np.isfinite(lo)
        stats[i, 0] = lo if finite else np.nan
        stats[i, 1] = hi if finite else np.nan
        stats[i, 2] = share
        stats[i, 3] = longest
        stats[i, 4] = step
        if not finite:
            continue
        b = bounds[i]
        if (
            lo < b[0]
            or hi > b[1]
            or share < np.float64(b[2])
            or share > np.float64(b[3])
            or longest > np.float64(b[4])
            or step < np.float64(b[5])
            or step > np.float64(b[6])
        ):
            mask |= 1 << i
    return mask


class Kernels:
    """The compiled kernels (see the module docstring).

    * :func:`features_int8`: one window of float32 values to the model's int8 input, i.e.
      ``LoadedModel._quantize_into(FeatureExtractor.groups(values))``.
    * :func:`occlusion_batch_int8`: the alarm path's batch of occluded inputs for the ``median
      + noise`` reference, i.e. ``ColumnMedian``, then ``LevelOcclusion.at``'s multiply-add,
      clip and rounding of the level channel, then the two copies into the batch.
    * :func:`input_out_mask`: per window, which signals sit outside the training distribution
      (:func:`models.input_stats.out_of_training`, ~15 numpy calls in one).
    """

    __slots__ = ("features_int8", "input_out_mask", "occlusion_batch_int8")

    def __init__(
        self, features: FeaturesKernel, occlusion: OcclusionKernel, out_mask: OutMaskKernel
    ) -> None:
        self.features_int8 = features
        self.occlusion_batch_int8 = occlusion
        self.input_out_mask = out_mask


_lock = threading.Lock()
#: Empty until tried; then [(kernels or None, why they are unavailable)].
_compiled: list[tuple[Kernels | None, str]] = []


def jit_enabled() -> bool:
    """Whether the environment allows the kernels (``EDGEFLEET_JIT`` not ``0``)."""
    return os.environ.get(JIT_ENV, "1").strip().lower() not in {"0", "false", "no", "off"}


def kernels(stop: threading.Event | None = None) -> Kernels | None:
    """The compiled kernels, compiling them on the first call; None without numba or when
    ``EDGEFLEET_JIT=0``. Thread-safe; call it where a model is loaded, not per window.

    ``stop``: checked before each of the four compile steps; once set, raises
    :class:`models.errors.KernelsStopped` and records nothing (so a thread loading them can
    be ended within one step, ~1 s cold, where a process must not wait for the whole load).

    Compiled on first use (:func:`kernels`), ~0.5 s, then cached on disk next to this file
    where it is writable. ``EDGEFLEET_JIT=0`` in the environment, or numba not importable,
    leaves the numpy path. numba costs ~65 MB of resident memory once imported: a gateway
    short of memory can turn it off and pay ~10-30 µs more per window.
    """
    if not jit_enabled():
        return None
    with _lock:
        if not _compiled:
            _compiled.append(_compile(stop))
        return _compiled[0][0]


def pending() -> bool:
    """Whether :func:`kernels` would load them now (~0.7 s: numba and its disk cache):
    enabled, and not tried yet in this process."""
    return jit_enabled() and not _compiled


def unavailable_reason() -> str:
    """Why :func:`kernels` returns None ("" when it has not or it does not)."""
    if not jit_enabled():
        return f"{JIT_ENV}=0"
    return _compiled[0][1] if _compiled else ""


_SELECT_SIG: Final = "float32(float32[::1], intp)"
_FEATURES_SIG: Final = "void(float32[:, :], float32[:, ::1], int8[:, :, ::1])"
_OUT_MASK_SIG: Final = "int64(float32[:, :], float32[:, ::1], float32[:, ::1])"
_OCCLUSION_SIG: Final = (
    "void(float32[:, :], float32[::1], float32[:, ::1], float32[::1], int8[:, :, ::1], "
    "int8[:, :, ::1], int8[:, :, :, ::1])"
)


def _with_globals(fn: Any, **names: Any) -> Any:
    """``fn`` with some global names bound to other objects (numba resolves globals at
    compile time, so the compiled kernel calls the compiled helper)."""
    g = dict(fn.__globals__)
    g.update(names)
    out = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__qualname__ = fn.__qualname__
    out.__module__ = fn.__module__
    return out


def _step(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise KernelsStopped("the compiled kernels' load was stopped")


def _compile(stop: threading.Event | None) -> tuple[Kernels | None, str]:
    _step(stop)
    try:
        import numba  # noqa: PLC0415 - ~65 MB and forbidden under MDWE: only when asked
    except ImportError:
        why = "numba is not installed"
        log.info("%s: features and quantization run on numpy", why)
        return None, why
    except OSError as exc:
        # llvmlite checks at import that it may map executable memory: a systemd unit
        # with MemoryDenyWriteExecute=yes (ours, by default) forbids it.
        why = (
            f"numba cannot map executable memory ({exc.strerror or exc}; "
            "MemoryDenyWriteExecute=yes?)"
        )
        log.info(
            "%s: features and quantization run on numpy; firmware/systemd/edge-agent-jit.conf "
            "allows the compiled kernels",
            why,
        )
        return None, why
    # Explicit signatures: compiled now (not on a live window). Cached on disk where numba
    # finds a writable place (next to this file, or NUMBA_CACHE_DIR); else compiled at
    # every start (~0.5 s).
    for cache in (True, False):
        try:
            _step(stop)
            select = numba.njit(_SELECT_SIG, nogil=True, cache=cache)(_select)
            _step(stop)
            features = numba.njit(_FEATURES_SIG, nogil=True, cache=cache)(features_int8)
            _step(stop)
            # The kernel calls _select by name: compile it against the compiled one.
            occlusion = numba.njit(_OCCLUSION_SIG, nogil=True, cache=cache)(
                _with_globals(occlusion_batch_int8, _select=select)
            )
            _step(stop)
            out_mask = numba.njit(_OUT_MASK_SIG, nogil=True, cache=cache)(input_out_mask)
        except KernelsStopped:
            raise
        except Exception as exc:  # noqa: BLE001 - numba raises many kinds: all mean numpy
            if cache:
                log.info("numba cannot cache the kernels (%s): compiling without a cache", exc)
                continue
            why = f"numba could not compile the kernels: {exc}"
            log.warning("%s: numpy path", why)
            return None, why
        return Kernels(features, occlusion, out_mask), ""
    return None, "unreachable"  # the loop returns


__all__ = [
    "JIT_ENV",
    "Kernels",
    "features_int8",
    "input_out_mask",
    "jit_enabled",
    "kernels",
    "occlusion_batch_int8",
    "pending",
    "unavailable_reason",
]
