"""A real sender process and our CanSource in another process, over udp_multicast in a netns."""

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator

import can
import pytest

from tests.support.can import REPO, load_db, reference_decode, require_subaru
from tests.support.netns import GROUP_PREFIX, in_netns, netns, netns_problem

pytestmark = pytest.mark.peers

COUNT = 600  # frames: ~0.65 s of the capture, 8 known and 27 unknown ids among them
RATE = 2000.0  # frames/s, paced: cold-start blasting loses ~1.6 % on lo


@pytest.fixture
def namespace() -> Iterator[str]:
    problem = netns_problem()
    if problem is not None:
        pytest.fail(f"cross-process CAN test needs a network namespace: {problem}")
    with netns() as name:
        yield name


def python(ns: str, *args: str) -> list[str]:
    return in_netns(ns, [sys.executable, "-m", "tests.support.can_peer", *args])


def test_samples_cross_process_boundary_with_arrival_stamps(namespace: str) -> None:
    log_path, dbc_path = require_subaru()
    group = GROUP_PREFIX + str(10 + secrets.randbelow(200))
    port = str(40_000 + secrets.randbelow(20_000))
    bus_args = ("--group", group, "--port", port)

    receiver = subprocess.Popen(
        python(namespace, "recv", "--dbc", str(dbc_path), "--expect", str(COUNT), *bus_args),
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        assert receiver.stdout.readline().strip() == "READY"
        sender = subprocess.run(
            python(
                namespace,
                "send",
                "--capture",
                str(log_path),
                "--count",
                str(COUNT),
                "--rate",
                str(RATE),
                *bus_args,
            ),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        )
        out, _ = receiver.communicate(timeout=15)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    sent_ns: list[int] = json.loads(sender.stdout)["sent_ns"]
    got = json.loads(out.strip().splitlines()[-1])
    assert receiver.returncode == 0

    # What cantools makes of the same frames, in order, each tagged with its frame index.
    db = load_db(dbc_path)
    known = {m.frame_id for m in db.messages}
    expected: list[tuple[int, str, float]] = []
    unknown_frames = 0
    for i, msg in enumerate(can.LogReader(log_path)):
        if i == COUNT:
            break
        if msg.arbitration_id not in known:
            unknown_frames += 1
            continue
        decoded = reference_decode(db, msg.arbitration_id, bytes(msg.data))
        expected.extend((i, k, v) for k, v in decoded.items())

    stats = got["stats"]
    assert stats["frames"] == COUNT, stats
    assert stats["unknown_frames"] == unknown_frames
    assert stats["decode_errors"] == 0
    assert stats["bus_errors"] == 0
    assert got["dropped"] == 0
    samples = got["samples"]
    assert [(s, v) for s, v, _ in samples] == [(s, v) for _, s, v in expected]
    # Stamped on arrival in the receiving process: after the sender's clock read for the
    # same frame (both share CLOCK_REALTIME), and soon after it.
    for (frame, _, _), (_, _, t_ns) in zip(expected, samples, strict=True):
        assert 0 <= t_ns - sent_ns[frame] < 1_000_000_000
