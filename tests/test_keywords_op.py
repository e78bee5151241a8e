"""Every keyword of the op against running each row / document alone through the naive reference,
in float64, for the outputs and the gradients; and every misuse gets a clear error."""
import pytest
import torch

from linear_rope import (
    LinearAttentionState,
    FavorFeatures,
    naive_rotary_linear_attention as naive,
    rotary_linear_attention as fast,
    rotary_linear_attention_step as step,
)

F64 = dict(dtype=torch.float64)
H, D, M, E = 2, 6, 10, 5
MODES = [pytest.param(True, id="causal"), pytest.param(False, id="bidir")]
ROT = [pytest.param(True, id="rope"), pytest.param(False, id="norope")]
INPUTS = [pytest.param(False, id="features"), pytest.param(True, id="favor")]


def make(B, N, favor, seed=0, Nk=None):
    g = torch.Generator().manual_seed(seed)
    Nk = N if Nk is None else Nk
    if favor:
        q = torch.randn(B, H, N, D, generator=g, **F64)
        k = torch.randn(B, H, Nk, D, generator=g, **F64)
        torch.manual_seed(seed)
        w = FavorFeatures(D, M).projection.double()
    else:
        q = torch.rand(B, H, N, M, generator=g, **F64) + 0.01
        k = torch.rand(B, H, Nk, M, generator=g, **F64) + 0.01
        w = None
    v = torch.randn(B, H, Nk, E, generator=g, **F64)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), w


def vjp(out, inputs, up):
    return torch.autograd.grad(out, inputs, up, allow_unused=True)


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def sizes(causal, chunk, block):
    """Small chunks and blocks for a causal call; nothing for a bidirectional one (no chunks
    there: the op refuses them as having no effect)."""
    return dict(chunk_size=chunk, block_size=block) if causal else {}


LENGTHS = {"left": [(3, 40), (0, 40)], "right": [(0, 29), (0, 40)], "both": [(5, 33), (1, 40)]}


@pytest.mark.parametrize("pad", list(LENGTHS))
@pytest.mark.parametrize("favor", INPUTS)
@pytest.mark.parametrize("rotary", ROT)
@pytest.mark.parametrize("causal", MODES)
def test_mask_rows_equal_rows_alone(causal, rotary, favor, pad):
    N = 40
    q, k, v, w = make(2, N, favor, seed=len(pad))
    mask = torch.zeros(2, N, dtype=torch.bool)
    for b, (s, e) in enumerate(LENGTHS[pad]):
        mask[b, s:e] = True
    kw = dict(causal=causal, rotary=rotary, projection=w, **(dict(offset=7) if rotary else {}))
    out = fast(q, k, v, mask=mask, **sizes(causal, 8, 16), **kw)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), **F64)
    grads = vjp(out, (q, k, v), up)
    close(out, naive(q, k, v, mask=mask, **kw))
    for b, (s, e) in enumerate(LENGTHS[pad]):
        alone = [t[b : b + 1, :, s:e].detach().requires_grad_() for t in (q, k, v)]
        ref = naive(*alone, **kw)
        close(out[b : b + 1, :, s:e], ref)
        for g, ga in zip(grads, vjp(ref, alone, up[b : b + 1, :, s:e])):
            close(g[b : b + 1, :, s:e], ga, 1e-9)
        pads = ~mask[b]
        assert (out[b, :, pads] == 0).all() and torch.isfinite(out).all()
        for g in grads:  # padding gets no gradient: it took part in nothing
            assert (g[b, :, pads] == 0).all()


@pytest.mark.parametrize("favor", INPUTS)
@pytest.mark.parametrize("rotary", ROT)
@pytest.mark.parametrize("causal", MODES)
def test_packed_documents_equal_documents_alone(causal, rotary, favor):
    lengths = [17, 1, 30, 9]
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v, w = make(1, T, favor, seed=3)
    kw = dict(causal=causal, rotary=rotary, projection=w)
    out, state = fast(q, k, v, cu_seqlens=cu, output_final_state=True, **sizes(causal, 8, 16), **kw)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), **F64)
    grads = vjp(out, (q, k, v), up)
    close(out, naive(q, k, v, cu_seqlens=cu, **kw))
    for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = [t[:, :, s:e].detach().requires_grad_() for t in (q, k, v)]
        ref, ref_state = naive(*alone, output_final_state=True, **kw)
        close(out[:, :, s:e], ref)
        close(state.S[d : d + 1], ref_state.S)
        close(state.z[d : d + 1], ref_state.z)
        for g, ga in zip(grads, vjp(ref, alone, up[:, :, s:e])):
            close(g[:, :, s:e], ga, 1e-9)


