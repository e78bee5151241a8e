"""linear_rope.hf: every PerformerLM variant as a Hugging Face causal LM (tiny preset, CPU).

Greedy ``generate`` equals ``PerformerLM.generate`` token for token, left-padded batches equal
each prompt alone, sampling follows the same draws, beam search on the recurrent cache equals
beam search recomputing every prefix, the loss is the trainer's, ``save_pretrained`` /
``from_pretrained`` round-trip bit for bit in safetensors (and load offline in a fresh
interpreter after ``import linear_rope.hf``, or with ``trust_remote_code=True`` and no import), an
exported training run reproduces its val BPC, a cache of a prompt's prefix continues where it
ends, and what cannot be right (weights a folder lacks, ids past the bytes, positions past the
``absolute`` table) is refused in one line.
Skipped when transformers is not installed (``pip install -e ".[hf]"``).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline  # noqa: E402

from linear_rope import PerformerLM  # noqa: E402
from linear_rope.hf import ByteTokenizer, LinearRopeConfig, LinearRopeForCausalLM, RecurrentCache  # noqa: E402
from linear_rope.hf.modeling import _CACHE_FIELD  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["rope", "rope_pre", "rope_norm", "none", "softmax", "absolute"]
PROMPTS = [b"The ", b"Rotary position ", b"x"]  # ragged: left padding of 12 and 15 bytes
NEW = 8


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one thread for small sizes


def tiny(position: str, seed: int = 0) -> PerformerLM:
    torch.manual_seed(seed)
    return PerformerLM.from_preset("tiny", position=position).eval()


def encode(prompts):
    return ByteTokenizer()([p.decode() for p in prompts], return_tensors="pt", padding=True)


def new_bytes(out: torch.Tensor) -> list[bytes]:
    return [bytes(row[-NEW:].tolist()) for row in out]


@pytest.mark.parametrize("position", VARIANTS)
def test_greedy_generate_equals_performer_lm_and_batched_equals_alone(position):
    lm = tiny(position)
    hf = LinearRopeForCausalLM.from_performer(lm)
    want = lm.generate(PROMPTS, NEW, top_k=1)
    batched = new_bytes(hf.generate(**encode(PROMPTS), max_new_tokens=NEW, do_sample=False))
    assert batched == want
    for prompt, row in zip(PROMPTS, batched):
        assert new_bytes(hf.generate(**encode([prompt]), max_new_tokens=NEW, do_sample=False)) == [row]
    assert len(set(b"".join(want))) > 3, "a degenerate model (one byte repeated) would prove little"


@pytest.mark.parametrize("position", ["rope", "softmax"])
def test_sampling_draws_what_performer_lm_draws(position):
    """Temperature 1 and top-k: the same probabilities, so the same multinomial draws from the
    same global RNG state."""
    lm = tiny(position)
    hf = LinearRopeForCausalLM.from_performer(lm)
    torch.manual_seed(7)
    want = lm.generate(PROMPTS, NEW, top_k=40)
    torch.manual_seed(7)
    got = hf.generate(**encode(PROMPTS), max_new_tokens=NEW, do_sample=True, top_k=40, top_p=1.0, temperature=1.0)
    assert new_bytes(got) == want
    torch.manual_seed(8)  # PerformerLM.generate's defaults (temperature 1, every byte): top_k=0 here
    want = lm.generate(PROMPTS, NEW)
    torch.manual_seed(8)
    assert new_bytes(hf.generate(**encode(PROMPTS), max_new_tokens=NEW, do_sample=True, top_k=0)) == want


@pytest.mark.parametrize("position", ["rope_norm", "softmax"])
def test_beam_search_reorders_the_recurrent_cache(position, monkeypatch):
    """Beam search on the cache (reordered as beams are picked) equals beam search that
    recomputes every prefix from scratch (``use_cache=False``); without the reordering it does not."""
    hf = LinearRopeForCausalLM.from_performer(tiny(position, seed=1))
    enc = encode(PROMPTS[:2])
    kw = dict(max_new_tokens=NEW, num_beams=4, num_return_sequences=2, do_sample=False)
    cached = hf.generate(**enc, **kw)
    assert torch.equal(cached, hf.generate(**enc, use_cache=False, **kw))
    monkeypatch.setattr(RecurrentCache, "reorder_cache", lambda self, beam_idx: None)
    assert not torch.equal(cached, hf.generate(**enc, **kw))


@pytest.mark.parametrize("position", ["rope", "rope_pre", "softmax"])
def test_cache_continues_a_padded_batch_as_one_forward(position):
    """Prompt under a left-padding mask, then the rest through the cache, token by token, with a
    padded token in the middle of one row: the real tokens' logits equal one masked forward
    (float64)."""
    hf = LinearRopeForCausalLM.from_performer(tiny(position).double())
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (3, 14), generator=g)
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[0, :5] = 0
    mask[2, 10] = 0  # padding inside the continuation: it must leave row 2's state as it was
    full = hf(input_ids=ids, attention_mask=mask).logits
    first = hf(input_ids=ids[:, :8], attention_mask=mask[:, :8], use_cache=True)
    cache = getattr(first, _CACHE_FIELD)
    assert isinstance(cache, RecurrentCache) and cache.positions.tolist() == [3, 8, 8]
    rest = hf(input_ids=ids[:, 8:], attention_mask=mask, past_key_values=cache, use_cache=True).logits
    real = mask.bool()
    torch.testing.assert_close(torch.cat((first.logits, rest), 1)[real], full[real], rtol=1e-10, atol=1e-10)
    assert cache.positions.tolist() == [9, 14, 13]


def test_loss_equals_the_trainer_loss():
    """The trainer's loss on a batch of crops (x, y): cross_entropy(lm(x), y). With
    ``labels = input_ids`` over the crop (x and y's last byte), the model shifts inside."""
    from linear_rope.enwik8 import data

    torch.manual_seed(0)
    lm = PerformerLM.from_preset("tiny", position="rope_norm").double().train()  # dropout 0: train mode is fine
    hf = LinearRopeForCausalLM.from_performer(lm)
    corpus = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(1)).to(torch.uint8).numpy()
    x, y = data.crops(corpus, torch.tensor([0, 17, 999, 4000]), lm.cfg.seq_len)
    trainer_loss = F.cross_entropy(lm(x).float().flatten(0, 1), y.flatten())
    crop = torch.cat((x, y[:, -1:]), 1)
    out = hf(input_ids=crop, labels=crop)
    torch.testing.assert_close(out.loss, trainer_loss.to(out.loss.dtype), rtol=1e-6, atol=0)
    # padding labelled -100 is ignored, and num_items_in_batch (HF's Trainer) gives the sum over it
    labels = crop.clone()
    labels[0, :10] = -100
    summed = hf(input_ids=crop, labels=labels, num_items_in_batch=1).loss
    mean = hf(input_ids=crop, labels=labels).loss
    torch.testing.assert_close(summed, mean * (labels[:, 1:] != -100).sum(), rtol=1e-10, atol=0)


