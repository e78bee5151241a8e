"""``python -m benchmarks.gpu``, the GPU window: its rows in order at toy sizes on the CPU, each
row's JSON as it ends, skips with their reasons, decoding timed at the shapes it warmed up on,
the budgets within 570 s. No timing asserts. Outputs go to a temporary directory."""
import json
import os
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

FIRST = ["train_softmax_1k", "train_rope_1k", "train_softmax_4k", "train_rope_4k", "train_rope_parallel_1k",
         "decode_1k", "decode_16k", "op", "checks"]
ENV_OMP = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()  # main() sets 1 thread in quick mode
    yield
    torch.set_num_threads(n)


def test_plan_order_and_budgets():
    """The rows users compare first, in this order; the budgets and the set-up within 570 s."""
    plan = gpu.plan()
    assert [r["row"] for r in plan["rows"]][:len(FIRST)] == FIRST
    assert plan["total_s"] == plan["setup_s"] + sum(r["budget_s"] for r in plan["rows"]) <= plan["window_s"] == 570
    body = (ROOT / "benchmarks/gpu_plan.sh").read_text()
    assert "WINDOW_S:-570" in body and "benchmarks.gpu --until" in body


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("window")
    results = ROOT / "benchmarks/results"
    before = {p: p.stat().st_mtime_ns for p in results.glob("*")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=ROOT, env={**os.environ, **ENV_OMP}, capture_output=True, text=True,
                          timeout=400)
    assert {p: p.stat().st_mtime_ns for p in results.glob("*")} == before, "a quick run wrote into benchmarks/results"
    return proc, json.loads((out / "window.json").read_text()), out


def test_quick_runs_every_row_in_order_each_with_its_json(quick):
    proc, res, out = quick
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert res["finished"] and res["exit_code"] == 0 and res["quick"]
    assert [r["row"] for r in res["rows"]] == [r[0] for r in gpu.ROWS]
    for r in res["rows"]:
        assert json.loads((out / f"{r['row']}.json").read_text()) == r  # each row's own file
        assert r["status"] == "ok", r
    assert "## The GPU window" in (out / "window.md").read_text()


def test_quick_rows_name_what_ran(quick):
    _, res, _ = quick
    rows = {r["row"]: r for r in res["rows"]}
    for name in ("train_softmax_1k", "train_rope_1k", "train_softmax_4k", "train_rope_4k"):
        r = rows[name]
        assert r["tokens_per_s"] > 0 and r["compile_s"] > 0 and r["batch"] * r["N"] == gpu.QUICK["tokens"]
        assert r["mfu"].startswith(NEEDS_CUDA) and r["compile"].startswith("eager")
    assert rows["train_rope_4k"]["N"] == 4 * rows["train_rope_1k"]["N"]
    assert rows["train_rope_1k"]["path"].startswith("torch path (auto: tensors on cpu)")  # the op's own record
    assert not any("fused" in rows[n]["path"] for n in ("train_rope_1k", "train_rope_4k"))  # never on the CPU
    assert rows["train_softmax_1k"]["path"].startswith("F.scaled_dot_product_attention")
    op = rows["op"]
    ours = [c for c in op["cells"] if c["impl"] == "ours"]
    assert ours and all(c["status"] == "ok" and c["path"].startswith("torch path") for c in ours)
    assert all(c["status"].startswith(NEEDS_CUDA) for c in op["cells"] if c["impl"] == "fla")
    checks = rows["checks"]
    assert checks["failed"] == [] and checks["passed"] >= 40
    assert {c["dtype"] for c in checks["checks"]} >= {"float64", "float32", "bfloat16", "float16"}
    assert any(p.startswith("torch path") for p in checks["paths"])  # the default path, not a forced one


def test_decode_times_the_shapes_it_warmed_up_on(tmp_path):
    """The decode row warms up and times one Decoder: the same batch and max_len, and no graph
    compiled inside the timed steps (compiled here on the CPU, at toy sizes, so a recompile
    would be counted: the warm-up's compile is)."""
    torch.manual_seed(0)
    w = gpu.Window(torch.device("cpu"), True, 300.0, False, None)
    w.row_end = float("inf")
    rec: dict = {}
    gpu.decode_row(w, rec, context=1024, compile=True)
    assert rec["shapes"]["warmup"] == rec["shapes"]["timed"] == {"batch": 2, "max_len": 64 + 3 + 8, "token": [2]}
    assert rec["graphs_compiled_warmup"] >= 1 and rec["graphs_compiled_timed"] == 0
    assert rec["ms_per_step"] > 0 and rec["compiled"] is True


def test_skips_and_errors_are_recorded(tmp_path, monkeypatch, keep_threads):
    """A row whose budget no longer fits is skipped with the reason; a row that raises is
    recorded with its one-line message, the next row runs, and the exit code is 2."""
    def boom(w, rec, **kw):
        raise RuntimeError("planted failure\nsecond line")
    def not_here(w, rec, **kw):
        raise gpu.Skip("skipped: planted, not on this device")
    monkeypatch.setitem(gpu.RUNNERS, "checks", boom)
    monkeypatch.setitem(gpu.RUNNERS, "op", not_here)
    monkeypatch.setitem(gpu.RUNNERS, "train", lambda w, rec, **kw: rec.update(ran=True))
    code = gpu.main(["--device", "cpu", "--rows", "checks,op,train_rope_1k", "--out", str(tmp_path / "a")])
    res = json.loads((tmp_path / "a/window.json").read_text())
    assert code == 2 and res["exit_code"] == 2
    assert [r["row"] for r in res["rows"]] == ["train_rope_1k", "op", "checks"]  # ROWS' order
    assert [r["status"] for r in res["rows"]] == ["ok", "skipped: planted, not on this device",
                                                  "error: RuntimeError: planted failure"]
    assert json.loads((tmp_path / "a/train_rope_1k.json").read_text())["ran"] is True
    code = gpu.main(["--device", "cpu", "--rows", "train_softmax_1k,train_rope_1k", "--window-s", "58", "--out", str(tmp_path / "b")])
    rows = json.loads((tmp_path / "b/window.json").read_text())["rows"]
    assert code == 0 and rows[0]["status"] == "ok" and rows[0]["ran"]
    assert rows[1]["status"].startswith("skipped: ") and "the row's budget is 90 s" in rows[1]["status"]


def test_bf16_peaks_by_device_name():
    assert bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bf16_peak_tflops("NVIDIA H200") == 989.0
    assert bf16_peak_tflops("NVIDIA GeForce RTX 4090") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--quick", "--rows", "train_softmax_1k,decode_1k,op",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads((tmp_path / "window.json").read_text())["rows"]}
    assert rows["train_softmax_1k"]["peak_memory_mib"] > 0 and rows["train_softmax_1k"]["path"].startswith("flash SDPA")
    assert rows["decode_1k"]["graphs_compiled_timed"] == 0
    assert all(c["status"] == "ok" for c in rows["op"]["cells"] if c["impl"] != "fla")
