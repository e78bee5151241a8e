"""Peak memory of the attention op: each (impl, N, mode) in a fresh process.

    python -m benchmarks.memory [--quick]
    python -m benchmarks.memory --one --impl ours_inside --n 65536 --mode fwd+bwd   # one child

How it measures: docs/performance.md, "Methods" (``benchmarks.memory``).
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import resource
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from linear_rope import FavorFeatures

from .attention import D, IMPLS, M, make_call, make_inputs, make_op, make_performer, skip_reason
from .common import REPO_ROOT, cli, fmt, report, setup, target, time_call

def peak_rss_mib() -> float:
    """High-water resident set of this process, MiB: ``VmHWM`` of /proc/self/status on Linux (not
    ``ru_maxrss``: a child inherits its parent's peak there across fork + exec); ``ru_maxrss`` elsewhere."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM")) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux, bytes on macOS


def reset_peak_rss() -> bool:
    """Lower this process's high-water RSS (``VmHWM``) to its current RSS (Linux >= 4.0), so that
    the import-time peak does not hide a smaller peak of the op after it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_child(module: str, args: list[str], env: dict[str, str] | None = None, timeout_s: float = 900) -> dict:
    """Run ``python -m <module> --one <args>`` in a fresh process (``env`` added): its last stdout
    line's JSON, or ``{"error": ...}`` when the child fails (e.g. killed for memory)."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run([sys.executable, "-m", module, "--one", *args], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


NAME = "memory"
MODES = ("fwd", "fwd+bwd")
# skip: (impl, N, mode) -> reason, cuts on top of ``attention.skip_reason`` (e.g. for the 15-minute
# budget); none now.
FULL = dict(ns=(1024, 4096, 16384, 65536), slope_min_n=4096, jobs=1, modes=("fwd+bwd",),
            skip={("ours_features_in", 65536, "fwd"): "time budget", ("ours_features_in", 65536, "fwd+bwd"): "time budget",
                  ("ours_inside", 65536, "fwd"): "time budget",
                  ("performer", 4096, "fwd+bwd"): "time budget (101 s and 9.5 GiB in the issue-22 run)"})
# Quick: fwd+bwd, every impl at N = 64 and ours_inside also at 128 (for the slope), two children
# at a time (a tiny child is mostly imports and first-call set-up).
QUICK = dict(ns=(64, 128), slope_min_n=0, jobs=2, modes=("fwd+bwd",),
             skip={(i, 128, "fwd+bwd"): "quick mode" for i in ("ours_features_in", "performer", "sdpa")})
TARGET_MIB = 2048.0
TARGET_SLOPE = 1.15


def measure_one(impl: str, n: int, mode: str, quick: bool = False) -> dict:
    """Run in a fresh process: MiB of resident-set high water above the post-setup baseline."""
    setup(quick)
    features = FavorFeatures(D, M)
    call = make_call(make_op(impl, features, make_performer() if impl == "performer" else None), mode, *make_inputs(n))
    gc.collect()
    reset = reset_peak_rss()
    base = peak_rss_mib()
    seconds = time_call(call)
    peak = peak_rss_mib()
    return {"impl": impl, "n": n, "mode": mode, "baseline_mib": base, "peak_mib": peak, "delta_mib": peak - base,
            "seconds": seconds, "peak_reset": reset}


def loglog_slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(y) on log(x): 1 for linear growth, 2 for quadratic."""
    pts = [(math.log(x), math.log(y)) for x, y in points if y > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def main(quick: bool = False, out_dir=None, one: bool = False, impl=None, n=None, mode=None) -> dict | None:
    if one:  # a child: one configuration, its figures as the last line of stdout
        print(json.dumps(measure_one(impl, n, mode, quick)))
        return None
    cfg = QUICK if quick else FULL
    modes = cfg.get("modes", MODES)
    todo, skipped = [], {}
    for impl in IMPLS:
        for n in cfg["ns"]:
            for mode in modes:
                why = skip_reason(impl, mode, n) or cfg["skip"].get((impl, n, mode))
                if why:
                    skipped[f"{impl}/{mode}/{n}"] = why
                else:
                    todo.append((impl, n, mode))

    def child(job):
        impl, n, mode = job
        res = run_child("benchmarks.memory", ["--impl", impl, "--n", str(n), "--mode", mode] + ["--quick"] * quick)
        msg = res.get("error") or f"{fmt(res['delta_mib'])} MiB in {fmt(res['seconds'])} s"
        print(f"{impl} N={n} {mode}: {msg}", flush=True)
        return f"{impl}/{mode}/{n}", res

    with ThreadPoolExecutor(max_workers=cfg["jobs"]) as pool:
        children = dict(pool.map(child, todo))
    mib = {k: r.get("delta_mib") for k, r in children.items()}
    rows = []
    for n in cfg["ns"]:
        for mode in modes:
            cells = [n, mode]
            for impl in IMPLS:
                key = f"{impl}/{mode}/{n}"
                if key in skipped:
                    cells.append(f"skipped ({skipped[key]})")
                elif "error" in children[key]:
                    cells.append(f"failed ({children[key]['error'][:60]})")
                else:
                    cells.append(mib[key])
            rows.append(cells)
    big = max(cfg["ns"])
    ours = [(n, mib.get(f"ours_inside/fwd+bwd/{n}")) for n in cfg["ns"] if n >= cfg["slope_min_n"]]
    slope = loglog_slope([(n, y) for n, y in ours if y is not None])
    result = {
        "name": NAME, "quick": quick,
        "config": {"ns": list(cfg["ns"]), "modes": list(modes), "impls": list(IMPLS), "slope_min_n": cfg["slope_min_n"]},
        "mib_above_baseline": mib, "children": children, "skipped": skipped, "ours_inside_growth_slope": slope,
        "table": {"headers": ["N", "mode", *[f"{i} MiB" for i in IMPLS]], "rows": rows},
        "targets": [
            target(f"ours_inside fwd+bwd MiB above baseline, N={big}", mib.get(f"ours_inside/fwd+bwd/{big}"), "<=", TARGET_MIB),
            target(f"ours_inside fwd+bwd growth, log-log slope over N>={cfg['slope_min_n']}", slope, "<=", TARGET_SLOPE),
        ],
        "notes": [
            "MiB of high-water RSS (VmHWM) above the baseline taken after imports and input creation, one "
            "fresh process per cell, glibc's default allocator (what a user's process holds); "
            "fwd+bwd includes the q, k, v gradients that outlive the op.",
        ],
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__, one=dict(action="store_true", help="child mode: measure one configuration, print JSON"),
        impl=dict(choices=IMPLS, help="with --one: the implementation"),
        n=dict(type=int, help="with --one: the sequence length"), mode=dict(choices=MODES, help="with --one: fwd or fwd+bwd"))
