"""The model's input contract (issue 20, item 1): the pure check, the config's side of it,
and every place it is enforced (check-config, start, hot swap, OTA before staging) or run
anyway (``[reasoning] acquisition = "accept-mismatch"``).

Real parts: the committed model and manifest, the example config and DBC, the issue's own
Modbus-only register map against the simulator, signed bundles through the real verifier.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from edge_agent.acquisition import config_acquisition, contract_check, contract_report
from edge_agent.cli import app
from edge_agent.compose import build_agent
from edge_agent.config import load_config, parse_config
from edge_agent.errors import ModelMismatch
from edge_agent.reasoning import ReasoningStage
from edge_agent.simwindows import plant_windows
from models import DEFAULT_MODEL_DIR, load_model
from models.acquisition import Acquisition, SignalAcquisition
from models.contract import check_contract
from models.dataset import FIELD_BUSES, SIGNALS
from models.input_stats import InputStats, SignalInputStats
from ota.errors import ActivationError
from tests.support.agent import example_config
from tests.support.ota import Signer, model_members
from tests.support.ota_agent import installed_of, ota_config
from tests.support.ports import free_port
from wire.messages import DecisionMsg, decode, encode

pytestmark = pytest.mark.peers

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples"
GRID = 10.0

# -- the pure check ------------------------------------------------------------------------


def can(period: float, quantum: float = 0.01) -> SignalAcquisition:
    return SignalAcquisition("can STATUS", period, quantum, 0.0, 655.35, jitter_ms=0.7)


def poll(
    period: float, quantum: float = 0.0, deadband: float = 0.0, hb: float = 0.0
) -> SignalAcquisition:
    return SignalAcquisition(
        "modbus block", period, quantum, deadband=deadband, heartbeat_ms=hb, synced=False
    )


STATS = InputStats(
    windows=1,
    source="test",
    signals={
        "x": SignalInputStats(
            level=(0.0, 25.0),
            repeat_share=(0.0, 0.5),
            repeat_run=(0.0, 10.0),
            step=(0.03, 0.3),
            step_median=0.08,
        )
    },
)


def check(model: SignalAcquisition, config: SignalAcquisition | None) -> list[str]:
    found = check_contract({"x": model}, {"x": config}, grid_ms=GRID, stats=STATS)
    return [f"{f.severity} {f.aspect}: {f}" for f in found]


def test_the_same_acquisition_has_nothing_to_say() -> None:
    assert check(can(10.0), can(10.0)) == []
    # Within the measured tolerances: 5 % faster, 10 % slower, faster than the grid.
    assert check(can(20.0), can(19.0)) == []
    assert check(can(20.0), can(22.0)) == []
    assert check(can(10.0), can(8.0)) == []


def test_a_slower_source_is_stuck_and_a_faster_one_noisy_in_words() -> None:
    (slow,) = check(can(10.0), poll(100.0, 0.01))[:1]
    assert slow == (
        "error period: x: windows will look stuck: the model learned a value every 10 ms "
        "(can STATUS); modbus block gives one every 100 ms, held for 10 grid steps"
    )
    (fast,) = check(poll(200.0, 0.1), poll(100.0, 0.1))
    assert fast.startswith("error period: x: windows will look noisy: the model learned a value")
    assert "held for 20 grid steps" in fast
    assert "gives a new one every 100 ms" in fast
    assert check(can(20.0), can(18.0))[0].startswith("error period")


def test_resolution_deadband_hold_range_and_missing() -> None:
    # Resolution: up to half the median change (0.04) is tolerated.
    assert check(can(10.0), can(10.0, 0.04)) == []
    (coarse,) = check(can(10.0), can(10.0, 0.05))
    assert coarse.startswith("error resolution: x: windows will look stuck")
    assert "steps of 0.05" in coarse
    assert "typical changes of 0.08" in coarse
    # A deadband on a signal learned without one: up to 0.3 of the median change.
    assert check(can(10.0), poll(10.0, 0.01, deadband=0.02, hb=150.0))[0].startswith("note")
    (db,) = [f for f in check(can(10.0), poll(10.0, 0.01, 0.03, 150.0)) if f.startswith("error")]
    assert "deadband of 0.03" in db
    # A heartbeat that holds values far longer than the model saw (200 ms learned).
    learned = poll(100.0, deadband=0.5, hb=150.0)
    assert check(learned, poll(100.0, deadband=0.5, hb=500.0)) == []
    (hold,) = check(learned, poll(100.0, deadband=0.5, hb=1000.0))
    assert hold.startswith("error hold")
    assert "up to 1000 ms" in hold
    assert "at most 200 ms" in hold
    # A register that cannot carry what training saw (0..25) saturates.
    narrow = SignalAcquisition("modbus block", 10.0, 0.01, 0.0, 20.0, synced=False)
    assert any(f.startswith("error range") for f in check(can(10.0), narrow))
    (missing,) = check(can(10.0), None)
    assert missing.startswith("error missing: x: no source in this config produces it")


def test_notes_do_not_refuse() -> None:
    found = check(can(10.0), poll(10.0, 0.01))
    assert found == [
        "note source: x: modbus block reads it over modbus where the model learned can STATUS; "
        "at the same period and resolution that measured harmless"
    ]
    unknown = SignalAcquisition("can FRAME", math.nan, 0.01, 0.0, 655.35)
    (note,) = check(can(10.0), unknown)
    assert note.startswith("note unchecked")
    assert "no cycle time" in note


# -- the config's side -----------------------------------------------------------------------


def test_the_example_config_delivers_what_the_model_learned() -> None:
    cfg = load_config(EXAMPLES / "agent.toml")
    delivered = config_acquisition(cfg.sources)
    for name, learned in FIELD_BUSES.signals.items():
        got = delivered[name].acquisition
        assert (got.kind, got.period_ms, got.quantum) == (
            learned.kind,
            learned.period_ms,
            learned.quantum,
        ), name
        assert (got.deadband, got.heartbeat_ms) == (learned.deadband, learned.heartbeat_ms), name
        if math.isfinite(learned.lo):
            assert (got.lo, got.hi) == pytest.approx((learned.lo, learned.hi)), name
    assert delivered["current"].where == "sources.can[0] (DRIVE_STATUS)"
    assert delivered["temperature"].where == "sources.modbus[0].registers[1]"
    report = contract_report(cfg.sources, grid_ms=GRID, manifest=load_model().manifest)
    assert report.checked
    assert not report.findings
    assert not report.refused


def modbus_only(tmp: Path, poll_ms: int, extra: str = "") -> Path:
    """The issue's register map: the model's six signals and four more, ten registers, all
    over Modbus TCP from the simulator, polled every ``poll_ms``."""
    text = f"""
