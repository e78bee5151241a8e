"""benchmarks/gpu_predict.py: Inductor's GPU kernels of the tiny model, generated on the CPU (in a
subprocess: the fake CUDA device it installs stays in its process), listed with positive bytes;
per layer = depth 2 - depth 1; MFU from model FLOPs, which recomputation cannot raise; the JSON's
fields; more bytes priced slower. The committed JSON is checked against its own kernels and the
rules without triton."""
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; it runs from the repo root
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_predict as gp  # noqa: E402

KINDS = {"triton", "gemm", "flash_fwd", "flash_bwd", "extern", "own"}


def _env():
    """The subprocesses' environment: this repository first, no Triton interpreter (conftest's)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _config(variant, depth=12, preset="tiny"):
    from linear_rope.model import MODEL_PRESETS, ModelConfig
    return ModelConfig(**{**MODEL_PRESETS[preset], "position": variant, "depth": depth})


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    pytest.importorskip("triton", reason="triton is not installed: Inductor's GPU code generation needs it (pip install -e '.[predict]')")
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler: the predictor builds its fake CUDA device guard with one")
    out = tmp_path_factory.mktemp("gpu_predict") / "p.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_predict", "--quick", "--variants", "rope,softmax", "--n", "64",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _run(doc, variant, depth, N=64, backend="parallel"):
    return next(r for r in doc["runs"] if r["variant"] == variant and r["depth"] == depth and r["N"] == N
                and r.get("backend", "parallel") == backend)


def test_kernels_are_listed_with_their_bytes(quick):
    doc, stdout = quick
    for r in doc["runs"]:
        parts = [g["part"] for g in r["graphs"]]
        assert parts == ["forward", "backward"]
        ks = [k for g in r["graphs"] for k in g["kernels"]]
        assert len(ks) == r["kernels"] > 20
        assert all(k["bytes"] > 0 and k["kind"] in KINDS for k in ks)
        assert r["bytes"] == sum(k["bytes"] for k in ks)
        assert {"triton", "gemm"} <= {k["kind"] for k in ks}
        for g in r["graphs"]:  # one scheduled Triton kernel per launch in the generated wrapper
            assert sum(k["kind"] == "triton" for k in g["kernels"]) == g["triton_launches_in_wrapper"]
    soft = [k for g in _run(doc, "softmax", 1)["graphs"] for k in g["kernels"]]
    assert {k["kind"] for k in soft} >= {"flash_fwd", "flash_bwd"}  # flash SDPA, not the math fallback
    assert all(k["flops"] > 0 for k in soft if k["kind"].startswith("flash"))
    rope = [k for g in _run(doc, "rope", 1)["graphs"] for k in g["kernels"]]
    assert any(k["kind"] == "gemm" and k["out_dtype"] == "torch.float32" and "bmm" in k["name"] for k in rope)
    dec = doc["decode"]
    assert dec["bytes_per_step"] > 0 and dec["graphs"][0]["part"] == "inference"
    assert "rope" in stdout and "decode" in stdout


def test_per_layer_is_depth_two_minus_depth_one(quick):
    doc, _ = quick
    for row in doc["rows"]:
        s1, s2 = _run(doc, row["variant"], 1), _run(doc, row["variant"], 2)
        assert row["layer_bytes"] == s2["bytes"] - s1["bytes"] > 0
        assert row["step_bytes"] == s1["bytes"] + 11 * row["layer_bytes"]
        for d in ("h100", "h200"):
            layer = (s2["us"][d] - s1["us"][d]) / 1e3
            assert row[d]["layer_ms"] == pytest.approx(layer)
            assert row[d]["step_ms"] == pytest.approx(s1["us"][d] / 1e3 + 11 * layer)
            assert row[d]["tokens_s"] == pytest.approx(row["B"] * row["N"] / (row[d]["step_ms"] / 1e3))


def test_mfu_counts_model_flops_and_recompute_does_not_raise_it(quick):
    doc, _ = quick
    for row in doc["rows"]:
        cfg = _config(row["variant"])
        assert row["model_flops_per_token"] == gp.model_flops(cfg, row["N"])
        for d in ("h100", "h200"):
            assert row[d]["mfu"] == pytest.approx(row["model_flops_per_token"] * row[d]["tokens_s"] / 989e12)
    s1, s2 = _run(doc, "rope", 1), _run(doc, "rope", 2)
    base = gp.make_row("rope", 64, 4, s1, s2, _config("rope"), ("h100",), 1)
    # a recompute: depth 2's backward runs the forward's kernels again (more FLOPs executed)
    again = copy.deepcopy(s2)
    fwd = [k for g in s2["graphs"] if g["part"] == "forward" for k in g["kernels"]]
    again["flops"] += sum(k["flops"] for k in fwd)
    again["us"] = {d: v + sum(k["us"][d] for k in fwd) for d, v in s2["us"].items()}
    more = gp.make_row("rope", 64, 4, s1, again, _config("rope"), ("h100",), 1)
    assert more["model_flops_per_token"] == base["model_flops_per_token"]
    assert more["h100"]["mfu"] < base["h100"]["mfu"]
    # the paper preset's rope: 6 x 85.1M weights in GEMMs + 3 x 144 heads x 179,496 = 588M a token
    assert gp.model_flops(_config("rope", preset="paper"), 1024) == pytest.approx(588.3e6, rel=1e-3)


def test_more_bytes_are_priced_slower(quick):
    doc, _ = quick
    k = {"kind": "triton", "bytes": 10**9, "flops": 0}
    assert gp.price_us(dict(k, bytes=2 * 10**9), "h100") > gp.price_us(k, "h100") > gp.price_us(k, "h200")
    assert gp.price_us(k, "h100") == pytest.approx(1e6 * 1e9 / (3.35e12 * 0.85) + gp.RULES["launch_us"])
    g = {"kind": "gemm", "bytes": 1000, "flops": 10**12, "fp32": False, "odd": False}
    assert gp.price_us(dict(g, odd=True), "h100") > gp.price_us(g, "h100")  # 45% against 70% of the peak
    rope, soft = (next(r for r in doc["rows"] if r["variant"] == v) for v in ("rope", "softmax"))
    assert rope["step_bytes"] > soft["step_bytes"] and rope["h100"]["step_ms"] > soft["h100"]["step_ms"]


def test_json_fields(quick):
    doc, _ = quick
    for key in ("note", "command", "torch", "triton", "git_commit", "rules", "devices", "rows", "runs", "decode"):
        assert key in doc
    assert doc["rules"] == gp.RULES and doc["command"].startswith("python -m benchmarks.gpu_predict --quick")
    for r in doc["runs"]:
        for g in r["graphs"]:
            for k in g["kernels"]:
                assert {"name", "kind", "bytes", "flops", "us"} <= set(k) and set(k["us"]) == {"h100", "h200"}
                assert k["us"]["h100"] == pytest.approx(gp.price_us(k, "h100"), abs=1e-3)


def test_committed_json_is_consistent():
    """benchmarks/results/gpu_predict.json (the paper preset): its rows follow from its kernels
    by today's rules (no triton needed to check it)."""
    doc = json.loads((ROOT / "benchmarks/results/gpu_predict.json").read_text())
    assert doc["preset"] == "paper" and doc["rules"] == gp.RULES
    assert {(r["variant"], r["N"], r["backend"]) for r in doc["rows"]} == \
        {(v, n, "parallel") for v in gp.VARIANTS for n in gp.LENGTHS} | {("rope", n, "fused") for n in (1024, 4096, 16384)}
    for row in doc["rows"]:
        s1, s2 = (_run(doc, row["variant"], depth, row["N"], row["backend"]) for depth in (1, 2))
        for s in (s1, s2):
            ks = [k for g in s["graphs"] for k in g["kernels"]]
            assert s["bytes"] == sum(k["bytes"] for k in ks) and s["kernels"] == len(ks)
            for d in doc["devices"]:
                assert s["us"][d] == pytest.approx(sum(k["us"][d] for k in ks))
                assert all(k["us"][d] == pytest.approx(gp.price_us(k, d), abs=1e-3) for k in ks)
        again = gp.make_row(row["variant"], row["N"], row["B"], s1, s2, _config(row["variant"], preset="paper"),
                            tuple(doc["devices"]), row["params"])
        for key in ("layer_bytes", "step_bytes", "model_flops_per_token", "peak_bytes_est"):
            assert again[key] == row[key]
        for d in doc["devices"]:
            assert again[d] == pytest.approx(row[d])
    assert doc["decode"]["bytes_per_step"] > 0


