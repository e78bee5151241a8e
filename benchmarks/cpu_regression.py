"""The CPU default against a base commit: the op and the ``cpu20m`` training step, interleaved.

    python -m benchmarks.cpu_regression --base-ref 775219b [--rounds 5] [--quick]

What the CPU runs by default (``LINEAR_ROPE_BACKEND`` unset: ``auto``, the torch block walk) in
this tree and in a ``git worktree`` of ``--base-ref``, one child process per measurement, base
then ours, ``--rounds`` times: so a drift of the machine's load hits both alike. Measured:

* **op**: ``rotary_linear_attention`` fwd+bwd, B = 1, H = 12, N = 4096, d = 64, m = 266 (FAVOR+
  inside), float32 (each child: 2 warm-up calls, then the median of 3);
* **step**: ``Trainer.train_step`` of the ``cpu20m`` preset (each child: 3 warm-up steps, then the
  median of 5).

Reported: each tree's median over its children, ours / base, and the load average before and
after (``os.getloadavg``). Target: ours / base time <= 1.05 for both.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, time, statistics, tempfile
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
import linear_rope
assert linear_rope.__file__.startswith(sys.argv[1]), linear_rope.__file__
torch.set_num_threads(int(sys.argv[3]))
what, small = sys.argv[2], sys.argv[4] == "1"
def timed(fn, warm, n):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
torch.manual_seed(0)
if what == "op":
    from linear_rope import FavorFeatures, rotary_linear_attention
    N = 512 if small else 4096
    w = FavorFeatures(64, 266).projection
    q, k, v = (torch.randn(1, 12, N, 64, requires_grad=True) for _ in range(3))
    def fn():
        rotary_linear_attention(q, k, v, projection=w).sum().backward()
    print(timed(fn, 2, 3))
else:
    from linear_rope.enwik8.config import TRAIN_PRESETS, TrainConfig
    from linear_rope.enwik8.trainer import Trainer
    from linear_rope.model import MODEL_PRESETS, ModelConfig
    preset = "tiny" if small else "cpu20m"
    raw = np.random.default_rng(0).integers(0, 256, 2_000_000, dtype=np.uint8)
    splits = {"train": raw[:1_800_000], "valid": raw[1_800_000:1_900_000], "test": raw[1_900_000:]}
    with tempfile.TemporaryDirectory() as out:
        t = Trainer("rope-seed0", ModelConfig(**MODEL_PRESETS[preset]),
                    TrainConfig(**{**TRAIN_PRESETS[preset], "out": out, "threads": int(sys.argv[3])}), splits)
        t._open()
        step = iter(range(10**6))
        try:
            print(timed(lambda: t.train_step(next(step)), 3, 5))
        finally:
            t._close()
"""


def child(root: Path, what: str, threads: int, quick: bool) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, str(root), what, str(threads), "1" if quick else "0"],
                         cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"cpu_regression: the {what} child of {root} failed: {out.stderr.strip().splitlines()[-1:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_regression", allow_abbrev=False,
                                description=__doc__.splitlines()[0])
    p.add_argument("--base-ref", required=True, help="the commit to compare with")
    p.add_argument("--rounds", type=int, default=5, help="children per tree and measurement (default 5)")
    p.add_argument("--threads", type=int, default=2, help="torch threads in each child (default 2)")
    p.add_argument("--quick", action="store_true", help="N = 512 and the tiny preset, 1 round: seconds")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    a = p.parse_args(argv)
    rounds = 1 if a.quick else a.rounds
    tmp = Path(tempfile.mkdtemp(prefix="linear_rope_base_"))
    base = tmp / "base"
    made = subprocess.run(["git", "worktree", "add", "--detach", str(base), a.base_ref], cwd=REPO,
                          capture_output=True, text=True)
    if made.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"cpu_regression: no worktree of {a.base_ref}: {made.stderr.strip().splitlines()[-1:]}")
    load = {"before": os.getloadavg()}
    res = {}
    try:
        for what in ("op", "step"):
            times = {"base": [], "ours": []}
            for _ in range(rounds):
                for side, root in (("base", base), ("ours", REPO)):
                    times[side].append(child(root, what, a.threads, a.quick))
            med = {s: statistics.median(v) for s, v in times.items()}
            res[what] = {"seconds": times, "median_s": med, "ours_over_base": med["ours"] / med["base"]}
            print(f"{what}: base {med['base']:.4f} s, ours {med['ours']:.4f} s, ours / base "
                  f"{res[what]['ours_over_base']:.3f}", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    load["after"] = os.getloadavg()
    out = {"base_ref": a.base_ref, "rounds": rounds, "threads": a.threads, "quick": a.quick,
           "load_average_1_5_15": load, "results": res}
    print(f"load average before {load['before']}, after {load['after']}")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
