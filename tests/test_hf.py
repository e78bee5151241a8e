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
    (edit_config(depth=3), "missing (model.blocks.2."),
    (edit_config(position="absolute"), "1 missing (model.pos_emb.weight)"),
    (edit_config(depth=1), "unexpected (model.blocks.1."),
], ids=["tensor-removed", "depth-3", "absolute", "depth-1"])
def test_weights_the_folder_lacks_are_refused_not_left_uninitialised(tmp_path, damage, text):
    """A weight ``from_pretrained`` cannot find was left as allocated (NaN, 6e19 or 0): the
    folder is refused in one line instead, through the Auto class too."""
    LinearRopeForCausalLM.from_performer(tiny("rope")).save_pretrained(tmp_path)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is LinearRopeForCausalLM  # intact: loads
    damage(tmp_path)
    for load in (AutoModelForCausalLM.from_pretrained, LinearRopeForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match="its weights do not match its config.json") as e:
            load(tmp_path)
        assert text in str(e.value) and "\n" not in str(e.value)


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
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "text = pipeline('text-generation', model=model, tokenizer=tok)('The ', max_new_tokens=8)\n"
        "print('\\n' + json.dumps([type(model).__name__, type(tok).__name__, text[0]['generated_text'], refused]))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_HOME": str(tmp_path / "hf_home"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "hf")], env=env, capture_output=True,
                         text=True, cwd=tmp_path, timeout=300, stdin=subprocess.DEVNULL)  # [y/N]: no
    assert res.returncode == 0, res.stderr[-3000:]
    model, tok, text, refused = json.loads(res.stdout.strip().splitlines()[-1])
    assert (model, tok) == ("LinearRopeForCausalLM", "ByteTokenizer")
    assert "trust_remote_code=True" in refused
    want = b"The " + sample.load_model(tmp_path / "ckpt-00000003.pt").generate(b"The ", 8, top_k=1)
    assert text == want.decode("utf-8", errors="replace")
