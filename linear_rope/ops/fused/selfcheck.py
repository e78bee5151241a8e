"""The fused path's self-check: each compiled specialization of its kernels checks itself once,
against the chunk-parallel path, before any call of it takes the fused path.

A specialization (``Spec``) is what selects a different compiled kernel: the inputs' dtype and
GEMM arithmetic (bf16 operands for bf16 inputs or a bf16 autocast), d, m, e, RoPE or not, a
mask or not, an initial state or not. Its check runs the fused kernels on a problem of that
specialization of ``N_CHECK`` tokens (4 chunks of 64, the last one partial: the carried state
crosses three chunk boundaries), outputs, final states and the gradients of q, k, v (and of the
initial state) through two backwards (the output's gradient alone, as training runs it; and with
the final state's), against the float64 chunk-parallel path, within the dtype's contract
(``tolerances.py``): float32 ``tolerance(float32)``; bf16 arithmetic ``PARALLEL_BF16_CONTRACT``
times the bf16 chunk-parallel path's own error (Frobenius, ``relative_error``); float16
``HALF_CONTRACT`` times the float64 result rounded to float16 (its float32 states: float32's).

The results are a keyed cache (``docs/caches.md``): ``_RESULTS[(Spec, device)]`` is None (the
check passed) or why not (one line). ``verdict`` runs the check at the first eager call of a
specialization (or ``check_backend``'s ``specs``); while ``torch.compile`` traces or a CUDA graph
is captured the stored result decides, and with none stored the call takes the chunk-parallel
path (``NOT_CHECKED``, recorded; nothing is stored). A failed build, launch or check sends the
specialization's calls to the chunk-parallel path with one warning line (once per
specialization); ``LINEAR_ROPE_BACKEND=fused`` raises a one-line ValueError instead.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import NamedTuple

import torch

from ...checks import is_compiling

__all__ = ["N_CHECK", "NOT_CHECKED", "Spec", "capturing", "clear", "pricing_only", "run_check", "spec_of", "verdict"]

N_CHECK = 200  # tokens of the check: 4 chunks of 64 (3 boundaries the state crosses), the last one partial
NOT_CHECKED = ("fused kernels not self-checked yet for this specialization (the first call was traced or captured: "
               "one eager call, or check_backend's specs, checks them)")
_RESULTS: dict[tuple, str | None] = {}  # (Spec, device) -> None (passed) or why not
_WARNED: set[tuple] = set()
_PRICING: list[bool] = []  # inside ``pricing_only()``: every specialization taken as passed, nothing stored


class Spec(NamedTuple):
    """What selects a compiled specialization of the fused kernels."""

    dtype: torch.dtype  # q, k, v's
    lowp: bool  # bf16 GEMM operands (bf16 inputs, or float32 / float16 ones under a bf16 autocast)
    d: int
    m: int
    e: int
    rotary: bool
    mask: bool
    init: bool  # an initial state given

    def __str__(self) -> str:
        arith = " (bf16 arithmetic)" if self.lowp and self.dtype != torch.bfloat16 else ""
        return (f"{str(self.dtype)[6:]}{arith} d={self.d} m={self.m} e={self.e} rotary={self.rotary} "
                f"mask={self.mask} initial_state={self.init}")


def spec_of(q, v, projection, a, rotary: bool, lowp: bool) -> Spec:
    """The specialization of a call (``a``: its checked arguments)."""
    return Spec(q.dtype, bool(lowp), q.shape[-1], projection.shape[0], v.shape[-1], bool(rotary),
                a.kmask is not None, a.state is not None)


def _key(spec: Spec, device) -> tuple:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():  # "cuda": the current one
        dev = torch.device("cuda", torch.cuda.current_device())
    return spec, str(dev)


def capturing() -> bool:
    """``torch.compile`` tracing, or a CUDA graph being captured: no check can run."""
    if is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def pricing_only():
    """For ``benchmarks.gpu_predict`` alone, which compiles for a fake GPU and runs nothing (no
    check can run there): within the block every specialization is taken as passed, as on a GPU
    where it passed; nothing is stored."""
    _PRICING.append(True)
    try:
        yield
    finally:
        _PRICING.pop()


def clear() -> None:
    """Forget every stored result (the tests)."""
    _RESULTS.clear()
    _WARNED.clear()


def verdict(spec: Spec, device, forced: bool) -> str | None:
    """None if calls of ``spec`` on ``device`` take the fused path, else why not (one line). The
    check runs once per specialization and device, eagerly; while tracing or capturing, a stored
    result decides (none: ``NOT_CHECKED``). A failure warns once (one line) unless ``forced``
    (``LINEAR_ROPE_BACKEND=fused``), where the op raises the returned line as a ValueError."""
    if _PRICING:
        return None
    key = _key(spec, device)
    if key not in _RESULTS:
        if capturing():
            return NOT_CHECKED
        _RESULTS[key] = run_check(spec, torch.device(device))
    why = _RESULTS[key]
    if why is None:
        return None
    line = f"the fused kernels failed their self-check for {spec} on {key[1]}: {why}"
    if not forced and key not in _WARNED and not capturing():
        _WARNED.add(key)
        warnings.warn(f"linear_rope: {line}; these calls take the chunk-parallel path", RuntimeWarning, stacklevel=3)
    return line


def _problem(spec: Spec, device: torch.device):
    """q, k, v, the projection, the op's keywords and the upstream gradients (out, S, z) of the
    check: seeded, on ``device``."""
    g = torch.Generator().manual_seed(0)
    B, H, N, d, m, e = 2, 1, N_CHECK, spec.d, spec.m, spec.e
    q, k = torch.randn(B, H, N, d, generator=g), torch.randn(B, H, N, d, generator=g)
    v, w = torch.randn(B, H, N, e, generator=g), torch.randn(m, d, generator=g)
    kw = dict(rotary=spec.rotary, projection=w, output_final_state=True)
    if spec.rotary:
        kw["offset"] = 3
    if spec.mask:
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[0, :9] = False  # left padding
        mask[1, N - 5:] = False  # right padding
        kw["mask"] = mask
    if spec.init:
        kw["initial_state"] = (torch.rand(B, H, m, e, generator=g), torch.rand(B, H, m, generator=g) + 0.5)
    grads = (torch.randn(B, H, N, e, generator=g).to(spec.dtype).float(),  # as the output's gradient arrives
             torch.randn(B, H, m, e, generator=g), torch.randn(B, H, m, generator=g))
    to = dict(device=device)
    q, k, v = (t.to(spec.dtype).to(**to) for t in (q, k, v))
    kw = {n: (tuple(t.to(**to) for t in x) if isinstance(x, tuple) else x.to(**to) if torch.is_tensor(x) else x)
          for n, x in kw.items()}
    return q, k, v, kw, tuple(t.to(**to) for t in grads)


def _fused_call(q, k, v, kw, lowp: bool):
    """The fused op on the check's arguments, as ``api._fused`` calls it -> out, S, z."""
    from ..utils import LinearAttentionState, Options, check_args
    from .op import fused_causal

    st = kw.get("initial_state")
    opts = Options(causal=True, rotary=kw["rotary"], offset=kw.get("offset", 0), base=10000.0,
                   projection=kw["projection"], mask=kw.get("mask"), key_mask=None, cu_seqlens=None,
                   initial_state=None if st is None else LinearAttentionState(*st), allow_negative=False,
                   output_final_state=True)
    a = check_args(q, k, v, opts)
    with torch.autocast(q.device.type, enabled=False):
        return fused_causal(q, k, v, kw["projection"], a, kw["rotary"], kw.get("offset", 0), 10000.0, lowp)


