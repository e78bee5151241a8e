"""performer-pytorch's PerformerLM in ours (linear_rope/from_performer.py): its keywords, its weights and
logits, the keyword tables of docs/performer-pytorch.md, and ``--init-from`` from a converted model."""
from __future__ import annotations

import contextlib
import functools
import inspect
import io
import json
from pathlib import Path

import pytest
import torch

from linear_rope import PerformerLM, from_performer_kwargs, from_performer_pytorch, load_run
from linear_rope import from_performer as conv
from linear_rope.enwik8 import train
from linear_rope.enwik8.checkpoint import latest_checkpoint, load_checkpoint
from linear_rope.enwik8.config import TrainConfig, resume_diffs
from linear_rope.model import ModelConfig

P = pytest.importorskip("performer_pytorch.performer_pytorch")
ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(num_tokens=256, max_seq_len=64, dim=32, depth=2, heads=2, dim_head=16)  # m = int(16 ln 16) = 44

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def theirs(seed: int = 0, **kw):
    torch.manual_seed(seed)
    with contextlib.redirect_stdout(io.StringIO()):  # its note that the CUDA causal kernel is missing
        return P.PerformerLM(**{**SMALL, **kw}).eval()


@contextlib.contextmanager
def without_eps(model, monkeypatch):
    """Its feature eps (1e-4) and causal denominator eps (1e-6) at 0: then it computes what ours does."""
    monkeypatch.setattr(P, "softmax_kernel", functools.partial(P.softmax_kernel, eps=0.0))
    for m in model.modules():
        if isinstance(m, P.FastAttention) and m.causal:
            monkeypatch.setattr(m, "causal_linear_fn", functools.partial(P.causal_linear_attention_noncuda, eps=0.0))
    yield


CASES = [pytest.param(c, r, id=f"{'causal' if c else 'bidirectional'}-{'rotary' if r else 'learned'}")
         for c in (False, True) for r in (False, True)]


@pytest.mark.parametrize("causal, rotary", CASES)
def test_converted_logits_are_its_logits(causal, rotary, monkeypatch):
    """float64, N = 37: within 1e-10 (learned table) or 1e-6 (rotary: its float32 sinusoid tables)
    with its eps at 0; within 2e-2 with its eps as it is, at its initialisation (measured 7e-4 to
    5e-3 here; docs/performer-pytorch.md)."""
    pp = theirs(causal=causal, rotary_position_emb=rotary).double()
    ours = from_performer_pytorch(pp).double()
    assert ours.cfg.position == ("rope_pre" if rotary else "none") and ours.cfg.causal == causal
    assert ours.cfg.input_pos == ("sinusoidal" if rotary else "learned") and ours.cfg.head_bias
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, as_is = ours(ids), pp(ids)
        torch.testing.assert_close(got, as_is, rtol=0, atol=2e-2)
        with without_eps(pp, monkeypatch):
            torch.testing.assert_close(got, pp(ids), rtol=0, atol=1e-6 if rotary else 1e-10)


def test_a_state_dict_with_its_keywords_converts_as_the_model_does(tmp_path):
    pp = theirs(causal=True)
    torch.save(pp.state_dict(), tmp_path / "theirs.pt")
    sd = torch.load(tmp_path / "theirs.pt", weights_only=True)
    a, b = from_performer_pytorch(pp), from_performer_pytorch(sd, causal=True, **SMALL)
    assert a.cfg == b.cfg
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    with pytest.raises(ValueError, match="pass the ones its PerformerLM was built with"):
        from_performer_pytorch(sd)
    with pytest.raises(ValueError, match="not of a PerformerLM built with these keywords"):
        from_performer_pytorch(sd, **{**SMALL, "depth": 3})


