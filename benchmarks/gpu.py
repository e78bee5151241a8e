"""The GPU check and benchmark: is every path right on the device, and how fast is it?

    python -m benchmarks.gpu                            # CUDA: about 8.5 minutes on an H100
    python -m benchmarks.gpu --device cpu --quick       # every part at toy sizes, under a minute
    python -m benchmarks.gpu --check                    # correctness only; exit 1 if a check fails

One process on one device; the parts (``PARTS``, docs/gpu.md) run in order, each with a share of
``--budget-s``: 0. compare (``gpu_train.run_compare``, only when named): training tokens/s and MFU,
softmax first; 1. correctness (``gpu_checks``); 2. op_speed (``gpu_speed``); 3. training and
4. generation (``gpu_train``). The JSON (``--out``) and its Markdown beside it are rewritten after
every part, so a run cut short keeps what it measured. Exit 1 if a check failed, 2 if a part
raised, else 0; what the CPU cannot run says "skipped: needs CUDA". Wheels for a device machine
without network: ``bash benchmarks/gpu_wheels.sh``.
"""
from __future__ import annotations

import os
import sys

if "cpu" in sys.argv[sys.argv.index("--device") + 1:][:1] if "--device" in sys.argv else False:
    # CPU mode: the Triton kernels' rows run in Triton's interpreter, which must be chosen before
    # triton.language is first imported (torch may import it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import time
import traceback
from pathlib import Path

import torch

try:  # performer-pytorch (which draws the FAVOR+ projections) imports distutils, which Python 3.12
    import distutils  # noqa: F401  has only through setuptools' shim; importing setuptools installs it
except ImportError:
    import setuptools  # noqa: F401

from . import gpu_checks, gpu_speed, gpu_train  # noqa: E402
from .common import BENCH_DIR, NEEDS_CUDA, Ctx, PartTimeout, deadline, device_info, fmt, format_table, one_line, write_json  # noqa: E402

# Part name -> (title, runner, share of the budget). Run in this order; the JSON and the
# Markdown list them by number.
PARTS = {
    "compare": ("0. Training: softmax against linear attention", gpu_train.run_compare, 0.3),
    "correctness": ("1. Correctness on the device", lambda ctx, res: res.update(gpu_checks.run(ctx)), 0.15),
    "op_speed": ("2. Op speed", gpu_speed.run, 0.35), "generation": ("4. Generation", gpu_train.run_generation, 0.06),
    "training": ("3. Training", gpu_train.run_training, 0.44),
}
ORDER = ("compare", "correctness", "op_speed", "training", "generation")
GRACE_S = 20.0  # past a part's budget before its deadline fires (a call in flight may finish)


# --- the Markdown section, from the JSON alone -----------------------------------------------

def _cell(x):
    if isinstance(x, str):
        return "needs CUDA" if x.startswith(NEEDS_CUDA) else x
    return x


def _pct(x):
    return None if not isinstance(x, float) else f"{100 * x:.1f}%"


def _head(title: str, part: dict) -> list[str]:
    line = f"Status: **{part.get('status')}**"
    if "wall_s" in part:
        line += f", {fmt(part['wall_s'])} s of a {fmt(part.get('budget_s'))} s budget"
    if "error" in part:
        line += f". {part['error']}"
    return [f"### {title}", "", line + ".", ""]


