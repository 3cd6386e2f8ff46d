"""What ``bench.e2e`` uses to watch the processes it starts: the agent's NOTIFY_SOCKET, the
Modbus load's counters, the measured interval, CPU per process and per thread, the
agent's final status and the kernel's UDP drops."""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any


class NotifyListener:
    """A bound ``AF_UNIX`` datagram socket standing in for systemd's ``NOTIFY_SOCKET``.

    A thread reads every datagram (so the agent never finds the queue full) and records
    when the first one holding ``READY=1`` arrived (``time.monotonic()``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[tuple[float, str]] = []
        self.ready_at: float | None = None
        self._ready = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="notify-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.monotonic()
            text = data.decode(errors="replace")
            self.messages.append((now, text))
            if self.ready_at is None and "READY=1" in text.splitlines():
                self.ready_at = now
                self._ready.set()

    def wait_ready(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s)

    def close(self) -> None:
        self._closed = True
        self._thread.join()
        self._sock.close()


class ModbusLoad:
    """The Modbus load process: its port, and its request counter on demand."""

    def __init__(self, proc: "subprocess.Popen[str]") -> None:
        self.proc = proc
        assert proc.stdin is not None
        assert proc.stdout is not None
        self._stdin: IO[str] = proc.stdin
        self._stdout: IO[str] = proc.stdout
        hello = self._stdout.readline()
        if not hello:
            raise RuntimeError("Modbus load process did not start")
        info = json.loads(hello)
        self.port = int(info["port"])
        self.origin = float(info["origin"])

    def count(self) -> dict[str, Any]:
        """``requests`` answered so far, at ``mono``; ``first_mono``: the first request."""
        self._stdin.write("COUNT\n")
        self._stdin.flush()
        reply: dict[str, Any] = json.loads(self._stdout.readline())
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Interval:
    """CPU of one process and the Modbus requests served over one measured interval."""

    wall_s: float
    cpu_s: float
    modbus_requests: int
    #: Requests per read block (``fc3@8+2``: function 3, address 8, 2 registers).
    modbus_by_block: dict[str, int]
    #: Wake-ups of the host stall probe more than 1 ms late per second, same interval.
    host_stalls_per_s: float = float("nan")
    #: The interval on the wall clock (UNIX ns), to pick the agent's traced windows in it.
    start_ns: int = 0
    end_ns: int = 0
    #: CPU % of one core per thread name over the interval.
    threads_pct: dict[str, float] = field(default_factory=dict)

    @classmethod
    def between(
        cls, c0: Mapping[str, Any], cpu0: float, c1: Mapping[str, Any], cpu1: float
    ) -> "Interval":
        """From two (Modbus load count, process CPU seconds) snapshots."""
        b0, b1 = c0["by_block"], c1["by_block"]
        return cls(
            wall_s=float(c1["mono"]) - float(c0["mono"]),
            cpu_s=cpu1 - cpu0,
            modbus_requests=int(c1["requests"]) - int(c0["requests"]),
            modbus_by_block={k: int(v) - int(b0.get(k, 0)) for k, v in sorted(b1.items())},
        )

    @property
    def cpu_pct(self) -> float:
        return 100.0 * self.cpu_s / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def modbus_reads_per_s(self) -> float:
        return self.modbus_requests / self.wall_s if self.wall_s > 0 else float("nan")

    def modbus_block_rates(self) -> dict[str, float]:
        if self.wall_s <= 0:
            return {}
        return {k: round(n / self.wall_s, 1) for k, n in self.modbus_by_block.items() if n}


@dataclass
class SenderRun:
    """A CAN sender process started in the netns; ``started`` is when it began sending."""

    proc: "subprocess.Popen[str]"
    started: float
    result: dict[str, Any] = field(default_factory=dict)

    def finish(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        out, _ = self.proc.communicate(timeout=timeout_s)
        if self.proc.returncode != 0 or not out.strip():
            raise RuntimeError(f"CAN sender failed (exit {self.proc.returncode})")
        self.result = json.loads(out.strip().splitlines()[-1])
        return self.result

    @property
    def sent(self) -> int:
        return sum(int(v) for v in self.result["sent"].values())

    @property
    def elapsed_s(self) -> float:
        return float(self.result["elapsed_s"])


def warm_kernel_cache() -> float:
    """Have numba compile the agent's kernels into their disk cache, in a process of its
    own, before the agent starts; the seconds it took. A one-off per install (a package
    would do it when installed): the agent loads the kernels after READY, and on the first
    start after an install it would compile them there, seconds of CPU inside the measured
    interval of the first run only. With the cache warm this is ~1 s (numba's import)."""
    t0 = time.monotonic()
    code = "from models.kernels import kernels; kernels()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)
    return time.monotonic() - t0


def cpu_s(proc: Any) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (the kernel's ``comm``; threads of one name summed)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip()
            # comm may hold spaces and parentheses: the fields start after the last ')'.
            fields = (task / "stat").read_text().rpartition(")")[2].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def threads_pct(
    t0: Mapping[str, float], t1: Mapping[str, float], wall_s: float
) -> dict[str, float]:
    if wall_s <= 0:
        return {}
    pct = {k: round(100.0 * (v - t0.get(k, 0.0)) / wall_s, 1) for k, v in t1.items()}
    return dict(sorted(((k, v) for k, v in pct.items() if v >= 0.1), key=lambda kv: -kv[1]))


def agent_process(pid: int) -> Any:
    """The psutil process running ``edge-agent``: ``ip netns exec`` execs it in place."""
    import psutil  # noqa: PLC0415

    proc = psutil.Process(pid)
    for candidate in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            if any("edge-agent" in part for part in candidate.cmdline()):
                return candidate
    return proc


def sleep_until(deadline: float, alive: Callable[[], bool]) -> None:
    while (left := deadline - time.monotonic()) > 0:
        if not alive():
            raise RuntimeError("a bench process exited early")
        time.sleep(min(left, 0.1))


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def parse_status(text: str) -> dict[str, Any] | None:
    """The last JSON object in the agent's stdout (``--status-json`` prints it last)."""
    with contextlib.suppress(ValueError):
        whole = json.loads(text)
        if isinstance(whole, dict):
            return whole
    decoder = json.JSONDecoder()
    starts = [m.start() for m in re.finditer(r"(?m)^\{", text)]
    for start in reversed(starts):
        with contextlib.suppress(ValueError):
            obj, _ = decoder.raw_decode(text, start)
            if isinstance(obj, dict):
                return obj
    return None


_DROP_KEY = re.compile(r"(^|_)(dropped|drops)(_|$)")


def drop_counters(status: Mapping[str, Any]) -> dict[str, int]:
    """Every drop counter in ``status`` by its dotted path.

    A counter is an integer whose key says ``dropped``/``drops``, plus perception's
    ``windows_skipped`` (windows never built after a stall). ``*_rows`` counters are left
    out: they count again, in rows, drops another counter already counts in items.
    """
    found: dict[str, int] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, Mapping):
                walk(value, path + ".")
            elif isinstance(value, int) and not isinstance(value, bool):
                if key.endswith("_rows"):
                    continue
                if _DROP_KEY.search(key) or key == "windows_skipped":
                    found[path] = value

    walk(status, "")
    return found


def status_get(node: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def udp_drops(ns: str, ports: set[int]) -> int | None:
    """Datagrams the kernel dropped on full receive buffers, over the UDP sockets bound to
    ``ports`` in namespace ``ns`` (``/proc/net/udp``'s last column); None if unreadable."""
    from tests.support.netns import in_netns  # noqa: PLC0415

    done = subprocess.run(
        in_netns(ns, ["cat", "/proc/net/udp"]), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return None
    total = 0
    for line in done.stdout.splitlines()[1:]:
        cols = line.split()
        if len(cols) > 12 and int(cols[1].rpartition(":")[2], 16) in ports:
            total += int(cols[-1])
    return total


def reap(proc: "subprocess.Popen[str]") -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
