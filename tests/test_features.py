import math

import pytest
import torch

from linear_rope import FavorFeatures, apply_rotary, rotary_linear_attention
from linear_rope.features import default_nb_features
from linear_rope import naive_rotary_linear_attention as linear_attention_ref
from linear_rope.reference import favor_features_ref, softmax_attention_ref

F64 = dict(dtype=torch.float64)


@pytest.mark.parametrize("d, m", [(64, 266), (16, 44), (10, 24), (32, 110)])
def test_default_nb_features(d, m):
    assert default_nb_features(d) == m
    assert FavorFeatures(d).out_features == m


@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0, 100.0])
def test_features_bounded_and_finite(scale):
    torch.manual_seed(0)
    f = FavorFeatures(64)
    x = torch.randn(2, 3, 100, 64) * scale
    for is_query in (True, False):
        phi = f(x, is_query=is_query)
        assert phi.dtype == torch.float32 and phi.shape == (2, 3, 100, 266)
        assert torch.isfinite(phi).all() and (phi >= 0).all() and (phi <= 1).all()
    assert (f(x, is_query=True).amax(-1) == 1).all()  # the per-token max is the query shift


def test_stabilised_weights_equal_reference_up_to_a_per_query_factor():
    # Eq. 19's numerator and denominator weights from the stabilised features equal the
    # unstabilised reference weights times c(q_m) > 0, one factor per query for *both*.
    torch.manual_seed(1)
    f = FavorFeatures(16).double()
    q, k = torch.randn(1, 1, 30, 16, **F64), torch.randn(1, 1, 30, 16, **F64)
    fq, fk = f(q, is_query=True), f(k, is_query=False)
    rq, rk = favor_features_ref(q, f.projection), favor_features_ref(k, f.projection)
    for rot in (False, True):
        a = (apply_rotary(fq) if rot else fq) @ (apply_rotary(fk) if rot else fk).transpose(-1, -2)
        b = (apply_rotary(rq) if rot else rq) @ (apply_rotary(rk) if rot else rk).transpose(-1, -2)
        ratio = (a / b)[0, 0]
        if not rot:
            c = ratio[:, :1]
        torch.testing.assert_close(ratio, c.expand_as(ratio), rtol=1e-9, atol=0)
    # and so the attention outputs agree exactly
    v = torch.randn(1, 1, 30, 5, **F64)
    torch.testing.assert_close(rotary_linear_attention(fq, fk, v), linear_attention_ref(rq, rk, v), rtol=1e-10, atol=1e-12)


def test_favor_is_unbiased_for_the_softmax_kernel():
    d, m, draws = 16, 160, 300  # 48,000 rows in blocks of 16
    g = torch.Generator().manual_seed(2)
    # moderate: |q'| = |k'| = 0.6 after the d^(-1/4) scaling (the estimator's variance grows
    # like exp(|q' + k'|^2), so large norms need far more draws than a test can afford)
    unit = lambda t: t / t.norm(dim=-1, keepdim=True)
    q = 0.6 * d**0.25 * unit(torch.randn(8, d, generator=g, **F64))
    k = 0.6 * d**0.25 * unit(torch.randn(8, d, generator=g, **F64))
    exact = torch.exp((q * k).sum(-1) / math.sqrt(d))
    f = FavorFeatures(d, m).double()
    est = torch.zeros(8, **F64)
    gen = torch.Generator().manual_seed(3)
    for _ in range(draws):
        f.redraw(gen)
        est += (favor_features_ref(q, f.projection) * favor_features_ref(k, f.projection)).sum(-1)
    rel = ((est / draws) / exact - 1).abs().max().item()
    assert rel < 0.03, rel


def _approx_errors(q, k, v, f):
    from performer_pytorch.performer_pytorch import FastAttention

    exact = softmax_attention_ref(q.double(), k.double(), v.double(), causal=True)
    ours = rotary_linear_attention(f(q, is_query=True), f(k, is_query=False), v, rotary=False)
    theirs_mod = FastAttention(q.shape[-1], f.out_features, causal=True)
    theirs_mod.projection_matrix.copy_(f.projection)
    err = lambda out: ((out.double() - exact).norm() / exact.norm()).item()
    return err(ours), err(theirs_mod(q, k, v))


