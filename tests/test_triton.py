"""The Triton kernels (``linear_rope/ops/triton``) without a GPU: Triton's interpreter against the
naive reference (outputs and gradients, every supported keyword), the dispatch switch and its
fallbacks, and the ahead-of-time sm_80 / sm_90 builds of every kernel in every config the
dispatch can pick.

The interpreter runs the kernels' code on the CPU with numpy, and multiplies every ``tl.dot`` in
full fp32 whatever the GPU would do; the half-precision and fp32 cases therefore run under
``emulation.tensor_core_dots``, which computes each dot as the tensor cores do (TF32 truncation,
TF32x3, exact half products), and are held to the device tolerances of
``linear_rope.ops.tolerances`` (what ``benchmarks.gpu`` applies on the GPU) and to the 2x
half-precision contract. ``TRITON_INTERPRET=1`` is set here, before the kernels are imported
(conftest.py sets it for the whole CPU session). What the interpreter cannot see (shared memory,
registers, spills, which instructions) the ahead-of-time builds report, in subprocesses beside the
interpreter tests. Sizes are small on purpose: the interpreter costs about a millisecond per
tensor operation.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.language is imported (see conftest.py)
triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[triton]')")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(triton.language.standard.max, InterpretedFunction):
    pytest.skip("triton.language was imported before TRITON_INTERPRET=1 was set (or on CUDA): the "
                "interpreter tests need it set first", allow_module_level=True)

from linear_rope.features import FavorFeatures  # noqa: E402
from linear_rope.ops import LinearAttentionState, naive_rotary_linear_attention  # noqa: E402
from linear_rope.ops.triton import rotary_linear_attention, should_use_triton, supports  # noqa: E402
from linear_rope.ops.triton.dispatch import ENV_VAR, dispatch_configs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


AOT_SHARDS = 2  # compile processes beside the interpreter tests (the compile is the longer half)


@pytest.fixture(scope="module", autouse=True)
def aot_jobs(request, tmp_path_factory):
    """Start the ahead-of-time builds now, in a fresh cache, split over ``AOT_SHARDS`` processes,
    when the session runs ``test_aot_builds`` (which collects them), so that they run beside
    the interpreter tests."""
    if not any(item.name.startswith("test_aot_builds") for item in request.session.items):
        yield []
        return
    tmp = tmp_path_factory.mktemp("aot")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    jobs = []
    for i in range(AOT_SHARDS):
        out = tmp / f"aot{i}.json"
        cmd = [sys.executable, "-m", "linear_rope.ops.triton.aot", "--builds", "ci", "--shard", f"{i}/{AOT_SHARDS}",
               "--json", str(out)]
        jobs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True), out))
    yield jobs
    for proc, _ in jobs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _inputs(dtype, N, *, fused, m=10, d=8, e=8, B=1, H=1, seed=0):
    """q, k (raw with a projection, or features), v: leaves requiring grad, in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    if fused:
        w = FavorFeatures(d, m).projection
        q, k = (torch.randn(B, H, N, d, generator=g) for _ in range(2))
    else:
        w = None
        q, k = (torch.rand(B, H, N, m, generator=g) + 0.05 for _ in range(2))
    v = torch.randn(B, H, N, e, generator=g)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    return leaves, (None if w is None else w.to(dtype))


