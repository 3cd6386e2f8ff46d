"""Sample a running process with py-spy and say where its CPU went.

``bench.e2e --profile DIR`` records the agent over its measured interval with
:class:`Profile` (``py-spy record --format raw``: collapsed stacks, one line per distinct
stack with its sample count; only samples where a thread was on the CPU, py-spy's default)
and keeps the file; :func:`summarize` turns it into the shares a reader wants first: per
thread, and per function by self time (the leaf frame) and by inclusive time.

    python -m bench.profile FILE.folded      # the summary of an earlier recording
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

#: Samples per second: enough for 1 % shares over 15 s, light enough not to move them.
RATE_HZ = 250
#: py-spy's thread frame: ``thread (TID): NAME`` (TID in decimal or hex).
_THREAD = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\):?\s*")
_COUNT = re.compile(r"^(?P<stack>.*) (?P<n>\d+)$")
#: ``function (file:line)`` as py-spy prints a frame; the line number is dropped so that one
#: function's samples add up.
_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^():]+)(?::\d+)?\)$")


def available() -> str | None:
    """The py-spy executable next to this Python or on PATH, or None."""
    here = Path(sys.executable).parent / "py-spy"
    if here.exists():
        return str(here)
    return shutil.which("py-spy")


class Profile:
    """``py-spy record`` of ``pid`` for ``seconds`` into ``out`` (raw collapsed stacks).

    Non-blocking sampling (the target is not paused to read its stacks), so the profile
    costs the agent nothing but the cache misses of being read; threads are kept apart.
    """

    def __init__(self, pid: int, seconds: float, out: Path) -> None:
        exe = available()
        if exe is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy)")
        self.out = out
        argv = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds)))]
        argv += ["--rate", str(RATE_HZ), "--format", "raw", "--threads", "--nonblocking"]
        argv += ["--output", str(out)]
        self._log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - closed in wait()
        self._proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)

    def wait(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Wait for the recording to end; its summary (``{"error": ...}`` if none)."""
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        finally:
            self._log.close()
        if not self.out.exists():
            log = self.out.with_suffix(".log").read_text(errors="replace").strip()
            return {"error": f"py-spy wrote no profile: {log[-300:]}"}
        return summarize(self.out)


def _frame_name(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if m is None:
        return frame.strip()
    return f"{m['fn']} ({Path(m['file']).name})"


def summarize(path: Path, top: int = 15) -> dict[str, Any]:
    """Shares of samples (%) per thread, and the top functions by self and inclusive time."""
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        m = _COUNT.match(line)
        if m is None:
            continue
        n = int(m["n"])
        frames = m["stack"].split(";")
        # --threads puts the thread first: 'thread (0x7f..)' or 'process N:"..."' then it.
        thread = frames[0]
        if thread.startswith("process ") and len(frames) > 1:
            thread = frames[1]
            frames = frames[2:]
        else:
            frames = frames[1:]
        thread = _THREAD.sub("", thread).strip()
        total += n
        threads[thread] += n
        if frames:
            own[_frame_name(frames[-1])] += n
        for name in {_frame_name(f) for f in frames}:
            incl[name] += n

    def shares(c: Counter[str], k: int) -> list[list[Any]]:
        return [[name, round(100.0 * n / total, 1)] for name, n in c.most_common(k)]

    if total == 0:
        return {"samples": 0}
    return {
        "samples": total,
        "threads_pct": shares(threads, 10),
        "self_pct": shares(own, top),
        "inclusive_pct": shares(incl, top),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    ap.add_argument("path", type=Path, help="a py-spy --format raw recording")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    print(json.dumps(summarize(args.path, args.top), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
