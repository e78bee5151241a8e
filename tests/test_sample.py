"""linear_rope.enwik8.sample: checkpoint loading, UTF-8 output with replacement, clean CLI errors."""
from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from linear_rope.enwik8 import sample
from linear_rope.model import MODEL_PRESETS, ModelConfig, PerformerLM


def save_model(path, model: PerformerLM):
    torch.save({"model": model.state_dict(), "step": 0, "config": {"model": asdict(model.cfg), "train": {}}}, path)


def forced_byte_model(byte: int) -> PerformerLM:
    """A tiny model whose logits favour ``byte`` whatever the input."""
    torch.manual_seed(0)
    model = PerformerLM(ModelConfig(**MODEL_PRESETS["tiny"]))
    with torch.no_grad():
        model.ln_f.weight.zero_()
        model.ln_f.bias.fill_(1.0)  # ln_f(x) = 1 for every token
        model.head.weight.zero_()
        model.head.weight[byte] = 1.0  # logit of `byte` = dim, every other logit 0
    return model


def test_invalid_utf8_bytes_are_replaced(tmp_path, capsys):
    path = tmp_path / "ff.pt"
    save_model(path, forced_byte_model(0xFF))  # 0xFF never occurs in UTF-8
    assert sample.main([str(path), "--prompt", "é", "--max-new-tokens", "5", "--top-k", "1"]) == 0
    assert capsys.readouterr().out == "é" + "\ufffd" * 5 + "\n"


def test_sampling_is_seeded(tmp_path, capsys):
    torch.manual_seed(1)
    path = tmp_path / "m.pt"
    save_model(path, PerformerLM(ModelConfig(**MODEL_PRESETS["tiny"])))
    outs = []
    for seed in (0, 0, 1):
        sample.main([str(path), "--prompt", "ab", "--max-new-tokens", "24", "--seed", str(seed)])
        outs.append(capsys.readouterr().out)
    assert all(isinstance(o, str) and o.startswith("ab") for o in outs)
    assert outs[0] == outs[1] != outs[2]


@pytest.mark.parametrize("content", [None, b"not a checkpoint", "no-config"],
                         ids=["missing", "garbage", "no-config"])
def test_unreadable_checkpoint_is_one_line_exit_2(tmp_path, capsys, content):
    path = tmp_path / "ckpt.pt"
    if content == "no-config":
        torch.save({"model": {}, "step": 0}, path)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as exc:
        sample.main([str(path), "--prompt", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error:" in err and str(path) in err


def test_bad_generation_args_exit_2(tmp_path, capsys):
    path = tmp_path / "m.pt"
    save_model(path, forced_byte_model(65))
    with pytest.raises(SystemExit) as exc:
        sample.main([str(path), "--prompt", "", "--max-new-tokens", "3"])
    assert exc.value.code == 2
    assert "prompt" in capsys.readouterr().err


def test_an_experiment_folder_lists_its_runs(tmp_path, capsys):
    """``runs/first`` holds run folders, not checkpoints: the error names each run folder that has
    a checkpoint (and only those)."""
    exp = tmp_path / "first"
    for run in ("rope-seed0", "none-seed0"):
        (exp / run).mkdir(parents=True)
        save_model(exp / run / "ckpt-00001000.pt", forced_byte_model(65))
    (exp / "empty-seed0").mkdir()
    with pytest.raises(SystemExit) as exc:
        sample.main([str(exp), "--prompt", "x"])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"python -m linear_rope.sample: error: {exp} holds runs, not checkpoints: name one "
                     f"of {exp / 'none-seed0'}, {exp / 'rope-seed0'}"]
    assert sample.main([str(exp / "rope-seed0"), "--prompt", "x", "--max-new-tokens", "2",
                        "--top-k", "1"]) == 0
    assert capsys.readouterr().out == "xAA\n"


def test_an_empty_folder_says_no_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        sample.main([str(tmp_path), "--prompt", "x"])
    assert exc.value.code == 2
    assert f"no checkpoint in {tmp_path}" in capsys.readouterr().err


def _fails(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        sample.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, text", [
    (["--device", "meta"], "unknown --device 'meta'"),
    (["--device", "bogus"], "unknown --device 'bogus'"),
    (["--seed", str(2**64)], "--seed must be in [0, 2**64 - 1]"),
    (["--seed", "-1"], "--seed must be in [0, 2**64 - 1]"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "CUDA is not available")]),
    ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_device_or_seed_is_one_line(tmp_path, capsys, argv, text):
    path = tmp_path / "m.pt"
    save_model(path, forced_byte_model(65))
    assert text in _fails(capsys, [str(path), "--prompt", "x", *argv])


