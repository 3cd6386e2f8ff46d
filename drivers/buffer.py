"""A bounded, thread-safe sample buffer between driver threads and the event loop."""

import asyncio
import threading
from collections import deque
from collections.abc import Iterable

from drivers.sample import Sample


class SampleBuffer:
    """Bounded FIFO of samples; when full, the **oldest** sample is dropped and counted.

    Drop-oldest because the newest reading of a signal is the one perception needs; a
    stale backlog is worth less than fresh data. Producers may be threads (a CAN reader
    blocked in ``recv``) or coroutines; the consumer is one coroutine that ``await``s
    :meth:`wait` and then :meth:`drain`s everything in one go. A producer wakes the loop
    only when the buffer goes from empty to non-empty, so a burst of 8,000 frames/s costs a
    handful of wake-ups, not one per frame.
    """

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self.maxlen = maxlen
        self._items: deque[Sample] = deque()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self.accepted = 0
        self.dropped = 0
        self.high_water = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, sample: Sample) -> None:
        """Add one sample from any thread."""
        self.put_many((sample,))

    def put_many(self, samples: Iterable[Sample]) -> None:
        """Add samples from any thread, dropping the oldest beyond ``maxlen``."""
        batch = samples if isinstance(samples, (list, tuple)) else list(samples)
        n = len(batch)
        if not n:
            return
        with self._lock:
            items = self._items
            was_empty = not items
            # One extend instead of a Python step per sample: this runs for every CAN
            # batch and every Modbus read. The oldest go first, as one by one would.
            over = len(items) + n - self.maxlen
            if over > 0:
                self.dropped += over
                held = min(over, len(items))
                for _ in range(held):
                    items.popleft()
                if over > held:
                    batch = batch[over - held :]
            items.extend(batch)
            self.accepted += n
            size = len(items)
            self.high_water = max(self.high_water, size)
        if was_empty:
            self._wake()

    def drain(self, max_items: int | None = None) -> list[Sample]:
        """Take up to ``max_items`` (default all) samples, oldest first."""
        with self._lock:
            items = self._items
            if max_items is None or max_items >= len(items):
                out = list(items)
                items.clear()
            else:
                out = [items.popleft() for _ in range(max_items)]
            if self._event is not None and not items:
                self._event.clear()
        return out

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait until the buffer holds a sample; ``False`` if ``timeout`` passed first."""
        if self._event is None:
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
        if self._items:
            return True
        try:
            async with asyncio.timeout(timeout):
                await self._event.wait()
        except TimeoutError:
            return bool(self._items)
        return True

    def _wake(self) -> None:
        loop, event = self._loop, self._event
        if loop is None or event is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        else:
            loop.call_soon_threadsafe(event.set)
