"""edge_agent.sdnotify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent.sdnotify import (
    STATUS_MAX_CHARS,
    Notifier,
    ProgressWatch,
    watchdog_interval_s,
    watchdog_loop,
)

pytestmark = pytest.mark.peers

STAGES = ("perception", "reasoning")


@pytest.fixture
def systemd_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket (what systemd listens on) and its path."""
    path = str(tmp_path / "notify")
    assert len(path) < 100, "AF_UNIX paths are limited to 107 bytes"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    yield sock, path
    sock.close()


def recv(sock: socket.socket) -> bytes:
    return sock.recv(65536)


def test_each_message_arrives_as_one_exact_datagram(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    rx, path = systemd_socket
    with Notifier.from_env({"NOTIFY_SOCKET": path}) as n:
        assert n.enabled
        assert n.address == path
        assert n.ready()
        assert recv(rx) == b"READY=1"
        assert n.ready("running: 2 sources, model motor_drive 1.0")
        assert recv(rx) == b"READY=1\nSTATUS=running: 2 sources, model motor_drive 1.0"
        assert n.status("degraded: rules only")
        assert recv(rx) == b"STATUS=degraded: rules only"
        assert n.watchdog()
        assert recv(rx) == b"WATCHDOG=1"
        assert n.stopping()
        assert recv(rx) == b"STOPPING=1"
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        assert n.reloading()
        first, second = recv(rx).split(b"\n")
        assert first == b"RELOADING=1"
        key, _, usec = second.partition(b"=")
        assert key == b"MONOTONIC_USEC"
        assert before <= int(usec) <= before + 10_000_000
        assert n.send("STATUS=a", "EXTEND_TIMEOUT_USEC=5000000")
        assert recv(rx) == b"STATUS=a\nEXTEND_TIMEOUT_USEC=5000000"
        assert (n.sent, n.failures) == (7, 0)
    assert not n.enabled
    assert not n.watchdog()


def test_abstract_socket_name() -> None:
    name = f"edgefleet-test-{uuid.uuid4().hex}"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind("\0" + name)
    rx.settimeout(2.0)
    with rx, Notifier.from_env({"NOTIFY_SOCKET": "@" + name}) as n:
        assert n.address == "\0" + name
        assert n.ready("up")
        assert recv(rx) == b"READY=1\nSTATUS=up"
        assert n.watchdog()
        assert recv(rx) == b"WATCHDOG=1"


def test_status_cannot_smuggle_assignments_and_stays_short(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    rx, path = systemd_socket
    with Notifier.from_env({"NOTIFY_SOCKET": path}) as n:
        n.status("bad reading\nREADY=1")
        assert recv(rx) == b"STATUS=bad reading READY=1"
        n.status("x" * 5000)
        got = recv(rx).decode()
        assert len(got) == len("STATUS=") + STATUS_MAX_CHARS
        assert got.endswith("...")


@pytest.mark.parametrize("value", [None, "", "relative/notify", "@", "vsock:2:1234"])
def test_disabled_without_a_usable_notify_socket(value: str | None) -> None:
    env = {} if value is None else {"NOTIFY_SOCKET": value}
    n = Notifier.from_env(env)
    assert not n.enabled
    assert n.address is None
    assert not n.ready("x")
    assert not n.status("x")
    assert not n.watchdog()
    assert not n.stopping()
    assert not n.reloading()
    assert not n.send("READY=1")
    assert (n.sent, n.failures) == (0, 0)
    n.close()


def test_default_environment_is_read() -> None:
    # pytest is not run by systemd with NOTIFY_SOCKET set, so this one is disabled too.
    assert Notifier.from_env().enabled == bool(os.environ.get("NOTIFY_SOCKET"))


def test_send_to_a_vanished_socket_is_counted_not_raised(
    systemd_socket: tuple[socket.socket, str], caplog: pytest.LogCaptureFixture
) -> None:
    rx, path = systemd_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.watchdog()
    rx.close()
    Path(path).unlink()
    with caplog.at_level(logging.DEBUG, logger="edge_agent.sdnotify"):
        assert not n.watchdog()
        assert not n.status("still here")
        assert not n.stopping()
    assert (n.sent, n.failures) == (1, 3)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert path in warnings[0].getMessage()
    n.close()


def test_send_recovers_when_the_socket_comes_back(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    rx, path = systemd_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    rx.close()
    Path(path).unlink()
    assert not n.watchdog()
    # systemd re-executing keeps the path; the next datagram must find the new socket.
    again = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    again.bind(path)
    again.settimeout(2.0)
    with again:
        assert n.watchdog()
        assert recv(again) == b"WATCHDOG=1"
    n.close()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": ""}, None),
        ({"WATCHDOG_USEC": "10000000"}, 5.0),
        ({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "4242"}, 5.0),
        ({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "4243"}, None),
        ({"WATCHDOG_USEC": "3"}, 1.5e-6),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval_s(env, pid=4242) == expected


@pytest.mark.parametrize(
    "env",
    [
        {"WATCHDOG_USEC": "ten"},
        {"WATCHDOG_USEC": "0"},
        {"WATCHDOG_USEC": "-5"},
        {"WATCHDOG_USEC": " 10"},
        {"WATCHDOG_USEC": "1_000"},
        {"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "me"},
    ],
)
def test_watchdog_interval_junk_is_off_with_a_warning(
    env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="edge_agent.sdnotify"):
        assert watchdog_interval_s(env, pid=4242) is None
    assert len(caplog.records) == 1
    assert "WATCHDOG_" in caplog.records[0].getMessage()


def test_watchdog_interval_defaults_to_our_pid() -> None:
    env = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval_s(env) == 1.0


def test_progress_first_check_only_records() -> None:
    w = ProgressWatch(STAGES)
    assert w.check({"perception": 5, "reasoning": 5}, 0.0) == (False, "")
    # Compared with the first check, not with zero: nothing moved yet.
    ok, reason = w.check({"perception": 5, "reasoning": 5}, 1.0)
    assert not ok
    assert "perception stalled" in reason
    assert "reasoning stalled" in reason


def test_progress_pings_when_every_stage_advanced() -> None:
    w = ProgressWatch(STAGES)
    w.check({"perception": 0, "reasoning": 0}, 0.0)
    assert w.check({"perception": 8, "reasoning": 8}, 5.0) == (True, "")
    assert w.check({"perception": 16, "reasoning": 15}, 10.0) == (True, "")


def test_progress_names_the_stalled_stage() -> None:
    w = ProgressWatch(STAGES)
    w.check({"perception": 100, "reasoning": 1230}, 0.0)
    assert w.check({"perception": 108, "reasoning": 1234}, 5.0) == (True, "")
    ok, reason = w.check({"perception": 111, "reasoning": 1234}, 7.1)
    assert not ok
    assert reason == "reasoning stalled: no progress for 2.1 s (counter 1234)"
    assert w.check({"perception": 115, "reasoning": 1234}, 9.0) == (
        False,
        "reasoning stalled: no progress for 4.0 s (counter 1234)",
    )
    # Reasoning moves again; perception moved during the failed checks, which still counts.
    assert w.check({"perception": 115, "reasoning": 1235}, 11.0) == (True, "")
    assert w.check({"perception": 115, "reasoning": 1236}, 13.0) == (
        False,
        "perception stalled: no progress for 4.0 s (counter 115)",
    )


def test_progress_every_stalled_stage_is_named() -> None:
    w = ProgressWatch(("perception", "memory", "reasoning"))
    w.check({"perception": 1, "memory": 1, "reasoning": 1}, 0.0)
    ok, reason = w.check({"perception": 2, "memory": 1, "reasoning": 1}, 3.0)
    assert not ok
    assert reason == (
        "memory stalled: no progress for 3.0 s (counter 1); "
        "reasoning stalled: no progress for 3.0 s (counter 1)"
    )


def test_progress_counter_reset_counts_as_advance() -> None:
    w = ProgressWatch(STAGES)
    w.check({"perception": 500, "reasoning": 499}, 0.0)
    assert w.check({"perception": 3, "reasoning": 2}, 5.0) == (True, "")
    # ... but a reset counter that then stays put is a stall like any other.
    assert w.check({"perception": 3, "reasoning": 9}, 10.0) == (
        False,
        "perception stalled: no progress for 5.0 s (counter 3)",
    )


def test_progress_missing_counter_is_a_stall() -> None:
    w = ProgressWatch(STAGES)
    w.check({"perception": 1}, 0.0)
    ok, reason = w.check({"perception": 2}, 1.0)
    assert not ok
    assert reason == "reasoning stalled: no counter"
    # Appearing at last is progress.
    assert w.check({"perception": 3, "reasoning": 0}, 2.0) == (True, "")


def test_progress_refuses_no_stages_and_duplicates() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ProgressWatch([])
    with pytest.raises(ValueError, match="duplicate"):
        ProgressWatch(["perception", "perception"])


def test_watchdog_loop_refuses_a_bad_interval() -> None:
    async def main() -> None:
        await watchdog_loop(Notifier(None), lambda: {}, STAGES, 0.0)

    with pytest.raises(ValueError, match="interval_s"):
        asyncio.run(main())


def test_watchdog_loop_pings_on_progress_only(
    systemd_socket: tuple[socket.socket, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Pings at the interval, silence and a STATUS naming the stage on a stall, then pings."""
    rx, path = systemd_socket
    rx.setblocking(False)
    interval = 0.05
    counts = dict.fromkeys(STAGES, 0)
    frozen: set[str] = set()

    async def produce() -> None:
        # Windows every 5 ms, ten per watchdog interval.
        while True:
            await asyncio.sleep(0.005)
            for stage in counts:
                if stage not in frozen:
                    counts[stage] += 1

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def message(timeout: float = 2.0) -> list[str]:
            data = await asyncio.wait_for(loop.sock_recv(rx, 65536), timeout)
            return data.decode().split("\n")

        n = Notifier.from_env({"NOTIFY_SOCKET": path})
        producer = asyncio.create_task(produce(), name="producer")
        started = time.monotonic()
        watchdog = asyncio.create_task(
            watchdog_loop(n, lambda: counts, STAGES, interval), name="watchdog"
        )
        try:
            # Progress: nothing but pings, one per interval (the first check only records).
            for _ in range(8):
                assert await message() == ["WATCHDOG=1"]
            mean_gap = (time.monotonic() - started) / 8
            assert interval * 0.9 <= mean_gap <= interval * 2.5

            # Reasoning freezes: at most the ping already earned, then one STATUS, no pings.
            frozen.add("reasoning")
            earned = 0
            while (got := await message()) == ["WATCHDOG=1"]:
                earned += 1
            assert earned <= 1
            assert len(got) == 1
            assert got[0].startswith("STATUS=reasoning stalled: no progress for ")
            assert got[0].endswith(f" s (counter {counts['reasoning']})")
            assert "perception" not in got[0]
            with pytest.raises(TimeoutError):
                await message(timeout=interval * 6)  # not one datagram while stalled

            # Unfrozen: the next check pings and says so in the status line.
            frozen.clear()
            assert await message() == ["WATCHDOG=1", "STATUS=running"]
            for _ in range(3):
                assert await message() == ["WATCHDOG=1"]
            assert n.failures == 0
        finally:
            watchdog.cancel()
            producer.cancel()
            await asyncio.gather(watchdog, producer, return_exceptions=True)
            n.close()
        assert watchdog.cancelled()

    with caplog.at_level(logging.INFO, logger="edge_agent.sdnotify"):
        asyncio.run(main())
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [lvl for lvl, _ in levels] == [logging.WARNING, logging.INFO]
    assert "reasoning stalled" in levels[0][1]


def test_watchdog_loop_without_systemd_is_harmless() -> None:
    """Disabled notifier: the loop still runs its checks and sends nothing."""
    counts = {"perception": 0, "reasoning": 0}
    now = [0.0]

    def counters() -> dict[str, int]:
        counts["perception"] += 1
        return counts

    async def main() -> None:
        task = asyncio.create_task(
            watchdog_loop(Notifier(None), counters, STAGES, 0.01, clock=lambda: now[0])
        )
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert counts["perception"] > 3
