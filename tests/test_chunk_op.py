"""The causal op as a custom op (``linear_rope.ops.chunk_op``): opcheck, one graph under
torch.compile, compiled equals eager, no recompilation per sequence length; and the three paths
(chunk, recurrent, naive) with one signature and one result."""
import shutil

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from linear_rope import FavorFeatures, LinearAttentionState, RotaryLinearAttention
from linear_rope.model import PerformerLM
from linear_rope.ops import naive_rotary_linear_attention, recurrent_rotary_linear_attention, rotary_linear_attention
from linear_rope.ops.chunk_op import chunk_causal
from linear_rope.ops.layout import OpConfig

F64 = dict(dtype=torch.float64)


def _op_args(fused, rotary, case, N=37, seed=0):
    """Arguments of ``chunk_causal`` as ``rotary_linear_attention`` builds them (B*H = 2*2, m = 6)."""
    g = torch.Generator().manual_seed(seed)
    B, H, m, e = (1 if case == "cu" else 2), 2, 6, 3
    x = 4 if fused else m
    q, k = (torch.rand(B, H, N, x, generator=g, **F64) + 0.1 for _ in range(2))
    v = torch.randn(B, H, N, e, generator=g, **F64)
    rows = 3 if case == "cu" else B
    S0, z0 = torch.randn(rows, H, m, e, generator=g, **F64), torch.rand(rows, H, m, generator=g, **F64) + 0.5
    none = torch.empty(0, **F64)
    w = FavorFeatures(4, m).projection.double() if fused else none
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[0, :5] = False
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0) + 7 if rotary else none
    cu = (0, 10, 11, N) if case == "cu" else ()
    aux = [mask if case == "mask" else none, w, positions if case == "mask" else none]
    cfg = OpConfig(8, 16, 7, rotary, cu, 10000.0)
    return [q, k, v, [S0, z0], aux, cfg.to_list(), 10000.0]


@pytest.mark.parametrize("case", ["plain", "mask", "cu"])
@pytest.mark.parametrize("rotary", [True, False], ids=["rope", "norope"])
@pytest.mark.parametrize("fused", [True, False], ids=["projection", "features"])
def test_opcheck(fused, rotary, case):
    """Schema, fake implementation, autograd registration and AOT dispatch (static and dynamic)."""
    args = _op_args(fused, rotary, case)
    for t in args[:3] + args[3]:
        t.requires_grad_()
    torch.library.opcheck(chunk_causal, args)


def _explain(mod, *inputs):
    ex = torch._dynamo.explain(mod)(*inputs)
    return ex.graph_count, ex.graph_break_count, [str(b.reason) for b in ex.break_reasons]


def test_one_graph_no_breaks():
    torch.manual_seed(0)
    layer = RotaryLinearAttention(32, heads=2, dim_head=16)
    assert _explain(layer, torch.randn(2, 100, 32)) == (1, 0, [])
    lm = PerformerLM(dim=32, depth=2, heads=2, dim_head=16, seq_len=512)
    assert _explain(lm, torch.randint(0, 256, (2, 100))) == (1, 0, [])


def _grads_after(mod, inp, y_of, seed):
    mod.zero_grad(set_to_none=True)
    y = y_of(inp)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)))
    return [y.detach()] + [p.grad.clone() for p in mod.parameters() if p.grad is not None]


@pytest.mark.parametrize("which", ["layer", "lm"])
def test_compiled_equals_eager_and_lengths_do_not_recompile(which):
    """fullgraph=True; outputs and gradients equal eager; 6 lengths from 256 to 4096 compile at
    most twice (the first length, then one dynamic graph). aot_eager traces what Inductor would
    get (the fake implementation and the registered backward) without a C++ compiler."""
    torch.manual_seed(0)
    if which == "layer":
        mod, make = RotaryLinearAttention(16, heads=2, dim_head=8, nb_features=12), lambda n: torch.randn(1, n, 16)
    else:
        mod = PerformerLM(dim=16, depth=1, heads=2, dim_head=8, nb_features=12, seq_len=4096)
        make = lambda n: torch.randint(0, 256, (1, n))  # noqa: E731
    cnt = CompileCounterWithBackend("aot_eager")
    comp = torch.compile(mod, fullgraph=True, backend=cnt)
    for n in (256, 300, 511, 1024, 2047, 4096):
        x = make(n)
        want = _grads_after(mod, x, mod, n)
        got = _grads_after(mod, x, comp, n)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert cnt.frame_count <= 2


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="Inductor on CPU needs a C++ compiler")
def test_inductor_equals_eager():
    """The real backend: Inductor compiles the rest of the layer around the op (float32, 1e-5)."""
    torch.manual_seed(0)
    layer = RotaryLinearAttention(16, heads=2, dim_head=8, nb_features=12)
    comp = torch.compile(layer, fullgraph=True)
    for n in (100, 257):
        x = torch.randn(2, n, 16)
        want = _grads_after(layer, x, layer, n)
        got = _grads_after(layer, x, comp, n)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _keyword_inputs(case, fused, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = 1 if case == "cu" else 2
    H, m, e = 2, 6, 3
    if fused:
        q, k = (torch.randn(B, H, N, 4, generator=g, **F64) for _ in range(2))
        torch.manual_seed(seed)
        w = FavorFeatures(4, m).projection.double()
    else:
        q, k = (torch.rand(B, H, N, m, generator=g, **F64) + 0.01 for _ in range(2))
        w = None
    v = torch.randn(B, H, N, e, generator=g, **F64)
    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_()]
    kw = dict(projection=w, output_final_state=True)
    if case == "mask":
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[0, : N // 4] = False
        mask[1, N - N // 3 :] = False
        kw["mask"] = mask
    if case == "cu":
        kw["cu_seqlens"] = torch.tensor([0, N // 3, N // 3 + 1, N], dtype=torch.int32)
        kw["offset"] = torch.tensor([3, 0, 40])
    if case == "state":
        S0 = torch.randn(B, H, m, e, generator=g, **F64).requires_grad_()
        z0 = (torch.rand(B, H, m, generator=g, **F64) + 0.5).requires_grad_()
        kw["initial_state"] = LinearAttentionState(S0, z0)
        kw["offset"] = torch.tensor([5, 900])
        leaves += [S0, z0]
    return leaves, kw


@pytest.mark.parametrize("path", [rotary_linear_attention, recurrent_rotary_linear_attention],
                         ids=["chunk", "recurrent"])
@pytest.mark.parametrize("case", ["plain", "mask", "cu", "state"])
@pytest.mark.parametrize("fused", [True, False], ids=["projection", "features"])
@pytest.mark.parametrize("N", [pytest.param(n, id=f"N{n}") for n in (5, 33)])
def test_paths_share_signature_and_result(path, case, fused, N):
    """chunk and recurrent against naive: the same call, the same (out, state), the same
    gradients (float64)."""
    leaves, kw = _keyword_inputs(case, fused, N, seed=N)
    got = path(*leaves[:3], **kw)
    want = naive_rotary_linear_attention(*leaves[:3], **kw)
    assert type(got) is type(want) and type(got[1]) is LinearAttentionState
    got, want = [got[0], *got[1]], [want[0], *want[1]]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    ups = [torch.randn(t.shape, generator=torch.Generator().manual_seed(1), **F64) for t in got]
    for a, b in zip(torch.autograd.grad(got, leaves, ups), torch.autograd.grad(want, leaves, ups)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_recurrent_path_is_causal_only():
    q = torch.rand(1, 1, 4, 6)
    with pytest.raises(ValueError, match="causal"):
        recurrent_rotary_linear_attention(q, q, q, causal=False, rotary=False)