@pytest.mark.parametrize("split", [1, 20, 39])
@pytest.mark.parametrize("favor", INPUTS)
@pytest.mark.parametrize("rotary", ROT)
def test_two_chained_calls_equal_one(rotary, favor, split):
    N = 40
    q, k, v, w = make(2, N, favor, seed=split)
    kw = dict(causal=True, rotary=rotary, projection=w)
    at = (lambda o: dict(offset=o)) if rotary else (lambda o: {})  # no positions without RoPE
    one = fast(q, k, v, **at(4), **kw)
    up = torch.randn(one.shape, generator=torch.Generator().manual_seed(7), **F64)
    a, st = fast(q[:, :, :split], k[:, :, :split], v[:, :, :split], **at(4), output_final_state=True, **kw)
    b = fast(q[:, :, split:], k[:, :, split:], v[:, :, split:], **at(4 + split), initial_state=st, **kw)
    two = torch.cat((a, b), dim=2)
    close(two, one)
    close(one, naive(q, k, v, **at(4), **kw))
    # the gradient flows through the state from the second call back into the first
    for g1, g2 in zip(vjp(one, (q, k, v), up), vjp(two, (q, k, v), up)):
        close(g1, g2, 1e-9)


@pytest.mark.parametrize("favor", INPUTS)
@pytest.mark.parametrize("causal", MODES)
def test_initial_state_and_final_state_gradients(causal, favor):
    q, k, v, w = make(2, 23, favor, seed=11)
    g = torch.Generator().manual_seed(1)
    S0 = torch.randn(2, H, M, E, generator=g, **F64).requires_grad_()
    z0 = (torch.rand(2, H, M, generator=g, **F64) + 0.1).requires_grad_()
    kw = dict(causal=causal, rotary=True, projection=w, offset=3, initial_state=LinearAttentionState(S0, z0),
              output_final_state=True)
    out, (S, z) = fast(q, k, v, **sizes(causal, 8, 8), **kw)
    ref, (Sr, zr) = naive(q, k, v, **kw)
    for a, b in ((out, ref), (S, Sr), (z, zr)):
        close(a, b)
    ups = [torch.randn(t.shape, generator=g, **F64) for t in (out, S, z)]
    inputs = (q, k, v, S0, z0)
    got = vjp((out, S, z), inputs, ups)
    want = vjp((ref, Sr, zr), inputs, ups)
    for a, b in zip(got, want):
        close(a, b, 1e-9)


@pytest.mark.parametrize("favor", INPUTS)
def test_cross_attention_with_key_mask(favor):
    q, k, v, w = make(2, 12, favor, seed=4, Nk=19)
    key_mask = torch.ones(2, 19, dtype=torch.bool)
    key_mask[0, 15:] = False
    key_mask[1, :4] = False
    kw = dict(causal=False, rotary=False, projection=w)
    out = fast(q, k, v, key_mask=key_mask, **kw)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), **F64)
    grads = vjp(out, (q, k, v), up)
    for b, (s, e) in enumerate([(0, 15), (4, 19)]):
        alone = [q[b : b + 1].detach().requires_grad_()] + [t[b : b + 1, :, s:e].detach().requires_grad_() for t in (k, v)]
        ref = naive(*alone, **kw)
        close(out[b : b + 1], ref)
        ga = vjp(ref, alone, up[b : b + 1])
        close(grads[0][b : b + 1], ga[0], 1e-9)
        close(grads[1][b : b + 1, :, s:e], ga[1], 1e-9)
        close(grads[2][b : b + 1, :, s:e], ga[2], 1e-9)
        assert (grads[1][b, :, ~key_mask[b]] == 0).all()


