"""Every memory access of a Triton kernel inside its tensors, checked in Triton's interpreter.

The interpreter reads and writes through raw addresses, like the GPU, but an access outside a
tensor rarely fails on the CPU: it reads whatever lies beside it. ``bounds_checked()`` patches
the interpreter so every load and store checks each lane its mask lets through against the
extent of the running kernel's tensor arguments (from the first element of each view to its
last, by its strides) and raises ``OutOfBounds`` naming the nearest tensor. Use it around
interpreter calls (``TRITON_INTERPRET=1``)::

    with bounds_checked() as log:
        out = linear_rope.ops.triton.rotary_linear_attention(q, k, v, projection=W)
    log["accesses"]  # how many loads and stores were checked

The first GPU run met an illegal memory access in the bf16 tensor-core builds
(benchmarks/results/h200); under this check the same programs stay inside their tensors, which
places that fault in the compiled code. It does not see races, shared memory or spills.
"""
from __future__ import annotations

import contextlib

import numpy as np

__all__ = ["OutOfBounds", "bounds_checked"]


class OutOfBounds(RuntimeError):
    """A kernel lane loaded or stored outside every tensor argument of its launch."""


def _extent(t) -> tuple[int, int, tuple]:
    lo = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else -1
    return lo, lo + (last + 1) * t.element_size(), tuple(t.shape)


@contextlib.contextmanager
def bounds_checked():
    import triton.runtime.interpreter as I

    state = {"ranges": [], "kernel": "?", "accesses": 0}
    init, load, store = I.GridExecutor._init_args_hst, I.InterpreterBuilder.create_masked_load, \
        I.InterpreterBuilder.create_masked_store

    def _init(self, args_dev, kwargs):
        args, kw = init(self, args_dev, kwargs)
        state["kernel"] = getattr(self.fn, "__name__", "?")
        state["ranges"] = [_extent(x) for x in (*args, *kw.values()) if hasattr(x, "data_ptr")]
        return args, kw

    def _check(kind, ptrs, mask, size):
        lanes = ptrs.data[mask.data] if mask is not None else ptrs.data.ravel()
        state["accesses"] += 1
        if lanes.size == 0:
            return
        ok = np.zeros(lanes.shape, bool)
        for lo, hi, _ in state["ranges"]:
            ok |= (lanes >= lo) & (lanes + size <= hi)
        if not ok.all():
            first = int(lanes[~ok][0])
            lo, hi, shape = min(state["ranges"], key=lambda r: min(abs(first - r[0]), abs(first - r[1])))
            raise OutOfBounds(f"{state['kernel']}: a {kind} of {int((~ok).sum())} lanes outside its tensors, the first "
                              f"{first - lo:+d} B from the start of a tensor {shape} of {hi - lo} B")

    def _load(self, ptrs, mask, other, *a):
        _check("load", ptrs, mask, np.dtype(I._get_np_dtype(ptrs.get_element_ty())).itemsize)
        return load(self, ptrs, mask, other, *a)

    def _store(self, ptrs, value, mask, *a):
        _check("store", ptrs, mask, value.data.dtype.itemsize)
        return store(self, ptrs, value, mask, *a)

    I.GridExecutor._init_args_hst = _init
    I.InterpreterBuilder.create_masked_load, I.InterpreterBuilder.create_masked_store = _load, _store
    try:
        yield state
    finally:
        I.GridExecutor._init_args_hst = init
        I.InterpreterBuilder.create_masked_load, I.InterpreterBuilder.create_masked_store = load, store
