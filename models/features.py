"""The model's input features: a fixed function of one ``(window, n_signals)`` float window.

Pure numpy, shared by training (:mod:`models.dataset`, :mod:`models.train`) and the device
runtime (:mod:`models.runtime`), so the two can never compute different inputs. Feature set
``level+asinh_diff+repeat/v1``: per signal its level, its compressed step change and whether
it repeats; the definitions and why: :class:`FeatureExtractor`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FEATURES_NAME = "level+asinh_diff+repeat/v1"
GROUPS = 3
FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True, eq=False)
class FeatureSpec:
    """Per-signal constants of the feature function (all stored in the model manifest)."""

    mean: FloatArray
    std: FloatArray
    diff_scale: FloatArray
    clip: float

    @classmethod
    def from_lists(
        cls,
        mean: Sequence[float],
        std: Sequence[float],
        diff_scale: Sequence[float],
        clip: float,
    ) -> FeatureSpec:
        return cls(
            mean=np.asarray(mean, dtype=np.float32),
            std=np.asarray(std, dtype=np.float32),
            diff_scale=np.asarray(diff_scale, dtype=np.float32),
            clip=float(clip),
        )

    @property
    def n_signals(self) -> int:
        return int(self.mean.shape[0])

    @property
    def n_channels(self) -> int:
        return GROUPS * self.n_signals

    def describe(self) -> dict[str, object]:
        """The manifest's ``features`` entry."""
        return {
            "name": FEATURES_NAME,
            "channels": self.n_channels,
            "clip": self.clip,
            "diff_scale": [float(v) for v in self.diff_scale],
            "definition": (
                "z = (x - mean) / std with non-finite x counted as the mean (z = 0); "
                "channels [0, n): clip(z, -clip, clip); channels [n, 2n): "
                "clip(asinh((z[k] - z[k-1]) * std / diff_scale), -clip, clip), 0 at k = 0; "
                "channels [2n, 3n): 1.0 where z[k] == z[k-1] else 0.0, 0 at k = 0"
            ),
        }


def compute_features(values: npt.ArrayLike, spec: FeatureSpec) -> FloatArray:
    """Features of one window ``(window, n)`` or a batch ``(batch, window, n)``.

    The reference implementation, written for clarity; :class:`FeatureExtractor` is the
    allocation-free one the runtime uses for single windows and gives the same numbers.
    """
    x = np.asarray(values, dtype=np.float32)
    n = spec.n_signals
    if x.ndim not in (2, 3) or x.shape[-1] != n:
        raise ValueError(
            f"expected values of shape (window, {n}) or a batch of them, got {x.shape}"
        )
    z = (x - spec.mean) * (np.float32(1.0) / spec.std)
    z = np.where(np.isfinite(z), z, np.float32(0.0)).astype(np.float32)
    ratio = (spec.std / spec.diff_scale).astype(np.float32)
    out = np.zeros((*x.shape[:-1], GROUPS * n), dtype=np.float32)
    out[..., :n] = z
    out[..., 1:, n : 2 * n] = np.arcsinh((z[..., 1:, :] - z[..., :-1, :]) * ratio)
    out[..., 1:, 2 * n :] = z[..., 1:, :] == z[..., :-1, :]
    np.clip(out, -spec.clip, spec.clip, out=out)
    return out


