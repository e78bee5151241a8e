"""Training throughput of the ``cpu20m`` and ``cpu`` presets: this tree against the start commit.

    python -m benchmarks.training [--quick] [--base-ref 92ee694]
    python -m benchmarks.training --base-ref 775219b --presets cpu20m --op --rounds 5

The second is a regression check against a recent commit: the ``cpu20m`` step and, with ``--op``,
``rotary_linear_attention`` alone (fwd+bwd, B = 1, H = 12, N = 4096, d = 64, m = 266 FAVOR+ inside,
float32), ``--rounds`` alternating children per tree; ``time_ours_over_base`` is the ratio of the
medians of the children's median steps (target <= 1.05), with the load average before and after.

How it measures: docs/performance.md, "Methods" (``benchmarks.training``).
"""
from __future__ import annotations

import inspect
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import REPO_ROOT, cli, fmt, load_average, report, target, threads

NAME = "training"
BASE_REF = "92ee694"
FULL = dict(presets=("cpu20m", "cpu"), rounds=2, warmup=5, steps=40)  # threads: common.threads()
QUICK = dict(presets=("tiny",), rounds=1, warmup=1, steps=2, threads=1)
TARGET = 2.0


def measure_one(root: str, preset: str, warmup: int, steps: int, threads: int) -> dict:
    """Child: ``warmup`` + ``steps`` steps of the tree at ``root``'s Trainer on ``preset``."""
    import tempfile
    import time

    import numpy as np
    import torch

    import linear_rope
    from linear_rope.enwik8.config import TRAIN_PRESETS, TrainConfig
    from linear_rope.enwik8.trainer import Trainer
    from linear_rope.model import MODEL_PRESETS, ModelConfig

    assert Path(linear_rope.__file__).resolve().is_relative_to(Path(root).resolve()), linear_rope.__file__
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        if preset.startswith("op:"):  # the op alone, N = the number after "op:"
            from linear_rope import FavorFeatures, rotary_linear_attention
            w = FavorFeatures(64, 266).projection
            q, k, v = (torch.randn(1, 12, int(preset[3:]), 64, requires_grad=True) for _ in range(3))
            step_fn, close, compiled = lambda _: rotary_linear_attention(q, k, v, projection=w).sum().backward(), None, False
            tokens = q.shape[2]
        else:
            raw = np.random.default_rng(0).integers(0, 256, 2_000_000, dtype=np.uint8)  # the same bytes for both trees
            splits = {"train": raw[:1_800_000], "valid": raw[1_800_000:1_900_000], "test": raw[1_900_000:]}
            mc = ModelConfig(**MODEL_PRESETS[preset])
            tc = TrainConfig(**{**TRAIN_PRESETS[preset], "out": out, "threads": threads})
            t = Trainer("rope-seed0", mc, tc, splits)
            t._open()  # what fit() does before its loop (compiles there, where that tree compiles)
            step_fn, close, tokens = t.train_step, t._close, tc.batch_size * tc.grad_accum * mc.seq_len
            compiled = bool(getattr(t, "compiled", getattr(tc, "compile", False)))
        times, cpu = [], []
        try:
            for step in range(warmup + steps):
                t0, c0 = time.perf_counter(), time.process_time()
                step_fn(step)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        finally:
            if close:
                close()
    return {"root": root, "warmup_s": times[:warmup], "step_s": times[warmup:], "cpu_s": cpu[warmup:],
            "tokens_per_step": tokens, "compile": compiled}