def _correctness(p: dict) -> list[str]:
    checks = p.get("checks", [])
    rows = []
    for c in checks:
        verdict = {True: "pass", False: "FAIL", None: "skipped"}[c.get("passed")]
        if "error" in c:
            rows.append([c["check"], c["dtype"], c["error"], "-", "-", "-", verdict])
        elif "max_abs_before_t0" in c:
            rows.append([c["check"], c["dtype"], f"before t0: {c['max_abs_before_t0']:.3g} (must be 0)",
                         f"after: {c['max_abs_from_t0']:.3g}", "-", "exact", verdict])
        elif "losses" in c:
            rows.append([c["check"], c["dtype"], "losses " + ", ".join(f"{x:.3f}" for x in c["losses"]),
                         "grad norms " + ", ".join(f"{x:.3g}" for x in c["grad_norms"])
                         + f" ({c.get('steps_applied')}/{len(c['losses'])} steps applied)"
                         + (f"; first non-finite output: {c['first_nonfinite_module']}" if c.get("first_nonfinite_module") else ""),
                         "-", "finite", verdict])
        else:
            base = c.get("naive_fp32_max_rel_to_max")
            tol = f"{c['rtol']:.3g} / {c['atol']:.3g}" + (f" / {c['grad_atol']:.3g}" if "grad_atol" in c else "")
            rows.append([c["check"], c["dtype"], f"{c['worst_over_tol']:.3g}", f"{c['max_rel_to_max']:.3g}",
                         f"{base:.3g}" if base else "-", tol, verdict])
    out = [f"{p.get('passed', 0)} checks passed, {len(p.get('failed', []))} failed"
           + (": " + "; ".join(p["failed"]) if p.get("failed") else "") + ".", ""]
    if rows:
        out += [format_table(["check", "dtype", "worst error / tolerance", "max error / max abs(ref)",
                              "same, naive in fp32", "rtol / atol / grad atol", "result"], rows), ""]
    whys = {("Triton kernels, " if c["check"].startswith("triton:") else "") + c["dtype"]: c["why"]
            for c in checks if "why" in c}
    out += ["Fast vs naive: every element must obey abs(fast - ref) <= atol * max abs(ref) + rtol * abs(ref) "
            "(grad atol for the gradients), ref = the naive op in float64 on the same rounded inputs (outputs, "
            "final states, gradients of q, k, v for a random upstream gradient). \"same, naive in fp32\": the error "
            "of the naive op run in float32 and rounded like the fast path, for comparison.",
            *[f"- {d}: {w}" for d, w in whys.items()], ""]
    if p.get("triton"):
        out += [f"Triton kernels (``linear_rope.ops.triton``): {p['triton']}.", ""]
    return out


def _speed(p: dict) -> list[str]:
    rows, cfg = p.get("rows", []), p.get("config", {})
    out = [f"- {n}: {d}" for n, d in p.get("impls", {}).items()] + [""]
    if p.get("fla_warmup_s"):
        out += ["fla's first calls (autotuning), before the timed cells: "
                + ", ".join(f"{n} {fmt(v) + ' s' if isinstance(v, float) else v}" for n, v in p["fla_warmup_s"].items()), ""]
    if p.get("memory"):
        out += [f"Peak memory: {p['memory']}", ""]
    shown = ("ours_torch", "ours_triton", "ours_fla", "sdpa", "fla_chunk", "fla_fused_chunk", "performer")
    impls = sorted(p.get("impls", {}), key=lambda i: shown.index(i) if i in shown else len(shown))  # not run order
    reasons: dict[str, list[int]] = {}
    for B, H in cfg.get("configs", []):
        table = []
        for n in cfg.get("ns", []):
            for mode in ("fwd", "fwd+bwd"):
                get = {r["impl"]: r for r in rows if (r["B"], r["H"], r["N"], r["mode"]) == (B, H, n, mode)}
                if not get:
                    continue
                cells = [n, mode]
                for i in impls:
                    r = get.get(i, {})
                    if r.get("status") == "ok":
                        cells.append(r["ms"])
                    else:
                        reasons.setdefault(f"{i}: {r.get('status', 'not reached (the part stopped)')}", []).append(n)
                        cells.append("needs CUDA" if str(r.get("status", "")).startswith(NEEDS_CUDA) else "-")
                if all(not isinstance(c, float) for c in cells[2:]):
                    continue  # nothing measured in this row: the reasons are listed below the table
                o, t, s = get.get("ours_torch", {}), get.get("ours_triton", {}), get.get("sdpa", {})
                cells.append(s["ms"] / o["ms"] if "ms" in o and "ms" in s else None)
                cells.append(s["ms"] / t["ms"] if "ms" in t and "ms" in s else None)
                for r in (o, t, s):
                    cells.append(f"{fmt(r['tflops'])} ({_pct(r.get('frac_bf16_peak')) or 'no peak'})" if "tflops" in r else None)
                cells += [_cell(o.get("peak_mib")), _cell(t.get("peak_mib")), _cell(s.get("peak_mib"))]
                table.append(cells)
        if table:
            out += [f"B={B}, H={H}, d={cfg.get('d')}, m={cfg.get('m')}, bf16; milliseconds (median):", "",
                    format_table(["N", "mode", *[f"{i} ms" for i in impls], "sdpa/ours_torch", "sdpa/ours_triton",
                                  "ours_torch TFLOP/s", "ours_triton TFLOP/s", "sdpa TFLOP/s", "ours_torch MiB",
                                  "ours_triton MiB", "sdpa MiB"], table), ""]
    if reasons:
        out += ["Not measured (\"-\", or rows left out):",
                *[f"- {r} ({len(ns)} cells, N={min(ns)}..{max(ns)})" for r, ns in sorted(reasons.items())], ""]
    prof = p.get("profile")
    if isinstance(prof, dict):
        busy = (f"{prof['kernels']} kernels, {fmt(prof['kernel_ms'])} ms of kernel time = "
                f"{_pct(prof['gpu_busy_fraction'])} of the wall time" if "kernel_ms" in prof else _cell(prof["kernels"]))
        out += [f"Profile of {prof.get('impl', 'ours')} ({prof.get('path', '')}), fwd+bwd at B={prof['B']}, H={prof['H']}, N={prof['N']} (torch.profiler): "
                f"{fmt(prof['wall_ms_profiled'])} ms wall; {busy}. Top ops by {prof['sorted_by']}: "
                + ", ".join(f"{t['op']} {fmt(t['self_ms'])} ms ({_pct(t['share'])}, {t['calls']} calls)"
                            for t in prof["top"][:8]) + ".", ""]
    elif prof:
        out += [f"Profile of ours: {prof}", ""]
    for key, c in p.get("crossover", {}).items():
        if isinstance(c, str):
            out.append(f"- crossover against flash, {key}: {c}")
            continue
        for what, x in c.items():
            est = f", about N={x['estimate']}" if x.get("estimate") else ""
            out.append(f"- crossover {what.replace('_vs_', ' vs ')}, {key}: N={x['n']}{est} ({x['note']})")
    return out + [""]