def _rel(a, b, scale=None):
    """max |a - b| over max |b| (or over ``scale``: a gradient that is exactly 0, dq at N = 1, is
    measured against the largest gradient of the call)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / (b.abs().max() if scale is None else scale))


def _check(dtype, N, tol, *, fused=True, rotary=True, seed=0, ref_dtype=torch.float64, grad_tol=None, **kw):
    """Kernel vs naive (in ``ref_dtype`` on the same inputs): outputs, final state, and the
    gradients of q, k, v (and of the initial state) under random upstream gradients."""
    shape = {n: kw.pop(n) for n in ("m", "d", "e", "B", "H") if n in kw}
    (q, k, v), w = _inputs(dtype, N, fused=fused, seed=seed, **shape)
    m = w.shape[0] if fused else q.shape[-1]
    B, H, e = q.shape[0], q.shape[1], v.shape[-1]
    gen = torch.Generator().manual_seed(seed + 1)
    state = kw.pop("initial_state", None)
    leaves = [q, k, v]
    if state is True:
        S0 = torch.rand(B, H, m, e, generator=gen).to(dtype).requires_grad_()
        z0 = torch.rand(B, H, m, generator=gen).to(dtype).requires_grad_()
        leaves += [S0, z0]
    kw = dict(kw, rotary=rotary, projection=w)
    if not rotary:
        kw.pop("offset", None)  # positions only enter through RoPE: the op refuses an offset without it
    if state is True:
        kw["initial_state"] = LinearAttentionState(S0, z0)
    res = rotary_linear_attention(q, k, v, **kw)
    ref_kw = dict(kw, projection=None if w is None else w.to(ref_dtype))
    if state is True:
        ref_kw["initial_state"] = LinearAttentionState(S0.to(ref_dtype), z0.to(ref_dtype))
    ref = naive_rotary_linear_attention(*(t.to(ref_dtype) for t in (q, k, v)), **ref_kw)
    res, ref = (res, ref) if isinstance(res, tuple) else ((res,), (ref,))
    assert res[0].dtype == v.dtype and res[0].shape == ref[0].shape
    outs_res = [res[0]] + (list(res[1]) if len(res) > 1 else [])
    outs_ref = [ref[0]] + (list(ref[1]) if len(ref) > 1 else [])
    for name, a, b in zip(("out", "S", "z"), outs_res, outs_ref):
        assert _rel(a, b) <= tol, f"{name}: relative error {_rel(a, b):.2e} > {tol:.0e}"
    ups = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in outs_ref]
    ref_leaves = [t for t in leaves]
    got = torch.autograd.grad(sum((a.double() * u).sum() for a, u in zip(outs_res, ups)), leaves)
    want = torch.autograd.grad(sum((b.double() * u).sum() for b, u in zip(outs_ref, ups)), ref_leaves)
    scale = max(float(b.abs().max()) for b in want)
    for name, a, b in zip(("dq", "dk", "dv", "dS0", "dz0"), got, want):
        t, r = grad_tol or tol, _rel(a, b, scale)
        assert r <= t, f"{name}: error {r:.2e} > {t:.0e} (relative to the largest gradient, {scale:.3g})"
    if w is not None:
        assert not w.requires_grad  # the projection is a fixed draw: no gradient, as in the torch op


PATHS = [pytest.param(f, r, id=f"{'projection' if f else 'features'}-{'eq19' if r else 'eq18'}")
         for f in (True, False) for r in (True, False)]


@pytest.mark.parametrize("N", [1, 63, 257], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("fused, rotary", PATHS)
def test_float64_matches_naive(fused, rotary, N):
    _check(torch.float64, N, 1e-10, fused=fused, rotary=rotary, offset=3)


@pytest.mark.parametrize("fused, rotary", PATHS[:1] + PATHS[3:])
def test_state_in_and_out(fused, rotary):
    """initial_state and output_final_state (and their gradients) across chunk boundaries."""
    _check(torch.float64, 100, 1e-10, fused=fused, rotary=rotary, offset=5, initial_state=True, output_final_state=True)


def test_mask_and_row_offsets():
    """Left and right padding with per-row offsets: positions count real tokens, masked keys add
    nothing, masked queries output 0, over two rows."""
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[0, :9] = False
    mask[1, 61:] = False
    _check(torch.float64, 70, 1e-10, B=2, offset=torch.tensor([0, 1000]), mask=mask, initial_state=True,
           output_final_state=True)


@pytest.mark.parametrize("fused, rotary", PATHS[:1] + PATHS[3:])
def test_padding_is_selected_never_multiplied(fused, rotary):
    """NaN in the masked positions of q, k, v leaves every output, the final state and every
    gradient exactly what they are with zeros there (the kernels used to multiply by the key mask:
    0 * NaN is NaN)."""
    (q, k, v), w = _inputs(torch.float64, 37, fused=fused, B=2, H=1, seed=3)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[0, :9] = False  # two chunks of 32: padding in both
    mask[1, 30:] = False
    mask[1, 20] = False
    ups = None

    def run(fill):
        nonlocal ups
        xs = [t.detach().clone().masked_fill_(~mask[:, None, :, None], fill).requires_grad_() for t in (q, k, v)]
        out, st = rotary_linear_attention(*xs, projection=w, mask=mask, rotary=rotary, output_final_state=True)
        outs = (out, st.S, st.z)
        ups = ups or [torch.randn(t.shape, generator=torch.Generator().manual_seed(4), dtype=t.dtype) for t in outs]
        return [*outs, *torch.autograd.grad(sum((t * u).sum() for t, u in zip(outs, ups)), xs)]

    clean, dirty = run(0.0), run(float("nan"))
    for a, b in zip(clean, dirty):
        assert torch.isfinite(b).all() and torch.equal(a, b)


def test_nan_in_real_tokens_propagates_as_on_the_torch_path():
    """A NaN in an unmasked key reaches the same outputs and gradients as on the torch path: the
    kernels' denominator guard (den <= 0 divides by 1) lets NaN through, never turns it into 0.
    One difference, at the NaN token's own dk: the kernels select where the clamped key
    exponent passes its gradient (a NaN exponent passes none), torch's clamp multiplies by that
    mask (NaN * 0), so 7 of its 8 entries are finite here and NaN there."""
    from linear_rope.ops.api import rotary_linear_attention as torch_op
    from linear_rope.ops.triton.dispatch import use_backend

    (q, k, v), w = _inputs(torch.float64, 70, fused=True)
    k = k.detach().clone()
    k[0, 0, 5, 0] = float("nan")
    res = {}
    for name, op in (("triton", rotary_linear_attention), ("torch", torch_op)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with use_backend("torch" if name == "torch" else "auto"):
            out = op(*leaves, projection=w)
        out.sum().backward()
        res[name] = [out.isnan()] + [t.grad.isnan() for t in leaves]
    res["triton"][2][0, 0, 5] = res["torch"][2][0, 0, 5] = True  # dk at the NaN token: see above
    for a, b in zip(res["triton"], res["torch"]):
        assert torch.equal(a, b) and a.any()


def test_float32_at_512():
    """fp32 inputs, with the GPU's tl.dot arithmetic (TF32x3 everywhere)."""
    from linear_rope.ops.triton.emulation import tensor_core_dots

    with tensor_core_dots():
        _check(torch.float32, 512, 1e-5, offset=100)


