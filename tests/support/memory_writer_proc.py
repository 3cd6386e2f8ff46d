"""A process that writes to a memory store at full rate, for the kill -9 test.

    python -m tests.support.memory_writer_proc STATE_DIR START_NS

Every value changes (1024 rows per 16-signal window). It keeps the writer's pending list
at most half full (backpressure in the producer, so nothing is dropped) and after every
window prints ``<committed rows> <enqueued rows> <windows>``: the rows the writer thread has
committed so far (each commit is one transaction) and the rows handed to it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import numpy as np

from edge_agent.memory import MemorySection, MemoryStage
from edge_agent.perception import Window

SIGNALS = tuple(f"s{i:02d}" for i in range(16))
PERIOD = 10_000_000
POINTS = 64


def main(state_dir: Path, start_ns: int) -> None:
    cfg = MemorySection(commit_interval_ms=10, batch_max_rows=100_000, snapshot_interval_s=0)
    t = start_ns
    # The store's clock follows the data, which starts in 2023: on the wall clock, TTL aging
    # would delete rows while the test counts them.
    stage = MemoryStage(cfg, SIGNALS, state_dir=state_dir, clock_ns=lambda: t)
    rng = np.random.default_rng(start_ns % 1000)
    asyncio.run(stage.start())  # opens the store and starts the writer thread
    writer = stage._writer
    assert writer is not None
    seq = 0
    zeros = np.zeros(len(SIGNALS), dtype=np.float32)
    while True:
        while writer.pending_rows > 50_000:
            time.sleep(0.0005)
        values = rng.normal(size=(POINTS, len(SIGNALS))).astype(np.float32)
        seq += 1
        w = Window(seq, t, PERIOD, SIGNALS, values, zeros.astype(bool), 1.0, zeros)
        stage.process(w, {"seq": seq}, now_ns=t)
        t += POINTS * PERIOD
        stats = stage.stats()
        print(stats["writer"]["committed_rows"], stats["rows"], seq, flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
