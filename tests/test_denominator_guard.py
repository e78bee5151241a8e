"""A denominator that is 0 for a real query: relu features whose supports do not overlap.

The naive reference divides by 1 there and passes no gradient to the denominator; the fast
path and the one-token step must do the same (they used to divide by the smallest float and
return NaN gradients). With rotation the numerator can be non-zero while the denominator is 0.
"""
import pytest
import torch

from linear_rope.ops import naive_rotary_linear_attention, rotary_linear_attention, rotary_linear_attention_step

F64 = dict(dtype=torch.float64)


def disjoint_features(N=70, m=8):
    torch.manual_seed(0)
    q, k = torch.rand(2, 2, N, m, **F64), torch.rand(2, 2, N, m, **F64)
    q[:, :, :6] = 0
    q[:, :, :6, 0] = 1.0 + torch.rand(2, 2, 6, **F64)  # queries 0..5 on feature 0 only
    k[:, :, :6] = 0
    k[:, :, :6, 1] = 1.0 + torch.rand(2, 2, 6, **F64)  # keys 0..5 on feature 1 only
    return q, k


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("rotary", [True, False], ids=["rope", "norope"])
def test_zero_denominator_rows_match_naive_with_gradients(rotary, causal):
    q, k = disjoint_features()
    v = torch.randn(2, 2, 70, 5, **F64)
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    up = torch.randn(2, 2, 70, 5, **F64)
    if not causal:  # every key sees query 0 only on feature 1's support: its row's den is 0
        args[1].data[:, :, :, 0] = 0
    pos = dict(offset=3) if rotary else {}
    fast = rotary_linear_attention(*args, causal=causal, rotary=rotary, **pos)
    ref = naive_rotary_linear_attention(*args, causal=causal, rotary=rotary, **pos)
    if rotary and causal:  # features 0 and 1 form one rotated pair: the numerator is not 0
        assert ref[:, :, 1:6].abs().max() > 0.1
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    g_fast, g_ref = torch.autograd.grad(fast, args, up), torch.autograd.grad(ref, args, up)
    for a, b in zip(g_fast, g_ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_zero_denominator_step_matches_naive():
    q, k = disjoint_features(N=10)
    v = torch.randn(2, 2, 10, 5, **F64)
    ref = naive_rotary_linear_attention(q, k, v, causal=True, rotary=True)
    state, outs = None, []
    for t in range(10):
        o, state = rotary_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, t, rotary=True)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 2), ref, rtol=1e-10, atol=1e-12)
