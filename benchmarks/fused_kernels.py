"""The fused kernels' sm_90 builds for ``benchmarks/fused_build.py``: every specialization the
launches of ``linear_rope/ops/fused/launch.py`` can make, from its own ``plan`` (block sizes,
warps, stages), ``FLAGS`` and ``DQKV_PARTS``, so that the builds and the launches cannot drift.

Per arithmetic (``DTYPES``: the inputs' dtype and whether the kernels multiply in bf16, LOWP),
d in {16, 32, 64, 128} (BD) and e in {16, 32, 64, 128} (one e per BE: e = BE), each kernel with
every combination of its flags (``full``, 2136 builds) or with all of them on (the default,
348: a representative subset; not always the worst: at d = e = 64 in bf16 ``_dqkv``'s dq part
spills 40-48 bytes without RoPE and none with it). Integer arguments are built divisible
by 16, as Triton specializes them at a launch with d and e multiples of 16 (the row strides are
d and e, the feature count m a multiple of 16); ``N`` and ``nc`` are never specialized.
"""
from __future__ import annotations

import itertools

# name: (the q, k, v, dout, dq, dk, dv dtype, LOWP)
DTYPES = {"bf16": ("bf16", True), "fp16": ("fp16", True), "fp16-fp32": ("fp16", False), "fp32": ("fp32", False)}
DIMS = (16, 32, 64, 128)
# the arithmetic tests/test_fused_build.py builds at d = e = 64 and holds to no spills (float32's
# tf32x3 products still spill: docs/gpu.md)
TESTED_DTYPES = ("bf16",)
OTHER_TRITON_SPILL = 128  # bytes a thread the test lets a Triton other than 3.6 spill (3.9: _dqkv 52 and 68)
# kernels launched with one program an SM, and why (the test holds the others to two)
ONE_PROGRAM = {
    "_output": "8 warps, 255 registers a thread: at 4 warps its accumulators num `[C, BE]` and A `[C, C]` "
               "float32 beside the q, k tiles spill 40-100 bytes a thread (any stages, or BE = 32)",
}
_F32 = {"c", "cos", "sin", "S0", "z0", "zb", "Sn", "zn", "den", "rmax", "dden", "dSn", "dzn", "dza", "dS0", "dz0"}
_NOT_SPECIALIZED = ("N", "nc")  # do_not_specialize


def signature(fn, constexprs: dict, dt: str, lowp: bool) -> dict:
    """Triton types of ``fn``'s runtime arguments as ``launch.py`` passes them."""
    sig = {}
    for n in fn.arg_names:
        if n in constexprs:
            continue
        if n in ("q", "k", "v", "do", "dq", "dk", "dv"):
            sig[n] = "*" + dt
        elif n == "out":  # out_dtype: float32 for float16 inputs (op.fused_causal)
            sig[n] = "*fp32" if dt == "fp16" else "*" + dt
        elif n in ("wa", "wb", "Sb", "dSa"):
            sig[n] = "*bf16" if lowp else "*fp32"
        elif n == "mask":
            sig[n] = "*i8"
        elif n in _F32:
            sig[n] = "*fp32"
        elif n == "ksc":
            sig[n] = "fp32"
        else:
            sig[n] = "i32" if n in _NOT_SPECIALIZED else "i32:16"
    return sig


def builds(full: bool = False, dtypes=None, dims=DIMS, pairs=None) -> list:
    """(name, jit fn, signature, constexprs, options, label) for every specialization (``full``)
    or the representative subset (every flag on); at every (d, e) of ``dims`` or those of ``pairs``."""
    from linear_rope.ops.fused import backward, forward, launch

    fns = {"_states": forward._states, "_output": forward._output, "_dden": backward._dden,
           "_dstates": backward._dstates, "_dqkv": backward._dqkv}
    out, seen = [], set()
    for dname in dtypes or DTYPES:
        dt, lowp = DTYPES[dname]
        for d, e in pairs or itertools.product(dims, dims):
            for name, (consts, options) in launch.plan(lowp, d, e).items():
                names = launch.FLAGS[name]
                combos = itertools.product((True, False), repeat=len(names)) if full else [(True,) * len(names)]
                parts = [{"PART": p} for p in launch.DQKV_PARTS] if name == "_dqkv" else [{}]
                for flags, part in itertools.product(list(combos), parts):
                    c = {**consts, **dict(zip(names, flags)), **part}
                    key = (name, dname, tuple(sorted(c.items())), tuple(sorted(options.items())))
                    if key in seen:  # e.g. _dden, which takes no d
                        continue
                    seen.add(key)
                    out.append((name, fns[name], signature(fns[name], c, dt, lowp), c, options, {"dtype": dname}))
    return out

