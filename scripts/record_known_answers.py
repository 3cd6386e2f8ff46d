"""Write ``known_answers`` into committed model manifests without retraining.

Usage: ``python scripts/record_known_answers.py [--fresh] [MODEL_DIR ...]`` (default:
models/motor_drive and models/motor_drive_slow). The model files are not touched; every
other manifest key (``training.acquisition``, ``training.input_stats``, the metrics) is kept
as it is. This machine's outputs (``platform.machine()``: LiteRT, XNNPACK and builtin
kernels, :func:`models.selftest.record`) are added to the answers already there, on the
same golden inputs; ``--fresh`` makes new inputs and drops every other machine's answers.
Run it on each kind of machine the model is served on (an aarch64 gateway, or the arm64
root of ``make test-arm64`` under ``QEMU_CPU=cortex-a76``); ``models.train`` writes the
training host's answers for a model it trains.
"""

import json
import platform
import sys
from pathlib import Path

from models.known_answers import KEY
from models.selftest import record

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIRS = (ROOT / "models" / "motor_drive", ROOT / "models" / "motor_drive_slow")


def main(argv: list[str]) -> int:
    fresh = "--fresh" in argv
    dirs = [Path(a) for a in argv if a != "--fresh"] or list(DEFAULT_DIRS)
    for d in dirs:
        path = d / "manifest.json"
        doc = json.loads(path.read_text(encoding="utf-8"))
        answers = record(d, fresh=fresh)
        doc[KEY] = answers.describe()
        path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        machine = platform.machine()
        info = answers.recorded_with[machine]["xnnpack_vs_builtin"]
        print(
            f"{path}: {answers.windows} golden windows, answers for "
            f"{', '.join(answers.expected)}; here ({machine}) xnnpack vs builtin differ on "
            f"{info['windows_differing']} (max {info['max_abs_int8_diff']}/256)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
