"""linear_rope/ops/fused/pricing.py and ``benchmarks.gpu_predict --backend fused``: the fused
kernels' formulas give sane numbers for a small shape (bytes at least what each kernel must
touch, FLOPs at least the products it must make, padding and grid fill as stated); a kernel
without an entry is an error, never 0; the fused row lists the four kernels, priced by the
formulas and derated by fill; a fused compilation without them fails loudly. The compiling
tests skip where the predictor's extra (triton) or a C++ compiler is missing."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_predict as gp  # noqa: E402
from linear_rope.ops.fused import pricing  # noqa: E402

SMALL = pricing.Shape(B=2, H=3, N=256, d=16, m=40, e=32, C=64, BM=16, BE=32)


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _needs_predictor():
    pytest.importorskip("triton", reason="triton is not installed: Inductor's GPU code generation needs it (pip install -e '.[predict]')")
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler: the predictor builds its fake CUDA device guard with one")


def test_every_kernel_has_every_formula():
    for table in (pricing.OWN_KERNEL_BYTES, pricing.OWN_KERNEL_FLOPS, pricing.OWN_KERNEL_GRID):
        assert set(table) == set(pricing.KERNELS)


def test_formulas_are_sane_for_a_small_shape():
    s = SMALL
    assert (s.mp, s.nm, s.nc, s.ne) == (48, 3, 4, 1)  # 40 features padded to 3 blocks of 16
    p = {k: pricing.price(k, s) for k in pricing.KERNELS}
    qk, ve, rows = s.B * s.H * s.N * s.d * 2, s.B * s.H * s.N * s.e * 2, s.B * s.H * s.N * 4
    states = s.B * s.H * s.nc * s.m * s.e * 2
    assert sum(x["bytes"] for x in p.values()) >= 2 * qk + 2 * ve  # q, k, v, out at least
    assert p["fused_fwd_states"]["bytes"] >= qk + ve + states
    assert p["fused_fwd_output"]["bytes"] >= 2 * qk + 2 * ve + states + 2 * rows
    assert p["fused_bwd_dstates"]["bytes"] >= qk + 2 * ve + states
    assert p["fused_bwd_dqkv"]["bytes"] >= 5 * qk + 3 * ve + 2 * states  # q k v dout in, dq dk dv out, S dS
    assert all(x["reread_bytes"] >= 0 and x["flops"] > 0 for x in p.values())
    BH = s.B * s.H
    assert p["fused_fwd_states"]["flops"] >= BH * s.N * (2 * 2 * s.d * s.mp + 2 * s.mp * s.e)  # features hi/lo, rk^T v
    assert p["fused_bwd_dqkv"]["flops"] > p["fused_fwd_output"]["flops"] > p["fused_fwd_states"]["flops"]
    assert [p[k]["programs"] for k in pricing.KERNELS] == [BH * 3, 4 * BH, BH * 3, 4 * BH]
    # linear in the batch (B x N tokens): twice the rows, twice every byte and FLOP but the shared tables and w
    two = {k: pricing.price(k, pricing.Shape(**{**s.__dict__, "B": 4})) for k in pricing.KERNELS}
    for k in pricing.KERNELS:
        assert two[k]["flops"] == 2 * p[k]["flops"]
        assert p[k]["bytes"] < two[k]["bytes"] < 2 * p[k]["bytes"]


def test_the_paper_shape_as_docs_gpu_states():
    """m = 266 padded to 320 at BM = 64; about 98 GFLOP forward and 156 backward a layer at
    16 x 1024 tokens (docs/gpu.md's table)."""
    s = pricing.Shape(16, 12, 1024, 64, 266, 64)
    assert s.mp == 320 and s.nc == 16
    f = {k: pricing.price(k, s)["flops"] for k in pricing.KERNELS}
    assert f["fused_fwd_states"] + f["fused_fwd_output"] == pytest.approx(98.4e9, rel=0.01)
    assert f["fused_bwd_dstates"] + f["fused_bwd_dqkv"] == pytest.approx(156.4e9, rel=0.01)


def test_grid_fill():
    assert pricing.fill(132) == (1, 1.0) and pricing.fill(264) == (2, 1.0)
    assert pricing.fill(60) == (1, pytest.approx(60 / 132)) and pricing.fill(133) == (2, pytest.approx(133 / 264))
    k = {"kind": "own", "bytes": 10**9, "flops": 0}
    assert gp.price_us(dict(k, fill=0.5), "h100") - 2.0 == pytest.approx(2 * (gp.price_us(k, "h100") - 2.0))


def test_a_kernel_without_an_entry_is_an_error():
    with pytest.raises(KeyError, match="no pricing entry"):
        pricing.price("fused_fwd_nothing", SMALL)
    shapes = [[2, 3, 256, 16], [2, 3, 256, 16], [2, 3, 256, 32], [40, 16]]
    with pytest.raises(RuntimeError, match="fused_fwd_nothing"):
        gp._fused_kernel("torch.ops.linear_rope_priced.fused_fwd_nothing.default", shapes, {})
    k = gp._fused_kernel("torch.ops.linear_rope_priced.fused_fwd_states.default", shapes,
                         {"name": "x", "kind": "extern"})
    assert k["kind"] == "own" and k["name"] == "fused_fwd_states" and k["shape"] == [2, 3, 256, 16, 40, 32]


def test_merge_keeps_the_other_backends_rows():
    old = {"rows": [{"variant": "rope", "N": 64}, {"variant": "softmax", "N": 64}],
           "runs": [{"variant": "rope", "N": 64, "depth": 1}], "decode": {"x": 1}}
    new = {"rows": [{"variant": "rope", "N": 64, "backend": "fused"}],
           "runs": [{"variant": "rope", "N": 64, "depth": 1, "backend": "fused"}]}
    m = gp.merge(old, new)
    assert [(r["variant"], r["backend"]) for r in m["rows"]] == [("rope", "parallel"), ("softmax", "parallel"),
                                                                ("rope", "fused")]
    assert len(m["runs"]) == 2 and m["decode"] == {"x": 1}
    again = gp.merge(m, {"rows": [{"variant": "rope", "N": 64, "backend": "fused", "new": 1}], "runs": []})
    assert [r.get("new") for r in again["rows"]] == [None, None, 1]


def test_fused_row_lists_the_fused_kernels(tmp_path):
    _needs_predictor()
    out = tmp_path / "f.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_predict", "--quick", "--variants", "rope", "--n", "64",
                           "--backend", "fused", "--no-decode", "--out", str(out)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [(r["variant"], r["backend"]) for r in doc["rows"]] == [("rope", "fused")]
    for r in doc["runs"]:
        parts = {g["part"]: [k for k in g["kernels"] if k["kind"] == "own"] for g in r["graphs"]}
        assert [k["name"] for k in parts["forward"]] == ["fused_fwd_states", "fused_fwd_output"] * r["depth"]
        assert [k["name"] for k in parts["backward"]] == ["fused_bwd_dstates", "fused_bwd_dqkv"] * r["depth"]
        for k in parts["forward"] + parts["backward"]:
            assert k == {**k, **pricing.reprice(k["name"], k["shape"], **pricing.DESIGN)}
            assert 0 < k["fill"] <= 1 and k["us"]["h100"] == pytest.approx(gp.price_us(k, "h100"), abs=1e-3)
        # no chunk-parallel path left: none of its feature GEMMs (bmm with fp32 output)
        assert not any("bmm" in k["name"] for g in r["graphs"] for k in g["kernels"])


NONE = '''
import sys, contextlib
from benchmarks import gpu_predict as gp, gpu_fused
gpu_fused.attention_core_fused = contextlib.nullcontext  # the stand-ins never reach the model
try:
    gp._compile_train_as("fused", "rope", 64, 4, 1, True)
except RuntimeError as e:
    print(e)
    sys.exit(3)
'''


def test_a_fused_row_without_the_fused_kernels_fails_loudly():
    _needs_predictor()
    proc = subprocess.run([sys.executable, "-c", NONE], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "none of the fused kernels" in proc.stdout
