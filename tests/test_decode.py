"""Decoder: in-place decoding equals the functional ``PerformerLM.step`` and the full forward, for
ragged prompts, with no sync and a bounded number of kernel launches per step."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; it runs from the repo root
    sys.path.insert(0, str(ROOT))

import linear_rope.decode as decode_mod  # noqa: E402
from benchmarks.counting import counted  # noqa: E402
import linear_rope.decode_step as decode_step  # noqa: E402
from linear_rope.decode import Decoder, sample_next  # noqa: E402
from linear_rope.model import LM_POSITIONS, PerformerLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one thread for small sizes

# every position variant, and the other feature maps and qk_norm on Eq. 19
VARIANTS = [dict(position=p) for p in LM_POSITIONS] + [
    dict(position="rope", feature_map="elu", nb_features=None),
    dict(position="rope_norm", feature_map="relu", nb_features=None),
    dict(position="rope", qk_norm=True),
    dict(position="rope_pre", qk_norm=True),
]
NEW = 6


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return PerformerLM.from_preset("tiny", **kw).eval()


def ragged(lengths=(4, 11, 7), new=NEW, seed=2):
    """Left-padded prompts (ids, mask `[B, P]`) and the whole sequences (prompt + ``new``)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 256, (n + new,), generator=g) for n in lengths]
    P = max(lengths)
    ids, mask = torch.zeros(len(seqs), P, dtype=torch.long), torch.zeros(len(seqs), P, dtype=torch.bool)
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        ids[b, P - n:], mask[b, P - n:] = s[:n], True
    return ids, mask, seqs


def count_dispatch(fn) -> dict:
    """``benchmarks.generation.count_dispatch``: the one counter (``benchmarks/counting.py``)."""
    from benchmarks.generation import count_dispatch

    return count_dispatch(fn)


def vid(kw):
    return "-".join(str(v) for v in kw.values())


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kw", VARIANTS, ids=vid)
@torch.no_grad()
def test_decoder_equals_the_functional_step_and_the_forward_on_ragged_prompts(kw, dtype, tol):
    model = tiny(**kw).to(dtype)
    ids, mask, seqs = ragged()
    logits, states = model(ids, mask=mask, output_final_state=True)
    dec = Decoder(model, len(seqs), ids.shape[1] + NEW)
    torch.testing.assert_close(dec.prefill(ids, mask), logits[:, -1], rtol=0, atol=0)
    pos, got, want = mask.sum(1), [], []
    for t in range(NEW):
        tok = torch.stack([s[len(s) - NEW + t] for s in seqs])
        lg, states = model.step(tok, states, pos + t)
        want.append(lg)
        got.append(dec.step(tok))
    got, want = torch.stack(got, 1), torch.stack(want, 1)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for b, s in enumerate(seqs):  # and each row equals the row's full forward alone
        alone = model(s[None])[0, len(s) - NEW:]
        torch.testing.assert_close(got[b], alone, rtol=10 * tol, atol=10 * tol)
    if kw["position"] != "softmax":  # the live state is the functional one
        for mine, theirs in zip(dec.states, states):
            torch.testing.assert_close(mine.S, theirs.S, rtol=tol, atol=tol)
            torch.testing.assert_close(mine.z, theirs.z, rtol=tol, atol=tol)


@pytest.mark.parametrize("kw", [dict(position="rope"), dict(position="rope_norm"), dict(position="softmax"),
                                dict(position="absolute"), dict(position="rope", feature_map="elu", nb_features=None)],
                         ids=vid)
