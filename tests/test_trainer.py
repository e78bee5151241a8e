"""linear_rope.enwik8.trainer: bf16 autocast per variant, torch.compile against eager, and
TrainState.state_dict() as the checkpoint."""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import losses, run_main
from linear_rope.enwik8.checkpoint import latest_checkpoint, load_checkpoint
from linear_rope.enwik8.config import TrainConfig
from linear_rope.enwik8.trainer import Trainer, compile_unavailable
from linear_rope.model import MODEL_PRESETS, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = ["rope", "rope_pre", "absolute", "none"]


@pytest.fixture(scope="module")
def splits(corpus):
    raw = np.frombuffer(corpus.read_bytes(), dtype=np.uint8)
    return {"train": raw[:60_000], "valid": raw[60_000:62_000], "test": raw[62_000:64_000]}


def trainer(splits, tmp_path: Path, position: str, dropout: float = 0.0, **train) -> Trainer:
    # 2 layers of the cpu preset's width: big enough for bf16 to round, small enough to be quick
    mc = ModelConfig(**{**MODEL_PRESETS["cpu"], "depth": 2, "seq_len": 64, "position": position,
                        "dropout": dropout, "feature_redraw_interval": 2})
    tc = TrainConfig(**{"batch_size": 4, "warmup_steps": 1, "steps": 4, "out": str(tmp_path), **train})
    return Trainer(position + "-seed0", mc, tc, splits)


@pytest.mark.parametrize("position", VARIANTS)
def test_bf16_autocast_step_is_finite_and_within_2_percent_of_fp32(splits, tmp_path, position):
    """CPU autocast stands in for CUDA's: the same step in bf16 and fp32 from the same state."""
    got = {}
    for precision in ("fp32", "bf16"):
        t = trainer(splits, tmp_path, position, precision=precision)
        seen = set()  # the dtypes the feed-forward's matmuls produced: bf16 must really be used
        hook = t.model.blocks[0].ff[0].register_forward_hook(lambda m, i, o: seen.add(o.dtype))
        losses_ = [float(t.train_step(s)[0]) for s in range(3)]  # three updates: bf16 weights drift too
        hook.remove()
        assert seen == {torch.bfloat16 if precision == "bf16" else torch.float32}, (precision, seen)
        grads = [p.grad for p in t.model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), precision
        assert all(p.dtype == torch.float32 for p in t.model.parameters())  # fp32 master weights
        got[precision] = losses_
        if precision == "bf16":  # this state's logits, at every position, against float64
            x = torch.from_numpy(splits["valid"][: 4 * 64].astype(np.int64)).view(4, 64)
            t.model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                low = t.model(x).double()
            with torch.no_grad():
                ref = t.model.double()(x)
            # 2 layers of bf16 matmuls (2^-9 per rounding, sums of 128 products): 3% of the
            # logits' spread at each position; a negated or fp32-only output is far outside
            err = (low - ref).abs().amax(-1) / ref.std(-1)
            assert (err < 0.03).all(), err.max().item()
    assert got["bf16"] != got["fp32"]  # the rounding shows
    for fp32, bf16 in zip(got["fp32"], got["bf16"]):
        # bf16 has an 8-bit mantissa (rel. error 2^-9 per rounding); the loss is a mean over
        # 256 positions of logits from bf16 matmuls, so 2% is far above its noise
        assert bf16 == pytest.approx(fp32, rel=0.02)


def test_train_state_dict_is_the_checkpoint_and_restores_exactly(splits, tmp_path):
    a = trainer(splits, tmp_path, "rope", dropout=0.1)  # the torch RNG matters too
    a.train_step(0)
    a.state.step = 1
    a.save()
    ckpt = load_checkpoint(latest_checkpoint(a.run_dir))
    sd = a.state.state_dict()
    assert set(sd) == {"model", "optimizer", "step", "rng", "config", "metrics", "world", "param_sha256"}
    assert set(ckpt) == set(sd) | {"content_sha256"}  # added by save_checkpoint, checked on load
    def steps(t):  # (loss, grad norm, stop) as Python values
        return [(float(loss), float(norm), stop) for loss, norm, stop in map(t.train_step, (1, 2))]

    want = steps(a)  # a feature redraw at step 2
    b = trainer(splits, tmp_path, "rope", dropout=0.1)  # reseeds the (shared) global RNG
    assert b.resume() and b.state.step == 1
    assert steps(b) == want  # weights, moments, every generator
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k]), k


