"""End-to-end tests of linear_rope.enwik8 (train, trainer): runs, TensorBoard tags, checkpoints, resume, seeding."""
from __future__ import annotations

import bz2
import contextlib
import io
import json
import math
import re
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
from tensorboard.plugins.custom_scalar import layout_pb2

from linear_rope.enwik8 import config, data, sample, train, trainer
from linear_rope.enwik8.checkpoint import latest_checkpoint
from linear_rope.model import MODEL_PRESETS, ModelConfig

TAGS = {"train/loss", "train/bpc", "val/bpc", "lr", "perf/tokens_per_sec", "grad/norm", "test/bpc"}


def run_main(argv: list[str]) -> str:
    """train.main in-process; returns its stdout."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert train.main(argv) == 0
    return buf.getvalue()


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    ea = EventAccumulator(str(run_dir))
    ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def small_corpus(corpus) -> Path:
    """64 KB of generated Wikipedia-like text (val and test: 3.2 KB each; conftest.py)."""
    return corpus


@pytest.fixture(scope="module")
def ablation(tmp_path_factory, small_corpus):
    """The tiny two-variant ablation: rope,none x seed 0, 4 steps, val every 2."""
    root = tmp_path_factory.mktemp("ablation")
    out = root / "runs"
    stdout = run_main(["--preset", "tiny", "--variants", "rope,none", "--steps", "4",
                       "--eval-every", "2", "--data", str(small_corpus),
                       "--data-dir", str(root / "data"), "--out", str(out)])
    return out, stdout


def test_every_tag_in_both_runs_at_the_same_steps(ablation):
    out, _ = ablation
    rope, none = scalars(out / "rope-seed0"), scalars(out / "none-seed0")
    assert TAGS <= set(rope) and set(rope) == set(none)
    for tag in rope:
        assert [s for s, _ in rope[tag]] == [s for s, _ in none[tag]], tag
    assert [s for s, _ in rope["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in rope["val/bpc"]] == [2, 4]
    assert [s for s, _ in rope["test/bpc"]] == [4]
    for tag in ("train/bpc", "val/bpc", "test/bpc"):
        assert all(0 < v < 9 for _, v in rope[tag] + none[tag]), tag
    loss, bpc = rope["train/loss"][-1][1], rope["train/bpc"][-1][1]
    assert bpc == pytest.approx(loss / math.log(2), rel=1e-5)


def test_summary_table_and_custom_scalars_layout(ablation):
    out, stdout = ablation
    lines = stdout.strip().splitlines()
    assert lines[-1] == f"tensorboard --logdir {out}"
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
    assert set(rows) == {"rope-seed0", "none-seed0"}
    for step, val, test in rows.values():
        assert step == "4" and 0 < float(val) < 9 and 0 < float(test) < 9
    # TensorBoard's runs are the folders that hold event files: the runs, and no empty "." run
    # of --out's own (the layout and the HParams row are written in each run's folder).
    mux = EventMultiplexer().AddRunsFromDirectory(str(out))
    mux.Reload()
    assert set(mux.Runs()) == {"rope-seed0", "none-seed0"}
    assert not list(out.glob("events.out.tfevents.*"))
    for run in mux.Runs():
        ea = EventAccumulator(str(out / run))
        ea.Reload()
        proto = ea.Tensors("custom_scalars__config__")[0].tensor_proto
        layout = layout_pb2.Layout.FromString(proto.string_val[0])
        charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
        # Multiline charts regex over tags; TensorBoard overlays every run that has a match.
        for tag in ("val/bpc", "train/bpc"):
            (chart,) = [regexes for title, regexes in charts.items() if title.startswith(tag)]
            assert any(re.fullmatch(r, tag) for r in chart)
            assert not any(re.search(r, "test/bpc") for r in chart)


def test_checkpoint_loads_weights_only_and_samples(ablation, capsys):
    out, _ = ablation
    path = latest_checkpoint(out / "rope-seed0")
    assert path.name == "ckpt-00000004.pt"
    ckpt = torch.load(path, weights_only=True)
    assert set(ckpt) >= {"model", "optimizer", "step", "rng", "config", "metrics"}
    assert ckpt["step"] == 4
    assert ckpt["rng"]["torch"].dtype == torch.uint8
    assert ckpt["rng"]["features"].dtype == torch.uint8
    assert ckpt["rng"]["data"].dtype == torch.uint8
    assert ckpt["config"]["model"] == asdict(ModelConfig(**MODEL_PRESETS["tiny"]))
    assert ckpt["config"]["train"]["lr"] == config.TRAIN_PRESETS["tiny"]["lr"]
    saved = json.loads((out / "rope-seed0" / "config.json").read_text())
    assert {k: v for k, v in saved.items() if k not in ("history", "attention")} == ckpt["config"]
    assert saved["attention"] == saved["history"][0]["attention"] and saved["attention"].startswith("torch path (")
    assert [(h["from_step"], h["train"], h["corpus"]) for h in saved["history"]] == \
        [(0, ckpt["config"]["train"], ckpt["config"]["corpus"])]
    assert not list(path.parent.glob("*.tmp"))

    assert sample.main([str(path.parent), "--prompt", "The ", "--max-new-tokens", "16", "--top-k", "5"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("The ") and len(text) > len("The ")


def test_build_run_shares_init_projections_and_data_across_variants():
    cfg = ModelConfig(**MODEL_PRESETS["tiny"])
    built = {v: trainer.build_run(replace(cfg, position=v), seed=3) for v in ("rope", "none", "rope_pre",
                                                                             "absolute")}
    ref_model, ref_data, ref_feat = built["rope"]
    ref_state = {k: t.clone() for k, t in ref_model.state_dict().items()}
    ref_batches = [data.get_batch(bytes(range(256)) * 4, 4, 32, ref_data) for _ in range(3)]
    ref_model.redraw_features(ref_feat)  # a redraw is shared too
    for v, (model, data_gen, feat_gen) in list(built.items())[1:]:
        state = model.state_dict()
        assert set(ref_state) <= set(state), v  # absolute adds pos_emb only
        for k, t in ref_state.items():
            torch.testing.assert_close(state[k], t, rtol=0, atol=0, msg=f"{v}: {k}")
        for x_ref, x in zip(ref_batches, [data.get_batch(bytes(range(256)) * 4, 4, 32, data_gen)
                                          for _ in range(3)]):
            assert torch.equal(x_ref[0], x[0]) and torch.equal(x_ref[1], x[1])
        model.redraw_features(feat_gen)
        for f_ref, f in zip(ref_model.feature_modules, model.feature_modules):
            assert torch.equal(f_ref.projection, f.projection)
    other, _, _ = trainer.build_run(cfg, seed=4)
    assert not torch.equal(other.tok_emb.weight, ref_model.tok_emb.weight)


def test_lr_schedule_is_warmup_then_cosine_to_ten_percent():
    tc = config.TrainConfig(lr=1.0, warmup_steps=10, steps=110)
    assert config.lr_at(0, tc) == pytest.approx(0.1)
    assert config.lr_at(9, tc) == pytest.approx(1.0)
    assert config.lr_at(10, tc) == pytest.approx(1.0)
    assert config.lr_at(60, tc) == pytest.approx(0.55)
    assert config.lr_at(110, tc) == pytest.approx(0.1)
    lrs = [config.lr_at(s, tc) for s in range(10, 200)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])) and min(lrs) == pytest.approx(0.1)
    fixed = replace(tc, decay_steps=50)
    assert config.lr_at(50, fixed) == config.lr_at(500, fixed) == pytest.approx(0.1)


def test_resume_matches_an_uninterrupted_run(tmp_path, small_corpus, capsys):
    # redraw every 3 steps: one redraw before the split at step 4, one after it
    common = ["--preset", "tiny", "--variants", "rope", "--decay-steps", "8", "--eval-every", "0",
              "--feature-redraw-interval", "3", "--data", str(small_corpus),
              "--data-dir", str(tmp_path / "data")]
    run_main([*common, "--steps", "8", "--out", str(tmp_path / "straight")])
    run_main([*common, "--steps", "4", "--out", str(tmp_path / "split")])
    # TensorBoard orders event files by their name, which starts with the time in whole seconds:
    # a resume within the same second could sort first. A real restart is never that quick.
    time.sleep(1.05)
    run_main([*common, "--steps", "8", "--out", str(tmp_path / "split"), "--resume"])
    a = torch.load(latest_checkpoint(tmp_path / "straight/rope-seed0"), weights_only=True)
    b = torch.load(latest_checkpoint(tmp_path / "split/rope-seed0"), weights_only=True)
    assert a["step"] == b["step"] == 8
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=0, atol=1e-6, msg=k)
    assert torch.equal(a["rng"]["data"], b["rng"]["data"])
    assert torch.equal(a["rng"]["features"], b["rng"]["features"])
    steps = [s for s, _ in scalars(tmp_path / "split/rope-seed0")["train/loss"]]
    assert steps == list(range(1, 9))
    capsys.readouterr()

    # a second run into the same dir without --resume refuses, and writes nothing
    with pytest.raises(SystemExit) as exc:
        train.main([*common, "--steps", "8", "--out", str(tmp_path / "split")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--resume" in err
    assert torch.load(latest_checkpoint(tmp_path / "split/rope-seed0"), weights_only=True)["step"] == 8

    # --resume of a finished run skips it, and still reports it
    out = run_main([*common, "--steps", "8", "--out", str(tmp_path / "split"), "--resume"])
    assert "already done" in capsys.readouterr().err
    assert "rope-seed0" in out

    # --resume with a changed trajectory setting is refused
    with pytest.raises(SystemExit) as exc:
        train.main([*common, "--steps", "9", "--lr", "0.5", "--out", str(tmp_path / "split"),
                    "--resume"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "lr" in err


def test_on_a_bz2_text_archive(tmp_path):
    """One run on a 400 KB Wikipedia-like .bz2 (tests/fixtures/wikitext.py): full-split val and
    test BPC (20 KB each)."""
    from fixtures.wikitext import wiki_text

    archive = tmp_path / "wiki-like.xml.bz2"
    archive.write_bytes(bz2.compress(wiki_text(400_000)))
    stdout = run_main(["--preset", "tiny", "--variants", "rope", "--steps", "2",
                       "--eval-every", "0", "--eval-batch-size", "1024", "--data", str(archive),
                       "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "runs")])
    splits = data.prepare_corpus(archive, tmp_path / "data")
    assert splits["valid"].stat().st_size == 20_000
    ckpt = torch.load(latest_checkpoint(tmp_path / "runs/rope-seed0"), weights_only=True)
    val, test = ckpt["metrics"]["val_bpc"], ckpt["metrics"]["test_bpc"]
    assert 7 < val < 8.5 and 7 < test < 8.5  # ~log2(256) = 8 after 2 steps
    assert f"{val:8.4f}" in stdout


def test_cpu40m_is_cpu20m_with_issue24s_recipe_and_twice_the_bytes():
    """The recipe chosen on `none` (results/recipe_sweep) changes only qk_norm, the redraws and the lr;
    the old recipe stays reachable as --preset cpu20m (or cpu40m with --no-qk-norm
    --feature-redraw-interval 1000 --lr 2e-3)."""
    old, new = MODEL_PRESETS["cpu20m"], MODEL_PRESETS["cpu40m"]
    assert {k: v for k, v in new.items() if k not in ("qk_norm", "feature_redraw_interval")} == old
    assert new["qk_norm"] and new["feature_redraw_interval"] == 0
    assert "qk_norm" not in old and ModelConfig().feature_redraw_interval == 1000 and not ModelConfig().qk_norm
    t_old, t_new = config.TRAIN_PRESETS["cpu20m"], config.TRAIN_PRESETS["cpu40m"]
    assert {k: v for k, v in t_new.items() if k not in ("steps", "lr")} == \
        {k: v for k, v in t_old.items() if k not in ("steps", "lr")}
    assert (t_old["lr"], t_new["lr"]) == (2e-3, 4e-3)
    bytes_per_step = t_new["batch_size"] * new["seq_len"]
    assert t_new["steps"] * bytes_per_step >= 40_000_000 and t_old["steps"] * bytes_per_step >= 20_000_000


def test_paper_width_script_trains_exports_and_packs_the_results(tmp_path, small_corpus):
    """results/gpu_paper_width/run.sh (the GPU plan's ablation) end to end at the tiny preset on
    the CPU: each variant trains on the path it names, the call exports into the results folder,
    keeps the earlier calls' runs, and packs the folder into one tarball for the device's $OUT."""
    import os
    import subprocess
    import sys
    import tarfile

    root = Path(__file__).resolve().parents[1]
    results = tmp_path / "gpu_paper_width"
    env = {**os.environ, "PRESET": "tiny", "DEVICE": "cpu", "STEPS": "2", "DATA": str(small_corpus),
           "RESULTS": str(results), "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("LINEAR_ROPE_BACKEND", None)
    for variants in ("softmax", "rope_norm"):  # two device calls, each with its own variants
        # a fresh machine each call: its run dirs are gone, the results folder travelled
        r = subprocess.run(["bash", str(root / "results/gpu_paper_width/run.sh")],
                           env={**env, "VARIANTS": variants, "RUNS": str(tmp_path / f"runs-{variants}")},
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((results / "summary.json").read_text())
    assert sorted(summary["variants"]) == ["rope_norm", "softmax"]
    assert summary["variants"]["softmax"]["steps"] == [2]
    cfg = json.loads((results / "runs.json").read_text())["rope_norm-seed0"]["config"]
    assert cfg["model"]["qk_norm"] and cfg["model"]["feature_redraw_interval"] == 0
    paths = json.loads((results / "attention_paths.json").read_text())  # this call's runs
    assert paths == {"rope_norm-seed0": "torch path (LINEAR_ROPE_BACKEND=torch)"}
    assert "Attention path of each run (LINEAR_ROPE_BACKEND=torch)" in (results / "tables.md").read_text()
    with tarfile.open(tmp_path / "gpu_paper_width.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("gpu_paper_width/summary.json") for n in names)
    assert any(n.endswith("logs/softmax-seed0.log") for n in names) and any(n.endswith("tables.md") for n in names)
    assert not (tmp_path / "gpu_paper_width.tar.gz.tmp").exists()


def test_the_final_table_says_which_step_a_val_bpc_is_of(capsys, tmp_path):
    """A run stopped by a signal at step 480 whose last evaluation was at step 250: its row says
    so (the table printed the two side by side with nothing saying they differ)."""
    from linear_rope.enwik8.train import _report

    results = [("rope-seed0", {"step": 1000, "val_bpc": 4.08, "val_step": 1000, "test_bpc": 4.01, "stopped": None}),
               ("none-seed0", {"step": 480, "val_bpc": 4.2, "val_step": 250, "test_bpc": None, "stopped": "SIGINT"})]
    _report(results, tmp_path, ["--steps", "1000"], "train_enwik8.py", 1)
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].endswith(" 4.0100") and "val bpc of step" not in rows[1]
    assert rows[2].split()[:3] == ["none-seed0", "480", "4.2000"] and rows[2].endswith("(val bpc of step 250)")
