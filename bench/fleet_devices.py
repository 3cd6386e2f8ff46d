"""A fleet of devices at once: N MQTT clients, each publishing 1 telemetry msg/s, into ingest.

``python -m bench.fleet_devices [--quick] [--json] [--devices N] [--seconds S]``

A real Mosquitto (``tests.support.mosquitto``) on loopback and the fleet ingest service as it is
deployed (``fleet serve --workers 1`` into a fresh SQLite file, in a subprocess so its CPU
can be measured). The bench process simulates N devices: N paho clients (MQTT 5,
``clean_start``), each with its own TCP connection, client id, ``boot_id`` and gap-free
``seq`` from 0, publishing one valid ``TelemetryMsg`` per second at QoS 1. A thread per
client would not fit a small VM, so all clients run on ONE thread through paho's external
loop hooks (``on_socket_open`` / ``register_write``, ``loop_read`` / ``loop_write`` /
``loop_misc``) over one ``selectors`` selector. Devices connect in waves (so the broker's
listen backlog is not flooded) and their send times are spread evenly over each second.

Figures (JSON object on the last line):

* ``connect_s``: from the first connect to the last CONNACK (``connected`` of ``devices``);
* ``msgs_expected`` = devices x seconds; ``msgs_published`` / ``msgs_acked`` (PUBACKs);
* ``msgs_stored``: telemetry rows the store gained; ``lost`` = expected - stored;
* ``duplicates``: messages the ingest worker got more than once (its own stats);
* ``gaps`` / ``gap_msgs``: seq holes the store reports for the bench's devices (holes between
  stored seqs only: the devices send no state watermark, so a lost head or tail of a
  stream shows in ``lost``, not here);
* ``publish_lag_max_ms``: how late the single bench thread sent its most delayed message
  (if this grows, the bench, not the fleet, is the bottleneck);
* ``fleet_cpu_pct`` / ``broker_cpu_pct`` / ``bench_cpu_pct``: CPU of the ingest service (with
  its store process), the broker and this process over the publishing window, in percent
  of one core.

Target: 1,000 devices for 60 s (the default), none lost. ``--quick``: 200 devices for 15 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from fleet.store import Store, open_store
from tests.support.mosquitto import Mosquitto
from wire import SignalStats, TelemetryMsg, encode, topic

SITE = "bench"
WAVE = 100
CONNECT_TIMEOUT_S = 60.0
ACK_WAIT_S = 30.0
STORE_WAIT_S = 30.0
SIGNALS = 8
#: Descriptors besides the device sockets (store, logs, pipes, psutil's /proc reads).
FD_MARGIN = 256


@dataclass(eq=False)
class Device:
    """One simulated device: its client and its seq stream."""

    name: str
    client: mqtt.Client
    topic: str
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    seq: int = 0
    connected: bool = False
    refused: str | None = None
    acked: int = 0
    ack_failures: int = 0
    disconnects: int = 0

    def next_message(self) -> bytes:
        seq = self.seq
        self.seq += 1
        msg = TelemetryMsg(
            device=self.name,
            boot_id=self.boot_id,
            seq=seq,
            t_ns=time.time_ns(),
            period_ns=1_000_000_000,
            keyframe=seq % 10 == 0,
            signals={
                f"s{k}": SignalStats(1.0 * k, 0.0, 2.0 * k, 1.5 * k, 100) for k in range(SIGNALS)
            },
        )
        return encode(msg)


class Fleet:
    """N device clients driven from the calling thread over one selector."""

    def __init__(self, host: str, port: int, count: int, tag: str) -> None:
        self.host = host
        self.port = port
        self.sel = selectors.DefaultSelector()
        self.devices = [self._make(f"{tag}-{i:05d}") for i in range(count)]
        self.connect_errors = 0
        self.last_error: str | None = None

    # --- paho's external-loop hooks -------------------------------------------------------

    def _on_open(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self.sel.register(sock, selectors.EVENT_READ, client)

    def _on_close(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        # Never registered, or closed twice: nothing to undo.
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(sock)

    def _on_want_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, client)

    def _on_done_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.modify(sock, selectors.EVENT_READ, client)

    # --- MQTT callbacks -------------------------------------------------------------------

    @staticmethod
    def _on_connect(
        client: mqtt.Client,
        dev: Device,
        flags: mqtt.ConnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if reason_code.is_failure:
            dev.refused = str(reason_code)
        else:
            dev.connected = True

    @staticmethod
    def _on_disconnect(
        client: mqtt.Client,
        dev: Device,
        flags: mqtt.DisconnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if not dev.connected and dev.refused is None:
            dev.refused = f"closed before CONNACK: {reason_code}"
        dev.connected = False
        dev.disconnects += 1

    @staticmethod
    def _on_publish(
        client: mqtt.Client,
        dev: Device,
        mid: int,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if reason_code.is_failure:
            dev.ack_failures += 1
        else:
            dev.acked += 1

    def _make(self, name: str) -> Device:
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5, userdata=None
        )
        dev = Device(name=name, client=client, topic=topic(SITE, name, "telemetry"))
        client.user_data_set(dev)
        client.on_socket_open = self._on_open
        client.on_socket_close = self._on_close
        client.on_socket_register_write = self._on_want_write
        client.on_socket_unregister_write = self._on_done_write
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        return dev

    # --- driving --------------------------------------------------------------------------

    def pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` for socket events and let paho handle them."""
        for key, mask in self.sel.select(max(0.0, timeout)):
            client: mqtt.Client = key.data
            if mask & selectors.EVENT_READ:
                client.loop_read(max_packets=10)
            if mask & selectors.EVENT_WRITE:
                client.loop_write()

    def misc(self) -> None:
        """Keepalive pings and QoS retries: paho wants this about once a second."""
        for dev in self.devices:
            dev.client.loop_misc()

    def connect_all(self) -> float:
        """Connect in waves of ``WAVE``; seconds from the first connect to the last CONNACK."""
        t0 = time.monotonic()
        deadline = t0 + CONNECT_TIMEOUT_S
        for start in range(0, len(self.devices), WAVE):
            wave = self.devices[start : start + WAVE]
            for dev in wave:
                try:
                    dev.client.connect(self.host, self.port, keepalive=60, clean_start=True)
                except OSError as exc:
                    self.connect_errors += 1
                    dev.refused = f"connect: {exc}"
                    self.last_error = f"{dev.name}: {exc}"
            while time.monotonic() < deadline and not all(d.connected or d.refused for d in wave):
                self.pump(0.05)
        while time.monotonic() < deadline and not all(
            d.connected or d.refused for d in self.devices
        ):
            self.pump(0.05)
        return time.monotonic() - t0

    def require_connected(self) -> None:
        """Raise RuntimeError naming the last failure unless every device is connected."""
        down = [d for d in self.devices if not d.connected]
        if down:
            why = self.last_error or next((d.refused for d in down if d.refused), None)
            raise RuntimeError(
                f"only {len(self.devices) - len(down)} of {len(self.devices)} devices "
                f"connected; last error: {why or 'no CONNACK within the timeout'}"
            )

    def run(self, seconds: float, rate: float = 1.0) -> tuple[int, float]:
        """Each device publishes ``rate`` times a second for ``seconds``, the devices' turns
        spread evenly over each period. Returns (messages published, worst lateness in s)."""
        n = len(self.devices)
        total = int(n * seconds * rate)
        period = 1.0 / rate
        t0 = time.monotonic() + 0.5
        k = 0
        published = 0
        worst = 0.0
        next_misc = time.monotonic() + 1.0
        while k < total:
            now = time.monotonic()
            due = t0 + (k // n + (k % n) / n) * period
            while k < total and due <= now:
                dev = self.devices[k % n]
                worst = max(worst, now - due)
                info = dev.client.publish(dev.topic, dev.next_message(), qos=1)
                if info.rc == mqtt.MQTT_ERR_SUCCESS:
                    published += 1
                else:
                    self.last_error = f"{dev.name}: publish failed: {mqtt.error_string(info.rc)}"
                k += 1
                due = t0 + (k // n + (k % n) / n) * period
            if now >= next_misc:
                self.misc()
                next_misc = now + 1.0
            self.pump(min(due - time.monotonic(), 0.05) if k < total else 0.0)
        return published, worst

    def acked(self) -> int:
        return sum(d.acked for d in self.devices)

    def settle(self, until: Any, timeout: float) -> None:
        """Keep the clients alive until ``until()`` is true or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        next_misc = 0.0
        while time.monotonic() < deadline and not until():
            if time.monotonic() >= next_misc:
                self.misc()
                next_misc = time.monotonic() + 1.0
            self.pump(0.05)

    def close(self) -> None:
        for dev in self.devices:
            if dev.connected:
                dev.client.disconnect()
        self.settle(lambda: not any(d.client.want_write() for d in self.devices), 5.0)
        for dev in self.devices:
            sock = dev.client.socket()
            if sock is not None:
                self._on_close(dev.client, dev, sock)
                sock.close()
        self.sel.close()


def _cpu_s(proc: psutil.Process, with_children: bool) -> float:
    procs = [proc, *(proc.children(recursive=True) if with_children else [])]
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def _unusual(log: str) -> str:
    """The broker log without its one-line-per-client connect / disconnect notices."""
    routine = ("New connection from", "New client connected", "disconnected.")
    return "\n".join(line for line in log.splitlines() if not any(r in line for r in routine))


def _raise_nofile(devices: int) -> int:
    """Raise the fd limit (inherited by the broker and the ingest service): the bench and the
    broker each hold one socket per device. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = devices + FD_MARGIN
    if hard != resource.RLIM_INFINITY and hard < need:
        # Only a privileged process may raise the hard limit; otherwise the check below
        # reports the shortfall before anything starts.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
            soft, hard = need, need
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _start_ingest(broker: Mosquitto, url: str, workdir: Path) -> tuple[subprocess.Popen[str], Path]:
    log = workdir / "ingest.log"
    cmd = [
        sys.executable,
        "-c",
        "from fleet.cli import main; main()",
        "serve",
        "--http",
        "127.0.0.1:0",
        "--store",
        url,
        "--broker",
        f"{broker.host}:{broker.port}",
        "--workers",
        "1",
        "--client-id",
        "bench-fleet-ingest",
        "--json",
    ]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    return proc, log


def _wait_ingest_ready(broker: Mosquitto, url: str, proc: subprocess.Popen[str]) -> None:
    """Publish probe messages (another device) until one is stored: then the ingest's
    shared subscriptions exist and nothing the devices send can miss them."""
    probe = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-probe", protocol=mqtt.MQTTv5)
    probe.connect(broker.host, broker.port)
    probe.loop_start()
    store = open_store(url)
    boot = uuid.uuid4().hex
    try:
        deadline = time.monotonic() + 60
        seq = 0
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"fleet serve exited with {proc.returncode}")
            msg = TelemetryMsg(
                device="bench-probe",
                boot_id=boot,
                seq=seq,
                t_ns=time.time_ns(),
                period_ns=1_000_000_000,
                keyframe=True,
                signals={},
            )
            probe.publish(topic(SITE, "bench-probe", "telemetry"), encode(msg), qos=1)
            seq += 1
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                try:
                    if store.counts()["telemetry"] > 0:
                        return
                except Exception:  # noqa: BLE001 - the schema may not exist yet
                    pass
                time.sleep(0.05)
        raise RuntimeError("fleet serve stored no probe message within 60 s")
    finally:
        store.close()
        probe.disconnect()
        probe.loop_stop()


def _stop_ingest(proc: subprocess.Popen[str]) -> dict[str, Any]:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        return {}
    stats: dict[str, Any] = json.loads(lines[-1])
    return stats


def orchestrate(devices: int, seconds: int, as_json: bool) -> int:
    def say(text: str) -> None:
        if not as_json:
            print(text, flush=True)

    nofile = _raise_nofile(devices)
    figures: dict[str, Any] = {"devices": devices, "seconds": seconds, "rlimit_nofile": nofile}
    if nofile != resource.RLIM_INFINITY and nofile < devices + FD_MARGIN:
        figures["error"] = (
            f"RLIMIT_NOFILE is {nofile}; {devices} devices need at least "
            f"{devices + FD_MARGIN} (raise the hard limit: ulimit -Hn)"
        )
        print(json.dumps(figures))
        return 1
    expected = devices * seconds
    figures["msgs_expected"] = expected
    me = psutil.Process()
    with tempfile.TemporaryDirectory(prefix="bench-devices-") as tmp:
        work = Path(tmp)
        url = f"sqlite://{work}/fleet.db"
        broker = Mosquitto(work / "broker", extra="max_connections -1\n")
        broker.start()
        ingest: subprocess.Popen[str] | None = None
        fleet: Fleet | None = None
        ingest_log = work / "ingest.log"
        store: Store | None = None
        try:
            ingest, ingest_log = _start_ingest(broker, url, work)
            _wait_ingest_ready(broker, url, ingest)
            store = db = open_store(url)
            baseline = db.counts()["telemetry"]
            fleet = f = Fleet(broker.host, broker.port, devices, "dev")
            say(f"connecting {devices} devices in waves of {WAVE} ...")
            figures["connect_s"] = round(fleet.connect_all(), 3)
            connected = sum(d.connected for d in fleet.devices)
            figures["connected"] = connected
            figures["connect_errors"] = fleet.connect_errors
            refused = [d.refused for d in fleet.devices if d.refused]
            figures["refused"] = len(refused)
            say(f"{connected}/{devices} connected in {figures['connect_s']} s")
            # Publishing with part of the fleet would measure something else.
            fleet.require_connected()
            assert broker.proc is not None
            bproc = psutil.Process(broker.proc.pid)
            iproc = psutil.Process(ingest.pid)
            cpu0 = (_cpu_s(iproc, True), _cpu_s(bproc, False), _cpu_s(me, False))
            w0 = time.monotonic()
            say(f"publishing 1 msg/s per device for {seconds} s ...")
            published, worst = fleet.run(seconds)
            wall = time.monotonic() - w0
            cpu1 = (_cpu_s(iproc, True), _cpu_s(bproc, False), _cpu_s(me, False))
            fleet.settle(lambda: f.acked() >= published, ACK_WAIT_S)

            def stored() -> int:
                return db.counts()["telemetry"] - baseline

            deadline = time.monotonic() + STORE_WAIT_S
            while stored() < expected and time.monotonic() < deadline:
                fleet.settle(lambda: False, 0.2)
            figures["msgs_published"] = published
            figures["msgs_acked"] = fleet.acked()
            figures["ack_failures"] = sum(d.ack_failures for d in fleet.devices)
            figures["msgs_stored"] = stored()
            figures["lost"] = expected - figures["msgs_stored"]
            gaps = [g for g in db.gaps() if g.device.startswith("dev-")]
            figures["gaps"] = len(gaps)
            figures["gap_msgs"] = sum(g.last_missing - g.first_missing + 1 for g in gaps)
            figures["disconnects"] = sum(d.disconnects for d in fleet.devices)
            figures["publish_lag_max_ms"] = round(worst * 1000, 1)
            figures["fleet_cpu_pct"] = round(100 * (cpu1[0] - cpu0[0]) / wall, 1)
            figures["broker_cpu_pct"] = round(100 * (cpu1[1] - cpu0[1]) / wall, 1)
            figures["bench_cpu_pct"] = round(100 * (cpu1[2] - cpu0[2]) / wall, 1)
            db.close()
            store = None
            fleet.close()
            fleet = None
            stats = _stop_ingest(ingest)
            ingest = None
            workers = stats.get("workers", [])
            figures["duplicates"] = sum(w.get("duplicates", 0) for w in workers)
            figures["ingest_dropped"] = sum(w.get("dropped", 0) for w in workers)
            figures["ingest_quarantined"] = sum(
                sum(w.get("quarantined", {}).values()) for w in workers
            )
            problems = fleet_errors(figures)
            if problems:
                figures["error"] = problems
        except Exception as exc:  # noqa: BLE001 - report what broke, with the logs' tails
            figures["error"] = f"{type(exc).__name__}: {exc}"
            if fleet is not None:  # frees its sockets first, in case fds ran out
                fleet.close()
                fleet = None
            figures["broker_log_tail"] = _unusual(broker.log())[-800:]
            if ingest_log.exists():
                figures["ingest_log_tail"] = ingest_log.read_text()[-800:]
        finally:
            if store is not None:
                store.close()
            if fleet is not None:
                fleet.close()
            if ingest is not None:
                _stop_ingest(ingest)
            broker.stop()
    say(
        f"stored {figures.get('msgs_stored')} of {expected}, lost {figures.get('lost')}, "
        f"duplicates {figures.get('duplicates')}, gaps {figures.get('gaps')}; CPU: ingest "
        f"{figures.get('fleet_cpu_pct')} %, broker {figures.get('broker_cpu_pct')} %, bench "
        f"{figures.get('bench_cpu_pct')} %"
    )
    print(json.dumps(figures))
    ok = "error" not in figures and figures.get("lost") == 0 and figures.get("duplicates") == 0
    return 0 if ok else 1


def fleet_errors(figures: dict[str, Any]) -> str | None:
    """Why the run does not meet the target beyond ``lost``, or None."""
    problems = []
    if figures.get("connected") != figures["devices"]:
        problems.append(f"only {figures.get('connected')} of {figures['devices']} connected")
    if figures.get("disconnects"):
        problems.append(f"{figures['disconnects']} disconnects")
    return "; ".join(problems) or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet_devices", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument("--quick", action="store_true", help="200 devices for 15 s")
    parser.add_argument(
        "--json", action="store_true", help="figures as one JSON object on the last line"
    )
    parser.add_argument("--devices", type=int, default=None, help="devices (default 1000)")
    parser.add_argument("--seconds", type=int, default=None, help="publishing time (default 60)")
    args = parser.parse_args(argv)
    devices = args.devices or (200 if args.quick else 1000)
    seconds = args.seconds or (15 if args.quick else 60)
    if devices < 1 or seconds < 1:
        parser.error("--devices and --seconds must be at least 1")
    return orchestrate(devices, seconds, args.json)


if __name__ == "__main__":
    sys.exit(main())
