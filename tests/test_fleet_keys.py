"""``fleet keys``: real key files in a temp folder, judged by the device's own trust code
(``ota.trust.load_root`` / ``rotate``) and gatekeeper (``ota.verify.verify_bundle``)."""

from __future__ import annotations

import json
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from fleet import keys
from fleet.cli import app
from fleet.errors import FleetKeyError
from models.copies import copy_with_new_sha
from ota import build, trust
from ota import keys as ota_keys
from ota.errors import SignatureInvalid
from ota.store import ContentStore
from ota.verify import Policy, VerifiedBundle, verify_bundle

DEVICE = "motor-drive-gw"
POLICY = Policy(DEVICE, "0.1.0", frozenset({"model:swap"}))
SECRET = "correct horse battery staple"
runner = CliRunner()


def fleet(*args: str, env: dict[str, str | None] | None = None) -> Result:
    # The passphrase variable is cleared unless a test sets it: the developer's shell
    # must not decide what a test sees.
    return runner.invoke(
        app, list(args), env={keys.ENV_PASSPHRASE: None, **(env or {})}, catch_exceptions=False
    )


def now() -> datetime:
    return datetime.now(UTC)


def init(folder: Path, *extra: str, env: dict[str, str | None] | None = None) -> Result:
    r = fleet("keys", "init", "--dir", str(folder), *extra, env=env)
    assert r.exit_code == 0, r.output
    return r


def key_files(folder: Path, role: str) -> list[Path]:
    return sorted(folder.glob(f"{role}-*.pem"))


def keyid_of(path: Path, passphrase: bytes | None = None) -> str:
    return ota_keys.keyid(keys.load_key(path, passphrase).public_key())


def build_model(tmp: Path, out: Path, *sign_with: str, counter: int = 2) -> Path:
    model = copy_with_new_sha(tmp / f"model-{out.stem}", out.stem)
    args = ["bundle", "build", "--kind", "model", "--model-dir", str(model)]
    args += ["--version", "1.2.0", "--counter", str(counter), "--device-type", DEVICE]
    args += ["--out", str(out)]
    for s in sign_with:
        args += ["--sign-with", s]
    r = fleet(*args)
    assert r.exit_code == 0, r.output
    return out


def device_verify(bundle: Path, root: trust.TrustRoot, store_dir: Path) -> VerifiedBundle:
    store = ContentStore(store_dir)
    store.ensure()
    return verify_bundle(
        bundle, root=root, policy=POLICY, floors={}, now=now(), store=store, keep_source=True
    )


# --- init --------------------------------------------------------------------------------


