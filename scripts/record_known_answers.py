"""Write ``known_answers`` into committed model manifests without retraining.

Usage: ``python scripts/record_known_answers.py [MODEL_DIR ...]`` (default: models/motor_drive
and models/motor_drive_slow). The model files are not touched; every other manifest key
(``training.acquisition``, ``training.input_stats``, the metrics) is kept as it is. The
golden inputs and outputs come from :func:`models.selftest.record` on this machine (LiteRT,
XNNPACK and builtin kernels); ``models.train`` writes the same for a model it trains.
"""

import json
import sys
from pathlib import Path

from models.known_answers import KEY
from models.selftest import record

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIRS = (ROOT / "models" / "motor_drive", ROOT / "models" / "motor_drive_slow")


def main(argv: list[str]) -> int:
    for d in [Path(a) for a in argv] or list(DEFAULT_DIRS):
        path = d / "manifest.json"
        doc = json.loads(path.read_text(encoding="utf-8"))
        answers = record(d)
        doc[KEY] = answers.describe()
        path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        info = answers.recorded_with["xnnpack_vs_builtin"]
        print(
            f"{path}: {answers.windows} golden windows; xnnpack vs builtin differ on "
            f"{info['windows_differing']} (max {info['max_abs_int8_diff']}/256)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
