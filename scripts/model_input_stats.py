"""Write ``training.input_stats`` into the committed models' manifests, without retraining.

The statistics (:mod:`models.input_stats`) describe the normal training windows, which
depend on the data generator and its seeds, not on the network: this regenerates exactly
the normal windows :mod:`models.train` trains on (the training set's normal windows and the
continuous training runs, same seeds) and writes their statistics into
``models/motor_drive/manifest.json`` and ``models/motor_drive_slow/manifest.json`` (both
trained on those windows). Nothing else in a manifest changes, the model files are not
touched, so every sha256 still holds. ``make model`` writes the same entry when it
retrains (:func:`models.train.main`).

    .venv/bin/python scripts/model_input_stats.py [--cache /tmp/edgefleet-train] [--workers 2]

Takes ~5 min on 2 cores (the training set is regenerated; ``--cache`` shares
``models.train``'s cache files, so a cache from ``make model`` is reused as is).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models import dataset, train  # noqa: E402 - after the path fix
from models.input_stats import InputStats  # noqa: E402
from models.runtime import MANIFEST_NAME, ModelManifest  # noqa: E402

MODEL_DIRS = (REPO / "models" / "motor_drive", REPO / "models" / "motor_drive_slow")


def training_input_stats(cache: Path | None, workers: int) -> InputStats:
    """The statistics of :mod:`models.train`'s normal training windows."""
    trainset = train._cached(cache, "train", lambda: train._make_set(train.TRAIN_SEEDS, workers))
    cont = train._cached(cache, "cont_train", lambda: train._continuous(train.CONT_TRAIN, workers))
    return train.input_stats_of(trainset, cont)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=None, help="models.train's data cache")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    started = time.monotonic()
    stats = training_input_stats(args.cache, args.workers)
    print(
        f"[{time.monotonic() - started:.0f}s] input statistics of {stats.windows} normal "
        "training windows",
        file=sys.stderr,
    )
    for model_dir in MODEL_DIRS:
        path = model_dir / MANIFEST_NAME
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc["signals"] != list(dataset.SIGNALS):
            raise SystemExit(f"{path}: signals {doc['signals']} are not the generator's")
        doc["training"]["input_stats"] = stats.describe()
        train.write_manifest(model_dir, doc)
        ModelManifest.load(path)  # still a valid manifest, statistics included
        print(f"wrote training.input_stats into {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
