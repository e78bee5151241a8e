"""The layer's and the LM's keywords against each row / document run alone through the naive
reference (``layer_ref``), in float64, for the outputs and the gradients."""
import pytest
import torch

from linear_rope import PerformerLM, RotaryLinearAttention, naive_rotary_linear_attention
from linear_rope.model import MODEL_PRESETS, ModelConfig
from linear_rope.reference import layer_ref

F64 = dict(dtype=torch.float64)
POSITIONS = ["rope", "rope_pre", "rope_norm", "none"]
MODES = [pytest.param(True, id="causal"), pytest.param(False, id="bidir")]
DIM = 24


def make_layer(position, causal=True, feature_map="favor", seed=0):
    torch.manual_seed(seed)
    return RotaryLinearAttention(DIM, heads=3, dim_head=8, causal=causal, position=position,
                                 feature_map=feature_map).double()


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def vjp(out, inputs, up):
    return torch.autograd.grad(out, inputs, up)


@pytest.mark.parametrize("pad", ["left", "right"])
@pytest.mark.parametrize("causal", MODES)
@pytest.mark.parametrize("position", POSITIONS)
def test_padding_mask(position, causal, pad):
    layer = make_layer(position, causal)
    N, lens = 37, [37, 21, 30]
    x = torch.randn(3, N, DIM, **F64, requires_grad=True)
    mask = torch.zeros(3, N, dtype=torch.bool)
    spans = [(N - n, N) if pad == "left" else (0, n) for n in lens]
    for b, (s, e) in enumerate(spans):
        mask[b, s:e] = True
    out = layer(x, mask=mask, offset=2)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), **F64)
    params = list(layer.parameters())
    gx, *gp = vjp(out, [x] + params, up)
    sum_gp = [torch.zeros_like(p) for p in params]
    for b, (s, e) in enumerate(spans):
        xb = x[b : b + 1, s:e].detach().requires_grad_()
        ref = layer_ref(layer, xb, offset=2)
        close(out[b : b + 1, s:e], ref)
        gxb, *gpb = vjp(ref, [xb] + params, up[b : b + 1, s:e])
        close(gx[b : b + 1, s:e], gxb, 1e-9)
        assert (gx[b, ~mask[b]] == 0).all()
        sum_gp = [a + g for a, g in zip(sum_gp, gpb)]
    # the weights' gradient: the padded rows' outputs are the output bias alone (what enters
    # them is 0), so compare after removing that bias term
    for p, g, ga in zip(params, gp, sum_gp):
        if p is layer.to_out.bias:
            ga = ga + (up * (~mask)[..., None]).sum((0, 1))
        close(g, ga, 1e-9)


@pytest.mark.parametrize("causal", MODES)
@pytest.mark.parametrize("position", POSITIONS)
def test_packed_documents(position, causal):
    layer = make_layer(position, causal)
    lengths = [11, 1, 26, 5]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(1, sum(lengths), DIM, **F64, requires_grad=True)
    out = layer(x, cu_seqlens=cu)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), **F64)
    (gx,) = vjp(out, [x], up)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        xd = x[:, s:e].detach().requires_grad_()
        ref = layer_ref(layer, xd)
        close(out[:, s:e], ref)
        close(gx[:, s:e], vjp(ref, [xd], up[:, s:e])[0], 1e-9)


@pytest.mark.parametrize("position", POSITIONS)
def test_state_in_and_out(position):
    layer = make_layer(position)
    x = torch.randn(2, 40, DIM, **F64, requires_grad=True)
    one = layer(x, offset=5)
    a, st = layer(x[:, :17], offset=5, output_final_state=True)
    b = layer(x[:, 17:], offset=22, initial_state=st)
    two = torch.cat((a, b), dim=1)
    close(two, one)
    close(one, layer_ref(layer, x, offset=5))
    up = torch.randn(one.shape, generator=torch.Generator().manual_seed(3), **F64)
    close(vjp(two, [x], up)[0], vjp(one, [x], up)[0], 1e-9)


