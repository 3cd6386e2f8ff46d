"""The updater's offers and rollbacks on a real agent: offers fetched from the fleet's own
artifact server, a silent TCP peer for a transfer in flight, bundles verified into the
agent's own store, and the agent's model loader doing the restores.

An agent that is built but not run is enough where no probation is needed (a refused offer,
a rollback); the re-offer test runs the agent against the plant simulator.
"""

from __future__ import annotations

import asyncio
import json
import socket
from datetime import UTC, datetime
from pathlib import Path

import pytest

from edge_agent.compose import build_agent
from edge_agent.config import AgentConfig, load_config
from edge_agent.service import Agent
from firmware.boot import ENV_SLOT, slot_env
from firmware.slots import SlotName, Slots
from fleet.artifacts import ArtifactServer, publish
from models import load_model
from ota import journal as ota_journal
from ota.machine import Installed, Journal, Update
from ota.store import ContentStore
from ota.trust import load_root
from ota.updater import download_name
from ota.verify import Policy, verify_bundle
from tests.support.firmware import expect_slot, install, variant
from tests.support.ota import Signer, model_members
from tests.support.ota_agent import ota_config, run_agent, until

pytestmark = pytest.mark.peers


def _config(tmp: Path, signer: Signer, old: str = "", new: str = "") -> AgentConfig:
    """The example config with a trust root, ``old`` replaced by ``new`` in its text."""
    ota_config(tmp, signer)
    path = tmp / "agent.toml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return load_config(path)


def _bundle(
    signer: Signer, tmp: Path, tag: str, counter: int, *, bundle_id: str | None = None
) -> Path:
    members, _ = model_members(tmp, tag)
    return signer.bundle(
        tmp / f"{tag}.efb",
        members,
        version=f"1.{counter}.0",
        counter=counter,
        bundle_id=bundle_id,
    )


def _verified(store: ContentStore, signer: Signer, path: Path) -> Installed:
    vb = verify_bundle(
        path,
        root=load_root(signer.root_json(), datetime.now(UTC)),
        policy=Policy("motor-drive-gw", "0.1.0", frozenset({"model:swap"})),
        floors={},
        now=datetime.now(UTC),
        store=store,
        keep_source=True,
    )
    s = vb.signed
    return Installed(
        s.bundle_id, s.kind, s.version, s.counter, vb.manifest_sha256, dict(vb.payloads)
    )


def test_an_offer_over_the_size_limit_is_refused_before_a_byte_is_fetched(
    tmp_path: Path,
) -> None:
    signer = Signer()
    cfg = _config(tmp_path, signer, "max_bundle_mb = 512", "max_bundle_mb = 1")
    (tmp_path / "art").mkdir()
    sha = publish(tmp_path / "art", _bundle(signer, tmp_path, "big", 2))
    agent = build_agent(cfg)
    assert agent.ota is not None
    up = agent.ota.updater

    async def main() -> tuple[str, str, str, int]:
        async with ArtifactServer(tmp_path / "art") as srv:
            out = await up.install_url(srv.http_url(sha), length=2 << 20, bundle_id="big")
            return out.result, out.code, out.reason, srv.stats.http_requests

    result, code, reason, requests = asyncio.run(main())
    assert (result, code) == ("failed", "malformed")
    assert f"declares {2 << 20} bytes" in reason
    assert f"limit is {1 << 20}" in reason
    assert requests == 0
    assert up.journal.state == "idle"
    assert up.journal.last is not None
    assert up.journal.last.result == "failed"
    assert not list(up.store.incoming.iterdir())


def test_a_refused_download_leaves_nothing_to_resume(tmp_path: Path) -> None:
    signer, stranger = Signer(), Signer()
    cfg, _, _ = ota_config(tmp_path, signer)
    (tmp_path / "art").mkdir()
    path = _bundle(stranger, tmp_path, "unsigned", 2)  # signed by a key the root lacks
    sha = publish(tmp_path / "art", path)
    agent = build_agent(cfg)
    assert agent.ota is not None
    up = agent.ota.updater

    async def main() -> str:
        async with ArtifactServer(tmp_path / "art") as srv:
            out = await up.install_url(
                srv.http_url(sha), length=path.stat().st_size, bundle_id="model-1.2.0"
            )
            return out.code

    assert asyncio.run(main()) == "bad_signature"
    assert not list(up.store.incoming.iterdir())


