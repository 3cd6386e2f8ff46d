"""The whole EdgeFleet story on one machine, live in the terminal (``make demo``).

A Mosquitto broker, ``fleet serve`` (ingest, artifact server, rollout orchestrator) and five
``edge-agent`` processes, each on its own simulated motor drive (a real Modbus TCP server
and a CAN bus) with its uplink, health API and OTA. Then, with the ``fleet`` CLI only:

1. ``fleet keys init``; the five gateways trust the root it writes;
2. model **v2** (the committed model, re-versioned) built and signed as a bundle and rolled
   out in three waves: the canary first, the critical gateway last;
3. model **v3**, a real INT8 model several times slower (``models/motor_drive_slow``):
   the canary's probation finds its reasoning latency far over the gateway's own baseline,
   rolls it back by itself, and the rollout halts at its first wave;
4. a summary of what every gateway runs and how each rollout ended.

Everything it makes lives in ``var/demo-fleet/`` (deleted at the start). Ctrl-C ends it
early; every process is stopped on the way out, agents first and the broker last. With
stdout not a terminal it prints plain lines instead of the live view: every command, each
gateway coming online, each wave and each device's progress and outcome.

    .venv/bin/python scripts/demo_fleet.py [--agents 5] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge_agent.console import make_console  # noqa: E402
from fleet.rollout.orchestrator import load  # noqa: E402
from fleet.store import open_store  # noqa: E402
from models.copies import copy_with_new_sha  # noqa: E402 - after the path set-up

BIN = Path(sys.executable).parent
VAR = REPO / "var" / "demo-fleet"
SITE = "demo-plant"
DEVICE_TYPE = "motor-drive-gw"
SLOW_MODEL = REPO / "models" / "motor_drive_slow"
CONSOLE_PORT = 8780


def console_port() -> int:
    """The console's usual port (8780) when it is free here, else any free one."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", CONSOLE_PORT))
        except OSError:
            return free_port()
    return CONSOLE_PORT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Gateway:
    name: str
    api_port: int
    proc: subprocess.Popen[bytes] | None = None
    status: dict[str, Any] = field(default_factory=dict)