@pytest.mark.parametrize("value", ["garbage", "fla"])
def test_a_backend_sampling_cannot_use_is_one_line(tmp_path, capsys, monkeypatch, value):
    if value == "fla" and torch.cuda.is_available():
        pytest.skip("fla is refused without CUDA only")
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", value)
    path = tmp_path / "m.pt"
    save_model(path, forced_byte_model(65))
    assert "LINEAR_ROPE_BACKEND" in _fails(capsys, [str(path), "--prompt", "x"])


def test_a_checkpoint_with_nan_weights_is_refused(tmp_path, capsys):
    model = forced_byte_model(65)
    with torch.no_grad():
        model.blocks[1].ff[0].weight[0, 0] = float("nan")
    save_model(tmp_path / "ckpt-00000001.pt", forced_byte_model(65))
    save_model(tmp_path / "ckpt-00000002.pt", model)
    line = _fails(capsys, [str(tmp_path), "--prompt", "x"])
    assert "non-finite weights (blocks.1.ff.0.weight)" in line
    assert f"the previous checkpoint is {tmp_path / 'ckpt-00000001.pt'}" in line


@pytest.mark.parametrize("field, value, text", [
    ("depth", 10**6, "depth 1000000, but the weights hold 2 blocks"),
    ("heads", 10**6, "blocks.0.attn.to_qkv.weight should be [24000000, 32], is [48, 32]"),
    ("dim", 10**6, "tok_emb.weight should be [256, 1000000], is [256, 32]"),
    ("nb_features", 10**9, "nb_features 1000000000 needs more numbers than the weights hold"),
])
def test_a_config_that_does_not_describe_the_weights_is_refused_before_building(tmp_path, capsys, field, value,
                                                                                 text):
    """An edited config (depth 1e6) built a million blocks before load_state_dict could object."""
    model = forced_byte_model(65)
    path = tmp_path / "m.pt"
    cfg = {**asdict(model.cfg), field: value}
    torch.save({"model": model.state_dict(), "step": 0, "config": {"model": cfg, "train": {}}}, path)
    line = _fails(capsys, [str(path), "--prompt", "x"])
    assert "its config does not describe its weights" in line and text in line


def test_a_temperature_below_float32_samples_greedily(tmp_path, capsys):
    torch.manual_seed(1)
    path = tmp_path / "m.pt"
    save_model(path, PerformerLM(ModelConfig(**MODEL_PRESETS["tiny"])))
    outs = []
    for extra in (["--temperature", "1e-300"], ["--top-k", "1"]):
        assert sample.main([str(path), "--prompt", "ab", "--max-new-tokens", "12", *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


# ------------------------------------------------------------------ linear_rope.load_run

def save_run(run_dir, model: PerformerLM, step: int = 3, digest_of: PerformerLM | None = None):
    """A run folder's checkpoint as the trainer writes it: content digest and param_sha256."""
    from linear_rope.enwik8.checkpoint import save_checkpoint
    from linear_rope.enwik8.runtime import param_digest

    payload = {"model": model.state_dict(), "step": step, "config": {"model": asdict(model.cfg), "train": {}},
               "param_sha256": param_digest(digest_of or model)}
    return save_checkpoint(run_dir, step, payload, keep=3)


def test_load_run_is_public_and_returns_the_run_s_model(tmp_path):
    import linear_rope

    assert "load_run" in linear_rope.__all__
    model = forced_byte_model(66)
    path = save_run(tmp_path / "rope-seed0", model)
    for where in (tmp_path / "rope-seed0", path):  # a run folder (its newest checkpoint) or a file
        got = linear_rope.load_run(where)
        assert isinstance(got, PerformerLM) and not got.training and got.cfg == model.cfg
        assert all(torch.equal(got.state_dict()[k], v) for k, v in model.state_dict().items())
    assert got.generate(b"x", 3, top_k=1) == b"BBB"


def test_load_run_verifies_as_sample_does(tmp_path):
    """Weights that fail their param_sha256, non-finite weights, a folder without checkpoints:
    one-line ValueErrors."""
    import linear_rope

    save_run(tmp_path / "tampered", forced_byte_model(65), digest_of=forced_byte_model(66))
    with pytest.raises(ValueError, match="weights do not match the param_sha256"):
        linear_rope.load_run(tmp_path / "tampered")
    nan = forced_byte_model(65)
    with torch.no_grad():
        nan.head.weight[0, 0] = float("nan")
    save_run(tmp_path / "nan", nan)
    with pytest.raises(ValueError, match="non-finite weights"):
        linear_rope.load_run(tmp_path / "nan")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no checkpoint in"):
        linear_rope.load_run(tmp_path / "empty")