@pytest.mark.parametrize("favor", INPUTS)
@pytest.mark.parametrize("rotary", ROT)
def test_ragged_prefill_then_per_row_steps(rotary, favor):
    """Left-padded prompts of different lengths, prefilled under a mask, then decoded with per-row
    positions, give every row exactly what it gets alone."""
    q, k, v, w = make(3, 30, favor, seed=9)
    lens = [12, 20, 7]
    P = max(lens)
    mask = torch.zeros(3, P, dtype=torch.bool)
    for b, n in enumerate(lens):
        mask[b, P - n :] = True
    # row b alone: its prompt (the last lens[b] tokens of the padded prefix), then 10 decoded tokens
    idx = [list(range(P - n, P)) + list(range(P, P + 10)) for n in lens]
    kw = dict(rotary=rotary, projection=w)
    out, state = fast(q[:, :, :P], k[:, :, :P], v[:, :, :P], mask=mask, output_final_state=True, **kw)
    outs, pos = [], mask.sum(1)
    for t in range(P, P + 10):
        o, state = step(q[:, :, t], k[:, :, t], v[:, :, t], state, pos, **kw)
        outs.append(o)
        pos = pos + 1
    dec = torch.stack(outs, dim=2)
    for b in range(3):
        i = torch.tensor(idx[b])
        ref = naive(q[b : b + 1, :, i], k[b : b + 1, :, i], v[b : b + 1, :, i], **kw)
        close(out[b : b + 1, :, P - lens[b] :], ref[:, :, : lens[b]])
        close(dec[b : b + 1], ref[:, :, lens[b] :])


def test_step_with_int_and_tensor_positions_agree():
    q, k, v, w = make(2, 3, True, seed=2)
    a, sa = step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, 5, projection=w)
    b, sb = step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, torch.tensor([5, 5]), projection=w)
    close(a, b)
    close(sa.S, sb.S)


# --- misuse -------------------------------------------------------------------------------------

def _small(favor=False):
    return [None if t is None else t.detach() for t in make(2, 5, favor)]


def test_negative_features_are_refused_unless_allowed():
    q, k, v, _ = _small()
    with pytest.raises(ValueError, match="non-negative.*allow_negative"):
        fast(q - 1.0, k, v)
    with pytest.raises(ValueError, match="k: features must be non-negative"):
        naive(q, k - 1.0, v)
    with pytest.raises(ValueError, match="non-negative"):
        step(q[:, :, 0] - 1.0, k[:, :, 0], v[:, :, 0], None, 0)
    out = fast(q - 0.001, k, v, allow_negative=True)  # the caller opted out
    assert out.shape == v.shape


@pytest.mark.parametrize("mask, match", [
    (torch.ones(2, 4, dtype=torch.bool), r"mask must have shape \[2, 5\]"),
    (torch.ones(2, 5), "mask must be a bool tensor"),
    (torch.ones(2, 5, dtype=torch.long), "mask must be a bool tensor"),
    ([[True] * 5] * 2, "mask must be a bool tensor"),
], ids=["shape", "float", "long", "list"])
def test_bad_mask(mask, match):
    q, k, v, _ = _small()
    with pytest.raises(ValueError, match=match):
        fast(q, k, v, mask=mask)


@pytest.mark.parametrize("cu, match", [
    (torch.tensor([0, 3, 2, 5], dtype=torch.int32), "never decrease"),
    (torch.tensor([0, 3, 4], dtype=torch.int32), "end at T=5"),
    (torch.tensor([1, 3, 5], dtype=torch.int32), "start at 0"),
    (torch.tensor([0.0, 5.0]), "int32"),
], ids=["not-increasing", "short", "not-from-0", "float"])
def test_bad_cu_seqlens(cu, match):
    q, k, v, _ = (None if t is None else t[:1] for t in _small())
    with pytest.raises(ValueError, match=match):
        fast(q, k, v, cu_seqlens=cu)


def test_cu_seqlens_needs_one_row():
    q, k, v, _ = _small()
    with pytest.raises(ValueError, match="one row"):
        fast(q, k, v, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))


def test_bad_state():
    q, k, v, _ = _small()
    _, st = fast(q, k, v, output_final_state=True)
    with pytest.raises(ValueError, match=r"initial_state: S \[2, 2, 10, 5\].*want S \[1, 2, 10, 5\]"):
        fast(q[:1], k[:1], v[:1], initial_state=st)
    with pytest.raises(ValueError, match="initial_state"):
        fast(q, k, v, initial_state=(st.S[..., :3], st.z))
    with pytest.raises(ValueError, match="LinearAttentionState"):
        fast(q, k, v, initial_state=st.S)
    with pytest.raises(ValueError, match="^state: S"):  # the step's argument is called state
        step(q[:, :, 0], k[:, :, 0], v[:, :, :1, 0], st, 5)