def _parallel_call(q, k, v, kw, lowp: bool):
    """The chunk-parallel path (under a bf16 autocast for bf16 arithmetic of other inputs)."""
    from ..api import rotary_linear_attention
    from ..backend import use_backend
    from ..utils import LinearAttentionState

    st = kw.get("initial_state")
    kw = {**kw, "initial_state": None if st is None else LinearAttentionState(*st)}
    ac = lowp and q.dtype != torch.bfloat16
    with use_backend("parallel"), torch.autocast(q.device.type, dtype=torch.bfloat16, enabled=ac):
        out, state = rotary_linear_attention(q, k, v, **kw)
    return out, state.S, state.z


def _results(call, q, k, v, kw, grads, lowp: bool, cast) -> dict:
    """out, S, z and the gradients of two backwards: of out . gout (``dq`` ...), and of
    out . gout + S . gS + z . gz (``dq+`` ..., and the initial state's ``dS0+``, ``dz0+``)."""
    q, k, v = (cast(t).detach().requires_grad_() for t in (q, k, v))
    st = kw.get("initial_state")
    if st is not None:
        st = tuple(cast(t).detach().requires_grad_() for t in st)
    kw = {**kw, "initial_state": st} if st is not None else kw
    out, S, z = call(q, k, v, kw, lowp)
    go, gS, gz = (cast(t) for t in grads)
    one = (out.to(go.dtype) * go).sum()
    res = dict(out=out, S=S, z=z)
    res.update(zip(("dq", "dk", "dv"), torch.autograd.grad(one, (q, k, v), retain_graph=True)))
    both = one + (S.to(gS.dtype) * gS).sum() + (z.to(gz.dtype) * gz).sum()
    ins = (q, k, v) + (st or ())
    names = ("dq+", "dk+", "dv+", "dS0+", "dz0+")[: len(ins)]
    res.update(zip(names, torch.autograd.grad(both, ins)))
    return {n: t.detach() for n, t in res.items()}