def test_a_tied_head_is_copied(monkeypatch):
    pp = theirs(causal=True, tie_embed=True).double()
    ours = from_performer_pytorch(pp).double()
    assert not ours.cfg.head_bias and torch.equal(ours.head.weight, ours.tok_emb.weight)
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad(), without_eps(pp, monkeypatch):
        torch.testing.assert_close(ours(ids), pp(ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("position", ["rope", "rope_norm", "none"])
def test_every_position_keeps_every_weight(position):
    pp = theirs(causal=True)
    base, other = from_performer_pytorch(pp), from_performer_pytorch(pp, position=position)
    assert other.cfg.position == position and other.cfg.input_pos == "sinusoidal"
    a, b = base.state_dict(), other.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        assert not torch.allclose(base(ids), other(ids))


REFUSED = [("reversible", True), ("local_attn_heads", 1), ("local_window_size", 128), ("axial_position_emb", True),
           ("axial_position_shape", (2, 32)), ("shift_tokens", True), ("ff_glu", True), ("qkv_bias", True),
           ("generalized_attention", True), ("kernel_fn", torch.nn.GELU()), ("use_scalenorm", True),
           ("use_rezero", True), ("cross_attend", True), ("no_projection", True), ("tie_embed", True)]


@pytest.mark.parametrize("name, value", REFUSED, ids=[n for n, _ in REFUSED])
def test_a_keyword_ours_cannot_honour_is_refused_in_one_line(name, value, monkeypatch):
    monkeypatch.setattr(conv, "PerformerLM", None)  # refused before anything of ours is built
    with pytest.raises(ValueError, match=rf"^{name}=.*not supported by linear_rope") as e:
        from_performer_kwargs(**SMALL, **{name: value})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw, match", [
    (dict(num_tokens=300), r"^num_tokens=300: not supported"),
    (dict(emb_dropout=0.1), r"^emb_dropout, ff_dropout, attn_dropout: ours has one dropout"),
    (dict(bogus=1), r"^bogus: not a keyword of performer-pytorch's PerformerLM"),
    (dict(heads=None), r"heads must be"),
], ids=["num_tokens", "dropouts", "unknown", "heads"])
def test_other_refusals(kw, match):
    args = {**SMALL, **kw}
    if kw.get("heads", 0) is None:
        del args["heads"]
        match = r"^heads: performer-pytorch's PerformerLM needs it"
    with pytest.raises(ValueError, match=match):
        from_performer_kwargs(**args)


@pytest.mark.parametrize("kw", [dict(reversible=True), dict(local_attn_heads=1), dict(rotary_position_emb=False,
                                axial_position_emb=True, axial_position_shape=(2, 32))],
                         ids=["reversible", "local_attn_heads", "axial_position_emb"])
def test_its_models_that_cannot_cross_are_refused_before_anything_is_built(kw, monkeypatch):
    pp = theirs(**kw)
    sd = pp.state_dict()
    monkeypatch.setattr(conv, "PerformerLM", None)
    @functools.wraps(P.PerformerLM.__init__)
    def built(*args, **kwargs):
        raise AssertionError("its model was built")

    monkeypatch.setattr(P.PerformerLM, "__init__", built)  # a state dict's keywords: refused before its model is built
    name = next(iter(k for k in kw if k != "rotary_position_emb"))
    for call in (lambda: from_performer_pytorch(pp), lambda: from_performer_pytorch(sd, **SMALL, **kw)):
        with pytest.raises(ValueError, match=rf"^{name}=.*not supported"):
            call()


def test_its_keywords_build_ours():
    """Each keyword where LM_KEYWORDS says it goes."""
    lm = from_performer_kwargs(**SMALL, causal=True, nb_features=32, feature_redraw_interval=None, ff_mult=2,
                               emb_dropout=0.1, ff_dropout=0.1, attn_dropout=0.1, ff_chunks=4, attn_out_bias=True)
    assert isinstance(lm, PerformerLM)
    want = dict(vocab_size=256, dim=32, depth=2, heads=2, dim_head=16, nb_features=32, seq_len=64, position="rope_pre",
                ff_mult=2, dropout=0.1, feature_redraw_interval=0, causal=True, input_pos="sinusoidal", head_bias=True)
    assert {k: getattr(lm.cfg, k) for k in want} == want
    assert from_performer_kwargs(**SMALL).cfg.nb_features == 44 and not from_performer_kwargs(**SMALL).cfg.causal
    assert from_performer_kwargs(**SMALL, position="rope").cfg.position == "rope"
    assert from_performer_kwargs(**SMALL, rotary_position_emb=False).cfg.input_pos == "learned"
    assert from_performer_kwargs(**SMALL, auto_check_redraw=False).cfg.feature_redraw_interval == 0
    layer = conv.attention_from_performer_kwargs(dim=32, heads=2, dim_head=16, causal=True, dropout=0.1)
    assert (layer.heads, layer.dim_head, layer.causal, layer.position, layer.features.out_features) == \
        (2, 16, True, "none", 44)
    with pytest.raises(ValueError, match="^qkv_bias=True: not supported"):
        conv.attention_from_performer_kwargs(dim=32, qkv_bias=True)


def test_its_selfattention_is_our_layer(monkeypatch):
    """Its SelfAttention and ours from its keywords, its weights moved: the same outputs (eps at 0)."""
    torch.manual_seed(0)
    kw = dict(dim=32, heads=2, dim_head=16, causal=True, attn_out_bias=True)
    sa, ours = P.SelfAttention(**kw).double(), conv.attention_from_performer_kwargs(**kw).double()
    with torch.no_grad():
        ours.to_qkv.weight.copy_(torch.cat([sa.to_q.weight, sa.to_k.weight, sa.to_v.weight]))
        ours.to_out.load_state_dict(sa.to_out.state_dict())
        ours.features.projection.copy_(sa.fast_attention.projection_matrix)
        x = torch.randn(2, 23, 32, dtype=torch.float64)
        with without_eps(sa, monkeypatch):
            torch.testing.assert_close(ours(x), sa(x), rtol=0, atol=1e-10)


