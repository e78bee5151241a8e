"""Training throughput of the ``cpu`` preset: this tree against the commit the speed-up is measured from.

    python -m benchmarks.training [--quick] [--base-ref 6403649]

The ``cpu`` preset (12 layers, dim 128, 4 heads x 32, m = 64, sequence 256, batch 8) trained
the way ``linear_rope.train`` trains it: zero_grad, forward on `[8, 256]` bytes, next-byte
cross entropy, backward, gradient clipping at 1.0, AdamW (weight decay on matrices only). Data
are random bytes (the step's cost does not depend on them).

Each side runs in a fresh child process that imports ``linear_rope`` from its own tree: ours
from this repository, the base from a ``git worktree`` of ``--base-ref`` (the commit issue 14
starts from), made under a temporary directory and removed afterwards. Children alternate,
base then ours then base ..., so a drift of the shared machine hits both alike; each child
times ``steps`` steps after ``warmup`` and reports their median. Each tree's step time is its
best child's median (bursts of load slow whole children); the median of all steps is recorded
too. Target: ours / base tokens/s >= 2.
"""
from __future__ import annotations

import argparse
import inspect
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import REPO_ROOT, fmt, report, target

NAME = "training"
BASE_REF = "6403649"
FULL = dict(preset="cpu", rounds=3, warmup=3, steps=10, threads=2)
QUICK = dict(preset="tiny", rounds=1, warmup=1, steps=2, threads=1)
TARGET = 2.0


def measure_one(root: str, preset: str, warmup: int, steps: int, threads: int) -> dict:
    """Child: time ``steps`` training steps of ``preset`` with linear_rope imported from ``root``."""
    import torch
    import torch.nn.functional as F

    import linear_rope
    from linear_rope.model import PerformerLM

    assert Path(linear_rope.__file__).resolve().is_relative_to(Path(root).resolve()), linear_rope.__file__
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = PerformerLM.from_preset(preset).train()
    batch = {"cpu": 8, "tiny": 4}[preset]
    seq = model.cfg.seq_len
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"root": root, "step_s": times, "tokens_per_step": batch * seq}


def _child(root: Path, cfg: dict) -> dict:
    # A fresh interpreter with the tree first on sys.path before anything imports linear_rope.
    code = ("import json, sys, time\nfrom pathlib import Path\nsys.path.insert(0, sys.argv[1])\n"
            + inspect.getsource(measure_one)
            + "print(json.dumps(measure_one(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))))\n")
    args = [sys.executable, "-c", code, str(root), cfg["preset"], str(cfg["warmup"]), str(cfg["steps"]),
            str(cfg["threads"])]
    proc = subprocess.run(args, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"training child for {root} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(quick: bool = False, out_dir=None, base_ref: str = BASE_REF) -> dict:
    cfg = QUICK if quick else FULL
    tmp = Path(tempfile.mkdtemp(prefix="linear_rope_base_"))
    base = tmp / "base"
    made = subprocess.run(["git", "worktree", "add", "--detach", str(base), base_ref], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    if made.returncode != 0:  # e.g. a shallow clone without the base commit: nothing to compare with
        shutil.rmtree(tmp, ignore_errors=True)
        why = (made.stderr.strip().splitlines() or ["git worktree add failed"])[-1]
        return report({"name": NAME, "quick": quick, "config": {**cfg, "base_ref": base_ref},
                       "table": {"headers": ["tree", "step s", "tokens/s"], "rows": [["-", "-", "-"]]},
                       "targets": [target(f"ours / base ({base_ref}) training tokens/s", None, ">=", TARGET)],
                       "notes": [f"not run: no worktree of {base_ref} ({why})"]}, out_dir)
    try:
        runs = {"base": [], "ours": []}
        for _ in range(cfg["rounds"]):
            for side, root in (("base", base), ("ours", REPO_ROOT)):
                runs[side].append(_child(root, cfg))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO_ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    # Each child's median step, then the best child per tree: a burst of load on the shared
    # machine slows whole children (steps of 3-10 s were seen), and it should not decide the ratio.
    step = {s: min(statistics.median(r["step_s"]) for r in rs) for s, rs in runs.items()}
    step_all = {s: statistics.median(t for r in rs for t in r["step_s"]) for s, rs in runs.items()}
    tokens = runs["ours"][0]["tokens_per_step"]
    tok_s = {s: tokens / v for s, v in step.items()}
    ratio = tok_s["ours"] / tok_s["base"]
    result = {
        "name": NAME,
        "quick": quick,
        "config": {**cfg, "base_ref": base_ref, "tokens_per_step": tokens},
        "step_s": step,
        "step_s_median_of_all_steps": step_all,
        "tokens_per_s": tok_s,
        "speedup": ratio,
        "runs": runs,
        "table": {"headers": ["tree", "step s (best child's median)", "step s (median of all steps)", "tokens/s"],
                  "rows": [[f"base ({base_ref})", step["base"], step_all["base"], tok_s["base"]],
                           ["ours", step["ours"], step_all["ours"], tok_s["ours"]]]},
        "targets": [target(f"ours / base ({base_ref}) {cfg['preset']}-preset training tokens/s", ratio, ">=", TARGET)],
        "notes": [f"{cfg['rounds']} alternating child processes per tree, {cfg['steps']} timed steps each after "
                  f"{cfg['warmup']} warmup; {cfg['threads']} threads; tokens/s from the best child's median step of each tree."],
    }
    return report(result, out_dir)


if __name__ == "__main__":
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny preset, for smoke tests")
    p.add_argument("--out-dir", default=None, help="where <name>.json goes (default benchmarks/results)")
    p.add_argument("--base-ref", default=BASE_REF, help="the commit to compare with (default %(default)s)")
    p.add_argument("--one", metavar="ROOT", help="child mode: time the tree at ROOT, print JSON")
    p.add_argument("--preset", default="cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure_one(a.one, a.preset, a.warmup, a.steps, a.threads)))
    else:
        main(a.quick, a.out_dir, a.base_ref)
