"""Working memory: the last N windows and decisions, in RAM, for reasoning to read as context.

Two bounded rings (``collections.deque(maxlen=N)``): pushing onto a full ring forgets the
oldest entry, which is the point of a working memory, so nothing is counted as dropped.
Windows are immutable (frozen dataclass, arrays never written after perception builds
them), so readers get the objects themselves, not copies.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from edge_agent.perception import Window


class JsonRecord(Protocol):
    """Anything with a ``to_json()`` dict, like reasoning's ``Decision``."""

    def to_json(self) -> Mapping[str, object]: ...


#: A decision as memory sees it: reasoning's ``Decision`` (anything with ``to_json()``) or a
#: JSON-ready mapping. Working memory keeps the object itself; the store keeps its JSON.
Decision = JsonRecord | Mapping[str, Any]


class WorkingMemory:
    """The last ``capacity`` windows and the last ``capacity`` decisions, oldest first."""

    __slots__ = ("_decisions", "_windows", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._windows: deque[Window] = deque(maxlen=capacity)
        self._decisions: deque[Decision] = deque(maxlen=capacity)

    def push_window(self, window: Window) -> None:
        self._windows.append(window)

    def push_decision(self, decision: Decision) -> None:
        self._decisions.append(decision)

    def windows(self) -> tuple[Window, ...]:
        return tuple(self._windows)

    def decisions(self) -> tuple[Decision, ...]:
        return tuple(self._decisions)

    @property
    def latest(self) -> Window | None:
        return self._windows[-1] if self._windows else None

    def values(self, last: int | None = None) -> npt.NDArray[np.float32]:
        """The values of the last ``last`` windows (default: all) stacked in time order.

        Windows with another column set than the newest one are left out (perception's
        signals do not change while the agent runs; after a config change they would).
        """
        if not self._windows:
            return np.empty((0, 0), dtype=np.float32)
        picked = list(self._windows)[-last:] if last else list(self._windows)
        signals = picked[-1].signals
        arrays = [w.values for w in picked if w.signals == signals]
        return np.concatenate(arrays, axis=0)

    def clear(self) -> None:
        self._windows.clear()
        self._decisions.clear()

    def __len__(self) -> int:
        return len(self._windows)


__all__ = ["Decision", "JsonRecord", "WorkingMemory"]
