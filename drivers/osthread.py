"""Name the calling thread in the kernel, so the agent's threads can be told apart outside it."""

import ctypes
import functools
import sys
from typing import Any, Final

_PR_SET_NAME: Final = 15


@functools.cache
def _prctl() -> Any:
    return ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the kernel too (its first 15 bytes), so that
    ``top -H``, ``ps -L`` and ``/proc/PID/task/TID/comm`` show which thread uses the CPU
    (Python names threads only for itself). Best effort: elsewhere nothing happens."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
