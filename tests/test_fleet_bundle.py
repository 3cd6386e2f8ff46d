"""``fleet bundle``: real bundles built from the committed model, a config and a wheel, signed
with keys made by ``fleet keys init``, and judged by the device's gatekeeper
(``ota.verify.verify_bundle``) on a real content store."""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from fleet import bundles, keys
from fleet.cli import app
from models.copies import copy_with_new_sha
from ota import build, trust
from ota import keys as ota_keys
from ota.efb import BundleReader, write_bundle
from ota.errors import Incompatible
from ota.store import ContentStore
from ota.verify import Policy, VerifiedBundle, verify_bundle

DEVICE = "motor-drive-gw"
CONFIG = Path(__file__).resolve().parent.parent / "examples" / "agent.toml"
PERMS = frozenset({"model:swap", "config:write", "agent:replace"})
runner = CliRunner()


def fleet(*args: str) -> Result:
    return runner.invoke(app, list(args), env={keys.ENV_PASSPHRASE: None}, catch_exceptions=False)


def now() -> datetime:
    return datetime.now(UTC)


@pytest.fixture
def kdir(tmp_path: Path) -> Path:
    folder = tmp_path / "keys"
    r = fleet("keys", "init", "--dir", str(folder))
    assert r.exit_code == 0, r.output
    return folder


def root_of(folder: Path) -> trust.TrustRoot:
    return trust.load_root((folder / "root.json").read_bytes(), now())


def bundle_key(folder: Path) -> Path:
    (path,) = sorted(folder.glob("bundle-*.pem"))
    return path


def make_wheel(tmp: Path) -> Path:
    wheel = tmp / "edgefleet-0.2.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("edge_agent/__init__.py", '__version__ = "0.2.0"\n')
        z.writestr("edgefleet-0.2.0.dist-info/METADATA", "Name: edgefleet\nVersion: 0.2.0\n")
    return wheel


def build_args(kind: str, source: Path, out: Path, *extra: str) -> list[str]:
    flag = {"model": "--model-dir", "config": "--config", "agent": "--wheel"}[kind]
    args = ["bundle", "build", "--kind", kind, flag, str(source), "--version", "1.2.0"]
    args += ["--counter", "5", "--device-type", DEVICE, "--device-type", "other-gw"]
    return [*args, "--out", str(out), *extra]


def device_verify(
    bundle: Path, root: trust.TrustRoot, store: ContentStore, *, agent: str = "0.1.0"
) -> VerifiedBundle:
    store.ensure()
    return verify_bundle(
        bundle,
        root=root,
        policy=Policy(DEVICE, agent, PERMS),
        floors={},
        now=now(),
        store=store,
        keep_source=True,
    )


