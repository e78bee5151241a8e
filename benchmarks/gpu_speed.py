"""Part 2 of ``benchmarks.gpu``: op speed, forward and fwd+bwd, bf16 inputs, d = 64.

How it measures: docs/performance.md, "Methods" (``benchmarks.gpu_speed``).
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import time

import torch
import torch.nn.functional as F

from linear_rope import FavorFeatures, rotary_linear_attention
from linear_rope.ops.triton import kernel_status, use_backend

from .attention import ours_flops, sdpa_flops
from .common import NEEDS_CUDA, Ctx, PartTimeout, is_oom, measure, one_line

D, M, FLA_K = 64, 266, 64
MODES = ("fwd", "fwd+bwd")
FULL = dict(configs=((8, 12), (1, 12)), ns=(1024, 2048, 4096, 8192, 16384), reps=10, cell_max_s=0.5,
            profile=(8, 12, 4096))
QUICK = dict(configs=((1, 2), (2, 2)), ns=(64, 128), reps=2, cell_max_s=0.1, profile=(1, 2, 128))
# fla autotunes each kernel over its whole config list on the first call at a shape (126 s of a
# 205 s part on an H200): each of its autotuned kernels keeps its first FLA_MAX_CONFIGS configs
# (env FLA_MAX_CONFIGS; 0: no cap). SPEED_IMPLS (env, comma-separated names of ``PATHS``) keeps
# only those rows: the 10-minute run times ours, flash SDPA and fla.
FLA_MAX_CONFIGS = 4
PROFILE_MIN_S = 10.0  # budget left for the profile of ours
GROWTH = {"sdpa": 4.0}  # time x per doubling of N, for the budget forecast; others 2.2


def fla_flops(n: int, *, heads: int, k: int = FLA_K, e: int = D, chunk: int = 64, backward: bool = True) -> float:
    nc = math.ceil(n / chunk)
    per_head = nc * (2 * chunk * chunk * k + 2 * chunk * chunk * e + 4 * chunk * k * e) + 2 * n * k
    return per_head * heads * (3 if backward else 1)


def performer_flops(n: int, *, heads: int, backward: bool = True) -> float:
    return (4 * n * D * M + 4 * n * M * D) * heads * (3 if backward else 1)


def _flash(ctx: Ctx):
    """(fn, backend note). Flash if it runs on this card at these dtypes, else the default."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    if not ctx.cuda:
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                f"CPU default backend; flash: {NEEDS_CUDA}")
    try:
        x = torch.randn(1, 1, 128, D, device=ctx.device, dtype=torch.bfloat16)
        flash(x, x, x)
        return flash, "flash (SDPBackend.FLASH_ATTENTION)"
    except RuntimeError as e:
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                f"default backend: flash could not run ({one_line(e)})")


def _fla(ctx: Ctx, fused: bool):
    if not ctx.cuda:
        return None, f"{NEEDS_CUDA} (fla's kernels are Triton GPU kernels)"
    try:
        from fla.ops.linear_attn import chunk_linear_attn, fused_chunk_linear_attn
    except Exception as e:  # ImportError, or a Triton / torch version mismatch at import
        return None, f"skipped: fla not installed ({one_line(e)}); carry fla-core, see benchmarks/gpu_wheels.sh"
    op = fused_chunk_linear_attn if fused else chunk_linear_attn
    cap = cap_fla_autotune(int(os.environ.get("FLA_MAX_CONFIGS", FLA_MAX_CONFIGS)))
    return (lambda q, k, v: op(F.elu(q) + 1, F.elu(k) + 1, v, normalize=True)[0]), \
        f"fla.ops.linear_attn.{op.__name__}, K={FLA_K}, elu+1 features, normalize=True, [B, N, H, K] layout; {cap}"


def cap_fla_autotune(max_configs: int) -> str:
    """Keep the first ``max_configs`` configs of every autotuned kernel fla has imported; a note."""
    import sys

    try:
        from triton.runtime.autotuner import Autotuner
    except Exception as e:  # noqa: BLE001
        return f"not capped: {one_line(e)}"
    if max_configs <= 0:
        return "not capped (FLA_MAX_CONFIGS=0)"
    capped = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            seen = 0
            while obj is not None and seen < 4:  # triton.heuristics wraps the autotuner in .fn
                if isinstance(obj, Autotuner) and len(obj.configs) > max_configs:
                    obj.configs = obj.configs[:max_configs]
                    capped += 1
                obj, seen = getattr(obj, "fn", None), seen + 1
    return f"autotuning capped at the first {max_configs} configs of each kernel ({capped} kernels)"


