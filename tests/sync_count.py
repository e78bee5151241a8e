"""Count kernel launches and host syncs of a piece of code, and say where each sync comes from.

* A ``TorchDispatchMode`` sees every ATen op: the non-view ones are launches; ``aten._local_scalar_dense``
  (``.item()``, ``bool()``, ...), ``aten.nonzero``, ``aten.masked_select`` and indexing with a
  boolean mask (their output size is data-dependent) are syncs.
* A ``TorchFunctionMode`` sees the Python reads of a tensor's value (``.item()``, ``.tolist()``,
  ``bool()``, ``int()``, ``float()``, ``__index__``) and ``torch.tensor`` / ``torch.as_tensor`` of
  Python data (a copy from the host): syncs too. An ATen sync inside one of these is the same
  sync, counted once.

Each sync is attributed to the innermost frame in the ``linear_rope`` package (``checks.py``, a
helper that runs its callers' checks, passes it on to its caller), as ``path:line`` relative to
the package; ``None`` where no package frame is on the stack (the test's own code, torch's).
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from torch._library.custom_ops import OPDEFS
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import linear_rope

PACKAGE = Path(linear_rope.__file__).resolve().parent
PASS_ON = {PACKAGE / "checks.py"}  # helpers whose syncs belong to their caller
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
            "aten::item", "aten::is_nonzero"}  # the last two: as seen inside a custom op's body
MASK_INDEX = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__"}


def where() -> str | None:
    """``path:line`` of the innermost package frame (``PASS_ON`` skipped), relative to the repo."""
    f = sys._getframe(1)
    while f is not None:
        path = Path(f.f_code.co_filename)
        if path.is_relative_to(PACKAGE) and path not in PASS_ON:
            return f"{path.relative_to(PACKAGE.parent)}:{f.f_lineno}"
        f = f.f_back
    return None


def _indices(args) -> list:
    return list(args[1]) if len(args) > 1 and isinstance(args[1], (list, tuple)) else []


class Counts:
    def __init__(self):
        self.launches = 0
        self.syncs: collections.Counter = collections.Counter()  # where -> count (+ what)
        self._in_read = 0

    def sync(self, what: str) -> None:
        self.syncs[(where(), what)] += 1

    def total(self, outside: str | None = None) -> int:
        """All syncs, or those whose frame is not under ``outside`` (e.g. ``"linear_rope/ops/"``)."""
        return sum(n for (w, _), n in self.syncs.items() if outside is None or not (w or "").startswith(outside))

    def report(self) -> str:
        return "\n".join(f"{n:4d}  {w}  {what}" for (w, what), n in self.syncs.most_common())


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counts, functions: TorchFunctionMode):
        super().__init__()
        self.counts, self.functions = counts, functions

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        opdef = OPDEFS.get(name) if name.startswith("linear_rope::") else None
        if opdef is not None:  # the package's custom ops: count what their Python body runs
            with self.functions, self:
                return opdef._init_fn(*args, **(kwargs or {}))
        if name in SYNC_OPS and not self.counts._in_read:
            self.counts.sync(name)
        elif name in MASK_INDEX and not self.counts._in_read and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in _indices(args)):
            self.counts.sync(f"{name} (a boolean mask: nonzero inside)")
        if not func.is_view:
            self.counts.launches += 1
        return func(*args, **(kwargs or {}))


class _Function(TorchFunctionMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        read = name in READS and args and isinstance(args[0], torch.Tensor)
        if func in (torch.tensor, torch.as_tensor) and args and not isinstance(args[0], torch.Tensor):
            read = True
        if not read:
            return func(*args, **kwargs)
        if not self.counts._in_read:
            self.counts.sync(name)
        self.counts._in_read += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.counts._in_read -= 1


class count:
    """``with count() as c: ...`` then ``c.launches``, ``c.total()``, ``c.report()``."""

    def __enter__(self) -> Counts:
        self.counts = Counts()
        functions = _Function(self.counts)
        self._modes = [functions, _Dispatch(self.counts, functions)]
        for m in self._modes:
            m.__enter__()
        return self.counts

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        return False
