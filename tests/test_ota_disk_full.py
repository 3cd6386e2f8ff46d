"""A full disk while a bundle is staged: a clean abort, the old version untouched.

The device's OTA directory is on a 8 MiB tmpfs of the test's own (root), so ENOSPC really
happens: a bundle copied in from elsewhere (``edge-agent ota install FILE``) needs more than
is left, and a delta payload's result has to be written.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

from edge_agent.service import Agent
from ota import build
from ota.errors import StorageError
from ota.store import ContentStore
from ota.trust import load_root
from ota.verify import Policy, verify_bundle
from tests.support.ota import DEVICE_TYPE, Signer, model_members
from tests.support.ota_agent import ota_config, run_agent

pytestmark = pytest.mark.peers

POLICY = Policy(DEVICE_TYPE, "0.1.0", frozenset({"model:swap"}))


def _members(size: int) -> list[tuple[str, bytes]]:
    return [("model.tflite", os.urandom(size)), ("model.json", b"{}")]


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_copying_a_bundle_onto_a_full_disk_aborts_and_leaves_no_trace(
    tmp_path: Path,
    tiny_fs: Path,
) -> None:
    signer = Signer()
    root = load_root(signer.root_json(), datetime.now(UTC))
    store = ContentStore(tiny_fs / "ota" / "store")
    store.ensure()
    small = signer.bundle(tmp_path / "small.efb", _members(200_000), counter=2)
    first = verify_bundle(small, root=root, policy=POLICY, floors={}, now=datetime.now(UTC),
                          store=store, keep_source=True)  # fmt: skip
    before = _files(tiny_fs)
    big = signer.bundle(tmp_path / "big.efb", _members(12 * 1024 * 1024), counter=3)
    with pytest.raises(StorageError, match=r"No space left|staging"):
        verify_bundle(big, root=root, policy=POLICY, floors={"model": 2},
                      now=datetime.now(UTC), store=store, keep_source=True)  # fmt: skip
    assert _files(tiny_fs) == before, "no partial file left behind"
    # What was staged before is whole and still readable.
    data = store.read(first.payloads["model.tflite"], max_bytes=1 << 20)
    assert len(data) == 200_000


def test_a_delta_result_that_does_not_fit_aborts_and_keeps_the_base(
    tmp_path: Path,
    tiny_fs: Path,
) -> None:
    signer = Signer()
    root = load_root(signer.root_json(), datetime.now(UTC))
    store = ContentStore(tiny_fs / "ota" / "store")
    store.ensure()
    base = os.urandom(1_500_000)
    b1 = signer.bundle(tmp_path / "b1.efb", [("model.tflite", base), ("model.json", b"{}")],
                       counter=2)  # fmt: skip
    v1 = verify_bundle(b1, root=root, policy=POLICY, floors={}, now=datetime.now(UTC),
                       store=store, keep_source=True)  # fmt: skip
    new = base + bytes(9_000_000)  # zeros: the patch is tiny, the result does not fit
    entry, patch = build.payload_entry("model.tflite", new, base=base)
    meta, meta_bytes = build.payload_entry("model.json", b"{}")
    signed = build.bundle_signed(
        bundle_id="d2", kind="model", version="1.2.0", counter=3,
        expires=datetime(2099, 1, 1, tzinfo=UTC), device_types=[DEVICE_TYPE],
        payloads=[entry, meta], required_permissions=["model:swap"],
    )  # fmt: skip
    delta = build.write(tmp_path / "d2.efb", signed, [("model.tflite", patch),
                                                      ("model.json", meta_bytes)],
                        [signer.bundle_key])  # fmt: skip
    before = _files(tiny_fs)
    with pytest.raises(StorageError):
        verify_bundle(delta, root=root, policy=POLICY, floors={"model": 2},
                      now=datetime.now(UTC), store=store, keep_source=True)  # fmt: skip
    assert _files(tiny_fs) == before
    assert store.read(v1.payloads["model.tflite"], max_bytes=1 << 22) == base


def test_the_agent_reports_a_full_disk_and_keeps_serving(
    tmp_path: Path,
    tiny_fs: Path,
) -> None:
    signer = Signer()
    cfg, port, channel = ota_config(tmp_path, signer)
    # The agent's state (memory, outbox, OTA) on the tiny disk.
    cfg = dataclasses.replace(cfg, state_dir=tiny_fs)
    # The committed model's manifest, so the input contract passes and staging is reached;
    # the model file is 12 MiB of noise, which does not fit the 8 MiB disk.
    (_, (_, model_json)) = model_members(tmp_path, "disk")[0]
    members = [("model.tflite", os.urandom(12 * 1024 * 1024)), ("model.json", model_json)]
    big = signer.bundle(tmp_path / "big.efb", members, counter=2)

    async def scenario(agent: Agent) -> object:
        assert agent.ota is not None
        sha = agent.model_sha256()
        out = await agent.ota.install_file(big)
        return out, sha, agent.model_sha256()

    (outcome, before, after), _, status = run_agent(cfg, port, channel, scenario)
    assert outcome.result == "failed"
    assert outcome.code == "storage"
    assert before == after
    assert status["ota"]["last"]["result"] == "failed"
