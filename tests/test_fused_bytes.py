"""linear_rope/ops/fused/pricing.py's bytes against the count: each fused launch's loads and
stores counted in Triton's interpreter (``tests/fused_bytes.py``, in a process of its own: the
interpreter is switched on when a kernel is decorated) and the formula's unique + re-read bytes
within 10% of it, per launch, at the paper's head (d = e = 64, m = 266: 9 feature blocks of 32,
the last one part full) over 4 chunks, and at an odd shape (N not whole chunks, two value
blocks forward, one of 128 backward)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from linear_rope.ops.fused import pricing

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed: the fused kernels need it (interpreted here)")

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = {"paper_head": (1, 2, 256, 64, 266, 64), "odd": (2, 1, 130, 16, 34, 65)}  # B, H, N, d, m, e (bf16)


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_formula_bytes_match_the_interpreters_count(shape):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, os.path.join(HERE, "fused_bytes.py"), *map(str, SHAPES[shape])],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(counts) == set(pricing.KERNELS)
    s = pricing.Shape(*SHAPES[shape])
    for name, (loads, stores) in counts.items():
        unique, reread = pricing.OWN_KERNEL_BYTES[name](s)
        assert abs(unique + reread - (loads + stores)) <= 0.10 * (loads + stores), (name, unique, reread, loads, stores)
        assert 0 < unique <= loads + stores and reread >= 0, name
        assert stores <= unique, name  # every byte stored is a unique one
