"""A copy of a model with its own identity, for hot swaps, bundles and rollouts to differ.

Used by the demo (the v2 its rollout offers), the benches and the tests.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from models import DEFAULT_MODEL_DIR


def copy_with_new_sha(dst: Path, tag: str, src: Path = DEFAULT_MODEL_DIR) -> Path:
    """Copy model directory ``src`` to ``dst`` with ``tag`` appended to the model file.

    The interpreter ignores bytes after the flatbuffer, so the copy scores exactly like the
    original but has its own sha256 (the manifest is updated to match, version 1.0.1).
    """
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    blob = dst / manifest["file"]
    data = blob.read_bytes() + tag.encode().ljust(16, b"\0")
    blob.write_bytes(data)
    manifest["sha256"] = hashlib.sha256(data).hexdigest()
    manifest["size_bytes"] = len(data)
    manifest["version"] = "1.0.1"
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dst
