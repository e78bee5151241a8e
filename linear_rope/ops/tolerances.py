"""The accuracy contract of the fast paths, in one place: the CPU tests and the GPU checks
(``benchmarks.gpu``) apply these same tolerances, the same way.

A fast result passes against the float64 reference ``ref`` when every element obeys
``|fast - ref| <= atol * max|ref| + rtol * |ref| (+ tiny)`` (``atol`` -> ``grad_atol`` for
gradients): ``check``. Half-precision inputs are also held to the contract of the project:
within ``HALF_CONTRACT`` (2x) of what a float32 computation rounded to the input dtype
achieves (``rounded_error``), for outputs, final states and gradients.
"""
from __future__ import annotations

import torch

__all__ = ["HALF_CONTRACT", "PARALLEL_BF16_CONTRACT", "check", "relative_error", "rounded_error", "tolerance"]

HALF_CONTRACT = 2.0  # bf16 / fp16 inputs: error at most this times float32's, rounded to the input dtype


def tolerance(dtype: torch.dtype) -> dict:
    """rtol, atol (relative to max|ref|; ``grad_atol`` for the gradients) and why, for the torch
    path. It computes in float32 (float64 for float64 inputs) whatever the input dtype and
    rounds once, to the input dtype, at the end; so a half-precision result may be off by
    float32's error plus half an ulp (relative; absolute among subnormals)."""
    f32 = dict(rtol=1e-4, atol=1e-5, grad_atol=1e-4)
    f32_why = ("float32 sums over N tokens and m = 266 exp features: outputs and states measured to 6e-6 x max, "
               "the gradients of k and v to 4.5e-6 x max over 8 seeds (a naive float32 run: 4.3e-6; the suffix "
               "sums of the backward accumulate from the end, never as total - prefix); 10-20x headroom")
    if dtype == torch.float64:
        return dict(rtol=1e-9, atol=1e-10, grad_atol=1e-10,
                    why="float64 throughout: round-off of other summation orders only (measured about 1e-14 x max)")
    if dtype == torch.float32:
        return dict(**f32, why=f32_why)
    fi = torch.finfo(dtype)
    return dict(rtol=f32["rtol"] + fi.eps / 2, atol=f32["atol"], grad_atol=f32["grad_atol"],
                tiny=fi.smallest_normal * fi.eps / 2,
                why=f"computed in float32, rounded once to {str(dtype)[6:]}: float32's tolerances + half an ulp "
                    f"({fi.eps / 2:.2e} relative; {fi.smallest_normal * fi.eps / 2:.1e} absolute among subnormals)")


def check(fast: torch.Tensor, ref: torch.Tensor, tol: dict, grad: bool = False) -> dict:
    """Error of ``fast`` against the float64 reference ``ref`` under ``tol``: max_abs,
    max_rel_to_max (max error / max|ref|) and worst_over_tol (> 1: fails; inf if not finite)."""
    a, b = fast.detach().double(), ref.detach().double()
    scale = b.abs().max().clamp_min(1e-300) if b.numel() else torch.tensor(1.0, dtype=torch.float64)
    diff = (a - b).abs()
    if not diff.numel():
        return {"max_abs": 0.0, "max_rel_to_max": 0.0, "worst_over_tol": 0.0}
    allowed = tol["grad_atol" if grad else "atol"] * scale + tol["rtol"] * b.abs() + tol.get("tiny", 0.0)
    ratio = float((diff / allowed).max()) if torch.isfinite(a).all() else float("inf")
    return {"max_abs": float(diff.max()), "max_rel_to_max": float(diff.max() / scale), "worst_over_tol": ratio}


def rounded_error(fp32: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """max error / max|ref| of a float32 result rounded to ``dtype``'s precision, the baseline of
    the half-precision contract. Rounded at the tensor's own scale (a power of two), so that a
    tiny final state, far below fp16's normal range, gets fp16's relative precision and not
    its underflow."""
    a, b = fp32.detach().float(), ref.detach().double()
    if not b.numel():
        return 0.0
    top = float(a.abs().max())
    scale = 2.0 ** torch.tensor(top).clamp_min(1e-38).log2().floor().item() if top > 0 else 1.0
    rounded = (a / scale).to(dtype).double() * scale
    return float((rounded - b).abs().max() / b.abs().max().clamp_min(1e-300))


# The chunk-parallel path (``parallel.py``) with bf16 inputs or under a bf16 autocast: bf16 GEMM
# operands with float32 accumulation and results throughout (the FAVOR+ projection as two bf16
# parts of w along K, the [C, C] scores of ``A v`` as two bf16 parts along K; the features, the
# states before each chunk and the backward's gradients as single bf16 operands), sums over
# chunks, exponents and the division in float32. Contract, against bf16 SDPA (flash attention's
# precision): the relative error (``relative_error``: Frobenius norms) of the output and of the
# gradients of q, k and v against the float64 op on the same bf16 q, k, v is within this factor
# of bf16 SDPA's against float64 softmax attention on the same q, k, v and shapes; the final
# state's S and z within it of SDPA's output error (tests/test_parallel_bf16.py, a seeded fuzz of
# shapes on the CPU, where float32 products of bf16-rounded operands are what the tensor cores
# compute). Measured over 40 draws (worst): output 3.3x, dq 4.4x, dk 3.1x, dv 2.5x, S 1.35x, z
# 0.84x; the design before this one (float32 features, a float32 running denominator) on the
# same draws: 3.3x, 4.5x, 3.2x, 2.4x, 1.3x. Not 1x: SDPA's scores come exactly from its bf16
# inputs, where Eq. 19's GEMMs take the features, computed values rounded to bf16 (2^-9 each).
# Features given (no FAVOR+ inside): within 2x of the float64 op's error on the bf16-rounded
# features and values (tests/test_parallel.py).
PARALLEL_BF16_CONTRACT = 5.0


def relative_error(fast: torch.Tensor, ref: torch.Tensor) -> float:
    """|fast - ref| / |ref| over the whole tensor (Frobenius norms, in float64): the measure of
    ``PARALLEL_BF16_CONTRACT``."""
    a, b = fast.detach().double(), ref.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300)) if b.numel() else 0.0