def test_init_writes_0600_keys_and_a_root_the_device_loads(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    r = init(folder, "--root-keys", "3", "--root-threshold", "2", "--bundle-keys", "2")
    assert "offline" in r.stdout
    roots, bundles = key_files(folder, "root"), key_files(folder, "bundle")
    assert len(roots) == 3
    assert len(bundles) == 2
    for path in (*roots, *bundles):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        # The name carries the key id: list and rotate find keys by it.
        assert path.name.endswith(f"-{keyid_of(path)[:16]}.pem")
    root = trust.load_root((folder / "root.json").read_bytes(), now())
    assert root.version == 1
    assert root.roles["root"].keyids == {keyid_of(p) for p in roots}
    assert root.roles["root"].threshold == 2
    assert root.roles["bundles"].keyids == {keyid_of(p) for p in bundles}
    assert root.roles["bundles"].threshold == 1
    assert not list(folder.glob(".*tmp"))  # no temp file left behind


def test_init_refuses_an_existing_key_set_and_force_puts_it_aside(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    init(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    r = fleet("keys", "init", "--dir", str(folder))
    assert r.exit_code == 3
    assert "already holds a key set" in r.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before

    r = init(folder, "--force")
    (aside,) = folder.glob("replaced-*")
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == before
    assert (folder / "root.json").read_bytes() != before["root.json"]
    assert f"moved to {aside}" in r.stdout


def test_init_threshold_above_key_count_is_a_usage_error(tmp_path: Path) -> None:
    r = fleet("keys", "init", "--dir", str(tmp_path / "k"), "--bundle-threshold", "2")
    assert r.exit_code == 2
    assert "--bundle-threshold 2 exceeds --bundle-keys 1" in r.stderr
    assert not (tmp_path / "k").exists()


def test_a_passphrase_protected_key_is_useless_without_it(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    r = init(folder, env={keys.ENV_PASSPHRASE: SECRET})
    assert SECRET not in r.output
    (bundle_key,) = key_files(folder, "bundle")
    assert bundle_key.read_bytes().startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
    with pytest.raises(FleetKeyError, match="encrypted; give its passphrase"):
        keys.load_key(bundle_key, None)
    with pytest.raises(FleetKeyError, match="wrong passphrase"):
        keys.load_key(bundle_key, b"not it")
    assert keys.load_key(bundle_key, SECRET.encode())

    out = tmp_path / "m.efb"
    model = copy_with_new_sha(tmp_path / "model", "p")
    args = ["bundle", "build", "--kind", "model", "--model-dir", str(model), "--version"]
    args += ["1.0.0", "--counter", "1", "--device-type", DEVICE, "--out", str(out)]
    args += ["--sign-with", str(folder)]
    r = fleet(*args)
    assert r.exit_code == 3
    assert "encrypted" in r.stderr
    assert not out.exists()
    # From a file (one trailing newline is the editor's) or from the environment.
    pass_file = tmp_path / "pass"
    pass_file.write_text(SECRET + "\n")
    r = fleet(*args, "--passphrase-file", str(pass_file))
    assert r.exit_code == 0, r.output
    assert SECRET not in r.output
    root = trust.load_root((folder / "root.json").read_bytes(), now())
    assert device_verify(out, root, tmp_path / "store").kind == "model"


def test_a_passphrase_is_never_a_command_line_value(tmp_path: Path) -> None:
    r = fleet("keys", "init", "--dir", str(tmp_path / "k"), "--passphrase", SECRET)
    assert r.exit_code == 2
    assert not (tmp_path / "k").exists()


# --- rotate ------------------------------------------------------------------------------


def test_rotate_new_bundle_key_verifies_on_the_device_and_the_revoked_one_does_not(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "keys"
    init(folder)
    v1 = (folder / "root.json").read_bytes()
    (old_key,) = key_files(folder, "bundle")
    old_id = keyid_of(old_key)
    by_old = build_model(tmp_path, tmp_path / "old.efb", str(folder))

    r = fleet("keys", "rotate", "--dir", str(folder), "--add-bundle-key", "--revoke", old_id[:12])
    assert r.exit_code == 0, r.output
    assert (folder / "root.1.json").read_bytes() == v1
    assert (folder / "revoked" / old_key.name).exists()
    (new_key,) = key_files(folder, "bundle")
    assert new_key != old_key
    by_new = build_model(tmp_path, tmp_path / "new.efb", str(folder), counter=3)

    # The device: it has root v1, takes v2 by the TUF rule, then judges the bundles.
    old_root = trust.load_root(v1, now())
    new_root = trust.rotate(old_root, (folder / "root.json").read_bytes(), now())
    assert new_root.version == 2
    assert device_verify(by_new, new_root, tmp_path / "s1").version == "1.2.0"
    with pytest.raises(SignatureInvalid, match=f"key {old_id[:16]} is not a bundles key"):
        device_verify(by_old, new_root, tmp_path / "s2")
    # The same bundle was good under v1: it is the revocation that refuses it.
    assert device_verify(by_old, old_root, tmp_path / "s3").version == "1.2.0"


def test_rotate_root_key_replaced_and_the_chain_continues(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    init(folder)
    (old_root_key,) = key_files(folder, "root")
    old_id = keyid_of(old_root_key)
    r = fleet("keys", "rotate", "--dir", str(folder), "--new-root-key", "--revoke", old_id)
    assert r.exit_code == 0, r.output
    assert "offline" in r.stdout
    (new_root_key,) = key_files(folder, "root")
    assert keyid_of(new_root_key) != old_id
    # Version 3 is signed by the new root key alone: the old one is gone from the folder.
    r = fleet("keys", "rotate", "--dir", str(folder))
    assert r.exit_code == 0, r.output

    chain = trust.load_root((folder / "root.1.json").read_bytes(), now())
    for data in ((folder / "root.2.json").read_bytes(), (folder / "root.json").read_bytes()):
        chain = trust.rotate(chain, data, now())
    assert chain.version == 3
    assert chain.roles["root"].keyids == {keyid_of(new_root_key)}


def test_rotate_refuses_without_the_old_threshold(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    init(folder, "--root-keys", "2", "--root-threshold", "2")
    gone = key_files(folder, "root")[0]
    gone.rename(tmp_path / gone.name)  # kept offline, not brought back
    before = sorted(p.name for p in folder.iterdir())
    v1 = (folder / "root.json").read_bytes()

    r = fleet("keys", "rotate", "--dir", str(folder), "--add-bundle-key")
    assert r.exit_code == 3
    assert "needs 2 of its root keys; only 1 here" in r.stderr
    assert gone.name in r.stderr
    assert (folder / "root.json").read_bytes() == v1
    assert sorted(p.name for p in folder.iterdir()) == before


def test_rotate_fails_closed_when_the_device_would_refuse_the_new_root(tmp_path: Path) -> None:
    """The root key is here but expired in root.json: its signature would not count on a
    device, so ``ota.trust.rotate`` refuses the successor and nothing is written."""
    folder = tmp_path / "keys"
    init(folder)
    (root_path,) = key_files(folder, "root")
    root_key = keys.load_key(root_path, None)
    bundle_pub = keys.load_key(key_files(folder, "bundle")[0], None).public_key()
    signed = build.root_signed(
        version=1,
        expires=now() + timedelta(days=30),
        root_keys=[root_key.public_key()],
        bundle_keys=[bundle_pub],
        key_expires={ota_keys.keyid(root_key.public_key()): now() - timedelta(days=1)},
    )
    (folder / "root.json").write_bytes(build.sign_envelope(signed, [root_key]))
    before = sorted(p.name for p in folder.iterdir())

    r = fleet("keys", "rotate", "--dir", str(folder), "--add-bundle-key")
    assert r.exit_code == 3
    assert "would be refused by devices" in r.stderr, r.stderr
    assert "expired" in r.stderr
    assert sorted(p.name for p in folder.iterdir()) == before


def test_rotate_refuses_to_empty_a_role_and_unknown_key_ids(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    init(folder)
    v1 = (folder / "root.json").read_bytes()
    bundle_id = keyid_of(key_files(folder, "bundle")[0])
    r = fleet("keys", "rotate", "--dir", str(folder), "--revoke", bundle_id)
    assert r.exit_code == 3
    assert "the bundles role would have no keys" in r.stderr
    r = fleet("keys", "rotate", "--dir", str(folder), "--revoke", "0123456789abcdef")
    assert r.exit_code == 3
    assert "no key of the current root.json has it" in r.stderr
    r = fleet("keys", "rotate", "--dir", str(folder), "--revoke", "abc")
    assert r.exit_code == 3
    assert "at least 8 hex digits" in r.stderr
    assert (folder / "root.json").read_bytes() == v1
    assert not (folder / "root.1.json").exists()


def test_rotate_keeps_encrypted_keys_encrypted(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    env: dict[str, str | None] = {keys.ENV_PASSPHRASE: SECRET}
    init(folder, env=env)
    r = fleet("keys", "rotate", "--dir", str(folder), "--add-bundle-key")
    assert r.exit_code == 3  # the root key is encrypted and no passphrase was given
    assert "encrypted" in r.stderr
    r = fleet("keys", "rotate", "--dir", str(folder), "--add-bundle-key", env=env)
    assert r.exit_code == 0, r.output
    for path in key_files(folder, "bundle"):
        assert keys.is_encrypted(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


# --- export-root and list ----------------------------------------------------------------


def test_export_root_gives_the_exact_file(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    init(folder)
    data = (folder / "root.json").read_bytes()
    r = fleet("keys", "export-root", "--dir", str(folder))
    assert r.exit_code == 0, r.output
    assert r.stdout.encode() == data
    out = tmp_path / "device" / "root.json"
    out.parent.mkdir()
    r = fleet("keys", "export-root", "--dir", str(folder), "--out", str(out))
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == data


def test_export_root_refuses_a_damaged_root(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    init(folder)
    doc = json.loads((folder / "root.json").read_bytes())
    doc["signed"]["expires"] = "2099-01-01T00:00:00Z"  # extended by hand: the signature breaks
    (folder / "root.json").write_text(json.dumps(doc))
    r = fleet("keys", "export-root", "--dir", str(folder))
    assert r.exit_code == 3
    assert "0 valid root signature(s)" in r.stderr
    assert fleet("keys", "export-root", "--dir", str(tmp_path / "none")).exit_code == 1


def test_list_json_shows_roles_expiry_and_offline_keys(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    init(folder, "--root-keys", "2", "--expires-days", "10")
    offline = key_files(folder, "root")[0]
    offline.rename(tmp_path / offline.name)
    r = fleet("keys", "list", "--dir", str(folder), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["version"] == 1
    assert doc["expired"] is False
    assert doc["thresholds"] == {"root": 1, "bundles": 1}
    days = datetime.strptime(doc["expires"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC) - now()
    assert 9 <= days.days <= 10
    roles = sorted(tuple(k["roles"]) for k in doc["keys"])
    assert roles == [("bundles",), ("root",), ("root",)]
    files = {k["keyid"][:16]: k["file"] for k in doc["keys"]}
    assert files[offline.stem.removeprefix("root-")] is None
    assert doc["stray_files"] == []

    r = fleet("keys", "list", "--dir", str(folder))
    assert r.exit_code == 0, r.output
    assert "offline" in r.stdout
    assert "version 1" in r.stdout