def test_paper_size():
    """m = 266 FAVOR+ features of d = 64 (133 pairs: 17 blocks of 8 in the chunk kernels, 9 of
    16 in the state passes, the last one padded), two chunks, fp32 inputs with the GPU's tl.dot
    arithmetic."""
    from linear_rope.ops.triton.emulation import tensor_core_dots

    with tensor_core_dots():
        _check(torch.float32, 80, 1e-5, m=266, d=64, e=64, offset=7)


def test_blocks_of_pairs_float64():
    """m = 70: 35 pairs in five blocks of 8 (three of 16 in the state passes), the last holding 3
    real pairs; N = 150: three chunks of 64, the last partial. In float64 the blocks' sums on
    chip and the chunk states are checked to 1e-10."""
    _check(torch.float64, 150, 1e-10, m=70, offset=11)


# The half-precision cases, run with the GPU's tl.dot arithmetic (emulation.tensor_core_dots):
# name -> (N, keywords). The paper's head sizes (d = 64, m = 266: exponents of realistic size, 17
# blocks of 8 pairs, two chunks of 64) with every keyword the kernels take, and small sizes over 2-3 chunks.
HALF_CASES = {
    "paper-state-offsets": (80, dict(m=266, d=64, e=64, B=2, offset=torch.tensor([3, 1000]), initial_state=True,
                                     output_final_state=True)),
    "paper-mask": (70, dict(m=266, d=64, e=64, B=2, mask="pad")),
    "small-state": (150, dict(offset=2, initial_state=True, output_final_state=True)),
    "features-eq19": (100, dict(fused=False, output_final_state=True)),
    "paper-eq18": (40, dict(m=266, d=64, e=64, rotary=False)),
}


