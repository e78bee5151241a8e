import pytest
import torch

from linear_rope import rotary_linear_attention, rotary_linear_attention_step
from linear_rope import naive_rotary_linear_attention as linear_attention_ref
from helpers import bf16_bound

F64 = dict(dtype=torch.float64)


def make_qkv(B, H, N, m, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, H, N, m, generator=g, dtype=torch.float64) + 0.01
    k = torch.rand(B, H, N, m, generator=g, dtype=torch.float64) + 0.01
    v = torch.randn(B, H, N, d, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    up = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, up)


def step_all(q, k, v, *, rotary, offset):
    state, outs = None, []
    for t in range(q.shape[2]):
        o, state = rotary_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, offset + t, rotary=rotary)
        outs.append(o)
    return torch.stack(outs, dim=2)


def rope_kw(rotary, offset):
    """``offset`` for a rotary call; nothing without RoPE, where the op refuses it (no effect)."""
    return dict(offset=offset) if rotary else {}


SIZES = [pytest.param(n, id=f"N{n}") for n in (1, 2, 63, 64, 257)]
DIMS = [pytest.param(m, d, id=f"m{m}-d{d}") for m, d in ((2, 3), (10, 5), (16, 16))]


@pytest.mark.parametrize("offset", [0, 1000])
@pytest.mark.parametrize("rotary", [True, False], ids=["rope", "norope"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("m, d", DIMS)
@pytest.mark.parametrize("N", SIZES)
def test_chunked_matches_reference(N, m, d, causal, rotary, offset):
    q, k, v = make_qkv(2, 3, N, m, d, seed=N + m)
    pos = rope_kw(rotary, offset)
    out = rotary_linear_attention(q, k, v, causal=causal, rotary=rotary, **pos)
    ref = linear_attention_ref(q, k, v, causal=causal, rotary=rotary, **pos)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, gr in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(g, gr, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("offset", [0, 1000])
@pytest.mark.parametrize("rotary", [True, False], ids=["rope", "norope"])
@pytest.mark.parametrize("m, d", DIMS[1:])
@pytest.mark.parametrize("N", SIZES)
def test_recurrent_matches_reference(N, m, d, rotary, offset):
    q, k, v = make_qkv(2, 2, N, m, d, seed=3 * N + m)
    out = step_all(q, k, v, rotary=rotary, offset=offset)
    ref = linear_attention_ref(q, k, v, causal=True, rotary=rotary, **rope_kw(rotary, offset))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, gr in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(g, gr, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 1000])
def test_chunk_size_does_not_change_result(chunk):
    q, k, v = make_qkv(1, 2, 150, 8, 4)
    want = linear_attention_ref(q, k, v)
    torch.testing.assert_close(rotary_linear_attention(q, k, v, chunk_size=chunk), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rotary", [True, False], ids=["rope", "norope"])
def test_prefill_state_then_steps(rotary):
    q, k, v = make_qkv(2, 2, 40, 10, 6)
    ref = linear_attention_ref(q, k, v, rotary=rotary, **rope_kw(rotary, 5))
    out, state = rotary_linear_attention(q[:, :, :30], k[:, :, :30], v[:, :, :30], rotary=rotary, **rope_kw(rotary, 5),
                                         output_final_state=True)
    outs = [out]
    for t in range(30, 40):
        o, state = rotary_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, 5 + t, rotary=rotary)
        outs.append(o.unsqueeze(2))
    torch.testing.assert_close(torch.cat(outs, dim=2), ref, rtol=1e-10, atol=1e-12)
    assert state.S.shape == (2, 2, 10, 6) and state.z.shape == (2, 2, 10)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_translation_invariance(causal):
    q, k, v = make_qkv(2, 2, 100, 16, 8)
    a = rotary_linear_attention(q, k, v, causal=causal, offset=0)
    b = rotary_linear_attention(q, k, v, causal=causal, offset=1000)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert not torch.allclose(a, rotary_linear_attention(q, k, v, causal=causal, rotary=False), atol=1e-3)


@pytest.mark.parametrize("t", [0, 31, 63, 64, 200])
@pytest.mark.parametrize("rotary", [True, False], ids=["rope", "norope"])
def test_strictly_causal(t, rotary):
    q, k, v = make_qkv(2, 2, 257, 10, 6)
    out = rotary_linear_attention(q, k, v, rotary=rotary)
    q2, k2, v2 = (x.detach().clone() for x in (q, k, v))
    g = torch.Generator().manual_seed(7)
    for x in (q2, k2):
        x[:, :, t + 1:] = torch.rand(x[:, :, t + 1:].shape, generator=g, **F64) * 100
    v2[:, :, t + 1:] = torch.randn(v2[:, :, t + 1:].shape, generator=g, **F64) * 100
    out2 = rotary_linear_attention(q2, k2, v2, rotary=rotary)
    assert (out[:, :, : t + 1] - out2[:, :, : t + 1]).abs().max().item() <= 1e-12
    if t < 256:
        assert (out[:, :, t + 1:] - out2[:, :, t + 1:]).abs().max().item() > 1e-3


def test_bf16_error_does_not_grow_along_the_sequence():
    N = 4096
    q, k, v = (t.detach() for t in make_qkv(1, 2, N, 16, 8))
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    bf16_bound(rotary_linear_attention(qb, kb, vb), linear_attention_ref(qb.double(), kb.double(), vb.double()))


def test_zero_features_give_zero_not_nan():
    q, k, v = make_qkv(1, 1, 10, 4, 3)
    q = q.detach().clone()
    q[:, :, 3] = 0.0
    out = rotary_linear_attention(q, k, v)
    assert torch.isfinite(out).all() and (out[:, :, 3] == 0).all()


def _qkv(N=5, m=4, d=3):
    return [t.detach() for t in make_qkv(2, 2, N, m, d)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(q=_qkv(m=3)[0], k=_qkv(m=3)[1], v=_qkv(m=3)[2]), "even"),
    (dict(q=_qkv()[0], k=_qkv(N=6)[1], v=_qkv(N=6)[2]), "cross-attention"),
    (dict(q=_qkv()[0], k=_qkv()[1], v=_qkv(N=6)[2]), "v must have shape"),
    (dict(q=_qkv()[0][0], k=_qkv()[1][0], v=_qkv()[2][0]), "q must have shape"),
    (dict(q=_qkv()[0], k=_qkv()[1].float(), v=_qkv()[2]), "dtype"),
    (dict(q=_qkv()[0], k=_qkv()[1], v=_qkv()[2], offset=-1), "offset"),
    (dict(q=_qkv()[0], k=_qkv()[1], v=_qkv()[2].long()), "floating"),
], ids=["odd-m", "k-shape", "v-shape", "3d", "dtype", "offset", "int-v"])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rotary_linear_attention(**kwargs)


