"""The chunk-parallel causal path (``linear_rope/ops/parallel.py``, ``LINEAR_ROPE_BACKEND=parallel``):
equal to the float64 reference for every keyword it takes, within its bf16 contract under a bf16
autocast, a fixed number of ATen ops at any N and B with no host sync, and plain ops under
``torch.compile`` (no graph break, no ``linear_rope`` custom op)."""
from __future__ import annotations

import pytest
import torch

from benchmarks.counting import counted
from linear_rope import FavorFeatures, LinearAttentionState
from linear_rope import naive_rotary_linear_attention as naive
from linear_rope import rotary_linear_attention as op
from linear_rope.features import favor_features
from linear_rope.ops import parallel, rope_tables
from linear_rope.ops import backend as dispatch


@pytest.fixture(autouse=True)
def parallel_backend(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "parallel")
    monkeypatch.delenv(parallel.CHECKS_VAR, raising=False)


def _rel(a, b, scale=None):
    a, b = a.detach().double(), b.detach().double()
    s = b.abs().max().item() if scale is None else scale
    return (a - b).abs().max().item() / (s if s > 0 else 1.0)


def _inputs(B, H, N, m, d, e, favor, seed=0, state=False):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if favor:
        q, k = (torch.randn(B, H, N, d, generator=g, dtype=torch.float64) for _ in range(2))
    else:
        q, k = (torch.rand(B, H, N, m, generator=g, dtype=torch.float64) + 0.05 for _ in range(2))
    v = torch.randn(B, H, N, e, generator=g, dtype=torch.float64)
    xs = [q, k, v]
    if state:
        xs += [torch.randn(B, H, m, e, generator=g, dtype=torch.float64),
               torch.rand(B, H, m, generator=g, dtype=torch.float64) + 0.5]
    w = FavorFeatures(d, m).projection.double() if favor else None
    return [x.requires_grad_() for x in xs], w, g


KEYWORDS = {
    "plain": {},
    "eq18": dict(rotary=False),
    "mask": dict(mask=True),
    "offsets": dict(offset=torch.tensor([5, 2**40])),
    "int-offset": dict(offset=123),
    "state": dict(state=True),
    "sizes": dict(chunk_size=7, block_size=20),  # several segments, the state carried
}


@pytest.mark.parametrize("favor", [False, True], ids=["features", "favor"])
@pytest.mark.parametrize("N", [1, 63, 257])
@pytest.mark.parametrize("name", list(KEYWORDS))
def test_parallel_path_matches_the_float64_reference(name, N, favor):
    """Outputs, final states and the gradients of q, k, v and the initial state under random
    upstream gradients, in float64, for every keyword the path takes."""
    kw = dict(KEYWORDS[name])
    B, H, m, d, e = 2, 2, 6, 4, 3
    xs, w, g = _inputs(B, H, N, m, d, e, favor, seed=N, state=kw.pop("state", False))
    if kw.pop("mask", False):
        kw["mask"] = torch.rand(B, N, generator=g) < 0.7
    if w is not None:
        kw["projection"] = w
    if len(xs) > 3:
        kw["initial_state"] = LinearAttentionState(*xs[3:])
    with dispatch.record_paths() as paths:
        out, st = op(*xs[:3], output_final_state=True, **kw)
    assert paths == ["parallel path (LINEAR_ROPE_BACKEND=parallel)"]
    ref_kw = {k: v for k, v in kw.items() if k not in ("chunk_size", "block_size")}
    ref, ref_st = naive(*xs[:3], output_final_state=True, **ref_kw)
    for a, b in zip((out, st.S, st.z), (ref, ref_st.S, ref_st.z)):
        assert _rel(a, b) <= 1e-12
    ups = [torch.randn(r.shape, generator=g, dtype=torch.float64) for r in (ref, ref_st.S, ref_st.z)]
    got = torch.autograd.grad(sum((a * u).sum() for a, u in zip((out, st.S, st.z), ups)), xs)
    want = torch.autograd.grad(sum((b * u).sum() for b, u in zip((ref, ref_st.S, ref_st.z), ups)), xs)
    scale = max(b.abs().max().item() for b in want)
    for a, b in zip(got, want):
        assert _rel(a, b, scale) <= 1e-12


