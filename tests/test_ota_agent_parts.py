"""Parts of the agent's OTA side, each against the real thing: model directories
materialised from the content store, and the health probe of the agent's own API.

Heavier end-to-end runs (probation, rollback, SIGKILL) are in ``test_ota_agent.py``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from edge_agent.compose import build_agent
from edge_agent.config import load_config
from edge_agent.ota import _health_url
from edge_agent.service import Agent
from models import DEFAULT_MODEL_DIR
from ota import build
from tests.support.ota import Signer, model_members
from tests.support.ota_agent import installed_of, ota_config, run_agent

pytestmark = pytest.mark.peers


def _with_thresholds(model_json: bytes, drift: float) -> bytes:
    doc = json.loads(model_json)
    doc["thresholds"]["drift"] = drift
    return json.dumps(doc, indent=1).encode()


def test_a_bundle_changing_only_model_json_serves_its_own_manifest(tmp_path: Path) -> None:
    signer = Signer()
    cfg, _, _ = ota_config(tmp_path, signer)
    members, _ = model_members(tmp_path, "thresholds")
    (tflite_name, tflite), (_, model_json) = members
    b1 = signer.bundle(
        tmp_path / "m1.efb",
        [(tflite_name, tflite), ("model.json", _with_thresholds(model_json, 0.91))],
        version="1.1.0",
        counter=2,
    )
    b2 = signer.bundle(
        tmp_path / "m2.efb",
        [(tflite_name, tflite), ("model.json", _with_thresholds(model_json, 0.93))],
        version="1.2.0",
        counter=3,
    )
    agent = build_agent(cfg)
    assert agent.ota is not None
    assert agent.stage is not None
    store = agent.ota.updater.store
    served: list[float] = []

    async def main() -> None:
        assert agent.ota is not None
        assert agent.stage is not None
        for b in (b1, b2):
            inst = installed_of(agent, b)
            assert await agent.ota.activate(inst, store)
            served.append(agent.stage.model.manifest.thresholds["drift"])

    asyncio.run(main())
    assert served == [0.91, 0.93]
    dirs = sorted((agent.ota.dir / "models").iterdir())
    drifts = sorted(
        json.loads((d / "manifest.json").read_bytes())["thresholds"]["drift"] for d in dirs
    )
    assert drifts == [0.91, 0.93]


def test_a_rollback_brings_back_the_manifest_it_names_when_models_share_a_tflite(
    tmp_path: Path,
) -> None:
    """The factory model and two bundles with the same .tflite and their own thresholds:
    every restore serves the manifest of the version it restores (the models kept in
    memory were keyed by the .tflite alone, so the factory came back with 1.1.0's)."""
    signer = Signer()
    cfg, _, _ = ota_config(tmp_path, signer)
    # The factory model's own payloads: the same .tflite bytes.
    model_dir = cfg.reasoning.model_dir or DEFAULT_MODEL_DIR
    (tflite_name, tflite), (_, model_json) = build.model_bundle_payloads(model_dir)
    bundles = [
        signer.bundle(
            tmp_path / f"m{i}.efb",
            [(tflite_name, tflite), ("model.json", _with_thresholds(model_json, drift))],
            version=f"1.{i}.0",
            counter=i + 1,
        )
        for i, drift in ((1, 0.91), (2, 0.93))
    ]
    agent = build_agent(cfg)
    assert agent.ota is not None
    assert agent.stage is not None
    factory = agent.stage.model
    assert factory.sha256 == agent.ota.factory_sha
    factory_drift = factory.manifest.thresholds["drift"]
    assert factory_drift not in (0.91, 0.93)
    store = agent.ota.updater.store
    served: list[float] = []

    async def main() -> None:
        assert agent.ota is not None
        assert agent.stage is not None
        inst = [installed_of(agent, b) for b in bundles]
        assert all(i.payloads[tflite_name] == factory.sha256 for i in inst)
        for i in inst:
            assert await agent.ota.activate(i, store)
        for back in (inst[0], None, inst[1], None):
            assert await agent.ota.restore(back, store)
            served.append(agent.stage.model.manifest.thresholds["drift"])

    asyncio.run(main())
    assert served == [0.91, factory_drift, 0.93, factory_drift]
    assert agent.stage.model is factory  # swapped back from memory, not reloaded


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8080/v1/health"),
        ("localhost", "http://localhost:8080/v1/health"),
        ("::1", "http://[::1]:8080/v1/health"),
        ("[::1]", "http://[::1]:8080/v1/health"),
        ("fd00::5", "http://[fd00::5]:8080/v1/health"),
        ("0.0.0.0", "http://127.0.0.1:8080/v1/health"),
        ("::", "http://[::1]:8080/v1/health"),
    ],
)
def test_the_health_url_brackets_ipv6_and_probes_loopback_for_a_wildcard(
    host: str, url: str
) -> None:
    assert _health_url(host, 8080) == url


@pytest.mark.parametrize("host", ["::1", "::", "0.0.0.0"])
def test_the_health_probe_reaches_the_api_bound_on(tmp_path: Path, host: str) -> None:
    signer = Signer()
    _, port, channel = ota_config(tmp_path, signer)
    text = (tmp_path / "agent.toml").read_text()
    bound = text.replace('host = "127.0.0.1"             #', f'host = "{host}"  #', 1)
    assert bound != text
    (tmp_path / "agent.toml").write_text(bound)
    cfg = load_config(tmp_path / "agent.toml")
    assert cfg.api.host == host

    async def scenario(agent: Agent) -> bool:
        assert agent.ota is not None
        return await agent.ota.health()

    healthy, _, _ = run_agent(cfg, port, channel, scenario)
    assert healthy is True
