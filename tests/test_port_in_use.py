"""A second agent, simulator or fleet service on the same ports and files: one line, printed
once, that says what is taken and which key or option sets it; never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from edge_agent.memory.store import StoreLock
from tests.support.mosquitto import mosquitto
from tests.support.ports import free_port

pytestmark = pytest.mark.peers

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@contextmanager
def taken(kind: int = socket.SOCK_STREAM) -> Iterator[int]:
    """A loopback port another process holds (listening, for TCP)."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            s.listen()
        yield int(s.getsockname()[1])


def agent_config(tmp_path: Path, *, modbus: int, api: int) -> Path:
    text = (REPO / "examples" / "agent.toml").read_text()
    for old, new in (
        ('state_dir = "../var/demo-gw-01"', f'state_dir = "{tmp_path / "state"}"'),
        ("port = 8080", f"port = {api}"),
        ("port = 15020", f"port = {modbus}"),
        ('channel = "edgefleet-demo"', f'channel = "port-test-{tmp_path.name[-12:]}"'),
    ):
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "agent.toml"
    path.write_text(text.replace('"../', f'"{REPO}/'))
    return path


def run(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def test_the_simulators_modbus_port_in_use_names_the_source_key(tmp_path: Path) -> None:
    with taken() as port:
        cfg = agent_config(tmp_path, modbus=port, api=0)
        res = run(BIN / "edge-agent", "run", "-c", cfg, "--simulate", "--duration", "5")
    assert res.returncode == 1, res.stderr
    assert last_line(res.stderr) == (
        f"edge-agent: sources.modbus[0].port: 127.0.0.1:{port} is already in use (another "
        "edge-agent --simulate?); the simulator serves the port the config reads"
    )
    assert res.stderr.count(str(port)) == 1, res.stderr  # once: no pymodbus warning too
    assert "Traceback" not in res.stderr


def test_the_health_api_port_in_use_names_api_port(tmp_path: Path) -> None:
    with taken() as port:
        cfg = agent_config(tmp_path, modbus=free_port(), api=port)
        res = run(BIN / "edge-agent", "run", "-c", cfg, "--duration", "5")
    assert res.returncode == 1, res.stderr
    assert last_line(res.stderr) == (
        f"edge-agent: api.port: 127.0.0.1:{port} is already in use (another edge-agent?); "
        "set another [api] port, or [api] enabled = false"
    )
    assert "Traceback" not in res.stderr


def test_a_health_api_host_it_cannot_bind_names_api_host(tmp_path: Path) -> None:
    cfg = agent_config(tmp_path, modbus=free_port(), api=0)
    cfg.write_text(
        cfg.read_text().replace(
            'host = "127.0.0.1"             # keep', 'host = "192.0.2.1"  # keep', 1
        )
    )
    res = run(BIN / "edge-agent", "run", "-c", cfg, "--duration", "5")
    assert res.returncode == 1, res.stderr
    last = last_line(res.stderr)
    assert last.startswith("edge-agent: api.host: the health API cannot listen on 192.0.2.1:0: ")
    assert "cannot assign requested address" in last.lower()


def test_edge_agent_simulate_names_its_option(tmp_path: Path) -> None:
    with taken() as port:
        res = run(
            BIN / "edge-agent", "simulate", "--modbus-port", str(port), "--no-can",
            "--duration", "5",
        )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip() == (
        f"edge-agent simulate: --modbus-port: 127.0.0.1:{port} is already in use "
        "(another simulator?)"
    )


def test_a_second_agent_on_the_same_state_dir_is_one_line(tmp_path: Path) -> None:
    cfg = agent_config(tmp_path, modbus=free_port(), api=0)
    lock = StoreLock(tmp_path / "state" / "memory.db").acquire()  # the first agent
    try:
        res = run(BIN / "edge-agent", "run", "-c", cfg, "--duration", "5")
    finally:
        lock.release()
    assert res.returncode == 1, res.stderr
    assert last_line(res.stderr).startswith(
        f"edge-agent: memory store {tmp_path / 'state' / 'memory.db'} is in use by process "
    )
    assert "Traceback" not in res.stderr


def test_fleet_serve_names_the_artifact_port_option_once(tmp_path: Path) -> None:
    with mosquitto(tmp_path / "broker") as broker:
        base: list[object] = [
            BIN / "fleet", "serve", "--store", tmp_path / "fleet.db", "--broker",
            f"127.0.0.1:{broker.port}", "--artifacts", tmp_path / "artifacts", "--duration",
            "20",
        ]  # fmt: skip
        with taken() as http:
            res = run(*base, "--artifact-port", str(http), "--coap-port", "0", "--http",
                      "127.0.0.1:0")  # fmt: skip
        assert res.returncode == 3, res.stderr
        assert last_line(res.stderr) == (
            f"fleet: --artifact-port: 127.0.0.1:{http} is already in use (another fleet "
            "serve?); choose another port"
        )
        assert res.stderr.count(str(http)) == 1, res.stderr
        with taken(socket.SOCK_DGRAM) as coap:
            res = run(*base, "--artifact-port", "0", "--coap-port", str(coap), "--http",
                      "127.0.0.1:0")  # fmt: skip
        assert res.returncode == 3, res.stderr
        assert last_line(res.stderr).startswith(
            f"fleet: --coap-port: 127.0.0.1:{coap} is already in use"
        )
        assert res.stderr.count(str(coap)) == 1, res.stderr
        with taken() as api:
            res = run(*base, "--artifact-port", "0", "--coap-port", "0", "--http",
                      f"127.0.0.1:{api}")  # fmt: skip
        assert res.returncode == 3, res.stderr
        assert last_line(res.stderr) == (
            f"fleet: --http: 127.0.0.1:{api} is already in use (another fleet serve?); "
            "choose another port"
        )
        res = run(*base, "--http", "localhost")
        assert res.returncode == 2, res.stderr
        assert last_line(res.stderr).startswith("fleet: --http 'localhost': expected HOST:PORT")


def test_fleet_artifacts_serve_names_its_option(tmp_path: Path) -> None:
    (tmp_path / "artifacts").mkdir()
    with taken() as http:
        res = run(
            BIN / "fleet", "artifacts", "serve", "--dir", tmp_path / "artifacts",
            "--http-port", str(http), "--coap-port", "0",
        )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip() == f"error: --http-port: 127.0.0.1:{http} is already in use"