def _performer(ctx: Ctx):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # it prints when it falls back to its non-CUDA causal path
        from performer_pytorch import FastAttention

        fa = FastAttention(dim_heads=D, nb_features=M, causal=True).to(ctx.device, torch.bfloat16)
    path = getattr(fa.causal_linear_fn, "__name__", None) or getattr(fa.causal_linear_fn, "func").__name__
    return fa, f"performer_pytorch FastAttention(64, 266, causal=True), bf16, causal path {path}"


def _ours(W, path: str):
    """The public op with its path forced: "torch", "triton" or "fla"."""
    def call(q, k, v):
        with use_backend(path):
            return rotary_linear_attention(q, k, v, projection=W)
    return call


def _ours_fla(ctx: Ctx, W):
    from linear_rope.ops.fla_path import FLA_TESTED, fla_available

    if not ctx.cuda:
        return None, f"{NEEDS_CUDA} (the fla path runs fla-core's Triton GPU kernels)"
    if not fla_available():
        return None, "skipped: fla-core is not installed (pip install 'linear_rope[fla]')"
    return _ours(W, "fla"), (f"fla path: linear_rope.rotary_linear_attention(projection=W [266, 64]) forced onto it "
                             f"(fla-core chunk_linear_attn for numerator and denominator, tested with {FLA_TESTED})")


def _ours_triton(ctx: Ctx, W):
    ok, why = kernel_status(ctx.device if ctx.cuda else None, forced=True)
    if not ok:
        return None, f"skipped: {why}"
    where = why if ctx.cuda else f"{why}: interpreted on the CPU, times mean nothing"
    return _ours(W, "triton"), f"{where}; linear_rope.rotary_linear_attention(projection=W [266, 64]) forced onto them"


PATHS = {"ours_torch": "torch path", "ours_triton": "triton kernels", "ours_fla": "fla path", "sdpa": "flash SDPA",
         "fla_chunk": "fla", "fla_fused_chunk": "fla", "performer": "performer-pytorch"}


def impls(ctx: Ctx) -> dict:
    """name -> (fn or None, description or skip reason), in the order each N measures them: the
    comparison that matters first (the kernels, flash, fla), then the rest."""
    W = FavorFeatures(D, M).projection.to(ctx.device)
    makers = {"ours_triton": lambda: _ours_triton(ctx, W), "sdpa": lambda: _flash(ctx),
              "fla_chunk": lambda: _fla(ctx, False),
              "ours_torch": lambda: (_ours(W, "torch"), "torch path: linear_rope.rotary_linear_attention(projection=W "
                                                        "[266, 64]) forced onto it, causal Eq. 19, float32 inside"),
              "fla_fused_chunk": lambda: _fla(ctx, True), "performer": lambda: _performer(ctx),
              # last: its first call at a new feature width autotunes fla's kernels again (the first
              # GPU run spent its part's remaining 90 s there, before any flash or fla cell)
              "ours_fla": lambda: _ours_fla(ctx, W)}
    keep = [n.strip() for n in os.environ.get("SPEED_IMPLS", "").split(",") if n.strip()] or list(makers)
    res = {}
    for name, make in makers.items():
        try:
            res[name] = make() if name in keep else (None, "skipped: not in SPEED_IMPLS")
        except Exception as e:
            res[name] = (None, f"error: {one_line(e)}")
    return res


def _flops(impl: str, n: int, heads: int, backward: bool) -> float:
    if impl.startswith("ours"):  # the kernels do the torch path's GEMMs (and no more)
        return ours_flops(n, d=D, m=M, heads=heads, backward=backward)
    if impl == "sdpa":
        return sdpa_flops(n, d=D, heads=heads, backward=backward)
    if impl.startswith("fla"):
        return fla_flops(n, heads=heads, backward=backward)
    return performer_flops(n, heads=heads, backward=backward)


def _performer_too_big(ctx: Ctx, B: int, H: int, n: int, mode: str) -> str | None:
    """performer's non-CUDA causal path keeps the [N, m, e] prefix sums of every token for backward."""
    if not ctx.cuda or mode == "fwd":
        return None
    need = 2 * B * H * n * M * D * 2  # prefix sums and their einsum input, bf16
    free, _ = torch.cuda.mem_get_info(ctx.device)
    if need > 0.7 * free:
        return f"skipped: needs about {need / 2**30:.0f} GiB ([N, m, e] prefix sums) of {free / 2**30:.0f} GiB free"
    return None