def test_the_journal_and_the_status_carry_the_url_without_its_secrets(tmp_path: Path) -> None:
    signer = Signer()
    cfg = _config(tmp_path, signer)
    agent = build_agent(cfg)
    assert agent.ota is not None
    up = agent.ota.updater
    # A peer that takes the connection and never answers: the offer stays in "fetching".
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        url = f"http://fleet:hunter2@127.0.0.1:{port}/v1/bundles/{'a' * 64}?token=s3cr3t"

        async def main() -> tuple[str, dict[str, object]]:
            task = asyncio.create_task(up.install_url(url, length=1000, bundle_id="m"))
            try:
                await until(lambda: up.journal.state == "fetching", timeout=5)
                return up.journal_path.read_text(), up.status()
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        on_disk, status = asyncio.run(main())
    for secret in ("hunter2", "fleet:", "s3cr3t", "token"):
        assert secret not in on_disk
        assert secret not in json.dumps(status)
    safe = f"http://127.0.0.1:{port}/v1/bundles/{'a' * 64}?<redacted>"
    assert json.loads(on_disk)["update"]["source"] == safe
    update = status["update"]
    assert isinstance(update, dict)
    assert update["source"] == safe


def test_a_reoffer_under_the_same_bundle_id_never_resumes_another_files_part(
    tmp_path: Path,
) -> None:
    signer = Signer()
    cfg, port, channel = ota_config(tmp_path, signer)
    (tmp_path / "art").mkdir()
    a = _bundle(signer, tmp_path, "first", 2, bundle_id="model-1.2.0")
    b = _bundle(signer, tmp_path, "resigned", 2, bundle_id="model-1.2.0")
    sha_a, sha_b = publish(tmp_path / "art", a), publish(tmp_path / "art", b)
    size_a, size_b = a.stat().st_size, b.stat().st_size
    incoming = cfg.state_dir / "ota" / "incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    scratch = ContentStore(tmp_path / "scratch" / "store")
    scratch.ensure()
    want = _verified(scratch, signer, b).manifest_sha256

    async def scenario(agent: Agent) -> tuple[str, str, bool]:
        assert agent.ota is not None
        up = agent.ota.updater
        async with ArtifactServer(tmp_path / "art") as srv:
            # An earlier offer of model-1.2.0 (file a) died after 2000 bytes; wherever it
            # left its .part (by bundle_id, or by its own URL), b must not resume it.
            head = a.read_bytes()[:2000]
            (incoming / "model-1.2.0.efb.part").write_bytes(head)
            (incoming / f"{download_name(srv.http_url(sha_a), size_a)}.part").write_bytes(head)
            cmd = {"action": "install", "bundle_id": "model-1.2.0", "length": size_b}
            cmd["url"] = srv.http_url(sha_b)
            agent.ota.on_command("ota", json.dumps(cmd).encode())
            await until(lambda: up.journal.last is not None, timeout=60)
        last = up.journal.last
        assert last is not None
        active = up.journal.active.get("model")
        served_b = active is not None and active.manifest_sha256 == want
        return last.result, last.reason, served_b

    (result, reason, served_b), _, _ = run_agent(cfg, port, channel, scenario)
    assert result == "committed", reason
    assert served_b
    # The commit raised the floor in the floors file too, not only in the journal.
    floors = ota_journal.floors_path(cfg.state_dir / "ota" / "journal.json")
    assert json.loads(floors.read_bytes())["floors"] == {"model": 2}


