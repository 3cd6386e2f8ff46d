"""SampleBuffer: bounded, drop-oldest with a counter, wakes the loop from a thread."""

import asyncio
import random
import threading
import time

import pytest

from drivers.backoff import backoff_delay
from drivers.buffer import SampleBuffer
from drivers.sample import Sample


def s(i: int) -> Sample:
    return Sample("x", float(i), i)


def test_drops_oldest_and_counts() -> None:
    buf = SampleBuffer(3)
    buf.put_many(s(i) for i in range(5))
    assert buf.dropped == 2
    assert buf.accepted == 5
    assert [x.value for x in buf.drain()] == [2.0, 3.0, 4.0]
    assert len(buf) == 0
    assert buf.high_water == 3


@pytest.mark.parametrize(("held", "batch"), [(0, 5), (2, 2), (2, 4), (3, 1), (1, 7), (3, 0)])
def test_a_batch_drops_exactly_what_one_by_one_would(held: int, batch: int) -> None:
    buf, ref = SampleBuffer(3), SampleBuffer(3)
    for b in (buf, ref):
        b.put_many([s(i) for i in range(held)])
    new = [s(100 + i) for i in range(batch)]
    buf.put_many(new)
    for x in new:
        ref.put(x)
    assert (buf.dropped, buf.accepted, buf.high_water) == (
        ref.dropped,
        ref.accepted,
        ref.high_water,
    )
    assert buf.drain() == ref.drain()


def test_partial_drain_keeps_order() -> None:
    buf = SampleBuffer(10)
    buf.put_many(s(i) for i in range(6))
    assert [x.t_ns for x in buf.drain(4)] == [0, 1, 2, 3]
    assert [x.t_ns for x in buf.drain()] == [4, 5]


def test_rejects_zero_size() -> None:
    with pytest.raises(ValueError, match="maxlen must be >= 1"):
        SampleBuffer(0)


def test_thread_producer_wakes_the_waiting_loop() -> None:
    async def main() -> float:
        buf = SampleBuffer(100)
        assert not await buf.wait(0.01)  # binds the loop; nothing there yet

        def produce() -> None:
            time.sleep(0.05)
            buf.put(s(1))

        t0 = time.monotonic()
        threading.Thread(target=produce).start()
        assert await buf.wait(5.0)
        return time.monotonic() - t0

    woke_after = asyncio.run(main())
    assert woke_after < 1.0  # woken by the put, not by the 5 s timeout


def test_concurrent_producers_lose_nothing_below_capacity() -> None:
    buf = SampleBuffer(100_000)

    def produce(base: int) -> None:
        for i in range(10_000):
            buf.put(s(base + i))

    threads = [threading.Thread(target=produce, args=(k * 10_000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = buf.drain()
    assert len(got) == 40_000
    assert len({x.t_ns for x in got}) == 40_000
    assert buf.dropped == 0


def test_backoff_grows_and_is_capped() -> None:
    rng = random.Random(1)
    delays = [backoff_delay(a, base_s=0.1, max_s=2.0, rng=rng) for a in range(10)]
    assert 0.05 <= delays[0] <= 0.1
    assert all(1.0 <= d <= 2.0 for d in delays[5:])
