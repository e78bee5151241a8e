"""The fused kernels run in Triton's interpreter (bf16 as the GPU computes it: ``fused_interp``)
against the float64 reference, case by case; prints one JSON object: per case, per tensor (out,
S, z, dq, dk, dv, dS0, dz0) the max error / max|ref| (``rel``), Frobenius relative error
(``fro``) and, for bf16, the chunk-parallel path's on the same inputs (``par_fro``, ``par_rel``).

Run by ``tests/test_fused_kernel.py`` in a process of its own (the interpreter is switched on at
import): ``python tests/fused_check.py [case ...]``.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import fused_interp  # noqa: E402,F401  (first: the interpreter, bf16 as on the GPU)
import torch  # noqa: E402

from linear_rope.ops import rotary_linear_attention  # noqa: E402
from linear_rope.ops.backend import use_backend  # noqa: E402
from linear_rope.ops.fused import supports_fused  # noqa: E402
from linear_rope.ops.fused.op import fused_causal  # noqa: E402
from linear_rope.ops.naive import naive_rotary_linear_attention  # noqa: E402
from linear_rope.ops.parallel import compute_dtypes  # noqa: E402
from linear_rope.ops.utils import LinearAttentionState, Options, check_args  # noqa: E402

CASES = {
    # name: (dtype, B, H, N, d, m, e, options)
    "fp32": (torch.float32, 2, 2, 130, 16, 40, 24, dict(offset=3, state=True)),
    "fp32_rows_mask": (torch.float32, 2, 1, 70, 16, 34, 16, dict(offset=[5, 2 ** 40 + 3], mask=True, state=True)),
    "fp32_n1": (torch.float32, 1, 2, 1, 8, 10, 8, dict(state=True)),
    "fp32_norot_odd_m_e65": (torch.float32, 1, 2, 67, 16, 13, 65, dict(rotary=False)),
    "fp32_large_qk": (torch.float32, 1, 2, 100, 16, 32, 16, dict(scale=4.0, offset=11, vs_parallel=True)),
    "fp32_m266": (torch.float32, 1, 1, 80, 64, 266, 64, dict(offset=2)),
    "fp32_strided_state_only": (torch.float32, 2, 2, 70, 16, 20, 16, dict(strided=True, state=True, state_only=True)),
    "fp16": (torch.float16, 2, 1, 100, 16, 40, 24, dict(offset=7, state=True)),
    "fp16_mask": (torch.float16, 2, 1, 70, 16, 34, 16, dict(offset=[1, 40], mask=True)),
    "bf16": (torch.bfloat16, 2, 2, 130, 16, 40, 24, dict(offset=3, state=True)),
    "bf16_rows_mask": (torch.bfloat16, 2, 1, 70, 16, 34, 16, dict(offset=[5, 900], mask=True, state=True)),
    "bf16_m266": (torch.bfloat16, 1, 1, 80, 64, 266, 64, dict(offset=2)),
    "bf16_d128_e65": (torch.bfloat16, 1, 2, 70, 128, 34, 65, dict(offset=9)),
}
NAMES = ("out", "S", "z", "dq", "dk", "dv", "dS0", "dz0")


def _inputs(dtype, B, H, N, d, m, e, o, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = o.get("scale", 1.0)
    q, k = (torch.randn(B, H, N, d, generator=g) * s).to(dtype), (torch.randn(B, H, N, d, generator=g) * s).to(dtype)
    v = torch.randn(B, H, N, e, generator=g).to(dtype)
    w = torch.randn(m, d, generator=g)
    if o.get("strided"):  # [B, N, H, x] in memory, as a layer's projection gives them
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    mask = None
    if o.get("mask"):
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[0, :9] = False  # left padding
        mask[-1, N - 5:] = False  # right padding
        q[0, :, :3] = float("nan")  # whatever padding holds
    state = None
    if o.get("state"):
        state = LinearAttentionState(torch.rand(B, H, m, e, generator=g), torch.rand(B, H, m, generator=g) + 0.5)
    offset = o.get("offset", 0)
    if isinstance(offset, list):
        offset = torch.tensor(offset)
    kw = dict(rotary=o.get("rotary", True), projection=w, mask=mask, initial_state=state, output_final_state=True)
    if kw["rotary"]:
        kw["offset"] = offset
    grads = (torch.randn(B, H, N, e, generator=g).to(dtype).float(), torch.randn(B, H, m, e, generator=g),
             torch.randn(B, H, m, generator=g))
    if o.get("state_only"):  # the output unused: only the final state's gradient comes back
        grads = (None,) + grads[1:]
    return q, k, v, kw, grads


def _run(fn, q, k, v, kw, grads, cast):
    q, k, v = (t.detach().to(cast(t[:0]).dtype).requires_grad_() for t in (q, k, v))
    st = kw["initial_state"]
    if st is not None:
        st = LinearAttentionState(*(cast(t).detach().requires_grad_() for t in st))
    out, (S, z) = fn(q, k, v, **{**kw, "initial_state": st})
    go, gS, gz = (None if t is None else cast(t) for t in grads)
    loss = (S.to(gS.dtype) * gS).sum() + (z.to(gz.dtype) * gz).sum()
    if go is not None:
        loss = loss + (out.to(go.dtype) * go).nansum()
    loss.backward()
    dS0, dz0 = (None, None) if st is None else (st.S.grad, st.z.grad)
    return dict(zip(NAMES, (out, S, z, q.grad, k.grad, v.grad, dS0, dz0)))


def _fused(q, k, v, **kw):
    opts = Options(causal=True, rotary=kw["rotary"], offset=kw.get("offset", 0), base=10000.0,
                   projection=kw["projection"], mask=kw["mask"], key_mask=None, cu_seqlens=None,
                   initial_state=kw["initial_state"], allow_negative=False, output_final_state=True)
    a = check_args(q, k, v, opts)
    why = supports_fused(q, k, v, kw["projection"], a, True)
    assert why is None, why
    lowp = compute_dtypes(q.dtype, q.device.type)[1] is not None
    out, S, z = fused_causal(q, k, v, kw["projection"], a, kw["rotary"], a.offset if isinstance(a.offset, int) else 0,
                             10000.0, lowp)
    return out, (S, z)


def _parallel(q, k, v, **kw):
    with use_backend("parallel"):
        return rotary_linear_attention(q, k, v, **kw)


def _errors(got: dict, ref: dict) -> dict:
    res = {}
    for n in NAMES:
        a, b = got[n], ref[n]
        if b is None:
            continue
        a, b = a.detach().double(), b.detach().double()
        if not torch.isfinite(a).all():
            res[n] = dict(rel=float("inf"), fro=float("inf"))
            continue
        scale = b.abs().max().clamp_min(1e-300)
        res[n] = dict(rel=float((a - b).abs().max() / scale), fro=float((a - b).norm() / b.norm().clamp_min(1e-300)))
    return res


def run_case(name: str) -> dict:
    dtype, B, H, N, d, m, e, o = CASES[name]
    q, k, v, kw, grads = _inputs(dtype, B, H, N, d, m, e, o)
    t0 = time.time()
    got = _run(_fused, q, k, v, kw, grads, lambda t: t)
    secs = time.time() - t0
    kw64 = {**kw, "projection": kw["projection"].double()}
    ref = _run(naive_rotary_linear_attention, q, k, v, kw64, grads, lambda t: t.double())
    res = _errors(got, ref)
    if dtype == torch.bfloat16 or o.get("vs_parallel"):
        par = _errors(_run(_parallel, q, k, v, kw, grads, lambda t: t), ref)
        for n in res:
            res[n]["par_rel"], res[n]["par_fro"] = par[n]["rel"], par[n]["fro"]
    if dtype == torch.float16:  # the baseline of the half contract: the float64 result rounded to float16
        for n in res:
            r = ref[n].detach()
            res[n]["rounded"] = float((r.to(dtype).double() - r).abs().max() / r.abs().max().clamp_min(1e-300))
    return dict(tensors=res, seconds=secs)


def dispatch_checks() -> dict:
    """The public op with ``LINEAR_ROPE_BACKEND=fused`` on CPU tensors (the interpreter lets them
    through): the path recorded, out and the final state as the direct call's, in bf16 and under
    a bf16 autocast of float32 inputs; a call it does not take (features given) refused."""
    from linear_rope.ops.backend import record_paths

    res = {}
    q, k, v, kw, grads = _inputs(torch.bfloat16, 1, 2, 70, 16, 20, 16, dict(offset=4, state=True))
    with use_backend("fused"), record_paths() as paths:
        out, st = rotary_linear_attention(q, k, v, **kw)
    direct, (S, z) = _fused(q, k, v, **kw)
    res["paths"] = paths
    res["same"] = bool(torch.equal(out, direct) and torch.equal(st.S, S) and torch.equal(st.z, z))
    res["dtypes"] = [str(out.dtype), str(st.S.dtype), str(st.z.dtype)]
    qf, kf, vf = q.float(), k.float(), v.float()
    with use_backend("fused"), torch.autocast("cpu", dtype=torch.bfloat16):
        out_ac = rotary_linear_attention(qf, kf, vf, **{**kw, "output_final_state": False})
    res["autocast_dtype"] = str(out_ac.dtype)
    res["autocast_vs_bf16"] = float((out_ac.double() - out.double()).abs().max() / out.double().abs().max())
    qg = q.detach().requires_grad_()
    with use_backend("fused"):
        o = rotary_linear_attention(qg, k, v, **{**kw, "output_final_state": False})
    try:
        torch.autograd.grad(o.float().sum(), qg, create_graph=True)
        res["double_backward"] = None
    except RuntimeError as ex:
        res["double_backward"] = str(ex)
    try:
        with use_backend("fused"):
            rotary_linear_attention(q.float().abs(), k.float().abs(), v.float())
        res["refused"] = None
    except ValueError as ex:
        res["refused"] = str(ex)
    return res


def selfcheck_checks() -> dict:
    """The self-check (``fused/selfcheck.py``) with the kernels in the interpreter: the results
    ``dispatch_checks``' forced calls stored (bf16, and float32 under a bf16 autocast), and the
    check of a float16 and a float32 specialization (masks, initial states, no RoPE) run here."""
    from linear_rope.ops.fused import selfcheck

    res = {"stored": {str(spec): why for (spec, _), why in selfcheck._RESULTS.items()}}
    for spec in (selfcheck.Spec(torch.float16, False, 16, 20, 16, True, True, True),
                 selfcheck.Spec(torch.float32, False, 16, 12, 24, False, True, False)):
        t0 = time.time()
        res[str(spec)] = dict(why=selfcheck.run_check(spec, torch.device("cpu")), seconds=time.time() - t0)
    return res


if __name__ == "__main__":
    fused_interp.self_check()
    names = sys.argv[1:] or list(CASES)
    res = {n: run_case(n) for n in names}
    res["_dispatch"] = dispatch_checks()
    res["_selfcheck"] = selfcheck_checks()
    print(json.dumps(res))
