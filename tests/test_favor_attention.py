import pytest
import torch

from linear_rope import FavorFeatures, rotary_linear_attention
from linear_rope import naive_rotary_linear_attention as linear_attention_ref
from helpers import bf16_bound
from linear_rope.reference import favor_features_ref


def favor_rotary_attention(q, k, v, w, **kw):
    return rotary_linear_attention(q, k, v, projection=w, **kw)

F64 = dict(dtype=torch.float64)


def inputs(B, H, N, d, e, m, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k = (scale * torch.randn(B, H, N, d, generator=g, **F64) for _ in range(2))
    v = torch.randn(B, H, N, e, generator=g, **F64)
    torch.manual_seed(seed)
    w = FavorFeatures(d, m).projection.double()
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), w


def reference(q, k, v, w, rotary, offset):
    pos = dict(offset=offset) if rotary else {}  # no positions without RoPE (the op refuses an offset there)
    return linear_attention_ref(favor_features_ref(q, w), favor_features_ref(k, w), v, rotary=rotary, **pos)


def check(out, ref, inputs_, rtol=1e-9):
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), **F64)
    for g, gr in zip(torch.autograd.grad(out, inputs_, up), torch.autograd.grad(ref, inputs_, up)):
        torch.testing.assert_close(g, gr, rtol=rtol, atol=1e-11)


# m = 266 (the paper's size) runs at N <= 64 only, which keeps the suite fast; longer sequences
# run at m = 8 and 10 here and at m = 40 in test_block_and_chunk_sizes.
SHAPES = [pytest.param(N, m, d, e, id=f"{N}-m{m}") for N in (1, 2, 63, 64, 257)
          for m, d, e in ((8, 4, 3), (10, 6, 5), (266, 64, 64)) if m != 266 or N <= 64]


@pytest.mark.parametrize("offset", [0, 1000])
@pytest.mark.parametrize("rotary", [True, False], ids=["rope", "norope"])
@pytest.mark.parametrize("N, m, d, e", SHAPES)
def test_fused_matches_reference(N, m, d, e, rotary, offset):
    q, k, v, w = inputs(2, 2, N, d, e, m, seed=N + m)
    out = favor_rotary_attention(q, k, v, w, rotary=rotary, chunk_size=16, block_size=48,
                                 **(dict(offset=offset) if rotary else {}))
    check(out, reference(q, k, v, w, rotary, offset), (q, k, v))


@pytest.mark.parametrize("chunk, block", [(1, 1), (7, 7), (8, 24), (64, 256), (64, 1000), (300, 300)])
def test_block_and_chunk_sizes(chunk, block):
    q, k, v, w = inputs(1, 3, 150, 16, 8, 40)
    out = favor_rotary_attention(q, k, v, w, chunk_size=chunk, block_size=block)
    check(out, reference(q, k, v, w, True, 0), (q, k, v))


def test_fused_equals_two_step_path():
    q, k, v, w = inputs(2, 2, 100, 8, 5, 12)
    f = FavorFeatures(8, 12).double()
    f.projection.copy_(w)
    two = rotary_linear_attention(f(q, is_query=True), f(k, is_query=False), v)
    torch.testing.assert_close(favor_rotary_attention(q, k, v, w), two, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("t", [0, 63, 64, 200])
def test_fused_is_strictly_causal(t):
    q, k, v, w = (x.detach() if x.requires_grad else x for x in inputs(1, 2, 300, 8, 4, 10, scale=2.0))
    out = favor_rotary_attention(q, k, v, w, chunk_size=64, block_size=128)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, :, t + 1:] = 30 * torch.randn_like(x[:, :, t + 1:])
    out2 = favor_rotary_attention(q2, k2, v2, w, chunk_size=64, block_size=128)
    assert (out[:, :, : t + 1] - out2[:, :, : t + 1]).abs().max().item() <= 1e-12
    later = (out[:, :, t + 1:] - out2[:, :, t + 1:]).abs().amax(-1)
    assert (later > 1e-3).all()  # and every later output moves


def test_large_inputs_stay_finite():
    """|q|, |k| near 6 sqrt(d): float32 features near their floor; outputs and gradients stay
    finite and close to the float64 reference."""
    q, k, v, w = inputs(1, 2, 200, 16, 8, 32, scale=6.0)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = favor_rotary_attention(qf, kf, vf, w.float())
    ref = reference(q, k, v, w, True, 0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), **F64)
    got = torch.autograd.grad(out, (qf, kf, vf), up.float())
    want = torch.autograd.grad(ref, (q, k, v), up)
    for g, r in zip(got, want):
        assert torch.isfinite(g).all() and g.abs().max() > 0
        torch.testing.assert_close(g.double(), r, rtol=1e-2, atol=1e-2 * r.abs().max().item())


def test_bf16_error_does_not_grow_along_the_sequence():
    """bf16 in, bf16 out, float32 sums inside: within bf16 rounding of float64 at every position."""
    q, k, v, w = (x.detach() for x in inputs(1, 2, 4096, 16, 8, 32, scale=0.5))
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref = reference(qb.double(), kb.double(), vb.double(), w, True, 0)
    bf16_bound(favor_rotary_attention(qb, kb, vb, w.float()), ref)


def test_bad_input():
    q, k, v, w = (x.detach() for x in inputs(1, 1, 5, 4, 3, 8))
    with pytest.raises(ValueError, match="projection"):
        favor_rotary_attention(q, k, v, w[:, :3])
    with pytest.raises(ValueError, match="even"):
        favor_rotary_attention(q, k, v, w[:7])
    with pytest.raises(ValueError, match="offset"):
        favor_rotary_attention(q, k, v, w, offset=-2)
    with pytest.raises(ValueError, match="projection has 0 rows"):
        favor_rotary_attention(q, k, v, w[:0])
    favor_rotary_attention(q, k, v, w[:7], rotary=False)  # odd m is fine without RoPE
