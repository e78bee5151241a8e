import pytest
import torch

from linear_rope.decode import Decoder
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
        logits2 = model(ids2)
        diff = (logits2[:, : t + 1] - logits[:, : t + 1]).abs().max().item()
        assert diff <= 1e-10, (position, t, diff)
        later = (logits2[:, t + 1 :] - logits[:, t + 1 :]).abs().amax(-1)  # (B, N - t - 1)
        assert (later > 1e-6).all(), (position, t)  # and the later ones do move


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


def test_sampling_is_seeded_and_respects_top_k(monkeypatch):
    import linear_rope.decode as decode_mod

    seen, sample = [], decode_mod.sample_next

    def recorded(logits, **kw):  # every sampled token with the logits it was drawn from
        tok = sample(logits, **kw)
        seen.append((logits.clone(), tok.clone()))
        return tok

    monkeypatch.setattr(decode_mod, "sample_next", recorded)
    model = tiny("rope").eval()
    a = model.generate([b"ab", b"xyz"], 20, temperature=2.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert len(seen) == 20 and all(len(t) == 20 for t in a)
    for logits, tok in seen:  # each of the 2 x 20 tokens is one of its 5 most likely
        top5 = logits.topk(5, dim=-1).indices
        assert (top5 == tok[:, None]).any(-1).all(), (tok, top5)
    assert any((logits.argmax(-1) != tok).any() for logits, tok in seen)  # and it sampled
    b = model.generate([b"ab", b"xyz"], 20, temperature=2.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert a == b
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


def test_step_refuses_a_state_list_of_the_wrong_length():
    model = tiny("rope")
    _, states = model(torch.tensor([[1, 2, 3]]), output_final_state=True)
    for bad in (states[:1], states + states[:1]):
        with pytest.raises(ValueError, match=r"states: one state per layer is needed \(2\), got \d states"):
            model.step(torch.tensor([4]), bad, 3)
    with pytest.raises(ValueError, match="states"):
        model.step(torch.tensor([4]), states[0], 3)


@pytest.mark.parametrize("call", ["forward", "step"])
def test_ids_outside_the_vocabulary_name_the_values(call, monkeypatch):
    monkeypatch.setenv("LINEAR_ROPE_CHECKS", "1")  # value checks (a host sync) are opt-in
    model = tiny("rope")
    _, states = model(torch.tensor([[1, 2, 3]]), output_final_state=True)
    for bad, shown in ((256, "256"), (-1, "-1")):
        with pytest.raises(ValueError, match=rf"outside \[0, vocab_size=256\): {shown}"):
            if call == "forward":
                model(torch.tensor([[1, bad, 3]]))
            else:
                model.step(torch.tensor([bad]), states, 3)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0, None, "1"])
def test_bad_temperature_is_refused(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        tiny("rope").generate(b"ab", 3, temperature=temperature)


def test_a_tiny_temperature_is_greedy():
    model = tiny("rope").eval()
    assert model.generate(b"ab", 8, temperature=1e-45) == model.generate(b"ab", 8, top_k=1)


def test_a_temperature_below_float32_is_greedy_too():
    """1e-300 is 0 in float32, where (logits - max) / t made 0 / 0 = nan and multinomial failed."""
    model = tiny("rope").eval()
    assert model.generate(b"ab", 8, temperature=1e-300) == model.generate(b"ab", 8, top_k=1)


def test_generate_leaves_the_model_in_the_mode_it_found_even_on_an_error(monkeypatch):
    model = tiny("rope", dropout=0.1).train()
    assert len(model.generate(b"ab", 3)) == 3 and model.training

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Decoder, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.generate(b"ab", 3)
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    with pytest.raises(KeyboardInterrupt):
        model.generate(b"ab", 3)
    assert not model.training


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=True), "top_k must be a positive int or None, got True"),
    (dict(top_k=False), "top_k must be a positive int or None, got False"),
    (dict(max_new_tokens=True), "max_new_tokens must be a non-negative int, got True"),
    (dict(temperature=True), "temperature must be a finite number"),
    (dict(top_k=2.0), "top_k must be a positive int"),
], ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_generate_refuses_bools_as_numbers(kwargs, match):
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        tiny("rope").generate(b"ab", **kwargs)


