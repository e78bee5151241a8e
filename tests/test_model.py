import pytest
import torch

from linear_rope.model import LM_POSITIONS, MODEL_PRESETS, ModelConfig, PerformerLM


def tiny(position, seed=0, **kw):
    torch.manual_seed(seed)
    return PerformerLM.from_preset("tiny", position=position, **kw)


@pytest.mark.parametrize("position", LM_POSITIONS)
def test_lm_is_causal(position):
    model = tiny(position).double()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    assert logits.shape == (2, 32, 256)
    for t in (0, 10, 30):
        ids2 = ids.clone()
        ids2[:, t + 1:] = torch.randint(0, 256, ids2[:, t + 1:].shape, generator=torch.Generator().manual_seed(t))
        diff = (model(ids2)[:, : t + 1] - logits[:, : t + 1]).abs().max().item()
        assert diff <= 1e-10, (position, t, diff)


@pytest.mark.parametrize("position", LM_POSITIONS)
def test_greedy_generation_equals_full_forward(position):
    model = tiny(position).eval()
    prompt = b"The quick brown"
    new = model.generate(prompt, 16, top_k=1)
    assert isinstance(new, bytes) and len(new) == 16
    ids = torch.tensor(list(prompt + new))[None]
    full = model(ids)[0]  # (N, 256), fp32
    # token i of `new` is the argmax of the logits at the position before it
    assert bytes(full[len(prompt) - 1 : -1].argmax(-1).tolist()) == new
    # and the recurrent logits match the full-sequence logits
    logits, states = model(ids[:, : len(prompt)], output_final_state=True)
    step_logits = [logits[0, -1]]
    for i, tok in enumerate(new[:-1]):
        lg, states = model.step(torch.tensor([tok]), states, len(prompt) + i)
        step_logits.append(lg[0])
    torch.testing.assert_close(torch.stack(step_logits), full[len(prompt) - 1 : -1], rtol=0, atol=1e-4)


def test_sampling_is_seeded_and_respects_top_k():
    model = tiny("rope").eval()
    a = model.generate(b"ab", 20, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    b = model.generate(b"ab", 20, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert a == b and len(a) == 20
    assert model.generate(b"ab", 0) == b""
    assert model.generate(b"ab", 5, temperature=0) == model.generate(b"ab", 5, top_k=1)


def test_rope_generates_past_training_length():
    model = tiny("rope").eval()
    assert len(model.generate(b"x" * 30, 40, top_k=1)) == 40  # seq_len is 32


def test_variants_share_initial_weights():
    models = {p: tiny(p, seed=3) for p in LM_POSITIONS}
    ref = models["rope"].state_dict()
    for p, m in models.items():
        sd = m.state_dict()
        assert set(sd) - set(ref) <= {"pos_emb.weight"}
        # softmax has no FAVOR+ projections; every weight it has equals the others'
        missing = set(ref) - set(sd)
        assert missing == (set() if p != "softmax" else {k for k in ref if k.endswith("features.projection")})
        for name, t in ref.items():
            if name not in missing:
                assert torch.equal(sd[name], t), (p, name)


def test_redraw_features_is_seeded_per_layer():
    a, b = tiny("rope"), tiny("none", seed=5)
    a.redraw_features(torch.Generator().manual_seed(1))
    b.redraw_features(torch.Generator().manual_seed(1))
    pa = [f.projection for f in a.feature_modules]
    pb = [f.projection for f in b.feature_modules]
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert not torch.equal(pa[0], pa[1])  # each layer gets its own draw


def test_presets():
    assert MODEL_PRESETS["paper"] == dict(dim=768, depth=12, heads=12, dim_head=64, nb_features=266, seq_len=1024)
    assert MODEL_PRESETS["cpu"]["depth"] == 12
    m = PerformerLM.from_preset("tiny", dim=48)
    assert m.cfg.dim == 48 and m.cfg.depth == MODEL_PRESETS["tiny"]["depth"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="huge"), "preset"),
    (dict(name="tiny", position="alibi"), "position"),
    (dict(name="tiny", feature_map="gauss"), "feature_map"),
    (dict(name="tiny", widht=3), "unknown model config"),
    (dict(name="tiny", depth=0), "depth"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PerformerLM.from_preset(**kwargs)


def test_bad_generate_and_forward_input():
    model = tiny("absolute")
    with pytest.raises(ValueError, match="prompt"):
        model.generate("text", 3)
    with pytest.raises(ValueError, match="prompt"):
        model.generate(b"", 3)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(b"a", 3, top_k=0)
    with pytest.raises(ValueError, match="seq_len"):
        model.generate(b"a", 100)
    with pytest.raises(ValueError, match="ids"):
        model(torch.randn(2, 3))
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 40, dtype=torch.long))
    assert isinstance(ModelConfig(), ModelConfig)
