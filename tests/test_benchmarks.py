"""Smoke tests for benchmarks/: every benchmark runs at tiny sizes and returns sane numbers.

No timing asserts (speed lives in the benchmarks themselves). Outputs go to a temporary
directory, never to benchmarks/results or BENCHMARKS.md.
"""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; it runs from the repo root
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks import run as bench_run  # noqa: E402
from benchmarks.attention import crossover, ours_flops  # noqa: E402
from linear_rope import FavorFeatures, rotary_linear_attention  # noqa: E402

NAMES = list(bench_run.BENCHMARKS)


def _snapshot():
    """mtime of every file run.py writes by default, so we can check none was touched."""
    paths = [ROOT / "BENCHMARKS.md", *common.RESULTS_DIR.rglob("*")]
    return {p: p.stat().st_mtime_ns for p in paths if p.is_file()}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    before = _snapshot()
    results = bench_run.main(["--quick", "--out-dir", str(out), "--md", str(out / "BENCHMARKS.md")])
    assert _snapshot() == before, "a quick run wrote into the repository"
    return out, results


def _numbers(x):
    """Every float/int leaf of a nested result (bools and strings excluded)."""
    if isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _numbers(v)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield x


def test_run_writes_json_and_markdown(quick):
    out, results = quick
    assert list(results) == NAMES
    for name in NAMES:
        data = json.loads((out / f"{name}.json").read_text())
        assert data["name"] == name and data["quick"] is True
    md = (out / "BENCHMARKS.md").read_text()
    assert "## Targets" in md and "python -m benchmarks.run --quick" in md
    assert all(f"## {name}:" in md for name in NAMES)
    assert ("PASS" in md) or ("MISS" in md)


@pytest.mark.parametrize("name", NAMES)
def test_result_shape(quick, name):
    r = quick[1][name]
    for key in ("name", "quick", "config", "table", "targets", "notes"):
        assert key in r, key
    headers, rows = r["table"]["headers"], r["table"]["rows"]
    assert rows and all(len(row) == len(headers) for row in rows)
    for t in r["targets"]:
        assert set(t) == {"name", "value", "op", "threshold", "pass"}
    assert all(math.isfinite(v) and v >= 0 for v in _numbers(r)), "negative or non-finite number"


def test_attention_numbers(quick):
    r = quick[1]["attention"]
    for impl in ("ours_inside", "ours_features_in", "sdpa"):
        assert len(r["ms"][impl]) == 3 and all(ms > 0 for ms in r["ms"][impl].values()), impl
    assert all(0 < e for e in r["efficiency"].values()) and all(g > 0 for g in r["gemm_gflop_per_s_same_rounds"].values())
    names = [t["name"] for t in r["targets"]]
    assert sum("efficiency" in n for n in names) == 4 and sum("crossover" in n for n in names) == 2
    assert sum(n.startswith("sdpa / ") for n in names) == 4


def test_crossover_interpolates_in_log_n():
    assert crossover({1024: 0.5, 2048: 2.0}) == (pytest.approx(1448.15, rel=1e-4), "between N=1024 and N=2048")
    assert crossover({1024: 1.2, 2048: 3.0})[0] == 1024
    assert crossover({1024: 0.5, 2048: 0.9}) == (None, "sdpa / ours < 1 up to N=2048")


def test_generation_numbers(quick):
    r = quick[1]["generation"]["decoder"]
    assert set(r["ms_per_step"]) == {f"{k}@{c}" for k in ("step", "decoder") for c in (16, 64)}
    assert all(ms > 0 for ms in r["ms_per_step"].values()) and r["ratio_decoder_longest_over_shortest"] > 0
    assert all(c["launches"] > 0 for c in r["counts_per_step"].values())


def test_training_numbers(quick):
    r = quick[1]["training"]
    if "presets" not in r:  # the base commit could not be checked out (e.g. a shallow clone)
        notes = r.get("notes") or []
        assert notes and notes[0].startswith("not run: no worktree"), r  # and nothing else went wrong
        pytest.skip(notes[0])
    for p in r["presets"].values():
        assert all(v > 0 for v in p["tokens_per_s"].values()) and p["speedup"] > 0
        assert all(v > 0 for v in p["cpu_s_per_step"].values()) and p["speedup_cpu_time"] > 0
        assert all(len(run["step_s"]) == 2 for runs in p["runs"].values() for run in runs)


def test_summary(quick):
    out, results = quick
    summary = json.loads((out / "summary.json").read_text())
    assert summary["machine"]["gemm_gflop_per_s"] > 0 and summary["machine"]["cpu"]
    assert {t["result"] for t in summary["targets"]} <= {"PASS", "MISS", "n/a"}
    assert len(summary["targets"]) == sum(len(r["targets"]) for r in results.values())


def test_no_allocator_tuning():
    """The timings use glibc's default allocator, as users get it."""
    for path in (ROOT / "benchmarks").glob("*.py"):
        text = path.read_text()
        assert "mallopt(" not in text and '"MALLOC_' not in text, path.name


def test_ours_attention_is_features_then_eq19():
    """The one-line switch to a fused op must not change the maths (float64, N odd)."""
    torch.manual_seed(0)
    feats = FavorFeatures(8, 16).double()
    q, k, v = (torch.randn(1, 2, 37, 8, dtype=torch.float64) for _ in range(3))
    for rotary in (True, False):
        want = rotary_linear_attention(feats(q, is_query=True), feats(k, is_query=False), v, causal=True, rotary=rotary)
        torch.testing.assert_close(common.ours_attention(q, k, v, feats, rotary), want, rtol=1e-10, atol=1e-12)


def test_flop_formula():
    # chunk = 64: one chunk at N = 64, so the count is exactly the per-chunk formula.
    per_head = 4 * 64 * 64 * 266 + (2 * 64 * 64 * 266 + 2 * 64 * 64 * 64 + 4 * 64 * 266 * 64) + 2 * 64 * 266
    assert ours_flops(64, chunk=64, backward=False) == per_head * 12
    assert ours_flops(4096, chunk=64) == pytest.approx(64 * ours_flops(64, chunk=64), rel=1e-12)


def test_training_op_regression_check(tmp_path):
    """``--op`` adds the op as one more interleaved measurement, with its own <= 1.05 target."""
    from benchmarks import training
    r = training.main(quick=True, out_dir=tmp_path, presets="tiny", op=True)
    if "presets" not in r:
        pytest.skip(r["notes"][0])
    assert list(r["presets"]) == ["tiny", "op:512"] and len(r["load_average_before_after"]) == 2
    p = r["presets"]["op:512"]
    assert p["time_ours_over_base"] > 0 and all(len(runs) == 1 for runs in p["runs"].values())
    assert [t["op"] for t in r["targets"]] == [">=", "<="] and r["targets"][1]["value"] == p["time_ours_over_base"]
    with pytest.raises(SystemExit):
        training.main(quick=True, out_dir=tmp_path, presets="tiny,nope")
