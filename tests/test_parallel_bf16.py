"""The chunk-parallel path's bf16 contract (``tolerances.PARALLEL_BF16_CONTRACT``) over a seeded
fuzz of shapes: bf16 q, k, v (odd lengths, several head sizes and feature counts, FAVOR+
inside), its output, final state and gradients against the float64 op on the same q, k, v,
beside bf16 SDPA's against float64 softmax attention on the same q, k, v and shapes. Also: its
backward recomputes the features (it keeps none of them), and double backward is a one-line
error."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from linear_rope import FavorFeatures
from linear_rope import naive_rotary_linear_attention as naive
from linear_rope import rotary_linear_attention as op
from linear_rope.ops import parallel
from linear_rope.ops.tolerances import PARALLEL_BF16_CONTRACT, relative_error
from linear_rope.ops import backend as dispatch


@pytest.fixture(autouse=True)
def parallel_backend(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "parallel")
    monkeypatch.delenv(parallel.CHECKS_VAR, raising=False)


def _draw(seed):
    """Shapes of the fuzz: B, H, N (odd), d, m, e, chunk size, and whether v comes through a
    bf16 autocast (float32 q, k, v rounded by the autocast) or as bf16 tensors."""
    r = random.Random(seed)
    d = r.choice([8, 16, 32, 64])
    return dict(B=r.randint(1, 2), H=r.randint(1, 3), N=2 * r.randint(20, 300) + 1, d=d,
                m=r.choice([d, 2 * d, 266 if d == 64 else 3 * d]), e=r.choice([8, 16, 64]),
                C=r.choice([None, 16, 32]), autocast=r.random() < 0.3)


def _errors(B, H, N, d, m, e, C, autocast, seed):
    """(ours, SDPA's): relative errors (``relative_error``) of the output and the gradients of
    q, k, v under one random upstream gradient, each against float64 on the same bf16 q, k, v;
    ours also of the final state's S and z (SDPA has none)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, x, generator=g).to(torch.bfloat16) for x in (d, d, e))
    w = FavorFeatures(d, m).projection
    up = torch.randn(B, H, N, e, generator=g, dtype=torch.float64)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, st = op(*(x.float() for x in xs), projection=w, chunk_size=C, output_final_state=True)
    else:
        out, st = op(*xs, projection=w, chunk_size=C, output_final_state=True)
    grads = torch.autograd.grad((out.double() * up).sum(), xs)
    x64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_st = naive(*x64, projection=w.double(), output_final_state=True)
    want = torch.autograd.grad((ref * up).sum(), x64)
    ours = [relative_error(a, b) for a, b in zip((out, *grads, st.S, st.z), (ref, *want, ref_st.S, ref_st.z))]
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    so = F.scaled_dot_product_attention(*xs, is_causal=True)
    sg = torch.autograd.grad((so.double() * up).sum(), xs)
    x64 = [t.double().requires_grad_() for t in (q, k, v)]
    sr = F.scaled_dot_product_attention(*x64, is_causal=True)
    sw = torch.autograd.grad((sr * up).sum(), x64)
    sdpa = [relative_error(a, b) for a, b in zip((so, *sg), (sr, *sw))]
    return ours, sdpa


@pytest.mark.parametrize("seed", [*range(8), 27, 38])  # 27, 38: the worst of 40 draws (out, dq)
def test_bf16_contract_against_sdpa_over_random_shapes(seed):
    """Output and dq, dk, dv: within ``PARALLEL_BF16_CONTRACT`` of bf16 SDPA's error on the same
    q, k, v and shapes; the final state's S and z within it of SDPA's output error."""
    shape = _draw(seed)
    ours, sdpa = _errors(**shape, seed=seed)
    names = ("out", "dq", "dk", "dv")
    for name, a, b in zip(names, ours, sdpa):
        assert a <= PARALLEL_BF16_CONTRACT * b, (name, a, b, shape)
    for name, a in zip(("S", "z"), ours[4:]):
        assert a <= PARALLEL_BF16_CONTRACT * sdpa[0], (name, a, sdpa[0], shape)


def test_what_the_backward_keeps(monkeypatch):
    """What autograd keeps of the paper preset's attention (m = 266 features of d = 64) under
    bf16: the four feature operands (bf16 on the GPU), and beyond ``KEEP_BYTES`` none of them:
    the backward recomputes them from q and k (same gradients, to bf16's rounding)."""
    B, H, N, d, m, e = 1, 2, 256, 64, 266, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, x, generator=g).to(torch.bfloat16).requires_grad_() for x in (d, d, e))
    w = FavorFeatures(d, m).projection

    def kept_and_grads():
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(tuple(t.shape)) or t, lambda t: t):
            out = op(q, k, v, projection=w)
        grads = torch.autograd.grad(out.float().pow(2).sum(), (q, k, v))
        return [s for s in kept if len(s) == 5 and s[-1] == m], grads  # [B, H, nc, C, m]: the operands

    feats, grads = kept_and_grads()
    assert len(feats) == 4, feats
    monkeypatch.setattr(parallel, "KEEP_BYTES", 0)
    feats, again = kept_and_grads()
    assert feats == [], feats
    for a, b in zip(grads, again):
        assert relative_error(a, b) <= 2.0**-7, relative_error(a, b)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "float64"])
