"""Backward under autocast on every backend a call can take: a backward called inside the
``with torch.autocast(...)`` block gives the gradients a backward outside it gives (the torch
path's custom backward used to crash with "Input dtypes must be the same"): bit for bit where
the op's own backward runs (the torch path's custom op), within the autocast dtype's rounding
where plain ops' backward runs (autocast then casts their products too, as PyTorch documents
for a backward under autocast). Double backward is
either right (float32 / float64: plain autograd on the chunk-parallel path) or one clear
RuntimeError (the chunk-parallel path's bf16 products, whose own backward is not
differentiated: it used to return second derivatives 30-45% off, silently; the torch path's
hand-written backward)."""
from __future__ import annotations

import pytest
import torch

from linear_rope import FavorFeatures, PerformerLM, RotaryLinearAttention
from linear_rope import naive_rotary_linear_attention as naive
from linear_rope import rotary_linear_attention as fast
from linear_rope.model import MODEL_PRESETS, ModelConfig
from linear_rope.ops import parallel
from linear_rope.ops import backend as dispatch

BACKENDS = ["torch", "parallel"]
LOW = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, request.param)
    return request.param


def _op_case(kind):
    """A function of its leaves -> a scalar loss, and the leaves (float32)."""
    g = torch.Generator().manual_seed(len(kind))
    q, k, v = (torch.rand(2, 2, 70, 8, generator=g) + 0.05 for _ in range(3))
    kw = dict(causal=kind != "bidir")
    leaves = [q, k, v]
    if kind == "favor":
        torch.manual_seed(0)
        kw["projection"] = FavorFeatures(8, 8).projection
        leaves = [q - 0.5, k - 0.5, v]
    if kind == "state":
        leaves += [torch.randn(2, 2, 8, 8, generator=g), torch.rand(2, 2, 8, generator=g) + 0.5]
        kw["output_final_state"] = True
    up = torch.randn(2, 2, 70, 8, generator=g)
    eye = torch.eye(8)

    def loss(*xs):
        q, k, v = (x @ eye for x in xs[:3])  # under autocast: low-precision inputs, as a model gives them
        if kind == "state":
            out, st = fast(q, k, v, initial_state=tuple(xs[3:]), **kw)
            return (out.float() * up).sum() + st.S.float().square().sum() + st.z.float().sum()
        return (fast(q, k, v, **kw).float() * up).sum()

    return loss, leaves


def _close(got, want, tol):
    """Normwise: ||got - want|| <= tol ||want|| (0: bit for bit)."""
    assert got is not None and torch.isfinite(got).all()
    if tol == 0:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        assert (got - want).norm() <= tol * want.norm(), ((got - want).norm() / want.norm()).item()


def _tol(dtype, exact: bool):
    return 0 if exact else 2 * torch.finfo(dtype).eps


def _grads(loss, leaves, dtype, inside: bool):
    xs = [t.clone().requires_grad_() for t in leaves]
    with torch.autocast("cpu", dtype=dtype):
        value = loss(*xs)
        if inside:
            value.backward()
    if not inside:
        value.backward()
    return [x.grad for x in xs]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("kind", ["features", "favor", "bidir", "state"])
def test_op_backward_inside_autocast_is_the_backward_outside(backend, kind, dtype):
    loss, leaves = _op_case(kind)
    inside, outside = _grads(loss, leaves, dtype, True), _grads(loss, leaves, dtype, False)
    for a, b in zip(inside, outside):  # the custom op of the causal torch path: its own backward
        _close(a, b, _tol(dtype, exact=backend == "torch" and kind != "bidir"))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("position", ["rope", "rope_pre", "rope_norm", "none", "absolute", "softmax"])
def test_model_and_layer_backward_inside_autocast(backend, position, dtype):
    """PerformerLM (with a padding mask) and the layer: loss.backward() inside the autocast block
    gives the parameters the gradients a backward outside it gives."""
    torch.manual_seed(0)
    lm = PerformerLM(ModelConfig(**{**MODEL_PRESETS["tiny"], "position": position}))
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, :3] = False

    def grads(inside):
        lm.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = lm(ids, mask=mask).float().logsumexp(-1).sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        return [p.grad.clone() for p in lm.parameters() if p.grad is not None]

    a, b = grads(True), grads(False)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        _close(x, y, 2 * _tol(dtype, exact=False))
    if position in ("rope", "rope_pre"):
        layer = RotaryLinearAttention(16, heads=2, dim_head=8, nb_features=8, position=position)
        x = torch.randn(2, 70, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
        with torch.autocast("cpu", dtype=dtype):
            layer(x).float().sum().backward()
        assert torch.isfinite(x.grad).all()


# --- double backward ---------------------------------------------------------------------------

def _second(q, k, v, up):
    """d/dk of sum(d loss / dq): a second derivative through the op's backward."""
    out = fast(q, k, v)
    (gq,) = torch.autograd.grad((out.to(up.dtype) * up).sum(), q, create_graph=True)
    (gk,) = torch.autograd.grad(gq.sum(), k)
    return gk


def _leaves(dtype=torch.float32, n=37):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.rand(1, 2, n, 6, generator=g, dtype=torch.float64) + 0.05 for _ in range(3))
    up = torch.randn(1, 2, n, 6, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)], up.to(dtype)


@pytest.mark.parametrize("how", ["autocast-bf16", "bf16-inputs"])
def test_double_backward_of_the_parallel_bf16_products_is_refused(monkeypatch, how):
    monkeypatch.setenv(dispatch.ENV_VAR, "parallel")
    (q, k, v), up = _leaves(torch.bfloat16 if how == "bf16-inputs" else torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast-bf16"):
        with pytest.raises(RuntimeError, match="double backward") as err:
            _second(q, k, v, up.float())
    assert str(err.value) == parallel.DOUBLE_BACKWARD and "\n" not in str(err.value)
    out = fast(q, k, v)  # a first-order backward is unchanged
    (out.float() * up.float()).sum().backward()
    assert torch.isfinite(q.grad).all()


def test_double_backward_of_the_torch_path_is_refused(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    (q, k, v), up = _leaves()
    with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True\) is not supported") as err:
        _second(q, k, v, up)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_double_backward_of_the_parallel_path_is_one_line_in_every_dtype(monkeypatch, dtype):
    """The chunk-parallel path's backward is written by hand (it recomputes rather than saves): a
    second derivative through it is refused in one line in every dtype, never silently wrong, and
    the message names the way that works (torch.func, the composite path)."""
    monkeypatch.setenv(dispatch.ENV_VAR, "parallel")
    (q, k, v), up = _leaves(dtype)
    with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True\) is not supported") as err:
        _second(q, k, v, up)
    assert "\n" not in str(err.value) and "torch.func" in str(err.value)