def _child(root: Path, preset: str, cfg: dict) -> dict:
    # A fresh interpreter with the tree first on sys.path before anything imports linear_rope.
    code = ("import json, sys\nfrom pathlib import Path\nsys.path.insert(0, sys.argv[1])\n"
            + inspect.getsource(measure_one)
            + "print(json.dumps(measure_one(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))))\n")
    args = [sys.executable, "-c", code, str(root), preset, str(cfg["warmup"]), str(cfg["steps"]), str(cfg["threads"])]
    proc = subprocess.run(args, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"training child for {root} ({preset}) failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summarise(runs: dict[str, list[dict]]) -> dict:
    # Each child's median step, then the best child per tree: a burst of load on the shared
    # machine slows whole children, and it should not decide the ratio.
    step = {s: min(statistics.median(r["step_s"]) for r in rs) for s, rs in runs.items()}
    step_all = {s: statistics.median(t for r in rs for t in r["step_s"]) for s, rs in runs.items()}
    # The regression check's figure: the median over children of each child's median step.
    mid = {s: statistics.median(statistics.median(r["step_s"]) for r in rs) for s, rs in runs.items()}
    warm = {s: statistics.median(sum(r["warmup_s"]) for r in rs) for s, rs in runs.items()}
    # CPU seconds per step (one thread): what the step costs, whatever else runs on the machine.
    cpu = {s: statistics.median(t for r in rs for t in r.get("cpu_s", [])) if rs[0].get("cpu_s") else None
           for s, rs in runs.items()}
    tokens = runs["ours"][0]["tokens_per_step"]
    tok_s = {s: tokens / v for s, v in step.items()}
    return {"step_s": step, "step_s_median_of_all_steps": step_all, "step_s_median_of_child_medians": mid,
            "time_ours_over_base": mid["ours"] / mid["base"], "cpu_s_per_step": cpu, "warmup_s": warm,
            "tokens_per_s": tok_s, "speedup": tok_s["ours"] / tok_s["base"],
            "speedup_cpu_time": cpu["base"] / cpu["ours"] if cpu["ours"] else None,
            "compiled": {s: rs[0]["compile"] for s, rs in runs.items()}, "runs": runs}


def main(quick: bool = False, out_dir=None, base_ref: str = BASE_REF, presets: str | None = None,
         rounds: int | None = None, steps: int | None = None, op: bool = False) -> dict:
    cfg = {**(QUICK if quick else {**FULL, "threads": threads()}), **({"rounds": rounds} if rounds else {}),
           **({"steps": steps} if steps else {}), **({"presets": tuple(presets.split(","))} if presets else {})}
    if op:
        cfg["presets"] = (*cfg["presets"], f"op:{512 if quick else 4096}")
    from linear_rope.enwik8.config import TRAIN_PRESETS
    if bad := [p for p in cfg["presets"] if p not in TRAIN_PRESETS and not p.startswith("op:")]:
        print(f"training: unknown preset {', '.join(bad)} (known: {', '.join(TRAIN_PRESETS)})", file=sys.stderr)
        raise SystemExit(2)
    tmp = Path(tempfile.mkdtemp(prefix="linear_rope_base_"))
    base = tmp / "base"
    made = subprocess.run(["git", "worktree", "add", "--detach", str(base), base_ref], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    if made.returncode != 0:  # e.g. a shallow clone without the base commit: nothing to compare with
        shutil.rmtree(tmp, ignore_errors=True)
        why = (made.stderr.strip().splitlines() or ["git worktree add failed"])[-1]
        return report({"name": NAME, "quick": quick, "config": {**cfg, "base_ref": base_ref},
                       "table": {"headers": ["preset", "tree", "step s", "tokens/s"], "rows": [["-", "-", "-", "-"]]},
                       "targets": [target(f"ours / base ({base_ref}) {p}-preset training tokens/s", None, ">=", TARGET)
                                   for p in cfg["presets"]],
                       "notes": [f"not run: no worktree of {base_ref} ({why})"]}, out_dir)
    per, load = {}, [load_average()]
    try:
        for preset in cfg["presets"]:
            runs = {"base": [], "ours": []}
            for _ in range(cfg["rounds"]):
                for side, root in (("base", base), ("ours", REPO_ROOT)):
                    runs[side].append(_child(root, preset, cfg))
                    r = runs[side][-1]
                    print(f"{preset} {side}: step {fmt(statistics.median(r['step_s']))} s, warm-up "
                          f"{fmt(sum(r['warmup_s']))} s", flush=True)
            per[preset] = _summarise(runs)
            print(f"{preset}: ours / base time {fmt(per[preset]['time_ours_over_base'])}", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO_ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    load.append(load_average())
    rows = []
    for preset, p in per.items():
        for side in ("base", "ours"):
            rows.append([preset, f"base ({base_ref})" if side == "base" else "ours",
                         "yes" if p["compiled"][side] else "no", p["step_s"][side],
                         p["step_s_median_of_all_steps"][side], p["cpu_s_per_step"][side], p["tokens_per_s"][side],
                         p["warmup_s"][side]])
    result = {
        "name": NAME, "quick": quick, "config": {**cfg, "presets": list(cfg["presets"]), "base_ref": base_ref},
        "load_average_before_after": load, "presets": per,
        "table": {"headers": ["preset", "tree", "compiled", "step s (best child's median)",
                              "step s (median of all steps)", "CPU s per step (median)", "tokens/s",
                              "warm-up s (compile here)"], "rows": rows},
        "targets": [target(f"ours / base ({base_ref}) {preset}-preset training tokens/s", p["speedup"], ">=", TARGET)
                    if not preset.startswith("op:") else
                    target(f"ours / base ({base_ref}) op time, N={preset[3:]}", p["time_ours_over_base"], "<=", 1.05)
                    for preset, p in per.items()],
        "notes": [f"{cfg['rounds']} alternating child processes per tree and preset, {cfg['steps']} timed steps each "
                  f"after {cfg['warmup']} warm-up steps (their total is the warm-up column, compilation included); "
                  f"{cfg['threads']} threads; each tree's own Trainer and TrainConfig defaults; tokens/s from the "
                  "best child's median step.",
                  *[f"{preset}: ours / base by CPU seconds per step (median of all steps; the process's CPU time, "
                    f"which other jobs on the machine do not inflate at {cfg['threads']} thread(s)): "
                    f"{fmt(p['speedup_cpu_time'])}x" for preset, p in per.items() if p["speedup_cpu_time"]],
                  *[f"{preset}: ours / base time, median over children of each child's median step: "
                    f"{fmt(p['time_ours_over_base'])}" for preset, p in per.items()],
                  f"load average (1, 5, 15 min) before {load[0]}, after {load[1]}."],
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__, base_ref=dict(default=BASE_REF, help="the commit to compare with (default %(default)s)"),
        presets=dict(default=None, help="comma-separated training presets (default cpu20m,cpu)"),
        rounds=dict(type=int, default=None, help="children per tree and preset (default 2)"),
        steps=dict(type=int, default=None, help="timed steps per child (default 40)"),
        op=dict(action="store_true", help="also time rotary_linear_attention alone (N = 4096)"))
