"""chunk_rotary_linear_attn (fla's `[B, T, H, .]` layout and signature) against the `[B, H, N, d]`
op it wraps and the naive O(N^2) reference, in float64, for every keyword: outputs, states and
gradients (q, k, v and the initial state, under a random upstream gradient)."""
import pytest
import torch

import linear_rope
from linear_rope import (
    FavorFeatures,
    LinearAttentionState,
    chunk_rotary_linear_attn,
    naive_rotary_linear_attention as naive,
    rotary_linear_attention as op,
)

F64 = dict(dtype=torch.float64)
H, D, M, E, T = 2, 6, 10, 5, 37
INPUTS = [pytest.param(False, id="features"), pytest.param(True, id="favor")]
ROT = [pytest.param(True, id="rope"), pytest.param(False, id="norope")]
CU = [0, 11, 12, 37]  # a one-token document in the middle


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one thread for small sizes


def make(B, favor, seed=0):
    """q, k, v in fla's layout `[B, T, H, .]` (leaf tensors) and the projection (favor) or None."""
    g = torch.Generator().manual_seed(seed)
    if favor:
        q, k = (torch.randn(B, T, H, D, generator=g, **F64) for _ in range(2))
        torch.manual_seed(seed)
        w = FavorFeatures(D, M).projection.double()
    else:
        q, k = (torch.rand(B, T, H, M, generator=g, **F64) + 0.01 for _ in range(2))
        w = None
    v = torch.randn(B, T, H, E, generator=g, **F64)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), w


def state(rows, seed=3):
    g = torch.Generator().manual_seed(seed)
    S0 = torch.randn(rows, H, M, E, generator=g, **F64).requires_grad_()
    z0 = (torch.rand(rows, H, M, generator=g, **F64) + 0.1).requires_grad_()
    return S0, z0


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def left_and_right_padding():
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, :9] = False  # left padding
    mask[0, -4:] = False  # right padding
    return mask


# name -> (B, keywords; "state" stands for an initial state of that many rows)
CASES = {
    "plain": (2, {}),
    "offset": (2, dict(offset=5)),
    "offset_per_row": (2, dict(offset=torch.tensor([3, 0]))),
    "mask": (2, dict(mask=left_and_right_padding())),
    "cu_seqlens": (1, dict(cu_seqlens=torch.tensor(CU, dtype=torch.int32))),
    "cu_seqlens_int64_offsets": (1, dict(cu_seqlens=torch.tensor(CU), offset=torch.tensor([0, 4, 9]))),
    "final_state": (2, dict(output_final_state=True)),
    "initial_state": (2, dict(initial_state=2, output_final_state=True)),
    "documents_states": (1, dict(cu_seqlens=torch.tensor(CU, dtype=torch.int32), initial_state=3,
                                 output_final_state=True)),
    "mask_offsets_state": (2, dict(mask=left_and_right_padding(), offset=torch.tensor([7, 2]), initial_state=2,
                                   output_final_state=True)),
}


# Eq. 19 with every keyword; Eq. 18 (rotary=False, a flag passed through) with the plainest and the fullest
GRID = [(c, True) for c in CASES] + [("plain", False), ("mask_offsets_state", False)]


@pytest.mark.parametrize("case, rotary", [pytest.param(c, r, id=f"{c}-{'rope' if r else 'norope'}") for c, r in GRID])
@pytest.mark.parametrize("favor", INPUTS)
def test_every_keyword_equals_the_heads_first_op(favor, case, rotary):
    B, kw = CASES[case]
    kw = dict(kw)
    if not rotary:  # positions enter through RoPE only: the op refuses an offset without it
        kw.pop("offset", None)
    q, k, v, w = make(B, favor, seed=len(case))
    leaves = [q, k, v]
    if "initial_state" in kw:
        S0, z0 = state(kw["initial_state"])
        kw["initial_state"] = LinearAttentionState(S0, z0)
        leaves += [S0, z0]
    scale = None if favor else 0.5  # on features any scale cancels in Eq. 19: the op's q, exactly
    o, st = chunk_rotary_linear_attn(q, k, v, scale, projection=w, rotary=rotary, **kw)
    assert o.shape == (B, T, H, E) and o.dtype == v.dtype
    assert (st is None) == (not kw.get("output_final_state", False))
    heads = [t.transpose(1, 2) for t in (q, k, v)]
    res = op(*heads, projection=w, rotary=rotary, **kw)
    ref = naive(*heads, projection=w, rotary=rotary, **kw)
    res, ref = ((r, ) if isinstance(r, torch.Tensor) else (r[0], *r[1]) for r in (res, ref))
    got = (o, *(st or ()))
    want = (res[0].transpose(1, 2), *res[1:])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)  # the same op on views: bit for bit
    for a, b in zip(got, (ref[0].transpose(1, 2), *ref[1:]), strict=True):
        close(a, b)
    g = torch.Generator().manual_seed(11)
    ups = [torch.randn(t.shape, generator=g, **F64) for t in got]
    grads = torch.autograd.grad(got, leaves, ups)
    refs = torch.autograd.grad((ref[0].transpose(1, 2), *ref[1:]), leaves, ups)
    for a, b in zip(grads, refs):
        assert a.shape == b.shape
        close(a, b, 1e-9)


