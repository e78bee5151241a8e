"""The fused kernels' price, as built: formulas for ``benchmarks.gpu_predict``, read from the
kernels' source (``forward.py``, ``backward.py``, ``launch.py``).

Five kernels, seven launches a layer: forward ``_states`` (grid (BH, Mb, nw), a serial walk over
the nc chunks) and ``_output`` (grid (nc, BH, ne)); backward ``_dden`` (grid (nc, BH)),
``_dstates`` (grid (BH, Mb, nw), a reverse walk) and ``_dqkv`` launched three times (grid (nc,
BH, nd); dv's (nc, BH, nu)) by its PART: ``_dqkv[dq]`` (0), ``_dqkv[dk]`` (1), ``_dqkv[dv]`` (2), each
recomputing the features (dv in every value block). Mb = cdiv(m, BM) feature blocks
of BM = 32, ne = cdiv(e, BE) value blocks of BE = min(64, p2(e)) (the walks' nw = cdiv(e, BW),
BW = min(BE, 32) where BD > 64, else BE; ``_dqkv``'s dq, dk loop over ne blocks, nd = cdiv(BD, 64)
column blocks, dv's nu = cdiv(e, BU), BU = BE, 32 at most in float32), BD = p2(d), C = 64 tokens
a chunk; p2(x) = the next power of two >= max(x, 16).

Bytes: what the kernels' ``tl.load`` / ``tl.store`` ask of global memory, lane by lane (the
active lanes of each masked access, times the element size), as Triton's interpreter counts them
(``tests/test_fused_bytes.py`` holds each formula to the count). Split into *unique* (each
tensor once: what the roofline prices) and *re-read* (the rest: the same bytes again, by other
programs or other feature blocks; meant to hit L2; shown, not priced). Inputs of ``itemsize``
(q, k, v, out, dout, dq, dk, dv); under ``lowp`` (bf16 arithmetic) the projection as two bf16
parts wa, wb (else one float32: 4 bytes a weight either way) and the per-chunk states Sb, dSa
bf16 (else float32); c, z, den, rmax, dden and the RoPE tables float32. The tables are strided
views (cos, sin of each pair: every other column of two [N, m] tables), shared by all B H:
ceil(m / 2) floats a token each. No mask, no initial state, no final state's gradient (the
training step's calls).

FLOPs: those executed on the tensor cores (``tl.dot``), tile by tile: every chunk of C tokens in
full (no causal skipping in the [C, C] tiles), m padded to Mb · BM (266 -> 288), d to BD, e to
BE, the projection GEMMs twice under lowp (wa and wb along K), every recomputation (``_output``
makes the query exponents twice: the row max's pass, then the features). The elementwise work
(exp, the rotation, the cumulative sums, ``_dden``'s row dot products) runs beside them on the
CUDA cores and is not counted.

A kernel without an entry here is an error in the predictor, never 0.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["DESIGN", "KERNELS", "OWN_KERNEL_BYTES", "OWN_KERNEL_FLOPS", "OWN_KERNEL_GRID", "SMS", "Shape",
           "count", "fill", "price", "reprice", "ALTERNATIVES", "kernel_name"]

SMS = 132  # H100 SXM / H200: one program a SM at a time (8 warps, the tiles fill its registers)
DESIGN = {"C": 64, "BM": 32}  # launch.C, launch.BM
# the launches of a layer's step, in order (the backward's _dqkv three times: dq, dk, dv)
KERNELS = ("_states", "_output", "_dden", "_dstates", "_dqkv[dq]", "_dqkv[dk]", "_dqkv[dv]")
DQKV_PART = {0: "_dqkv[dq]", 1: "_dqkv[dk]", 2: "_dqkv[dv]"}  # launch.DQKV_PARTS


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _p2(x: int) -> int:
    return max(16, 1 << (max(int(x), 1) - 1).bit_length())


def kernel_name(fn_name: str, constexprs: dict) -> str:
    """The launch's name in KERNELS: the kernel function's, ``_dqkv`` by its PART."""
    if fn_name == "_dqkv":
        part = constexprs.get("PART")
        return DQKV_PART.get(part, f"_dqkv[PART={part}]")  # (an unknown part: no entry, an error)
    return fn_name


@dataclass(frozen=True)
class Shape:
    """A call's sizes: q, k [B, H, N, d], v [B, H, N, e], the projection [m, d]; the kernels'
    C and BM; ``itemsize`` of the inputs; ``lowp``: bf16 arithmetic; ``rotary``: RoPE tables read."""
    B: int
    H: int
    N: int
    d: int
    m: int
    e: int
    C: int = DESIGN["C"]
    BM: int = DESIGN["BM"]
    itemsize: int = 2
    lowp: bool = True
    rotary: bool = True

    @property
    def BH(self) -> int:
        return self.B * self.H

    @property
    def nc(self) -> int:
        return _cdiv(self.N, self.C)

    @property
    def Mb(self) -> int:  # feature blocks
        return _cdiv(self.m, self.BM)

    @property
    def mp(self) -> int:  # the features as the tiles compute them
        return self.Mb * self.BM

    @property
    def BD(self) -> int:
        return _p2(self.d)

    @property
    def BE(self) -> int:  # _states, _output, _dstates
        return min(64, _p2(self.e))

    @property
    def ne(self) -> int:
        return _cdiv(self.e, self.BE)

    @property
    def BW(self) -> int:  # _states, _dstates (the walks): BE, 32 at most where BD > 64
        return min(self.BE, 32) if self.BD > 64 else self.BE

    @property
    def nw(self) -> int:
        return _cdiv(self.e, self.BW)

    @property
    def BU(self) -> int:  # _dqkv's dv: value blocks of BE, 32 at most in float32 (a grid dimension)
        return self.BE if self.lowp else min(self.BE, 32)

    @property
    def nu(self) -> int:
        return _cdiv(self.e, self.BU)

    @property
    def BEq(self) -> int:  # _dqkv dq, dk: all e, in value blocks of BE
        return _p2(self.e)

    @property
    def nd(self) -> int:  # _dqkv's dq, dk: column blocks of BO = min(64, BD), a grid dimension
        return _cdiv(self.BD, 64)

    @property
    def sS(self) -> int:  # an element of Sb, dSa
        return 2 if self.lowp else 4

    @property
    def L(self) -> int:  # GEMMs a projection product takes (wa, wb under lowp)
        return 2 if self.lowp else 1

    # per (batch, head): bytes over all N tokens
    @property
    def q(self) -> int:  # q or k rows
        return self.N * self.d * self.itemsize

    @property
    def v(self) -> int:  # v, out, dout rows
        return self.N * self.e * self.itemsize

    @property
    def tab(self) -> int:  # cos, sin of the pairs, float32, over all N tokens
        return 8 * self.N * _cdiv(self.m, 2) if self.rotary else 0

    @property
    def w(self) -> int:  # the projection's features, once: wa + wb (bf16) or w (float32), and c
        return 4 * self.m * self.d + 4 * self.m

    @property
    def states(self) -> int:  # Sb or dSa stored before / after every chunk, and zb or dza, per (b, h)
        return self.nc * self.m * (self.e * self.sS + 4)

    @property
    def final(self) -> int:  # S, z (or dS0, dz0) float32, per (b, h)
        return self.m * (self.e + 1) * 4


def _states(s: Shape):
    """(loads, stores, unique): every (feature, value) block program reads the chunk's k, its v
    slice, its rows of w and c, the tables; stores the state before every chunk, then the final."""
    loads = s.BH * (s.nw * s.Mb * s.q + s.Mb * s.v + s.nw * s.nc * s.w + s.nw * s.tab)
    stores = s.BH * (s.states + s.final)
    return loads, stores, s.BH * (s.q + s.v) + s.w + s.tab + stores


def _output(s: Shape):
    """A program per (chunk, bh, value block): q, k, its v slice once; w and c three times (the
    row max's pass, q's and k's features), the tables, Sb and zb once; stores out, den, rmax."""
    loads = s.BH * (s.ne * 2 * s.q + s.v + s.ne * s.nc * 3 * s.w + s.ne * s.tab
                    + s.nc * s.m * s.e * s.sS + s.ne * s.nc * 4 * s.m)
    stores = s.BH * (s.v + 8 * s.N)
    return loads, stores, s.BH * (2 * s.q + s.v + s.states) + s.w + s.tab + stores


def _dden(s: Shape):
    """dout, out, den in; dden out: each once."""
    loads = s.BH * (2 * s.v + 4 * s.N)
    stores = s.BH * 4 * s.N
    return loads, stores, loads + stores


def _dstates(s: Shape):
    """As ``_states``: every block program reads q, rmax, den, dden, its dout slice, its rows of w
    and c, the tables; stores the states' gradients after every chunk, then the initial one's."""
    loads = s.BH * (s.nw * s.Mb * (s.q + 12 * s.N) + s.Mb * s.v + s.nw * s.nc * s.w + s.nw * s.tab)
    stores = s.BH * (s.states + s.final)
    return loads, stores, s.BH * (s.q + s.v + 12 * s.N) + s.w + s.tab + stores


def _dqkv(s: Shape, part: int):
    """A program per (chunk, bh, column block), all e: q, k, dout, rmax, den once; w and c twice (q's and k's
    features). dq (0) and dk (1) also read v and dden once, wa once more (the exponents' gradient
    through it) and the states of their side: Sb and zb (dq) or dSa and dza (dk) (e over value
    blocks of BE where p2(e) > BE: dout, den or v again, below); dv (2), a
    program per (chunk, bh, value block), reads q, k, rmax, den, w, c and the tables in every value
    block, its slice of dout and dSa once. Stores dq, dk or dv."""
    wa = s.m * s.d * (2 if s.lowp else 4)
    S = s.m * s.e * s.sS  # Sb or dSa, a chunk
    if part == 2:
        loads = s.BH * (s.nu * (2 * s.q + 8 * s.N + s.nc * 2 * s.w + s.tab) + s.v + s.nc * S)
        stores = s.BH * s.v
        return loads, stores, s.BH * (2 * s.q + s.v + 8 * s.N + s.nc * S) + s.w + s.tab + stores
    loads = 2 * s.q + 2 * s.v + 12 * s.N + s.nc * (2 * s.w + S + 4 * s.m) + s.tab
    nv = _cdiv(s.BEq, s.BE)
    if nv > 1:  # e over nv value blocks of BE: den read per block for dA, then per feature block dout
        # and den again (dq: g Sb^T) or v again (dk: v dSa^T)
        loads += (nv - 1) * 4 * s.N + s.Mb * (s.v + (nv * 4 * s.N if part == 0 else 0))
    # nd programs of BO columns each read all of it again, but their columns of wa (and k for dk)
    loads = s.BH * (s.nd * loads + s.nc * wa + (s.q if part == 1 and s.nd > 1 else 0))
    stores = s.BH * s.q
    return loads, stores, s.BH * (2 * s.q + 2 * s.v + 12 * s.N + s.states) + s.w + s.tab + stores


_COUNTS = {"_states": _states, "_output": _output, "_dden": _dden, "_dstates": _dstates,
           **{name: (lambda s, p=p: _dqkv(s, p)) for p, name in DQKV_PART.items()}}


def count(name: str, s: Shape) -> tuple[int, int]:
    """(loads, stores) in bytes, as Triton's interpreter counts them for one launch."""
    loads, stores, _ = _COUNTS[name](s)
    return loads, stores


def _bytes(name: str):
    def f(s: Shape):
        loads, stores, unique = _COUNTS[name](s)
        return unique, loads + stores - unique
    return f


# FLOPs: per program and chunk (or per chunk for the (chunk, bh) grids), then times the grid
def _feat(s: Shape) -> int:  # the exponents of one feature block (two halves) of a chunk: [C, BD] @ [BD, BM]
    return 2 * s.C * s.BM * s.BD * s.L


def _states_flops(s: Shape) -> int:  # k's features; S += Rk^T v (two halves)
    return s.BH * s.nw * s.Mb * s.nc * (_feat(s) + 2 * s.C * s.BM * s.BW)


def _output_flops(s: Shape) -> int:
    C, BM, BE = s.C, s.BM, s.BE
    block = 3 * _feat(s) + 2 * C * BM * BE + 2 * C * C * BM  # q twice, k; num += Rq Sb; A += Rq Rk^T
    return s.BH * s.ne * s.nc * (s.Mb * block + s.L * 2 * C * C * BE)  # tril(A) v (two bf16 parts under lowp)


def _dstates_flops(s: Shape) -> int:  # q's features; dS += Rq^T dnum
    return s.BH * s.nw * s.Mb * s.nc * (_feat(s) + 2 * s.C * s.BM * s.BW)


def _dqkv_flops(s: Shape, part: int) -> int:
    C, BM, BE, BD = s.C, s.BM, s.BEq, s.BD
    block = 2 * _feat(s)  # q's and k's features, every block
    if part == 2:  # per value block of BU: A = Rq Rk^T, dv += Rk dSa; after the blocks dv += tril(A)^T g
        BE = s.BU
        return s.BH * s.nc * s.nu * (2 * C * C * BE + s.Mb * (block + 2 * C * C * BM + 2 * C * BM * BE))
    # dA = g v^T; d(Rq) = dA Rk + g Sb^T (dq) or d(Rk) = dA^T Rq + v dSa^T (dk); the gradient through wa
    block += 2 * C * C * BM + 2 * C * BE * BM  # in each of the nd column blocks; the gradient through wa once
    return s.BH * s.nc * (s.nd * (2 * C * C * BE + s.Mb * block) + s.Mb * 2 * C * BM * BD)


# kernel name -> formula of a Shape: bytes (unique, re-read), FLOPs as executed, programs in its grid
OWN_KERNEL_BYTES = {k: _bytes(k) for k in KERNELS}
OWN_KERNEL_FLOPS = {"_states": _states_flops, "_output": _output_flops, "_dden": lambda s: 0,
                    "_dstates": _dstates_flops,
                    **{name: (lambda s, p=p: _dqkv_flops(s, p)) for p, name in DQKV_PART.items()}}
OWN_KERNEL_GRID = {"_states": lambda s: s.BH * s.Mb * s.nw, "_output": lambda s: s.nc * s.BH * s.ne,
                   "_dden": lambda s: s.nc * s.BH, "_dstates": lambda s: s.BH * s.Mb * s.nw,
                   "_dqkv[dq]": lambda s: s.nc * s.BH * s.nd, "_dqkv[dk]": lambda s: s.nc * s.BH * s.nd,
                   "_dqkv[dv]": lambda s: s.nc * s.BH * s.nu}


def fill(programs: int, sms: int = SMS) -> tuple[int, float]:
    """(waves, fill): a grid of ``programs`` (one a SM at a time) runs in ceil(programs / sms)
    waves; fill = programs / (waves x sms), the share of the SMs' time it keeps busy: a kernel's
    roofline time is divided by it (60 programs on 132 SMs: 0.45; 264: 1.0; 133: 0.50)."""
    waves = _cdiv(programs, sms)
    return waves, programs / (waves * sms)


def price(name: str, s: Shape) -> dict:
    """One launch's entry for the predictor: bytes (unique), reread_bytes, flops, programs,
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
            "shape": [s.B, s.H, s.N, s.d, s.m, s.e], "itemsize": s.itemsize, "lowp": s.lowp, "rotary": s.rotary,
            "design": {"C": s.C, "BM": s.BM, "BE": s.BE, "mp": s.mp}}


# other block sizes ``benchmarks.gpu_predict --backend fused`` re-prices the same launches at
# ({} is the kernels as built): the formulas' answer, not a build (registers, spills unknown)
ALTERNATIVES = ({}, {"BM": 64}, {"BM": 16}, {"C": 128})


def reprice(name: str, shape, itemsize: int = 2, lowp: bool = True, rotary: bool = True, **design) -> dict:
    """``price`` of launch ``name`` at ``shape`` ([B, H, N, d, m, e]) with other C or BM."""
    return price(name, replace(Shape(*shape, itemsize=itemsize, lowp=lowp, rotary=rotary), **design))
