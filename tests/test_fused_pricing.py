"""linear_rope/ops/fused/pricing.py and ``benchmarks.gpu_predict --backend fused``: the fused
kernels' formulas give sane numbers for a small shape (bytes at least what each kernel must
touch, FLOPs at least the products it must make, padding and grid fill as stated); a kernel
without an entry is an error, never 0; the fused row lists the six launches (the real kernels), priced by the
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

SMALL = pricing.Shape(B=2, H=3, N=256, d=16, m=40, e=32)  # BM = 32: 2 feature blocks (64), BD = 16, BE = 32


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
    assert pricing.KERNELS == ("_states", "_output", "_dden", "_dstates", "_dqkv[dq]", "_dqkv[dk]", "_dqkv[dv]")
    assert {n.split("[")[0] for n in pricing.KERNELS} == set(gp.FUSED_KERNELS)


def test_formulas_are_sane_for_a_small_shape():
    s = SMALL
    assert (s.mp, s.Mb, s.nc, s.ne, s.BD, s.BE) == (64, 2, 4, 1, 16, 32)  # 40 features padded to 2 blocks of 32
    p = {k: pricing.price(k, s) for k in pricing.KERNELS}
    BH = s.B * s.H
    qk, ve, rows = BH * s.N * s.d * 2, BH * s.N * s.e * 2, BH * s.N * 4
    states = BH * s.nc * s.m * (s.e * 2 + 4)  # the per-chunk states: S bf16, z float32
    assert p["_states"]["bytes"] >= qk + ve + states
    assert p["_output"]["bytes"] >= 2 * qk + 2 * ve + states + 2 * rows
    assert p["_dden"]["bytes"] == 2 * ve + 2 * rows and p["_dden"]["reread_bytes"] == 0
    assert p["_dstates"]["bytes"] >= qk + ve + 3 * rows + states
    assert p["_dqkv[dq]"]["bytes"] >= 3 * qk + 2 * ve + 3 * rows + states  # q k v dout den rmax dden Sb zb | dq
    assert p["_dqkv[dk]"]["bytes"] == p["_dqkv[dq]"]["bytes"]  # the same reads (dSa, dza for Sb, zb), dk for dq
    assert p["_dqkv[dv]"]["bytes"] < p["_dqkv[dq]"]["bytes"]  # no v, dden, dza or wa again
    assert all(x["reread_bytes"] >= 0 for x in p.values())
    assert p["_dden"]["flops"] == 0 and all(p[k]["flops"] > 0 for k in pricing.KERNELS if k != "_dden")
    # k's features (hi/lo: K doubled), every chunk in full, per feature block; Rk^T v
    assert p["_states"]["flops"] == BH * s.nc * s.C * (2 * 2 * s.BD * s.mp + 2 * s.mp * s.BE)
    assert p["_dqkv[dk]"]["flops"] == p["_dqkv[dq]"]["flops"] > p["_dqkv[dv]"]["flops"] > p["_states"]["flops"]
    assert p["_output"]["flops"] > 3 * p["_states"]["flops"] - 2 * BH * s.nc * s.C * 2 * s.mp * s.BE
    assert [p[k]["programs"] for k in pricing.KERNELS] == [BH * 2, 4 * BH, 4 * BH, BH * 2, 4 * BH, 4 * BH, 4 * BH]
    # linear in the batch (B x N tokens): twice the rows, twice every byte and FLOP but the shared tables and w
    two = {k: pricing.price(k, pricing.Shape(**{**s.__dict__, "B": 4})) for k in pricing.KERNELS}
    for k in pricing.KERNELS:
        assert two[k]["flops"] == 2 * p[k]["flops"]
        assert p[k]["bytes"] < two[k]["bytes"] <= 2 * p[k]["bytes"]


def test_the_paper_shape():
    """m = 266 padded to 288 at BM = 32: 83.0 GFLOP forward and 171.5 backward a layer at
    16 x 1024 tokens (docs/gpu.md's table)."""
    s = pricing.Shape(16, 12, 1024, 64, 266, 64)
    assert s.mp == 288 and s.nc == 16 and s.Mb == 9
    f = {k: pricing.price(k, s)["flops"] for k in pricing.KERNELS}
    assert f["_states"] + f["_output"] == pytest.approx(82.95e9, rel=0.001)
    back = f["_dden"] + f["_dstates"] + f["_dqkv[dq]"] + f["_dqkv[dk]"] + f["_dqkv[dv]"]
    assert back == pytest.approx(171.53e9, rel=0.001)


def test_grid_fill():
    assert pricing.fill(132) == (1, 1.0) and pricing.fill(264) == (2, 1.0)
    assert pricing.fill(60) == (1, pytest.approx(60 / 132)) and pricing.fill(133) == (2, pytest.approx(133 / 264))
    k = {"kind": "own", "bytes": 10**9, "flops": 0}
    assert gp.price_us(dict(k, fill=0.5), "h100") - 2.0 == pytest.approx(2 * (gp.price_us(k, "h100") - 2.0))


class _T:  # an Inductor IR buffer, as fused_kernel reads it
    def __init__(self, *size):
        self.size = size

    def get_size(self):
        return self.size

    def get_dtype(self):
        import torch
        return torch.bfloat16


def _ir(grid, **kw):
    t = (2, 3, 256)
    return type("IR", (), {"kwargs": {"q": _T(*t, 16), "v": _T(*t, 32), "wa": _T(40, 16), "LOWP": True,
                                      "ROTARY": True, **kw}, "grid": [grid]})()


def test_a_kernel_without_an_entry_is_an_error():
    from benchmarks.gpu_fused import fused_kernel
    with pytest.raises(KeyError, match="no pricing entry"):
        pricing.price("_nothing", SMALL)
    with pytest.raises(RuntimeError, match="'_nothing' has no pricing entry"):
        fused_kernel("_nothing", _ir((4, 6)), {}, 5.5e12)
    k = fused_kernel("_dqkv", _ir((4, 6), PART=0), {"name": "x", "kind": "extern", "bytes": 1}, 5.5e12)
    assert k["kind"] == "own" and k["name"] == "_dqkv[dq]" and k["shape"] == [2, 3, 256, 16, 40, 32]
    assert k == {**k, **pricing.price("_dqkv[dq]", SMALL)}
    with pytest.raises(RuntimeError, match="grid"):  # the launch's grid is the formula's, or an error
        fused_kernel("_dqkv", _ir((4, 3), PART=2), {"bytes": 1}, 5.5e12)
    with pytest.raises(RuntimeError, match="MASK"):  # a launch the formulas do not cover
        fused_kernel("_states", _ir((6, 2, 1), MASK=True), {"bytes": 1}, 5.5e12)


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
        assert [k["name"] for k in parts["forward"]] == ["_states", "_output"] * r["depth"]
        assert [k["name"] for k in parts["backward"]] == ["_dden", "_dstates", "_dqkv[dq]", "_dqkv[dk]", "_dqkv[dv]"] * r["depth"]
        for k in parts["forward"] + parts["backward"]:
            assert k == {**k, **pricing.reprice(k["name"], k["shape"], k["itemsize"], k["lowp"], k["rotary"])}
            assert 0 < k["fill"] <= 1 and k["us"]["h100"] == pytest.approx(gp.price_us(k, "h100"), abs=1e-3)
        # no chunk-parallel path left: none of its feature GEMMs (bmm with fp32 output)
        assert not any("bmm" in k["name"] for g in r["graphs"] for k in g["kernels"])


NONE = '''
import sys
from benchmarks import gpu_predict as gp, gpu_fused
from linear_rope.ops.backend import use_backend
gpu_fused.fused_core = lambda: use_backend("parallel")  # the fused kernels never reach the model
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
