"""The compiled kernels, loaded after the agent is ready: it serves on numpy until then.

With ``[reasoning] jit = "auto"`` the features, quantization and the input-distribution
check run on numba kernels (:mod:`models.kernels`) when numba is there. Loading numba and
the kernels' disk cache takes ~0.7 s, half of a start: the agent would answer READY that
much later, and systemd, a watchdog or an operator waits for it. So the agent starts on the
numpy path, which gives the same int8 input bit for bit (the reference the kernels
repeat), and once READY is out loads the kernels in a thread, checks them against the
numpy path on the model's golden windows (and windows around its normal levels), and only
then switches the serving model to them, on the loop between two windows. A check that
fails leaves numpy serving and says why; nothing is lost either way.

The load runs in a thread of its own that stops between two compile steps once asked
(:func:`in_thread`): the agent asks when it stops, so a SIGTERM during a cold compile
(~3 s of CPU without numba's disk cache) waits for one step, not the whole load. Not the
loop's executor: ``asyncio.run`` joins its threads, which waits for the whole load. Not a
daemon thread either: one still inside LLVM while the interpreter finalizes crashed the
process at exit (a segmentation fault under qemu, where a compile takes minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from edge_agent.reasoning import PreparedModel, ReasoningStage
from models.input_stats import STAT_NAMES, out_of_training
from models.kernels import Kernels, kernels, unavailable_reason
from models.runtime import LoadedModel

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Windows around the model's normal levels checked beside its golden windows.
AROUND_NORMAL = 8


def check_windows(prepared: PreparedModel) -> list[npt.NDArray[np.float32]]:
    """The windows the kernels are checked on: the model's golden windows, then windows
    of noise around its normal levels (a model without known answers still gets a check;
    the noise reaches past the training ranges, so the input check sees signals out)."""
    model = prepared.model
    out: list[npt.NDArray[np.float32]] = []
    answers = model.manifest.known_answers
    if answers is not None:
        out += [np.asarray(w, dtype=np.float32) for w in answers.inputs]
    rng = np.random.default_rng(0)
    mean = prepared.normal_mean.astype(np.float32)
    spread = np.maximum(np.abs(mean) * np.float32(0.2), np.float32(1.0))
    shape = (model.manifest.window, len(mean))
    for _ in range(AROUND_NORMAL):
        noise = rng.standard_normal(shape).astype(np.float32)
        out.append(mean + noise * spread)
    return out


def disagreement(prepared: PreparedModel, k: Kernels) -> str:
    """Why ``k`` must not serve ``prepared`` ("" when it may): the first window whose int8
    input or out-of-distribution mask differs from the numpy path's. Thread-safe (fresh
    buffers): it runs beside the serving model."""
    model = prepared.model
    if not isinstance(model, LoadedModel):
        return "the serving model is not a loaded TFLite model"
    bounds = prepared.input_bounds
    n = len(model.manifest.signals)
    for i, w in enumerate(check_windows(prepared)):
        if not np.array_equal(model.input_int8(w), model.input_int8(w, k)):
            return f"check window {i}: the compiled int8 input differs from the numpy path's"
        if bounds is not None:
            ref = np.zeros((n, len(STAT_NAMES)), dtype=np.float32)
            got = np.zeros_like(ref)
            if out_of_training(w, bounds, ref) != k.input_out_mask(w, bounds, got):
                return f"check window {i}: the compiled input check differs from the numpy path's"
    return ""


async def in_thread(fn: Callable[[threading.Event], T], name: str) -> T:
    """``fn(stop)`` in a thread of its own, awaited like :func:`asyncio.to_thread`; when
    the awaiting task is cancelled, ``stop`` is set and the cancellation goes on at once:
    ``fn`` checks ``stop`` where it can end, and the process's exit joins the thread."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    stop = threading.Event()

    def settle(value: T | None, exc: BaseException | None) -> None:
        if done.cancelled():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(value)  # type: ignore[arg-type]

    def work() -> None:
        value: T | None = None
        error: BaseException | None = None
        try:
            value = fn(stop)
        except Exception as exc:  # noqa: BLE001 - raised again in the awaiting task
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=work, name=name).start()
    try:
        return await done
    except asyncio.CancelledError:
        stop.set()
        raise


async def load_kernels(stage: ReasoningStage, on_loaded: Callable[[], None]) -> bool:
    """Load the kernels in a thread, check them on the serving model, switch it to them.
    ``on_loaded`` runs after the switch (the CLI keeps what numba built out of the garbage
    collector's scans). Returns whether the model now runs compiled."""
    t0 = time.monotonic()
    # Cancelled (the agent stops): the thread ends with KernelsStopped, which nobody awaits.
    k = await in_thread(kernels, "kernels-load")
    if k is None:
        log.info("reasoning: features stay on numpy (%s)", unavailable_reason())
        return False
    prepared = stage.prepared
    why = await in_thread(lambda _stop: disagreement(prepared, k), "kernels-check")
    if why:
        log.warning("reasoning: compiled kernels refused, numpy serves: %s", why)
        return False
    if not stage.use_kernels(prepared, k):
        return False  # another model serves since: it was loaded as the config says
    on_loaded()
    took = time.monotonic() - t0
    log.info("reasoning: features compiled (kernels loaded in %.2f s after ready)", took)
    return True


#: Longest a new agent build may spend compiling its kernels at install (a cold compile is
#: ~3 s of CPU on a gateway, minutes under emulation); past it, the build compiles them
#: after its first READY instead, as without this step.
PRECOMPILE_TIMEOUT_S = 120.0

# Runs in a child interpreter started with -P: the slot directory (argv[1]) first on
# sys.path, as the launcher's bootstrap puts it (firmware.boot), so it is the new build's
# kernels that compile, into the numba cache next to the slot's own source.
_PRECOMPILE = (
    "import sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from models.kernels import kernels, unavailable_reason\n"
    "sys.exit(0 if kernels() is not None else unavailable_reason() or 1)\n"
)


def precompile_slot(slot_dir: Path, timeout_s: float = PRECOMPILE_TIMEOUT_S) -> str:
    """Compile a new agent build's kernels into its slot before it is started; why not
    ("" when done). Blocking: run it in a thread.

    numba caches a compiled kernel beside its source file, so the first start of a build in
    a new slot would compile them cold, after READY, beside its first windows: seconds of
    CPU and tens of MiB that an OTA probation would charge to the new build (its memory
    rule compares with the old build, which loaded its kernels from the cache). Compiled
    here, in a child process that gives its memory back, the new build starts as the old
    one did. A failure changes nothing but that: the build then compiles at its start."""
    try:
        done = subprocess.run(
            [sys.executable, "-P", "-c", _PRECOMPILE, str(slot_dir)],
            capture_output=True,
            timeout=timeout_s,
            check=False,
            cwd=slot_dir,
        )
    except subprocess.TimeoutExpired:
        return f"the compile took over {timeout_s:g} s"
    except OSError as exc:
        return f"cannot start {sys.executable}: {exc.strerror or exc}"
    if done.returncode == 0:
        return ""
    tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
    return tail[0][:300] if tail else f"exit code {done.returncode}"


__all__ = ["check_windows", "disagreement", "in_thread", "load_kernels", "precompile_slot"]