def _check_on_tensor_cores(dtype, N, *, fused=True, rotary=True, seed=0, **kw):
    """The kernels with the GPU's tl.dot arithmetic, bf16 / fp16 inputs, against the float64
    reference on the same rounded inputs: every output, final state and gradient (i) within the
    device tolerances (``tolerances.triton_tolerance``, what ``benchmarks.gpu`` applies on the
    GPU) and (ii) within ``HALF_CONTRACT`` of float32 rounded to the input dtype."""
    from linear_rope.ops.tolerances import HALF_CONTRACT, check, rounded_error, triton_tolerance
    from linear_rope.ops.triton.emulation import tensor_core_dots

    shape = {n: kw.pop(n) for n in ("m", "d", "e", "B", "H") if n in kw}
    (q, k, v), w = _inputs(dtype, N, fused=fused, seed=seed, **shape)
    w = None if w is None else w.float()  # the layer's projection is a float32 buffer
    m = w.shape[0] if fused else q.shape[-1]
    B, H, e = q.shape[0], q.shape[1], v.shape[-1]
    gen = torch.Generator().manual_seed(seed + 1)
    leaves = [q, k, v]
    if kw.get("mask") == "pad":
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[0, :9] = False
        mask[-1, N - 11:] = False
        kw["mask"] = mask
    state = kw.pop("initial_state", None)
    if state:  # a state of a real prefix's scale (a random one would swamp the features)
        prefix = [torch.randn(B, H, 20, t.shape[-1], generator=gen, dtype=torch.float64) for t in (q, k, v)]
        if not fused:
            prefix[0], prefix[1] = prefix[0].abs() + 0.05, prefix[1].abs() + 0.05
        _, st = naive_rotary_linear_attention(*prefix, projection=None if w is None else w.double(),
                                              output_final_state=True)
        S0, z0 = (t.float().requires_grad_() for t in st)
        leaves += [S0, z0]
        kw["initial_state"] = LinearAttentionState(S0, z0)
    kw = dict(kw, rotary=rotary)

    def run(x, proj, op, **extra):
        kws = dict(kw, **extra)
        if state:
            kws["initial_state"] = LinearAttentionState(x[3], x[4])
        res = op(*x[:3], projection=proj, **kws)
        return (res[0], *res[1]) if isinstance(res, tuple) else (res,)

    with tensor_core_dots():
        outs = run(leaves, w, rotary_linear_attention)
    ref_x = [t.detach().double().requires_grad_() for t in leaves]
    ref = run(ref_x, None if w is None else w.double(), naive_rotary_linear_attention)
    f32_x = [t.detach().float().requires_grad_() for t in leaves]
    base = run(f32_x, w, naive_rotary_linear_attention)
    # upstream gradients as the op receives them: in its outputs' dtypes (fp16 / bf16 out, fp32 state)
    ups = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(a.dtype).double() for t, a in zip(ref, outs)]
    with tensor_core_dots():
        got = torch.autograd.grad([(a.double() * u).sum() for a, u in zip(outs, ups)], leaves)
    want = torch.autograd.grad([(b * u).sum() for b, u in zip(ref, ups)], ref_x)
    base_g = torch.autograd.grad([(b.double() * u).sum() for b, u in zip(base, ups)], f32_x)
    names = ["out", "S", "z"][:len(outs)] + ["dq", "dk", "dv", "dS0", "dz0"][:len(leaves)]
    tol = triton_tolerance(dtype)
    floor = torch.finfo(dtype).eps / 8  # a baseline can be exact by luck (a tensor of zeros and ones)
    for name, a, b, f in zip(names, (*outs, *got), (*ref, *want), (*base, *base_g)):
        r = check(a, b, tol, grad=name.startswith("d"))
        assert r["worst_over_tol"] <= 1.0, f"{name}: error {r['worst_over_tol']:.2f}x the device tolerance ({r})"
        limit = HALF_CONTRACT * max(rounded_error(f, b, dtype), floor)
        assert r["max_rel_to_max"] <= limit, \
            f"{name}: error {r['max_rel_to_max']:.2e} x max > {HALF_CONTRACT} x float32 rounded to {dtype} ({limit / 2:.2e})"


# bf16 inputs run the default config (TF32x3 products, as fp16: ``dispatch.BF16_TENSOR_CORES``
# is off since the first GPU run) on three cases, and the bf16 tensor-core config on all five
BF16_DEFAULT_CASES = ("paper-mask", "small-state", "features-eq19")
HALF_RUNS = [(dt, case, tc) for dt, tc in ((torch.float16, False), (torch.bfloat16, False), (torch.bfloat16, True))
             for case in HALF_CASES if tc or dt == torch.float16 or case in BF16_DEFAULT_CASES]


@pytest.mark.parametrize("dtype, case, tensor_cores", HALF_RUNS,
                         ids=[f"{str(d)[6:]}{'-tc' if t else ''}-{c}" for d, c, t in HALF_RUNS])
