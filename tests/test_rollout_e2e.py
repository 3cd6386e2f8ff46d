"""Rollouts end to end: a real Mosquitto, fleet serve's ingest and rollout service, and
SimAgent devices (the agent's own uplink, updater and reasoning; simulated windows)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mqtt_broker import Mosquitto, mosquitto
from tests.rollout_support import dump, fleet, model_bundle


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with mosquitto(tmp_path / "broker") as b:
        yield b


def test_a_good_model_rolls_out_wave_by_wave_to_50_agents(
    tmp_path: Path, broker: Mosquitto
) -> None:
    labels = {"dev-00": ("", "canary"), "dev-01": ("", "canary")}
    labels |= {f"dev-{i}": ("", "critical") for i in (47, 48, 49)}
    with fleet(tmp_path, broker, 50, labels=labels) as f:
        bundle, new_sha = model_bundle(f, "v2", probation={"seconds": 1, "min_windows": 5})
        rid = f.create(bundle, waves=(0.04, 0.3, 1.0), min_devices=3, device_timeout_s=60)
        r = f.wait_state(rid, {"completed", "halted"}, timeout=120)
        assert r.state == "completed", dump(r)
        assert all(d.state == "committed" for d in r.devices.values()), dump(r)
        assert set(r.waves[0]) == {"dev-00", "dev-01"}
        assert {"dev-47", "dev-48", "dev-49"} <= set(r.waves[-1])
        assert set(f.serving().values()) == {new_sha}
        assert all(d.attempts == 1 for d in r.devices.values())