@dataclass
class Demo:
    console: Console
    live: bool
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    gateways: list[Gateway] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    store_url: str = f"sqlite://{VAR / 'fleet.db'}"
    phase: str = "starting"
    #: Where the console is and the token to sign in with (shown all along the live view).
    console_line: str = ""
    #: What rollout_events() has reported already.
    seen: dict[tuple[object, ...], object] = field(default_factory=dict)

    # -- processes -------------------------------------------------------------------------

    def spawn(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        out = (VAR / "logs" / log).open("wb")
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        self.procs.append(proc)
        return proc

    def fleet(self, *args: str) -> str:
        """One ``fleet`` command, shown as a user would type it; its output is returned."""
        self.note(f"$ fleet {' '.join(args)}")
        res = subprocess.run(
            [str(BIN / "fleet"), *args, "--store", self.store_url] if args[0] in (
                "rollout", "devices", "tokens") else [str(BIN / "fleet"), *args],
            capture_output=True, text=True, cwd=REPO, check=False,
        )  # fmt: skip
        if res.returncode != 0:
            raise SystemExit(f"fleet {' '.join(args)} failed ({res.returncode}):\n{res.stderr}")
        return res.stdout

    def note(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.events.append(f"{stamp} {text}")
        if not self.live:
            print(f"{stamp} {text}", flush=True)

    def stop(self) -> None:
        """The agents first, then fleet serve, then the broker, each waited for: everyone
        stops while what it talks to is still there (an agent's last flush to the broker)."""
        agents = [g.proc for g in self.gateways if g.proc is not None]
        rest = [p for p in reversed(self.procs) if p not in agents]
        for group in (agents, *([p] for p in rest)):
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            for p in group:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.1, deadline - time.monotonic()))
                if p.poll() is None:
                    p.kill()

    # -- observing ---------------------------------------------------------------------------

    def poll(self) -> None:
        for g in self.gateways:
            try:
                url = f"http://127.0.0.1:{g.api_port}/v1/status"
                with urllib.request.urlopen(url, timeout=0.5) as r:
                    g.status = json.loads(r.read())
            except (OSError, ValueError):
                g.status = {}

    def rollouts(self) -> list[Any]:
        try:
            st = open_store(self.store_url)
        except Exception:  # noqa: BLE001 - before fleet serve made the store
            return []
        try:
            return [load(doc)[0] for _, _, doc in st.rollouts()]
        except Exception:  # noqa: BLE001 - before the migration ran
            return []
        finally:
            st.close()

    def view(self) -> Group:
        devices = Table("gateway", "up", "model", "OTA", "reasoning P50 µs", "windows", "last OTA")
        for g in self.gateways:
            s = g.status
            if not s:
                devices.add_row(g.name, "[red]no[/]", "-", "-", "-", "-", "-")
                continue
            model = s.get("reasoning", {}).get("model", {})
            ota = s.get("ota", {})
            last = ota.get("last") or {}
            lat = s.get("latency_us", {}).get("reasoning", {})
            version = f"{model.get('version', '?')} {model.get('sha256', '')[:8]}"
            last_ota = f"{last.get('result', '')} {last.get('version', '')}".strip() or "-"
            devices.add_row(
                g.name, "[green]yes[/]", version, ota.get("state", "-"),
                f"{lat.get('p50', 0):.0f}", str(s.get("windows", 0)), last_ota,
            )  # fmt: skip
        rollouts = Table("rollout", "bundle", "state", "wave", "committed", "failed", "reason")
        for r in self.rollouts():
            c = r.counts()
            rollouts.add_row(
                r.id, f"{r.bundle_id} {r.version}", r.state, f"{r.wave + 1}/{len(r.waves)}",
                f"{c.get('committed', 0)}/{len(r.devices)}",
                str(c.get("failed", 0) + c.get("rolled_back", 0)), (r.reason or "")[:70],
            )  # fmt: skip
        return Group(
            Panel(
                f"[bold]{self.phase}[/bold]\n{escape(self.console_line)}", title="EdgeFleet demo"
            ),
            devices,
            rollouts,
            Panel("\n".join(self.events[-12:]) or "-", title="what happened"),
        )


def rollout_events(rollouts: list[Any], seen: dict[tuple[object, ...], object]) -> list[str]:
    """A line for each change in ``rollouts`` not in ``seen`` yet (which this updates): the
    rollout's own history (waves starting and passing, a halt) and each device's progress
    (offered, its OTA state, then committed, or rolled back / failed with the reason)."""
    lines: list[str] = []
    for r in rollouts:
        for t_ns, text in r.history:
            if (r.id, t_ns, text) not in seen:
                seen[(r.id, t_ns, text)] = True
                lines.append(f"rollout {r.id} ({r.version}): {text}")
        for name, d in sorted(r.devices.items()):
            state = d.reason if d.state == "in_progress" else d.state
            if state == "waiting" or seen.get((r.id, name)) == state:
                continue
            seen[(r.id, name)] = state
            outcome = f": {d.reason}" if d.state in ("rolled_back", "failed", "timed_out") else ""
            lines.append(f"rollout {r.id}: {name} {state} {r.version}{outcome}")
    return lines


def wait(demo: Demo, live: Live | None, pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        demo.poll()
        for line in rollout_events(demo.rollouts(), demo.seen):
            demo.note(line)
        if live is not None:
            live.update(demo.view())
        if pred():
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.5)


def agent_config(name: str, i: int, broker: int, api: int, root: Path) -> Path:
    text = (REPO / "examples" / "agent.toml").read_text()
    edits = [
        ('device = "demo-gw-01"', f'device = "{name}"'),
        ('state_dir = "../var/demo-gw-01"', f'state_dir = "{VAR / name}"'),
        ("port = 15020", f"port = {free_port()}"),
        ('channel = "edgefleet-demo"', f'channel = "demo-fleet-{i}"'),
        ("port = 8080", f"port = {api}"),
        ("[uplink]\nenabled = false", "[uplink]\nenabled = true"),
        ("port = 1883", f"port = {broker}"),
        ("[ota]\nenabled = true\n", f'[ota]\nenabled = true\ntrust_root = "{root}"\n'),
        ('log_level = "info"', 'log_level = "warning"'),
    ]
    for old, new in edits:
        if old not in text:
            raise SystemExit(f"examples/agent.toml changed: {old!r} not found")
        text = text.replace(old, new, 1)
    text = text.replace('"../', f'"{REPO}/')
    path = VAR / f"{name}.toml"
    path.write_text(text)
    return path