def test_half_inputs_on_tensor_cores(dtype, case, tensor_cores, monkeypatch):
    """bf16 / fp16 inputs as the GPU computes them (TF32 truncation, TF32x3, exact half
    products), against the float64 reference: the device tolerances and the 2x contract; bf16
    in the default config and in the bf16 tensor-core one (bf16x3 / bf16w3 products)."""
    from linear_rope.ops.triton import dispatch

    monkeypatch.setattr(dispatch, "BF16_TENSOR_CORES", tensor_cores)
    assert dispatch.pick_config(dtype)["chunk"]["PREC"].startswith("bf16") == tensor_cores
    N, kw = HALF_CASES[case]
    _check_on_tensor_cores(dtype, N, **dict(kw))


def test_emulated_dot_arithmetic():
    """The emulation computes what the tensor cores compute: TF32 drops the low 13 mantissa
    bits of fp32 operands, TF32x3 is within fp32 round-off of the exact product, IEEE is exact,
    bf16 operands multiply exactly; and it reaches tl.dot inside a kernel."""
    import numpy as np

    from linear_rope.ops.triton.emulation import emulated_dot, tensor_core_dots, tf32_round, tf32_truncate

    x = np.array([[1 + 2.0 ** -11 + 2.0 ** -20]], dtype=np.float32)  # below TF32's 10 mantissa bits
    one = np.ones((1, 1), dtype=np.float32)
    assert tf32_truncate(x)[0, 0] == 1.0 and tf32_round(x)[0, 0] == 1 + 2.0 ** -10
    assert emulated_dot(x, one, "tf32")[0, 0] == 1.0
    assert emulated_dot(x, one, "ieee")[0, 0] == x[0, 0]
    assert abs(emulated_dot(x, one, "tf32x3")[0, 0] - x[0, 0]) <= 2.0 ** -23
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, o_ptr, PREC: tl.constexpr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
        tl.store(o_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b, input_precision=PREC))

    a = torch.full((16, 16), 1 + 2.0 ** -11 + 2.0 ** -20)
    b = torch.eye(16)
    for prec, want in (("tf32", 1.0), ("ieee", float(a[0, 0])), ("tf32x3", float(a[0, 0]))):
        o = torch.empty(16, 16)
        with tensor_core_dots():
            dot_kernel[(1,)](a, b, o, PREC=prec)
        assert float(o[0, 0]) == want, (prec, float(o[0, 0]), want)
        dot_kernel[(1,)](a, b, o, PREC=prec)  # the plain interpreter: full fp32 whatever the precision
        assert float(o[0, 0]) == float(a[0, 0])
    ah, bh = (torch.full((16, 16), 1 + 2.0 ** -7).bfloat16(), torch.eye(16).bfloat16())
    o = torch.empty(16, 16)
    with tensor_core_dots():
        dot_kernel[(1,)](ah, bh, o, PREC="tf32")  # bf16 operands: exact products, fp32 sums
    assert float(o[0, 0]) == 1 + 2.0 ** -7


def test_dispatch_switch(monkeypatch):
    (q, k, v), w = _inputs(torch.float32, 8, fused=True)
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert not should_use_triton(q, k, v, projection=w)  # auto: CPU tensors take the torch path
    assert should_use_triton(q, k, v, projection=w, force="triton")  # the interpreter runs it
    assert not should_use_triton(q, k, v, projection=w, force="torch")
    monkeypatch.setenv(ENV_VAR, "triton")
    assert should_use_triton(q, k, v, projection=w)
    assert not should_use_triton(q, k, v, projection=w, force="torch")  # force beats the variable
    monkeypatch.setenv(ENV_VAR, "torch")
    assert not should_use_triton(q, k, v, projection=w)
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="must be one of"):
        should_use_triton(q, k, v, projection=w)
    with pytest.raises(ValueError, match="causal=False"):
        should_use_triton(q, k, v, projection=w, causal=False, force="triton")


def test_supports_names_what_goes_to_torch(monkeypatch):
    (q, k, v), w = _inputs(torch.float32, 8, fused=True)
    assert supports(q, k, v, projection=w) == (True, "")
    big = torch.zeros(1, 1, 8, 128)
    cases = {
        "causal=False": dict(causal=False),
        "cu_seqlens": dict(cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32)),
        "cross-attention": dict(key_mask=torch.ones(1, 8, dtype=torch.bool), causal=False, rotary=False),
        "head dims": dict(v=big),
        "empty batch": dict(v=v[:0], q=q[:0], k=k[:0]),
        "chunk_size / block_size apply to the torch path": dict(chunk_size=16),
    }
    for why, kw in cases.items():
        args = dict(q=kw.pop("q", q), k=kw.pop("k", k), v=kw.pop("v", v))
        ok, reason = supports(**args, projection=w, **kw)
        assert not ok and why in reason, (why, reason)
        with pytest.raises(ValueError, match="triton"):
            rotary_linear_attention(**args, projection=w, **kw)
    ok, reason = supports(q.to(torch.int32), k, v)
    assert not ok and "dtype" in reason
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a machine without the interpreter
    ok, reason = supports(q, k, v, projection=w)
    assert not ok and "CUDA" in reason


