"""Every cache the package keeps between calls (docs/caches.md): each thing its key or snapshot
claims to follow is changed, and the next call gives the fresh answer."""
from __future__ import annotations

import copy
from dataclasses import asdict

import pytest
import torch

from linear_rope import RotaryLinearAttention, rotary_linear_attention
from linear_rope.decode import Decoder
from linear_rope.model import PerformerLM
from linear_rope.ops import workspace
from linear_rope.ops.backend import use_backend
from linear_rope.ops import rope_tables

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return PerformerLM.from_preset("tiny", **kw).eval()


# -- the FAVOR+ projection's operands (parallel path): no cache, every write seen -------------------

@pytest.mark.parametrize("write", ["data", "in_place", "no_grad_copy"])
def test_a_projection_rewritten_is_used_at_the_next_call_on_the_parallel_path(write):
    """A projection written through ``.data`` (no version counter moves) or in place: the next call
    on the chunk-parallel path uses the new projection (it equals the torch path's answer)."""
    torch.manual_seed(0)
    layer = RotaryLinearAttention(32, heads=2, dim_head=16)
    x = torch.randn(2, 70, 32)
    new = torch.randn_like(layer.features.projection)
    with use_backend("parallel"):
        old_out = layer(x)
        p = layer.features.projection
        if write == "data":
            p.data.copy_(new)
        else:
            with torch.no_grad():
                p.copy_(new)
        got = layer(x)
    with use_backend("torch"):
        want = layer(x)
    assert (got - old_out).abs().max() > 1e-2  # the projection changed the answer
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_two_views_of_one_projection_with_one_start_are_told_apart():
    """``W[:8]`` and ``W[::2]`` start at one address: each call uses its own rows."""
    torch.manual_seed(1)
    W = torch.randn(16, 8, dtype=torch.float64)
    q, k = (torch.randn(1, 2, 70, 8, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 70, 8, dtype=torch.float64)
    for view in (W[:8], W[::2], W[:8]):
        with use_backend("parallel"):
            got = rotary_linear_attention(q, k, v, projection=view)
        with use_backend("torch"):
            want = rotary_linear_attention(q, k, v, projection=view.contiguous())
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# -- the workspace pool (torch path on the CPU): inference mode is part of the key -----------------

@pytest.mark.parametrize("backend", ["torch", "parallel"])
def test_a_call_under_inference_mode_does_not_break_later_training_calls(backend):
    torch.manual_seed(0)
    layer = RotaryLinearAttention(32, heads=2, dim_head=16)
    x = torch.randn(2, 70, 32)
    with use_backend(backend):
        with torch.inference_mode():
            first = layer(x)
        out = layer(x)
        out.sum().backward()
        with torch.inference_mode():
            again = layer(x)
    assert layer.to_qkv.weight.grad is not None and torch.isfinite(layer.to_qkv.weight.grad).all()
    torch.testing.assert_close(out.detach(), first, rtol=0, atol=0)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_the_pool_keys_buffers_on_inference_mode():
    like = torch.empty(1)
    workspace.clear()
    with torch.inference_mode():
        a = workspace.empty((4, 8), like)
    assert torch.is_inference(a)
    del a
    b = workspace.empty((4, 8), like)  # same numel and dtype, outside the mode: not that buffer
    assert not torch.is_inference(b)
    b.add_(1)  # writable outside inference mode
    workspace.clear()


# -- RoPE tables and limb constants: keyed on all that decides their values -----------------------

def test_the_rope_tables_follow_every_key_field():
    base = dict(n=12, dim=8, offset=3, base=10000.0, positions=None, device="cpu", dtype=torch.float32)
    ref = rope_tables.rope_pair_tables(**base)
    for field, value in (("n", 13), ("dim", 10), ("offset", 4), ("base", 500.0), ("dtype", torch.float64)):
        got = rope_tables.rope_pair_tables(**{**base, field: value})
        fresh = rope_tables._pair_tables(torch.arange(got[0].shape[-2]) + (value if field == "offset" else 3),
                                         value if field == "dim" else 8, value if field == "base" else 10000.0,
                                         value if field == "dtype" else torch.float32)
        torch.testing.assert_close(got, fresh, rtol=0, atol=0)
        assert got[0].shape != ref[0].shape or got[0].dtype != ref[0].dtype or not torch.equal(got[0], ref[0])
    with torch.inference_mode():  # made under inference_mode first: still a plain tensor after
        t = rope_tables.rope_pair_tables(**{**base, "n": 29})
    assert not torch.is_inference(t[0])


def test_one_copy_of_the_limb_constants():
    from linear_rope import rotary

    assert rope_tables._limb_tensors is rotary._limb_tensors


# -- the Decoder's held weights: replaced tensors seen, refresh re-reads the module ----------------

def _autocast_logits(model, ids, mask, steps):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dec = Decoder(model, ids.shape[0], ids.shape[1] + steps + 1, compile=False)
        tok = dec.prefill(ids, mask).argmax(-1)
        return dec, tok


@pytest.mark.parametrize("how", ["assign", "parameter"])
@torch.no_grad()
def test_a_decoder_after_weights_are_replaced_decodes_with_the_new_ones(how):
    """``load_state_dict(sd, assign=True)`` or ``head.weight = nn.Parameter(...)`` between steps
    under bf16 autocast: the next step equals a fresh Decoder's (was ~1 away: the old tensors)."""
    model, other = tiny(0, position="rope"), tiny(7, position="rope")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    dec, tok = _autocast_logits(model, ids, None, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dec.step(tok)
    if how == "assign":
        model.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    else:
        model.head.weight = torch.nn.Parameter(other.head.weight.clone())
    states = [type(s)(s.S.clone(), s.z.clone()) for s in dec.states]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dec.step(tok)
        want, _ = model.step(tok, states, dec.positions - 1)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)


@torch.no_grad()
def test_a_decoder_step_without_autocast_then_with_it_uses_the_held_weights():
    """Plain, then autocast: the autocast step runs on the bf16 copies (as in a fresh process)."""
    model = tiny(0, position="rope")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    dec, tok = _autocast_logits(model, ids, None, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dec.step(tok)
    dec.step(tok)  # plain: the model's float32 weights
    assert dec._w is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dec.step(tok)
    assert dec._w is not None and got.dtype == torch.bfloat16


@torch.no_grad()
def test_the_decoder_s_favor_and_rope_copies_follow_a_redraw_at_the_next_prefill():
    """The FAVOR+ projections and RoPE tables are copied at ``prefill`` / ``load`` (a snapshot): a
    redraw between two prefills is used by the second, which equals a fresh Decoder's."""
    model = tiny(0, position="rope")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    dec = Decoder(model, 2, 20, compile=False)
    old = dec.prefill(ids)
    model.redraw_features(torch.Generator().manual_seed(11))
    got = [dec.prefill(ids), dec.step(ids[:, 0])]
    fresh = Decoder(model, 2, 20, compile=False)
    want = [fresh.prefill(ids), fresh.step(ids[:, 0])]
    assert (old - want[0]).abs().max() > 1e-3
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@torch.no_grad()
def test_a_compiled_step_shared_by_two_models_of_one_shape_reads_each_one_s_weights(monkeypatch):
    """The compiled steps are kept per (batch_size, max_len, device, dtype, config, mode): a second
    model of that key runs the same compiled function on its own weights and state."""
    from linear_rope import decode_step

    monkeypatch.setattr(decode_step, "_STEPS", {})
    monkeypatch.setattr(decode_step, "_COMPILED", {})
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    for seed in (0, 7):
        model = tiny(seed, position="rope").double()
        dec = Decoder(model, 2, 20, compile=True)
        logits = dec.prefill(ids)
        _, states = model(ids, output_final_state=True)
        tok = logits.argmax(-1)
        want, _ = model.step(tok, states, 9)
        torch.testing.assert_close(dec.step(tok), want, rtol=1e-12, atol=1e-12)
    assert len(decode_step._STEPS) == 1


# -- load_run: the config against the weights before anything is built ----------------------------

FIELDS = [("vocab_size", 200), ("dim", 48), ("depth", 3), ("heads", 4), ("dim_head", 16), ("nb_features", 34),
          ("seq_len", 2**24), ("position", "rope"), ("feature_map", "relu"), ("ff_mult", 2), ("qk_norm", True),
          ("head_bias", True), ("input_pos", "learned")]


@pytest.mark.parametrize("field, value", FIELDS, ids=[f for f, _ in FIELDS])
def test_load_run_checks_every_sizing_field_before_building(tmp_path, monkeypatch, field, value):
    """An ``absolute`` run whose config was edited (digest recomputed): refused in one line, and the
    model is never built (``seq_len = 2**24`` built a 512 MiB table first)."""
    import linear_rope
    from linear_rope.enwik8 import sample
    from linear_rope.enwik8.checkpoint import save_checkpoint
    from linear_rope.enwik8.runtime import param_digest

    model = tiny(0, position="absolute" if field != "input_pos" else "none", seq_len=32)
    cfg = {**asdict(model.cfg), field: value}
    payload = {"model": model.state_dict(), "step": 3, "config": {"model": cfg, "train": {}},
               "param_sha256": param_digest(model)}
    save_checkpoint(tmp_path / "run", 3, payload, keep=3)
    built = []
    monkeypatch.setattr(sample, "PerformerLM", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError) as e:
        linear_rope.load_run(tmp_path / "run")
    msg = str(e.value)  # (relu with m = 16: the layer's own refusal of the combination)
    assert "\n" not in msg and ("describe its weights" in msg or "m = dim_head" in msg), msg
    assert built == []


# -- sizes: every public constructor refuses a bool, a float or an out-of-range size in one line ----

BAD_SIZES = [
    ("FavorFeatures", (True,), {}, "dim_head"), ("FavorFeatures", (8.0,), {}, "dim_head"),
    ("FavorFeatures", (0,), {}, "dim_head"), ("FavorFeatures", (8, True), {}, "nb_features"),
    ("FavorFeatures", (8, 2.5), {}, "nb_features"), ("FavorFeatures", (8, 0), {}, "nb_features"),
    ("RotaryLinearAttention", (True,), {}, "dim"), ("RotaryLinearAttention", (32.0,), {}, "dim"),
    ("RotaryLinearAttention", (32,), {"heads": True}, "heads"), ("RotaryLinearAttention", (32,), {"heads": 0}, "heads"),
    ("RotaryLinearAttention", (32,), {"dim_head": 2.0}, "dim_head"),
    ("RotaryLinearAttention", (32,), {"nb_features": True}, "nb_features"),
    ("RotaryLinearAttention", (32,), {"dropout": True}, "dropout"),
    ("RotaryLinearAttention", (32,), {"dropout": 1.5}, "dropout"),
    ("RotaryLinearAttention", (32,), {"base": True}, "base"),
    ("ModelConfig", (), {"depth": True}, "depth"), ("ModelConfig", (), {"dim": 32.0}, "dim"),
    ("ModelConfig", (), {"heads": 0}, "heads"), ("ModelConfig", (), {"nb_features": True}, "nb_features"),
    ("ModelConfig", (), {"dropout": 2}, "dropout"), ("ModelConfig", (), {"seq_len": -1}, "seq_len"),
    ("ModelConfig", (), {"vocab_size": 257}, "vocab_size"), ("ModelConfig", (), {"ff_mult": 1.5}, "ff_mult"),
    ("PerformerLM", (), {"depth": True}, "depth"), ("PerformerLM", ("tiny",), {}, "cfg"),
]


@pytest.mark.parametrize("name, args, kw, field", BAD_SIZES, ids=[f"{n}-{f}-{i}" for i, (n, _, _, f) in
                                                                  enumerate(BAD_SIZES)])
def test_a_public_constructor_refuses_a_bad_size_in_one_line_naming_it(name, args, kw, field):
    import linear_rope

    assert name in linear_rope.__all__
    with pytest.raises((ValueError, TypeError)) as e:
        getattr(linear_rope, name)(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(field), msg
