"""Every load and store of every Triton kernel stays inside its launch's tensors, checked lane by
lane in the interpreter (``linear_rope.ops.triton.bounds``): every config the dispatch can pick
(fp32, bf16 and fp16 defaults, the bf16 tensor-core config) and every keyword the kernels take,
forward and backward, at sizes that leave partial chunks and partial blocks of pairs. And the
check itself fails an access one element past a tensor."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.language is imported (see conftest.py)
triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[triton]')")
import triton.language as tl  # noqa: E402
from triton.runtime.errors import InterpreterError  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from linear_rope.features import FavorFeatures  # noqa: E402
from linear_rope.ops import LinearAttentionState  # noqa: E402
from linear_rope.ops.triton import dispatch, rotary_linear_attention  # noqa: E402
from linear_rope.ops.triton.bounds import bounds_checked  # noqa: E402
from linear_rope.ops.triton.emulation import tensor_core_dots  # noqa: E402


@triton.jit
def _copy(x_ptr, y_ptr, n, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < n), mask=o < n)


@pytest.fixture(autouse=True)
def _interpreted():
    if not isinstance(_copy, InterpretedFunction):
        pytest.skip("the check runs in Triton's interpreter (TRITON_INTERPRET=1 before triton.language)")


def test_the_check_fails_one_element_past_a_tensor():
    x, y = torch.arange(16.0), torch.zeros(16)
    with bounds_checked() as log:
        _copy[(1,)](x, y, 16, B=32)  # masked to the 16 that exist
        assert torch.equal(x, y) and log["accesses"] == 2
        # the interpreter wraps what a kernel raises in its own error, the message kept
        with pytest.raises(InterpreterError, match=r"OutOfBounds.*_copy: a load of 1 lanes outside its tensors, the "
                                                   r"first \+64 B from the start of a tensor \(16,\) of 64 B"):
            _copy[(1,)](x, y, 17, B=32)
        with pytest.raises(InterpreterError, match="OutOfBounds.*_copy: a store of 8 lanes"):
            _copy[(1,)](x, torch.zeros(8), 16, B=16)
    _copy[(1,)](x, y, 16, B=16)  # restored on exit: no check, no count
    assert log["accesses"] == 5  # 2 + the failing load + a load and the failing store


CONFIGS = [("float32", False), ("float16", False), ("bfloat16", False), ("bfloat16", True)]


@pytest.mark.parametrize("dtype, tc", CONFIGS, ids=[f"{d}{'-tc' if t else ''}" for d, t in CONFIGS])
@pytest.mark.parametrize("fused", [True, False], ids=["favor", "features"])
def test_kernels_stay_inside_their_tensors(dtype, tc, fused, monkeypatch):
    """m = 70 (35 pairs: three blocks, the last partial), N = 70 (a partial second chunk), B = 2
    with left padding and per-row offsets, an initial state and the final state: forward and
    backward of all six kernels, every access in bounds. (Its first run found the bf16
    tensor-core config reading the projection's bf16 pieces for features in, where none exist:
    1023 lanes past a one-element stand-in.)"""
    monkeypatch.setattr(dispatch, "BF16_TENSOR_CORES", tc)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    B, H, N, d, m, e = 2, 1, 70, 16, 70, 24
    torch.manual_seed(0)
    w = FavorFeatures(d, m).projection if fused else None
    x = d if fused else m
    q, k = (torch.randn(B, H, N, x, generator=g) for _ in range(2))
    if not fused:
        q, k = q.abs() + 0.05, k.abs() + 0.05
    v = torch.randn(B, H, N, e, generator=g)
    q, k, v = (t.to(dt).requires_grad_() for t in (q, k, v))
    S0 = torch.rand(B, H, m, e, generator=g).requires_grad_()
    z0 = torch.rand(B, H, m, generator=g).add(1.0).requires_grad_()
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, :5] = False
    with bounds_checked() as log, tensor_core_dots():
        out, st = rotary_linear_attention(q, k, v, projection=w, mask=mask, offset=torch.tensor([3, 0]),
                                          initial_state=LinearAttentionState(S0, z0), output_final_state=True)
        torch.autograd.grad(out.float().sum() + st.S.sum() + st.z.sum(), (q, k, v, S0, z0))
    assert log["accesses"] > 100 and torch.isfinite(out.float()).all()
