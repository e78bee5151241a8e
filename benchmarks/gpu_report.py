"""The Markdown section of ``benchmarks.gpu`` (``gpu.md``), from its JSON alone."""
from __future__ import annotations

from .common import fmt, format_table
from .gpu_common import NEEDS_CUDA


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


def _training(p: dict) -> list[str]:
    out = [f"Preset `{p.get('preset')}` ({fmt(p.get('params', 0) / 1e6)}M parameters), sequence {p.get('seq')}, "
           f"{p.get('autocast')} autocast, {p.get('optimizer')}. Data: {p.get('data')}. {p.get('batch_note', '')}", ""]
    rows, why = [], []
    for phase in ("eager", "eager_triton", "compiled"):
        r = p.get(phase)
        if isinstance(r, dict):
            rows.append([phase, r.get("path", "-"), r["batch"], r["tokens_per_s"], _pct(r["mfu"]) or _cell(r["mfu"]), r["ms_per_step"],
                         _cell(r["peak_memory_mib"]), r.get("compile_s"), r["timed_steps"], r["last_loss"]])
        elif r is not None:
            why.append(f"- {phase}: {r}")
    if rows:
        out += [format_table(["phase", "attention path", "batch", "tokens/s", "MFU (bf16 peak)", "ms/step", "peak MiB", "compile s",
                              "timed steps", "last loss"], rows), ""]
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
    out += [f"- {n}" for n in p.get("notes", [])]
    return out + [""]


def _compare(p: dict) -> list[str]:
    out = [f"Preset `{p.get('preset')}`, {p.get('tokens_per_step')} tokens per step (batch x N), "
           f"{p.get('autocast')} autocast, {p.get('optimizer')}; attention backend: {p.get('backend')}. "
           f"Data: {p.get('data')}.", ""]
    rows = []
    for r in p.get("rows", []):
        if r.get("status") == "ok":
            rows.append([r["position"], r["N"], r["batch"], r["tokens_per_s"], _pct(r["mfu"]) or _cell(r["mfu"]),
                         r["ms_per_step"], r["compile_s"], _cell(r["peak_memory_mib"]), r["path"], r["compile"]])
        else:
            rows.append([r["position"], r["N"], "-", r.get("status"), "-", "-", "-", "-", "-", "-"])
    if rows:
        out += [format_table(["attention", "N", "batch", "tokens/s", "MFU (bf16 peak)", "ms/step", "compile s",
                              "peak MiB", "path", "compiled"], rows), ""]
    if p.get("vs_softmax"):
        out += ["Tokens/s over softmax's at the same N: " + ", ".join(f"{k}: {v:.2f}x" for k, v in p["vs_softmax"].items())
                + ".", ""]
    return out


def _generation(p: dict) -> list[str]:
    rows = []
    for r in p.get("rows", []):
        if r.get("status") == "ok":
            rows.append([r["context"], r["prefill_tokens_per_s"], r["decode_tokens_per_s"], r["ms_per_step"],
                         _cell(r["peak_memory_mib"])])
        else:
            rows.append([r["context"], r.get("status"), "-", "-", "-"])
    out = [f"Preset `{p.get('preset')}`, batch {p.get('batch')}, {p.get('steps')} timed steps, "
           f"{p.get('autocast')} autocast, {p.get('decoding')}.", ""]
    if rows:
        out += [format_table(["context", "prefill tokens/s", "decode tokens/s", "ms/step", "peak MiB"], rows), ""]
    return out


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
