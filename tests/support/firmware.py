"""Agent builds for the A/B slot tests: the project's real wheel and variants of it, installs
and the launcher as the unit runs it, and a tiny tmpfs where the disk really fills."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from firmware.slots import (
    SlotName,
    Slots,
)

ROOT = Path(__file__).resolve().parents[2]


BASE_VERSION = "0.1.0"  # the editable install's version (pyproject.toml)


@pytest.fixture(scope="session")
def real_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built once per session (both slot test modules share the file)."""
    out = tmp_path_factory.getbasetemp() / "real-wheel"
    found = sorted(out.glob("edgefleet-*.whl")) if out.is_dir() else []
    if found:
        return found[0]
    out.mkdir(exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("edgefleet-*.whl")
    return wheel


MARKER = "    typer.echo(f\"{__version__} {os.environ.get('EDGEFLEET_SLOT')} {__file__}\")\n"


CRASH = '    """Console-script entry point."""\n    raise SystemExit(1)\n'


def marker_cli(src: str) -> str:
    """`edge-agent version` also prints EDGEFLEET_SLOT and the file it runs from."""
    old = "    typer.echo(__version__)\n"
    assert old in src
    return src.replace(old, MARKER)


def crashing_cli(src: str) -> str:
    """main() exits 1 at once, as a build that crash-loops on start would: its body, from
    the docstring to the ``app()`` call, becomes ``raise SystemExit(1)``."""
    head = '    """Console-script entry point."""\n'
    start = src.index(head)
    end = src.index("    app()\n", start) + len("    app()\n")
    return src[:start] + CRASH + src[end:]


def variant(
    real: Path,
    out: Path,
    *,
    version: str,
    cli: Callable[[str], str] = marker_cli,
    extra: list[tuple[zipfile.ZipInfo, bytes]] | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    """A copy of the real wheel with another version, a changed cli.py and extra members."""
    dist = f"edgefleet-{BASE_VERSION}.dist-info/"
    with zipfile.ZipFile(real) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename in drop:
                continue
            data = src.read(info)
            name = info.filename
            if name == f"{dist}METADATA":
                text = data.decode()
                assert f"\nVersion: {BASE_VERSION}\n" in text
                data = text.replace(
                    f"\nVersion: {BASE_VERSION}\n", f"\nVersion: {version}\n"
                ).encode()
            elif name == "edge_agent/cli.py":
                data = cli(data.decode()).encode()
            new = zipfile.ZipInfo(
                name.replace(dist, f"edgefleet-{version}.dist-info/"), info.date_time
            )
            new.external_attr = info.external_attr
            new.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(new, data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Duplicate name": on purpose
            for info, data in extra or []:
                dst.writestr(info, data)
    return out


def install(slots: Slots, wheel: Path, version: str) -> SlotName:
    return slots.install_wheel(wheel, version=version, sha256=sha256_of(wheel))


def launch(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The launcher exactly as the unit runs it (``-P -m firmware.boot``), cwd outside."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "firmware.boot", "--slots", str(root), "--", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        check=False,
    )


def ran(root: Path) -> str:
    """What `edge-agent version` printed through the launcher: the marker line or base."""
    proc = launch(root, "version")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def expect_slot(root: Path, slot: str, version: str) -> None:
    assert ran(root) == f"{version} {slot}:{version} {root / slot / 'edge_agent' / 'cli.py'}"


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs of our own, so ENOSPC really happens (the tests run as root); room for
    two unpacked agent builds (~2 MiB each with both models) and not much more."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(mnt)], check=True
    )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