[agent]
state_dir = "{tmp / "state"}"
[perception]
signals = {json.dumps(list(SIGNALS))}
max_staleness_ms = 250
[reasoning]
{extra}
[api]
enabled = false
[ota]
enabled = false
[[sources.modbus]]
name = "drive"
port = {free_port()}
poll_ms = {poll_ms}
timeout_ms = 300
registers = [
  {{ name = "voltage", address = 0, type = "float32", order = "CDAB" }},
  {{ name = "current", address = 2, type = "float32", order = "CDAB" }},
  {{ name = "frequency", address = 4, type = "uint16", scale = 0.01 }},
  {{ name = "speed", address = 5, type = "int16" }},
  {{ name = "temperature", address = 6, type = "int16", scale = 0.1 }},
  {{ name = "vibration", address = 7, type = "uint16", scale = 0.01 }},
  {{ name = "ramp_state", address = 8, type = "bitfield", bits = 2 }},
  {{ name = "at_setpoint", address = 8, type = "bitfield", bit = 2 }},
  {{ name = "overtemp_warning", address = 8, type = "bitfield", bit = 3 }},
  {{ name = "frequency_setpoint", address = 9, type = "uint16", scale = 0.01 }},
]
"""
    path = tmp / f"modbus-{poll_ms}.toml"
    path.write_text(text)
    return path


def test_check_config_refuses_the_modbus_only_configs_with_the_reason(tmp_path: Path) -> None:
    """The issue's finding: at 100 ms every window was ``stuck``, at 10 ms ``noise``, and
    check-config said ok. Now it exits 2 and says why, per signal."""
    res = CliRunner().invoke(app, ["check-config", str(modbus_only(tmp_path, 100))])
    assert res.exit_code == 2, res.output
    lines = res.output.splitlines()
    for name, period in (("current", 10), ("frequency", 10), ("speed", 10), ("vibration", 20)):
        assert (
            f"  reasoning.acquisition: {name}: windows will look stuck: the model learned a "
            f"value every {period} ms"
        ) in res.output, name
    assert any(
        "temperature: windows will look noisy" in line and "every 200 ms" in line for line in lines
    )
    assert 'set [reasoning] acquisition = "accept-mismatch"' in res.output
    res = CliRunner().invoke(app, ["check-config", str(modbus_only(tmp_path, 10))])
    assert res.exit_code == 2, res.output
    for name in ("voltage", "temperature", "vibration"):
        assert f"reasoning.acquisition: {name}: windows will look noisy" in res.output, name
    # The example config is still fine.
    res = CliRunner().invoke(app, ["check-config", str(EXAMPLES / "agent.toml")])
    assert res.exit_code == 0, res.output


def test_accept_mismatch_passes_check_config_with_the_findings_as_notes(tmp_path: Path) -> None:
    path = modbus_only(tmp_path, 100, 'acquisition = "accept-mismatch"')
    res = CliRunner().invoke(app, ["check-config", str(path)])
    assert res.exit_code == 0, res.output
    assert "note: reasoning.acquisition: current: windows will look stuck" in res.output
    assert "(run anyway: acquisition = accept-mismatch)" in res.output
    bad = modbus_only(tmp_path, 100, 'acquisition = "accept_mismatch"')
    res = CliRunner().invoke(app, ["check-config", str(bad)])
    assert res.exit_code == 2
    assert "reasoning.acquisition: expected one of 'check' or 'accept-mismatch'" in res.output


def test_the_agent_does_not_start_on_a_config_its_model_was_not_trained_for(
    tmp_path: Path,
) -> None:
    res = CliRunner().invoke(
        app, ["run", "-c", str(modbus_only(tmp_path, 100)), "--simulate", "--duration", "1"]
    )
    assert res.exit_code == 2, res.output
    assert "does not fit this config" in res.output
    assert "\n  current: windows will look stuck" in res.output
    assert "\n  vibration: windows will look stuck" in res.output


def test_accept_mismatch_marks_every_decision_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(modbus_only(tmp_path, 100, 'acquisition = "accept-mismatch"'))
    with caplog.at_level(logging.WARNING):
        agent = build_agent(cfg)
    assert agent.stage is not None
    warned = [r for r in caplog.records if "accept-mismatch" in r.getMessage()]
    assert len(warned) == 1
    assert "current: windows will look stuck" in warned[0].getMessage()
    # The stage as the agent built it, on the simulator's windows acquired as this config
    # acquires them.
    acq = {s: d.acquisition for s, d in config_acquisition(cfg.sources).items()}
    profile = Acquisition("modbus 100 ms", {s: acq[s] for s in SIGNALS})
    decisions = [
        agent.stage.process(w, w.end_ns)
        for w in plant_windows(seed=4, seconds=5, acquisition=profile)
    ]
    assert decisions
    assert all(d.acquisition_mismatch for d in decisions)
    body = decisions[0].to_json()
    assert body["acquisition_mismatch"] is True
    msg = msgspec.convert({**body, "device": "gw", "boot_id": "0" * 32, "seq": 0}, DecisionMsg)
    assert decode("decision", encode(msg)) == msg
    health = agent.status()["reasoning"]["model_health"]["acquisition"]
    assert health["status"] == "mismatch_accepted"
    assert any(e.startswith("current: windows will look stuck") for e in health["errors"])
    # A model that fits is not marked, and says nothing extra on the wire.
    example = load_config(EXAMPLES / "agent.toml")
    fits = ReasoningStage(load_model(), agent.stage.rules, contract=contract_check(example))
    w = next(iter(plant_windows(seed=4, seconds=1)))
    d = fits.process(w, w.end_ns)
    assert not d.acquisition_mismatch
    assert "acquisition_mismatch" not in d.to_json()


def _manifest_claiming(dst: Path, **changes: float) -> Path:
    """The committed model, its manifest saying current was acquired otherwise."""
    shutil.copytree(DEFAULT_MODEL_DIR, dst)
    doc = json.loads((dst / "manifest.json").read_text())
    doc["training"]["acquisition"]["signals"]["current"].update(changes)
    (dst / "manifest.json").write_text(json.dumps(doc, indent=2))
    return dst


def test_a_hot_swap_to_a_model_trained_for_another_acquisition_is_refused(
    tmp_path: Path,
) -> None:
    cfg = example_config(free_port(), "unused")
    other = _manifest_claiming(tmp_path / "slow-current", period_ms=100.0)
    agent = build_agent(cfg)
    assert agent.stage is not None
    serving = agent.stage.model

    async def swap() -> str:
        try:
            await agent.reload_model(other)
        except ModelMismatch as exc:
            return str(exc)
        return ""

    why = asyncio.run(swap())
    assert "current: windows will look noisy" in why, why
    assert agent.stage.model is serving
    assert agent.status()["reasoning"]["swaps_refused"] == 1


def test_an_ota_model_whose_contract_the_device_cannot_meet_is_refused_before_staging(
    tmp_path: Path,
) -> None:
    signer = Signer()
    cfg, _, _ = ota_config(tmp_path, signer)
    members, tflite_sha = model_members(tmp_path, "contract")
    (tflite_name, tflite), (_, model_json) = members
    doc = json.loads(model_json)
    doc["training"]["acquisition"]["signals"]["vibration"]["period_ms"] = 100.0
    bad_json = json.dumps(doc, indent=1).encode()
    bundle = signer.bundle(
        tmp_path / "m.efb", [(tflite_name, tflite), ("model.json", bad_json)], version="1.1.0"
    )
    agent = build_agent(cfg)
    assert agent.ota is not None
    store = agent.ota.updater.store
    # What goes out on .../ota/status: each transition with its reason and detail.
    published: list[tuple[str, str, dict[str, object]]] = []
    report = agent.ota.updater.on_transition
    assert report is not None

    def observe(j: Any, reason: str, detail: dict[str, Any]) -> None:
        published.append((j.state, reason, dict(detail)))
        report(j, reason, detail)

    agent.ota.updater.on_transition = observe
    outcome = asyncio.run(agent.ota.install_file(bundle))
    assert (outcome.result, outcome.code) == ("failed", "model_contract")
    assert "vibration every 20 ms, learned 100 ms" in outcome.reason
    assert "edge-agent check-config" in outcome.reason
    # Nothing of it was staged.
    assert not store.has(tflite_sha)
    _state, reason, detail = published[-1]
    assert detail == {"event": "rejected", "code": "model_contract", "permanent": True}
    assert reason == outcome.reason
    assert agent.ota.status()["last"]["reason"] == outcome.reason
    # The same model with its committed manifest passes the check and is staged.
    good = signer.bundle(tmp_path / "g.efb", members, version="1.2.0", counter=3)
    inst = installed_of(agent, good)
    assert inst.payloads[tflite_name] == tflite_sha
    assert store.has(tflite_sha)


def test_a_config_bundle_cannot_switch_the_contract_check_live(tmp_path: Path) -> None:
    """A config bundle applies rules and thresholds between two windows; the serving model
    was checked under the old ``acquisition`` setting, so changing it needs a restart and
    the bundle is refused naming the key (not accepted and ignored)."""
    cfg, _, _ = ota_config(tmp_path, Signer())
    text = (tmp_path / "agent.toml").read_text()
    assert 'acquisition = "check"' in text
    new = parse_config(
        text.replace('acquisition = "check"', 'acquisition = "accept-mismatch"'),
        base_dir=tmp_path,
    )
    agent = build_agent(cfg)
    assert agent.ota is not None
    with pytest.raises(ActivationError, match=r"reasoning\.acquisition, which need a restart"):
        asyncio.run(agent.ota._swap_config(new))
