"""linear_rope.results: analysis and plots: the numbers behind the results and their files."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from helpers import poison_training_forward, run_main
from linear_rope import apply_rotary, rotary_linear_attention
from linear_rope.enwik8 import data, trainer
from linear_rope.enwik8.checkpoint import load_checkpoint, resolve_checkpoint
from linear_rope.results import analysis, plots
from linear_rope.model import MODEL_PRESETS, ModelConfig, PerformerLM

pytestmark = pytest.mark.usefixtures("one_thread")


def test_decay_bound_matches_the_sum_and_decays():
    d = 8
    got = analysis.rope_decay_bound(d, 300)
    theta = [10000 ** (-2 * k / d) for k in range(d // 2)]
    for r in (0, 1, 17, 300):
        s = [abs(sum(complex(math.cos(r * t), math.sin(r * t)) for t in theta[:j]))
             for j in range(1, d // 2 + 1)]
        assert got[r].item() == pytest.approx(sum(s) / len(s), rel=1e-12)
    assert got[0].item() == pytest.approx((d // 2 + 1) / 2)  # |S_j| = j at distance 0
    for dim in (64, 266):
        b = analysis.rope_decay_bound(dim, 1024)
        assert b[256:].max() < 0.45 * b[0] and b[256:].mean() < 0.25 * b[0]  # the long-term decay
    with pytest.raises(ValueError, match="even"):
        analysis.rope_decay_bound(7, 10)


@pytest.mark.parametrize("position", ["rope", "rope_pre", "rope_norm", "none", "absolute"])
def test_eq19_weights_reproduce_the_layer_and_their_row_sums(position):
    torch.manual_seed(0)
    model = PerformerLM(ModelConfig(**{**MODEL_PRESETS["tiny"], "position": position})).double()
    ids = torch.randint(256, (32,))
    w, sums = analysis.eq19_weights(model, ids, layer=1, head=1)
    assert w.shape == (32, 32) and torch.equal(w.triu(1), torch.zeros_like(w))
    torch.testing.assert_close(sums, w.sum(-1), rtol=0, atol=0)
    if position != "rope":  # normalised attention (rope_norm: where the rotated rows sum to >= floor)
        ok = sums > 0.999 if position == "rope_norm" else slice(None)
        assert position != "rope_norm" or ok.float().mean() > 0.5
        torch.testing.assert_close(sums[ok], torch.ones(32, dtype=torch.float64)[ok], rtol=0, atol=1e-12)
    # W @ v is the head's attention output
    seen = {}
    attn = model.blocks[1].attn
    h = attn.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    model(ids[None])
    h.remove()
    q, k, v = attn._qkv(seen["x"], None)
    if position == "rope_pre":
        q, k = apply_rotary(q), apply_rotary(k)
    q, k, projection = attn._op_inputs(q, k)
    out = rotary_linear_attention(q, k, attn._ones_column(v), causal=True, projection=projection,
                                  rotary=position in ("rope", "rope_norm"))
    torch.testing.assert_close(w @ v[0, 1], attn._renormalise(out)[0, 1], rtol=1e-10, atol=1e-12)


def test_softmax_weights_reproduce_the_layer():
    """The anchor's W is the exact causal softmax of the rotated scores: W @ v is its head output."""
    torch.manual_seed(2)
    model = PerformerLM(ModelConfig(**{**MODEL_PRESETS["tiny"], "position": "softmax", "qk_norm": True})).double()
    ids = torch.randint(256, (32,))
    w, sums = analysis.eq19_weights(model, ids, layer=1, head=1)
    assert torch.equal(w.triu(1), torch.zeros_like(w)) and w[0, 0] == 1
    torch.testing.assert_close(sums, torch.ones(32, dtype=torch.float64), rtol=0, atol=1e-12)
    seen = {}
    attn = model.blocks[1].attn
    h = attn.register_forward_hook(lambda m, a, o: seen.update(x=a[0], out=o))
    model(ids[None])
    h.remove()
    _, _, v = attn._qkv(seen["x"])
    heads = torch.zeros(1, attn.heads, 32, attn.dim_head, dtype=torch.float64)
    heads[0, 1] = w @ v[0, 1]
    # the layer's output less head 0's share through to_out is head 1's share
    w0, _ = analysis.eq19_weights(model, ids, layer=1, head=0)
    heads[0, 0] = w0 @ v[0, 0]
    torch.testing.assert_close(attn._project_out(heads, seen["x"]), seen["out"], rtol=1e-10, atol=1e-12)
    assert analysis.row_sums(model, ids).eq(1).all()


