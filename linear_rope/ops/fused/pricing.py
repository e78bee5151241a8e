"""The fused kernels' price, before they exist: formulas for ``benchmarks.gpu_predict``.

The design (fla's chunk form; docs/gpu.md, "The fused kernel: design and predicted step"): four
kernels a layer, the FAVOR+ features (q @ w, exp, RoPE) made on chip and never stored.

* ``fused_fwd_states`` (K1), grid (BH, mp/BM, cdiv(e,BE)), serial over the nc = N/C chunks: the
  key features of a [C, BM] tile, rotated; writes the state *before* every chunk, S [BH, nc, m, e]
  bf16 and z [BH, nc, m] fp32 (the final state only when asked: not in training).
* ``fused_fwd_output`` (K2), grid (nc, BH, cdiv(e,BE)): the query features in two passes over
  the feature blocks (pass 1: q @ w for the row max, recomputed in pass 2), the chunk's key
  features again; out = (rq S + tril(rq rk^T) v) / (fq z + rowsum(tril(fq fk^T))); writes out
  [BH, N, e] bf16, den and rowmax [BH, N] fp32.
* ``fused_bwd_dstates`` (B1), grid like K1, reverse serial: the query features again (stored
  rowmax, one pass); dS, dz of the state before every chunk [BH, nc, m, e] bf16, [BH, nc, m]
  fp32; delta = rowsum(dout * out) [BH, N] fp32 (written by the first feature block).
* ``fused_bwd_dqkv`` (B2), grid (nc, BH) (all e in one program: dq, dk sum over it): fq, fk,
  rq, rk again; every product of the backward; dq, dk through the projection; writes dq, dk,
  dv bf16.

FLOPs are counted *as executed* on the tensor cores: m padded to mp = cdiv(m, BM) * BM (266 ->
320 at BM = 64), full [C, C] tiles (no causal skipping inside a chunk), the projection GEMMs with
K doubled (w in bf16 hi + lo parts, for fp32-like features from bf16 operands), every
recomputation; every feature GEMM repeated per value block where BE < e. Elementwise work (exp,
the rotation, the masks) runs on the CUDA cores beside them and is not counted. Bytes: *unique*
(each tensor once from HBM; the roofline prices these) and *re-read* (the same bytes again, by
the other programs of the grid: from L2 when it holds them; shown, not priced). The states are
stored at m rows (masked stores), not mp. The key features' stabiliser is assumed a constant per
head known before K1 (not priced); the optimizer is not included, as in the rest of the step.

A kernel without an entry here is an error in the predictor, never 0.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["DESIGN", "KERNELS", "OWN_KERNEL_BYTES", "OWN_KERNEL_FLOPS", "OWN_KERNEL_GRID", "SMS", "Shape",
           "fill", "price", "reprice", "ALTERNATIVES"]

SMS = 132  # H100 SXM / H200: one program a SM at a time (the tiles fill its registers)
# The design priced (C: tokens a chunk; BM: features a block; BE: value columns a block): the one
# docs/gpu.md recommends after trying others (``alternatives``)
DESIGN = {"C": 64, "BM": 64, "BE": 64, "tables": "hbm", "query_max": "two_pass"}
KERNELS = ("fused_fwd_states", "fused_fwd_output", "fused_bwd_dstates", "fused_bwd_dqkv")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Shape:
    """A call's sizes: q, k [B, H, N, d], v [B, H, N, e], the projection [m, d]; the design's
    C, BM, BE; ``itemsize``: q, k, v, out and the stored states (bf16: 2); fp32 for z, den,
    rowmax, delta and the RoPE tables."""
    B: int
    H: int
    N: int
    d: int
    m: int
    e: int
    C: int = DESIGN["C"]
    BM: int = DESIGN["BM"]
    BE: int = DESIGN["BE"]
    itemsize: int = 2
    final_state: bool = False
    # RoPE's cos / sin: "hbm", read from [N, m] fp32 tables (re-read by every program); "chip",
    # made from the positions on chip (no table bytes; sin / cos beside the exp)
    tables: str = DESIGN["tables"]
    # the query features' row max: "two_pass" (pass 1 recomputes q @ w over every feature block),
    # "online" (one pass, the row's partial sums rescaled when its max grows, as flash attention does)
    query_max: str = DESIGN["query_max"]

    @property
    def BH(self) -> int:
        return self.B * self.H

    @property
    def nc(self) -> int:
        return _cdiv(self.N, self.C)

    @property
    def mp(self) -> int:  # the features as the tiles compute them
        return _cdiv(self.m, self.BM) * self.BM

    @property
    def nm(self) -> int:
        return _cdiv(self.m, self.BM)

    @property
    def ne(self) -> int:
        return _cdiv(self.e, self.BE)

    # bytes of one tensor each, once
    @property
    def qk(self) -> int:  # q or k
        return self.BH * self.N * self.d * self.itemsize

    @property
    def ve(self) -> int:  # v, out, dout, dv
        return self.BH * self.N * self.e * self.itemsize

    @property
    def row(self) -> int:  # den, rowmax or delta, fp32
        return self.BH * self.N * 4

    @property
    def w(self) -> int:  # the projection's hi and lo parts, bf16 (one a layer, shared by the heads)
        return 2 * self.m * self.d * 2

    @property
    def tab(self) -> int:  # RoPE's cos and sin [N, m] fp32 (shared by the heads), when read from HBM
        return 2 * self.N * self.m * 4 if self.tables == "hbm" else 0

    @property
    def passes(self) -> int:  # passes over the feature blocks for the query row max (K2)
        return 2 if self.query_max == "two_pass" else 1

    @property
    def states(self) -> int:  # S (or dS) before every chunk [BH, nc, m, e]
        return self.BH * self.nc * self.m * self.e * self.itemsize

    @property
    def zs(self) -> int:  # z (or dz) before every chunk [BH, nc, m] fp32
        return self.BH * self.nc * self.m * 4

    @property
    def feat(self) -> int:  # one [C, 2d] x [2d, mp] feature GEMM (hi/lo: K doubled), a chunk
        return 2 * self.C * (2 * self.d) * self.mp


def _k1_bytes(s: Shape):
    progs = s.BH * s.nm * s.ne
    final = s.BH * s.m * (s.e * 4 + 4) if s.final_state else 0
    unique = s.qk + s.ve + s.w + s.tab + s.states + s.zs + final
    reread = ((s.nm * s.ne - 1) * s.qk + (s.nm - 1) * s.ve  # k by every (m, e) block, v by every m block
              + (s.BH * s.ne - 1) * s.tab + (progs - 1) * s.w)  # tables, w: a slice a program
    return unique, reread


def _k1_flops(s: Shape) -> int:
    per_chunk = s.ne * s.feat + 2 * s.C * s.mp * s.e  # key features (per value block), rk^T v
    return s.BH * s.nc * per_chunk


def _k2_bytes(s: Shape):
    progs = s.nc * s.BH * s.ne
    unique = 2 * s.qk + 2 * s.ve + s.states + s.zs + s.w + s.tab + 2 * s.row  # q k v S z w tables | out den rowmax
    reread = ((s.ne - 1) * (2 * s.qk + s.zs) + (s.BH * s.ne - 1) * s.tab
              + (s.passes * progs - 1) * s.w)  # w once a pass over the feature blocks, a program
    return unique, reread


def _k2_flops(s: Shape) -> int:
    C, mp, e = s.C, s.mp, s.e
    feats = (s.passes + 1) * s.feat  # q (pass 1, for the row max), q again (pass 2), the chunk's keys
    per_chunk = (s.ne * feats + 2 * C * mp * e  # rq @ S
                 + s.ne * 2 * (2 * C * C * mp)  # rq @ rk^T and fq @ fk^T, full [C, C] tiles
                 + 2 * C * C * e + s.ne * 2 * C * mp)  # tril(A) @ v; fq @ z
    return s.BH * s.nc * per_chunk


def _b1_bytes(s: Shape):
    progs = s.BH * s.nm * s.ne
    unique = s.qk + 2 * s.ve + 3 * s.row + s.w + s.tab + s.states + s.zs  # q dout out den rowmax delta w tables | dS dz
    reread = ((s.nm * s.ne - 1) * (s.qk + 2 * s.row) + (s.nm * s.ne - 1) * 2 * s.ve
              + (s.BH * s.ne - 1) * s.tab + (progs - 1) * s.w)
    return unique, reread


def _b1_flops(s: Shape) -> int:
    per_chunk = s.ne * s.feat + 2 * s.C * s.mp * s.e + s.ne * 2 * s.C * s.mp  # q features; rq^T g; fq^T dden
    return s.BH * s.nc * per_chunk


def _b2_bytes(s: Shape):
    unique = (3 * s.qk + 2 * s.ve + 3 * s.row + 2 * s.states + 2 * s.zs + s.w + s.tab  # q k v dout den rowmax
              + 2 * s.qk + s.ve)  # delta S dS z dz w tables | dq dk dv
    reread = (s.BH - 1) * s.tab + (s.nc * s.BH - 1) * s.w
    return unique, reread


def _b2_flops(s: Shape) -> int:
    C, mp, e = s.C, s.mp, s.e
    cc_m, cc_e, cme = 2 * C * C * mp, 2 * C * C * e, 2 * C * mp * e
    per_chunk = (2 * s.feat  # fq, fk recomputed (rq, rk: the rotation, elementwise)
                 + cc_m + cc_e  # A = rq rk^T again, dA = g v^T
                 + cme + cc_m  # d rq = g S^T + tril(dA) rk
                 + cc_m + cme  # d rk = tril(dA)^T rq + v dS_after^T
                 + cc_e + cme  # dv = tril(A)^T g + rk dS_after
                 + 2 * cc_m  # d fq = tril(dden) fk, d fk = tril(dden)^T fq (the denominator's intra-chunk part)
                 + 2 * s.feat)  # dq, dk = d(qw) @ w, d(kw) @ w (hi/lo: K doubled)
    return s.BH * s.nc * per_chunk


# kernel name -> formula of a Shape: bytes (unique, re-read), FLOPs as executed, programs in its grid
OWN_KERNEL_BYTES = {"fused_fwd_states": _k1_bytes, "fused_fwd_output": _k2_bytes,
                    "fused_bwd_dstates": _b1_bytes, "fused_bwd_dqkv": _b2_bytes}
OWN_KERNEL_FLOPS = {"fused_fwd_states": _k1_flops, "fused_fwd_output": _k2_flops,
                    "fused_bwd_dstates": _b1_flops, "fused_bwd_dqkv": _b2_flops}
OWN_KERNEL_GRID = {"fused_fwd_states": lambda s: s.BH * s.nm * s.ne,
                   "fused_fwd_output": lambda s: s.nc * s.BH * s.ne,
                   "fused_bwd_dstates": lambda s: s.BH * s.nm * s.ne,
                   "fused_bwd_dqkv": lambda s: s.nc * s.BH}


def fill(programs: int, sms: int = SMS) -> tuple[int, float]:
    """(waves, fill): a grid of ``programs`` (one a SM at a time) runs in ceil(programs / sms)
    waves; fill = programs / (waves x sms), the share of the SMs' time it keeps busy: a kernel's
    roofline time is divided by it (60 programs on 132 SMs: 0.45; 264: 1.0; 133: 0.50)."""
    waves = _cdiv(programs, sms)
    return waves, programs / (waves * sms)


def price(name: str, s: Shape) -> dict:
    """One kernel's entry for the predictor: bytes (unique), reread_bytes, flops, programs,
    waves, fill. A name without an entry is a KeyError naming it."""
    missing = [t for t, table in (("bytes", OWN_KERNEL_BYTES), ("flops", OWN_KERNEL_FLOPS), ("grid", OWN_KERNEL_GRID))
               if name not in table]
    if missing:
        raise KeyError(f"own kernel {name!r} has no pricing entry ({', '.join(missing)}) in "
                       "linear_rope.ops.fused.pricing")
    unique, reread = OWN_KERNEL_BYTES[name](s)
    programs = OWN_KERNEL_GRID[name](s)
    waves, f = fill(programs)
    return {"bytes": int(unique), "reread_bytes": int(reread), "flops": int(OWN_KERNEL_FLOPS[name](s)),
            "programs": programs, "waves": waves, "fill": round(f, 4),
            "shape": [s.B, s.H, s.N, s.d, s.m, s.e],
            "design": {"C": s.C, "BM": s.BM, "BE": s.BE, "mp": s.mp, "tables": s.tables, "query_max": s.query_max}}


# the designs ``benchmarks.gpu_predict --backend fused`` also prices (Shape fields other than
# DESIGN's; {} is DESIGN itself): docs/gpu.md's table
ALTERNATIVES = ({}, {"C": 128}, {"C": 32}, {"BM": 32}, {"BM": 128}, {"C": 128, "BM": 32}, {"C": 128, "BM": 128},
                {"BE": 32}, {"BM": 16}, {"tables": "chip"}, {"query_max": "online"},
                {"tables": "chip", "query_max": "online"}, {"BM": 32, "tables": "chip", "query_max": "online"})


def reprice(name: str, shape, **design) -> dict:
    """``price`` of kernel ``name`` at ``shape`` ([B, H, N, d, m, e]) with another design
    (Shape's C, BM, BE, tables, query_max)."""
    return price(name, replace(Shape(*shape), **design))
