"""``python -m benchmarks.gpu``: the CPU quick mode runs every part and names it; CUDA-only parts
say so; failures reach the exit code. No timing asserts. Outputs go to a temporary directory."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; it runs from the repo root
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu  # noqa: E402
from benchmarks.common import NEEDS_CUDA, bf16_peak_tflops  # noqa: E402
from benchmarks.gpu_speed import crossover  # noqa: E402

PARTS = ("compare", "correctness", "op_speed", "training", "generation")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(out: Path, *args: str, timeout: float = 170) -> tuple[subprocess.CompletedProcess, dict, str]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", *args, "--out", str(out / "gpu.json")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert (out / "gpu.json").is_file(), proc.stderr[-3000:]
    return proc, json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text()


@pytest.fixture(scope="module")
def cpu_quick(tmp_path_factory):
    results = ROOT / "benchmarks/results"
    before = {p: p.stat().st_mtime_ns for p in results.glob("gpu*")}
    out = tmp_path_factory.mktemp("gpu")
    res = _run(out, "--device", "cpu", "--quick")
    assert {p: p.stat().st_mtime_ns for p in results.glob("gpu*")} == before, "a quick run wrote into benchmarks/results"
    return res


def test_cpu_quick_runs_every_part(cpu_quick):
    proc, data, md = cpu_quick
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["finished"] and data["exit_code"] == 0 and data["quick"]
    assert set(data["parts"]) == set(PARTS)
    for name, part in data["parts"].items():
        if name == "compare":  # the training table runs when named (the 10-minute run names it first)
            assert part["status"] == "not run (--parts)"
            continue
        assert part["status"] == "ok", (name, part.get("error"))
        assert f"### {part['title']}" in md
    assert "### 5. CPU mode" in md
    assert proc.stdout.strip().splitlines()[-1] == f"wrote {Path(data['command'].split('--out ')[1])}"


def test_cpu_quick_correctness_all_pass(cpu_quick):
    _, data, md = cpu_quick
    corr = data["parts"]["correctness"]
    assert corr["failed"] == []
    checks = corr["checks"]
    assert {c["dtype"] for c in checks} >= {"float64", "float32", "bfloat16", "float16"}
    for c in checks:
        assert c["passed"] is True or c.get("error", "").startswith(NEEDS_CUDA), c
    names = " ".join(c["check"] for c in checks)
    for word in ("mask", "cu_seqlens", "initial_state", "chaining", "key_mask", "context", "causality", "step",
                 "training steps finite"):
        assert word in names, word
    causal = [c for c in checks if c["check"].startswith("strict causality")]
    assert causal and all(c["max_abs_before_t0"] == 0.0 and c["max_abs_from_t0"] > 0 for c in causal)
    assert "47 checks passed, 0 failed" in md or f"{corr['passed']} checks passed, 0 failed" in md


def test_cpu_quick_says_what_needs_cuda(cpu_quick):
    _, data, md = cpu_quick
    speed = data["parts"]["op_speed"]
    assert speed["impls"]["fla_chunk"].startswith(NEEDS_CUDA)
    assert speed["impls"]["fla_fused_chunk"].startswith(NEEDS_CUDA)
    assert f"flash: {NEEDS_CUDA}" in speed["impls"]["sdpa"]
    assert speed["memory"].startswith(NEEDS_CUDA)
    assert all(v.startswith(NEEDS_CUDA) for v in speed["crossover"].values())
    ok = [r for r in speed["rows"] if r["status"] == "ok"]
    triton = importlib.util.find_spec("triton") is not None
    assert {r["impl"] for r in ok} == {"ours_torch", "sdpa", "performer"} | ({"ours_triton"} if triton else set())
    assert all(r["ms"] > 0 and r["peak_mib"] == NEEDS_CUDA for r in ok)
    paths = {r["impl"]: r["path"] for r in speed["rows"]}  # every row names the implementation that ran
    assert paths["ours_torch"] == "torch path" and paths["ours_triton"] == "triton kernels"
    assert paths["ours_fla"] == "fla path" and speed["impls"]["ours_fla"].startswith(NEEDS_CUDA)
    assert {paths["sdpa"], paths["fla_chunk"], paths["performer"]} == {"flash SDPA", "fla", "performer-pytorch"}
    if triton:
        assert speed["impls"]["ours_triton"].startswith("triton kernels (interpreter")
        assert "| ours_torch ms | ours_triton ms |" in md.replace("  ", " ")
    train = data["parts"]["training"]
    assert train["compiled"].startswith(NEEDS_CUDA) and train["eager"]["mfu"].startswith(NEEDS_CUDA)
    assert train["eager"]["path"].startswith("torch path") and train["eager_triton"].startswith(NEEDS_CUDA)
    assert train["eager"]["tokens_per_s"] > 0 and len(train["loss_curve"]) >= 2
    gen = data["parts"]["generation"]
    assert [r["status"] for r in gen["rows"]] == ["ok", "ok"]
    assert NEEDS_CUDA in md


def test_cpu_quick_training_table_starts_with_softmax(tmp_path):
    """The 10-minute run's first part: softmax first, then rope and none at the first N, each row
    naming its attention path and its compile time; the rope and none rows compared with softmax."""
    proc, data, md = _run(tmp_path, "--device", "cpu", "--quick", "--parts", "compare")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    part = data["parts"]["compare"]
    rows = part["rows"]
    n0 = rows[0]["N"]
    assert [(r["position"], r["N"]) for r in rows[:4]] == [("softmax", n0), ("rope", n0), ("none", n0), ("rope_pre", n0)]
    assert [r["position"] for r in rows[4:]] == ["softmax", "rope", "none"] and rows[4]["N"] == 4 * n0
    for r in rows[:3]:
        assert r["status"] == "ok", r
        assert r["tokens_per_s"] > 0 and r["compile_s"] > 0 and r["path"] and r["compile"].startswith("eager")
        assert r["batch"] * r["N"] == part["tokens_per_step"]
    assert rows[0]["path"].startswith("F.scaled_dot_product_attention")
    assert rows[1]["path"].startswith("torch path")  # on the CPU: the default path's own words
    assert set(part["vs_softmax"]) >= {f"rope N={n0}", f"none N={n0}"}
    assert "### 0. Training: softmax against linear attention" in md
    assert re.search(r"^\| softmax +\| " + str(n0) + " ", md, re.M)


def test_window_runs_the_training_table_first():
    """benchmarks/gpu_plan.sh window: training table, decoding, op speed, correctness, triage."""
    plan = (ROOT / "benchmarks/gpu_plan.sh").read_text()
    body = plan[plan.index("  window)"):plan.index("  check)")]
    order = [body.index(s) for s in ("part compare", "part generation", "part op_speed", "part correctness",
                                     "benchmarks.gpu_triage")]
    assert order == sorted(order)


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()  # main() sets 1 thread in quick mode
    yield
    torch.set_num_threads(n)


def test_failures_reach_the_exit_code(tmp_path, monkeypatch, keep_threads):
    """A failed check exits 1; a part that raises is recorded with its message and exits 2."""
    failing = dict(gpu.PARTS)
    failing["correctness"] = ("1. Correctness on the device",
                              lambda ctx, res: res.update(checks=[], passed=0, failed=["planted / float64"]), 0.1)
    monkeypatch.setattr(gpu, "PARTS", failing)
    assert gpu.main(["--device", "cpu", "--quick", "--check", "--out", str(tmp_path / "a.json")]) == 1

    def boom(ctx, res):
        raise RuntimeError("planted failure\nsecond line")
    failing["generation"] = ("4. Generation", boom, 0.1)
    failing["correctness"] = ("1. Correctness on the device", lambda ctx, res: res.update(checks=[], failed=[]), 0.1)
    code = gpu.main(["--device", "cpu", "--quick", "--parts", "correctness,generation", "--out", str(tmp_path / "b.json")])
    data = json.loads((tmp_path / "b.json").read_text())
    assert code == 2 and data["exit_code"] == 2
    part = data["parts"]["generation"]
    assert (part["status"], part["error"]) == ("error", "RuntimeError: planted failure")
    assert data["parts"]["training"]["status"] == "not run (--parts)"
    assert "RuntimeError: planted failure" in (tmp_path / "b.md").read_text()


def test_bf16_peaks_by_device_name():
    assert bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bf16_peak_tflops("NVIDIA H200") == 989.0
    assert bf16_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert bf16_peak_tflops("NVIDIA GeForce RTX 4090") is None


def test_crossover():
    ns = [1024, 2048, 4096, 8192]
    ours = {n: 1.0 * n for n in ns}
    flash = {1024: 512.0, 2048: 2048.0 * 0.8, 4096: 4096 * 2.0, 8192: 8192 * 4.0}
    c = crossover(ns, ours, flash)
    assert c["n"] == 4096 and 2048 < c["estimate"] < 4096
    assert crossover(ns, ours, {n: 0.5 * n for n in ns})["n"] is None
    assert crossover(ns, ours, {n: 2.0 * n for n in ns}) == {"n": 1024, "estimate": None,
                                                              "note": "ours faster already at the smallest N (1024)"}
    assert crossover(ns, ours, {1024: "skipped"})["note"] == "not measured"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_quick(tmp_path):
    proc, data, md = _run(tmp_path, "--device", "cuda", "--quick", "--compile", "off", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["parts"]["correctness"]["failed"] == []
    assert all(c["passed"] for c in data["parts"]["correctness"]["checks"])
    speed = data["parts"]["op_speed"]
    assert "flash" in speed["impls"]["sdpa"] and speed["memory"] is None
    for r in speed["rows"]:
        if r["impl"] in ("ours_torch", "ours_triton", "sdpa"):
            assert r["status"] == "ok" and r["peak_mib"] >= 0, r
        if r["impl"].startswith("fla"):
            assert r["status"] == "ok" or r["status"].startswith("skipped: fla not installed"), r
    assert data["parts"]["training"]["eager"]["peak_memory_mib"] > 0
    assert all(r["status"] == "ok" for r in data["parts"]["generation"]["rows"])