def test_bad_input_and_double_backward():
    (q, k, v), w = _inputs(torch.float32, 8, fused=True)
    with pytest.raises(ValueError, match="projection"):  # the op's own checks, same messages
        rotary_linear_attention(q, k, v, projection=w[:, :3])
    out = rotary_linear_attention(q, k, v, projection=w)
    with pytest.raises(RuntimeError, match="double backward"):  # as the torch path: refused, not wrong
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_aot_builds(aot_jobs):
    """Every kernel in every config ``dispatch`` can pick builds for sm_90 (and in bf16 for sm_80:
    ``aot --builds ci``; the full report builds every dtype for both) and fits the
    SM's per-block shared memory; the report names the matrix instructions of each build; the
    bf16 builds of the chunk-parallel kernels meet ``aot.BF16_TARGETS`` (2 blocks per SM, bf16
    tensor cores only, no spills: every sm_90 build) or, on sm_80, spill no more than
    ``aot.BF16_SPILLS`` records (four builds, 4-40 B: a ratchet). The targets are Triton 3.6.0's
    (the pin); another release is judged by its own record in ``aot.BF16_SPILLS_BY_TRITON``, or,
    without one, only built and reported."""
    from linear_rope.ops.triton.aot import ARCHS, KERNELS, SM_LIMITS, TC, bf16_misses, selected, variants

    rows = []
    for proc, path in aot_jobs:
        log, _ = proc.communicate(timeout=900)
        assert path.is_file(), log[-3000:]
        rows += json.loads(path.read_text())
        assert proc.returncode == 0, log[-3000:]
    built = {(r["arch"], r["variant"], r["kernel"], r["dtype"], r["favor"]) for r in rows}
    want = {(f"sm_{a}", var, k, str(dt).removeprefix("torch."), f) for a in ARCHS for var, dt, _ in variants()
            for k, _, favors in KERNELS for f in favors if selected(a, var, "ci")}
    assert built == want
    assert {dt for dt, _ in dispatch_configs()} <= {dt for var, dt, _ in variants() if var == "default"}
    assert sum(r["variant"] == TC and r["kernel"] != "_qmax_kernel" for r in rows) == 24  # judged: 2 archs x 12
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    for r in rows:
        assert 0 < r["shared_bytes"] <= SM_LIMITS[int(r["arch"][3:])]["smem_block"], r
        assert r["blocks_per_sm"] >= 1, r
        ins = r["instructions"]
        assert sum(v for k, v in ins.items() if k.startswith(("mma", "wgmma"))) > 0, r  # the dots reach the tensor cores
        assert not bf16_misses(r), (bf16_misses(r), r)
        if r["favor"] and r["dtype"] == "float32":
            assert ins["cvt.rna.tf32"] > 0, r  # the exponents' TF32x3 splits its operands with cvt.rna


