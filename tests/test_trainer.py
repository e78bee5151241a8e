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
from linear_rope import PerformerLM
from linear_rope.enwik8.step import compile_blocks
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
    """The fused kernel is the same update as the for-loop one, to fp32 rounding: three steps of
    the model's own (clipped) gradients, each step's gradients fed to both optimizers.

    The bound is derived, not fitted. u = eps_fp32 / 2 = 2**-24 is one rounding. Each
    implementation's step differs from exact arithmetic by at most, to first order in u:
    * 3u|p|: the decay factor 1 - lr*wd (a scalar rounded to fp32), its product with p, the final
      p - update; |p| taken as the larger of the parameter before and after the step;
    * (11t + 8)u * |update| at step t: m = beta1 m + (1 - beta1) g, at most 4 roundings a step, each
      at most u times 2 sum_i a_i |g_i| (a_i: g_i's weight in m), so 8u t of that sum by step t; v,
      positive terms only, at most 6 roundings a step: 6u t relative, 3u t + u after the sqrt; then
      the bias corrections (2u), the division by sqrt(1 - beta2^t) (u), + eps (u), lr / (1 - beta1^t)
      (u), m / denom (u) and the product with the step size (u). Scalars are computed in float64
      and rounded once. An FMA (the fused kernel on some CPUs) only removes roundings.
    * |update| <= lr_t R_t with R_t = sqrt(1 - beta2^t) / (1 - beta1^t) * sqrt(sum_i a_i^2 / b_i)
      (Cauchy-Schwarz, b_i: g_i's weight in v), which also bounds the sum of |a_i g_i| over
      sqrt(v) in the m term above; R_1 = 1, R_2 = 1.0014 and R_3 = 1.0036 for AdamW's betas.
    A parameter difference carries to the next step unchanged (times 1 - lr*wd <= 1), and m's and
    v's are in the t-fold terms, so after three steps |fused - loop| <= twice (two implementations)
    the sum over the steps. Below eps (1e-8) sqrt(v) is swamped by eps, denormals included."""
    from linear_rope.enwik8.config import lr_at

    t = trainer(splits, tmp_path, "rope", weight_decay=0.1)
    fused = t.state.optimizer
    params = list(t.model.parameters())
    copies = {id(p): p.detach().clone() for p in params}
    start = {id(p): p.detach().double() for p in params}
    loop = torch.optim.AdamW([{"params": [copies[id(p)] for p in g["params"]], "weight_decay": g["weight_decay"]}
                              for g in fused.param_groups], lr=t.tc.lr, foreach=False)
    assert all(g["fused"] for g in fused.param_groups) and not any(g["fused"] for g in loop.param_groups)
    beta1, beta2 = fused.defaults["betas"]
    assert loop.defaults["betas"] == (beta1, beta2) and loop.defaults["eps"] == fused.defaults["eps"]
    u = torch.finfo(torch.float32).eps / 2
    bound = {id(p): torch.zeros_like(p, dtype=torch.float64) for p in params}
    for step in range(3):
        before = {id(p): p.detach().double().abs() for p in params}
        t.train_step(step)  # the fused update, with this step's lr
        for p in params:
            copies[id(p)].grad = p.grad.clone()
        for g in loop.param_groups:
            g["lr"] = lr_at(step, t.tc)
        loop.step()
        k = step + 1
        a = [(1 - beta1) * beta1 ** (k - i) for i in range(1, k + 1)]
        b = [(1 - beta2) * beta2 ** (k - i) for i in range(1, k + 1)]
        r = (1 - beta2 ** k) ** 0.5 / (1 - beta1 ** k) * sum(x * x / y for x, y in zip(a, b)) ** 0.5
        assert 0.999 < r < 1.004
        for p in params:
            size = torch.maximum(before[id(p)], torch.maximum(p.detach().double().abs(), copies[id(p)].double().abs()))
            bound[id(p)] += 2 * (3 * u * size + (11 * k + 8) * u * lr_at(step, t.tc) * r)
    for p in params:
        diff = (p.detach().double() - copies[id(p)].double()).abs()
        assert (diff <= bound[id(p)]).all(), (diff - bound[id(p)]).max().item()
        # the steps moved the parameters far more than the bound: a wrong update would show
        moved = (p.detach().double() - start[id(p)]).abs()
        assert moved.max() > 100 * bound[id(p)].max(), (moved.max().item(), bound[id(p)].max().item())


def test_one_compile_serves_every_block():
    """Regional compilation (``compile_blocks``, the trainer's and the GPU window's): at depth 4
    one graph, the logits and gradients of eager, the state_dict keys unchanged."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model, ref = PerformerLM.from_preset("tiny", depth=4), PerformerLM.from_preset("tiny", depth=4)
    ref.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    torch._dynamo.reset()
    c0 = counters["stats"]["unique_graphs"]
    assert compile_blocks(model, backend="eager").startswith("regional: the 4 blocks")
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    out, want = model(x), ref(x)
    out.square().mean().backward()
    want.square().mean().backward()
    assert counters["stats"]["unique_graphs"] - c0 == 1
    torch.testing.assert_close(out, want)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    assert list(model.state_dict()) == keys


def test_compile_compiles_each_block_and_names_the_path(splits, tmp_path):
    """``--compile``: the blocks compiled in place, not the model; the header names the path the
    compiled graph holds (no compile runs here: nothing is called)."""
    if compile_unavailable(torch.device("cpu")) is not None:
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    t = trainer(splits, tmp_path, "rope", compile=True)
    t._open()
    try:
        assert t.compiled and t.model._compiled_call_impl is None
        assert all(b._compiled_call_impl is not None for b in t.model.blocks)
        assert t.attention.startswith("torch path (") and t.attention.endswith(", compiled (default)")
    finally:
        t._close()


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