def test_attention_error_no_worse_than_performer_fast_attention():
    # Attention that has to *select*: each query is a scaled copy of an earlier key plus noise.
    # performer-pytorch's eps = 1e-4 swamps the key features and flattens the weights; ours
    # keeps the peak. (With flat unit-variance inputs, exact attention is itself near-uniform:
    # there performer-pytorch's flattened output happens to be closer; see README.)
    g = torch.Generator().manual_seed(4)
    N, d, m = 256, 64, 266
    f = FavorFeatures(d, m)
    f.redraw(g)
    results = []
    for scale, sharp in ((0.5, 2.0), (0.7, 1.5), (0.35, 3.0)):
        k = scale * torch.randn(1, 4, N, d, generator=g)
        src = (torch.rand(N, generator=g) * torch.arange(1, N + 1)).long()  # an earlier key
        q = sharp * k[:, :, src] + 0.3 * scale * torch.randn(1, 4, N, d, generator=g)
        v = torch.randn(1, 4, N, d, generator=g)
        results.append(_approx_errors(q, k, v, f))
    for (ours, theirs), cfg in zip(results, ("0.5/2", "0.7/1.5", "0.35/3")):
        print(f"[{cfg}] relative error vs exact softmax: ours {ours:.4f}, performer-pytorch {theirs:.4f}")
    assert all(ours <= theirs for ours, theirs in results), results


def test_attention_error_matches_performer_for_small_inputs():
    g = torch.Generator().manual_seed(8)
    f = FavorFeatures(64, 266)
    f.redraw(g)
    q, k, v = torch.randn(3, 1, 4, 256, 64, generator=g)
    ours, theirs = _approx_errors(0.25 * q, 0.25 * k, v, f)
    print(f"[flat 0.25] relative error vs exact softmax: ours {ours:.4f}, performer-pytorch {theirs:.4f}")
    assert ours < 0.1 and abs(ours - theirs) < 0.05 * theirs


def test_redraw_is_reproducible_and_leaves_global_rng_alone():
    f = FavorFeatures(16, 20)
    before = torch.get_rng_state()
    f.redraw(torch.Generator().manual_seed(5))
    a = f.projection.clone()
    assert torch.equal(torch.get_rng_state(), before)
    f.redraw(torch.Generator().manual_seed(5))
    assert torch.equal(f.projection, a)
    f.redraw(torch.Generator().manual_seed(6))
    assert not torch.equal(f.projection, a)
    f.redraw()  # global RNG, as performer-pytorch
    assert a.shape == f.projection.shape == (20, 16)


@pytest.mark.parametrize("kind", ["elu", "relu"])
def test_elementwise_maps(kind):
    f = FavorFeatures(8, kind=kind)
    x = torch.randn(2, 5, 8, **F64)
    want = torch.nn.functional.elu(x) + 1 if kind == "elu" else torch.relu(x)
    torch.testing.assert_close(f(x, is_query=True), want)
    assert f.out_features == 8
    f.redraw()  # no-op


@pytest.mark.parametrize("kwargs, match", [
    (dict(dim_head=8, kind="gauss"), "kind"),
    (dict(dim_head=8, nb_features=4, kind="elu"), "nb_features"),
    (dict(dim_head=8, nb_features=0), "nb_features"),
    (dict(dim_head=0), "dim_head"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FavorFeatures(**kwargs)


def test_wrong_input_dim():
    with pytest.raises(ValueError, match="dim_head"):
        FavorFeatures(8)(torch.randn(2, 3, 9), is_query=True)


def test_projection_rows_are_unbiased_gaussian():
    # performer-pytorch's QR without sign correction leans row i towards -e_i; ours must not.
    from linear_rope.features import draw_orthogonal_projection

    g = torch.Generator().manual_seed(9)
    W = torch.cat([draw_orthogonal_projection(64, 8, g).view(8, 8, 8) for _ in range(300)]).double()  # (2400, 8, 8)
    assert W.mean(0).abs().max().item() < 0.1  # std of the mean is 1/sqrt(2400) = 0.02
    # rows within a block are orthogonal
    Q = W[0] / W[0].norm(dim=-1, keepdim=True)
    torch.testing.assert_close(Q @ Q.t(), torch.eye(8, dtype=torch.float64), rtol=0, atol=1e-5)
    # and their norms are chi(d): E|w|^2 = d
    assert abs((W * W).sum(-1).mean().item() - 8) < 0.2


def test_a_non_finite_projection_is_refused_where_it_enters():
    """Drawn or loaded, a projection is checked once, on its way in (not in every forward)."""
    f = FavorFeatures(8, 16)
    sd = f.state_dict()
    sd["projection"] = sd["projection"].clone()
    sd["projection"][3, 1] = float("nan")
    with pytest.raises(ValueError, match="^projection must be finite"):
        f.load_state_dict(sd)
    assert torch.isfinite(f.projection).all()  # left as it was
    from linear_rope.features import check_projection

    with pytest.raises(ValueError, match="^w must be finite"):
        check_projection(torch.tensor([[1.0, float("inf")]]), "w")
    f.redraw(torch.Generator().manual_seed(0))  # a draw passes its own check
    assert torch.isfinite(f.projection).all()