def test_a_manual_rollback_whose_kept_version_is_damaged_records_the_factory_model(
    tmp_path: Path,
) -> None:
    signer = Signer()
    cfg, _, _ = ota_config(tmp_path, signer)
    store = ContentStore(cfg.state_dir / "ota" / "store")
    store.ensure()
    v1, v2, v3 = (
        _verified(store, signer, _bundle(signer, tmp_path, f"v{n}", n)) for n in (1, 2, 3)
    )
    # The kept v2's model is damaged at rest (a bad flash block).
    ext = store.extent(v2.payloads["model.tflite"])
    assert ext is not None
    with open(ext.path, "r+b") as f:
        f.seek(ext.offset + 100)
        byte = f.read(1)
        f.seek(ext.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    journal = Journal(active={"model": v3}, kept={"model": (v2, v1)}, floors={"model": 3})
    ota_journal.save(cfg.state_dir / "ota" / "journal.json", journal)

    agent = build_agent(cfg)  # boots with v3 live, as after a restart
    assert agent.ota is not None
    assert agent.stage is not None
    assert agent.stage.model.sha256 == v3.payloads["model.tflite"]
    up = agent.ota.updater
    out = asyncio.run(up.rollback("model"))

    assert out.result == "rolled_back", out
    assert "rollback target unavailable" in out.reason
    assert agent.stage.model.sha256 == load_model(cfg.reasoning.model_dir).sha256  # factory
    # What the journal says runs is what runs: the factory model, no active bundle.
    assert "model" not in up.journal.active
    on_disk, _ = ota_journal.load(up.journal_path)
    assert "model" not in on_disk.active
    assert up.status()["active"] == {}


def test_a_rollback_asked_while_the_probation_waits_for_the_agent_to_settle_acts_at_once(
    tmp_path: Path,
) -> None:
    signer = Signer()
    cfg, _, _ = ota_config(tmp_path, signer)
    agent = build_agent(cfg)  # built, never run: it never settles
    assert agent.ota is not None
    assert agent.stage is not None
    factory = agent.stage.model.sha256
    up = agent.ota.updater
    # A probation of 60 s: the wait for the agent to settle could last that long.
    members, new_sha = model_members(tmp_path, "v2")
    bundle = signer.bundle(tmp_path / "v2.efb", members, probation={"seconds": 60})

    async def main() -> tuple[str, float]:
        install = asyncio.create_task(up.install_file(bundle))
        await until(lambda: up.journal.state == "probation", 30)
        assert agent.stage is not None
        assert agent.stage.model.sha256 == new_sha
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await up.rollback("model")
        out = await asyncio.wait_for(install, 30)
        return out.result, loop.time() - t0

    result, took = asyncio.run(main())
    assert result == "rolled_back"
    assert took < 5, f"the rollback waited {took:.1f} s for the settle"
    assert agent.stage.model.sha256 == factory
    assert not agent.settled.is_set()


# -- the anti-rollback floors survive a damaged journal ---------------------------------------


def _committed_v3(tmp_path: Path, signer: Signer, cfg: AgentConfig) -> Path:
    """A device whose journal has model 1.3.0 committed (floor 3), as after a restart."""
    store = ContentStore(cfg.state_dir / "ota" / "store")
    store.ensure()
    v3 = _verified(store, signer, _bundle(signer, tmp_path, "v3", 3))
    path = cfg.state_dir / "ota" / "journal.json"
    ota_journal.save(path, Journal(active={"model": v3}, floors={"model": 3}))
    return path


def test_a_damaged_journal_keeps_the_floors_and_an_older_bundle_is_refused_as_a_downgrade(
    tmp_path: Path,
) -> None:
    signer = Signer()
    cfg, _, _ = ota_config(tmp_path, signer)
    path = _committed_v3(tmp_path, signer, cfg)
    older = _bundle(signer, tmp_path, "v2", 2)  # signed, unexpired, below the floor
    build_agent(cfg)  # a start with the journal intact: its floors go to floors.json too
    path.write_bytes(b'{"format": 1, "state": "idl')  # torn by a bad flash block

    agent = build_agent(cfg)
    assert agent.ota is not None
    up = agent.ota.updater
    out = asyncio.run(up.install_file(older))
    assert (out.result, out.code) == ("failed", "downgrade"), out
    assert "floor 3" in out.reason
    assert "unreadable" in up.warning
    assert "floors kept from floors.json" in up.warning
    assert up.journal.floors == {"model": 3}
    assert "model" not in up.journal.active  # the factory model serves
    assert list(path.parent.glob("journal.json.corrupt-*"))
    # The new journal carries the floors again.
    on_disk, _ = ota_journal.load(path)
    assert on_disk.floors == {"model": 3}


def test_a_damaged_floors_file_is_rewritten_from_the_journal(tmp_path: Path) -> None:
    signer = Signer()
    cfg, _, _ = ota_config(tmp_path, signer)
    path = _committed_v3(tmp_path, signer, cfg)
    floors = ota_journal.floors_path(path)
    floors.write_bytes(b"\x00\x00garbage")

    agent = build_agent(cfg)
    assert agent.ota is not None
    up = agent.ota.updater
    assert up.journal.floors == {"model": 3}
    assert up.refused == ""
    assert "rewritten from the journal" in up.warning
    assert json.loads(floors.read_bytes()) == {"format": 1, "floors": {"model": 3}}
    out = asyncio.run(up.install_file(_bundle(signer, tmp_path, "v2", 2)))
    assert out.code == "downgrade", out


def test_a_floors_file_ahead_of_the_journal_wins_and_is_never_lowered(tmp_path: Path) -> None:
    signer = Signer()
    cfg, _, _ = ota_config(tmp_path, signer)
    path = _committed_v3(tmp_path, signer, cfg)
    floors = ota_journal.floors_path(path)
    # A commit whose floors file was written and whose journal was not (a power cut).
    floors.write_text(json.dumps({"format": 1, "floors": {"model": 4, "config": 7}}))
    journal, warning = ota_journal.load(path)
    assert (journal.floors, warning) == ({"config": 7, "model": 4}, "")
    ota_journal.save_floors(floors, {"model": 2})
    assert json.loads(floors.read_bytes())["floors"] == {"config": 7, "model": 4}


def test_with_journal_and_floors_both_unreadable_every_install_is_refused(
    tmp_path: Path,
) -> None:
    signer = Signer()
    cfg, _, _ = ota_config(tmp_path, signer)
    path = _committed_v3(tmp_path, signer, cfg)
    build_agent(cfg)
    floors = ota_journal.floors_path(path)
    path.write_bytes(b"not json")
    floors.write_bytes(b"[]")
    newer = _bundle(signer, tmp_path, "v5", 5)  # a fine upgrade, and still refused

    for _ in range(2):  # the refusal survives a restart: nothing was reset or rewritten
        agent = build_agent(cfg)  # the agent itself starts and serves (the factory model)
        assert agent.ota is not None
        assert agent.stage is not None
        assert agent.stage.model.sha256 == load_model(cfg.reasoning.model_dir).sha256
        up = agent.ota.updater
        assert up.refused
        out = asyncio.run(up.install_file(newer))
        assert (out.result, out.code) == ("failed", "floors_unknown"), out
        for needed in (str(path), str(floors), "stop the agent", "delete both files"):
            assert needed in out.reason
        assert up.journal.state == "idle"
        assert up.journal.last is not None
        assert up.journal.last.result == "failed"
        assert up.refused in up.status()["warning"]
        assert path.read_bytes() == b"not json"
        assert floors.read_bytes() == b"[]"
        assert not list(path.parent.glob("journal.json.corrupt-*"))

    # The operator writes the floors back: installs resume, above them.
    floors.write_text(json.dumps({"format": 1, "floors": {"model": 3}}))
    agent = build_agent(cfg)
    assert agent.ota is not None
    up = agent.ota.updater
    assert (up.refused, up.journal.floors) == ("", {"model": 3})
    out = asyncio.run(up.install_file(_bundle(signer, tmp_path, "v2", 2)))
    assert out.code == "downgrade", out


# -- an interrupted commit of an agent build the launcher gave up on ------------------------


def test_an_interrupted_agent_commit_is_rolled_back_when_the_old_build_runs(
    tmp_path: Path, real_wheel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    signer = Signer()
    cfg, _, _ = ota_config(tmp_path, signer)
    slots = Slots(cfg.state_dir / "slots")
    for version, slot in (("0.1.1", "a"), ("0.2.0", "b")):
        wheel = variant(real_wheel, tmp_path / f"{version}.whl", version=version)
        assert install(slots, wheel, version) == slot
        slots.activate(slot)
        if slot == "a":
            slots.mark_good()
    old = _agent(slots, "a", "0.1.1", 1)
    new = _agent(slots, "b", "0.2.0", 2)
    # 0.2.0 passed its probation; the agent died before the slot was marked good (state
    # committing), and its next boots failed: the real launcher went back to slot a.
    up = Update(
        bundle_id=new.bundle_id, kind="agent", version=new.version, target=new, replaced=old
    )
    path = cfg.state_dir / "ota" / "journal.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    ota_journal.save(path, Journal(state="committing", update=up, active={"agent": new},
                                   floors={"agent": 1}))  # fmt: skip
    for _ in range(slots.max_boots):
        expect_slot(slots.root, "b", "0.2.0")
    expect_slot(slots.root, "a", "0.1.1")
    before = slots.state_path.read_bytes()
    monkeypatch.setenv(ENV_SLOT, slot_env("a", slots.load()))

    agent = build_agent(cfg)  # the old build, started by the launcher from slot a
    assert agent.ota is not None
    asyncio.run(agent.ota.start())

    j = agent.ota.updater.journal
    assert j.state == "idle"
    assert j.last is not None
    assert j.last.result == "rolled_back", j.last
    assert "agent 0.2.0 did not become healthy (running 0.1.1" in j.last.reason
    assert j.active["agent"] == old
    assert j.floors == {"agent": 1}  # not raised for a build that never committed
    on_disk, _ = ota_journal.load(path)
    assert (on_disk.active["agent"], on_disk.floors) == (old, {"agent": 1})
    assert slots.state_path.read_bytes() == before  # a stays good, b stays bad


def _agent(slots: Slots, slot: SlotName, version: str, counter: int) -> Installed:
    info = slots.load().slot(slot)
    assert info.sha256 is not None
    return Installed(
        f"agent-{version}", "agent", version, counter, "0" * 64,
        {f"edgefleet-{version}-py3-none-any.whl": info.sha256},
    )  # fmt: skip