@pytest.mark.slow
def test_compile_trains_and_its_losses_equal_eager(corpus, tmp_path):
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on CPU needs a C compiler")
    argv = ["--preset", "tiny", "--variants", "rope", "--steps", "4", "--eval-every", "0",
            "--log-every", "1", "--eval-batch-size", "2048", "--data", str(corpus),
            "--data-dir", str(tmp_path / "data")]
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        code, _, err = run_main(argv + ["--out", str(tmp_path / name), *extra])
        assert code == 0, err
    eager, compiled = losses(tmp_path / "eager/rope-seed0"), losses(tmp_path / "compiled/rope-seed0")
    assert [s for s, _ in compiled] == [s for s, _ in eager] == [1, 2, 3, 4]
    # inductor fuses and reorders fp32 reductions: equal to fp32 rounding, not bitwise
    torch.testing.assert_close(torch.tensor([v for _, v in compiled]),
                               torch.tensor([v for _, v in eager]), rtol=1e-4, atol=0)
    ckpt = load_checkpoint(latest_checkpoint(tmp_path / "compiled/rope-seed0"))
    assert not any("_orig_mod" in k for k in ckpt["model"])  # compiled in place: clean keys
    assert ckpt["config"]["train"]["compile"] is True


def test_optimizer_is_fused_adamw_with_decay_on_matrices_only(splits, tmp_path):
    t = trainer(splits, tmp_path, "rope", weight_decay=0.1)
    opt = t.state.optimizer
    assert isinstance(opt, torch.optim.AdamW) and all(g["fused"] for g in opt.param_groups)  # CPU has a fused kernel
    decay, rest = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert rest["weight_decay"] == 0.0 and all(p.dim() < 2 for p in rest["params"])
    assert len(decay["params"]) + len(rest["params"]) == len(list(t.model.parameters()))


def test_fused_adamw_steps_like_the_for_loop_one(splits, tmp_path):
    """The fused kernel is the same update: three steps from the same state, to fp32 rounding."""
    runs = {}
    for name in ("fused", "loop"):
        t = trainer(splits, tmp_path, "rope")
        if name == "loop":
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in t.state.optimizer.param_groups]
            t.state.optimizer = torch.optim.AdamW(groups, lr=t.tc.lr, foreach=False)
        runs[name] = ([float(t.train_step(s)[0]) for s in range(3)], [p.detach().clone() for p in t.model.parameters()])
    assert runs["fused"][0] == pytest.approx(runs["loop"][0], rel=1e-5)
    for a, b in zip(runs["fused"][1], runs["loop"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_compile_without_a_cxx_compiler_trains_eagerly_with_one_info_line(splits, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no g++, c++ or clang++ on it
    monkeypatch.delenv("CXX", raising=False)
    assert "C++ compiler" in compile_unavailable(torch.device("cpu"))
    assert compile_unavailable(torch.device("cuda")) is None  # Inductor writes Triton there, not C++
    t = trainer(splits, tmp_path, "rope", compile=True)
    t._open()
    try:
        losses_ = [float(t.train_step(s)[0]) for s in range(2)]
    finally:
        t._close()
    err = capsys.readouterr().err
    assert not t.compiled and all(np.isfinite(losses_))
    assert [ln for ln in err.splitlines() if "info:" in ln] == [
        "rope-seed0: info: no C++ compiler on the PATH ($CXX, g++, c++, clang++), which torch.compile needs on the "
        "CPU; training eagerly (--no-compile says so up front)"]
    header = [ln for ln in err.splitlines() if " params, steps " in ln]
    assert len(header) == 1 and ", compiled" not in header[0]