@pytest.mark.parametrize("rotary", ROT)
def test_scale_on_features_is_fla_s_and_cancels(rotary):
    """fla multiplies q by ``scale`` (default 1/sqrt(K)) in the numerator and the normaliser:
    the result is the op's on ``q * scale`` (to rounding), which is the op's on q, state included."""
    q, k, v, _ = make(2, False, seed=5)
    heads = [t.transpose(1, 2) for t in (q, k, v)]
    plain, (S, z) = op(*heads, rotary=rotary, output_final_state=True)
    for scale in (None, 1.0, 0.125, 3.0):
        o, st = chunk_rotary_linear_attn(q, k, v, scale, rotary=rotary, output_final_state=True)
        assert torch.equal(o, plain.transpose(1, 2)) and torch.equal(st.S, S) and torch.equal(st.z, z)
        factor = M ** -0.5 if scale is None else scale
        scaled = op(heads[0] * factor, *heads[1:], rotary=rotary).transpose(1, 2)
        close(o, scaled, 1e-12)


def test_scale_with_favor_is_the_softmax_temperature():
    """With FAVOR+ inside, the kernel is exp(scale * q.k): the default 1/sqrt(d) is what FAVOR+
    holds already (q untouched), and another scale multiplies q by scale * sqrt(d)."""
    q, k, v, w = make(2, True, seed=6)
    heads = [t.transpose(1, 2) for t in (q, k, v)]
    default = op(*heads, projection=w).transpose(1, 2)
    for scale in (None, D ** -0.5):
        assert torch.equal(chunk_rotary_linear_attn(q, k, v, scale, projection=w)[0], default)
    o, _ = chunk_rotary_linear_attn(q, k, v, 0.25, projection=w)
    want = op(heads[0] * (0.25 * D ** 0.5), *heads[1:], projection=w).transpose(1, 2)
    close(o, want, 1e-12)
    assert not torch.allclose(o, default)


def test_state_chains_and_decodes_like_the_op():
    """Two chained calls equal one (the second at offset = tokens so far), and the final state
    feeds the `[B, H, .]` decoding step."""
    q, k, v, w = make(2, True, seed=8)
    one, _ = chunk_rotary_linear_attn(q, k, v, projection=w)
    a, st = chunk_rotary_linear_attn(q[:, :20], k[:, :20], v[:, :20], projection=w, output_final_state=True)
    b, _ = chunk_rotary_linear_attn(q[:, 20:], k[:, 20:], v[:, 20:], initial_state=st, projection=w, offset=20)
    close(torch.cat((a, b), 1), one)
    _, st = chunk_rotary_linear_attn(q[:, :-1], k[:, :-1], v[:, :-1], projection=w, output_final_state=True)
    last, _ = linear_rope.rotary_linear_attention_step(q[:, -1], k[:, -1], v[:, -1], st, T - 1, projection=w)
    close(last, one[:, -1])


def test_exported_from_the_package_and_the_ops():
    assert linear_rope.chunk_rotary_linear_attn is linear_rope.ops.chunk_rotary_linear_attn
    assert "chunk_rotary_linear_attn" in linear_rope.__all__ and "chunk_rotary_linear_attn" in linear_rope.ops.__all__


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.rand(2, T, M)), r"q must be a tensor \[B, T, H, \.\]"),
    (dict(v="values"), r"v must be a tensor \[B, T, H, \.\]"),
    (dict(scale=0.0), "scale must be a positive finite number"),
    (dict(scale=float("nan")), "scale must be a positive finite number"),
    (dict(scale=True), "scale must be a positive finite number"),
    (dict(mask=torch.ones(2, T + 1, dtype=torch.bool)), r"mask must have shape \[2, 37\]"),
    (dict(cu_seqlens=torch.tensor([0, 37], dtype=torch.int32)), "cu_seqlens: packed documents go in one row"),
])
def test_bad_arguments_are_one_line_errors(bad, match):
    q, k, v, _ = make(2, False)
    kw = {**dict(q=q, k=k, v=v), **bad}
    with pytest.raises(ValueError, match=match):
        chunk_rotary_linear_attn(**kw)


def test_heads_first_input_warns_and_the_docstring_names_the_layout():
    """[B, H, T, d] has the rank of fla's [B, T, H, d]: where the sequence axis is shorter than
    the head axis (1 < T < H), as heads-first input usually shows, the call warns, as fla's
    ops do. One token (decoding) or T >= H is quiet."""
    import warnings

    assert "`[B, T, H, d]`" in chunk_rotary_linear_attn.__doc__.splitlines()[0]
    g = torch.Generator().manual_seed(0)
    heads_first = [torch.rand(1, 2, 5, M, generator=g, **F64) + 0.01 for _ in range(3)]  # [B, H=2, T=5, .]
    with pytest.warns(UserWarning, match=r"2 tokens and 5 heads \(T < H\).*heads-first"):
        chunk_rotary_linear_attn(*heads_first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunk_rotary_linear_attn(*(t.transpose(1, 2) for t in heads_first))  # the same tensors in fla's layout
        for shape in ((1, 1, 8, M), (1, 8, 8, M), (2, T, H, M)):  # decoding one token; T = H; T > H
            chunk_rotary_linear_attn(*(torch.rand(*shape, generator=g, **F64) + 0.01 for _ in range(3)))