@pytest.mark.parametrize("position", ["rope", "rope_pre", "rope_norm", "none", "absolute"])
def test_row_sums_of_every_layer_equal_those_of_eq19_weights(position):
    torch.manual_seed(1)
    model = PerformerLM(ModelConfig(**{**MODEL_PRESETS["tiny"], "position": position})).double()
    ids = torch.randint(256, (32,))
    sums = analysis.row_sums(model, ids)
    assert sums.shape == (2, 2, 32) and sums.dtype == torch.float64
    for layer in range(2):
        for head in range(2):
            torch.testing.assert_close(sums[layer, head], analysis.eq19_weights(model, ids, layer, head)[1],
                                       rtol=1e-10, atol=1e-12)
    if position == "rope":
        assert (sums - 1).abs().max() > 0.01  # Eq. 19 drifts from 1


def test_bpc_at_lengths_agrees_with_training_eval_and_refuses_past_the_absolute_table():
    torch.manual_seed(0)
    split = torch.randint(256, (3000,), dtype=torch.uint8).numpy()
    for position in ("rope", "absolute"):
        model = PerformerLM(ModelConfig(**{**MODEL_PRESETS["tiny"], "position": position}))
        got = analysis.bpc_at_lengths(model, split, [32, 64, 256], tokens_per_batch=512)
        assert got[32] == pytest.approx(trainer.evaluate(model, split, 32, 16), rel=1e-6)
        assert (got[64] is None) == (position == "absolute")
        if position == "rope":
            assert 7 < got[256] < 9  # ~8 bits for an untrained byte model


def test_steps_to_reach_interpolates():
    curve = [(250, 4.0), (500, 3.0), (750, 2.5)]
    assert analysis.steps_to_reach(curve, 3.5) == pytest.approx(375)
    assert analysis.steps_to_reach(curve, 4.5) == 250
    assert analysis.steps_to_reach(curve, 2.0) is None


def test_power_law_fit_recovers_a_known_curve_and_where_it_reaches_a_target():
    a, b, c = 1.8, 50.0, 0.6
    curve = [(s, a + b * s ** -c) for s in range(490, 9801, 490)]
    fit = analysis.fit_power_law(curve)
    assert fit["from_step"] == 1960 and fit["n"] == 17 and fit["rmse"] < 1e-3
    assert (fit["a"], fit["b"], fit["c"]) == pytest.approx((a, b, c), rel=0.02)
    assert analysis.power_law_at(fit, 20000) == pytest.approx(a + b * 20000 ** -c, abs=1e-3)
    assert analysis.power_law_steps_to(fit, 2.0) == pytest.approx((b / 0.2) ** (1 / c), rel=0.02)
    assert analysis.power_law_steps_to(fit, 1.7) is None  # below the floor: never
    bt = analysis.backtest_power_law(curve)
    assert bt["fit_to_step"] == 4900 and bt["step"] == 9800 and abs(bt["error"]) < 1e-3


def test_power_law_backtest_measures_a_curve_that_flattens_and_the_fit_refuses_what_it_cannot_fit():
    # the law up to step 5000, then flat: a fit to the first half promises too much
    curve = [(s, 1.0 + 20 * min(s, 5000) ** -0.5) for s in range(500, 10001, 500)]
    assert analysis.backtest_power_law(curve)["error"] < -0.05
    assert analysis.fit_power_law(curve[:3]) is None  # too few points
    assert analysis.fit_power_law([(s, 2.0 + s / 1e4) for s in range(100, 1001, 100)]) is None  # rising
    # a curve that still falls fast would fit best with a floor below 0; floors are kept >= 0
    steep = [(s, 3.0 - s / 1000) for s in range(100, 2001, 100)]
    assert analysis.fit_power_law(steep)["a"] >= 0