def test_generate_refuses_a_generator_that_is_not_one():
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None"):
        tiny("rope").generate(b"ab", 3, generator=0)


def test_step_refuses_a_bool_token():
    model = tiny("rope")
    _, states = model(torch.tensor([[1, 2, 3]]), output_final_state=True)
    with pytest.raises(ValueError, match="token must be an integer tensor"):
        model.step(torch.tensor([True]), states, 3)


def test_uint8_ids_are_compared_without_wrapping(monkeypatch):
    """In uint8, ``ids >= 256`` wraps to ``ids >= 0``: every valid id was reported out of range."""
    monkeypatch.setenv("LINEAR_ROPE_CHECKS", "1")
    model = tiny("rope").eval()
    ids = torch.tensor([[255, 3, 0]])
    torch.testing.assert_close(model(ids.to(torch.uint8)), model(ids), rtol=0, atol=0)
    small = tiny("rope", vocab_size=10)
    with pytest.raises(ValueError, match=r"ids: 1 id\(s\) outside \[0, vocab_size=10\): 255$"):
        small(ids.to(torch.uint8))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(rope_base=float("nan")), ValueError, "rope_base must be a finite number"),
    (dict(rope_base=0.0), ValueError, "rope_base must be a positive number"),
    (dict(dropout=float("nan")), ValueError, "dropout must be a finite number"),
    (dict(depth=True), TypeError, "depth must be an int, got True"),
    (dict(depth=1e6), TypeError, "depth must be an int, got 1000000.0"),
    (dict(qk_norm=1), TypeError, "qk_norm must be a bool, got 1"),
], ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_model_config_refuses_non_finite_and_mistyped_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        ModelConfig(**kwargs)


@pytest.mark.parametrize("position", LM_POSITIONS)
def test_empty_batch_gives_empty_logits_and_gradients(position):
    model = tiny(position).double()
    logits, states = model(torch.zeros(0, 5, dtype=torch.long), output_final_state=True)
    assert logits.shape == (0, 5, 256)
    # every tensor of every layer's state (LinearAttentionState, or softmax's KVCache) is empty
    assert all(t.shape[0] == 0 for s in states for t in s if isinstance(t, torch.Tensor))
    logits.sum().backward()
    assert all(p.grad is None or (p.grad == 0).all() for p in model.parameters())
    lg, _ = model.step(torch.zeros(0, dtype=torch.long), states, 5)
    assert lg.shape == (0, 256)


@pytest.mark.parametrize("position", LM_POSITIONS)
def test_ragged_prefill_then_per_row_steps_match_rows_alone(position):
    """Left-padded rows prefilled under a mask, then decoded at per-row positions: each row's
    logits equal the row alone, in float64 (the per-row positions meet the per-row states)."""
    model = tiny(position).double()
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (n + 6,), generator=g) for n in (4, 11, 7)]
    P = 11
    ids, mask = torch.zeros(3, P, dtype=torch.long), torch.zeros(3, P, dtype=torch.bool)
    for b, s in enumerate(seqs):
        n = len(s) - 6
        ids[b, P - n :], mask[b, P - n :] = s[:n], True
    logits, states = model(ids, mask=mask, output_final_state=True)
    pos, dec = mask.sum(1), []
    for t in range(6):
        lg, states = model.step(torch.stack([s[len(s) - 6 + t] for s in seqs]), states, pos + t)
        dec.append(lg)
    dec = torch.stack(dec, dim=1)
    for b, s in enumerate(seqs):
        n = len(s) - 6
        alone = model(s[None])[0]
        torch.testing.assert_close(logits[b, P - n :], alone[:n], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(dec[b], alone[n:], rtol=1e-9, atol=1e-9)