def _rows(rows: list[dict], cols: list[tuple], keys: int = 1) -> list[str]:
    """A table of result rows, a column per (header, key or function of the row); a row that did
    not run shows its first ``keys`` cells and then its status."""
    body = [[_cell(f(r) if callable(f) else r.get(f)) for _, f in cols] if r.get("status", "ok") == "ok" else
            [r.get(f) for _, f in cols[:keys]] + [r.get("status")] + ["-"] * (len(cols) - keys - 1) for r in rows]
    return [format_table([h for h, _ in cols], body), ""] if body else []


def _mfu(r):
    return _pct(r["mfu"]) or _cell(r["mfu"])


def _training(p: dict) -> list[str]:
    out = [f"Preset `{p.get('preset')}` ({fmt(p.get('params', 0) / 1e6)}M parameters), sequence {p.get('seq')}, "
           f"{p.get('autocast')} autocast, {p.get('optimizer')}. Data: {p.get('data')}. {p.get('batch_note', '')}", ""]
    phases = [(ph, p.get(ph)) for ph in ("eager", "eager_triton", "compiled") if p.get(ph) is not None]
    out += _rows([dict(r, phase=ph) for ph, r in phases if isinstance(r, dict)],
                 [("phase", "phase"), ("attention path", "path"), ("batch", "batch"), ("tokens/s", "tokens_per_s"),
                  ("MFU (bf16 peak)", _mfu), ("ms/step", "ms_per_step"), ("peak MiB", "peak_memory_mib"),
                  ("compile s", "compile_s"), ("timed steps", "timed_steps"), ("last loss", "last_loss")])
    why = [f"- {ph}: {r}" for ph, r in phases if not isinstance(r, dict)]
    out += why + ([""] if why else [])
    if isinstance(p.get("compiled"), dict):
        c = p["compiled"]
        out += [f"Compiled vs eager, first compiled step's loss on one batch: {c['first_step_loss_compiled']:.4f} vs "
                f"{c['same_batch_loss_eager']:.4f} eager; speedup {p.get('compiled_speedup', 0):.2f}x "
                f"({p.get('compiled_speedup_note', '')}).", ""]
    curve = p.get("loss_curve", [])
    if curve:
        stride = max(1, len(curve) // 16)
        pts = curve[::stride] + ([curve[-1]] if (len(curve) - 1) % stride else [])
        out += ["Loss curve (nats/byte; step: loss): " + ", ".join(f"{s}: {l:.3f}" for s, l, _ in pts), ""]
    return out + [f"- {n}" for n in p.get("notes", [])] + [""]


def _compare(p: dict) -> list[str]:
    out = [f"Preset `{p.get('preset')}`, {p.get('tokens_per_step')} tokens per step (batch x N), "
           f"{p.get('autocast')} autocast, {p.get('optimizer')}; attention backend: {p.get('backend')}. "
           f"Data: {p.get('data')}.", ""]
    out += _rows(p.get("rows", []), [("attention", "position"), ("N", "N"), ("batch", "batch"),
                                     ("tokens/s", "tokens_per_s"), ("MFU (bf16 peak)", _mfu), ("ms/step", "ms_per_step"),
                                     ("compile s", "compile_s"), ("peak MiB", "peak_memory_mib"), ("path", "path"),
                                     ("compiled", "compile")], keys=2)
    if p.get("vs_softmax"):
        out += ["Tokens/s over softmax's at the same N: " + ", ".join(f"{k}: {v:.2f}x" for k, v in p["vs_softmax"].items())
                + ".", ""]
    return out


def _generation(p: dict) -> list[str]:
    return [f"Preset `{p.get('preset')}`, batch {p.get('batch')}, {p.get('steps')} timed steps, "
            f"{p.get('autocast')} autocast, {p.get('decoding')}.", ""] + \
        _rows(p.get("rows", []), [("context", "context"), ("prefill tokens/s", "prefill_tokens_per_s"),
                                  ("decode tokens/s", "decode_tokens_per_s"), ("ms/step", "ms_per_step"),
                                  ("peak MiB", "peak_memory_mib")])


def render(result: dict) -> str:
    dev = result["device"]
    out = ["## GPU check and benchmark (`python -m benchmarks.gpu`)", ""]
    if result.get("cpu_mode_note") or result.get("quick"):
        out += [f"**{result.get('cpu_mode_note') or 'Quick mode: toy sizes, figures mean nothing.'}**", ""]
    out += [f"- Command: `{result['command']}` (started {result['started_utc']} UTC"
            + (f", {fmt(result['wall_s'] / 60)} min, exit code {result['exit_code']})" if result.get("finished") else
               ", not finished)"),
            f"- Device: {dev.get('name')}" + (f", {dev.get('memory_gib')} GiB, compute capability {dev.get('capability')}"
                                              if dev.get("type") == "cuda" else "")
            + f"; torch {dev.get('torch')}, CUDA {dev.get('cuda')}; dense bf16 peak "
            + (f"{fmt(dev['bf16_peak_tflops'])} TFLOP/s" if dev.get("bf16_peak_tflops") else "unknown (fractions n/a)")
            + f"; TF32 matmuls {'on' if result.get('tf32') else 'off'}",
            f"- Budget: {fmt(result['budget_s'])} s over all parts; JSON: `{result['name']}.json` beside this file", ""]
    parts = result["parts"]
    render_part = {"compare": _compare, "correctness": _correctness, "op_speed": _speed, "training": _training,
                   "generation": _generation}
    for name in ("compare", "correctness", "op_speed", "training", "generation"):
        p = parts[name]
        out += _head(p["title"], p)
        if not p.get("status", "").startswith("not "):  # not run (--parts) / not reached
            out += render_part[name](p)
    out += ["### 5. CPU mode", "",
            "`python -m benchmarks.gpu --device cpu --quick` runs parts 0-4 at toy sizes in under a minute (a CI "
            "test does); what the CPU cannot run says \"" + NEEDS_CUDA + "\". "
            + ("This run was on the CPU." if dev.get("type") == "cpu" else "This run was on CUDA."), ""]
    return "\n".join(out)


def parse(argv):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true", help="toy sizes: every part in under a minute on a CPU")
    p.add_argument("--out", default=str(BENCH_DIR / "results" / "gpu.json"),
                   help="the JSON file; the Markdown section goes beside it with the suffix .md")
    p.add_argument("--data", default=None, help="byte corpus for the training part (.bz2/.gz/.xz/raw); "
                   "default: the shared enwiki sample if found, else random bytes (noted)")
    p.add_argument("--parts", default=",".join(ORDER[1:]), help=f"comma-separated subset of {','.join(ORDER)} (default: all but compare)")
    p.add_argument("--check", action="store_true", help="part 1 (correctness) only")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-time budget of all parts, seconds (default 480; 50 with --quick)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="time torch.compile in the training part (auto: on CUDA only)")
    p.add_argument("--train-batch", type=int, default=None, help="training batch (default 16; 4 with --quick); "
                   "halved on out-of-memory")
    p.add_argument("--gen-batch", type=int, default=None, help="decoding batch (default 8; 2 with --quick)")
    p.add_argument("--tf32", action="store_true", help="allow TF32 for float32 matmuls (the op computes in "
                   "float32); off by default, recorded in the JSON")
    a = p.parse_args(argv)
    parts = ["correctness"] if a.check else [s.strip() for s in a.parts.split(",") if s.strip()]
    bad = sorted(set(parts) - set(ORDER))
    if bad:
        p.error(f"--parts: unknown {bad}; choose from {list(ORDER)}")
    a.parts = parts
    return a