def test_bad_positions_and_cross_attention(monkeypatch):
    q, k, v, _ = _small()
    with pytest.raises(ValueError, match="offset"):  # a CPU tensor's values are read: no device sync there
        fast(q, k, v, offset=torch.tensor([1, -1]))
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", "parallel")  # the GPU's path: not read (a host sync) ...
    fast(q, k, v, offset=torch.tensor([1, -1]))
    monkeypatch.setenv("LINEAR_ROPE_CHECKS", "1")  # ... unless asked
    with pytest.raises(ValueError, match="offset"):
        fast(q, k, v, offset=torch.tensor([1, -1]))
    monkeypatch.delenv("LINEAR_ROPE_BACKEND")
    with pytest.raises(ValueError, match="offset"):
        fast(q, k, v, offset=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="position"):
        step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="cross-attention"):
        fast(q, k, v, key_mask=torch.ones(2, 5, dtype=torch.bool))


def test_double_backward_is_a_one_line_error():
    q, k, v, w = make(1, 9, True)
    out = fast(q, k, v, projection=w)
    with pytest.raises(RuntimeError, match="double backward") as err:
        torch.autograd.grad(out.sum(), q, create_graph=True)
    assert "\n" not in str(err.value).strip()


# --- cross-attention masks, feature scale, empty batches, compile and trace ---------------------

@pytest.mark.parametrize("path", [fast, naive], ids=["fast", "naive"])
@pytest.mark.parametrize("Nk", [12, 19], ids=["same-length", "other-length"])
def test_cross_attention_key_mask_is_never_the_query_mask(path, Nk):
    """With key_mask, the query mask masks queries only (the keys are masked by key_mask alone);
    k of another length with a query mask and no key_mask sees every key."""
    q, k, v, _ = (None if t is None else t.detach() for t in make(2, 12, False, seed=4, Nk=Nk))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :4] = False
    kw = dict(causal=False, rotary=False)
    all_keys = torch.ones(2, Nk, dtype=torch.bool)
    out = path(q, k, v, mask=mask, key_mask=all_keys, **kw)
    want = naive(q, k, v, key_mask=all_keys, **kw) * mask[:, None, :, None]  # every key, queries masked
    close(out, want)
    assert (out[0, :, 4:] != 0).all()
    if Nk != 12:  # another length: cross-attention without key_mask is every key as well
        close(path(q, k, v, mask=mask, **kw), want)


def _scaled(q, k, v, s, dtype):
    """q, k scaled by s in ``dtype`` (v too), and the same values in float64 for the reference."""
    qs, ks, vs = (q * s).to(dtype), (k * s).to(dtype), v.to(dtype)
    return (qs, ks, vs), tuple(t.double() for t in (qs, ks, vs))


SCALES = [pytest.param(s, id=f"{s:g}") for s in (1e-35, 1e-25, 1.0, 1e19, 1e35)]
LOW = [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.bfloat16, 2e-2, id="bf16")]


@pytest.mark.parametrize("dtype, tol", LOW)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("causal", MODES)
def test_output_is_scale_invariant_over_the_float32_range(causal, scale, dtype, tol):
    """Eq. 19 does not change when phi(q) or phi(k) is scaled: neither does the op, at any
    scale of float32 (and bf16), against the float64 reference of the same rounded inputs."""
    q, k, v, _ = (None if t is None else t.detach() for t in make(2, 50, False, seed=12))
    low, ref_in = _scaled(q, k, v, scale, dtype)
    ref = naive(*ref_in, causal=causal)
    out = fast(*low, causal=causal, **sizes(causal, 16, 32))
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    qs, ks, vs = (t.detach().requires_grad_() for t in low)
    qd, kd, vd = (t.detach().requires_grad_() for t in ref_in)
    up = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), **F64)
    got = vjp(fast(qs, ks, vs, causal=causal, **sizes(causal, 16, 32)), (qs, ks, vs), up.to(dtype))
    want = vjp(naive(qd, kd, vd, causal=causal), (qd, kd, vd), up)
    for g, w in zip(got, want):  # gradients scale as 1/s: compare relative to the largest
        assert torch.isfinite(g).all()
        err = ((g.double() - w).abs().max() / w.abs().max()).item()
        assert err < 5 * tol, err


