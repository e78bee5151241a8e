"""SoftmaxAttention (the ablation's anchor) and QKNorm against readable references in float64:
outputs and gradients, padding, decoding, and the LM's `softmax` variant."""
import pytest
import torch

from linear_rope import PerformerLM, RotaryLinearAttention
from linear_rope.model import MODEL_PRESETS, ModelConfig
from linear_rope.reference import layer_ref, softmax_layer_ref
from linear_rope.softmax_attention import KVCache, SoftmaxAttention

F64 = dict(dtype=torch.float64)
DIM = 24
QK = [pytest.param(False, id="plain"), pytest.param(True, id="qk_norm")]


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def make(qk_norm, seed=0):
    torch.manual_seed(seed)
    layer = SoftmaxAttention(DIM, heads=3, dim_head=8, qk_norm=qk_norm).double()
    if qk_norm:  # scales away from their common start, so a head mix-up shows
        layer.qk_norm.scale.data = torch.tensor([0.7, 1.9, 3.1], **F64)
    return layer


@pytest.mark.parametrize("qk_norm", QK)
@pytest.mark.parametrize("n", [1, 17, 64])
def test_forward_and_gradients_match_the_reference(qk_norm, n):
    layer = make(qk_norm)
    x = torch.randn(2, n, DIM, **F64, requires_grad=True)
    out, ref = layer(x), softmax_layer_ref(layer, x)
    close(out, ref)
    up = torch.randn_like(out)
    params = [x] + list(layer.parameters())
    for g, gr in zip(torch.autograd.grad(out, params, up), torch.autograd.grad(ref, params, up)):
        close(g, gr, 1e-9)


@pytest.mark.parametrize("pad", ["left", "right"])
def test_padding_gives_each_row_what_it_gives_alone(pad):
    layer = make(True)
    N, lens = 20, [20, 7, 13]
    x = torch.randn(3, N, DIM, **F64)
    mask = torch.zeros(3, N, dtype=torch.bool)
    spans = [(N - n, N) if pad == "left" else (0, n) for n in lens]
    for b, (s, e) in enumerate(spans):
        mask[b, s:e] = True
    out = layer(x, mask=mask)
    for b, (s, e) in enumerate(spans):
        close(out[b : b + 1, s:e], softmax_layer_ref(layer, x[b : b + 1, s:e]))
        # padded rows output what to_out makes of 0: its bias alone
        close(out[b, ~mask[b]], layer.to_out.bias.expand(int((~mask[b]).sum()), DIM))


def test_decoding_equals_the_parallel_forward_with_ragged_positions():
    layer = make(True)
    x = torch.randn(2, 15, DIM, **F64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :4] = False  # row 1: a 5-token prompt, left-padded
    out, state = layer(x[:, :9], mask=mask, output_final_state=True)
    assert isinstance(state, KVCache)
    position = mask.sum(1)
    steps = []
    for t in range(9, 15):
        y, state = layer.step(x[:, t], state, position + (t - 9))
        steps.append(y)
    # each row alone, all at once, equals its prefill + steps
    for b, s in enumerate([0, 4]):
        ref = softmax_layer_ref(layer, x[b : b + 1, s:])
        close(out[b, s:9], ref[0, : 9 - s])
        close(torch.stack(steps, 1)[b], ref[0, 9 - s :])


def test_lm_softmax_variant_shares_the_initial_weights_and_generates_each_prompt_as_alone():
    kw = dict(MODEL_PRESETS["tiny"])
    torch.manual_seed(0)
    none = PerformerLM(ModelConfig(**kw, position="none"))
    torch.manual_seed(0)
    soft = PerformerLM(ModelConfig(**kw, position="softmax"))
    sd_none, sd_soft = none.state_dict(), soft.state_dict()
    shared = [k for k in sd_soft if k in sd_none]
    assert len(shared) == len(sd_soft) and len(sd_none) > len(sd_soft)  # only FAVOR+ buffers differ
    for key in shared:
        assert torch.equal(sd_none[key], sd_soft[key]), key
    assert soft.feature_modules == []
    soft.redraw_features(torch.Generator().manual_seed(1))  # nothing to redraw: no error
    soft.double()
    prompts = [b"abc", b"a longer prompt"]
    greedy = soft.generate(prompts, 6, top_k=1)
    assert greedy == [soft.generate(p, 6, top_k=1) for p in prompts]
    ids = torch.tensor([list(b"xyz" + b"\0" * 5), list(b"12345678")])
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 3:] = False  # right padding
    close(soft(ids, mask=mask)[0, :3], soft(ids[:1, :3])[0])


def test_lm_softmax_is_causal_and_trains():
    torch.manual_seed(0)
    lm = PerformerLM(ModelConfig(**MODEL_PRESETS["tiny"], position="softmax", qk_norm=True))
    ids = torch.randint(0, 256, (2, 20))
    a = lm(ids)
    ids2 = ids.clone()
    ids2[:, 12:] = torch.randint(0, 256, (2, 8))
    b = lm(ids2)
    close(a[:, :12], b[:, :12], 0)  # the past never sees the future
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3  # and the future does change
    loss = torch.nn.functional.cross_entropy(a.flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    scales = [blk.attn.qk_norm.scale.grad for blk in lm.blocks]
    assert all(s is not None and s.abs().sum() > 0 for s in scales)


@pytest.mark.parametrize("position", ["rope", "rope_pre", "rope_norm", "none"])
@pytest.mark.parametrize("causal", [True, False])
def test_qk_norm_in_the_linear_layer_matches_the_reference(position, causal):
    torch.manual_seed(0)
    layer = RotaryLinearAttention(DIM, heads=3, dim_head=8, causal=causal, position=position, qk_norm=True).double()
    layer.qk_norm.scale.data = torch.tensor([0.7, 1.9, 3.1], **F64)
    x = torch.randn(2, 23, DIM, **F64, requires_grad=True)
    out, ref = layer(x, offset=3), layer_ref(layer, x, offset=3)
    close(out, ref)
    up = torch.randn_like(out)
    params = [x] + list(layer.parameters())
    for g, gr in zip(torch.autograd.grad(out, params, up), torch.autograd.grad(ref, params, up)):
        close(g, gr, 1e-9)
    # q and k enter the feature map at the head's norm, whatever the input's scale
    big = layer(x * 1e3, offset=3)
    close(big, layer_ref(layer, x * 1e3, offset=3))


def test_qk_norm_scale_is_not_weight_decayed():
    from linear_rope.enwik8.config import TrainConfig
    from linear_rope.enwik8.trainer import make_optimizer
    lm = PerformerLM(ModelConfig(**MODEL_PRESETS["tiny"], qk_norm=True))
    opt = make_optimizer(lm, TrainConfig())
    no_decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert all(id(b.attn.qk_norm.scale) in no_decay for b in lm.blocks)
def test_softmax_layer_inputs_checked_in_one_line():
    torch.manual_seed(0)
    attn = SoftmaxAttention(dim=32, heads=2, dim_head=16)
    for bad in (torch.randn(2, 5, 31), torch.randn(2, 5, 32, dtype=torch.float64), torch.ones(2, 5, 32, dtype=torch.long), torch.randn(5, 32)):
        with pytest.raises(ValueError, match="x"):
            attn(bad)
    for bad in (torch.randn(2, 31), torch.randn(2, 5, 32)):
        with pytest.raises(ValueError, match="x_t"):
            attn.step(bad, None, 0)
    assert attn(torch.randn(2, 5, 32)).shape == (2, 5, 32)