@pytest.mark.parametrize("position", ["rope_norm", "softmax"])
def test_save_and_load_round_trip_bitwise_in_safetensors(position, tmp_path):
    lm = tiny(position)
    with torch.no_grad():  # trained-looking weights: nothing left at its initial value
        for p in lm.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    hf = LinearRopeForCausalLM.from_performer(lm)
    hf.save_pretrained(tmp_path)
    ByteTokenizer().save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    assert (tmp_path / "modeling_linear_rope.py").is_file()  # and auto_map: trust_remote_code loads it
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == \
        "modeling_linear_rope.LinearRopeForCausalLM"
    assert "AutoTokenizer" in json.loads((tmp_path / "tokenizer_config.json").read_text())["auto_map"]
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(back) is LinearRopeForCausalLM and back.config.to_model_config() == lm.cfg
    want, got = hf.state_dict(), back.state_dict()
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    ids = encode(PROMPTS)
    assert torch.equal(back(**ids).logits, hf(**ids).logits)
    assert type(AutoTokenizer.from_pretrained(tmp_path)) is ByteTokenizer


def test_auto_classes_load_offline_in_a_fresh_interpreter_and_pipeline_generates(tmp_path):
    """A new process, offline, whose only linear_rope import is ``linear_rope.hf``: the Auto
    classes load the folder and ``pipeline("text-generation")`` continues a prompt as
    ``PerformerLM.generate`` does."""
    lm = tiny("rope")
    LinearRopeForCausalLM.from_performer(lm).save_pretrained(tmp_path)
    ByteTokenizer().save_pretrained(tmp_path)
    code = (
        "import json, sys, linear_rope.hf\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "text = pipeline('text-generation', model=model, tokenizer=tok)('The ', max_new_tokens=8, do_sample=False)\n"
        "print(json.dumps([type(model).__name__, type(tok).__name__, text[0]['generated_text']]))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    model, tok, text = json.loads(res.stdout.strip().splitlines()[-1])
    assert (model, tok) == ("LinearRopeForCausalLM", "ByteTokenizer")
    want = b"The " + lm.generate(b"The ", 8, top_k=1)
    assert text == want.decode("utf-8", errors="replace")


def test_registered_with_the_auto_classes():
    fields = {k: v for k, v in LinearRopeConfig.from_preset("tiny").to_dict().items() if k != "model_type"}
    cfg = AutoConfig.for_model("linear_rope", **fields)
    assert type(cfg) is LinearRopeConfig and (cfg.hidden_size, cfg.num_hidden_layers) == (32, 2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    assert type(model) is LinearRopeForCausalLM
    torch.manual_seed(0)
    fresh = PerformerLM.from_preset("tiny")  # PerformerLM's own initialisation, untouched by transformers
    for name, t in fresh.state_dict().items():
        assert torch.equal(model.model.state_dict()[name], t), name


@pytest.mark.parametrize("kw, match", [
    (dict(inputs_embeds=torch.zeros(1, 3, 32)), "inputs_embeds"),
    (dict(attention_mask=torch.ones(2, 3)), r"attention_mask must be \[B=1"),
    (dict(past_key_values=("not", "a cache")), "past_key_values must be a RecurrentCache"),
    (dict(labels=torch.zeros(1, 4, dtype=torch.long)), "labels must have input_ids' shape"),
])
def test_bad_forward_arguments_are_one_line_errors(kw, match):
    hf = LinearRopeForCausalLM.from_performer(tiny("rope"))
    with pytest.raises(ValueError, match=match):
        hf(input_ids=torch.tensor([[1, 2, 3]]), **kw)
    with pytest.raises(ValueError, match="position must be one of"):
        LinearRopeConfig(position="alibi")


# --- python -m linear_rope.export --------------------------------------------------------------

def run_export(argv, capsys) -> tuple[int, str]:
    from linear_rope import export

    code = export.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_exported_run_reproduces_the_runs_val_bpc(corpus, tmp_path, capsys):
    """A tiny training run (FAVOR+ redrawn every 2 steps: the exported projections must be the
    run's last ones), exported, loaded with AutoModelForCausalLM: its BPC over the whole
    validation split, computed as the trainer computes it, is the checkpoint's val BPC."""
    import numpy as np

    from linear_rope.enwik8 import data
    from linear_rope.enwik8.config import TrainConfig
    from linear_rope.enwik8.trainer import Trainer
    from linear_rope.model import MODEL_PRESETS, ModelConfig

    raw = np.frombuffer(corpus.read_bytes(), dtype=np.uint8)
    splits = {"train": raw[:50_000], "valid": raw[50_000:53_001], "test": raw[53_001:55_000]}
    mc = ModelConfig(**{**MODEL_PRESETS["tiny"], "position": "rope", "feature_redraw_interval": 2})
    tc = TrainConfig(steps=5, batch_size=4, warmup_steps=1, eval_every=0, log_every=5, eval_batch_size=64,
                     out=str(tmp_path / "runs"))
    result = Trainer("rope-seed0", mc, tc, splits).fit()
    code, err = run_export([tmp_path / "runs" / "rope-seed0", tmp_path / "hf"], capsys)
    assert code == 0, err
    assert "exported rope-seed0/ckpt-00000005.pt (step 5, val bpc" in err
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.linear_rope_run["val_bpc"] == result["val_bpc"]
    nats, n = 0.0, 0
    with torch.no_grad():
        for x, y in data.eval_batches(splits["valid"], mc.seq_len, tc.eval_batch_size):
            logits = model(input_ids=x).logits
            nats += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").double().item()
            n += y.numel()
    assert n == len(splits["valid"]) - 1
    assert math.isclose(nats / n / math.log(2), result["val_bpc"], rel_tol=1e-9)


def test_export_refuses_bad_input_with_one_line_exit_2(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    code, err = run_export([run, tmp_path / "out"], capsys)
    assert code == 2 and err.count("\n") == 1 and "no checkpoint in" in err
    torch.save({"model": {}, "step": 1, "config": {}}, run / "ckpt-00000001.pt")
    whole = (run / "ckpt-00000001.pt").read_bytes()
    (run / "ckpt-00000001.pt").write_bytes(whole[: len(whole) // 2])  # truncated
    code, err = run_export([run, tmp_path / "out"], capsys)
    assert code == 2 and err.count("\n") == 1 and "corrupt" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))  # nothing half-written
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    code, err = run_export([run, busy], capsys)
    assert code == 2 and err.count("\n") == 1 and "is not empty" in err and (busy / "keep.txt").read_text() == "mine"
    with pytest.raises(SystemExit) as e:
        run_export([run], capsys)
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1  # argparse: one line too
    monkeypatch.setitem(sys.modules, "linear_rope.hf.export", None)  # as without transformers
    code, err = run_export([run, tmp_path / "out"], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("python -m linear_rope.export: error:")


def test_the_docs_example_runs(tmp_path, capsys):
    """docs/hf.md's "Load and generate" block, on a tiny exported model in place of a run."""
    import re

    LinearRopeForCausalLM.from_performer(tiny("rope")).save_pretrained(tmp_path / "hf")
    ByteTokenizer().save_pretrained(tmp_path / "hf")
    doc = (ROOT / "docs" / "hf.md").read_text().split("## Load and generate", 1)[1]
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    assert code.count('"hf/rope-seed0"') == 2
    exec(compile(code.replace('"hf/rope-seed0"', repr(str(tmp_path / "hf"))), "docs/hf.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "The " in printed and "Rotary position " in printed and "generated_text" in printed


# --- a prefix cache, missing weights, ids past the bytes, the absolute table ---------------------

@pytest.mark.parametrize("position", ["rope", "softmax"])
def test_generate_continues_a_cache_of_the_prompts_prefix(position):
    """transformers' prefix-cache pattern: ``generate(input_ids=prompt, past_key_values=cache)``
    with a cache of the prompt's first 9 columns reads columns 9..18 from it, then decodes: the
    logits of every step equal generate() without a cache (float64), in a left-padded batch."""
    hf = LinearRopeForCausalLM.from_performer(tiny(position).double())
    ids = torch.randint(1, 256, (2, 19), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # row 1 is left-padded
    kw = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = hf.generate(input_ids=ids, attention_mask=mask, **kw)
    cache = getattr(hf(input_ids=ids[:, :9], attention_mask=mask[:, :9], use_cache=True), _CACHE_FIELD)
    got = hf.generate(input_ids=ids, attention_mask=mask, **{_CACHE_FIELD: cache}, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert cache.seen == 19 + NEW - 1 and cache.positions.tolist() == [19 + NEW - 1, 15 + NEW - 1]
    whole = getattr(hf(input_ids=ids, attention_mask=mask, use_cache=True), _CACHE_FIELD)
    with pytest.raises(ValueError, match="has read 19 tokens and the input holds 19"):
        hf.generate(input_ids=ids, attention_mask=mask, **{_CACHE_FIELD: whole}, max_new_tokens=2, do_sample=False)


def drop_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(folder / "model.safetensors")
    del sd["model.blocks.1.ff.2.weight"]
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})


def edit_config(**changes):
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
    return edit


@pytest.mark.parametrize("damage, text", [
    (drop_tensor, "1 missing (model.blocks.1.ff.2.weight)"),
    (edit_config(depth=3), "(depth 3, but the weights hold 2 blocks)"),
    (edit_config(position="absolute"), "1 missing (model.pos_emb.weight)"),
    (edit_config(depth=1), "(depth 1, but the weights hold 2 blocks)"),
    (edit_config(position="softmax"), "2 unexpected (model.blocks.0.attn.features.projection"),
    (edit_config(heads=4), "blocks.0.attn.to_qkv.weight should be [96, 32], is [48, 32]"),
], ids=["tensor-removed", "depth-3", "absolute", "depth-1", "softmax", "heads-4"])
def test_weights_the_folder_lacks_are_refused_not_left_uninitialised(tmp_path, damage, text, monkeypatch):
    """A weight ``from_pretrained`` cannot find was left as allocated (NaN, 6e19 or 0): the
    folder is refused in one line instead, naming both files, through the Auto class too, and
    before the model is built (from the weights' headers)."""
    from linear_rope.hf import modeling

    LinearRopeForCausalLM.from_performer(tiny("rope")).save_pretrained(tmp_path)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is LinearRopeForCausalLM  # intact: loads
    damage(tmp_path)
    built = []
    monkeypatch.setattr(modeling, "PerformerLM", lambda *a, **k: built.append(1))
    for load in (AutoModelForCausalLM.from_pretrained, LinearRopeForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match="its weights do not match") as e:
            load(tmp_path)
        assert text in str(e.value) and "\n" not in str(e.value)
        assert f"{tmp_path / 'model.safetensors'}: its weights do not match {tmp_path / 'config.json'}" in str(e.value)
    assert built == []


def test_ids_stay_bytes():
    """A vocabulary past 256 is refused (generate returns bytes), and the tokenizer refuses to
    decode an id that is not a byte instead of dropping it."""
    from linear_rope.model import ModelConfig

    for make in (lambda: ModelConfig(vocab_size=300), lambda: LinearRopeConfig.from_preset("tiny", vocab_size=257)):
        with pytest.raises(ValueError, match="vocab_size must be <= 256"):
            make()
    tok = ByteTokenizer()
    assert tok.decode([72, 105]) == "Hi"
    with pytest.raises(ValueError, match="token id 300 is not a byte"):
        tok.decode([72, 300, 105])
    assert tok.convert_tokens_to_ids(["H", "\xff"]) == [72, 255]
    with pytest.raises(ValueError, match="token 'ab' is not a byte"):  # was: the pad id, 0, in silence
        tok.convert_tokens_to_ids(["ab"])
    tok.add_special_tokens({"eos_token": "<eos>"})  # an added token's id is past the bytes: the model refuses it
    hf = LinearRopeForCausalLM.from_performer(tiny("rope"))
    with pytest.raises(ValueError, match=r"input_ids: 1 id\(s\) outside \[0, vocab_size=256\): 256"):
        hf(**tok(["Hi<eos>"], return_tensors="pt"))


def test_the_absolute_table_is_refused_up_front(monkeypatch):
    """Prompt 19 + 14 new tokens reads positions 0..31 of a 32-row table: it decodes. One more
    token is refused before anything is read (as ``PerformerLM.generate`` refuses it), however
    the length is given; a cache fed past the table by hand is refused from the lengths."""
    hf = LinearRopeForCausalLM.from_performer(tiny("absolute"))
    ids = torch.randint(1, 256, (1, 19), generator=torch.Generator().manual_seed(5))
    want = hf.model.generate(bytes(ids[0].tolist()), 14, top_k=1)
    assert bytes(hf.generate(input_ids=ids, max_new_tokens=14, do_sample=False)[0, 19:].tolist()) == want
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf.model.generate(bytes(ids[0].tolist()), 15, top_k=1)
    calls = []
    monkeypatch.setattr(hf.model, "forward", lambda *a, **k: calls.append(1))
    for kw in (dict(max_new_tokens=15), dict(max_length=34)):
        with pytest.raises(ValueError, match="the absolute variant cannot go past seq_len=32"):
            hf.generate(input_ids=ids, do_sample=False, **kw)
    assert calls == []
    monkeypatch.undo()
    cache = getattr(hf(input_ids=ids, use_cache=True), _CACHE_FIELD)
    hf(input_ids=ids[:, :13], past_key_values=cache)  # positions 19..31
    with pytest.raises(ValueError, match="32 tokens read and 1 more go past the absolute table of seq_len=32"):
        hf(input_ids=ids[:, :1], past_key_values=cache)


def test_trust_remote_code_loads_an_export_in_a_fresh_process_and_pipeline_is_greedy(corpus, tmp_path, capsys):
    """An exported run, in a new process that never imports ``linear_rope.hf`` itself: without
    ``trust_remote_code`` transformers asks for it (the folder names its code in ``auto_map``);
    with it the Auto classes load the folder, and ``pipeline("text-generation")`` with no
    decoding options decodes greedily (the folder's generation config says so), equal to
    ``PerformerLM.generate(top_k=1)``."""
    from linear_rope.enwik8 import sample

    lm = tiny("rope")
    torch.save({"model": lm.state_dict(), "step": 3, "config": {"model": lm.cfg.__dict__, "train": {}}},
               tmp_path / "ckpt-00000003.pt")
    code, err = run_export([tmp_path / "ckpt-00000003.pt", tmp_path / "hf"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["do_sample"] is False
    script = (
        "import json, sys\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline\n"
        "try:\n"
        "    AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "    refused = ''\n"
        "except ValueError as e:\n"
        "    refused = str(e)\n"
        # first, while only the remote code knows the model type: a config.json without rope_base
        "lacking = AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True)\n"
        "base = [lacking.config.rope_base, type(lacking.config).__module__.startswith('transformers_modules')]\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "text = pipeline('text-generation', model=model, tokenizer=tok)('The ', max_new_tokens=8)\n"
        "print('\\n' + json.dumps([type(model).__name__, type(tok).__name__, text[0]['generated_text'], refused, base]))\n"
    )
    import shutil

    shutil.copytree(tmp_path / "hf", tmp_path / "lacking")
    cfg = json.loads((tmp_path / "lacking" / "config.json").read_text())
    del cfg["rope_base"]
    (tmp_path / "lacking" / "config.json").write_text(json.dumps(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_HOME": str(tmp_path / "hf_home"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "hf"), str(tmp_path / "lacking")], env=env,
                         capture_output=True,
                         text=True, cwd=tmp_path, timeout=300, stdin=subprocess.DEVNULL)  # [y/N]: no
    assert res.returncode == 0, res.stderr[-3000:]
    model, tok, text, refused, base = json.loads(res.stdout.strip().splitlines()[-1])
    assert (model, tok) == ("LinearRopeForCausalLM", "ByteTokenizer")
    assert "trust_remote_code=True" in refused
    assert base == [10000.0, True]  # the remote code's class, with ModelConfig's default (was: AttributeError)
    want = b"The " + sample.load_model(tmp_path / "ckpt-00000003.pt").generate(b"The ", 8, top_k=1)
    assert text == want.decode("utf-8", errors="replace")


# --- configs under every name and on every entry point, inputs checked as PerformerLM's -----------

def remote_classes(folder: Path):
    """The classes ``trust_remote_code=True`` loads: the folder's ``modeling_linear_rope.py``,
    imported as transformers imports it (a subclass of the package's classes, with no ``__init__``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"remote_{abs(hash(str(folder)))}", folder / "modeling_linear_rope.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.LinearRopeConfig, mod.LinearRopeForCausalLM


def config_entry_points(folder: Path):
    """Every way a folder's config.json is read: the package's classes, the Auto classes, and
    the remote code's classes (those of ``trust_remote_code=True``)."""
    RemoteConfig, RemoteModel = remote_classes(folder)
    return {"LinearRopeConfig": lambda: LinearRopeConfig.from_pretrained(folder),
            "AutoConfig": lambda: AutoConfig.from_pretrained(folder),
            "remote config": lambda: RemoteConfig.from_pretrained(folder),
            "LinearRopeForCausalLM": lambda: LinearRopeForCausalLM.from_pretrained(folder).config,
            "AutoModelForCausalLM": lambda: AutoModelForCausalLM.from_pretrained(folder).config,
            "remote model": lambda: RemoteModel.from_pretrained(folder).config}


@pytest.mark.parametrize("field", ["rope_base", "dropout", "feature_redraw_interval", "qk_norm"])
def test_a_field_config_json_lacks_takes_its_default_on_every_entry_point(tmp_path, field):
    """A config.json without ``rope_base`` (or another field) loads with ModelConfig's default
    everywhere; the remote code's subclass (no ``__init__`` of its own: transformers 5 gave it a
    dataclass one that set nothing) raised AttributeError on the first read of the field."""
    from dataclasses import fields as dc_fields

    from linear_rope.model import ModelConfig

    lm = tiny("rope")
    LinearRopeForCausalLM.from_performer(lm).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg[field]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    default = {f.name: f.default for f in dc_fields(ModelConfig)}[field]
    for name, load in config_entry_points(tmp_path).items():
        got = load()
        assert getattr(got, field) == default, name
        assert got.to_model_config() == ModelConfig(**{**vars(lm.cfg), field: default}), name
    model = remote_classes(tmp_path)[1].from_pretrained(tmp_path)
    ids = encode(PROMPTS)
    assert torch.equal(model(**ids).logits, LinearRopeForCausalLM.from_performer(lm)(**ids).logits)


BAD_FIELDS = [  # (config.json changes, the start of the one line that refuses them)
    (dict(hidden_size=0, dim=None), "hidden_size (dim) must be >= 1, got 0"),
    (dict(num_hidden_layers=-1, depth=None), "num_hidden_layers (depth) must be >= 1, got -1"),
    (dict(num_attention_heads=0, heads=None), "num_attention_heads (heads) must be >= 1, got 0"),
    (dict(head_dim=7, dim_head=None, position="rope_pre"), "head_dim (dim_head): rope_pre rotates q and k"),
    (dict(rope_theta=-1.0, rope_base=None), "rope_theta (rope_base) must be a positive number"),
    (dict(rope_theta="1e4", rope_base=None), "rope_theta (rope_base) must be a float"),
    (dict(hidden_size=64), "hidden_size 64 and dim 32 disagree"),
    (dict(vocab_size=300), "vocab_size must be <= 256"),
    (dict(dim="32"), "dim must be an int"),
    (dict(dropout=1.5), "dropout must be in [0, 1)"),
    (dict(max_position_embeddings=64), "max_position_embeddings: LinearRopeConfig does not read it"),
    (dict(intermediate_size=128), "intermediate_size: LinearRopeConfig does not read it"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling: LinearRopeConfig does not read it"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings must be False"),
]


@pytest.mark.parametrize("changes, text", BAD_FIELDS, ids=[t.split(" ")[0].split(":")[0] for _, t in BAD_FIELDS])
def test_a_bad_field_under_any_name_is_refused_on_every_entry_point(tmp_path, changes, text):
    """transformers' names (hidden_size, rope_theta, ...) are checked as the fields they stand
    for, and the names this model does not read are refused, not ignored: in the constructor,
    when set later, and from a config.json on every entry point (one line naming the file)."""
    LinearRopeForCausalLM.from_performer(tiny("rope")).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **changes}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name, load in config_entry_points(tmp_path).items():
        with pytest.raises(ValueError) as e:
            load()
        assert str(e.value).startswith(f"{tmp_path / 'config.json'}: {text}"), (name, str(e.value))
        assert "\n" not in str(e.value)
    kwargs = {k: v for k, v in changes.items() if v is not None}
    if "disagree" in text:
        kwargs["dim"] = 32
    with pytest.raises(ValueError, match=re.escape(text.split(" (")[0])):
        LinearRopeConfig.from_preset("tiny", **kwargs)
    if len(kwargs) == 1 and "disagree" not in text:  # one field: set on a good config, refused the same
        cfg = LinearRopeConfig.from_preset("tiny")
        (key, value), = kwargs.items()
        with pytest.raises(ValueError, match=re.escape(text.split(" (")[0])):
            setattr(cfg, key, value)
        assert cfg.to_model_config() == LinearRopeConfig.from_preset("tiny").to_model_config()  # unchanged


def test_aliases_read_the_fields_they_name():
    """A config in transformers' names builds the model its fields name: rope_theta is the RoPE
    base the model rotates with (the same logits as rope_base, not a key stored and ignored)."""
    cfg = LinearRopeConfig.from_preset("tiny", hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                       head_dim=8, rope_theta=500.0)
    assert (cfg.dim, cfg.depth, cfg.heads, cfg.dim_head, cfg.rope_base) == (32, 3, 4, 8, 500.0)
    cfg.rope_theta = 20.0
    assert cfg.rope_base == 20.0 and cfg.hidden_size == 32
    torch.manual_seed(0)
    hf = LinearRopeForCausalLM(LinearRopeConfig.from_preset("tiny", rope_theta=20.0))
    torch.manual_seed(0)
    lm = PerformerLM.from_preset("tiny", rope_base=20.0)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(hf(input_ids=ids).logits, lm(ids))
    torch.manual_seed(0)
    assert not torch.equal(PerformerLM.from_preset("tiny")(ids), lm(ids))  # the base matters here


@pytest.mark.parametrize("changes, text", [
    (dict(depth=10**6), "depth 1000000, but the weights hold 2 blocks"),
    (dict(dim=None), "tok_emb.weight should be [256, 768], is [256, 32]"),
    (dict(nb_features=10**9), "nb_features 1000000000 needs more numbers than the weights hold"),
], ids=["depth-1e6", "dim-missing", "nb_features-1e9"])
def test_a_config_is_checked_against_its_weights_before_anything_is_built(tmp_path, changes, text, monkeypatch):
    """Nothing is built (not even on ``meta``) for a depth of 1e6 or an ``nb_features`` of 1e9;
    a field config.json lacks is named as the default the weights contradict; a keyword of
    from_pretrained is named as the cause."""
    from linear_rope import weights_fit
    from linear_rope.hf import modeling

    LinearRopeForCausalLM.from_performer(tiny("rope")).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in {**cfg, **changes}.items() if v is not None}))
    built = []
    monkeypatch.setattr(modeling, "PerformerLM", lambda *a, **k: built.append("model"))
    if "dim" not in changes:
        monkeypatch.setattr(weights_fit, "PerformerLM", lambda *a, **k: built.append("meta"))
    for name, load in config_entry_points(tmp_path).items():
        if "config" in name.lower() and "model" not in name.lower():
            continue  # a config alone describes no weights
        with pytest.raises(ValueError, match="its weights do not match") as e:
            load()
        msg = str(e.value)
        assert text in msg and str(tmp_path / "config.json") in msg and "\n" not in msg, (name, msg)
        assert ("it lacks dim, which took ModelConfig's defaults" in msg) == ("dim" in changes)
    assert built == []
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # intact again; a keyword is the cause now
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'config.json'} with dim=64 given")):
        LinearRopeForCausalLM.from_pretrained(tmp_path, dim=64)


BACKENDS = ["torch", "parallel", "auto"]
# Checks that read values (a host sync on a GPU): on by default for CPU tensors, where
# LINEAR_ROPE_BACKEND=parallel keeps the GPU's rule (off unless LINEAR_ROPE_CHECKS=1).
VALUE_CHECKS = ("id(s) outside", "must hold only 0 and 1", "label(s) outside", "must lie in [0, seen")


def bad_forward_inputs(hf):
    ids = torch.tensor([[1, 2, 3]])
    cache = getattr(hf(input_ids=ids, use_cache=True), _CACHE_FIELD)
    other = getattr(LinearRopeForCausalLM.from_performer(tiny("softmax"))(input_ids=ids, use_cache=True), _CACHE_FIELD)
    two = getattr(hf(input_ids=ids.repeat(2, 1), use_cache=True), _CACHE_FIELD)
    shifted = getattr(hf(input_ids=ids, use_cache=True), _CACHE_FIELD)
    shifted.positions = shifted.positions - 5
    return [
        (dict(input_ids=torch.tensor([[1, 256]])), "input_ids: 1 id(s) outside [0, vocab_size=256): 256"),
        (dict(input_ids=torch.tensor([[-1, 2]])), "input_ids: 1 id(s) outside [0, vocab_size=256): -1"),
        (dict(input_ids=torch.tensor([[1.0, 2.0]])), "input_ids must be an integer tensor [B, N]"),
        (dict(input_ids=torch.tensor([1, 2])), "input_ids must be an integer tensor [B, N]"),
        (dict(input_ids=[[1, 2]]), "input_ids must be an integer tensor [B, N]"),
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "input_ids must be an integer tensor [B, N] with N >= 1"),
        (dict(input_ids=ids, attention_mask=torch.tensor([[1, 2, 1]])), "attention_mask must hold only 0 and 1"),
        (dict(input_ids=ids, attention_mask=torch.tensor([[1.0, 0.5, 1.0]])), "attention_mask must hold only 0 and 1"),
        (dict(input_ids=ids, attention_mask=torch.tensor([[1.0, float("nan"), 1.0]])), "attention_mask must hold only 0 and 1"),
        (dict(input_ids=ids, attention_mask=torch.tensor([[1, -1, 1]])), "attention_mask must hold only 0 and 1"),
        (dict(input_ids=ids, attention_mask=torch.ones(1, 5)), r"attention_mask must be [B=1, 3]"),
        (dict(input_ids=ids, attention_mask=torch.ones(1, 1, 3)), r"attention_mask must be [B=1, 3]"),
        (dict(input_ids=ids, attention_mask=torch.ones(1, 3, dtype=torch.complex64)), "attention_mask must be a tensor of 0 and 1"),
        (dict(input_ids=ids, position_ids=torch.tensor([[5, 6, 7]])), "position_ids: row 0, column 0 is 5"),
        (dict(input_ids=ids, position_ids=torch.tensor([[0, 1]])), "position_ids must be an integer tensor [B=1, N=3]"),
        (dict(input_ids=ids, cache_position=torch.tensor([1, 2, 3])), "cache_position must be the columns read next, 0..2"),
        (dict(input_ids=ids, labels=torch.tensor([[1, 300, 2]])), "labels: 1 label(s) outside [0, vocab_size=256)"),
        (dict(input_ids=ids, labels=torch.tensor([[1.0, 3.0, 2.0]])), "labels must be an integer tensor"),
        (dict(input_ids=ids, atention_mask=torch.ones(1, 3)), "unexpected argument(s) ['atention_mask']"),
        (dict(input_ids=ids, output_hidden_states=True), "output_hidden_states: not available"),
        (dict(input_ids=ids, output_attentions=True), "output_attentions: not available"),
        (dict(input_ids=ids, token_type_ids=torch.zeros(1, 3, dtype=torch.long)), "token_type_ids"),
        (dict(input_ids=ids, logits_to_keep=1), "logits_to_keep"),
        (dict(input_ids=ids, use_cache="no"), "use_cache must be True, False or None"),
        (dict(input_ids=ids[:, :1], past_key_values=other), "past_key_values: layer 0 holds a KVCache"),
        (dict(input_ids=ids[:, :1], past_key_values=two), "past_key_values: its positions must be an integer tensor [B=1]"),
        (dict(input_ids=ids[:, :1], past_key_values=shifted), "past_key_values: positions -2 must lie in [0, seen=3]"),
        (dict(input_ids=ids[:, :1], past_key_values=cache, attention_mask=torch.ones(1, 3)),
         r"attention_mask must be [B=1, 1 or 4]"),
        (dict(input_ids=ids[:, :1], past_key_values=cache, cache_position=torch.tensor([0])),
         "cache_position must be the columns read next, 3..3"),
        (dict(input_ids=ids[:, :1], past_key_values=cache, position_ids=torch.tensor([[0]])),
         "position_ids: row 0, column 0 is 0, but the model reads that token at position 3"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_checks_its_inputs_as_performer_lm_does(backend, monkeypatch):
    """Every malformed input is a one-line ValueError naming it, on each backend; what passed
    before in silence (ids past the bytes: NaN logits; a mask of 2 or 0.5; position_ids the model
    does not use; an unknown keyword; a cache of another model) included. Under ``parallel`` (the
    GPU's rule) the value checks run with LINEAR_ROPE_CHECKS=1, and without it an id past the
    bytes gives NaN logits, as documented."""
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", backend)
    hf = LinearRopeForCausalLM.from_performer(tiny("rope"))
    for checks in (["0", "1"] if backend == "parallel" else ["0"]):
        monkeypatch.setenv("LINEAR_ROPE_CHECKS", checks)
        for kw, text in bad_forward_inputs(hf):
            if checks == "0" and backend == "parallel" and any(v in text for v in VALUE_CHECKS):
                continue
            with pytest.raises(ValueError) as e:
                hf(**kw)
            assert text in str(e.value) and "\n" not in str(e.value), (text, str(e.value))
    if backend == "parallel":
        monkeypatch.setenv("LINEAR_ROPE_CHECKS", "0")
        logits = hf(input_ids=torch.tensor([[1, 256]])).logits
        assert logits[0, 1].isnan().all()  # NaN, never a wrong finite value


@pytest.mark.parametrize("backend", BACKENDS)
def test_positions_given_are_exact_or_refused(backend, monkeypatch):
    """position_ids as transformers makes them (``mask.cumsum(-1) - 1``, padding anything) and
    cache_position of the columns read are accepted and change nothing; a mask of bool, int or
    float 0 / 1 gives the same logits (float64)."""
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", backend)
    hf = LinearRopeForCausalLM.from_performer(tiny("rope").double())
    ids = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    want = hf(input_ids=ids, attention_mask=mask).logits
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    for m in (mask, mask.bool(), mask.float()):
        got = hf(input_ids=ids, attention_mask=m, position_ids=pos, cache_position=torch.arange(9)).logits
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=0, atol=0)
    first = hf(input_ids=ids[:, :5], attention_mask=mask[:, :5], use_cache=True)
    cache = getattr(first, _CACHE_FIELD)
    rest = hf(input_ids=ids[:, 5:], attention_mask=mask, past_key_values=cache, position_ids=pos[:, 5:],
              cache_position=torch.arange(5, 9)).logits
    torch.testing.assert_close(rest, want[:, 5:], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="position_ids: row 0, column 3 is 1, but the model reads that token at position 0"):
        hf(input_ids=ids, attention_mask=mask, position_ids=torch.arange(9).expand(2, 9) - 2)


def test_generate_checks_its_prompt_as_performer_lm_does():
    """The prompt is read once, up front, on any device: ids past the bytes (greedy decoding
    took them silently; sampling died in torch.multinomial), a mask of 2, a row that ends in
    padding (it would continue from a pad), position_ids the model does not use, attentions
    asked for: one line each. position_ids as the mask gives them are accepted."""
    hf = LinearRopeForCausalLM.from_performer(tiny("rope"))
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    kw = dict(max_new_tokens=2, do_sample=False)
    cases = [
        (dict(input_ids=torch.tensor([[1, 300]])), "input_ids: 1 id(s) outside [0, vocab_size=256): 300"),
        (dict(input_ids=torch.tensor([[1, 300]]), do_sample=True), "input_ids: 1 id(s) outside"),
        (dict(input_ids=ids, attention_mask=torch.tensor([[1, 2, 1], [1, 1, 1]])), "attention_mask must hold only 0 and 1"),
        (dict(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]])), "attention_mask: row 1 ends in padding"),
        (dict(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])), "attention_mask: row 1 ends in padding"),
        (dict(input_ids=ids, position_ids=torch.tensor([[4, 5, 6], [0, 1, 2]])), "position_ids: row 0, column 0 is 4"),
        (dict(input_ids=ids, output_attentions=True, return_dict_in_generate=True), "output_attentions: not available"),
        (dict(input_ids=None), "input_ids is required"),
    ]
    for extra, text in cases:
        with pytest.raises(ValueError) as e:
            hf.generate(**{**kw, **extra})
        assert text in str(e.value) and "\n" not in str(e.value), (text, str(e.value))
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    want = hf.generate(input_ids=ids, attention_mask=mask, **kw)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    assert torch.equal(hf.generate(input_ids=ids, attention_mask=mask, position_ids=pos, **kw), want)


def test_a_keyword_of_from_pretrained_is_named_as_the_cause_not_the_file(tmp_path):
    LinearRopeForCausalLM.from_performer(tiny("rope")).save_pretrained(tmp_path)
    for load in (LinearRopeConfig.from_pretrained, AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained,
                 LinearRopeForCausalLM.from_pretrained):
        with pytest.raises(ValueError) as e:
            load(tmp_path, hidden_size=-1)
        assert str(e.value) == "hidden_size (dim) must be >= 1, got -1", str(e.value)
