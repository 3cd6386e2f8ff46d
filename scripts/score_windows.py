"""Score a fixed set of windows and compare machines (used by ``make test-arm64``).

    python scripts/score_windows.py make OUT.npy [--count 500]   # on the x86 host
    python scripts/score_windows.py score WINDOWS.npy > R.json   # on each machine
    python scripts/score_windows.py compare X86.json ARM.json
    python scripts/score_windows.py compare --sve ARM.json ARM_SVE.json
    python scripts/score_windows.py check-sve SELFTEST.json      # edge-agent selftest --json

``make``: windows of the simulated plant (test-set plant seeds, every label), float32. They
are made once on the host and the same bytes are scored everywhere (the plant's float math
may differ in the last bit between machines; the model's arithmetic must not).
``score``: the int8 outputs of the committed model on XNNPACK, on the builtin kernels, and
on what the agent would serve (``load_checked``: the self-test decides), plus the golden
windows' outputs; one JSON object. ``compare X86 ARM``: the rows that differ per kernel set
are reported (measured: XNNPACK 2 of 500 by 1/256, builtin 67 by up to 45/256: each
machine's kernels round their own way, which is why the known answers are per machine);
the agent's verdicts must be equal. ``compare --sve ARM ARM_SVE`` (qemu's SVE CPU, where
XNNPACK is known wrong): the agent must serve the builtin kernels and their outputs must
equal the reference CPU's exactly. ``check-sve``: the self-test fell back to the builtin
kernels or refused, never passed XNNPACK.
"""

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

from models import DEFAULT_MODEL_DIR, load_model
from models.selftest import KnownAnswersFailed, load_checked


def make(out: Path, count: int) -> None:
    from models import dataset  # noqa: PLC0415 - the plant simulation, host side only

    per_seed = 25
    seeds = range(200001, 200001 + -(-count // per_seed))
    ws = dataset.generate(seeds, per_seed, rng_seed=7)
    np.save(out, ws.values[:count].astype(np.float32))
    print(f"{out}: {count} windows from plant seeds {seeds.start}-{seeds.stop - 1}")


def score(path: Path) -> dict[str, Any]:
    windows = np.load(path)
    fast = load_model(DEFAULT_MODEL_DIR)
    plain = load_model(DEFAULT_MODEL_DIR, xnnpack=False)
    ka = fast.manifest.known_answers
    assert ka is not None
    out: dict[str, Any] = {"machine": platform.machine(), "windows": len(windows)}
    try:
        served = load_checked(DEFAULT_MODEL_DIR)
    except KnownAnswersFailed as exc:
        out["served_kernels"] = None
        out["served_selftest"] = {"result": "failed", "reason": str(exc)}
        models = (("xnnpack", fast), ("builtin", plain))
    else:
        out["served_kernels"] = served.kernels
        out["served_selftest"] = served.selftest.status()
        models = (("xnnpack", fast), ("builtin", plain), ("served", served))
    for name, model in models:
        out[name] = [[int(v) for v in model.predict_int8(w)] for w in windows]
        out[f"golden_{name}"] = [[int(v) for v in model.predict_int8(w)] for w in ka.inputs]
    return out


def _decisions(rows: list[list[int]]) -> list[str]:
    """The agent's verdict per row: manifest thresholds on the dequantized outputs."""
    model = load_model(DEFAULT_MODEL_DIR, xnnpack=False)
    return [model.decide(model.dequantize(np.array(r, dtype=np.int8))) for r in rows]


def compare(ref_path: Path, other_path: Path, *, sve: bool) -> int:
    """Across machines (x86 reference, aarch64): the int8 rows may differ (each machine's
    kernels round their own way; reported), the agent's verdicts must not. On the same
    machine kind (``--sve``: the reference CPU's run vs the SVE CPU's): what the agent
    serves must equal the reference CPU's builtin outputs exactly, row for row."""
    ref = json.loads(ref_path.read_text())
    got = json.loads(other_path.read_text())
    where = f"{got['machine']} vs {ref['machine']}"
    problems = []
    for k in ("xnnpack", "builtin", "golden_xnnpack", "golden_builtin"):
        d = np.abs(np.array(ref[k]) - np.array(got[k])).max(axis=1)
        print(f"{where}: {k}: {int((d > 0).sum())} of {len(d)} rows differ, max {int(d.max())}/256")
    served = got.get("served", [])
    if sve:
        # The same machine kind: what is served must be the reference CPU's builtin outputs.
        if got["served_kernels"] != "builtin":
            problems.append(f"served on {got['served_kernels']}, expected the builtin fallback")
        for a, b in (("builtin", "served"), ("golden_builtin", "golden_served")):
            rows = got.get(b, [])
            n = sum(x != y for x, y in zip(ref[a], rows, strict=False))
            n += abs(len(ref[a]) - len(rows))
            print(f"{where}: served vs the reference CPU's {a}: {n} rows differ")
            if n:
                problems.append(f"what is served differs from the reference {a} on {n} rows")
        dec_ref = _decisions(ref["builtin"])
    else:
        if got["served_kernels"] != "xnnpack":
            problems.append(f"served on {got['served_kernels']}, expected xnnpack")
        dec_ref = _decisions(ref["served"])
    dec_got = _decisions(served) if served else [""] * len(dec_ref)
    n = sum(x != y for x, y in zip(dec_ref, dec_got, strict=True))
    print(f"{where}: verdicts of what is served: {n} of {len(dec_ref)} differ")
    if n:
        problems.append(f"{n} verdicts differ")
    for p in problems:
        print(f"FAILED: {p}", file=sys.stderr)
    return 1 if problems else 0


def check_sve(path: Path) -> int:
    doc = json.loads(path.read_text().strip().splitlines()[-1])
    fell_back = doc.get("result") == "passed" and doc.get("kernels") == "builtin"
    refused = doc.get("result") == "failed"
    print(
        f"SVE self-test: result={doc.get('result')} kernels={doc.get('kernels')} "
        f"reason={doc.get('fallback') or doc.get('reason')}"
    )
    if (fell_back and doc.get("fallback")) or refused:
        return 0
    print("FAILED: the SVE run was not caught by the self-test", file=sys.stderr)
    return 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out", type=Path)
    m.add_argument("--count", type=int, default=500)
    s = sub.add_parser("score")
    s.add_argument("windows", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("reference", type=Path)
    c.add_argument("other", type=Path)
    c.add_argument("--sve", action="store_true")
    k = sub.add_parser("check-sve")
    k.add_argument("selftest", type=Path)
    args = ap.parse_args()
    if args.cmd == "make":
        make(args.out, args.count)
        return 0
    if args.cmd == "score":
        print(json.dumps(score(args.windows)))
        return 0
    if args.cmd == "compare":
        return compare(args.reference, args.other, sve=args.sve)
    return check_sve(args.selftest)


if __name__ == "__main__":
    sys.exit(main())
