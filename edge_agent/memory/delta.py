"""Deadband delta encoding of windows into state-change rows, and its exact inverse. Pure.

A *row* is ``(t_ns, signal_id, value)``; ``value is None`` means the signal's state became
*unknown* (its cell was NaN or +-inf). When the encoder writes a row, in what sense the rows
reconstruct the windows exactly, keyframes, and the order of rows: :class:`DeltaEncoder`.

Design: ``docs/MEMORY.md``, "Delta encoding".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import isnan

import numpy as np
import numpy.typing as npt

#: ``(t_ns, signal_id, value)``; ``None``: the state became unknown.
Row = tuple[int, int, float | None]


_I64 = npt.NDArray[np.int64]
_F64 = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class RowBlock:
    """Rows as three columns (what the encoder produces and the writer inserts).

    ``value`` NaN is "unknown"; SQLite stores a bound NaN as NULL, so the writer can insert
    the columns as they are. Keeping rows as arrays means the per-row Python tuples are made
    in the writer thread, not on the event loop.
    """

    t_ns: _I64
    signal: _I64
    value: _F64

    def __len__(self) -> int:
        return int(self.t_ns.shape[0])

    def params(self) -> Iterable[tuple[int, int, float]]:
        """``(t_ns, signal, value)`` tuples for ``executemany``."""
        return zip(self.t_ns.tolist(), self.signal.tolist(), self.value.tolist(), strict=True)

    def tuples(self) -> list[Row]:
        """The rows as :data:`Row` tuples (``None`` for unknown)."""
        return [(t, s, None if isnan(v) else v) for t, s, v in self.params()]

    @staticmethod
    def of(rows: Sequence[Row]) -> RowBlock:
        return RowBlock(
            np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows)),
            np.fromiter((r[1] for r in rows), dtype=np.int64, count=len(rows)),
            np.fromiter(
                (math.nan if r[2] is None else r[2] for r in rows),
                dtype=np.float64,
                count=len(rows),
            ),
        )


_EMPTY = RowBlock(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64))


@dataclass(frozen=True, slots=True)
class EncodeResult:
    block: RowBlock
    #: True when the first encoded point is a keyframe (all signals written).
    keyframe: bool
    #: Time of the first encoded grid point (``None``: every point was behind).
    first_ns: int | None
    #: Time of the last encoded grid point.
    last_ns: int | None
    #: NaN / +-inf cells seen (stored as "unknown" transitions).
    non_finite: int
    #: Grid points skipped because they were at or before the last encoded point.
    behind: int
    #: Cells looked at (encoded points x signals).
    cells: int

    @property
    def rows(self) -> list[Row]:
        """The rows as tuples (tests, tools; the writer uses :attr:`block`)."""
        return self.block.tuples()


class DeltaEncoder:
    """Encodes successive windows of one fixed set of columns. See the module docstring.

    ``signal_ids[j]`` is the store's id of column ``j``; ``deadbands[j]`` its deadband (>= 0).
    ``enabled=False`` writes every cell: the "without delta encoding" reference.

    A *row* is ``(t_ns, signal_id, value)``; ``value is None`` means the signal's state became
    *unknown* (its cell was NaN or +-inf). The encoder keeps, per signal, the last value it
    *stored* (not the last one it saw) and emits a row for a grid point when

    * the value moved **more** than the signal's deadband away from the stored value, or
    * the value became unknown (non-finite) while the stored one was known, or known again, or
    * the point is a **keyframe**: the first point of a window encoded with ``keyframe=True``
      gets a row for every signal, known or not.

    Reconstruction is therefore exact in this sense: the state of signal ``s`` at time ``t`` is
    the value of its last row at or before ``t``; it differs from the value perceived at ``t`` by
    at most the deadband (deadband 0: bit-identical, float32 in, float32 out), and it is unknown
    exactly where the perceived value was non-finite. Comparing against the stored value, never
    the previous one, is what stops slow creep below the deadband from accumulating.

    Keyframes make reconstruction local: the state at ``t`` is the nearest keyframe at or before
    ``t`` plus the rows after it, so aging can delete everything before a keyframe and a reader
    never scans back further than one keyframe interval.

    Rows come out ordered by time, then by column: the store appends them in that order, so row
    ids ascend with time and a time range is a row-id range.

    Clock going backwards: grid points at or before the last encoded point are skipped and
    counted (``behind``); they would break that ordering. Perception refuses such samples too.
    """

    __slots__ = (
        "_db",
        "_enabled",
        "_ids",
        "_ids_arr",
        "_last",
        "_last_t",
        "_lossless",
        "_need_keyframe",
    )

    def __init__(
        self,
        signal_ids: Sequence[int],
        deadbands: Sequence[float],
        *,
        enabled: bool = True,
    ) -> None:
        if len(signal_ids) != len(deadbands):
            raise ValueError("one deadband per signal")
        if any(not (math.isfinite(d) and d >= 0) for d in deadbands):
            raise ValueError(f"deadbands must be finite and >= 0, got {list(deadbands)}")
        self._ids = [int(i) for i in signal_ids]
        self._ids_arr = np.asarray(self._ids, dtype=np.int64)
        self._db = [float(d) for d in deadbands]
        self._lossless = all(d == 0 for d in self._db)
        self._enabled = enabled
        self._last = [math.nan] * len(self._ids)
        self._last_t: int | None = None
        self._need_keyframe = True

    @property
    def last_ns(self) -> int | None:
        """Time of the last encoded grid point (``None`` before the first)."""
        return self._last_t

    @property
    def needs_keyframe(self) -> bool:
        return self._need_keyframe

    def stored(self) -> dict[int, float]:
        """The stored state per signal id (NaN: unknown), what a reader reconstructs now."""
        return dict(zip(self._ids, self._last, strict=True))

    def invalidate(self) -> None:
        """Forget what was stored (rows were dropped or the store rolled back).

        The next window is encoded as a keyframe, so reconstruction is exact again from it.
        """
        self._last = [math.nan] * len(self._ids)
        self._need_keyframe = True

    def resume_after(self, t_ns: int | None) -> None:
        """Continue a store whose newest row is at ``t_ns``: earlier points count as behind."""
        if t_ns is not None and (self._last_t is None or t_ns > self._last_t):
            self._last_t = t_ns

    def encode(
        self,
        start_ns: int,
        period_ns: int,
        values: npt.NDArray[np.floating],
        *,
        keyframe: bool = False,
    ) -> EncodeResult:
        """Rows for the window whose point ``k`` is at ``start_ns + k * period_ns``.

        ``values`` is ``(points, signals)`` in this encoder's column order. A keyframe is
        written when asked or when :meth:`invalidate` (or a fresh encoder) requires one.
        """
        if values.ndim != 2 or values.shape[1] != len(self._ids):
            raise ValueError(f"expected (points, {len(self._ids)}) values, got {values.shape}")
        if period_ns <= 0:
            raise ValueError(f"period_ns must be > 0, got {period_ns}")
        points = int(values.shape[0])
        skip = 0
        if self._last_t is not None and start_ns <= self._last_t:
            skip = min(points, (self._last_t - start_ns) // period_ns + 1)
        if skip == points:
            return EncodeResult(_EMPTY, False, None, None, 0, skip, 0)
        t0 = start_ns + skip * period_ns
        v = values[skip:] if skip else values
        finite = np.isfinite(v)
        non_finite = 0
        if not finite.all():
            non_finite = int(v.size - np.count_nonzero(finite))
            v = np.where(finite, v, np.nan)
        keyframe = keyframe or self._need_keyframe
        if not self._enabled or (self._lossless and not non_finite):
            block = self._encode_vectorized(t0, period_ns, v, keyframe)
        else:
            block = RowBlock.of(self._encode_loop(t0, period_ns, v, keyframe))
        t_last = t0 + (int(v.shape[0]) - 1) * period_ns
        self._last_t = t_last
        self._need_keyframe = False
        return EncodeResult(block, keyframe, t0, t_last, non_finite, skip, int(v.size))

    def _encode_vectorized(
        self, t0: int, period_ns: int, v: npt.NDArray[np.floating], keyframe: bool
    ) -> RowBlock:
        """Every cell (``enabled=False``), or deadband 0 with every cell finite: then a cell
        is written exactly when it differs from the cell before it (the stored value *is*
        the previous cell), so the rows are picked with numpy, not a Python loop."""
        if self._enabled:
            mask = np.empty(v.shape, dtype=np.bool_)
            if keyframe:
                mask[0] = True
            else:
                np.not_equal(v[0], np.asarray(self._last, dtype=v.dtype), out=mask[0])
            np.not_equal(v[1:], v[:-1], out=mask[1:])
            ks, js = np.nonzero(mask)
            values = v[ks, js].astype(np.float64)
        else:
            ks, js = np.divmod(np.arange(v.size), v.shape[1])
            values = v.astype(np.float64).ravel()
        self._last = [math.nan if isnan(x) else x for x in v[-1].tolist()]
        return RowBlock(ks.astype(np.int64) * period_ns + t0, self._ids_arr[js], values)

    def _encode_loop(
        self, t0: int, period_ns: int, v: npt.NDArray[np.floating], keyframe: bool
    ) -> list[Row]:
        rows: list[Row] = []
        append = rows.append
        last, ids, dbs = self._last, self._ids, self._db
        first_candidate = 0
        if keyframe:
            for j, x in enumerate(v[0].tolist()):
                known = not isnan(x)
                append((t0, ids[j], x if known else None))
                last[j] = x if known else math.nan
            first_candidate = 1
        if v.shape[0] <= first_candidate:
            return rows
        # A cell equal to the cell before it can never cross the deadband (the stored value
        # is within the deadband of the previous cell, or is that cell), so only cells that
        # differ from their predecessor are looked at. NaN != NaN keeps unknown cells in.
        changed = np.empty(v.shape, dtype=np.bool_)
        changed[0] = not first_candidate
        np.not_equal(v[1:], v[:-1], out=changed[1:])
        ks, js = np.nonzero(changed)
        for k, j, x in zip(ks.tolist(), js.tolist(), v[ks, js].tolist(), strict=True):
            stored = last[j]
            d = x - stored
            if d > dbs[j] or -d > dbs[j]:  # both known, moved past the deadband
                append((t0 + k * period_ns, ids[j], x))
                last[j] = x
            elif isnan(x):  # unknown now
                if not isnan(stored):
                    append((t0 + k * period_ns, ids[j], None))
                    last[j] = math.nan
            elif isnan(stored):  # known again
                append((t0 + k * period_ns, ids[j], x))
                last[j] = x
        return rows


# -- reconstruction ----------------------------------------------------------------------------


def apply_rows(state: dict[int, float], rows: Iterable[Row], until_ns: int) -> dict[int, float]:
    """Apply ``rows`` (time order) at or before ``until_ns`` to ``state`` in place; return it."""
    for t, sid, value in rows:
        if t > until_ns:
            break
        state[sid] = math.nan if value is None else value
    return state


def reconstruct(rows: Iterable[Row], at_ns: int, signal_ids: Iterable[int]) -> dict[int, float]:
    """The state of ``signal_ids`` at ``at_ns`` from rows that start at a keyframe (or at the
    beginning). Signals without a row are unknown (NaN)."""
    return apply_rows(dict.fromkeys(signal_ids, math.nan), rows, at_ns)


def series(
    rows: Iterable[Row], signal_id: int, since_ns: int, until_ns: int
) -> tuple[float, list[tuple[int, float]]]:
    """One signal's history: its state at ``since_ns`` and its changes in ``(since, until]``.

    ``rows`` must start at a keyframe at or before ``since_ns``. Keyframe rows that repeat
    the current state are not changes and are left out.
    """
    state = math.nan
    changes: list[tuple[int, float]] = []
    for t, sid, value in rows:
        if sid != signal_id:
            continue
        if t > until_ns:
            break
        x = math.nan if value is None else value
        if t <= since_ns:
            state = x
        elif not _same(x, changes[-1][1] if changes else state):
            changes.append((t, x))
    return state, changes


def _same(a: float, b: float) -> bool:
    return a == b or (isnan(a) and isnan(b))


__all__ = ["DeltaEncoder", "EncodeResult", "Row", "RowBlock", "apply_rows", "reconstruct", "series"]
