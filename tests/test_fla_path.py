"""The fla-backed path of causal Eq. 19 (``linear_rope.ops.fla_path``) on the CPU.

fla's kernels need CUDA, so ``fla_path._kernel`` is replaced here by ``standin_chunk_linear_attn``:
a float64 stand-in with the exact signature of fla's ``chunk_linear_attn`` (layout
`[B, T, H, K]`, ``scale``, ``initial_state`` `[B or D, H, K, V]`, ``output_final_state``,
``normalize``, ``cu_seqlens``). fla's own naive references cannot stand in by themselves: they
compute in float32 (``naive_recurrent_linear_attn``), or take no state and whole chunks of 64
(``naive_chunk_linear_attn``), and neither takes ``cu_seqlens``; the stand-in is checked against
``naive_recurrent_linear_attn`` (with and without a state), so it computes what fla computes.
All of the wrapper (features, rotation, masks, documents, states, feature blocks, the division)
is then checked against ``naive_rotary_linear_attention`` in float64: outputs, final states,
gradients.
"""
import pytest
import torch

import linear_rope.ops.fla_path as fla_path
from linear_rope import LinearAttentionState
from linear_rope import naive_rotary_linear_attention as reference
from linear_rope import rotary_linear_attention
from linear_rope.ops.backend import BACKENDS, record_paths, use_backend
from test_ops import F64, _keyword_case, _loss_parts


def standin_chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                              cu_seqlens=None):
    """fla's ``chunk_linear_attn`` written out in the input dtype (a test stand-in, not fla's code):
    per sequence (or ``cu_seqlens`` document), o_t = scale q_t^T (S0 + sum_{n<=t} k_n v_n^T)."""
    assert not normalize, "the fla path never asks fla to normalise"
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    B, T, H, K = q.shape
    out_dtype, acc = v.dtype, torch.promote_types(q.dtype, torch.float32)  # fla: fp32 sums, o in v's dtype
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    docs = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    outs, finals = [], []
    for i, (b, s, e) in enumerate(docs):
        kv = torch.einsum("thk,thv->thkv", k[b, s:e], v[b, s:e]).cumsum(0)  # (t, H, K, V)
        if initial_state is not None:
            kv = kv + initial_state[i]
        outs.append(torch.einsum("thk,thkv->thv", q[b, s:e] * scale, kv))
        finals.append(kv[-1])
    o = (torch.stack(outs) if cu_seqlens is None else torch.cat(outs)[None]).to(out_dtype)
    return o, (torch.stack(finals) if output_final_state else None)


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setattr(fla_path, "_kernel", lambda: standin_chunk_linear_attn)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "state"])
def test_standin_is_flas_naive_recurrent(with_state):
    naive = pytest.importorskip("fla.ops.linear_attn.naive")
    g = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 7, 3, 6, 5
    q, k = (torch.rand(B, T, H, K, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g)
    S0 = torch.randn(B, H, K, V, generator=g) if with_state else None
    want, Sw = naive.naive_recurrent_linear_attn(q, k, v, scale=0.7, initial_state=S0, output_final_state=True)
    got, Sg = standin_chunk_linear_attn(q, k, v, scale=0.7, initial_state=S0, output_final_state=True,
                                        normalize=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(Sg, Sw, rtol=1e-5, atol=1e-5)


CASES = ["none", "mask", "offsets", "state", "mask+state", "offsets+state", "cu", "cu+offsets+state"]


@pytest.mark.parametrize("rotary", [True, False], ids=["rope", "norope"])
@pytest.mark.parametrize("fused", [True, False], ids=["projection", "features"])
@pytest.mark.parametrize("case", CASES)
def test_fla_path_matches_reference(case, fused, rotary, standin, monkeypatch):
    monkeypatch.setattr(fla_path, "MAX_K", 4)  # m = 10: blocks of 4, 4, 2 (the other tests: one block)
    leaves, kw = _keyword_case(case, fused, 11, seed=3)
    if not rotary:  # positions enter through RoPE only: the op refuses an offset without it
        kw.pop("offset", None)
    got = _loss_parts(fla_path.fla_rotary_linear_attention(*leaves[:3], rotary=rotary, **kw))
    want = _loss_parts(reference(*leaves[:3], rotary=rotary, **kw))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    g = torch.Generator().manual_seed(1)
    ups = [torch.randn(t.shape, generator=g, **F64) for t in got]
    for a, b in zip(torch.autograd.grad(got, leaves, ups), torch.autograd.grad(want, leaves, ups)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_state_chains_across_calls(standin):
    """Two calls chained through the final state give one call's output (the state maps both ways)."""
    leaves, kw = _keyword_case("none", True, 12, seed=5)
    q, k, v = (t.detach() for t in leaves[:3])
    whole = reference(q, k, v, **kw)
    o1, st = fla_path.fla_rotary_linear_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], output_final_state=True, **kw)
    o2 = fla_path.fla_rotary_linear_attention(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], offset=5, initial_state=st, **kw)
    torch.testing.assert_close(torch.cat([o1, o2], dim=2), whole, rtol=1e-10, atol=1e-12)
    assert isinstance(st, LinearAttentionState)