def test_packed_documents_take_the_torch_path_with_the_reason():
    """cu_seqlens' values set the chunk layout's shapes (a host sync to read): the torch path,
    recorded with the reason, and the same result."""
    xs, _, _ = _inputs(1, 2, 40, 4, 4, 3, favor=False)
    cu = torch.tensor([0, 11, 11, 40], dtype=torch.int32)
    with dispatch.record_paths() as paths:
        out = op(*xs, cu_seqlens=cu)
    assert paths == [f"torch path ({dispatch.PACKED_REASON})"]
    assert _rel(out, naive(*xs, cu_seqlens=cu)) <= 1e-12


def test_auto_on_the_cpu_keeps_the_torch_path(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    xs, _, _ = _inputs(1, 1, 9, 4, 4, 2, favor=False)
    with dispatch.record_paths() as paths:
        op(*xs)
    assert paths and paths[0].startswith("torch path"), paths


def test_value_checks_are_opt_in_on_the_parallel_path(monkeypatch):
    """No host sync by default: negative features are not looked for (the GPU would wait);
    ``LINEAR_ROPE_CHECKS=1`` brings the one-line ValueError back, and the torch path keeps it."""
    q, k, v = (torch.rand(1, 1, 5, 4, dtype=torch.float64) for _ in range(3))
    k[0, 0, 2, 1] = -0.5
    op(q, k, v)  # not read: no error
    monkeypatch.setenv(parallel.CHECKS_VAR, "1")
    with pytest.raises(ValueError, match="features must be non-negative"):
        op(q, k, v)
    monkeypatch.setenv(parallel.CHECKS_VAR, "0")
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    with pytest.raises(ValueError, match="features must be non-negative"):
        op(q, k, v)


PAPER = dict(H=12, d=64, m=266, e=64)  # the paper preset's attention: dim 768, 12 heads, FAVOR+ m = 266


def _count(B, N, favor=True, state=False):
    """Launches and syncs of one forward and one backward of the op at the paper's head sizes,
    bf16 inputs under a bf16 autocast (as a bf16 model feeds it)."""
    H, d, m, e = PAPER.values()
    torch.manual_seed(0)
    w = FavorFeatures(d, m).projection if favor else None
    x = d if favor else m
    q, k = (torch.rand(B, H, N, x).to(torch.bfloat16).requires_grad_() for _ in range(2))
    v = torch.randn(B, H, N, e).to(torch.bfloat16).requires_grad_()
    kw = dict(projection=w, output_final_state=state)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with counted() as fwd:
            res = op(q, k, v, **kw)
        out = res[0] if state else res
        with counted() as bwd:
            out.backward(torch.randn_like(out))
    return fwd.launches, fwd.syncs, bwd.launches, bwd.syncs


def test_launches_do_not_grow_with_N_or_B_and_no_host_syncs():
    """The paper preset's attention (12 heads of d = 64, m = 266 FAVOR+ features, bf16 autocast):
    forward + backward within 200 ATen launches, the same at N = 1024 and 4096 and B = 1 and 2,
    and not one host sync. The first call at a new length also builds its RoPE tables (kept for
    the next calls: every layer of a model shares them)."""
    rope_tables._pair_tables_at.cache_clear()
    first = _count(1, 1024)
    steady = _count(1, 1024)
    assert steady[1] == steady[3] == first[3] == 0, (first, steady)
    assert first[1] <= 2, first  # at most the RoPE constants, copied to the device once per process
    assert steady[0] + steady[2] <= 200, steady
    assert first[0] + first[2] <= 200, first
    _count(1, 4096)
    assert _count(1, 4096) == steady
    assert _count(2, 1024) == steady


def test_features_in_no_host_syncs():
    """Features given (no projection): the scale normalisation always divides rather than asking
    the device whether it needs to (a sync)."""
    _count(1, 256, favor=False, state=True)
    f, fs, b, bs = _count(1, 256, favor=False, state=True)
    assert fs == bs == 0 and f + b <= 200, (f, b)


def _bf16_case(favor, seed):
    B, H, N, d, m, e = 1, 2, 300, 16, 32, 16
    xs, w, g = _inputs(B, H, N, m, d, e, favor, seed=seed)
    q, k, v = (x.detach() for x in xs)
    fq, fk = (q, k) if w is None else (favor_features(q, w, is_query=True), favor_features(k, w, is_query=False))
    return q, k, v, fq, fk, w


ROUNDED = 2.0  # features in: the error within 2x of the float64 op's on the bf16-rounded features and values


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_features_in(seed):
    """Features given (no FAVOR+ inside), under a bf16 autocast: the chunk products take bf16
    operands (float32 results), so the error of the output and final state is within 2x of what
    the float64 op makes of the bf16-rounded features and values, the unavoidable error of bf16
    operands. The floor (1e-6 x max) is float32's own round-off, far below bf16's 4e-3. (With
    FAVOR+ inside, the contract against bf16 SDPA: tests/test_parallel_bf16.py.)"""
    q, k, v, fq, fk, w = _bf16_case(False, seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, st = op(q.float(), k.float(), v.float(), output_final_state=True)
    ref, ref_st = naive(fq, fk, v, output_final_state=True)
    r16 = [t.to(torch.bfloat16).double() for t in (fq, fk, v)]
    base, base_st = naive(*r16, output_final_state=True)
    for a, b, r in ((out, ref, base), (st.S, ref_st.S, base_st.S), (st.z, ref_st.z, base_st.z)):
        assert _rel(a, r) <= ROUNDED * _rel(b, r) + 1e-6, (_rel(a, r), _rel(b, r))


def test_bf16_gradients_features_in():
    """The gradients under a bf16 autocast, features given: the backward's GEMMs take the
    upstream gradient rounded to bf16, so theirs is the rounded operands' error plus half a bf16
    ulp of the largest gradient (2^-9 x max), within 2x."""
    q, k, v, fq, fk, w = _bf16_case(False, 0)
    xs = [t.clone().requires_grad_() for t in (fq, fk, v)]
    up = torch.randn(fq.shape[:-1] + v.shape[-1:], dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = op(*(x.float() for x in xs))
    got = torch.autograd.grad((out.double() * up).sum(), xs)
    want = torch.autograd.grad((naive(*xs) * up).sum(), xs)
    rs = [t.detach().to(torch.bfloat16).double().requires_grad_() for t in (fq, fk, v)]
    base = torch.autograd.grad((naive(*rs) * up).sum(), rs)
    for a, b, r in zip(got, base, want):
        assert _rel(a, r) <= ROUNDED * (_rel(b, r) + 2.0**-9), (_rel(a, r), _rel(b, r))


def _graph_ops(fn, *args):
    """Compile ``fn`` (fullgraph: a graph break raises) with a backend that records the ops of
    the forward and backward graphs (aot_autograd), and run it forward and backward."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    out = compiled(*args)
    out.sum().backward()
    return out, seen


def test_compiles_to_plain_ops_without_graph_breaks():
    """Under ``torch.compile(fullgraph=True)`` the parallel path traces forward and backward as
    plain ATen ops: no graph break, no ``linear_rope`` custom op (the torch path's is one node)."""
    xs, w, _ = _inputs(1, 2, 70, 8, 4, 3, favor=True)
    fn = lambda q, k, v: op(q, k, v, projection=w)  # noqa: E731
    out, seen = _graph_ops(fn, *xs[:3])
    assert seen and not [t for t in seen if "linear_rope" in t], seen
    assert _rel(out, naive(*xs[:3], projection=w)) <= 1e-12


def test_inductor_compiles_forward_and_backward():
    """Inductor on the CPU compiles the path (fullgraph) forward and backward, and the result
    is the reference's."""
    xs, w, g = _inputs(1, 2, 70, 8, 4, 3, favor=True)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: op(q, k, v, projection=w), fullgraph=True)
    out = fn(*xs[:3])
    up = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * up).sum(), xs[:3])
    ref = naive(*xs[:3], projection=w)
    want = torch.autograd.grad((ref * up).sum(), xs[:3])
    assert _rel(out, ref) <= 1e-12
    for a, b in zip(got, want):
        assert _rel(a, b) <= 1e-11


def test_recompute_above_the_byte_budget(monkeypatch):
    """Above ``KEEP_BYTES`` no segment keeps its features: the backward recomputes them from q
    and k, and the outputs, states and gradients are the same."""
    monkeypatch.setattr(parallel, "KEEP_BYTES", 0)
    xs, w, g = _inputs(2, 2, 100, 6, 4, 3, favor=True, seed=3, state=True)
    mask = torch.rand(2, 100, generator=g) < 0.8
    kw = dict(projection=w, mask=mask, initial_state=LinearAttentionState(*xs[3:]), output_final_state=True)
    out, st = op(*xs[:3], block_size=30, **kw)
    ref, ref_st = naive(*xs[:3], **kw)
    ups = [torch.randn(r.shape, generator=g, dtype=torch.float64) for r in (ref, ref_st.S, ref_st.z)]
    got = torch.autograd.grad(sum((a * u).sum() for a, u in zip((out, st.S, st.z), ups)), xs)
    want = torch.autograd.grad(sum((b * u).sum() for b, u in zip((ref, ref_st.S, ref_st.z), ups)), xs)
    scale = max(b.abs().max().item() for b in want)
    assert _rel(out, ref) <= 1e-12 and _rel(st.S, ref_st.S) <= 1e-12
    for a, b in zip(got, want):
        assert _rel(a, b, scale) <= 1e-12


def test_segments_keep_the_launches_per_token_fixed():
    """Past the state budget (here ``block_size``) the sequence is walked in segments: each adds
    the same number of launches, so the launches per token do not grow with N."""
    def launches(N):
        q, k = (torch.rand(1, 2, N, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
        v = torch.randn(1, 2, N, 4, dtype=torch.float64, requires_grad=True)
        op(q, k, v, block_size=64)  # the tables of this length, made once
        with counted() as fwd:
            out = op(q, k, v, block_size=64)
        with counted() as bwd:
            out.sum().backward()
        assert fwd.syncs == bwd.syncs == 0
        return fwd.launches + bwd.launches

    a, b, c = launches(128), launches(256), launches(384)
    assert b - a == c - b > 0, (a, b, c)


def test_one_attention_layer_within_200_launches():
    """One ``RotaryLinearAttention`` of the paper preset (dim 768, 12 heads of 64, FAVOR+ inside,
    RoPE) under a bf16 autocast: forward + backward (projections included) within 200 ATen
    launches in eager, the same at N = 1024 and 4096, and no host sync."""
    from linear_rope.attention import RotaryLinearAttention

    torch.manual_seed(0)
    layer = RotaryLinearAttention(768, heads=12, dim_head=64, position="rope")

    def count(N):
        x = torch.randn(1, N, 768, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x).float().sum().backward()  # the tables of this length, and every .grad, made once
            with counted() as fwd:
                y = layer(x)
            with counted() as bwd:
                y.float().sum().backward()
        return fwd.launches, fwd.syncs, bwd.launches, bwd.syncs

    short, long = count(1024), count(4096)
    assert short == long and short[1] == short[3] == 0, (short, long)
    assert short[0] + short[2] <= 200, short
