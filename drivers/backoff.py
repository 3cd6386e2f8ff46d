"""Jittered exponential backoff shared by every reconnecting driver."""

import random


def backoff_delay(
    attempt: int, *, base_s: float, max_s: float, rng: random.Random | None = None
) -> float:
    """Delay before retry number ``attempt`` (0 for the first retry).

    Equal jitter (uniform in ``[c/2, c]`` with ``c = min(max_s, base * 2**attempt)``) so many
    gateways that lost the same broker or bus do not come back in lock step.
    """
    r = rng if rng is not None else random
    ceiling = min(max_s, base_s * (2.0 ** min(attempt, 30)))
    return r.uniform(ceiling / 2.0, ceiling)
