"""Run every benchmark, write ``benchmarks/results/<name>.json`` and (re)write BENCHMARKS.md.

    python -m benchmarks.run                 # every target: about 20 min on 2 idle cores
    python -m benchmarks.run --quick         # tiny sizes; writes under benchmarks/results/quick/
    python -m benchmarks.run --only memory   # re-run one benchmark; the others' sections come from
                                             # their JSON files, marked as from an earlier run

Run from the repository root. BENCHMARKS.md is generated: edit this file, not that one. Besides
each benchmark's JSON it writes ``summary.json`` (every target with PASS/MISS, the machine, its
GEMM rate and the load average before and after), and appends ``benchmarks/results/gpu/window.md``
(written by ``python -m benchmarks.gpu`` on a GPU) when that file exists.

``busy_neighbour`` (a run beside a busy loop, about 18 min) is not part of the default run: it
runs with ``--only busy_neighbour``, and its section is shown only in the run that ran it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import attention, bounds, busy_neighbour, generation, keywords, leak, lm_training, memory, training
from . import compile as compile_bench
from .common import (
    REPO_ROOT, RESULTS_DIR, THREADS_ENV, fmt, format_table, gemm_n, load_average, machine_info, machine_peak, ours_path,
    setup, target_line, write_json,
)

# The default run, in order (bounds last: it reads training.json of the same run).
BENCHMARKS = {m.NAME: m for m in (attention, keywords, memory, compile_bench, training, generation, lm_training, leak,
                                   bounds)}
OPT_IN = {busy_neighbour.NAME: busy_neighbour}  # only with --only
GPU_MD = RESULTS_DIR / "gpu" / "window.md"


def misses_section(results: dict[str, dict]) -> list[str]:
    """"What bounds the misses": for each MISS, the figure of this run that bounds it (from
    ``bounds``, the profiles, and the FLOP counts of ``attention``)."""
    misses = [(n, t) for n, r in results.items() for t in r["targets"] if t["pass"] is False]
    b = results.get("bounds")
    if not misses or b is None or b.get("quick") or "training_steps" not in b:
        return []
    ours = b["ours"]
    self_ms = sum(ours["self_ms"].values())
    gemm_share = ours["self_ms"]["gemm"] / self_ms
    n = b["config"]["n"]
    busiest = ", ".join(f"{k} {fmt(v)} ms" for k, v in ours["busiest_ms"].items() if k not in bounds.GEMM_OPS)
    op_line = (f"**The op's profile** (`bounds`, FAVOR+ inside at N={n} fwd+bwd ({fmt(ours['wall_ms'])} ms profiled): "
               f"GEMMs run at {fmt(ours['gemm_gflop_per_s'])} GFLOP/s "
               f"({fmt(100 * ours['gemm_gflop_per_s'] / b['gemm_gflop_per_s'])}% of the {fmt(b['gemm_gflop_per_s'])} "
               f"GFLOP/s GEMM rate) but are only {fmt(100 * gemm_share)}% of the op's self time; the other "
               f"{fmt(self_ms - ours['self_ms']['gemm'])} ms are memory-bound passes (the busiest outside the GEMMs: "
               f"{busiest}; autograd-node rows are Python and dispatch). With no time outside the GEMMs the "
               f"{fmt(b['ours_counted_gflop'])} GFLOP yardstick would run at "
               f"{fmt(100 * b['ours_counted_gflop'] / (ours['self_ms']['gemm'] / 1e3) / b['gemm_gflop_per_s'])}% "
               "of the GEMM rate.")
    out = ["## What bounds the misses", "", op_line, ""]
    op_ref = "the op's profile above"
    for name, t in misses:
        if t["name"].startswith("sdpa / "):
            N = int(t["name"].rsplit("=", 1)[1])
            ratio = attention.sdpa_flops(N) / attention.ours_flops(N)
            why = (f"SDPA does {fmt(ratio)}x the yardstick FLOPs at N={N}, so at equal efficiency sdpa / ours = "
                   f"{fmt(ratio)}; the target {fmt(t['threshold'])} needs ours to run its FLOPs "
                   f"{fmt(t['threshold'] / ratio)}x as fast as SDPA's kernel runs its own (measured here: "
                   f"{fmt(t['value'] / ratio)}x); what keeps ours from it: {op_ref}.")
        elif "crossover" in t["name"]:
            why = (f"at N=1536 SDPA does {fmt(attention.sdpa_flops(1536) / attention.ours_flops(1536))}x the yardstick "
                   f"FLOPs: a crossover there needs ours at least that efficient relative to SDPA; {op_ref}.")
        elif "efficiency" in t["name"]:
            why = f"bounded by the time outside the GEMMs: {op_ref}."
        elif name == "compile":
            reasons = {c.get("first_break") for c in results["compile"].get("checks", {}).values()} - {None}
            why = (f"the first graph break: {'; '.join(sorted(reasons))[:300]}." if reasons else
                   "see its section (compiled with graph breaks allowed where fullgraph failed).")
        elif name == "training":
            preset = t["name"].split()[-3].split("-")[0]
            st, base = b["training_steps"].get(preset), b.get("base_step_s", {}).get(preset)
            if st and base:
                parts = ", ".join(f"{k} {fmt(100 * v / st['profiled_ms'])}%" for k, v in st["parts_ms"].items() if v)
                why = (f"the step's profile ({parts}): with a free attention op the step would take "
                       f"{fmt(st['step_s_if_attention_free'])} s against the base commit's {fmt(base)} s, at most "
                       f"{fmt(base / st['step_s_if_attention_free'])}x with the rest of the step as it is.")
            else:
                why = "see the bounds section (no step profile of this preset)."
        else:
            why = "see its section: measured on a shared machine (load averages in Setup)."
        out.append(f"- **{name}: {t['name']}** ({fmt(t['value'])}, target {t['op']} {fmt(t['threshold'])}): {why}")
    return out + [""]


def render(results: dict[str, dict], machine: dict, command: str, wall_s: float, peak: float,
           loads: tuple[str, str] = ("unknown", "unknown"), earlier: list[str] = ()) -> str:
    """BENCHMARKS.md: setup, every target with PASS/MISS, then one section per benchmark."""
    quick = any(r["quick"] for r in results.values())
    out = [
        "# Benchmarks",
        "",
        "Generated by `benchmarks/run.py`; do not edit by hand." + (" **Quick mode: tiny sizes, numbers mean nothing.**" if quick else ""),
        "Each benchmark times our implementation and its anchors in one process, in interleaved rounds",
        "(each implementation once per round, the order rotating), and reports medians. The machine may be",
        "shared, so read the ratios between implementations, not the absolute times.", "",
        "## Setup",
        "", f"- Command (from the repository root): `{command}`",
        f"- Wall time: {fmt(wall_s / 60)} min; load average (1/5/15 min) {loads[0]} before, {loads[1]} after "
        f"(the machine has {machine['cores']} cores; other jobs share it)",
        f"- CPU: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB memory",
        f"- torch {machine['torch']}, {machine['threads']} threads, Python {machine['python']}, {machine['platform']}",
        f"- fp32 GEMM, measured at the start: {fmt(peak)} GFLOP/s (best of 7 n x n matmuls, n = {gemm_n(quick)}); "
        "fractions of peak below use the GEMM rate measured in the same rounds as the workload",
        f"- ours: {ours_path()}",
        "- Allocator: glibc's default, as users get it (no `mallopt`, no `MALLOC_*` variables; earlier timings "
        "kept freed memory in the heap with `mallopt`, which hid 20-30% of the op's time at N=4096)",
        *([f"- Not re-run by this command (sections and targets from their last run's JSON, each with its own "
           f"load note): {', '.join(earlier)}"] if earlier else []),
        "",
        "## Targets",
        "",
    ]
    rows = []
    for name, r in results.items():
        for t in r["targets"]:
            verdict = {True: "PASS", False: "MISS", None: "n/a"}[t["pass"]]
            rows.append([name, t["name"], t["value"], f"{t['op']} {fmt(t['threshold'])}", verdict])
    out += [format_table(["benchmark", "target", "measured", "threshold", "result"], rows) if rows else "(none)", ""]
    out += misses_section(results)
    for name, r in results.items():
        doc = ({**BENCHMARKS, **OPT_IN}[name].__doc__ or name).strip().splitlines()
        out += [f"## {name}: {doc[0]}", "", f"`python -m benchmarks.{name}`; JSON: `benchmarks/results/{name}.json`; "
                f"{fmt(r.get('wall_s', 0) / 60)} min" + (" (earlier run)" if name in earlier else "")
                + (f"; load average {r['load']}" if r.get("load") else "") + ".", ""]
        out += ["Config: `" + json.dumps(r["config"]) + "`", ""]
        out += [format_table(r["table"]["headers"], r["table"]["rows"]), ""]
        out += [f"- {n}" for n in r.get("notes", [])] + [""]
    if GPU_MD.is_file() and not quick:
        out += [GPU_MD.read_text().strip(), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test); results go to benchmarks/results/quick")
    p.add_argument("--out-dir", default=None, help="directory for <name>.json (default benchmarks/results[/quick])")
    p.add_argument("--md", default=None, help="Markdown report path (default BENCHMARKS.md, or <out-dir>/BENCHMARKS.md with --quick)")
    p.add_argument("--render", action="store_true",
                   help="run nothing: rewrite BENCHMARKS.md and summary.json from the JSON files")
    p.add_argument("--only", nargs="+", choices=[*BENCHMARKS, *OPT_IN],
                   help="run only these benchmarks; BENCHMARKS.md takes the others from their JSON files")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of a full run (default 2, the machine's cores; 1 where other jobs keep them busy)")
    a = p.parse_args(argv)
    if a.threads is not None:
        os.environ[THREADS_ENV] = str(a.threads)
    out_dir = Path(a.out_dir) if a.out_dir else (RESULTS_DIR / "quick" if a.quick else RESULTS_DIR)
    md = Path(a.md) if a.md else (out_dir / "BENCHMARKS.md" if a.quick else REPO_ROOT / "BENCHMARKS.md")
    setup(a.quick)
    machine = machine_info()
    before = load_average()
    t0 = time.perf_counter()
    peak = machine_peak(a.quick)
    results = {}
    for name in [] if a.render else (a.only or BENCHMARKS):
        t = time.perf_counter()
        results[name] = {**BENCHMARKS, **OPT_IN}[name].main(a.quick, out_dir)
        results[name]["wall_s"] = time.perf_counter() - t
        results[name]["load"] = load_average()  # after it, 1/5/15 min
        write_json(results[name], out_dir)  # again, with wall_s
        print(f"{name}: {fmt(results[name]['wall_s'] / 60)} min", flush=True)
    wall = time.perf_counter() - t0
    earlier = []
    for name in BENCHMARKS:  # with --only: the other sections as their last run left them
        path = out_dir / f"{name}.json"
        if name not in results and path.is_file():
            r = json.loads(path.read_text())
            if r.get("quick") == a.quick:
                results[name] = r
                earlier.append(name)
    results = {n: results[n] for n in [*BENCHMARKS, *OPT_IN] if n in results}
    command = " ".join(["python -m benchmarks.run", *argv])
    md.parent.mkdir(parents=True, exist_ok=True)
    loads = (before, load_average())
    md.write_text(render(results, machine, command, wall, peak, loads, earlier))
    summary = {"name": "summary", "quick": a.quick, "command": command, "wall_s": wall, "load_before": loads[0],
               "load_after": loads[1], "from_earlier_runs": earlier, "machine": {**machine, "gemm_gflop_per_s": peak, "gemm_n": gemm_n(a.quick)},
               "targets": [{"benchmark": n, **t, "result": {True: "PASS", False: "MISS", None: "n/a"}[t["pass"]]}
                           for n, r in results.items() for t in r["targets"]]}
    write_json(summary, out_dir)
    print("\n== targets ==\n" + "\n".join(f"{n}: {target_line(t)}" for n, r in results.items() for t in r["targets"]))
    print(f"wrote {md}; wall time {fmt(wall / 60)} min")
    return results


if __name__ == "__main__":
    main()
