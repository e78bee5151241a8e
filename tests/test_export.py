"""python -m linear_rope.export: the checks ``sample`` runs, the folder's permissions, ``.`` as
OUT_DIR, and a run that deletes old checkpoints while it is exported.

Skipped when transformers is not installed (``pip install -e ".[hf]"``).
"""
from __future__ import annotations

import os
import stat
from dataclasses import asdict

import pytest
import torch

pytest.importorskip("transformers")

from linear_rope.enwik8.runtime import param_digest  # noqa: E402
from linear_rope.model import MODEL_PRESETS, ModelConfig, PerformerLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one thread for small sizes

EXPORTED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json",
            "modeling_linear_rope.py"}


def tiny() -> PerformerLM:
    torch.manual_seed(0)
    return PerformerLM(ModelConfig(**MODEL_PRESETS["tiny"]))


def save(path, model: PerformerLM, step: int = 1, config: dict | None = None, digest: str | None = None):
    ckpt = {"model": model.state_dict(), "step": step,
            "config": {"model": config or asdict(model.cfg), "train": {}}}
    if digest is not None:
        ckpt["param_sha256"] = digest
    torch.save(ckpt, path)


def export(argv, capsys) -> tuple[int, str]:
    from linear_rope import export as cli

    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def nan_weights(run):
    model = tiny()
    with torch.no_grad():
        model.blocks[1].ff[0].weight[0, 0] = float("nan")
    save(run / "ckpt-00000002.pt", model, step=2)
    return "non-finite weights (blocks.1.ff.0.weight)"


def wrong_digest(run):
    model = tiny()
    digest = param_digest(model)
    with torch.no_grad():
        model.head.weight[3, 3] += 1.0  # the weights changed after the digest was taken
    save(run / "ckpt-00000002.pt", model, step=2, digest=digest)
    return "its weights do not match the param_sha256 stored in it"


def huge_depth(run):
    save(run / "ckpt-00000002.pt", tiny(), step=2, config={**asdict(tiny().cfg), "depth": 10**6})
    return "depth 1000000, but the weights hold 2 blocks"


@pytest.mark.parametrize("make", [nan_weights, wrong_digest, huge_depth])
def test_export_refuses_what_sample_refuses(tmp_path, capsys, make):
    """The same checks as ``python -m linear_rope.sample``, in one line, naming the previous
    checkpoint; nothing is written (a config of depth 1e6 is refused before anything is built)."""
    run = tmp_path / "run"
    run.mkdir()
    save(run / "ckpt-00000001.pt", tiny())
    text = make(run)
    code, err = export([run, tmp_path / "out"], capsys)
    assert code == 2 and err.count("\n") == 1 and text in err, err
    assert f"the previous checkpoint is {run / 'ckpt-00000001.pt'}" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_the_new_folder_has_the_permissions_the_umask_gives(tmp_path, capsys, umask):
    save(tmp_path / "ckpt-00000001.pt", tiny())
    old = os.umask(umask)
    try:
        code, err = export([tmp_path / "ckpt-00000001.pt", tmp_path / "out"], capsys)
    finally:
        os.umask(old)
    assert code == 0, err
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask
    for f in (tmp_path / "out").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f.name


def test_export_into_the_current_empty_folder(tmp_path, capsys, monkeypatch):
    """``.`` (empty): the files move in, and the folder itself stays (its mode, its inode)."""
    save(tmp_path / "ckpt-00000001.pt", tiny())
    here = tmp_path / "here"
    here.mkdir()
    here.chmod(0o750)
    inode = here.stat().st_ino
    monkeypatch.chdir(here)
    code, err = export([tmp_path / "ckpt-00000001.pt", "."], capsys)
    assert code == 0 and "to ." in err, err
    assert {p.name for p in here.iterdir()} == EXPORTED
    assert here.stat().st_ino == inode and stat.S_IMODE(here.stat().st_mode) == 0o750
    code, err = export([tmp_path / "ckpt-00000001.pt", "."], capsys)  # no longer empty
    assert code == 2 and "is not empty" in err and {p.name for p in here.iterdir()} == EXPORTED


def test_a_checkpoint_deleted_by_retention_while_it_is_read(tmp_path, capsys, monkeypatch):
    """A run still training writes ckpt-2 and deletes ckpt-1 (keep 1) just as the export opens
    ckpt-1: the good checkpoint is not called corrupt, the new newest one is exported."""
    run = tmp_path / "run"
    run.mkdir()
    save(run / "ckpt-00000001.pt", tiny(), step=1)
    real_load = torch.load
    calls = []

    def racing_load(f, *args, **kwargs):
        calls.append(str(f))
        if len(calls) == 1:  # the trainer's save_checkpoint, between resolve and read
            save(run / "ckpt-00000002.pt", tiny(), step=2)
            os.unlink(f)
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", racing_load)
    code, err = export([run, tmp_path / "out"], capsys)
    assert code == 0, err
    assert "exported run/ckpt-00000002.pt (step 2)" in err
    assert calls == [str(run / "ckpt-00000001.pt"), str(run / "ckpt-00000002.pt")]