def main() -> int:  # noqa: PLR0915 - the demo's story, step by step, as the reader follows it
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="leave var/demo-fleet/ as it is at the end")
    args = ap.parse_args()
    if not SLOW_MODEL.is_dir():
        raise SystemExit(f"demo: {SLOW_MODEL} is missing (it ships with the repository)")
    mosquitto = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(mosquitto).exists():
        raise SystemExit("demo: mosquitto not found (apt-get install mosquitto)")
    shutil.rmtree(VAR, ignore_errors=True)
    (VAR / "logs").mkdir(parents=True)
    console = make_console()  # a pipe or a log file: lines are never wrapped
    demo = Demo(console, live=console.is_terminal)
    started = time.monotonic()
    live: Live | None = None
    try:
        if demo.live:
            live = Live(demo.view(), console=console, refresh_per_second=4, transient=False)
            live.start()
        broker = free_port()
        (VAR / "mosquitto.conf").write_text(
            f"listener {broker} 127.0.0.1\nallow_anonymous true\npersistence false\n"
        )
        demo.spawn([mosquitto, "-c", str(VAR / "mosquitto.conf")], "mosquitto.log")
        demo.note(f"broker: mosquitto on 127.0.0.1:{broker}")
        demo.fleet("keys", "init", "--dir", str(VAR / "keys"))
        root = VAR / "keys" / "root.json"
        token = demo.fleet("tokens", "create", "--name", "demo-viewer", "--role", "viewer").strip()
        http = console_port()
        demo.spawn(
            [str(BIN / "fleet"), "serve", "--store", demo.store_url, "--broker",
             f"127.0.0.1:{broker}", "--artifacts", str(VAR / "artifacts"), "--artifact-port",
             str(free_port()), "--coap-port", str(free_port()), "--http", f"127.0.0.1:{http}"],
            "fleet-serve.log",
        )  # fmt: skip
        demo.note("fleet serve: ingest, artifact server, rollout orchestrator, API and console")
        demo.console_line = f"console: http://127.0.0.1:{http}/  viewer token: {token}"
        demo.note(demo.console_line)
        for i in range(args.agents):
            name = f"gw-{i + 1:02d}"
            g = Gateway(name, free_port())
            cfg = agent_config(name, i, broker, g.api_port, root)
            g.proc = demo.spawn([str(BIN / "edge-agent"), "run", "-c", str(cfg), "--simulate"],
                                f"{name}.log")  # fmt: skip
            demo.gateways.append(g)
        demo.phase = f"{args.agents} gateways starting on simulated motor drives"
        demo.note(demo.phase)

        def registered() -> bool:
            try:
                st = open_store(demo.store_url)
                st.migrate()
                try:
                    online = {d.device for d in st.devices() if d.online}
                finally:
                    st.close()
            except Exception:  # noqa: BLE001 - fleet serve still creating it
                return False
            for name in sorted(online):
                if ("online", name) not in demo.seen:
                    demo.seen[("online", name)] = True
                    demo.note(f"{name} online in the fleet")
            return online >= {g.name for g in demo.gateways} and all(
                g.status.get("windows", 0) > 20 for g in demo.gateways
            )

        wait(demo, live, registered, 90, "every gateway online")
        first, last = demo.gateways[0].name, demo.gateways[-1].name
        first_cfg = VAR / f"{first}.toml"  # every gateway's grid: the probation must fit it
        demo.fleet("devices", "label", first, "--tier", "canary")
        demo.fleet("devices", "label", last, "--tier", "critical")

        # -- v2: a good model, wave by wave ----------------------------------------------
        demo.phase = "rollout of model v2: canary first, critical last"
        v2_dir = copy_with_new_sha(VAR / "models" / "v2", "v2")
        manifest = json.loads((v2_dir / "manifest.json").read_text())
        manifest["version"] = "2.0.0"
        (v2_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
        demo.fleet("bundle", "build", "--kind", "model", "--model-dir", str(v2_dir),
                   "--version", "2.0.0", "--counter", "2", "--device-type", DEVICE_TYPE,
                   "--target-config", str(first_cfg), "--out", str(VAR / "v2.efb"),
                   "--sign-with", str(VAR / "keys"))  # fmt: skip
        out = demo.fleet("rollout", "create", str(VAR / "v2.efb"), "--waves", "20%,60%,100%",
                         "--min-devices", "1", "--max-failure", "0%", "--artifacts",
                         str(VAR / "artifacts"), "--json")  # fmt: skip
        v2 = json.loads(out)["id"]

        def done(rid: str) -> bool:
            return any(
                r.id == rid and r.state not in ("running", "paused") for r in demo.rollouts()
            )

        wait(demo, live, lambda: done(v2), 180, "the v2 rollout")  # 3 waves of 20 s probations
        r2 = next(r for r in demo.rollouts() if r.id == v2)
        demo.note(f"v2 rollout {r2.state}: {r2.counts().get('committed', 0)}/{len(r2.devices)} "
                  f"gateways on 2.0.0")  # fmt: skip

        # -- v3: too slow, halts at its first wave ----------------------------------------
        demo.phase = "rollout of model v3 (several times slower): the canary's probation decides"
        demo.fleet("bundle", "build", "--kind", "model", "--model-dir", str(SLOW_MODEL),
                   "--version", "3.0.0", "--counter", "3", "--device-type", DEVICE_TYPE,
                   "--target-config", str(first_cfg), "--out", str(VAR / "v3.efb"),
                   "--sign-with", str(VAR / "keys"))  # fmt: skip
        out = demo.fleet("rollout", "create", str(VAR / "v3.efb"), "--waves", "20%,60%,100%",
                         "--min-devices", "1", "--max-failure", "0%", "--artifacts",
                         str(VAR / "artifacts"), "--json")  # fmt: skip
        v3 = json.loads(out)["id"]
        wait(demo, live, lambda: done(v3), 120, "the v3 rollout")
        r3 = next(r for r in demo.rollouts() if r.id == v3)
        demo.note(f"v3 rollout {r3.state}: {r3.reason}")
        for _ in range(4):  # a last look at the gateways
            demo.poll()
            time.sleep(0.5)
        demo.phase = "done"
        if live is not None:
            live.update(demo.view())
    except KeyboardInterrupt:
        demo.note("interrupted")
    finally:
        if live is not None:
            live.stop()
        demo.stop()
    summary(demo, time.monotonic() - started)
    if not args.keep:
        for p in (VAR / "artifacts",):
            shutil.rmtree(p, ignore_errors=True)
    return 0


def summary(demo: Demo, seconds: float) -> None:
    c = demo.console
    if c.is_terminal:
        c.rule("summary")
    else:
        c.print("--- summary ---")
    versions = {}
    for g in demo.gateways:
        model = g.status.get("reasoning", {}).get("model", {}) if g.status else {}
        versions[g.name] = model.get("version", "?")
    c.print("gateways: " + ", ".join(f"{n} runs model {v}" for n, v in versions.items()))
    for r in demo.rollouts():
        cnt = r.counts()
        c.print(f"rollout {r.id} ({r.bundle_id} {r.version}): {r.state}; "
                f"{cnt.get('committed', 0)}/{len(r.devices)} committed, "
                f"{cnt.get('rolled_back', 0) + cnt.get('failed', 0)} rolled back or failed"
                + (f"; {r.reason}" if r.reason else ""), highlight=False)  # fmt: skip
    c.print(f"{seconds:.0f} s; logs and state in {VAR.relative_to(REPO)}/", highlight=False)
    if demo.console_line:
        c.print(f"{demo.console_line} (while the demo ran)", highlight=False, markup=False)


if __name__ == "__main__":
    sys.exit(main())
