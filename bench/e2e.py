"""End to end: the whole agent as a process under field-bus load: latency, CPU, READY.

``python -m bench.e2e [--quick] [--json]``

Everything runs in one throw-away network namespace (``tests.support.netns``; needs root), so no
multicast reaches a real NIC:

* a **Modbus load** process: a pymodbus TCP server on ``127.0.0.1:<free port>`` serving the
  simulated drive's register map (:mod:`drivers.sim.registers`), rewritten from a
  :class:`~drivers.sim.plant.MotorPlant` every 10 ms; it counts the requests it answers;
* a **CAN sender** process: 8,000 frames/s paced (as ``bench.can_ingest`` does) on two
  python-can ``udp_multicast`` buses: the motor drive's ``DRIVE_STATUS`` and
  ``DRIVE_VIBRATION`` (``drivers/sim/motor_drive.dbc``, 2,000 frames/s, the same plant's
  values) and the auxiliary equipment of ``bench/data/e2e/extra.dbc`` (6,000 frames/s,
  values derived from the plant; one message is chatter the agent selects nothing from);
* the **agent**: ``edge-agent run --config CFG --duration D --status-json`` with
  ``NOTIFY_SOCKET`` on a unix datagram socket of ours, configured by
  ``bench/data/e2e/agent.toml``: 16 perception signals at 100 Hz, ``window = 64``,
  ``hop = 1`` (a window closes at every grid step), ``lateness_ms = 20``, reasoning and
  memory at their defaults, no API. Four signals come from Modbus (the drive's status block
  polled every 10 ms, voltage every 100 ms, temperature every 200 ms: 115 reads/s), twelve
  from CAN.

The six signals the committed model reads reach it as in its training (the manifest's
``training.acquisition``: voltage's deadband and poll period, temperature's poll period,
``DRIVE_STATUS`` values refreshed every 10 ms and ``DRIVE_VIBRATION``'s every 20 ms), and
the plant starts at plant time 1200 s (seed 1), where the motor runs for the next 470 s:
the model sees normal operation and decides ``normal``.

Sequence: have numba compile the agent's kernels into their disk cache if they are not there
(a one-off per install: the agent loads them after READY, and would compile them in the
first run's measured interval; the notes say when it did), spawn the agent, wait for
``READY=1`` (at most 10 s), start the CAN sender, warm up 2 s, measure (15 s with
``--quick``, else 60 s), stop the sender, stop the agent with SIGTERM (``--duration`` is
only a safety net) and read its final status. Then the **bare** baseline: a process that
only receives the same CAN stream with a python-can ``Bus.recv()`` loop per bus and makes
the same Modbus reads (100 Hz + 10 Hz + 5 Hz) with a bare pymodbus client, measured the same
way for half as long.

Keys (``--json``: one object on the last line):

* ``p50_us``, ``p99_us``, ``p999_us``: the agent's own ``status["latency_us"]["e2e"]``, from
  the instant a window can close (its last grid point + ``lateness_ms``) to its Decision,
  over every decision of the run (the agent keeps the last 10,000); ``null`` when the
  status has no such key (nothing is computed here instead);
* ``cpu_pct``: agent process CPU (all threads) over the measured interval, % of one core
  (psutil); ``bare_cpu_pct`` the same for the bare baseline;
* ``cpu_vs_bare``: ``cpu_pct / bare_cpu_pct`` (target <= 1.5);
* ``host_stalls_per_s``: wake-ups of a probe process (:mod:`bench.host_stalls`, outside the
  namespace) more than 1 ms late per second over the agent's measured interval
  (``bare_host_stalls_per_s``: the bare one's): near 0 on a quiet host; a run with more is
  a noisy run, whatever the agent did;
* ``ready_s``: from spawning the agent to the first ``READY=1`` datagram, ``null`` if none
  came within 10 s;
* ``windows``, ``decisions``, ``drops`` (the sum of every drop counter in the status, listed
  in ``drops_detail``), ``loop`` (the event loop the agent reports, if it does);
* ``frames_per_s``: CAN frames the agent's sources counted / the time the sender sent (it
  sends only between READY and the stop); ``lost_frames`` = sent - counted;
  ``udp_kernel_drops``: of those, datagrams the kernel dropped because the agent's socket
  buffer was full (its reader fell behind);
* ``modbus_reads_per_s``: requests the server answered during the measured interval (only
  the agent is connected then; per read block in ``modbus_reads_per_s_by_block``);
  ``status_modbus_reads_per_s``: the agent's own ``replies`` over the time from its first
  request to SIGTERM.

* ``cpu_by_thread_pct`` / ``bare_cpu_by_thread_pct``: CPU % of one core per thread over
  the interval, from ``/proc/PID/task`` (the agent names its threads in the kernel);
  ``spin_cpu_pct``: of the agent's, the share its gate scheduler spent spinning before each
  opening (the status's ``gates.spin_cpu_pct``, over the whole run);
* ``load1_before``, ``quiet``: the 1-minute load average before the run, and whether the
  run was quiet (load <= 1.0 and <= 1 host stall/s while the bare baseline ran); a noisy
  run says so in ``notes``.

``--trace`` runs the agent with ``edge-agent run --trace`` and adds ``trace``
(:mod:`bench.e2e_trace`): percentiles over the windows decided inside the measured
interval only (start-up excluded) and what the slowest 1 % of them waited for.
``--fifo PRIO`` runs the agent and the bare baseline under ``SCHED_FIFO`` at ``PRIO`` (``chrt``;
root), as the systemd unit's ``CPUSchedulingPolicy=fifo`` would on a device: the peers of
the bench (sender, Modbus server) stay at normal priority; ``sched`` says which a run used.
``--profile DIR`` records the agent with py-spy over the measured interval
(:mod:`bench.profile`; ``profile``: shares per thread and function; the files stay in DIR).

Targets: P99 <= 2,000 µs and P99.9 <= 5,000 µs with no lost frame and no drop; CPU < 40 %
of one core and <= 1.5x the bare baseline's; READY <= 1.5 s.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.e2e_peers import (
    BUS_DBC,
    DATA,
    DRIVE_DBC,
    EXTRA_DBC,
    GROUP_OCTET,
    PLANT_START_S,
    RATE,
    REPO,
    bare,
    sender,
    serve_modbus,
)
from bench.e2e_procs import (
    Interval,
    ModbusLoad,
    NotifyListener,
    SenderRun,
    agent_process,
    cpu_s,
    drop_counters,
    parse_status,
    reap,
    sleep_until,
    status_get,
    tail,
    thread_cpu_s,
    threads_pct,
    udp_drops,
    warm_kernel_cache,
)
from bench.e2e_report import report
from bench.e2e_trace import analyze
from bench.host_stalls import HostStallProbe
from bench.profile import Profile

TEMPLATE = DATA / "agent.toml"

READY_TIMEOUT_S = 10.0
WARMUP_S = 2.0
BARE_WARMUP_S = 1.0
#: A run is quiet when the host stall probe saw at most this many stalls/s while the bare
#: baseline ran (the agent's own phase counts its load too) and the 1-minute load average
#: before it was at most QUIET_LOAD.
QUIET_STALLS_PER_S = 1.0
QUIET_LOAD = 1.0
_TAG = re.compile(
    r"^(?P<key>\s*[A-Za-z0-9_.]+\s*=\s*)(?P<value>.+?)(?P<tag>\s+#\s*@(?P<name>\w+).*)$"
)


# -- config -------------------------------------------------------------------------------


def render_config(template: str, values: Mapping[str, str | int]) -> str:
    """``template`` with the value of every line tagged ``# @name`` replaced by ``values[name]``.

    Raises ``KeyError`` for a tag without a value and ``ValueError`` for a value no line takes.
    """
    used: set[str] = set()
    lines = []
    for line in template.splitlines():
        m = _TAG.match(line)
        if m is None:
            lines.append(line)
            continue
        name = m["name"]
        value = values[name]
        literal = json.dumps(value) if isinstance(value, str) else str(int(value))
        lines.append(f"{m['key']}{literal}{m['tag']}")
        used.add(name)
    unused = set(values) - used
    if unused:
        raise ValueError(f"{TEMPLATE}: no line tagged {', '.join(sorted(unused))}")
    return "\n".join(lines) + "\n"


# -- orchestration (host namespace) -------------------------------------------------------
@dataclass
class AgentRun:
    """What the agent phase measured and the agent's final status."""

    status: dict[str, Any]
    ready_s: float | None
    interval: Interval
    sender: SenderRun
    #: From the agent's first Modbus request to SIGTERM (None: no request seen).
    polled_s: float | None
    #: Datagrams the kernel dropped on the agent's CAN sockets (None: unknown).
    udp_drops: int | None


