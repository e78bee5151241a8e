"""The GPU step predicted on a CPU: Inductor compiles the model for an H100, a roofline prices it.

    python -m benchmarks.gpu_predict                      # all variants and lengths, H100 and H200, decode
    python -m benchmarks.gpu_predict --n 1024 --variants rope,softmax --device h100 --no-decode
    python -m benchmarks.gpu_predict --quick --out /tmp/p.json   # the tiny model (the tests)
    python -m benchmarks.gpu_predict --backend fused --variants rope --n 1024,4096,16384
        # rope's attention core on the fused Triton kernels (linear_rope/ops/fused, the default on
        # CUDA), each launch priced by linear_rope/ops/fused/pricing.py; the JSON's other rows kept

How it measures: docs/performance.md, "Methods" (``benchmarks.gpu_predict``).

ESTIMATES: no GPU ran anything here. The paper preset (768 wide, 12 heads of 64, m = 266) under a
bf16 autocast, the chunk-parallel path forced (``--backend fused``: the rope rows' attention core on
the fused Triton kernels, ``benchmarks.gpu_fused``), B x N = 16 x 1024
tokens at every N, is compiled by Inductor *for the GPU* on the CPU (``gpu_fake_cuda``: fake CUDA
tensors, an sm_90 device with 132 SMs; the Triton kernels are generated and never built): the
training step's forward, loss (cross-entropy of the fp32 logits, which the trainer runs eagerly
outside the compiled model) and backward, one graph each as AOTAutograd partitions them; the
optimizer is not included. Each kernel Inductor schedules is listed with its bytes (Inductor's
``get_read_write_buffers_sizes``: the buffers a fused kernel reads and writes in HBM) and, for
the extern calls (cuBLAS GEMMs, ``bmm(out_dtype=float32)``, flash SDPA), the FLOPs of their
shapes. ``RULES`` prices each kernel; a step is the sum of its kernels (no overlap between them).
Depth 1 and 2 are compiled; per layer = depth 2 - depth 1; a step = (depth 1 - per layer) +
12 x per layer. MFU counts *model* FLOPs (``model_flops``), never what the kernels execute, so
recomputation cannot raise it. Memory: the tensors the forward saves for the backward (the
forward graph's outputs other than the loss) and a peak estimate = fp32 weights and gradients +
those (no optimizer state, no transient buffers). ``Decoder.step`` (batch 8, max_len 1024) is
compiled the same way (inference, the state updated in place) and priced per step: one token
for each of the 8 rows.

Numbers: benchmarks/results/gpu_predict.json, tabled in docs/gpu.md ("Predicted GPU step", and
"The fused kernels: as built, priced" for ``--backend fused``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.gpu_predict_io import BACKENDS, DEVICES, VARIANTS, _dumps, _git_commit, _ints, merge, table

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "gpu_predict.json"
LENGTHS = (1024, 4096, 8192, 16384)
TOKENS = 16 * 1024  # B x N at every length
DECODE_BATCH, DECODE_LEN = 8, 1024

# Every pricing rule and efficiency, in one place. A kernel takes max(bytes / HBM, FLOPs / rate)
# + LAUNCH_US; a step is the sum of its kernels.
RULES = {
    "hbm_efficiency": 0.85,  # of the datasheet HBM bandwidth, every kernel
    "launch_us": 2.0,  # per kernel launched (CUDA-graphed or compiled step: the gap between kernels)
    "bf16_dense_flops": 989e12,  # H100 / H200 SXM, dense bf16 tensor cores: also MFU's peak
    "gemm_efficiency": 0.70,  # cuBLAS bf16 GEMM with bf16 output, every dim >= 128 and a multiple of 8
    # bmm(out_dtype=float32) (bf16 operands, fp32 output), or a GEMM with a dim < 128 or not a
    # multiple of 8 (the 266 FAVOR+ features, the 64-token chunks), or a batch of small GEMMs
    "gemm_odd_efficiency": 0.45,
    "fp32_flops": 67e12,  # fp32 GEMMs (torch's default: no TF32) and fp64 ones, at gemm_efficiency
    "flash_fwd_flops": 250e12,  # flash SDPA forward, absolute rate (FLOPs 4 B H N S d, halved if causal)
    "flash_bwd_flops": 190e12,  # flash SDPA backward, absolute rate (2.5 x the forward's FLOPs)
    "triton_flops": "not counted: Inductor's fused Triton kernels are priced by their bytes",
    "other_extern": "priced by bytes (Inductor's), no FLOPs",
    # a Triton kernel of the package's own (torch.library.triton_op: Inductor calls it as a user
    # kernel): its bytes are Inductor's count of its arguments, its FLOPs OWN_KERNEL_FLOPS' formula
    # of its argument shapes, run on the tensor cores at gemm_odd_efficiency
    "own_kernel": "bytes: its arguments; FLOPs: OWN_KERNEL_FLOPS[name](shapes) at gemm_odd_efficiency",
    # --backend fused: the fused path's Triton kernels (linear_rope/ops/fused; benchmarks/gpu_fused.py),
    # priced by the formulas of linear_rope/ops/fused/pricing.py; derated by their grid's fill of the SMs
    "own_fused_kernel": "bytes: pricing.OWN_KERNEL_BYTES (unique; re-reads shown, not priced); FLOPs: "
                        "pricing.OWN_KERNEL_FLOPS (as executed) at gemm_odd_efficiency; max(bytes, FLOPs) time "
                        "/ fill, fill = programs / (waves x 132 SMs), one program a SM",
    # shown beside each fused kernel, never priced: its re-read bytes at an assumed L2 bandwidth
    # (about 2x HBM); a kernel whose re-reads take longer than its priced time is L2-bound
    "l2_check_bytes_s": 5.5e12,
}
# kernel function name -> FLOPs from its tensor arguments' shapes (a list of lists), for
# RULES["own_kernel"]; a user kernel without an entry is an error (never 0 FLOPs). The fused
# kernels (FUSED_KERNELS) are priced by pricing.OWN_KERNEL_BYTES / OWN_KERNEL_FLOPS / OWN_KERNEL_GRID.
OWN_KERNEL_FLOPS: dict = {}
FUSED_KERNELS = ("_states", "_output", "_dden", "_dstates", "_dqkv")  # linear_rope/ops/fused


# -- what Inductor generated, kernel by kernel -------------------------------------------------

def _shape(x):
    return [int(s) for s in x.get_size()]


def _kernel(node) -> dict | None:
    """One scheduled kernel: name, kind (triton / gemm / flash_fwd / flash_bwd / extern), bytes,
    FLOPs, and for GEMMs whether the odd rule prices it."""
    from torch._inductor import scheduler as sch
    from torch._inductor.utils import get_fused_kernel_name

    from torch._inductor import ir as inductor_ir

    if isinstance(node, sch.NopKernelSchedulerNode) or isinstance(getattr(node, "node", None), inductor_ir.MultiOutput):
        return None  # no kernel: a view, or the tuple indexing of a multi-output call
    nbytes = int(node.get_read_write_buffers_sizes())
    if not isinstance(node, sch.ExternKernelSchedulerNode):
        name = "triton_" + get_fused_kernel_name(node.get_nodes(), "original_aten")
        return {"name": name[:120], "kind": "triton", "bytes": nbytes, "flops": 0}
    ir = node.node
    name = str(getattr(ir, "python_kernel_name", None) or type(ir).__name__)
    ins = [x for x in getattr(ir, "inputs", []) if hasattr(x, "get_size")]
    k = {"name": name, "kind": "extern", "bytes": nbytes, "flops": 0}
    if hasattr(ir, "get_kernel_and_metadata"):  # a user Triton kernel (the package's own)
        fn = ir.get_kernel_and_metadata()[0]
        fname = getattr(getattr(fn, "fn", fn), "__name__", name)
        shapes = [_shape(x) for x in ins]
        if fname in FUSED_KERNELS:  # the fused path's: priced by pricing.py's formulas
            from benchmarks.gpu_fused import fused_kernel
            return fused_kernel(fname, ir, k, RULES["l2_check_bytes_s"])
        if fname not in OWN_KERNEL_FLOPS:
            raise RuntimeError(f"own kernel {fname!r} has no entry in gpu_predict.OWN_KERNEL_FLOPS (never priced as 0)")
        return dict(k, name=fname, kind="own", flops=int(OWN_KERNEL_FLOPS[fname](shapes)))
    short = name.rsplit(".", 1)[-1] if not name.endswith(".default") else name.split(".")[-2]
    if short in ("mm", "bmm", "addmm", "baddbmm", "bmm_dtype", "mm_dtype", "addmm_dtype") and len(ins) >= 2:
        a, out = ins[-2], _shape(ir)
        K = _shape(a)[-1]
        M, N = out[-2], out[-1]
        batch = 1
        for s in out[:-2]:
            batch *= s
        in_dtypes = {str(x.get_dtype()) for x in ins[-2:]}
        k.update(kind="gemm", flops=2 * batch * M * N * K, shape=[batch, M, N, K], dtype=sorted(in_dtypes),
                 out_dtype=str(ir.get_dtype()))
        k["fp32"] = in_dtypes <= {"torch.float32", "torch.float64"}
        k["odd"] = (short.endswith("_dtype") or str(ir.get_dtype()) != min(in_dtypes) or min(M, N, K) < 128
                    or N % 8 or K % 8)
    elif "attention" in short:
        four = [_shape(x) for x in ins if len(x.get_size()) == 4]
        bwd = "backward" in short
        if len(four) >= (3 if bwd else 2):
            q, kk = four[0], four[2 if bwd else 1]
            consts = list(getattr(ir, "constant_args", ())) + list((getattr(ir, "kwargs", None) or {}).values())
            causal = any(c is True for c in consts)
            f = 4 * q[0] * q[1] * q[2] * kk[2] * q[3] * (0.5 if causal else 1.0)
            k.update(kind="flash_bwd" if bwd else "flash_fwd", flops=int(f * (2.5 if bwd else 1.0)), causal=causal)
    return k


def price_us(k: dict, device: str) -> float:
    """A kernel's predicted microseconds on ``device`` by ``RULES``."""
    r = RULES
    t = k["bytes"] / (DEVICES[device]["hbm_bytes_s"] * r["hbm_efficiency"])
    rate = None
    if k["kind"] == "gemm":
        rate = r["fp32_flops"] * r["gemm_efficiency"] if k["fp32"] else \
            r["bf16_dense_flops"] * (r["gemm_odd_efficiency"] if k["odd"] else r["gemm_efficiency"])
    elif k["kind"] == "own":
        rate = r["bf16_dense_flops"] * r["gemm_odd_efficiency"]
    elif k["kind"] == "flash_fwd":
        rate = r["flash_fwd_flops"]
    elif k["kind"] == "flash_bwd":
        rate = r["flash_bwd_flops"]
    if rate:
        t = max(t, k["flops"] / rate)
    return 1e6 * t / k.get("fill", 1.0) + r["launch_us"]