@pytest.mark.parametrize("args", [["--n", "100"], ["--variants", "rope,absolute"], ["--quick"]])
def test_bad_input_is_one_line(args, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_predict", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=_env())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("gpu_predict: error:")


OWN = '''
import json, torch, triton, triton.language as tl
from torch.library import triton_op, wrap_triton
from torch._subclasses.fake_tensor import FakeTensorMode
from benchmarks import gpu_predict as gp
from benchmarks.gpu_fake_cuda import compile_for_gpu, fake_cuda

@triton.jit
def double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

@triton_op("gpu_predict_test::double", mutates_args=())
def op(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    wrap_triton(double)[(triton.cdiv(x.numel(), 128),)](x, y, x.numel(), BLOCK=128)
    return y

gp.OWN_KERNEL_FLOPS["double"] = lambda shapes: 100000 * shapes[0][0]
fm = FakeTensorMode()
graphs = compile_for_gpu(lambda x: op(x + 1) * 3, [fake_cuda(fm, torch.zeros(1 << 20))], fm, gp._kernel)
print(json.dumps([k for g in graphs for k in g["nodes"] if k is not None]))
'''


def test_own_triton_kernel_is_priced_by_its_bytes_and_flops(tmp_path):
    """A triton_op of the package's own: Inductor calls it as a user kernel, listed as `own`
    with its arguments' bytes and the FLOPs OWN_KERNEL_FLOPS states, on the tensor cores."""
    pytest.importorskip("triton", reason="triton is not installed: Inductor's GPU code generation needs it (pip install -e '.[predict]')")
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler: the predictor builds its fake CUDA device guard with one")
    script = tmp_path / "own_kernel.py"  # a file: triton.jit reads the kernel's source
    script.write_text(OWN)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    ks = json.loads(proc.stdout.strip().splitlines()[-1])
    own = [k for k in ks if k["kind"] == "own"]
    assert [k["name"] for k in own] == ["double"] and own[0]["flops"] == 100000 << 20
    assert own[0]["bytes"] >= 2 * 4 << 20  # reads x, writes y (fp32)
    rate = gp.RULES["bf16_dense_flops"] * gp.RULES["gemm_odd_efficiency"]
    assert gp.price_us(own[0], "h100") == pytest.approx(1e6 * own[0]["flops"] / rate + gp.RULES["launch_us"])


def test_own_triton_kernel_without_an_entry_is_an_error(tmp_path):
    """A user kernel that OWN_KERNEL_FLOPS does not name fails the compilation with its name (never 0 FLOPs)."""
    pytest.importorskip("triton", reason="triton is not installed: Inductor's GPU code generation needs it (pip install -e '.[predict]')")
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler: the predictor builds its fake CUDA device guard with one")
    script = tmp_path / "own_kernel_unpriced.py"
    script.write_text(OWN.replace('gp.OWN_KERNEL_FLOPS["double"] = lambda shapes: 100000 * shapes[0][0]\n', ""))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=_env())
    assert proc.returncode != 0 and "own kernel 'double' has no entry in gpu_predict.OWN_KERNEL_FLOPS" in proc.stderr