@pytest.mark.parametrize("scale", SCALES)
def test_scaled_state_chains_and_decodes(scale):
    """Prefill with a state, a chained call and token steps, all at the same extreme scale, give
    the float64 reference's answer: the state returned is in the caller's scale."""
    q, k, v, _ = (None if t is None else t.detach() for t in make(2, 40, False, seed=13))
    low, ref_in = _scaled(q, k, v, scale, torch.float32)
    ref = naive(*ref_in, offset=torch.tensor([3, 900]))
    a, st = fast(*(t[:, :, :20] for t in low), offset=torch.tensor([3, 900]), output_final_state=True)
    b, st = fast(*(t[:, :, 20:30] for t in low), offset=torch.tensor([23, 920]), initial_state=st,
                 output_final_state=True)
    outs = [a, b]
    for t in range(30, 40):
        o, st = step(*(x[:, :, t] for x in low), st, torch.tensor([3 + t, 900 + t]))
        outs.append(o[:, :, None])
    got = torch.cat(outs, dim=2).double()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    _, st_ref = naive(*ref_in, offset=torch.tensor([3, 900]), output_final_state=True)
    torch.testing.assert_close(st.z.double(), st_ref.z, rtol=1e-5, atol=0)


def test_a_final_state_that_overflows_is_refused():
    q, k, v, _ = (None if t is None else t.detach().float() for t in make(1, 40, False))
    k = k / k.max() * 3e38  # each key fits float32, their sum does not
    out = fast(q, k, v)  # the output alone is fine
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="final state's key sum z is not finite"):
        fast(q, k, v, output_final_state=True)


EMPTY = {"B0": (0, H, 5, M, E), "H0": (2, 0, 5, M, E), "e0": (2, H, 5, M, 0)}


@pytest.mark.parametrize("with_state", [False, True], ids=["no-state", "state"])
@pytest.mark.parametrize("favor", INPUTS)
@pytest.mark.parametrize("causal", MODES)
@pytest.mark.parametrize("shape", list(EMPTY))
def test_empty_batches_give_empty_results_and_gradients(shape, causal, favor, with_state):
    B, h, N, m, e = EMPTY[shape]
    g = torch.Generator().manual_seed(0)
    x = D if favor else m
    q, k = (torch.rand(B, h, N, x, generator=g, **F64).requires_grad_() for _ in range(2))
    v = torch.randn(B, h, N, e, generator=g, **F64).requires_grad_()
    torch.manual_seed(0)
    w = FavorFeatures(D, M).projection.double() if favor else None
    kw = dict(causal=causal, projection=w, output_final_state=True)
    leaves = [q, k, v]
    if with_state:
        S0 = torch.randn(B, h, M, e, generator=g, **F64).requires_grad_()
        z0 = (torch.rand(B, h, M, generator=g, **F64) + 0.5).requires_grad_()
        kw["initial_state"] = LinearAttentionState(S0, z0)
        leaves += [S0, z0]
    out, (S, z) = fast(q, k, v, **kw)
    ref, (Sr, zr) = naive(q, k, v, **kw)
    assert out.shape == (B, h, N, e) and S.shape == (B, h, M, e) and z.shape == (B, h, M)
    close(out, ref), close(S, Sr), close(z, zr)  # e = 0: z is still every key's sum
    ups = [torch.randn(t.shape, generator=g, **F64) for t in (out, S, z)]
    for a, b, leaf in zip(vjp((out, S, z), leaves, ups), vjp((ref, Sr, zr), leaves, ups), leaves):
        assert a.shape == leaf.shape
        close(a, b, 1e-9)


def test_empty_batch_step():
    q, k, v = (torch.rand(0, H, n, **F64) for n in (M, M, E))
    out, st = step(q, k, v, None, 3)
    assert out.shape == (0, H, E) and st.S.shape == (0, H, M, E)


def test_negative_features_are_refused_under_compile():
    """Under torch.compile the sign check runs in the graph (torch._assert_async): compiled code
    refuses what eager refuses, with the same message, as a RuntimeError when the graph runs.
    (aot_eager traces what Inductor gets, without its C++ build.)"""
    q, k, v, _ = _small()
    compiled = torch.compile(lambda a, b, c: fast(a, b, c, causal=False), backend="aot_eager", fullgraph=True)
    close(compiled(q, k, v), fast(q, k, v, causal=False))
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="k: features must be non-negative"):
        compiled(q, k - 1.0, v)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
# torch (2.13) deprecates jit.trace itself; the test checks what the op does when traced anyway.
@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_jit_trace_causal_is_refused_bidirectional_traces():
    q, k, v, _ = _small()
    with pytest.raises(RuntimeError, match="jit.trace cannot record the causal path.*use torch.compile"):
        torch.jit.trace(lambda a, b, c: fast(a, b, c), (q, k, v))
    traced = torch.jit.trace(lambda a, b, c: fast(a, b, c, causal=False), (q, k, v), check_trace=False)
    close(traced(q, k, v), fast(q, k, v, causal=False))