def crossover(ns, ours_ms: dict, other_ms: dict):
    """The smallest measured N from which ours is faster at every larger measured N, and an
    estimate between the two bracketing N (log-log interpolation of the time ratio)."""
    both = [n for n in ns if isinstance(ours_ms.get(n), float) and isinstance(other_ms.get(n), float)]
    if not both:
        return {"n": None, "estimate": None, "note": "not measured"}
    ratio = {n: other_ms[n] / ours_ms[n] for n in both}
    first = next((n for i, n in enumerate(both) if all(ratio[m] > 1 for m in both[i:])), None)
    if first is None:
        return {"n": None, "estimate": None, "note": f"ours slower at every measured N up to {both[-1]}"}
    i = both.index(first)
    if i == 0:
        return {"n": first, "estimate": None, "note": f"ours faster already at the smallest N ({first})"}
    lo, hi = both[i - 1], first
    t = -math.log(ratio[lo]) / (math.log(ratio[hi]) - math.log(ratio[lo]))
    est = math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo)))
    return {"n": first, "estimate": round(est), "note": f"between N={lo} and N={hi}"}


def run(ctx: Ctx, res: dict) -> None:
    """Fills ``res`` as it goes, so a part cut short by its budget keeps what it measured."""
    cfg = QUICK if ctx.quick else FULL
    ops = impls(ctx)
    peak = ctx.peak_tflops()
    res.update(config={"d": D, "m": M, "fla_k": FLA_K, "dtype": "bfloat16", "configs": [list(c) for c in cfg["configs"]],
                       "ns": list(cfg["ns"]), "reps": cfg["reps"], "bf16_peak_tflops": peak},
               impls={n: d for n, (_, d) in ops.items()}, rows=[], crossover={},
               memory=None if ctx.cuda else f"{NEEDS_CUDA} (torch.cuda.max_memory_allocated)")
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    res["fla_warmup_s"] = _warm_fla(ctx, cfg, ops, gen)
    last: dict[tuple, float | str] = {}  # (B, H, impl, mode) -> ms at the last N, or why it stopped
    try:  # N outside, the two shapes inside: when the budget ends, both have the smaller N
        for n in cfg["ns"]:
            for B, H in cfg["configs"]:
                q, k, v = (torch.randn(B, H, n, D, device=ctx.device, dtype=torch.bfloat16, generator=gen)
                           for _ in range(3))
                for name, (fn, desc) in ops.items():
                    for mode in MODES:
                        _cell(ctx, cfg, res, last, (B, H, name, mode), n, fn, desc, q, k, v, peak)
                del q, k, v
                if ctx.cuda:
                    torch.cuda.empty_cache()
            ctx.save()
        if ctx.left() > PROFILE_MIN_S or ctx.quick:
            try:
                name = "ours_triton" if ops["ours_triton"][0] is not None and ctx.cuda else "ours_torch"
                res["profile"] = dict(profile_ours(ctx, ops[name][0], *cfg["profile"]), impl=name, path=PATHS[name])
            except Exception as e:
                res["profile"] = f"error: {one_line(e)}"
        else:
            res["profile"] = "skipped: part budget spent"
    finally:  # also when the budget's deadline cuts the part short
        for B, H in cfg["configs"]:
            for mode in MODES:
                key = f"B={B},H={H},{mode}"
                if not ctx.cuda:
                    res["crossover"][key] = f"{NEEDS_CUDA} (against flash)"
                    continue
                ms = {i: {r["N"]: r.get("ms") for r in res["rows"] if (r["B"], r["H"], r["impl"], r["mode"]) == (B, H, i, mode)}
                      for i in ops}
                res["crossover"][key] = {"ours_torch_vs_sdpa": crossover(cfg["ns"], ms["ours_torch"], ms["sdpa"]),
                                         "ours_triton_vs_sdpa": crossover(cfg["ns"], ms["ours_triton"], ms["sdpa"]),
                                         "ours_triton_vs_fla_chunk": crossover(cfg["ns"], ms["ours_triton"],
                                                                               ms["fla_chunk"]),
                                         "fla_chunk_vs_sdpa": crossover(cfg["ns"], ms["fla_chunk"], ms["sdpa"])}


def _warm_fla(ctx: Ctx, cfg, ops, gen) -> dict:
    """fla autotunes each kernel on its first call (its autotune keys are head dims and chunk
    sizes, not N): call every fla op once, forward and backward, at the first shape, before the
    timed cells; {impl: seconds spent}. Each timed cell's own warmup call covers any shape
    that tunes again."""
    spent = {}
    for name in ("fla_chunk", "fla_fused_chunk"):
        fn = ops[name][0]
        if fn is None:
            continue
        t0 = time.perf_counter()
        try:
            (B, H), n = cfg["configs"][0], cfg["ns"][0]
            leaves = [torch.randn(B, n, H, D, device=ctx.device, dtype=torch.bfloat16,
                                  generator=gen).requires_grad_() for _ in range(3)]
            out = fn(*leaves)
            torch.autograd.grad(out, leaves, torch.ones_like(out))
            del leaves, out
            ctx.sync()
            spent[name] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - recorded; its cells say what fails
            spent[name] = f"error after {time.perf_counter() - t0:.1f} s: {one_line(e)}"
        ctx.save()
    return spent