def test_bf16_targets_fail_a_build_that_breaks_them():
    """``aot.bf16_misses`` (what ``test_aot_builds`` asserts per build) names each broken target:
    fewer blocks per SM, no bf16 tensor cores (or no wgmma for the 64-row kernels on sm_90), TF32
    instructions, more spills than recorded for the Triton release that built it; other dtypes,
    the stabiliser and a release with no record are not judged (a build that failed still is)."""
    from linear_rope.ops.triton.aot import BF16_SPILLS, BF16_SPILLS_BY_TRITON, PINNED_TRITON, bf16_misses

    assert BF16_SPILLS is BF16_SPILLS_BY_TRITON[PINNED_TRITON] and PINNED_TRITON == "3.6.0"
    good = dict(kernel="_out_kernel", dtype="bfloat16", variant="bf16_tensor_cores", favor=True, arch="sm_90",
                triton="3.6.0", ok=True, shared_bytes=1,
                blocks_per_sm=2, spill_store_bytes=0,
                instructions={"wgmma.bf16": 8})
    assert bf16_misses(good) == []
    cases = {"blocks per SM": dict(blocks_per_sm=1), "spills": dict(spill_store_bytes=good["spill_store_bytes"] + 4),
             "TF32": dict(instructions={"wgmma.bf16": 8, "wgmma.tf32": 2}),
             "wgmma": dict(instructions={"mma.bf16": 8}), "no bf16": dict(instructions={"mma.tf32": 8})}
    for what, change in cases.items():
        miss = bf16_misses(dict(good, **change))
        assert any(what in m for m in miss), (what, miss)
    assert bf16_misses(dict(good, kernel="_state_kernel", spill_store_bytes=4)) == ["spills 4 B > 0 B"]
    assert not [key for key in BF16_SPILLS if key[0] == "sm_90"]  # sm_90: 0 spills, no allowance
    ampere = dict(good, arch="sm_80", kernel="_dk_kernel", instructions={"mma.bf16": 8},
                  spill_store_bytes=BF16_SPILLS[("sm_80", "_dk_kernel", True)])
    assert bf16_misses(ampere) == []
    assert bf16_misses(dict(ampere, spill_store_bytes=ampere["spill_store_bytes"] + 4)) != []
    assert bf16_misses(dict(good, dtype="float32", blocks_per_sm=1)) == []
    assert bf16_misses(dict(good, variant="default", instructions={"wgmma.tf32": 8})) == []  # TF32x3 bf16 default
    assert bf16_misses({k: v for k, v in good.items() if k != "triton"}) == []  # no release named: the pin's targets
    assert bf16_misses({k: v for k, v in dict(good, spill_store_bytes=4).items() if k != "triton"}) != []
    newer = dict(good, triton="3.9.0", spill_store_bytes=BF16_SPILLS_BY_TRITON["3.9.0"][("sm_90", "_out_kernel", True)])
    assert bf16_misses(newer) == [] and bf16_misses(dict(newer, triton="3.6.0")) != []  # its own record
    assert bf16_misses(dict(newer, spill_store_bytes=newer["spill_store_bytes"] + 4)) != []
    unrecorded = dict(good, triton="99.0.0", spill_store_bytes=800, blocks_per_sm=1, instructions={"mma.tf32": 8})
    assert bf16_misses(unrecorded) == []  # built and reported, not judged
    assert bf16_misses(dict(unrecorded, ok=False, error="out of resources")) == ["out of resources"]
    assert bf16_misses(dict(good, kernel="_qmax_kernel", instructions={"wgmma.tf32": 1})) == []


def test_public_op_layer_and_lm_take_the_kernels_when_forced(monkeypatch):
    """LINEAR_ROPE_BACKEND=triton routes the public op (and so the layer and the LM) to the
    kernels, here through the interpreter; the answers equal the torch path's in float64, outputs
    and gradients, and the kernels were really called."""
    import linear_rope
    from linear_rope.ops.triton import chunk as triton_chunk

    calls = []
    real = triton_chunk.rotary_linear_attention
    monkeypatch.setattr(triton_chunk, "rotary_linear_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    (q, k, v), w = _inputs(torch.float64, 21, fused=True, B=2, H=2)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[1, :5] = False
    kw = dict(projection=w, mask=mask, offset=torch.tensor([0, 7]), output_final_state=True)
    monkeypatch.setenv(ENV_VAR, "torch")
    ref, ref_state = linear_rope.rotary_linear_attention(q, k, v, **kw)
    up = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * up).sum() + ref_state.S.sum(), (q, k, v))
    assert not calls
    monkeypatch.setenv(ENV_VAR, "triton")
    out, state = linear_rope.rotary_linear_attention(q, k, v, **kw)
    assert calls
    g = torch.autograd.grad((out * up).sum() + state.S.sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state.S, ref_state.S, rtol=1e-10, atol=1e-10)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    torch.manual_seed(0)
    lm = linear_rope.PerformerLM(linear_rope.ModelConfig(dim=16, depth=1, heads=2, dim_head=8, nb_features=10,
                                                         seq_len=32)).double()
    ids = torch.randint(0, 256, (2, 13))
    calls.clear()
    logits_triton = lm(ids)
    assert calls
    monkeypatch.setenv(ENV_VAR, "torch")
    torch.testing.assert_close(logits_triton, lm(ids), rtol=1e-10, atol=1e-10)