def test_cross_attention():
    torch.manual_seed(0)
    layer = RotaryLinearAttention(DIM, heads=3, dim_head=8, causal=False, position="none").double()
    x = torch.randn(2, 9, DIM, **F64, requires_grad=True)
    ctx = torch.randn(2, 14, DIM, **F64, requires_grad=True)
    cmask = torch.ones(2, 14, dtype=torch.bool)
    cmask[0, 10:] = False
    cmask[1, :3] = False
    out = layer(x, context=ctx, context_mask=cmask)
    assert out.shape == x.shape
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), **F64)
    gx, gc = vjp(out, [x, ctx], up)

    def ref(xb, cb):  # the layer written out: q from x, k and v from the context, Eq. 18
        w = layer.to_qkv.weight
        heads = lambda t: t.view(1, -1, 3, 8).transpose(1, 2)  # noqa: E731
        inner = 24
        q, k, v = heads(xb @ w[:inner].t()), heads(cb @ w[inner : 2 * inner].t()), heads(cb @ w[2 * inner :].t())
        fq, fk = layer.features(q, is_query=True), layer.features(k, is_query=False)
        o = naive_rotary_linear_attention(fq, fk, v, causal=False, rotary=False)
        return layer.to_out(o.transpose(1, 2).reshape(1, -1, inner))

    for b, (s, e) in enumerate([(0, 10), (3, 14)]):
        xb, cb = x[b : b + 1].detach().requires_grad_(), ctx[b : b + 1, s:e].detach().requires_grad_()
        r = ref(xb, cb)
        close(out[b : b + 1], r)
        gxb, gcb = vjp(r, [xb, cb], up[b : b + 1])
        close(gx[b : b + 1], gxb, 1e-9)
        close(gc[b : b + 1, s:e], gcb, 1e-9)
        assert (gc[b, ~cmask[b]] == 0).all()


@pytest.mark.parametrize("position", ["rope", "rope_pre"])
def test_cross_attention_is_refused_with_rope(position):
    layer = make_layer(position, causal=False)
    with pytest.raises(ValueError, match="cross-attention needs a layer with position='none'"):
        layer(torch.randn(1, 3, DIM, **F64), context=torch.randn(1, 4, DIM, **F64))
    causal = make_layer("none", causal=True)
    with pytest.raises(ValueError, match="causal=False"):
        causal(torch.randn(1, 3, DIM, **F64), context=torch.randn(1, 4, DIM, **F64))


@pytest.mark.parametrize("position", POSITIONS)
def test_ragged_prefill_then_per_row_steps(position):
    layer = make_layer(position)
    lens, P, new = [6, 15, 10], 15, 8
    seqs = [torch.randn(1, n + new, DIM, **F64) for n in lens]
    x = torch.zeros(3, P, DIM, **F64)
    mask = torch.zeros(3, P, dtype=torch.bool)
    for b, n in enumerate(lens):
        x[b, P - n :] = seqs[b][0, :n]
        mask[b, P - n :] = True
    out, state = layer(x, mask=mask, output_final_state=True)
    pos, outs = mask.sum(1), []
    for t in range(new):
        xt = torch.stack([seqs[b][0, lens[b] + t] for b in range(3)])
        o, state = layer.step(xt, state, pos + t)
        outs.append(o)
    dec = torch.stack(outs, dim=1)
    for b, n in enumerate(lens):
        alone = layer(seqs[b])
        close(out[b, P - n :], alone[0, :n])
        close(dec[b], alone[0, n:])


@pytest.mark.parametrize("position", ["rope", "rope_pre", "rope_norm", "absolute", "none"])
def test_lm_mask_and_ragged_generate(position):
    torch.manual_seed(0)
    model = PerformerLM(ModelConfig(**{**MODEL_PRESETS["tiny"], "position": position})).double()
    prompts = [b"abc", b"hello world", b"x"]
    batch = model.generate(prompts, 12, top_k=1)
    assert batch == [model.generate(p, 12, top_k=1) for p in prompts]
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    ids[0, 8:], mask[0, 8:] = torch.tensor(list(b"abc")), True
    ids[1], mask[1] = torch.tensor(list(b"hello world")), True
    logits = model(ids, mask=mask)
    close(logits[0, 8:], model(torch.tensor([list(b"abc")]))[0])
    close(logits[1], model(torch.tensor([list(b"hello world")]))[0])