def _cell(ctx: Ctx, cfg, res, last, key, n, fn, desc, q, k, v, peak) -> None:
    """Measure one (B, H, impl, mode) at N into a new row of ``res``, or say why not."""
    B, H, name, mode = key
    row = {"B": B, "H": H, "N": n, "impl": name, "path": PATHS[name], "mode": mode}
    res["rows"].append(row)
    if fn is None:
        row["status"] = desc
        return
    prev = last.get(key)
    if isinstance(prev, str):
        row["status"] = f"skipped: {prev} at a smaller N"
        return
    # forecast: warmup, the upstream-gradient call and at least one timed call, plus the timing cap
    est = 3 * (prev or 0.0) * GROWTH.get(name, 2.2) / 1e3 + (cfg["cell_max_s"] if prev else 0.0)
    if ctx.left() < max(est, 1.0):
        row.update(status="skipped: part budget spent", detail=f"{ctx.left():.0f} s left, forecast {est:.1f} s")
        return
    if name == "ours_triton" and not ctx.cuda and ((n, B, H) != (cfg["ns"][0], *cfg["configs"][0]) or mode != "fwd"):
        row["status"] = "skipped: interpreted on the CPU, one cell only (the first forward) shows the path runs"
        return
    why = _performer_too_big(ctx, B, H, n, mode) if name == "performer" else None
    if why:
        row["status"], last[key] = why, "too big"
        return
    try:
        r = _measure(ctx, name, fn, mode, q, k, v, cfg)
    except PartTimeout:
        row["status"] = "skipped: part budget spent during this call"
        raise
    except Exception as e:
        oom = is_oom(e)
        row["status"] = f"error: {'out of memory' if oom else one_line(e)}"
        last[key] = "out of memory" if oom else "an error"
        if ctx.cuda:
            torch.cuda.empty_cache()
        return
    tf = _flops(name, n, B * H, mode == "fwd+bwd") / (r["ms"] / 1e3) / 1e12
    row.update(status="ok", **r, tflops=tf, frac_bf16_peak=tf / peak if peak else None)
    last[key] = r["ms"]


def _measure(ctx: Ctx, name: str, fn, mode: str, q, k, v, cfg) -> dict:
    if name.startswith("fla"):  # fla's own layout, [B, N, H, K], prepared outside the timing
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    if mode == "fwd":
        def call():
            with torch.no_grad():
                fn(q, k, v)
        if name == "ours_triton" and not ctx.cuda:  # the interpreter: one untimed-warmup-free call
            return measure(ctx, call, reps=1, max_s=0.0, warmup=0)
        return measure(ctx, call, reps=cfg["reps"], max_s=cfg["cell_max_s"])
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.no_grad():
        up = torch.randn_like(fn(q, k, v))

    def call():
        torch.autograd.grad(fn(*leaves), leaves, up)
    return measure(ctx, call, reps=cfg["reps"], max_s=cfg["cell_max_s"])


def profile_ours(ctx: Ctx, fn, B: int, H: int, n: int, top: int = 12) -> dict:
    """One fwd+bwd of ours under torch.profiler: where the time goes, and (CUDA) how busy the
    GPU is: kernel time / wall time, and the number of kernels. A low busy fraction with many
    small kernels means the op is bound by launches (Python and the block loop), not by the GPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device=ctx.device).manual_seed(1)
    leaves = [torch.randn(B, H, n, D, device=ctx.device, dtype=torch.bfloat16, generator=g).requires_grad_()
              for _ in range(3)]
    up = torch.randn(B, H, n, D, device=ctx.device, dtype=torch.bfloat16, generator=g)

    def call():
        torch.autograd.grad(fn(*leaves), leaves, up)
    call()
    ctx.sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        call()
        ctx.sync()
    wall_ms = 1e3 * (time.perf_counter() - t0)
    attr = "self_device_time_total" if ctx.cuda else "self_cpu_time_total"
    ops = sorted((e for e in prof.key_averages() if e.device_type == DeviceType.CPU),
                 key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in ops) or 1.0
    out = {"B": B, "H": H, "N": n, "mode": "fwd+bwd", "wall_ms_profiled": wall_ms,
           "sorted_by": attr.replace("_total", "") + " (us)",
           "top": [{"op": e.key, "calls": e.count, "self_ms": getattr(e, attr) / 1e3,
                    "share": getattr(e, attr) / total} for e in ops[:top]]}
    if ctx.cuda:
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
        out.update(kernels=len(kernels), kernel_ms=busy, gpu_busy_fraction=busy / wall_ms)
    else:
        out.update(kernels=f"{NEEDS_CUDA} (kernel counts and GPU busy time)")
    return out
