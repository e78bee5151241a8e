"""The one counter of kernel launches and host syncs: what a GPU would wait on, counted on the CPU.

    c, out = count(fn, *args)        # run fn under the counter
    with counted() as c: ...         # or a block
    c.launches, c.syncs, c.total(outside="linear_rope/ops/"), c.report(), c.as_dict()

``benchmarks.launches`` and ``benchmarks.generation`` count with it, and so do the tests
(``tests/test_syncs.py``, ``test_parallel.py``, ``test_decode.py``, ``test_launches.py``).

Rules:

* **launch**: an ATen op the dispatcher runs that is not a view or metadata: not ``is_view``
  (``view``, ``transpose``, ``select``, ``detach``, ``lift_fresh``, ...) and not an allocation or
  a metadata change (``ALLOC_OR_META``: ``empty``, ``_unsafe_view``, ``resize_``, ...). A foreach
  or fused op (``_foreach_norm``, ``_fused_adamw_``) counts 1, as it is one dispatcher call (on
  CUDA one launch per chunk of tensors). Custom ops (``linear_rope::chunk_causal`` and its
  backward) are counted *inside*: their eager bodies run under the counter, so every ATen op of
  the block walk counts.
* **sync**: ``aten._local_scalar_dense`` (a value read by the host), ``nonzero`` and
  ``masked_select`` (outputs sized by values: a launch and a sync), ``equal`` (a host bool),
  ``index`` / ``index_put_`` by a bool mask (they run ``nonzero`` inside), plus what the dispatcher
  never shows, seen by a ``TorchFunctionMode``: ``tolist``, ``item``, ``bool``, ``int``,
  ``float``, ``index`` of a tensor, and ``torch.tensor`` / ``torch.as_tensor`` of Python data (a
  host-to-device copy on a GPU). A read counts once (``item`` is not counted again as its
  ``_local_scalar_dense``). Copies between devices are not seen (everything stays on the CPU).
* **dispatcher calls**: every op the dispatch mode sees, views, allocations and custom ops
  included; a composite op that reaches the mode whole (inside a custom op's body, below
  autograd) counts as the ops it decomposes into, as it does everywhere else. The host-time
  estimate is calls x ``US_PER_CALL`` = 9 us (the H200's 8.1-10.5 us a call: ``calibration`` in
  ``results/launches_baseline.json``, commit 011edba). The CPU's buffer pool (``ops/workspace.py``)
  is cleared before each count, so every buffer is a fresh allocation, as on a GPU.
* **GEMM FLOPs** by operand dtype: ``mm``, ``addmm``, ``bmm``, ``baddbmm`` (2 per multiply-add),
  to show what runs in fp32 under bf16 autocast; and the sizes of the tensors cast or copied
  (``copied``: ``_to_copy``, ``copy_``), to show what a step re-casts.
* Each sync is attributed to the innermost stack frame in ``linear_rope/`` outside ``checks.py``
  (a shared check's sync belongs to its caller), as ``linear_rope/x.py:12`` (None where no package
  frame is on the stack), with what it was; each launch to the innermost ``linear_rope/`` file and
  function.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
US_PER_CALL = 9.0
ALLOC_OR_META = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
                 "_reshape_alias", "resize_", "set_", "as_strided_", "record_stream", "_local_scalar_dense",
                 "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "detach_",
                 "scalar_tensor", "promote_types"}
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "equal"}
BOOL_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}
GEMMS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}
READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__"}


@functools.lru_cache(maxsize=1)
def _package() -> str:
    import linear_rope

    return str(Path(linear_rope.__file__).resolve().parent) + "/"


def _site(pass_on: bool) -> str | None:
    """The innermost ``linear_rope/`` frame outside this module: ``linear_rope/x.py:12`` (with
    ``pass_on``, frames of ``checks.py`` skipped), else ``linear_rope/x.py fn``."""
    pkg, f = _package(), sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(pkg) and not (pass_on and name.endswith("/checks.py")):
            rel = "linear_rope/" + name[len(pkg):]
            return f"{rel}:{f.f_lineno}" if pass_on else f"{rel} {f.f_code.co_name}"
        f = f.f_back
    return None if pass_on else "(outside linear_rope)"


class Counter:
    """Counts of one region: launches, syncs, dispatcher calls, custom ops, GEMM FLOPs by dtype,
    the ops launched (by name), where each sync came from and what it was (``sync_at``: (site,
    what) -> n), and where each launch came from."""

    def __init__(self):
        self.launches = self.syncs = self.calls = self.custom = 0
        self.ops, self.sync_at, self.launch_at = (collections.Counter() for _ in range(3))
        self.gemm_flops = collections.Counter()
        self.copied: list[int] = []  # the sizes (elements) of the tensors cast or copied (_to_copy, copy_)
        self._reading = 0

    def sync(self, what: str) -> None:
        self.syncs += 1
        self.sync_at[(_site(True), what)] += 1

    def total(self, outside: str | None = None) -> int:
        """All syncs, or those whose site is not under ``outside`` (e.g. ``"linear_rope/ops/"``)."""
        return sum(n for (w, _), n in self.sync_at.items() if outside is None or not (w or "").startswith(outside))

    def report(self) -> str:
        return "\n".join(f"{n:4d}  {w}  {what}" for (w, what), n in self.sync_at.most_common())

    def as_dict(self, top: int = 10) -> dict:
        return {"launches": self.launches, "syncs": self.syncs, "dispatcher_calls": self.calls,
                "host_ms_est": round(self.calls * US_PER_CALL / 1e3, 2), "custom_op_calls": self.custom,
                "gemm_gflop": {k: round(v / 1e9, 4) for k, v in sorted(self.gemm_flops.items())},
                "top_ops": dict(self.ops.most_common(top)),
                "sync_sources": {f"{w} ({what})": n for (w, what), n in self.sync_at.most_common(top)},
                "launch_sources": dict(self.launch_at.most_common(top))}


class _Dispatch(TorchDispatchMode):
    def __init__(self, c: Counter):
        super().__init__()
        self.c = c

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c, name = self.c, func._schema.name.split("::")[-1]
        if func.namespace not in ("aten", "prim", "prims"):
            from torch._library.custom_ops import _maybe_get_opdef

            opdef = _maybe_get_opdef(func)
            if opdef is not None:  # run the eager body under this mode: its ATen ops count
                c.custom += 1
                c.calls += 1
                with self:
                    return opdef._init_fn(*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # below autograd (custom op bodies) composites reach the mode whole: count their parts
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        c.calls += 1
        if name in SYNC_OPS and not c._reading:
            c.sync(name)
        elif name in BOOL_INDEXED and not c._reading and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            c.sync(f"{name} by a bool mask")  # runs nonzero inside the kernel, where no mode sees it
        if not func.is_view and name not in ALLOC_OR_META:
            c.launches += 1
            c.ops[name] += 1
            c.launch_at[_site(False)] += 1
        if name in ("_to_copy", "copy_"):
            c.copied.append(args[-1 if name == "copy_" else 0].numel())
        if name in GEMMS:
            a, b = (args[i] for i in GEMMS[name])
            c.gemm_flops[str(a.dtype).replace("torch.", "")] += 2 * a.numel() * b.shape[-1]
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, c: Counter):
        super().__init__()
        self.c = c

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func in (torch.tensor, torch.as_tensor) and args and not isinstance(args[0], torch.Tensor):
            self.c.sync(f"torch.{name} of Python data")
        elif name not in READS:
            return func(*args, **kwargs)
        elif not self.c._reading:
            self.c.sync(name.strip("_"))
        self.c._reading += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.c._reading -= 1


@contextlib.contextmanager
def counted():
    """``with counted() as c:``: the block's launches and syncs in ``c`` (a ``Counter``)."""
    from linear_rope.ops import workspace

    workspace.clear()  # the CPU's buffer pool: every buffer a fresh allocation, as on a GPU, whatever ran before
    c = Counter()
    with _Function(c), _Dispatch(c):
        yield c


def count(fn, *args, **kwargs) -> tuple[Counter, object]:
    """Run ``fn(*args, **kwargs)`` under the counter -> (its counts, its result)."""
    with counted() as c:
        out = fn(*args, **kwargs)
    return c, out