def test_layer_misuse():
    layer = make_layer("rope")
    x = torch.randn(2, 5, DIM, **F64)
    with pytest.raises(ValueError, match=r"mask must have shape \[2, 5\]"):
        layer(x, mask=torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        layer(x, mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x[:1], cu_seqlens=torch.tensor([0, 3, 2, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="end at T=5"):
        make_layer("rope_pre")(x[:1], cu_seqlens=torch.tensor([0, 3], dtype=torch.int32))
    _, st = layer(x, output_final_state=True)
    other = RotaryLinearAttention(DIM, heads=2, dim_head=12).double()
    with pytest.raises(ValueError, match="initial_state"):
        other(x, initial_state=st)
    with pytest.raises(ValueError, match="state"):
        other.step(x[:, 0], st, 5)
    with pytest.raises(ValueError, match="position"):
        layer.step(x[:, 0], st, torch.tensor([5]))
    with pytest.raises(ValueError, match="context"):
        make_layer("none", causal=False)(x, context=torch.randn(2, 4, DIM + 1, **F64))


@pytest.mark.parametrize("M", [12, 7], ids=["same-length", "other-length"])
def test_cross_attention_mask_never_masks_the_context(M):
    """``mask`` masks the queries; the context is masked by ``context_mask`` alone (None: all
    real), also when the context has x's length or another one."""
    torch.manual_seed(0)
    layer = RotaryLinearAttention(16, heads=2, dim_head=8, causal=False, position="none").double()
    x, ctx = torch.randn(2, 12, 16, **F64), torch.randn(2, M, 16, **F64)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :4] = False
    out = layer(x, mask=mask, context=ctx)
    close(out, layer(x, mask=mask, context=ctx, context_mask=torch.ones(2, M, dtype=torch.bool)))
    for b in range(2):  # each row's real queries against its whole context
        real = mask[b]
        close(out[b, real], layer(x[b : b + 1, real], context=ctx[b : b + 1])[0])


@pytest.mark.parametrize("position", POSITIONS)
def test_per_row_offsets_with_a_state(position):
    """Per-row offsets and a state together: two chained calls equal one, and every row equals
    the row alone at its int offset (an op that ignored per-row offsets would rotate the state
    and the new tokens at different positions)."""
    layer = make_layer(position)
    x = torch.randn(3, 30, DIM, **F64, requires_grad=True)
    off = torch.tensor([3, 900, 17])
    one = layer(x, offset=off)
    a, st = layer(x[:, :11], offset=off, output_final_state=True)
    b = layer(x[:, 11:], offset=off + 11, initial_state=st)
    two = torch.cat((a, b), dim=1)
    close(two, one)
    for r in range(3):
        close(one[r : r + 1], layer_ref(layer, x[r : r + 1], offset=int(off[r])))
    up = torch.randn(one.shape, generator=torch.Generator().manual_seed(3), **F64)
    close(vjp(two, [x], up)[0], vjp(one, [x], up)[0], 1e-9)
    # prefill then per-row steps from those offsets
    st, outs = None, []
    _, st = layer(x[:, :20], offset=off, output_final_state=True)
    for t in range(20, 30):
        o, st = layer.step(x[:, t], st, off + t)
        outs.append(o)
    close(torch.stack(outs, dim=1), one[:, 20:])


@pytest.mark.parametrize("position", POSITIONS)
def test_packed_documents_with_offsets_and_states(position):
    """Packed documents, each with its own offset and initial state, continue exactly where
    each document alone left off."""
    layer = make_layer(position)
    lengths = [9, 1, 14]
    xs = [torch.randn(1, 6 + n, DIM, **F64) for n in lengths]  # 6 tokens before, then the packed part
    offs = torch.tensor([2, 500, 40])
    heads = []
    for d, xd in enumerate(xs):  # each document's first 6 tokens alone: its state
        _, st = layer(xd[:, :6], offset=int(offs[d]), output_final_state=True)
        heads.append(st)
    state = type(heads[0])(torch.cat([s.S for s in heads]), torch.cat([s.z for s in heads]))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    packed = torch.cat([xd[:, 6:] for xd in xs], dim=1)
    out = layer(packed, cu_seqlens=cu, offset=offs + 6, initial_state=state)
    for d, xd in enumerate(xs):
        close(out[:, cu[d] : cu[d + 1]], layer(xd, offset=int(offs[d]))[:, 6:])


@pytest.mark.parametrize("causal", MODES)
@pytest.mark.parametrize("position", POSITIONS)
def test_empty_batch_gives_empty_output_and_gradients(position, causal):
    layer = make_layer(position, causal)
    x = torch.randn(0, 7, DIM, **F64, requires_grad=True)
    out = layer(x)
    assert out.shape == (0, 7, DIM)
    out.sum().backward()
    assert x.grad.shape == x.shape and all(p.grad is not None and (p.grad == 0).all()
                                           for p in layer.to_qkv.parameters())


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
# torch (2.13) deprecates jit.trace itself; the test checks what the op does when traced anyway.
@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_jit_trace_of_a_causal_layer_is_refused_bidirectional_traces():
    x = torch.randn(2, 5, DIM, **F64)
    with pytest.raises(RuntimeError, match="jit.trace cannot record the causal path.*use torch.compile"):
        torch.jit.trace(make_layer("rope"), x)
    bidir = make_layer("rope", causal=False)
    traced = torch.jit.trace(bidir, x, check_trace=False)
    close(traced(x), bidir(x), 1e-6)  # the trace records d ** -0.25 of a traced shape in float32