def test_step_bad_input():
    q, k, v = (t[:, :, 0] for t in _qkv())
    with pytest.raises(ValueError, match="position"):
        rotary_linear_attention_step(q, k, v, None, -3)
    _, state = rotary_linear_attention_step(q, k, v, None, 0)
    q8, k8, v8 = (t[:, :, 0] for t in _qkv(m=8))
    with pytest.raises(ValueError, match="state"):
        rotary_linear_attention_step(q8, k8, v8, state, 1)
    with pytest.raises(ValueError, match="even"):
        rotary_linear_attention_step(q[..., :3], k[..., :3], v, None, 0)


# --- every keyword on the fast path, against the reference (float64, outputs and gradients) ---

import linear_rope.ops.chunk_fwd as chunk_mod  # noqa: E402
from linear_rope import FavorFeatures, LinearAttentionState  # noqa: E402


def _keyword_case(case, fused, N, seed=0):
    """(inputs requiring grad, kwargs) for one keyword case; B*H = 2*3, m = 10 or a d=6 projection."""
    g = torch.Generator().manual_seed(seed)
    B = 1 if case.startswith("cu") else 2
    H, m, e = 3, 10, 5
    if fused:
        q, k = (torch.randn(B, H, N, 6, generator=g, **F64) for _ in range(2))
        torch.manual_seed(seed)
        w = FavorFeatures(6, m).projection.double()
    else:
        q, k = (torch.rand(B, H, N, m, generator=g, **F64) + 0.01 for _ in range(2))
        w = None
    v = torch.randn(B, H, N, e, generator=g, **F64)
    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_()]
    kw = dict(projection=w)
    docs = [N // 3, 1, N - N // 3 - 1] if N >= 3 else [N]
    rows = len(docs) if case.startswith("cu") else B
    if case in ("mask", "mask+state"):
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[0, : N // 4] = False  # left padding
        mask[1, N - N // 3:] = False  # right padding
        mask[1, N // 2] = N < 4  # a hole (kept when the row would be empty)
        kw["mask"] = mask
    if case.startswith("cu"):
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    if "offsets" in case:
        kw["offset"] = torch.tensor([3, 900, 17][:rows])
    if "state" in case:
        S0 = torch.randn(rows, H, m, e, generator=g, **F64).requires_grad_()
        z0 = (torch.rand(rows, H, m, generator=g, **F64) + 0.5).requires_grad_()
        kw["initial_state"] = LinearAttentionState(S0, z0)
        kw["output_final_state"] = True
        leaves += [S0, z0]
    return leaves, kw


def _loss_parts(res):
    """Output and (when returned) final state, as one list of tensors to take gradients through."""
    return [res[0], res[1].S, res[1].z] if isinstance(res, tuple) else [res]


# Per-row offsets meet a state in "offsets+state" and "cu+offsets+state": without a state Eq. 19
# is the same at every offset, so only these see a path that ignores per-row offsets.
KEYWORD_CASES = ["mask", "offsets", "state", "mask+state", "offsets+state", "cu", "cu+offsets", "cu+state",
                 "cu+offsets+state"]


# Packed cases need three documents, so N = 1 runs the unpacked cases only.
SIZE_CASES = [pytest.param(n, c, id=f"N{n}-{c}") for n in (1, 5, 70, 257) for c in KEYWORD_CASES
              if n >= 3 or not c.startswith("cu")]


@pytest.mark.parametrize("keep", [("A", "phq", "phk", "S", "z"), ("A",), ("S", "z"), ()],
                         ids=["all-kept", "A-kept", "states-kept", "recomputed"])
@pytest.mark.parametrize("rotary", [True, False], ids=["rope", "norope"])
@pytest.mark.parametrize("fused", [True, False], ids=["projection", "features"])
@pytest.mark.parametrize("N, case", SIZE_CASES)
def test_keywords_match_reference(N, case, fused, rotary, keep, monkeypatch):
    plan = chunk_mod.keep_plan  # what the forward keeps for the backward; the rest is recomputed
    monkeypatch.setattr(chunk_mod, "keep_plan", lambda *a, **kw: {n: b for n, b in plan(*a, **kw).items() if n in keep})
    leaves, kw = _keyword_case(case, fused, N, seed=N)
    if not rotary:
        kw.pop("offset", None)  # no effect without RoPE: the op refuses it
    got = _loss_parts(rotary_linear_attention(*leaves[:3], rotary=rotary, chunk_size=16, block_size=32, **kw))
    want = _loss_parts(linear_attention_ref(*leaves[:3], rotary=rotary, **kw))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    g = torch.Generator().manual_seed(1)
    ups = [torch.randn(t.shape, generator=g, **F64) for t in got]
    for a, b in zip(torch.autograd.grad(got, leaves, ups), torch.autograd.grad(want, leaves, ups)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_bidirectional_keywords_match_reference(causal):
    leaves, kw = _keyword_case("mask+state", True, 40)
    got = _loss_parts(rotary_linear_attention(*leaves[:3], causal=causal, **kw))
    want = _loss_parts(linear_attention_ref(*leaves[:3], causal=causal, **kw))
    ups = [torch.randn(t.shape, generator=torch.Generator().manual_seed(2), **F64) for t in got]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, leaves, ups), torch.autograd.grad(want, leaves, ups)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_cross_attention_key_mask_matches_reference():
    g = torch.Generator().manual_seed(0)
    q = (torch.rand(2, 3, 7, 8, generator=g, **F64) + 0.01).requires_grad_()
    k = (torch.rand(2, 3, 11, 8, generator=g, **F64) + 0.01).requires_grad_()
    v = torch.randn(2, 3, 11, 4, generator=g, **F64).requires_grad_()
    key_mask = torch.rand(2, 11, generator=g) > 0.3
    kw = dict(causal=False, rotary=False, key_mask=key_mask, mask=torch.rand(2, 7, generator=g) > 0.2)
    out, ref = rotary_linear_attention(q, k, v, **kw), linear_attention_ref(q, k, v, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("case", ["mask", "cu+state"])
def test_keywords_strictly_causal(case):
    """Changing later keys and values moves earlier outputs by exactly 0, with every keyword."""
    leaves, kw = _keyword_case(case, True, 130)
    q, k, v = (t.detach() for t in leaves[:3])
    t = 70
    out = _loss_parts(rotary_linear_attention(q, k, v, chunk_size=16, block_size=32, **kw))[0]
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t + 1:] *= 5
    v2[:, :, t + 1:] += 3
    out2 = _loss_parts(rotary_linear_attention(q, k2, v2, chunk_size=16, block_size=32, **kw))[0]
    assert (out[:, :, : t + 1] - out2[:, :, : t + 1]).abs().max().item() == 0.0
    later = (out[:, :, t + 1:] - out2[:, :, t + 1:]).abs().amax(-1)  # (B, H, N - t - 1)
    real = kw["mask"][:, None, t + 1:].expand_as(later) if "mask" in kw else torch.ones_like(later, dtype=torch.bool)
    assert (later[real] > 1e-3).all()  # and every later real output moves (padding stays 0)


def test_bf16_autocast_training_step():
    """Under bf16 autocast, q, k, v come out of bf16 matmuls; the op runs in float32 inside, and
    its output and gradients stay within bf16 rounding of the float64 reference at every
    position."""
    leaves, kw = _keyword_case("mask", True, 100)
    x = [t.detach().float() for t in leaves[:3]]
    w = kw.pop("projection")
    mix = torch.eye(x[0].shape[-1]) + 0.1 * torch.randn(x[0].shape[-1], x[0].shape[-1],
                                                      generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = (t @ mix if i < 2 else t @ torch.eye(t.shape[-1]) for i, t in enumerate(x))
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16  # autocast did run the matmuls
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = rotary_linear_attention(q, k, v, projection=w.float(), **kw)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = linear_attention_ref(qd, kd, vd, projection=w, **kw)
    bf16_bound(out, ref)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), **F64)
    got = torch.autograd.grad(out, (q, k, v), up.bfloat16())
    want = torch.autograd.grad(ref, (qd, kd, vd), up)
    for g, r in zip(got, want):  # bf16 gradients: 2^-8 relative to the largest, per tensor
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.double(), r, rtol=2.0**-7, atol=2.0**-7 * r.abs().max().item())
