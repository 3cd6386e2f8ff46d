"""``python -m models.train --acquisition-from agent.toml`` (issue 20, item 3): the config's
acquisition becomes the data sets' and the manifest's, so the model it trains passes the
input contract against that config. TensorFlow is not in the test venv: this checks the
plumbing (config -> acquisition -> windows -> contract) up to the training itself."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from bench.detection import PROFILES, TRAINED
from edge_agent.acquisition import config_acquisition, contract_report
from edge_agent.config import load_config
from models import load_model, train
from models.acquisition import Acquisition
from models.contract import check_contract
from models.dataset import FIELD_BUSES, SIGNALS, WindowSet

ROOT = Path(__file__).resolve().parents[1]
MODBUS_100 = PROFILES["modbus_100ms"]


def test_the_example_config_is_the_acquisition_the_shipped_model_was_trained_for() -> None:
    acq = train.acquisition_from(ROOT / "examples" / "agent.toml")
    assert acq.name == "agent.toml"
    assert list(acq.signals) == list(SIGNALS)
    for name, learned in FIELD_BUSES.signals.items():
        got = acq.signals[name]
        assert (got.kind, got.period_ms, got.quantum, got.deadband, got.heartbeat_ms) == (
            learned.kind,
            learned.period_ms,
            learned.quantum,
            learned.deadband,
            learned.heartbeat_ms,
        ), name
        assert got.jitter_ms == learned.jitter_ms, name


def test_a_modbus_only_config_gives_its_polls_and_a_manifest_that_passes_its_contract() -> None:
    acq = train.acquisition_from(MODBUS_100)
    assert {a.period_ms for a in acq.signals.values()} == {100.0}
    assert {a.kind for a in acq.signals.values()} == {"modbus"}
    assert acq.signals["speed"].quantum == 1.0
    assert acq.signals["current"].quantum == 0.0  # float32
    # What the manifest records (training.acquisition), read back as the agent reads it,
    # against what the config delivers: nothing to refuse. The shipped model's record
    # against the same config is refused (tests/test_contract.py says why).
    recorded = Acquisition.from_description(acq.describe())
    delivered = {
        s: d.acquisition for s, d in config_acquisition(load_config(MODBUS_100).sources).items()
    }
    findings = check_contract(recorded.signals, delivered, grid_ms=10.0)
    assert [f for f in findings if f.severity == "error"] == []
    shipped = check_contract(FIELD_BUSES.signals, delivered, grid_ms=10.0)
    assert any(f.severity == "error" for f in shipped)


def test_the_data_sets_are_made_through_the_config_acquisition() -> None:
    modbus = train.acquisition_from(MODBUS_100)
    seeds = [300]
    via_config: WindowSet = train._make_set(seeds, 1, modbus)
    default: WindowSet = train._make_set(seeds, 1)
    assert np.array_equal(via_config.labels, default.labels)  # same plan, other acquisition

    def changes(ws: WindowSet, col: int) -> float:
        normal = ws.values[ws.labels == 0][:, :, col]
        return float((np.diff(normal, axis=1) != 0).mean())

    current = SIGNALS.index("current")
    # Polled every 100 ms, current changes on ~1 grid step in 10; over CAN at 10 ms, on
    # nearly every step.
    assert changes(via_config, current) < 0.15
    assert changes(default, current) > 0.8
    cont = train._continuous([(160_001, 150.0, 0.02)], 1, modbus)
    assert cont.shape == (round(0.02 * 3600 * 100 / 64), 64, 6)
    assert (np.diff(cont[:, :, current], axis=1) != 0).mean() < 0.15
    # The cache keeps each acquisition's sets apart.
    assert train.acquisition_key(modbus) != train.acquisition_key(FIELD_BUSES)


def test_a_config_that_cannot_be_trained_for_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = MODBUS_100.read_text().replace(
        '  { name = "temperature", address = 6, type = "int16", scale = 0.1 },\n', ""
    )
    text = text.replace('"temperature", "vibration"]', '"vibration"]')
    bad = tmp_path / "no-temperature.toml"
    bad.write_text(text)
    with pytest.raises(SystemExit) as exc:
        train.main(["--acquisition-from", str(bad)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--acquisition-from {bad}: no source gives temperature" in err
    # A config the agent refuses is refused here with the agent's own words.
    bad.write_text(MODBUS_100.read_text().replace("poll_ms = 100", 'poll_ms = "100"'))
    with pytest.raises(SystemExit):
        train.main(["--acquisition-from", str(bad)])
    err = capsys.readouterr().err
    assert f"--acquisition-from {bad}: " in err
    assert "poll_ms" in err


def test_where_a_model_for_a_config_goes_by_default() -> None:
    assert train._dir_name(train.VARIANTS["default"], MODBUS_100) == (
        "motor_drive_modbus_only_100ms"
    )
    assert train._dir_name(train.VARIANTS["slow"], Path("site.toml")) == "motor_drive_slow_site"
    assert not math.isnan(train.acquisition_from(MODBUS_100).signals["voltage"].period_ms)


@pytest.mark.parametrize("profile", ["modbus_100ms_trained", "modbus_10ms_trained"])
def test_a_model_trained_for_a_modbus_config_serves_it_and_not_the_example(profile: str) -> None:
    """``models/motor_drive_modbus_only_{100,10}ms``: trained with ``--acquisition-from``
    the bench's Modbus-only configs; check-config's contract accepts each for its config and
    refuses it for the example config's CAN signals (the shipped model's, the other way)."""
    base, model_dir = TRAINED[profile]
    config = PROFILES[base]
    model = load_model(model_dir)
    acq = model.manifest.acquisition
    assert acq is not None
    assert acq.name == config.name
    modbus = load_config(config)
    report = contract_report(modbus.sources, grid_ms=10.0, manifest=model.manifest)
    assert report.checked
    assert not report.errors
    example = load_config(ROOT / "examples" / "agent.toml")
    report = contract_report(example.sources, grid_ms=10.0, manifest=model.manifest)
    assert report.refused
    assert any(f.signal in ("current", "voltage") for f in report.errors)
