"""benchmarks/cost_model.py: its arithmetic on hand-checked cells, and the committed JSON and
docs/gpu.md's quoted table are what the script gives today (estimates, no GPU involved)."""
import contextlib
import io
import json
from pathlib import Path

import pytest

from benchmarks import cost_model as cm

ROOT = Path(__file__).resolve().parents[1]


def _row(rows, path, N):
    return next(r for r in rows if r["path"] == path and r["N"] == N)


def test_hand_checked_cells():
    rows = cm.table()
    assert len(rows) == len(cm.SHAPES) * len(cm.PATHS)
    sdpa = _row(rows, "flash SDPA", 4096)  # 3.5 x 2 N^2 d over 96 heads, bound by FLOPs at 989 TFLOP/s
    assert sdpa["gflop"] == pytest.approx(96 * 7 * 4096**2 * 64 / 1e9)
    assert sdpa["ms"] == pytest.approx(sdpa["gflop"] * 1e9 / 989e12 * 1e3)
    # the numerator's chunked forward per head at N = 4096, C = 64: 0.452 GFLOP (docs/gpu.md)
    assert cm.chunked(4096, 266, 64, 64) == 2 * 4096 * 64 * 266 + 2 * 4096 * 64 * 64 + 4 * 4096 * 266 * 64
    for r in rows:  # each phase is max(FLOP time, byte time) at its own peak; the path sums them
        assert r["ms"] == pytest.approx(sum(max(p["flops"] / cm.PEAK[p["peak"]], p["bytes"] / cm.BW) * 1e3
                                            for p in r["phases"]))


def test_committed_json_and_doc_match_the_script(monkeypatch, tmp_path):
    monkeypatch.setattr(cm, "OUT", tmp_path / "benchmarks" / "results" / "cost_model.json")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cm.main()
    assert json.loads(cm.OUT.read_text()) == json.loads((ROOT / "benchmarks/results/cost_model.json").read_text())
    table = "\n".join(line for line in out.getvalue().splitlines() if not line.startswith("wrote "))
    assert table in (ROOT / "docs/gpu.md").read_text()
