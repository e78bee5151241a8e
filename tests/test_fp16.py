"""float16 autocast stays finite with RoPE (Eq. 19), whose outputs pass float16's range.

Eq. 19 divides the rotated numerator by the unrotated denominator, so a layer's attention output
has no bound: the ``paper`` preset trained under float16 autocast with a GradScaler (random ids
from generator 7, batch 2 x 1024, AdamW at lr 1e-3) reached outputs near 1.7e6 at its third
step, which the cast to float16 turned into inf and the output projection into NaN. Under
float16 autocast the layer now takes those outputs to its output projection in float32.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linear_rope import PerformerLM, RotaryLinearAttention
from linear_rope.ops import rotary_linear_attention
from linear_rope.ops.backend import use_backend

FP16_MAX = torch.finfo(torch.float16).max


def _big_output_layer(position="rope"):
    """A layer of the paper's head sizes whose q, k are large enough that Eq. 19's output passes
    65504 in float32 (about 7.5e4 with this seed at 4x the initial to_qkv weights; 5x here)."""
    torch.manual_seed(0)
    layer = RotaryLinearAttention(768, heads=12, dim_head=64, nb_features=266, position=position)
    with torch.no_grad():
        layer.to_qkv.weight.mul_(5)
    x = torch.randn(1, 64, 768, generator=torch.Generator().manual_seed(7))
    return layer, x


def test_the_case_passes_float16_range_in_float32():
    """The premise: the float32 op itself gives outputs float16 cannot hold."""
    layer, x = _big_output_layer()
    with use_backend("torch"), torch.no_grad():
        q, k, v = layer._qkv(x)
        out = rotary_linear_attention(q, k, v, projection=layer.features.projection)
    assert out.abs().max() > FP16_MAX


@pytest.mark.parametrize("position", ["rope", "rope_norm"])
def test_layer_under_fp16_autocast_is_finite_and_matches_float32(position):
    layer, x = _big_output_layer(position)
    with use_backend("torch"), torch.no_grad():
        ref = layer(x)
        with torch.autocast("cpu", dtype=torch.float16):
            out = layer(x)
    assert torch.isfinite(out).all()
    # float16 q, k, v (about 3 decimal digits) move Eq. 19's large ratios by a few per cent of the max
    assert (out.float() - ref).abs().max() <= 0.05 * ref.abs().max()


def test_step_under_fp16_autocast_is_finite():
    """Decoding token by token takes the same float32 output projection."""
    layer, x = _big_output_layer()
    state, outs = None, []
    with use_backend("torch"), torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        for t in range(x.shape[1]):
            o, state = layer.step(x[:, t], state, t)
            outs.append(o)
    assert torch.isfinite(torch.stack(outs)).all()


def test_bfloat16_and_none_keep_the_half_precision_projection():
    """Only RoPE under float16 needs float32: without RoPE the output is a convex combination of
    v, and bfloat16 has float32's range; their output projection runs in the autocast dtype."""
    layer, x = _big_output_layer("none")
    seen = []
    layer.to_out.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        layer(x)
    rope, _ = _big_output_layer("rope")
    rope.to_out.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        rope(x)
    assert seen == [torch.float16, torch.bfloat16]


@pytest.mark.slow
def test_paper_widths_fp16_gradscaler_training_stays_finite():
    """The device check's inputs at one layer of the paper preset (widths, heads, m, N = 1024):
    random ids from generator 7, batch 2 x 1024, AdamW lr 1e-3, float16 autocast + GradScaler.
    Before the float32 output projection, the loss was NaN at the fourth step (the full 12-layer
    preset: at the third), its first non-finite value in blocks.0.attn.to_out."""
    torch.manual_seed(0)
    model = PerformerLM.from_preset("paper", depth=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(7)
    losses = []
    with use_backend("torch"):
        for _ in range(4):
            ids = torch.randint(0, 256, (2, 1025), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 256), ids[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert all(torch.isfinite(p).all() for p in model.parameters())