def inspect_json(bundle: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    r = fleet("bundle", "inspect", str(bundle), "--json", *extra)
    return r.exit_code, json.loads(r.stdout)


def sources(tmp: Path) -> dict[str, Path]:
    return {
        "model": copy_with_new_sha(tmp / "model", "rt"),
        "config": CONFIG,
        "agent": make_wheel(tmp),
    }


# --- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["model", "config", "agent"])
def test_build_sign_inspect_round_trip(tmp_path: Path, kdir: Path, kind: str) -> None:
    source = sources(tmp_path)[kind]
    out = tmp_path / f"{kind}.efb"
    r = fleet(*build_args(kind, source, out, "--agent-range", ">=0.1,<1"))
    assert r.exit_code == 0, r.output
    assert "unsigned" in r.stdout
    root_json = str(kdir / "root.json")

    # Unsigned: readable, consistent, and refused by a device.
    code, doc = inspect_json(out, "--root", root_json)
    assert code == 3
    assert doc["signatures"] == []
    assert doc["problems"] == []
    assert doc["verification"]["code"] == "bad_signature"
    assert "unsigned" in doc["verification"]["reason"]

    r = fleet("bundle", "sign", str(out), "--key", str(bundle_key(kdir)), "--root", root_json)
    assert r.exit_code == 0, r.output
    code, doc = inspect_json(out, "--root", root_json)
    assert code == 0, doc
    assert doc["verification"]["ok"] is True
    assert doc["signed"]["kind"] == kind
    assert doc["signed"]["compat"] == {"device_types": [DEVICE, "other-gw"], "agent": ">=0.1,<1"}
    assert doc["signed"]["required_permissions"] == build.default_permissions(kind)

    # The device agrees, and what it staged is the source's bytes.
    store = ContentStore(tmp_path / "store")
    verified = device_verify(out, root_of(kdir), store)
    if kind == "model":
        expected = {
            "model.tflite": (source / "model.tflite").read_bytes(),
            "model.json": (source / "manifest.json").read_bytes(),
        }
    else:
        expected = {"agent.toml" if kind == "config" else source.name: source.read_bytes()}
    assert set(verified.payloads) == set(expected)
    for name, data in expected.items():
        assert store.read(verified.payloads[name], max_bytes=1 << 24) == data
    # An agent outside the range is refused by the same gatekeeper.
    with pytest.raises(Incompatible, match=re.escape("needs agent >=0.1,<1")):
        device_verify(out, root_of(kdir), ContentStore(tmp_path / "s2"), agent="1.0.0")


def test_build_signs_with_a_keys_folder_and_sets_probation(tmp_path: Path, kdir: Path) -> None:
    out = tmp_path / "m.efb"
    extra = ["--sign-with", str(kdir), "--probation-seconds", "20", "--probation-p99-us", "800"]
    extra += ["--bundle-id", "motor-model", "--expires-days", "7"]
    r = fleet(*build_args("model", sources(tmp_path)["model"], out, *extra))
    assert r.exit_code == 0, r.output
    v = device_verify(out, root_of(kdir), ContentStore(tmp_path / "store"))
    assert v.signed.bundle_id == "motor-model"
    assert v.signed.probation.seconds == 20
    assert v.signed.probation.p99_us == 800
    assert 6 <= (v.signed.expires_at - now()).days <= 7


def test_build_refuses_a_probation_its_targets_cannot_pass(tmp_path: Path) -> None:
    model = sources(tmp_path)["model"]
    out = tmp_path / "m.efb"
    r = fleet(
        *build_args("model", model, out, "--target-config", str(CONFIG), "--probation-seconds", "3")
    )
    assert r.exit_code == 3
    assert r.stderr == (
        "fleet: devices would refuse this bundle: probation 3 s scores ~4.7 windows at 1.56 "
        f"windows/s ({CONFIG}: 100 Hz, hop 64); at least 10 needed: raise --probation-seconds "
        "to >= 7\n"
    )
    assert not out.exists()
    r = fleet(
        *build_args("model", model, out, "--window-rate", "1.5625", "--probation-seconds", "6")
    )
    assert r.exit_code == 3
    assert "(--window-rate); at least 10 needed: raise --probation-seconds to >= 7" in r.stderr
    assert not out.exists()

    # The default probation passes on the example config, and the build says what it checked.
    r = fleet(*build_args("model", model, out, "--target-config", str(CONFIG)))
    assert r.exit_code == 0, r.output
    assert f"probation 20 s: ~31 windows at 1.56 windows/s ({CONFIG}: 100 Hz, hop 64)" in r.stdout
    # Without a target, nothing is checked, and it says so.
    r = fleet(*build_args("model", model, out, "--probation-seconds", "3"))
    assert r.exit_code == 0, r.output
    assert r.stderr == (
        "note: probation 3 s needs devices that score >= 3.33 windows/s (10 windows); "
        "not checked: give --target-config or --window-rate\n"
    )
    # No device scores a window in 0 s.
    r = fleet(*build_args("model", model, out, "--probation-seconds", "0"))
    assert r.exit_code == 3
    assert "probation 0 s scores no window" in r.stderr

    # A config bundle is checked against the config it carries ([perception] cannot change).
    r = fleet(*build_args("config", CONFIG, tmp_path / "c.efb", "--probation-seconds", "3"))
    assert r.exit_code == 3
    assert "at 1.56 windows/s (its agent.toml: 100 Hz, hop 64)" in r.stderr


def test_build_refuses_a_target_it_cannot_read(tmp_path: Path) -> None:
    model = sources(tmp_path)["model"]
    out = tmp_path / "m.efb"
    r = fleet(*build_args("model", model, out, "--target-config", str(tmp_path / "none.toml")))
    assert r.exit_code == 1
    assert "none.toml: cannot read" in r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[perception]\nsignals = ["a"]\nwindow = 8\nhop = 9\n')
    r = fleet(*build_args("model", model, out, "--target-config", str(bad)))
    assert r.exit_code == 3
    assert r.stderr.startswith(f"fleet: {bad}: perception: ")
    assert "hop <= window" in r.stderr
    bad.write_text('[perception]\nsignals = ["a"]\nrate_hz = "100"\n')
    r = fleet(*build_args("model", model, out, "--target-config", str(bad)))
    assert r.exit_code == 3
    assert f"fleet: {bad}: perception.rate_hz: " in r.stderr
    bad.write_text('[agent]\ndevice = "x"\n')
    r = fleet(*build_args("model", model, out, "--target-config", str(bad)))
    assert r.exit_code == 3
    assert "no [perception] table" in r.stderr
    r = fleet(*build_args("model", model, out, "--window-rate", "0"))
    assert r.exit_code == 3
    assert "--window-rate: expected windows per second > 0; got 0.0" in r.stderr
    assert not out.exists()


def test_sign_twice_with_one_key_counts_once_and_a_threshold_needs_more(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "keys"
    r = fleet("keys", "init", "--dir", str(folder), "--bundle-keys", "2", "--bundle-threshold", "2")
    assert r.exit_code == 0, r.output
    first, second = sorted(folder.glob("bundle-*.pem"))
    out = tmp_path / "c.efb"
    assert fleet(*build_args("config", CONFIG, out)).exit_code == 0
    root_json = str(folder / "root.json")
    for _ in range(2):
        r = fleet("bundle", "sign", str(out), "--key", str(first), "--root", root_json)
        assert r.exit_code == 0, r.output
        assert "1 of the 2 bundle signature(s)" in r.stderr
    code, doc = inspect_json(out, "--root", root_json)
    assert code == 3
    assert len(doc["signatures"]) == 1  # the same key's signature replaced, not added
    assert doc["verification"]["code"] == "bad_signature"
    r = fleet("bundle", "sign", str(out), "--key", str(second), "--root", root_json)
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    code, doc = inspect_json(out, "--root", root_json)
    assert code == 0, doc
    assert doc["verification"]["valid_signatures"] == 2


# --- deltas ------------------------------------------------------------------------------


def test_delta_bundle_verifies_on_a_store_with_the_base(tmp_path: Path, kdir: Path) -> None:
    old_dir = copy_with_new_sha(tmp_path / "m-old", "old")
    new_dir = copy_with_new_sha(tmp_path / "m-new", "new")
    base = tmp_path / "base.efb"
    r = fleet(*build_args("model", old_dir, base, "--sign-with", str(kdir)))
    assert r.exit_code == 0, r.output
    delta = tmp_path / "delta.efb"
    args = build_args("model", new_dir, delta, "--sign-with", str(kdir), "--delta-from", str(base))
    args[args.index("--counter") + 1] = "6"
    r = fleet(*args)
    assert r.exit_code == 0, r.output
    assert "model.tflite: 15176 bytes (delta" in r.stdout

    new_model = (new_dir / "model.tflite").read_bytes()
    old_model = (old_dir / "model.tflite").read_bytes()
    entry = next(
        p for p in bundles.read_bundle(delta).signed["payloads"] if p["name"] == "model.tflite"
    )
    assert entry["delta_from"] == hashlib.sha256(old_model).hexdigest()
    assert entry["sha256"] == hashlib.sha256(new_model).hexdigest()
    assert entry["patch"]["length"] < len(new_model)
    assert delta.stat().st_size < base.stat().st_size

    root = root_of(kdir)
    store = ContentStore(tmp_path / "store")
    device_verify(base, root, store)  # the device installed the base earlier
    verified = device_verify(delta, root, store)
    assert store.read(verified.payloads["model.tflite"], max_bytes=1 << 24) == new_model
    assert (
        store.read(verified.payloads["model.json"], max_bytes=1 << 24)
        == (new_dir / "manifest.json").read_bytes()
    )
    # A device without the base cannot take it, and inspect says so unless given the base.
    with pytest.raises(Incompatible, match="does not have"):
        device_verify(delta, root, ContentStore(tmp_path / "fresh"))
    code, doc = inspect_json(delta, "--root", str(kdir / "root.json"))
    assert code == 3
    assert doc["verification"]["code"] == "incompatible"
    assert doc["signatures"][0]["counts"] is True  # the signature itself is fine
    code, doc = inspect_json(delta, "--root", str(kdir / "root.json"), "--base", str(base))
    assert code == 0, doc
    assert doc["verification"]["ok"] is True


# --- inspect -----------------------------------------------------------------------------


def test_inspect_json_structure(tmp_path: Path, kdir: Path) -> None:
    out = tmp_path / "m.efb"
    r = fleet(*build_args("model", sources(tmp_path)["model"], out, "--sign-with", str(kdir)))
    assert r.exit_code == 0, r.output
    code, doc = inspect_json(out)  # without --root: no verdict, exit 0
    assert code == 0
    assert set(doc) == {
        "file",
        "bytes",
        "manifest_sha256",
        "signed",
        "schema_error",
        "problems",
        "members",
        "signatures",
        "verification",
    }
    assert doc["verification"] is None
    kid = ota_keys.keyid(keys.load_key(bundle_key(kdir), None).public_key())
    assert doc["signatures"] == [{"keyid": kid, "counts": None, "reason": None}]
    assert [m["name"] for m in doc["members"]] == ["model.tflite", "model.json"]
    assert doc["bytes"] == out.stat().st_size
    assert [p["name"] for p in doc["signed"]["payloads"]] == ["model.tflite", "model.json"]

    code, doc = inspect_json(out, "--root", str(kdir / "root.json"))
    assert code == 0
    v = doc["verification"]
    assert v["ok"] is True
    assert v["code"] is None
    assert v["root_version"] == 1
    assert v["threshold"] == 1
    assert v["valid_signatures"] == 1
    assert v["checked_as"] == {"device_type": DEVICE, "agent_version": "0.1.0"}
    assert doc["signatures"][0]["counts"] is True
    # The device's identity of the bundle is the same.
    verified = device_verify(out, root_of(kdir), ContentStore(tmp_path / "s"))
    assert doc["manifest_sha256"] == verified.manifest_sha256

    r = fleet("bundle", "inspect", str(out), "--root", str(kdir / "root.json"))
    assert r.exit_code == 0
    assert "verifies against root.json version 1" in r.stdout
    assert "model.tflite" in r.stdout


def test_inspect_of_a_tampered_payload_names_it(tmp_path: Path, kdir: Path) -> None:
    out = tmp_path / "m.efb"
    r = fleet(*build_args("model", sources(tmp_path)["model"], out, "--sign-with", str(kdir)))
    assert r.exit_code == 0, r.output
    with out.open("rb") as f:
        reader = BundleReader(f, out.stat().st_size)
        first = reader.next_member()
        assert first is not None
        reader.skip(first)
        model = reader.next_member()
        assert model is not None
        assert model.name == "model.tflite"
    raw = bytearray(out.read_bytes())
    raw[model.offset + 100] ^= 0xFF
    out.write_bytes(raw)

    code, doc = inspect_json(out, "--root", str(kdir / "root.json"))
    assert code == 3
    assert doc["problems"] == ["payload 'model.tflite': sha256 differs from the manifest (payload)"]
    assert doc["signatures"][0]["counts"] is True  # the manifest is intact
    assert doc["verification"]["code"] == "payload_mismatch"
    assert "model.tflite" in doc["verification"]["reason"]
    r = fleet("bundle", "inspect", str(out), "--root", str(kdir / "root.json"))
    assert "REFUSED (payload_mismatch)" in r.stdout
    # And sign refuses to vouch for it.
    r = fleet("bundle", "sign", str(out), "--key", str(bundle_key(kdir)))
    assert r.exit_code == 3
    assert "refusing to sign" in r.stderr


def test_inspect_of_a_tampered_manifest_names_the_signature(tmp_path: Path, kdir: Path) -> None:
    out = tmp_path / "m.efb"
    r = fleet(*build_args("model", sources(tmp_path)["model"], out, "--sign-with", str(kdir)))
    assert r.exit_code == 0, r.output
    bf = bundles.read_bundle(out)
    signed = dict(bf.signed, counter=999)  # a bumped counter under the old signature
    manifest = json.dumps({"signed": signed, "signatures": bf.signatures}).encode()
    write_bundle(out, manifest, list(bf.members))

    code, doc = inspect_json(out, "--root", str(kdir / "root.json"))
    assert code == 3
    assert doc["signatures"][0]["counts"] is False
    assert "the signature does not verify" in doc["signatures"][0]["reason"]
    assert doc["verification"]["code"] == "bad_signature"
    assert "0 valid signature(s) by trusted bundle keys" in doc["verification"]["reason"]


def test_inspect_of_a_file_that_is_no_bundle(tmp_path: Path) -> None:
    junk = tmp_path / "junk.efb"
    junk.write_bytes(b"not a tar" * 100)
    r = fleet("bundle", "inspect", str(junk))
    assert r.exit_code == 3
    assert "junk.efb" in r.stderr
    r = fleet("bundle", "inspect", str(tmp_path / "none.efb"))
    assert r.exit_code == 1


# --- refusals ----------------------------------------------------------------------------


def test_sign_with_a_key_not_in_the_root_is_refused(tmp_path: Path, kdir: Path) -> None:
    out = tmp_path / "c.efb"
    assert fleet(*build_args("config", CONFIG, out)).exit_code == 0
    before = out.read_bytes()
    stranger = tmp_path / "stranger.pem"
    stranger.write_bytes(ota_keys.private_pem(ota_keys.generate()))
    root_key = next(kdir.glob("root-*.pem"))  # in the root, but not a bundles key
    for key in (stranger, root_key):
        r = fleet("bundle", "sign", str(out), "--key", str(key), "--root", str(kdir / "root.json"))
        assert r.exit_code == 3
        assert "is not a bundle key of root.json version 1" in r.stderr
        assert out.read_bytes() == before


def test_build_refuses_bad_sources_and_fields(tmp_path: Path) -> None:
    bad_toml = tmp_path / "agent.toml"
    bad_toml.write_text('[agent]\ndevice = "x"\nsite = \n')
    out = tmp_path / "x.efb"
    r = fleet(*build_args("config", bad_toml, out))
    assert r.exit_code == 3
    assert "not valid TOML" in r.stderr
    assert "line 3" in r.stderr

    args = build_args("config", CONFIG, out)
    args[args.index("--version") + 1] = "1.2"
    r = fleet(*args)
    assert r.exit_code == 3
    assert "devices would refuse this bundle" in r.stderr
    assert "signed.version" in r.stderr

    not_a_wheel = tmp_path / "edgefleet-0.2.0-py3-none-any.whl"
    not_a_wheel.write_text("plain text")
    r = fleet(*build_args("agent", not_a_wheel, out))
    assert r.exit_code == 3
    assert "not a zip archive" in r.stderr

    args = ["bundle", "build", "--kind", "model", "--config", str(CONFIG), "--version", "1.0.0"]
    r = fleet(*args, "--counter", "1", "--device-type", DEVICE, "--out", str(out))
    assert r.exit_code == 2
    assert "--kind model needs --model-dir" in r.stderr
    assert not out.exists()