@dataclass
class BareRun:
    """What the bare baseline phase measured."""

    interval: Interval
    sender: SenderRun
    frames: int


@dataclass(frozen=True)
class Options:
    """What a run adds to the plain measurement."""

    #: Where ``py-spy`` records the agent over its measured interval (None: no profile).
    profile_dir: Path | None = None
    #: Run the agent with ``--trace`` and analyze it (:mod:`bench.e2e_trace`).
    trace: bool = False
    #: TOML appended to the agent's config (``--config-extra``).
    config_extra: str = ""
    #: Run the agent and the bare baseline under SCHED_FIFO at this priority (``--fifo``).
    fifo: int | None = None

    @property
    def policy(self) -> str:
        """``other`` or ``fifo:PRIO``: how the agent and the bare baseline are scheduled."""
        return "other" if self.fifo is None else f"fifo:{self.fifo}"

    def sched(self, argv: list[str]) -> list[str]:
        """``argv`` under the run's scheduling policy (``chrt`` execs it in place)."""
        return argv if self.fifo is None else ["chrt", "--fifo", str(self.fifo), *argv]


class Bench:
    """The Modbus load in namespace ``ns``, and the two phases measured against it.

    Use as ``with``: leaving kills every process it started (by its Popen) and closes the
    logs it writes to ``tmp``.
    """

    load: ModbusLoad

    def __init__(self, ns: str, tmp: Path, options: "Options | None" = None) -> None:
        from tests.support.netns import GROUP_PREFIX  # noqa: PLC0415

        self.ns = ns
        self.tmp = tmp
        self.options = options if options is not None else Options()
        self.profile: dict[str, Any] | None = None
        self.trace_figures: dict[str, Any] | None = None
        self.me = [sys.executable, "-m", "bench.e2e"]
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONPATH": path}
        port0 = 41_000 + random.randrange(10_000)
        self.buses = {
            name: (f"{GROUP_PREFIX}{GROUP_OCTET[name]}", port0 + i)
            for i, name in enumerate(BUS_DBC)
        }
        self.bus_args = [
            f"--bus={name}={group}:{port}" for name, (group, port) in self.buses.items()
        ]
        self._stack = contextlib.ExitStack()
        self.notes: list[str] = []

    def __enter__(self) -> "Bench":
        try:
            proc = self.spawn_device(
                [*self.me, "--role", "modbus", "--start-at", repr(PLANT_START_S)],
                "load",
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            self.load = ModbusLoad(proc)
            self._stack.callback(self.load.close)
            # Outside the namespace: the host's own scheduling is what it measures.
            self.stalls = HostStallProbe()
            self._stack.callback(self.stalls.close)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def spawn_device(self, argv: list[str], log: str, **kwargs: Any) -> "subprocess.Popen[str]":
        """Start ``argv`` in the namespace, stderr to ``<tmp>/<log>.log``; reaped on exit."""
        from tests.support.netns import in_netns  # noqa: PLC0415

        kwargs.setdefault("env", self.env)
        err = self._stack.enter_context(open(self.tmp / f"{log}.log", "a"))  # noqa: SIM115
        proc: subprocess.Popen[str] = subprocess.Popen(
            in_netns(self.ns, argv), cwd=REPO, stderr=err, text=True, **kwargs
        )
        self._stack.callback(reap, proc)
        return proc

    def send_can(self, seconds: float) -> SenderRun:
        """Start the CAN sender; returns once it sends (``started``)."""
        proc = self.spawn_device(
            [
                *self.me,
                "--role",
                "sender",
                *self.bus_args,
                "--origin",
                repr(self.load.origin),
                "--seconds",
                str(seconds),
            ],
            "sender",
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        if not proc.stdout.readline():
            proc.wait()
            raise RuntimeError("CAN sender did not start:\n" + tail(self.tmp / "sender.log"))
        return SenderRun(proc, time.monotonic())

    def _measure(
        self,
        tx: SenderRun,
        warmup_s: float,
        measure_s: float,
        ps: Any,
        alive: Callable[[], bool],
        on_start: Callable[[], None] | None = None,
    ) -> Interval:
        sleep_until(tx.started + warmup_s, alive)
        if on_start is not None:
            on_start()
        c0, cpu0, s0, t0 = self.load.count(), cpu_s(ps), self.stalls.read(), time.time_ns()
        th0 = thread_cpu_s(ps.pid)
        sleep_until(tx.started + warmup_s + measure_s, alive)
        c1, cpu1, s1, t1 = self.load.count(), cpu_s(ps), self.stalls.read(), time.time_ns()
        th1 = thread_cpu_s(ps.pid)
        tx.finish(timeout_s=30)
        time.sleep(0.3)  # frames still in the sockets reach the receiver
        interval = Interval.between(c0, cpu0, c1, cpu1)
        return replace(
            interval,
            host_stalls_per_s=s1.rate_since(s0),
            start_ns=t0,
            end_ns=t1,
            threads_pct=threads_pct(th0, th1, interval.wall_s),
        )

    def agent_phase(self, measure_s: float) -> AgentRun:
        """Spawn the agent, wait for READY, load it with CAN, measure, SIGTERM, read status."""
        state_dir = self.tmp / "state"
        state_dir.mkdir()
        config = self.tmp / "agent.toml"
        text = render_config(
            TEMPLATE.read_text(),
            {
                "state_dir": str(state_dir),
                "modbus_port": self.load.port,
                "drive_group": self.buses["drive"][0],
                "drive_port": self.buses["drive"][1],
                "drive_dbc": str(DRIVE_DBC),
                "aux_group": self.buses["aux"][0],
                "aux_port": self.buses["aux"][1],
                "aux_dbc": str(EXTRA_DBC),
            },
        )
        extra = self.options.config_extra
        if extra:
            text += f"\n# --config-extra\n{extra}\n"
            self.notes.append(f"agent config with --config-extra: {extra!r}")
        config.write_text(text)
        warm_s = warm_kernel_cache()
        if warm_s > 3.0:
            self.notes.append(f"numba compiled the kernels into its cache first ({warm_s:.1f} s)")
        listener = NotifyListener(self.tmp / "notify.sock")
        self._stack.callback(listener.close)
        env = {**os.environ, "NOTIFY_SOCKET": str(listener.path)}
        for key in ("WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID"):
            env.pop(key, None)
        # --duration is a safety net only: the agent is stopped with SIGTERM.
        duration = READY_TIMEOUT_S + WARMUP_S + measure_s + 30.0
        out_path = self.tmp / "agent.stdout"
        argv = [str(Path(sys.executable).parent / "edge-agent"), "run", "--config", str(config)]
        argv += ["--duration", f"{duration:g}", "--status-json"]
        trace_path = self.tmp / "trace.json"
        if self.options.trace:
            argv += ["--trace", str(trace_path)]
        argv = self.options.sched(argv)
        if self.options.fifo is not None:
            self.notes.append(
                f"agent and bare baseline under SCHED_FIFO priority {self.options.fifo} "
                "(as firmware/systemd/edge-agent.service's CPUSchedulingPolicy=fifo)"
            )
        with open(out_path, "w") as out:
            spawned = time.monotonic()
            agent = self.spawn_device(argv, "agent", env=env, stdin=subprocess.DEVNULL, stdout=out)

        def alive() -> bool:
            return agent.poll() is None

        deadline = spawned + READY_TIMEOUT_S
        while not listener.wait_ready(0.05) and time.monotonic() < deadline:
            if not alive():
                raise RuntimeError(
                    f"agent exited with {agent.returncode} before READY:\n"
                    + tail(self.tmp / "agent.log")
                )
        ready_s = listener.ready_at - spawned if listener.ready_at is not None else None
        if ready_s is None:
            self.notes.append(f"no READY=1 on NOTIFY_SOCKET within {READY_TIMEOUT_S:g} s")
        ps = agent_process(agent.pid)

        # CAN only while the agent's buses are open: every frame sent is one it should count.
        tx = self.send_can(WARMUP_S + measure_s)
        profiles: list[Profile] = []

        def start_profile() -> None:
            if self.options.profile_dir is not None:
                out = self.options.profile_dir / "agent.folded"
                profiles.append(Profile(agent.pid, measure_s, out))

        interval = self._measure(tx, WARMUP_S, measure_s, ps, alive, start_profile)
        if profiles:
            self.profile = profiles[0].wait()
        stopped = time.monotonic()
        first_request = self.load.count().get("first_mono")
        # Only the agent's sockets are bound to the bus ports now (the sender has exited).
        kernel_drops = udp_drops(self.ns, {port for _, port in self.buses.values()})
        ps.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise RuntimeError("agent did not stop within 30 s of SIGTERM") from None
        if agent.returncode != 0:
            raise RuntimeError(
                f"agent exited with {agent.returncode}:\n" + tail(self.tmp / "agent.log")
            )
        status = parse_status(out_path.read_text(errors="replace"))
        if status is None:
            raise RuntimeError("no status JSON on the agent's stdout")
        polled = stopped - float(first_request) if first_request is not None else None
        if self.options.trace:
            if not trace_path.exists():
                raise RuntimeError("the agent wrote no --trace file")
            doc = json.loads(trace_path.read_text())
            self.trace_figures = analyze(doc, interval.start_ns, interval.end_ns)
            if self.options.profile_dir is not None:
                shutil.copy(trace_path, self.options.profile_dir / "trace.json")
        return AgentRun(status, ready_s, interval, tx, polled, kernel_drops)

    def bare_phase(self, measure_s: float) -> BareRun:
        """The bare receiver and poller under the same load, measured the same way."""
        import psutil  # noqa: PLC0415

        argv = [*self.me, "--role", "bare", *self.bus_args, "--modbus-port", str(self.load.port)]
        argv = self.options.sched(argv)
        proc = self.spawn_device(argv, "bare", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "READY":
            raise RuntimeError("bare baseline did not start:\n" + tail(self.tmp / "bare.log"))

        def alive() -> bool:
            return proc.poll() is None

        tx = self.send_can(BARE_WARMUP_S + measure_s)
        interval = self._measure(tx, BARE_WARMUP_S, measure_s, psutil.Process(proc.pid), alive)
        out, _ = proc.communicate("STOP\n", timeout=30)
        return BareRun(interval, tx, int(json.loads(out.strip().splitlines()[-1])["frames"]))


def figures(agent: AgentRun, bare_run: BareRun, notes: list[str]) -> dict[str, Any]:
    """The keys of the module docstring from what the two phases measured."""
    status = agent.status
    sources: Mapping[str, Any] = status.get("sources") or {}
    can_frames = sum(int(s["frames"]) for s in sources.values() if "frames" in s)
    replies = sum(int(s["replies"]) for s in sources.values() if "replies" in s)
    e2e = status_get(status, "latency_us", "e2e")
    if not isinstance(e2e, Mapping) or "p99" not in e2e:
        e2e = None
        notes.append("status has no latency_us.e2e: p50/p99/p999 are null")
    loop = status.get("loop")
    if loop is None:
        loop = status_get(status, "agent", "loop")
    drops = drop_counters(status)
    iv, tx, polled = agent.interval, agent.sender, agent.polled_s
    return {
        "p50_us": e2e.get("p50") if e2e else None,
        "p99_us": e2e.get("p99") if e2e else None,
        "p999_us": e2e.get("p999") if e2e else None,
        "e2e_max_us": e2e.get("max") if e2e else None,
        "e2e_n": e2e.get("n") if e2e else None,
        "cpu_pct": round(iv.cpu_pct, 1),
        "ready_s": round(agent.ready_s, 3) if agent.ready_s is not None else None,
        "agent_ready_s": status_get(status, "agent", "ready_s"),
        "windows": status.get("windows"),
        "decisions": status_get(status, "reasoning", "decisions"),
        "drops": sum(drops.values()),
        "drops_detail": drops,
        "frames_per_s": round(can_frames / tx.elapsed_s, 1),
        "sent_frames_per_s": round(tx.sent / tx.elapsed_s, 1),
        "lost_frames": tx.sent - can_frames,
        "udp_kernel_drops": agent.udp_drops,
        "modbus_reads_per_s": round(iv.modbus_reads_per_s, 1),
        "modbus_reads_per_s_by_block": iv.modbus_block_rates(),
        "status_modbus_reads_per_s": round(replies / polled, 1) if polled else None,
        "modbus_late_polls": sum(int(s.get("late_polls", 0)) for s in sources.values()),
        "loop": loop,
        "bare_cpu_pct": round(bare_run.interval.cpu_pct, 1),
        "cpu_vs_bare": round(iv.cpu_pct / bare_run.interval.cpu_pct, 2)
        if bare_run.interval.cpu_pct > 0
        else None,
        "cpu_by_thread_pct": iv.threads_pct,
        "spin_cpu_pct": status_get(status, "gates", "spin_cpu_pct"),
        "bare_cpu_by_thread_pct": bare_run.interval.threads_pct,
        "host_stalls_per_s": round(iv.host_stalls_per_s, 2),
        "bare_host_stalls_per_s": round(bare_run.interval.host_stalls_per_s, 2),
        "bare_frames_per_s": round(bare_run.frames / bare_run.sender.elapsed_s, 1),
        "bare_modbus_reads_per_s": round(bare_run.interval.modbus_reads_per_s, 1),
        "labels": status_get(status, "reasoning", "labels"),
        "measured_s": round(iv.wall_s, 2),
        "bare_measured_s": round(bare_run.interval.wall_s, 2),
        "signals": 16,
        "rate_hz": 100,
        "window": 64,
        "hop": 1,
        "lateness_ms": 20,
        "notes": notes,
    }


def run_bench(ns: str, tmp: Path, quick: bool, options: Options | None = None) -> dict[str, Any]:
    """Both phases in namespace ``ns``; the figures (see the module docstring)."""
    measure_s = 15.0 if quick else 60.0
    load1 = os.getloadavg()[0]
    with Bench(ns, tmp, options) as bench:
        agent = bench.agent_phase(measure_s)
        bare_run = bench.bare_phase(measure_s / 2)
    fig = figures(agent, bare_run, bench.notes)
    fig["load1_before"] = round(load1, 2)
    fig["sched"] = (options or Options()).policy
    fig["quiet"] = bool(load1 <= QUIET_LOAD and fig["bare_host_stalls_per_s"] <= QUIET_STALLS_PER_S)
    if not fig["quiet"]:
        fig["notes"].append(
            f"not a quiet run: load {load1:.2f} before (quiet: <= {QUIET_LOAD:g}), "
            f"{fig['bare_host_stalls_per_s']} host stalls/s in the bare phase (quiet: <= "
            f"{QUIET_STALLS_PER_S:g}); its latencies say more about the host than the agent"
        )
    if bench.profile is not None:
        fig["profile"] = bench.profile
    if bench.trace_figures is not None:
        fig["trace"] = bench.trace_figures
    return fig


def orchestrate(quick: bool, as_json: bool, options: Options | None = None) -> int:
    from tests.support.netns import netns, netns_problem  # noqa: PLC0415

    problem = netns_problem()
    if problem is not None:
        print(f"e2e: cannot run: {problem}", file=sys.stderr)
        return 2
    say: Callable[..., None] = (lambda *a: print(*a, file=sys.stderr)) if as_json else print
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edgefleet-e2e-") as tmp, netns("efe2e") as ns:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        say(
            f"e2e: edge-agent as a process in netns {ns}; 16 signals @ 100 Hz, window 64, hop 1, "
            f"lateness 20 ms; CAN {RATE} frames/s on 2 udp_multicast buses; Modbus status block "
            f"every 10 ms (+ voltage 100 ms, temperature 200 ms); {os.cpu_count()} cpus, "
            f"load average {load}"
        )
        try:
            figures = run_bench(ns, Path(tmp), quick, options)
        except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
            print(f"e2e: failed: {exc}", file=sys.stderr)
            return 1
    report(figures, say)
    say(f"{time.monotonic() - t_start:.1f} s")
    if as_json:
        print(json.dumps(figures))
    return 0


def _bus(text: str) -> tuple[str, tuple[str, int]]:
    """``NAME=GROUP:PORT`` -> (name, (group, port))."""
    name, _, where = text.partition("=")
    group, _, port = where.rpartition(":")
    return name, (group, int(port))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.e2e", description=(__doc__ or "").split("\n", 1)[0]
    )
    parser.add_argument("--quick", action="store_true", help="15 s of measurement (else 60 s)")
    parser.add_argument(
        "--json", action="store_true", help="figures as one JSON object on the last line"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="record the agent with py-spy over the measured interval into DIR/agent.folded "
        "and add its summary (threads, functions by self and inclusive time) as 'profile'",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="run the agent with --trace: steady-state percentiles over the measured interval "
        "and what the slowest 1 %% of windows waited for, as 'trace' (the file itself goes "
        "to the --profile DIR when there is one)",
    )
    parser.add_argument(
        "--config-extra",
        action="append",
        default=[],
        metavar="TOML",
        help="append TOML to the agent's config, e.g. '[schedule]\\nspin_us = 50' "
        "(repeatable): to measure what a setting changes; the run says so in its notes",
    )
    parser.add_argument(
        "--fifo",
        type=int,
        choices=range(1, 100),
        metavar="PRIO",
        help="run the agent and the bare baseline under SCHED_FIFO at PRIO (1-99), as the "
        "systemd unit's commented CPUSchedulingPolicy=fifo would on a device; 'sched' says "
        "which policy a run used",
    )
    parser.add_argument("--role", choices=("modbus", "sender", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--bus", action="append", type=_bus, default=[], help=argparse.SUPPRESS)
    parser.add_argument("--origin", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, default=PLANT_START_S, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--modbus-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is None:
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
        options = Options(args.profile, args.trace, "\n".join(args.config_extra), args.fifo)
        return orchestrate(args.quick, args.json, options)
    if args.role == "modbus":
        asyncio.run(serve_modbus(args.start_at))
        return 0
    from tests.support.netns import assert_isolated  # noqa: PLC0415

    assert_isolated()  # the sender and the bare baseline use multicast
    buses = dict(args.bus)
    if args.role == "sender":
        sender(buses, args.origin, args.start_at, args.seconds)
    else:
        asyncio.run(bare(buses, args.modbus_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
