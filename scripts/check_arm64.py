"""Prove every runtime dependency resolves to wheels a Jetson (aarch64) can install.

Devices run JetPack 7 (Ubuntu 24.04, CPython 3.12); older images run 3.11. For each
version this asks pip to resolve the project's runtime dependencies for manylinux aarch64
with ``--only-binary=:all:``: a dependency that would need compiling on the device fails.
"""

import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = [
    "manylinux2014_aarch64",
    "manylinux_2_17_aarch64",
    "manylinux_2_28_aarch64",
    "manylinux_2_34_aarch64",
    "manylinux_2_39_aarch64",
]


def main() -> int:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    failed = []
    for pyver in ("3.11", "3.12"):
        with tempfile.TemporaryDirectory() as dest:
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", dest]
            cmd += ["--only-binary=:all:", "--python-version", pyver, "--implementation", "cp"]
            for plat in PLATFORMS:
                cmd += ["--platform", plat]
            proc = subprocess.run([*cmd, *deps], capture_output=True, text=True, check=False)
            wheels = sorted(p.name for p in Path(dest).glob("*.whl"))
        if proc.returncode != 0:
            failed.append(pyver)
            print(f"cp{pyver} aarch64: FAILED\n{proc.stderr.strip()}", file=sys.stderr)
            continue
        native = [w for w in wheels if "aarch64" in w]
        print(f"cp{pyver} aarch64: ok, {len(wheels)} wheels ({len(native)} native: ", end="")
        print(", ".join(w.split("-")[0] for w in native) + ")")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