def _write(result: dict, out: Path) -> None:
    write_json(result, out)
    out.with_suffix(".md").write_text(render(result))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here; use --device cpu", file=sys.stderr)
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1 if a.quick else torch.get_num_threads())  # 1: no OpenMP spinning on shared cores
    budget = a.budget_s or (50.0 if a.quick else 480.0)
    ctx = Ctx(device=device, quick=a.quick, data=a.data, train_batch=a.train_batch, gen_batch=a.gen_batch,
              compile=a.compile == "on" or (a.compile == "auto" and device.type == "cuda"))
    out = Path(a.out)
    ctx.save = lambda: _write(result, out)
    t_start = time.perf_counter()
    result: dict = {
        "name": out.stem, "command": " ".join(["python -m benchmarks.gpu", *argv]), "quick": a.quick,
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "budget_s": budget,
        "device": device_info(device), "tf32": a.tf32, "finished": False,
        "cpu_mode_note": None if device.type == "cuda" else
        f"CPU mode: toy sizes, figures mean nothing; flash, fla and CUDA memory: {NEEDS_CUDA}",
        "parts": {name: {"title": PARTS[name][0], "status": "not reached (the run stopped before it)" if name in a.parts
                         else "not run (--parts)"} for name in ORDER},
    }
    shares = sum(PARTS[n][2] for n in a.parts)
    for name in (n for n in PARTS if n in a.parts):
        title, runner, share = PARTS[name]
        left = budget - (time.perf_counter() - t_start)
        rec = result["parts"][name] = {"title": title, "status": "running", "budget_s": max(0.0, budget * share / shares)}
        if name == "training" or a.quick:  # training runs last and may use what the others left; toy sizes
            rec["budget_s"] = max(rec["budget_s"], left)  # need no shares, only the cap on the whole run
        print(f"== {title} (budget {rec['budget_s']:.0f} s)", flush=True)
        # TF32 (--tf32) only where speed is measured: the checks' float32 tolerances assume float32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = a.tf32 and name != "correctness"
        ctx.start_part(rec["budget_s"])
        ctx.save()  # "running" in the file until it ends: a run killed from outside shows where
        t0 = time.perf_counter()
        try:
            with deadline(rec["budget_s"] + GRACE_S):
                runner(ctx, rec)
            rec["status"] = "ok"
        except PartTimeout as e:
            rec["status"], rec["error"] = "timed out", f"{e}; what it measured before is kept"
        except Exception as e:  # recorded with its one-line message, never dropped
            rec["status"], rec["error"] = "error", one_line(e)
            traceback.print_exc()
        rec["wall_s"] = time.perf_counter() - t0
        print(f"   {name}: {rec['status']}{' (' + rec['error'] + ')' if 'error' in rec else ''}, "
              f"{rec['wall_s']:.1f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _write(result, out)
    corr = result["parts"]["correctness"]
    code = 0
    if "correctness" in a.parts and (corr["status"] != "ok" or corr.get("failed")):
        code = 1
    elif any(p["status"] == "error" for p in result["parts"].values()):
        code = 2
    result.update(finished=True, wall_s=time.perf_counter() - t_start, exit_code=code)
    _write(result, out)
    if corr.get("failed"):
        print("FAILED checks:\n  " + "\n  ".join(corr["failed"]))
    print(f"correctness: {corr.get('passed', '-')} passed, {len(corr.get('failed', []))} failed; "
          f"wall {result['wall_s']:.0f} s; exit {code}")
    print(f"wrote {out.with_suffix('.md')}")
    print(f"wrote {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