def _compare(spec: Spec, got: dict, par: dict | None, ref: dict) -> str | None:
    """None if every tensor is within the contract of its dtype, else the worst one (one line)."""
    from ..tolerances import HALF_CONTRACT, PARALLEL_BF16_CONTRACT, check, relative_error, rounded_error, tolerance

    f32 = tolerance(torch.float32)
    for n, r in ref.items():
        a, grad = got[n], n.startswith("d")
        if not torch.isfinite(a).all():
            return f"{n} is not finite"
        if spec.lowp:
            err, base = relative_error(a, r), relative_error(par[n], r)
            if err > PARALLEL_BF16_CONTRACT * base + 1e-6:
                return (f"{n}: relative error {err:.2e} > {PARALLEL_BF16_CONTRACT:g} x the chunk-parallel path's "
                        f"{base:.2e} (bf16)")
        elif spec.dtype == torch.float16 and a.dtype == torch.float16:
            err = float((a.double() - r).abs().max() / r.abs().max().clamp_min(1e-300))
            allowed = HALF_CONTRACT * rounded_error(r.float(), r, torch.float16) + f32["grad_atol" if grad else "atol"]
            if err > allowed:
                return f"{n}: max error / max {err:.2e} > {allowed:.2e} (float16: {HALF_CONTRACT:g} x float16 rounding)"
        else:
            worst = check(a, r, f32, grad=grad)["worst_over_tol"]
            if worst > 1:
                return f"{n}: {worst:.3g} x the float32 tolerance"
    return None


def run_check(spec: Spec, device: torch.device) -> str | None:
    """The check of ``spec`` on ``device``: None if it passes, else why not (one line: the failed
    build or launch, or the tensor out of its contract)."""
    from ..backend import _RECORDERS

    held = _RECORDERS[:]  # the check's own calls are not the caller's: recorded nowhere
    _RECORDERS.clear()
    try:  # whatever the caller's modes: gradients on, no inference mode, no autocast
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            q, k, v, kw, grads = _problem(spec, device)
            got = _results(_fused_call, q, k, v, kw, grads, spec.lowp, lambda t: t)
            ref = _results(_parallel_call, q, k, v, kw, grads, False, lambda t: t.double())
            par = _results(_parallel_call, q, k, v, kw, grads, True, lambda t: t) if spec.lowp else None
        return _compare(spec, got, par, ref)
    except Exception as ex:  # a failed build or launch (Triton's compiler, ptxas, a CUDA error)
        first = (str(ex).strip().splitlines() or [""])[0][:300]
        return f"{type(ex).__name__}: {first}"
    finally:
        _RECORDERS[:] = held
