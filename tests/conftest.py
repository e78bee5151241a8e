"""Fixtures shared by the training tests (helpers live in helpers.py), and uninitialised memory
filled with NaN for the whole test run (see ``poison_uninitialised``)."""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from fixtures.wikitext import wiki_text  # noqa: E402


def _poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a fresh, uninitialised tensor with what no correct code reads: NaN (floating point,
    complex), the largest value (integers: an index past every end); bools are left as they are.
    Not while torch.compile traces: an in-place fill of a fresh buffer there is a mutation that
    Inductor's functional graphs refuse (the compiled code allocates its own buffers)."""
    if torch.compiler.is_compiling():
        return t
    with torch.no_grad():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).max)
    return t


def _poisoning(alloc, factory: bool = False):
    """``alloc`` wrapped to poison what it returns. ``factory`` (torch.empty, empty_strided): the
    default device (``with torch.device("meta")``, as transformers builds a model) is passed on
    explicitly, since the device mode does not see a call made from inside this wrapper."""
    @functools.wraps(alloc)
    def wrapped(*args, **kwargs):
        if factory and kwargs.get("device") is None:
            kwargs["device"] = torch.get_default_device()
        return _poison(alloc(*args, **kwargs))

    wrapped.poisons = True
    return wrapped


def poison_uninitialised() -> None:
    """Every uninitialised allocation of this test process is filled with NaN: ``torch.empty``,
    ``empty_like``, ``empty_strided``, ``Tensor.new_empty`` / ``new_empty_strided`` (the package
    calls them through ``torch.`` and the tensor, never imported by name: each call sees the
    wrapper), and the CPU buffer pool of ``linear_rope.ops.workspace``, whose buffers come back
    holding an earlier call's values. A buffer that is read before it is written then shows up
    as NaN in an output or a gradient instead of passing with stale or zero memory. (Tests that
    start a subprocess, such as the CLI runs, are not covered.)"""
    if getattr(torch.empty, "poisons", False):
        return
    for name in ("empty", "empty_like", "empty_strided"):
        setattr(torch, name, _poisoning(getattr(torch, name), factory=name != "empty_like"))
    for name in ("new_empty", "new_empty_strided"):
        setattr(torch.Tensor, name, _poisoning(getattr(torch.Tensor, name)))
    from linear_rope.ops import workspace

    workspace.empty = _poisoning(workspace.empty)


poison_uninitialised()

# A run without --data-dir caches its splits in $LINEAR_ROPE_CACHE (else ~/.cache/linear_rope):
# the tests' own folder, for this process and every subprocess, never the user's cache.
os.environ["LINEAR_ROPE_CACHE"] = tempfile.mkdtemp(prefix="linear_rope_test_cache.")
atexit.register(shutil.rmtree, os.environ["LINEAR_ROPE_CACHE"], ignore_errors=True)

# In-process training runs keep the test process's threads (no idle-core probe at every start;
# runtime.choose_threads is tested on its own). Subprocesses get the same from helpers.ENV.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """64 KB of generated Wikipedia-like text (tests/fixtures/wikitext.py): the same bytes on
    every machine, no file from outside the checkout."""
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_bytes(wiki_text(1 << 16))
    return path


# CI runs the README's test command with the README's set-up (no extras), then installs the
# extras and runs again exactly the tests that skipped for a missing module: with
# LINEAR_ROPE_EXTRA_SKIPS=FILE, each such test's (or test file's) node id is appended to FILE.
_EXTRA_SKIPS = os.environ.get("LINEAR_ROPE_EXTRA_SKIPS")


def _missing_module(report) -> bool:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return any(s in reason for s in ("could not import", "No module named", "not installed"))


def _record_extra_skip(report) -> None:
    if _EXTRA_SKIPS and report.skipped and _missing_module(report):
        with open(_EXTRA_SKIPS, "a") as f:
            f.write(report.nodeid.split("::")[0] if report.when == "collect" else report.nodeid)
            f.write("\n")


def pytest_collectreport(report):  # a test file that skips whole (a module-level importorskip)
    _record_extra_skip(report)


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call"):
        _record_extra_skip(report)