class FeatureExtractor:
    """:func:`compute_features` for one window at a time, into buffers it owns.

    :meth:`groups` fills a ``(window, GROUPS, n)`` view of the features before the final
    clip (the runtime folds that clip into int8 quantization); reshaped to
    ``(window, GROUPS * n)`` it is the channel order of :func:`compute_features`.
    :meth:`__call__` is exactly :func:`compute_features`. Both return buffers that the next
    call overwrites: copy them to keep them.

    Feature set ``level+asinh_diff+repeat/v1``: ``3 * n_signals`` channels, in this order, for
    signal ``i`` and step ``k`` (``z = (x - mean) / std``):

    * ``level[k, i] = clip(z[k, i], -clip, clip)``: the operating point, normalised by the
      statistics of normal training data. It carries offsets (drift) and the relations between
      signals (speed follows frequency, vibration follows speed, voltage sags with current).
    * ``diff[k, i] = clip(asinh((z[k, i] - z[k-1, i]) * std[i] / diff_scale[i]), -clip, clip)``,
      0 at ``k = 0``: the step-to-step change in units of the signal's normal step noise,
      log-compressed by ``asinh`` so a 1-sigma wiggle and a 100-sigma spike both fit the one int8
      scale of the input tensor. Measurement noise is far below one int8 step of the level
      channels (1.5 rpm against a 500 rpm spread); here it spans about 16 steps, which is what
      makes noise bursts and short spikes visible inside 0.64 s.
    * ``repeat[k, i] = 1.0`` when ``x[k, i] == x[k-1, i]`` exactly, else 0 (0 at ``k = 0``): a
      live sensor sampled every step practically never repeats a float reading; a frozen
      (stuck) one does every step. A small ReLU CNN finds "a whole channel of ones" far more
      reliably than "a whole channel of exactly zero differences".

    A value that is not finite (NaN: a signal never seen by perception) counts as the signal's
    normal mean: level 0, no change, and therefore repeating, i.e. it reads as a value held at
    the mean. Perception flags such a signal as stale; the reasoning stage should not trust a
    model alarm on a stale signal.
    """

    __slots__ = (
        "_bad",
        "_before",
        "_clip",
        "_diff",
        "_g",
        "_inv_std",
        "_mean",
        "_now",
        "_out",
        "_out3",
        "_ratio",
        "_same",
        "_view",
        "_z",
    )

    def __init__(self, spec: FeatureSpec, window: int) -> None:
        n = spec.n_signals
        self._mean = spec.mean.astype(np.float32)
        self._inv_std = (np.float32(1.0) / spec.std).astype(np.float32)
        self._ratio = (spec.std / spec.diff_scale).astype(np.float32)
        self._clip = np.float32(spec.clip)
        self._bad = np.empty((window, n), dtype=np.bool_)
        # Group-major so every ufunc below works on contiguous rows; _view is the
        # (window, GROUPS, n) transpose the model input is read from.
        self._g = g = np.zeros((GROUPS, window, n), dtype=np.float32)
        self._view = g.transpose(1, 0, 2)
        self._out = np.empty((window, GROUPS * n), dtype=np.float32)
        self._out3 = self._out.reshape(window, GROUPS, n)
        # Views made once: making a view costs about as much as a small ufunc call.
        self._z, self._diff, self._same = g[0], g[1, 1:], g[2, 1:]
        self._now, self._before = g[0, 1:], g[0, :-1]

    @property
    def mean(self) -> FloatArray:
        """Per-signal mean subtracted (float32, as used)."""
        return self._mean

    @property
    def inv_std(self) -> FloatArray:
        """Per-signal ``1 / std`` (float32, as used)."""
        return self._inv_std

    @property
    def ratio(self) -> FloatArray:
        """Per-signal ``std / diff_scale``: the step channel's scale (float32, as used)."""
        return self._ratio

    def groups(self, values: npt.NDArray[np.floating]) -> FloatArray:
        z = self._z
        np.subtract(values, self._mean, out=z)
        np.multiply(z, self._inv_std, out=z)
        if not math.isfinite(np.add.reduce(z, axis=None)):  # rare: a NaN (never-seen) signal
            np.isfinite(z, out=self._bad)
            np.logical_not(self._bad, out=self._bad)
            np.copyto(z, np.float32(0.0), where=self._bad)
        diff, now, before = self._diff, self._now, self._before
        np.equal(now, before, out=self._same, casting="unsafe")
        np.subtract(now, before, out=diff)
        np.multiply(diff, self._ratio, out=diff)
        np.arcsinh(diff, out=diff)
        return self._view

    def __call__(self, values: npt.NDArray[np.floating]) -> FloatArray:
        np.clip(self.groups(values), -self._clip, self._clip, out=self._out3)
        return self._out


__all__ = ["FEATURES_NAME", "GROUPS", "FeatureExtractor", "FeatureSpec", "compute_features"]
