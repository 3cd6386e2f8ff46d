"""The unit of data every driver produces."""

from typing import NamedTuple


class Sample(NamedTuple):
    """One value of one signal, stamped when it reached us.

    ``t_ns`` is UNIX time in nanoseconds taken at arrival (not the sender's clock), so
    samples from every source share one time base for alignment.
    """

    signal: str
    value: float
    t_ns: int