def test_plots_all_writes_every_file(tmp_path, corpus):
    pytest.importorskip("matplotlib")
    runs = tmp_path / "runs"
    code, _, err = run_main(["--preset", "tiny", "--variants", "rope,rope_norm,none,softmax", "--seeds", "0,1",
                             "--steps", "6", "--eval-every", "3", "--log-every", "1",
                             "--data", str(corpus), "--data-dir", str(tmp_path / "data"),
                             "--out", str(runs)])
    assert code == 0, err
    out = tmp_path / "results"
    assert plots.main(["all", "--runs", str(runs), "--data", str(corpus), "--data-dir",
                       str(tmp_path / "data"), "--out", str(out)]) == 0
    for name in ("extrapolation.csv", "extrapolation.png", "attention_weights.png",
                 "attention_rowsums.csv", "attention_rowsums.png", "decay.csv", "decay.png",
                 "summary.json", "val_bpc.png", "curves/rope-seed1.csv", "rowsums_lengths.csv",
                 "rowsums_lengths.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    rows = plots.read_csv(out / "curves/rope-seed0.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert [r["val/bpc"] != "" for r in rows] == [False, False, True, False, False, True]
    summary = json.loads((out / "summary.json").read_text())
    rope = summary["variants"]["rope"]
    assert rope["seeds"] == [0, 1] and rope["final_val_bpc"]["n"] == 2
    ckpt_val = [float(plots.read_csv(out / f"curves/rope-seed{s}.csv")[-1]["val/bpc"]) for s in (0, 1)]
    assert rope["final_val_bpc"]["mean"] == pytest.approx(sum(ckpt_val) / 2)
    assert set(summary["extrapolation_test_bpc"]["rope"]) == {"1L", "2L", "4L", "8L"}
    split = data.load_split(data.prepare_corpus(corpus, tmp_path / "data")["test"])
    assert summary["extrapolation_test_bpc"]["none"]["1L"]["n"] == 2 and len(split) > 0
    rl = summary["row_sums_at_lengths"]
    assert set(rl["rope"]) == {"1L", "2L", "4L", "8L"} and rl["rope"]["8L"]["mean"]["n"] == 2
    assert rl["none"]["8L"]["min"]["mean"] == 1.0 and rl["rope"]["1L"]["min"]["mean"] != 1.0
    assert rl["rope_norm"]["1L"]["p05"]["mean"] == pytest.approx(1.0, abs=1e-9)  # floored rows aside
    assert rl["none"]["8L"]["median"]["mean"] == rl["none"]["8L"]["p95"]["mean"] == rl["none"]["8L"]["max"]["mean"] == 1.0
    assert rl["none"]["4L"]["frac_abs_above_2"]["mean"] == 0.0
    r = rl["rope"]["2L"]
    assert r["min"]["mean"] <= r["p05"]["mean"] <= r["median"]["mean"] <= r["p95"]["mean"] <= r["max"]["mean"]
    rows = [r for r in plots.read_csv(out / "rowsums_lengths.csv") if r["run"] == "rope-seed0"]
    assert [int(r["factor"]) for r in rows] == [1, 2, 4, 8]
    assert summary["variants"]["rope"]["train_bytes"] == [6 * 4 * 32] * 2  # steps x batch x L
    assert summary["variants"]["rope"]["skipped_steps"] == [0, 0]
    table = plots.tables(out)
    assert "| `rope` | 2 | 0.0M |" in table and "test BPC at 8L" in table and "mean abs(row sum" in table
    assert "| `rope_norm` (n=2) |" in table and "at 8L: median (5th, 95th pct)" in table
    best = rope["best_val_bpc"][1]  # per seed: [step, lowest val BPC], steps 3 and 6 evaluated
    assert best[0] in (3, 6) and best[1] == min(float(r["val/bpc"]) for r in
                                                plots.read_csv(out / "curves/rope-seed1.csv") if r["val/bpc"])
    assert rope["test_bpc_per_seed"] == pytest.approx(rope["final_test_bpc"]["values"])
    vals = [float(r["val/bpc"]) for r in plots.read_csv(out / "curves/rope-seed1.csv") if r["val/bpc"]]
    assert rope["max_val_rise"][1] == pytest.approx(max(vals[1] - vals[0], 0.0))
    assert (f"| `rope` | 1 | {rope['final_val_bpc']['values'][1]:.3f} | {rope['test_bpc_per_seed'][1]:.3f} | "
            f"{best[1]:.3f} ({best[0]}) | {rope['max_val_rise'][1]:.3f} | 0 |") in table
    # the anchor: every variant against softmax, seed by seed; and against none
    paired = summary["paired_final_val_bpc"]
    assert set(paired) == {"rope - softmax", "rope_norm - softmax", "none - softmax", "rope - none", "rope_norm - none"}
    nn = summary["variants"]["none"]["final_val_bpc"]["values"]
    assert paired["rope_norm - none"]["values"] == pytest.approx(
        [a - b for a, b in zip(summary["variants"]["rope_norm"]["final_val_bpc"]["values"], nn)])
    soft = summary["variants"]["softmax"]["final_val_bpc"]["values"]
    diffs = [a - b for a, b in zip(rope["final_val_bpc"]["values"], soft)]
    assert paired["rope - softmax"]["values"] == pytest.approx(diffs) and paired["rope - softmax"]["seeds"] == [0, 1]
    assert f"| `rope` − `softmax` | {plots._ms(paired['rope - softmax'])} | {diffs[0]:+.3f} (seed 0)" in table
    assert summary["row_sums_at_lengths"]["softmax"]["8L"]["min"]["mean"] == 1.0
    assert summary["attention_row_sums"]["softmax"]["max"] == pytest.approx(1.0)
    # the Eq. 19 image sits in the run's TensorBoard events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(runs / "rope-seed0"))
    ea.Reload()
    assert any(t.startswith("attention/eq19_weights") for t in ea.Tags()["images"])
    assert any(t.startswith("attention/row_sums") for t in ea.Tags()["images"])


def test_results_accumulate_across_run_dirs(tmp_path, corpus):
    """Runs exported from two run dirs (two sessions whose run dirs did not survive) end up in
    one summary: curves, extrapolation and row sums of the first stay when the second is added."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    for variant, seed in (("rope", 0), ("none", 1)):
        runs = tmp_path / f"runs-{variant}"
        code, _, err = run_main(["--preset", "tiny", "--variants", variant, "--seeds", str(seed),
                                 "--steps", "4", "--eval-every", "2", "--data", str(corpus),
                                 "--data-dir", str(tmp_path / "data"), "--out", str(runs)])
        assert code == 0, err
        for what in ("export", "extrapolate", "rowsums", "attention", "summary"):
            assert plots.main([what, "--runs", str(runs), "--data", str(corpus), "--data-dir",
                               str(tmp_path / "data"), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["variants"]) == {"rope", "none"}
    assert summary["variants"]["none"]["seeds"] == [1]
    assert set(summary["extrapolation_test_bpc"]) == {"rope", "none"}
    assert {r["run"] for r in plots.read_csv(out / "rowsums_lengths.csv")} == {"rope-seed0", "none-seed1"}
    assert set(json.loads((out / "runs.json").read_text())) == {"rope-seed0", "none-seed1"}
    assert plots.main(["tables", "--runs", str(tmp_path / "gone"), "--out", str(out)]) == 0  # no run dir needed


def test_a_run_redone_from_scratch_is_measured_again(tmp_path, corpus):
    """A seed rerun from step 0 into a run dir of the same name ends at the same step: its
    extrapolation row must come from the new weights, not from the cached row of the old run."""
    pytest.importorskip("matplotlib")
    runs, out, found = tmp_path / "runs", tmp_path / "results", []
    for lr in ("1e-3", "3e-2"):
        code, _, err = run_main(["--preset", "tiny", "--variants", "rope", "--steps", "4", "--eval-every", "2",
                                 "--lr", lr, "--data", str(corpus), "--data-dir", str(tmp_path / "data"),
                                 "--out", str(runs)])
        assert code == 0, err
        assert plots.main(["extrapolate", "--runs", str(runs), "--data", str(corpus), "--data-dir",
                           str(tmp_path / "data"), "--out", str(out)]) == 0
        (row,) = plots.read_csv(out / "extrapolation.csv")
        test_bpc = load_checkpoint(resolve_checkpoint(runs / "rope-seed0"))["metrics"]["test_bpc"]
        assert row["step"] == "4" and row["bpc_1L"] == f"{test_bpc:.5f}"
        found.append(row)
        shutil.rmtree(runs)
    assert found[0]["bpc_1L"] != found[1]["bpc_1L"] and found[0]["bpc_8L"] != found[1]["bpc_8L"]


def test_a_run_that_a_non_finite_step_stopped_is_reported_with_its_last_checkpoint(tmp_path, corpus, monkeypatch):
    pytest.importorskip("matplotlib")
    poison_training_forward(monkeypatch, {5})
    runs, out = tmp_path / "runs", tmp_path / "results"
    code, _, err = run_main(["--preset", "tiny", "--variants", "rope", "--steps", "8", "--eval-every", "2",
                             "--data", str(corpus), "--data-dir", str(tmp_path / "data"), "--out", str(runs)])
    assert code == 3, err
    for what in ("export", "extrapolate", "summary"):
        assert plots.main([what, "--runs", str(runs), "--data", str(corpus), "--data-dir",
                           str(tmp_path / "data"), "--out", str(out)]) == 0
    rope = json.loads((out / "summary.json").read_text())["variants"]["rope"]
    assert rope["ended_nonfinite_at_step"] == [5] and rope["train_bytes"] == [4 * 4 * 32]
    assert all(r["bpc_1L"] and r["bpc_8L"] for r in plots.read_csv(out / "extrapolation.csv"))
    assert "(stopped: non-finite at step 5)" in plots.tables(out)


def test_plots_cli_bad_runs_dir_is_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        plots.main(["export", "--runs", str(tmp_path / "nope"), "--out", str(tmp_path / "r")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a directory" in err[0]
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exc:
        plots.main(["export", "--runs", str(tmp_path / "empty"), "--out", str(tmp_path / "r")])
    assert exc.value.code == 2 and "no finished" in capsys.readouterr().err


def test_redraw_jumps_measure_the_step_at_each_redraw():
    curve = [(s, 3.0 if s <= 100 else 4.0 if s <= 200 else 3.5) for s in range(10, 301, 10)]
    assert plots._redraw_jumps(curve, 100) == pytest.approx([1.0, -0.5])
    assert plots._redraw_jumps(curve, 0) == [] and plots._redraw_jumps(curve, 1000) == []