@torch.no_grad()
def test_a_decoder_step_has_no_sync_and_few_launches(kw):
    """Counted as a GPU sees it (``benchmarks.generation.count_dispatch``): no value read into
    Python, no Python data copied in, at most 60 kernel launches per layer, ragged rows too;
    the same count at any context (nothing per step grows with it)."""
    model = tiny(**kw, depth=3)
    counts = []
    for lengths in ((4, 11, 7), (30, 3, 17)):
        ids, mask, seqs = ragged(lengths)
        dec = Decoder(model, len(seqs), ids.shape[1] + NEW)
        tok = dec.prefill(ids, mask).argmax(-1)
        dec.step(tok)
        c = count_dispatch(lambda: dec.step(tok))
        assert c["syncs"] == 0, c["syncs_by_op"]
        assert c["launches"] <= 60 * model.cfg.depth, c["by_op"]
        counts.append(c["launches"])
    if kw["position"] != "softmax":  # (the anchor's key/value cache has max_len slots)
        assert counts[0] == counts[1]
    read = count_dispatch(lambda: bool(tok.sum() > 0))  # the counter sees a value read into Python
    assert read["syncs"] > 0


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 5), (2.0, 40)])
def test_sampling_draws_what_multinomial_draws(temperature, top_k):
    """``sample_next`` keeps the stream of ``torch.multinomial`` (one sample) for a seeded generator."""
    logits = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(50):
        got = sample_next(logits, temperature=temperature, top_k=top_k, generator=g1)
        lg = (logits - logits.amax(-1, keepdim=True)) / temperature
        if top_k is not None:
            lg = lg.masked_fill(lg < lg.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
        want = torch.multinomial(torch.softmax(lg, -1), 1, generator=g2)[:, 0]
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kw", [dict(position="rope"), dict(position="softmax"), dict(position="absolute")], ids=vid)
def test_generate_equals_the_functional_step_loop(kw, dtype):
    """``generate`` (on a Decoder) gives the tokens of the loop it replaced: a masked prefill, then
    ``PerformerLM.step`` at per-row positions and ``sample_next`` from the same generator."""
    model = tiny(**kw).to(dtype)
    prompts = [b"ab", b"The quick", b"x"]
    for sample in (dict(top_k=1), dict(temperature=1.0), dict(temperature=0.8, top_k=7)):
        got = model.generate(prompts, 12, generator=torch.Generator().manual_seed(4), **sample)
        g = torch.Generator().manual_seed(4)
        P = max(map(len, prompts))
        ids, mask = torch.zeros(3, P, dtype=torch.long), torch.zeros(3, P, dtype=torch.bool)
        for b, p in enumerate(prompts):
            ids[b, P - len(p):], mask[b, P - len(p):] = torch.tensor(list(p)), True
        with torch.no_grad():
            logits, states = model(ids, mask=mask, output_final_state=True)
            logits, out = logits[:, -1].float(), []
            for i in range(12):
                tok = sample_next(logits, temperature=sample.get("temperature", 1.0), top_k=sample.get("top_k"),
                                  generator=g)
                out.append(tok)
                logits, states = model.step(tok, states, mask.sum(1) + i)
                logits = logits.float()
        assert got == [bytes(r) for r in torch.stack(out, 1).tolist()], sample


@torch.no_grad()
def test_load_continues_from_functional_states():
    model = tiny(position="rope")
    ids, mask, _ = ragged()
    _, states = model(ids, mask=mask, output_final_state=True)
    dec = Decoder(model, 3, 20)
    dec.load(states, mask.sum(1))
    tok = torch.tensor([1, 2, 3])
    want, _ = model.step(tok, states, mask.sum(1))
    torch.testing.assert_close(dec.step(tok), want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_bad_use_is_a_value_error():
    model = tiny(position="rope")
    dec = Decoder(model, 2, 5)
    with pytest.raises(ValueError, match="call prefill"):
        dec.step(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"ids must be an integer tensor \[B=2, N >= 1\]"):
        dec.prefill(torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="do not fit max_len=5"):
        dec.prefill(torch.zeros(2, 6, dtype=torch.long))
    dec.prefill(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token must be an integer tensor \[B=2\]"):
        dec.step(torch.tensor([1.0, 2.0]))
    dec.step(torch.tensor([1, 2])), dec.step(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="max_len=5 reached"):
        dec.step(torch.tensor([1, 2]))
    absolute = Decoder(tiny(position="absolute"), 1, 100)  # seq_len 32
    absolute.prefill(torch.zeros(1, 30, dtype=torch.long))
    absolute.step(torch.tensor([1])), absolute.step(torch.tensor([1]))
    with pytest.raises(ValueError, match="the absolute table's seq_len=32 reached"):
        absolute.step(torch.tensor([1]))
    for bad in (dict(batch_size=0), dict(max_len=True), dict(compile="yes")):
        with pytest.raises(ValueError, match="must be"):
            Decoder(model, **{"batch_size": 2, "max_len": 5, **bad})


@torch.no_grad()
def test_a_failed_compile_falls_back_to_eager_with_one_warning(monkeypatch):
    def broken(fn, **kw):
        def run(*a):
            raise RuntimeError("no compiler here\nsecond line")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    model = tiny(position="rope")
    ids, mask, _ = ragged()
    eager, compiled = Decoder(model, 3, 20, compile=False), Decoder(model, 3, 20, compile=True)
    tok = eager.prefill(ids, mask).argmax(-1)
    compiled.prefill(ids, mask)
    line = r"^Decoder: torch.compile failed, decoding eagerly \(RuntimeError: no compiler here\)$"
    with pytest.warns(UserWarning, match=line):
        got = compiled.step(tok)
    torch.testing.assert_close(got, eager.step(tok), rtol=0, atol=0)
    torch.testing.assert_close(compiled.step(tok), eager.step(tok), rtol=0, atol=0)  # no second warning: eager now


def test_generate_with_a_failed_compile_gives_the_eager_tokens(monkeypatch):
    model = tiny(position="softmax")
    want = model.generate([b"ab", b"xyz"], 5, temperature=1.0, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda *a: 1 / 0)
    with pytest.warns(UserWarning, match="torch.compile failed, decoding eagerly"):
        got = model.generate([b"ab", b"xyz"], 5, temperature=1.0, generator=torch.Generator().manual_seed(1),
                             compile=True)  # (a key/value cache of 256 slots: max_len rounded up)
    assert got == want


def test_generate_samples_through_sample_next(monkeypatch):
    """Each new token comes from ``sample_next`` on the logits of the step before."""
    seen, sample = [], decode_mod.sample_next

    def recorded(logits, **kw):
        tok = sample(logits, **kw)
        seen.append(tok)
        return tok

    monkeypatch.setattr(decode_mod, "sample_next", recorded)
    out = tiny(position="rope").generate([b"ab", b"xyz"], 5, top_k=1)
    assert [bytes(r) for r in torch.stack(seen, 1).tolist()] == out


@pytest.mark.parametrize("position", ["rope", "rope_norm"])
@torch.no_grad()
def test_hugging_face_cached_steps_run_on_the_decoder(position, monkeypatch):
    """``LinearRopeForCausalLM`` with a cache: tokens with no padding step on a Decoder held by
    the cache (no value read after the first, on the GPU's path: ``LINEAR_ROPE_BACKEND=parallel``,
    where the input checks that read CPU tensors' values keep the GPU's rule), with the logits of
    ``PerformerLM.step``."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", "parallel")
    from linear_rope.hf import LinearRopeForCausalLM

    lm = tiny(position=position).double()
    hf = LinearRopeForCausalLM.from_performer(lm)
    ids, mask, seqs = ragged()
    out = hf(input_ids=ids, attention_mask=mask.long(), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    _, states = lm(ids, mask=mask, output_final_state=True)
    pos = mask.sum(1)
    for t in range(3):
        tok = torch.stack([s[len(s) - NEW + t] for s in seqs])
        box = []
        c = count_dispatch(lambda: box.append(hf(input_ids=tok[:, None], cache=cache).logits[:, 0]))
        want, states = lm.step(tok, states, pos + t)
        torch.testing.assert_close(box[0], want, rtol=1e-12, atol=1e-12)
        assert cache.decoder is not None
        if t:
            assert c["syncs"] == 0, c["syncs_by_op"]


# -- the compiled step, and the weights held in the autocast dtype ------------------------------


def fresh_compiles(monkeypatch, limit=None):
    """No compiled step shared with earlier tests: each test counts its own compiles."""
    monkeypatch.setattr(decode_step, "_STEPS", {})
    monkeypatch.setattr(decode_step, "_COMPILED", {})
    if limit is not None:
        monkeypatch.setattr(decode_step, "_RECOMPILE_LIMIT", limit)


def decoder_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("Decoder:")]


@pytest.mark.parametrize("kw", [dict(position="rope"),
                                dict(position="rope_norm", feature_map="relu", nb_features=None)], ids=vid)
@torch.no_grad()
def test_the_compiled_step_equals_the_functional_step_and_compiles_once_per_shape(kw, monkeypatch):
    """compile=True on the CPU (Inductor's C++): the compiled step (its update and read-out as one
    pass over the state) equals ``PerformerLM.step`` in float64; a second Decoder of the same
    (batch_size, max_len) compiles nothing, a new max_len compiles once and says so in one line."""
    import warnings

    fresh_compiles(monkeypatch)
    model = tiny(**kw).double()
    ids, mask, seqs = ragged()
    P = ids.shape[1]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        graphs = []
        shapes = (P + NEW, P + NEW, P + NEW + 8) if kw["position"] == "rope" else (P + NEW,)
        for max_len in shapes:
            dec = Decoder(model, len(seqs), max_len, compile=True)
            n0 = decode_step._graphs_compiled()
            dec.prefill(ids, mask)
            _, states = model(ids, mask=mask, output_final_state=True)
            pos = mask.sum(1)
            for t in range(NEW):
                tok = torch.stack([s[len(s) - NEW + t] for s in seqs])
                want, states = model.step(tok, states, pos + t)
                torch.testing.assert_close(dec.step(tok), want, rtol=1e-12, atol=1e-12)
            for mine, theirs in zip(dec.states, states):
                torch.testing.assert_close(mine.S, theirs.S, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(mine.z, theirs.z, rtol=1e-12, atol=1e-12)
            graphs.append(decode_step._graphs_compiled() - n0)
    assert graphs == [1, 0, 1][:len(shapes)]
    assert decoder_warnings(record) == [
        f"Decoder: compiling the step for a new shape, batch_size=3, max_len={P + NEW + 8} (compiled before for "
        f"batch_size x max_len 3x{P + NEW}); each new shape compiles once"][:len(shapes) - 1]


@torch.no_grad()
def test_past_the_recompile_limit_the_step_says_so_and_decodes_eagerly(monkeypatch):
    """A recompile past the shape's limit (here 1: the autocast state changes the step's graph)
    is one warning and the eager step's result, never a silent eager fallback."""
    import warnings

    fresh_compiles(monkeypatch, limit=1)
    model = tiny(position="rope")
    ids, mask, _ = ragged()
    dec, eager = Decoder(model, 3, 20, compile=True), Decoder(model, 3, 20, compile=False)
    tok = dec.prefill(ids, mask).argmax(-1)
    eager.prefill(ids, mask)
    torch.testing.assert_close(dec.step(tok), eager.step(tok), rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings(record=True) as record, torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("always")
        got, want = dec.step(tok), eager.step(tok)
    assert decoder_warnings(record) == ["Decoder: torch.compile failed, decoding eagerly (its recompile limit (1) "
                                        "for batch_size=3, max_len=20 is reached)"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def autocast_reference(model, tok, states, pos):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model.step(tok, states, pos)


@pytest.mark.parametrize("kw", [dict(position="rope"), dict(position="rope_norm"), dict(position="softmax"),
                                dict(position="absolute", qk_norm=True)], ids=vid)
@torch.no_grad()
def test_under_autocast_the_step_casts_no_weight_and_gives_the_autocast_step(kw):
    """A float32 model under bfloat16 autocast: the Decoder casts its weights at the first step and
    never again (no tensor the size of a weight is cast or copied per step), and its logits are
    those of ``PerformerLM.step`` under the same autocast (bfloat16 GEMMs both)."""
    model = tiny(**kw)
    ids, mask, seqs = ragged()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, states = model(ids, mask=mask, output_final_state=True)
        dec = Decoder(model, len(seqs), ids.shape[1] + NEW + 1)
        dec.prefill(ids, mask)
    smallest = min(p.numel() for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2
                   and "emb" not in n)
    pos = mask.sum(1)
    for t in range(NEW):
        tok = torch.stack([s[len(s) - NEW + t] for s in seqs])
        want, states = autocast_reference(model, tok, states, pos + t)
        with counted() as rec, torch.autocast("cpu", dtype=torch.bfloat16):
            got = dec.step(tok)
        big = [n for n in rec.copied if n >= smallest]
        assert (len(big) > 0) == (t == 0), (t, big)  # the first step casts the weights, no later one
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c = count_dispatch(lambda: dec.step(tok))
    assert c["syncs"] == 0, c["syncs_by_op"]


@torch.no_grad()
def test_a_training_step_between_decoding_steps_is_decoded_with_the_new_weights():
    """The held bfloat16 weights follow the model: after an optimizer step (in-place updates, seen
    by the weights' version counters on the host) and after ``refresh()`` (a write through
    ``.data``, which no version counter sees), the next token uses the new weights."""
    import copy

    model = tiny(position="rope")
    ids, mask, seqs = ragged()
    dec = Decoder(model, len(seqs), ids.shape[1] + 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tok = dec.prefill(ids, mask).argmax(-1)
        dec.step(tok)
    pos = mask.sum(1) + 1

    def check(old):
        states = [type(s)(s.S.clone(), s.z.clone()) for s in dec.states]
        want, _ = autocast_reference(model, tok, states, pos + dec._steps - 1)
        stale, _ = autocast_reference(old, tok, states, pos + dec._steps - 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = dec.step(tok)
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)
        assert (stale.float() - want.float()).abs().max() > 0.2  # the old weights give other logits

    old = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    with torch.enable_grad():
        model.train()
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        model.eval()
    check(old)
    old = copy.deepcopy(model)
    for p in model.parameters():
        p.data.mul_(-1.5)  # through .data: no version counter moves
    dec.refresh()
    check(old)


@torch.no_grad()
def test_the_compiled_step_under_autocast_runs_on_the_held_weights(monkeypatch):
    """compile=True under bfloat16 autocast: one compile, the eager Decoder's logits (both on the
    held bfloat16 weights)."""
    fresh_compiles(monkeypatch)
    model = tiny(position="rope")
    ids, mask, _ = ragged()
    dec, eager = Decoder(model, 3, 20, compile=True), Decoder(model, 3, 20, compile=False)
    n0 = decode_step._graphs_compiled()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tok = dec.prefill(ids, mask).argmax(-1)
        eager.prefill(ids, mask)
        for _ in range(3):
            got, want = dec.step(tok), eager.step(tok)
            assert got.dtype == torch.bfloat16 and dec._w is not None
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert decode_step._graphs_compiled() - n0 == 1