def test_the_docs_tables_are_the_mapping():
    """docs/performer-pytorch.md holds ``keyword_tables()`` verbatim, and each table names every
    keyword of performer-pytorch's class, and nothing else."""
    assert conv.keyword_tables() in (ROOT / "docs" / "performer-pytorch.md").read_text()
    for cls, table in conv.KEYWORD_TABLES.items():
        sig = [n for n in inspect.signature(getattr(P, cls).__init__).parameters if n != "self"]
        assert sorted(table) == sorted(sig), cls
    assert "performer-pytorch.md" in next(ln for ln in (ROOT / "README.md").read_text().splitlines()
                                          if "performer-pytorch users" in ln)


def test_a_bidirectional_model_does_not_decode():
    ours = from_performer_pytorch(theirs())
    with pytest.raises(ValueError, match="bidirectional model"):
        ours.generate(b"ab", 2)


def test_runs_written_before_the_new_fields_resume():
    old = {"model": {k: v for k, v in vars(ModelConfig()).items() if k not in ("causal", "input_pos", "head_bias")},
           "train": vars(TrainConfig())}
    assert resume_diffs(old, ModelConfig(), TrainConfig()) == []
    assert resume_diffs(old, ModelConfig(causal=False), TrainConfig()) == ["causal: checkpoint True, now False"]


def run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = train.main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def test_init_from_a_converted_model_trains_eq19(tmp_path, corpus, monkeypatch):
    """Its model -> our checkpoint (the CLI) -> ``--variants rope --init-from``: 20 steps from its
    weights, with its projections (no redraw before step 1000) and its sinusoid table."""
    kw = {**SMALL, "max_seq_len": 32, "causal": True}
    pp = theirs(**kw)
    torch.save(pp.state_dict(), tmp_path / "theirs.pt")
    with contextlib.redirect_stdout(io.StringIO()):
        assert conv.main([str(tmp_path / "theirs.pt"), "--kwargs", json.dumps(kw), "--out", str(tmp_path / "conv")]) == 0
    converted = load_run(tmp_path / "conv")
    assert converted.cfg == from_performer_pytorch(pp).cfg
    with pytest.raises(ValueError, match="already holds checkpoints"):
        conv.save_converted(converted, tmp_path / "conv")
    common = ["--preset", "tiny", "--variants", "rope", "--init-from", str(tmp_path / "conv"), "--data", str(corpus),
              "--data-dir", str(tmp_path / "data"), "--eval-every", "0"]
    code, err = run(common + ["--steps", "20", "--out", str(tmp_path / "runs")])
    assert code == 0, err
    ckpt = load_checkpoint(latest_checkpoint(tmp_path / "runs" / "rope-seed0"))
    assert ckpt["step"] == 20 and ckpt["config"]["train"]["init_from"] == str(tmp_path / "conv")
    assert ckpt["config"]["model"] == {**vars(converted.cfg), "position": "rope"}
    sd, init = ckpt["model"], converted.state_dict()
    assert torch.equal(sd["blocks.0.attn.features.projection"], init["blocks.0.attn.features.projection"])
    assert torch.equal(sd["pos_emb.weight"], init["pos_emb.weight"])  # a buffer: not trained
    assert not torch.equal(sd["blocks.0.attn.to_qkv.weight"], init["blocks.0.attn.to_qkv.weight"])
    code, err = run(common + ["--steps", "1", "--dim", "64", "--out", str(tmp_path / "bad")])
    assert code == 2 and err.count("\n") == 1 and "its weights do not fit this model (tok_emb.weight is [256, 32]" in err


def test_init_from_a_bidirectional_model_needs_causal(tmp_path, corpus):
    conv.save_converted(from_performer_pytorch(theirs(max_seq_len=32)), tmp_path / "conv")
    code, err = run(["--preset", "tiny", "--variants", "rope", "--init-from", str(tmp_path / "conv"), "--data",
                     str(corpus), "--out", str(tmp_path / "runs"), "--steps", "1"])
    assert code == 2 and "causal False: a bidirectional model sees the byte it is trained to predict" in err


def test_a_bidirectional_model_is_no_hugging_face_causal_lm():
    pytest.importorskip("transformers", reason="the hf extra (transformers)")
    import linear_rope.hf as hf
    with pytest.raises(ValueError, match="^causal must be True for a causal LM"):
        hf.LinearRopeConfig(causal=False)


def test_dim_head_none_is_dim_over_heads_as_there():
    assert from_performer_kwargs(**{**SMALL, "dim_head": None}).cfg.dim_head == 16
