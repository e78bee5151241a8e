"""The global-memory bytes each fused kernel loads and stores, counted in Triton's interpreter
(every ``tl.load`` / ``tl.store``: its active lanes times the element size), for
``tests/test_fused_bytes.py`` to hold ``linear_rope/ops/fused/pricing.py``'s formulas to.

The counting is a small copy of ``shared/tools/triton_bytes.py`` (a measuring aid outside the
repository): the interpreter's masked load and store, patched to add up their bytes. The
interpreter is switched on when a kernel is decorated, so this runs in a process of its own:
``python tests/fused_bytes.py B H N d m e`` prints one JSON object, per launch (``_dqkv`` twice:
``_dqkv[dq]``, ``_dqkv[dk]``, ``_dqkv[dv]``) [loads, stores] in bytes, bf16 inputs (the kernels' LOWP).
"""
from __future__ import annotations

import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import fused_interp  # noqa: E402,F401  (first: the interpreter, bf16 as on the GPU)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from triton.runtime import interpreter as _I  # noqa: E402

_B = _I.InterpreterBuilder
_load, _store = _B.create_masked_load, _B.create_masked_store
COUNT = [0, 0]  # loads, stores: bytes


def _bytes(ptrs, mask) -> int:
    n = ptrs.data.size if mask is None else int(np.count_nonzero(np.broadcast_to(mask.data, ptrs.data.shape)))
    return n * (ptrs.get_element_ty().primitive_bitwidth // 8)


def _masked_load(self, ptrs, mask, other, *a, **k):
    COUNT[0] += _bytes(ptrs, mask)
    return _load(self, ptrs, mask, other, *a, **k)


def _masked_store(self, ptrs, value, mask, *a, **k):
    COUNT[1] += _bytes(ptrs, mask)
    return _store(self, ptrs, value, mask, *a, **k)


_B.create_masked_load, _B.create_masked_store = _masked_load, _masked_store

from linear_rope.ops.fused import launch  # noqa: E402
from linear_rope.ops.fused.op import _projection_of  # noqa: E402
from linear_rope.ops.rope_tables import rope_pair_tables  # noqa: E402


def counted(counts: dict):
    """A ``wrap_triton`` stand-in: runs each launch, its bytes in ``counts`` under its name."""
    def wrap(kernel):
        name = getattr(kernel, "__name__", None) or kernel.fn.__name__

        class Launch:
            def __getitem__(self, grid):
                def run(*args, **kw):
                    key = name + ({0: "[dq]", 1: "[dk]", 2: "[dv]"}[kw["PART"]] if "PART" in kw else "")
                    COUNT[:] = [0, 0]
                    kernel[grid](*args, **kw)
                    counts[key] = list(COUNT)
                return run
        return Launch()
    return wrap


def main(B: int, H: int, N: int, d: int, m: int, e: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, H, N, d, generator=g).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(B, H, N, e, generator=g).to(torch.bfloat16)
    wa, wb, c = _projection_of(torch.randn(m, d, generator=g), True)
    cos2, sin2 = rope_pair_tables(N, m, 0, 10000.0, None, q.device, torch.float32)
    cos, sin = cos2[..., 0::2], sin2[..., 1::2]  # as op.fused_causal passes them
    counts: dict = {}
    wrap = counted(counts)
    out, S, z, den, rmax, Sb, zb = launch.forward(wrap, q, k, v, wa, wb, c, cos, sin, None, None, None, True,
                                                  torch.bfloat16)
    dout = torch.randn(B, H, N, e, generator=g).to(torch.bfloat16)
    launch.backward(wrap, q, k, v, wa, wb, c, cos, sin, None, out, den, rmax, Sb, zb, dout, None, None, True)
    return counts


if __name__ == "__main__":
    print(json.dumps(main(*(int(x) for x in sys.argv[1:7]))))