def test_double_backward_is_a_one_line_error(bf16):
    dt = torch.bfloat16 if bf16 else torch.float64
    q, k, v = (torch.randn(1, 2, 33, 8, dtype=dt).requires_grad_() for _ in range(3))
    out = op(q, k, v, projection=FavorFeatures(8, 16).projection.to(dt))
    with pytest.raises(RuntimeError, match="double backward") as err:
        torch.autograd.grad(out.float().sum(), q, create_graph=True)
    assert "\n" not in str(err.value).strip()


TRAIN_DATA_VAR = "LINEAR_ROPE_TRAIN_DATA"


@pytest.mark.slow
def test_bf16_training_follows_float32(tmp_path):
    """The ``cpu`` preset (Eq. 19, the parallel path) trained 200 steps in float32 and under a bf16
    autocast on the same data and seed: the training loss of every logged step within 0.5%.
    Opt-in (two trainings, about 10 min on 2 idle cores): set ``LINEAR_ROPE_TRAIN_DATA`` to an
    enwik8-style corpus. Measured once (enwiki-sample.xml.bz2, 1 thread each, side by side):
    ``LINEAR_ROPE_BACKEND=parallel python -m linear_rope.enwik8 --preset cpu --variants rope
    --steps 200 --eval-every 200 --data enwiki-sample.xml.bz2 --precision {fp32,bf16} --threads 1
    --no-compile``: largest difference over the 20 logged steps 0.25% (step 150), step 200 loss
    2.7989 / 2.7965 (-0.08%), validation bpc 3.9041 / 3.9012 (-0.07%)."""
    import os
    import subprocess
    import sys

    data = os.environ.get(TRAIN_DATA_VAR)
    if not data:
        pytest.skip(f"set {TRAIN_DATA_VAR} to a corpus to train on (two 200-step trainings)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        cmd = [sys.executable, "-m", "linear_rope.enwik8", "--preset", "cpu", "--variants", "rope", "--steps", "200",
               "--eval-every", "200", "--log-every", "10", "--data", data, "--data-dir", str(tmp_path / "data"),
               "--out", str(out), "--precision", precision, "--threads", "1", "--no-compile"]
        subprocess.run(cmd, check=True, env={**os.environ, dispatch.ENV_VAR: "parallel"}, capture_output=True)
        ea = EventAccumulator(str(next((out / "rope-seed0").glob("events*"))))
        ea.Reload()
        losses[precision] = {e.step: e.value for e in ea.Scalars("train/loss")}
    steps = sorted(set(losses["fp32"]) & set(losses["bf16"]))
    assert len(steps) >= 10, steps
    for s in steps:
        a, b = losses["fp32"][s], losses["bf16"][s]
        assert abs(b - a) <= 0.005 * a, (s, a, b)


def test_a_redrawn_projection_is_not_served_from_the_cache():
    """The projection's GEMM operands are made once per projection (eager), keyed by its storage
    and version: a redraw in place (``FavorFeatures.redraw``) gives the new projection's result."""
    feats = FavorFeatures(8, 16)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 37, 8, generator=g, dtype=torch.float64) for _ in range(3))
    w = feats.projection.double()
    first = op(q, k, v, projection=w)
    assert relative_error(first, naive(q, k, v, projection=w)) <= 1e-12
    w.copy_(FavorFeatures(8, 16).projection.double())  # in place, as a redraw
    second = op(q, k, v, projection=w)
    assert relative_error(second, naive(q, k, v, projection=w)) <= 1e-12
    assert relative_error(second, first) > 1e-3
