"""Run a blocking reader in a dedicated thread for the lifetime of a source's ``run()``.

A dedicated thread rather than ``asyncio.to_thread``: the reader blocks in ``recv`` for
the whole life of the source, which would pin one of the default executor's few workers
that SQLite commits and file hashing need.
"""

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Final

from drivers.errors import DriverError
from drivers.osthread import name_os_thread

log = logging.getLogger(__name__)

#: How long cancellation waits for the thread after asking it to stop. Bodies check the
#: stop event at least every 0.25 s, so this is only reached by a driver stuck in C code.
STOP_TIMEOUT_S: Final = 2.0


def _settle(fut: "asyncio.Future[None]", error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


async def run_in_thread(
    name: str,
    body: Callable[[threading.Event], None],
    wrap: Callable[[Exception], DriverError],
) -> None:
    """Run ``body(stop)`` in a new thread; return when it returns, raise what it raises.

    On cancellation ``stop`` is set and the thread is joined (without blocking the loop)
    for up to :data:`STOP_TIMEOUT_S`; then the cancellation propagates. A
    :class:`DriverError` from ``body`` is re-raised as is; any other exception is passed
    through ``wrap`` so no foreign exception leaves ``drivers``.
    """
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    stop = threading.Event()

    def main() -> None:
        error: BaseException | None = None
        name_os_thread(name)
        try:
            body(stop)
        # Everything, so the loop thread (which re-raises it) learns why the thread ended.
        except BaseException as exc:  # noqa: BLE001
            error = exc
        try:
            loop.call_soon_threadsafe(_settle, finished, error)
        except RuntimeError:  # the loop closed under us; nobody is left to tell
            if error is not None:
                log.error("%s: thread failed after its event loop closed", name, exc_info=error)

    # Marks a late exception (one that arrives after we were cancelled) as retrieved, so
    # asyncio does not log it as lost; it is logged below instead.
    finished.add_done_callback(lambda f: f.cancelled() or f.exception())
    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    try:
        # shield: a cancellation must not cancel `finished`, which the thread settles.
        await asyncio.shield(finished)
    except DriverError:
        raise
    except asyncio.CancelledError:
        stop.set()
        # Joined off the loop: the thread may still be in a recv() of up to 0.25 s.
        await asyncio.to_thread(thread.join, STOP_TIMEOUT_S)
        if thread.is_alive():
            # Left running as a daemon thread; it exits at its next stop check.
            log.warning("%s: thread did not stop within %.1f s", name, STOP_TIMEOUT_S)
        elif finished.done() and (late := finished.exception()) is not None:
            log.debug("%s: thread ended with %r while stopping", name, late)
        raise
    except Exception as exc:
        raise wrap(exc) from exc
    finally:
        stop.set()
