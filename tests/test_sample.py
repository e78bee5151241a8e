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
