import pytest
import torch

from linear_rope import RotaryLinearAttention
from linear_rope.reference import layer_ref

F64 = dict(dtype=torch.float64)
POSITIONS = ["rope", "rope_pre", "rope_norm", "none"]
MAPS = ["favor", "elu", "relu"]


def make_layer(position, feature_map="favor", causal=True, seed=0):
    torch.manual_seed(seed)
    return RotaryLinearAttention(24, heads=3, dim_head=8, causal=causal, position=position, feature_map=feature_map).double()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("position", POSITIONS)
def test_layer_matches_reference(position, feature_map, causal):
    layer = make_layer(position, feature_map, causal)
    x = torch.randn(2, 67, 24, **F64, requires_grad=True)
    out, ref = layer(x, offset=3), layer_ref(layer, x, offset=3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    up = torch.randn_like(out)
    params = [x] + [p for p in layer.parameters()]
    for g, gr in zip(torch.autograd.grad(out, params, up), torch.autograd.grad(ref, params, up)):
        torch.testing.assert_close(g, gr, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("position", POSITIONS)
def test_layer_is_strictly_causal(position, feature_map):
    layer = make_layer(position, feature_map)
    x = torch.randn(2, 130, 24, **F64)
    out = layer(x)
    for t in (0, 63, 64, 100):
        x2 = x.clone()
        x2[:, t + 1:] = 50 * torch.randn_like(x2[:, t + 1:])
        out2 = layer(x2)
        assert (out[:, : t + 1] - out2[:, : t + 1]).abs().max().item() <= 1e-12
        assert (out[:, t + 1:] - out2[:, t + 1:]).abs().max().item() > 1e-6


@pytest.mark.parametrize("position", POSITIONS)
def test_step_and_prefill_match_forward(position):
    layer = make_layer(position)
    x = torch.randn(2, 40, 24, **F64)
    full = layer(x)
    out, state = layer(x[:, :25], output_final_state=True)
    outs = [out]
    for t in range(25, 40):
        o, state = layer.step(x[:, t], state, t)
        outs.append(o[:, None])
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-12)
    state, outs = None, []
    for t in range(40):
        o, state = layer.step(x[:, t], state, t)
        outs.append(o[:, None])
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-12)


def test_rope_layer_is_translation_invariant():
    layer = make_layer("rope")
    x = torch.randn(2, 50, 24, **F64)
    torch.testing.assert_close(layer(x, offset=0), layer(x, offset=1000), rtol=0, atol=1e-10)


def test_redraw_changes_output_and_is_seeded():
    layer = make_layer("rope").float()
    x = torch.randn(1, 20, 24)
    layer.features.redraw(torch.Generator().manual_seed(1))
    a = layer(x)
    layer.features.redraw(torch.Generator().manual_seed(2))
    assert not torch.allclose(a, layer(x))
    layer.features.redraw(torch.Generator().manual_seed(1))
    torch.testing.assert_close(a, layer(x), rtol=0, atol=0)


def test_bfloat16_input():
    layer = make_layer("rope").float()
    x = torch.randn(2, 100, 24)
    ref = layer(x)
    out = layer.bfloat16()(x.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() < 0.05 * ref.abs().max().item()


@pytest.mark.parametrize("kwargs, match", [
    (dict(position="alibi"), "position"),
    (dict(feature_map="gauss"), "feature_map"),
    (dict(nb_features=7), "nb_features"),
    (dict(dim_head=7, position="rope_pre", feature_map="elu"), "dim_head"),
    (dict(heads=0), "heads"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RotaryLinearAttention(16, **kwargs)


def test_bad_calls():
    layer = RotaryLinearAttention(16, heads=2, dim_head=8)
    with pytest.raises(ValueError, match="x must have shape"):
        layer(torch.randn(2, 0, 16))
    with pytest.raises(ValueError, match="offset"):
        layer(torch.randn(2, 3, 16), offset=-1)
    with pytest.raises(ValueError, match="position"):
        layer.step(torch.randn(2, 16), None, -1)
    bidir = RotaryLinearAttention(16, heads=2, dim_head=8, causal=False)
    with pytest.raises(ValueError, match="bidirectional"):
        bidir.step(torch.randn(2, 16), None, 0)