def test_half_inputs_are_close(standin):
    """bfloat16 inputs: fla gets bf16 features (its kernels' operands); the result is v's dtype and
    within 2e-2 of the float64 reference (bf16 rounds the rotated features and the numerator)."""
    leaves, kw = _keyword_case("mask+state", True, 9, seed=7)
    x = [t.detach() for t in leaves]
    st = LinearAttentionState(x[3], x[4])
    kw = dict(kw, initial_state=st)
    got, gst = fla_path.fla_rotary_linear_attention(*(t.bfloat16() for t in x[:3]), **kw)
    want, wst = reference(*x[:3], **kw)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gst.z.double(), wst.z, rtol=2e-2, atol=2e-2)


def test_half_odd_widths_are_padded(standin, monkeypatch):
    """float16, Eq. 18 with m = 7 and e = 5: fla's 16-bit kernels get even K and V (a zero feature,
    a zero value column), which change nothing; blocks of 4 and 3."""
    monkeypatch.setattr(fla_path, "MAX_K", 4)
    seen = []
    monkeypatch.setattr(fla_path, "_kernel", lambda: lambda q, k, v, **kw: (
        seen.append((q.shape[-1], v.shape[-1], q.dtype)), standin_chunk_linear_attn(q, k, v, **kw))[1])
    g = torch.Generator().manual_seed(4)
    q, k = (torch.rand(2, 3, 9, 7, generator=g, **F64) + 0.01 for _ in range(2))
    v = torch.randn(2, 3, 9, 5, generator=g, **F64)
    got = fla_path.fla_rotary_linear_attention(q.half(), k.half(), v.half(), rotary=False)
    assert got.dtype == torch.float16 and all(K % 2 == 0 and V % 2 == 0 and dt == torch.float16 for K, V, dt in seen)
    torch.testing.assert_close(got.double(), reference(q, k, v, rotary=False), rtol=1e-2, atol=1e-2)


def test_env_variable_forces_fla(monkeypatch):
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", "fla")
    q, k, v = (torch.rand(1, 2, 5, 4) for _ in range(3))
    with pytest.raises(ValueError, match="backend 'fla' was forced, but tensors on cpu"):
        rotary_linear_attention(q, k, v)


def test_feature_blocks():
    assert fla_path.feature_blocks(266) == [(0, 134), (134, 266)]
    assert fla_path.feature_blocks(256) == [(0, 256)]
    assert fla_path.feature_blocks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert fla_path.feature_blocks(7, 4) == [(0, 4), (4, 7)]


def test_forced_fla_refuses_what_it_cannot_take():
    assert "fla" in BACKENDS
    q, k, v = (torch.rand(1, 2, 5, 4) for _ in range(3))
    with use_backend("fla"), pytest.raises(ValueError, match="backend 'fla' was forced, but .*needs CUDA"):
        rotary_linear_attention(q, k, v)


def test_forced_fla_routes_the_public_op(standin, monkeypatch):
    """With the CUDA check and the kernel replaced, the public op under ``use_backend("fla")``
    takes this path (record_paths names it) and gives the reference; ``auto`` never picks it."""
    monkeypatch.setattr(fla_path, "_on_cuda", lambda t: True)
    monkeypatch.setattr(fla_path, "fla_available", lambda: True)
    monkeypatch.setattr(fla_path, "GPU_DTYPES", fla_path.GPU_DTYPES + (torch.float64,))  # the stand-in's dtype
    calls = []
    monkeypatch.setattr(fla_path, "_kernel", lambda: (calls.append(1), standin_chunk_linear_attn)[1])
    leaves, kw = _keyword_case("mask", False, 6, seed=2)
    q, k, v = (t.detach() for t in leaves[:3])
    with use_backend("fla"), record_paths() as paths:
        out = rotary_linear_attention(q, k, v, **kw)
    assert calls and paths and paths[0].startswith("fla path")
    torch.testing.assert_close(out, reference(q, k, v, **kw), rtol=1e-10, atol=1e-12)
    calls.clear()
    with record_paths() as paths:
        rotary_linear_attention(q, k, v, **kw)
    assert not calls and paths[0].startswith("torch path")
    with use_backend("fla"), pytest.raises(ValueError, match="backend 'fla' was forced, but .*causal"):
        rotary_linear_attention(q, k, v, causal=False, **kw)