# -- the model, compiled ---------------------------------------------------------------------

def _model(variant: str, depth: int, quick: bool):
    import torch

    from linear_rope.model import PerformerLM
    torch.manual_seed(0)
    return PerformerLM.from_preset("tiny" if quick else "paper", position=variant, depth=depth)


def compile_train(variant: str, N: int, B: int, depth: int, quick: bool = False) -> list[dict]:
    """The training step's graphs (forward with the loss, backward) of ``variant`` at B x N."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from benchmarks.gpu_fake_cuda import compile_for_gpu, fake_cuda
    model = _model(variant, depth, quick)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    fm = FakeTensorMode()
    state = [fake_cuda(fm, p, True) for p in model.parameters()] + [fake_cuda(fm, b) for b in model.buffers()]
    ids = fake_cuda(fm, torch.zeros(B, N, dtype=torch.long))

    def step(*flat):
        params, (x, y) = dict(zip(names, flat[:-2])), flat[-2:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = torch.func.functional_call(model, params, (x,))
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    return compile_for_gpu(step, state + [ids, ids], fm, _kernel)


def compile_decode(quick: bool = False) -> list[dict]:
    """``Decoder.step`` of the rope variant at batch ``DECODE_BATCH`` (inference, in place)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from benchmarks.gpu_fake_cuda import compile_for_gpu, fake_cuda
    from linear_rope.decode import Decoder
    model = _model("rope", 2 if quick else 12, quick).eval()
    dec = Decoder(model, DECODE_BATCH, 64 if quick else DECODE_LEN, compile=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        held = dec._sync_weights()  # as a step under bf16 autocast: the weights held in bf16, autocast off
    attrs = [a for a in ("Sz", "vz", "_w", "positions", "first", "rope", "rope_pre", "favor", "k", "v", "key_mask",
                         "slot") if getattr(dec, a, None) is not None]
    flat, spec = tree_flatten({a: getattr(dec, a) for a in attrs})
    named = dict(model.named_parameters(), **dict(model.named_buffers()))
    fm = FakeTensorMode()
    inputs = [fake_cuda(fm, t) for t in named.values()] + [None if t is None else fake_cuda(fm, t) for t in flat]
    inputs.append(fake_cuda(fm, torch.zeros(DECODE_BATCH, dtype=torch.long)))
    P, S = len(named), len(flat)

    def step(*args):
        for a, v in tree_unflatten(list(args[P:P + S]), spec).items():
            setattr(dec, a, v)
        with torch.no_grad(), _reparametrize_module(model, dict(zip(named, args[:P]))), \
                torch.autocast("cuda", dtype=torch.bfloat16, enabled=not held):
            return dec._forward_step(args[-1])
    return compile_for_gpu(step, inputs, fm, _kernel)


def summarise(graphs: list[dict]) -> dict:
    """Kernels, bytes, FLOPs and predicted time per device of one compilation."""
    out = {"graphs": []}
    for g in graphs:
        ks = [k for k in g["nodes"] if k is not None]
        for k in ks:
            k["us"] = {d: round(price_us(k, d), 3) for d in DEVICES}
        out["graphs"].append({"part": "inference" if g["inference"] else ("backward" if g["backward"] else "forward"),
                              "kernels": ks, "triton_launches_in_wrapper": g["code"].count(".run("),
                              "saved_bytes": sum(g["outputs"][1:]) if not (g["backward"] or g["inference"]) else 0})
    every = [k for g in out["graphs"] for k in g["kernels"]]
    out["kernels"] = len(every)
    out["bytes"] = sum(k["bytes"] for k in every)
    out["flops"] = sum(k["flops"] for k in every)
    out["us"] = {d: sum(k["us"][d] for k in every) for d in DEVICES}
    out["saved_bytes"] = sum(g["saved_bytes"] for g in out["graphs"])
    return out


def model_flops(cfg, N: int) -> float:
    """Model FLOPs per token of a training step (forward + backward = 3 x forward):
    6 x (weights in GEMMs: L (4 D^2 + 2 ff D^2) + D V) + 3 L H a, with per head and token a =
    4 d m + 2 C (m + e) + 4 m e + 4 m for Eq. 19 (rope, none: FAVOR+ projections of q and k,
    chunked attention C = 64: scores and their product with v, states in and out, the
    denominator), a = 2 N d for causal softmax (scores and their product with v, half of N^2)."""
    L, D, H, d, V = cfg.depth, cfg.dim, cfg.heads, cfg.dim_head, cfg.vocab_size
    m, e, C = cfg.nb_features or d, d, 64
    dense = L * (4 * D * D + 2 * cfg.ff_mult * D * D) + D * V
    a = 2 * N * d if cfg.position == "softmax" else 4 * d * m + 2 * C * (m + e) + 4 * m * e + 4 * m
    return 6 * dense + 3 * L * H * a


def make_row(variant: str, N: int, B: int, s1: dict, s2: dict, cfg, devices, n_params: int) -> dict:
    """The step of ``cfg.depth`` layers from the depth-1 and depth-2 summaries: per layer = depth 2
    - depth 1, a step = (depth 1 - per layer) + layers x per layer; tokens/s = B N / step; MFU =
    model FLOPs per token (``model_flops``) x tokens/s / the bf16 dense peak."""
    L = cfg.depth
    row = {"variant": variant, "N": N, "B": B, "layers": L, "model_flops_per_token": model_flops(cfg, N)}
    for key in ("bytes", "kernels", "saved_bytes"):
        per = s2[key] - s1[key]
        row[f"layer_{key}"], row[f"step_{key}"] = per, s1[key] - per + L * per
    row["params"] = n_params
    row["peak_bytes_est"] = 8 * n_params + row["step_saved_bytes"]  # fp32 weights + grads + saved
    for d in devices:
        per = s2["us"][d] - s1["us"][d]
        ms = (s1["us"][d] - per + L * per) / 1e3
        tps = B * N / (ms / 1e3)
        row[d] = {"layer_ms": per / 1e3, "step_ms": ms, "tokens_s": tps,
                  "mfu": row["model_flops_per_token"] * tps / RULES["bf16_dense_flops"]}
    return row


def _compile_train_as(backend: str, variant: str, N: int, B: int, depth: int, quick: bool) -> list[dict]:
    """``compile_train`` with the attention core on ``backend``: ``parallel`` (forced: the
    chunk-parallel path), ``fused`` (rope only: the package's default on CUDA, ``auto``, which
    takes the fused Triton kernels for bf16 calls; ``benchmarks.gpu_fused``); a fused compilation
    without every fused launch is an error."""
    from linear_rope.ops.backend import use_backend
    if backend == "parallel":
        with use_backend("parallel"):
            return compile_train(variant, N, B, depth, quick)
    from benchmarks.gpu_fused import check_fused, fused_core
    with fused_core():
        graphs = compile_train(variant, N, B, depth, quick)
    check_fused(graphs, variant, N)
    return graphs


def predict(variants, lengths, devices, decode: bool, quick: bool = False, log=print,
            backend: str = "parallel") -> dict:
    """Compile and price every (variant, N) at depth 1 and 2, and the decoder's step. With
    ``backend="fused"`` the rope variant's attention core is the fused kernels' (priced by their
    formulas); the variants without it (none, softmax) are compiled as on ``parallel``."""
    os.environ["LINEAR_ROPE_BACKEND"] = "parallel"
    from linear_rope.model import MODEL_PRESETS, ModelConfig
    preset = MODEL_PRESETS["tiny" if quick else "paper"]
    tokens = 4 * 64 if quick else TOKENS
    rows, runs = [], []
    for N in lengths:
        B = max(1, tokens // N)
        for v in variants:
            be = backend if v == "rope" else "parallel"
            t0 = time.time()
            s1, s2 = (summarise(_compile_train_as(be, v, N, B, depth, quick)) for depth in (1, 2))
            runs += [dict(variant=v, backend=be, N=N, B=B, depth=dp, **s) for dp, s in ((1, s1), (2, s2))]
            n_params = sum(p.numel() for p in _model(v, 12, quick).parameters())
            row = make_row(v, N, B, s1, s2, ModelConfig(**{**preset, "position": v, "depth": 12}), devices, n_params)
            row = {"variant": v, "backend": be, **row}
            row["compile_s"] = round(time.time() - t0, 1)
            log(f"  {v:<8} {be:<8} N={N:<6} B={B:<3} {row['step_bytes'] / 1e9:7.1f} GB/step "
                f"({row['layer_bytes'] / 1e9:.2f}/layer), {row['layer_kernels']} kernels/layer, "
                f"compiled in {row['compile_s']} s", file=sys.stderr)
            rows.append(row)
    out = {"rows": rows, "runs": runs}
    if decode:
        t0 = time.time()
        s = summarise(compile_decode(quick))
        out["decode"] = {"batch": DECODE_BATCH, "max_len": 64 if quick else DECODE_LEN, "variant": "rope",
                         "layers": 2 if quick else 12, "bytes_per_step": s["bytes"], "kernels": s["kernels"],
                         "ms_per_step": {d: s["us"][d] / 1e3 for d in devices}, "compile_s": round(time.time() - t0, 1),
                         "graphs": s["graphs"]}
    return out



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_predict", allow_abbrev=False,
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--n", default=",".join(map(str, LENGTHS)), help="lengths N (B = 16384 / N)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="model positions: rope, none, softmax")
    ap.add_argument("--device", default="both", choices=("h100", "h200", "both"))
    ap.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True, help="price Decoder.step")
    ap.add_argument("--out", default=None, help=f"the JSON (default {OUT.relative_to(ROOT)})")
    ap.add_argument("--quick", action="store_true", help="the tiny model at N = 64, 128 (tests)")
    ap.add_argument("--backend", default="parallel", choices=BACKENDS,
                    help="the rope variant's attention core: the chunk-parallel path (forced), or the fused "
                         "Triton kernels (auto), priced by linear_rope/ops/fused/pricing.py (the JSON keeps the "
                         "other backend's rows)")
    a = ap.parse_args(argv)
    variants = tuple(v.strip() for v in a.variants.split(",") if v.strip())
    if not variants or any(v not in VARIANTS for v in variants):
        ap.exit(2, f"gpu_predict: error: --variants must be from {', '.join(VARIANTS)}, got {a.variants!r}\n")
    lengths = _ints(a.n) if not (a.quick and a.n == ",".join(map(str, LENGTHS))) else (64, 128)
    if lengths is None:
        ap.exit(2, f"gpu_predict: error: --n must be a comma list of lengths, multiples of 64, got {a.n!r}\n")
    devices = tuple(DEVICES) if a.device == "both" else (a.device,)
    out = Path(a.out) if a.out else (OUT if not a.quick else None)
    if out is None:
        ap.exit(2, "gpu_predict: error: --quick needs --out (the committed JSON is the paper preset's)\n")
    try:
        import triton  # noqa: F401
    except ImportError:
        ap.exit(2, "gpu_predict: error: Inductor's GPU code generation needs triton (pip install \"linear_rope[predict]\")\n")
    import torch
    try:
        res = predict(variants, lengths, devices, a.decode, a.quick, log=print, backend=a.backend)
    except RuntimeError as e:
        ap.exit(2, f"gpu_predict: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}\n")
    import triton
    command = " ".join(["python -m benchmarks.gpu_predict", *(argv if argv is not None else sys.argv[1:])])
    for r in res["rows"]:
        r.update(command=command, git_commit=_git_commit())
    try:
        old = json.loads(out.read_text()) if out.exists() else None
    except (OSError, ValueError):
        old = None
    if old is not None and old.get("preset") != ("tiny" if a.quick else "paper"):
        old = None  # another preset's rows are not kept
    res = merge(old, res)
    if any(r.get("backend") == "fused" for r in res["rows"]) and not a.quick:
        from benchmarks.gpu_fused import design_sweep
        res["fused_designs"] = design_sweep(res, devices, make_row, price_us, RULES["l2_check_bytes_s"])
    doc = {"note": "ESTIMATES: Inductor's GPU kernels generated on a CPU and priced on a roofline; no GPU ran them",
           "command": command, "torch": torch.__version__, "triton": triton.__version__, "git_commit": _git_commit(),
           "preset": "tiny" if a.quick else "paper", "autocast": "bf16",
           "backend": "per row: parallel (the chunk-parallel path) or fused (the fused Triton kernels, each launch "
                      "priced by linear_rope/ops/fused/pricing.py); each row names its command and commit",
           "optimizer": "not included", "rules": RULES, "devices": {d: DEVICES[d] for d in devices}, **res}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(_dumps(doc))
    os.replace(tmp, out)
    print(table(res, devices))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
