"""benchmarks/cost_model.py: its arithmetic on hand-checked cells, its host term's call counts
against what benchmarks.launches counts, and the committed JSON is what the script gives today
(estimates, no GPU involved)."""
import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; it runs from the repo root
    sys.path.insert(0, str(ROOT))

from benchmarks import cost_model as cm  # noqa: E402
from benchmarks import launches  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def unpoisoned(monkeypatch):
    """The allocators as users have them: conftest fills every fresh buffer with NaN, a launch
    that ``benchmarks.launches`` would count."""
    from linear_rope.ops import workspace

    for owner, names in ((torch, ("empty", "empty_like", "empty_strided")),
                         (torch.Tensor, ("new_empty", "new_empty_strided")), (workspace, ("empty",))):
        for name in names:
            f = getattr(owner, name)
            monkeypatch.setattr(owner, name, getattr(f, "__wrapped__", f))


def _row(rows, path, N):
    return next(r for r in rows if r["path"] == path and r["N"] == N)


def test_hand_checked_cells():
    rows = cm.table()
    assert len(rows) == len(cm.SHAPES) * len(cm.PATHS)
    assert cm.BW == 4.8e12  # the H200's HBM3e
    sdpa = _row(rows, "flash SDPA", 4096)  # 3.5 x 2 N^2 d over 96 heads, bound by FLOPs at 989 TFLOP/s
    assert sdpa["gflop"] == pytest.approx(96 * 7 * 4096**2 * 64 / 1e9)
    assert sdpa["device_ms"] == pytest.approx(sdpa["gflop"] * 1e9 / 989e12 * 1e3)
    # the numerator's chunked forward per head at N = 4096, C = 64: 0.452 GFLOP
    assert cm.chunked(4096, 266, 64, 64) == 2 * 4096 * 64 * 266 + 2 * 4096 * 64 * 64 + 4 * 4096 * 266 * 64
    for r in rows:  # each phase is max(FLOP time, byte time) at its own peak; the device sums them
        assert r["device_ms"] == pytest.approx(sum(max(p["flops"] / cm.PEAK[p["peak"]], p["bytes"] / cm.BW) * 1e3
                                                   for p in r["phases"]))
        assert r["host_ms"] == pytest.approx(r["host_calls"] * 9e-3)
        assert r["ms"] == max(r["device_ms"], r["host_ms"])
    # B*H = 384, N = 1024: the forward keeps only the intra-chunk products (A: 100 MB; the features,
    # 837 MB, and the states do not fit 512 MiB), so 156 + 344 calls per block of 256 tokens
    torch_row = _row(rows, "torch path (fp32)", 1024)
    assert torch_row["host_calls"] == 156 + 344 * 4 and torch_row["bound"] == "host"


def test_the_fla_feature_pass_is_priced_by_its_work():
    """Read q, k and write four bf16 feature tensors (and back): about 0.6 ms at B*H = 384,
    N = 1024 on the H200, not the 15 ms of fp32 [N, m] passes the eager code makes today (those
    are in its host term)."""
    feat = _row(cm.table(), "fla-backed", 1024)["phases"][0]
    per_head = 2 * (2 * 1024 * 64 * 2) + 2 * (4 * 1024 * 266 * 2) + 3 * 4 * 4 * 1024 * 64
    assert feat["bytes"] == 384 * per_head
    assert feat["ms"] == pytest.approx(384 * per_head / 4.8e12 * 1e3)
    assert 0.4 < feat["ms"] < 0.8


def _fit(counts):
    """{N: calls} at two lengths -> (fixed, per block of 256 tokens)."""
    (n1, c1), (n2, c2) = sorted(counts.items())
    per = (c2 - c1) // ((n2 - n1) // cm.BLOCK)
    return c1 - per * (n1 // cm.BLOCK), per


@pytest.mark.parametrize("kept", sorted(cm.TORCH_CALLS), ids=lambda k: "+".join(k) or "nothing")
def test_torch_path_calls_are_what_launches_counts(kept, unpoisoned):
    for N in (1024, 2048):  # warm: what a first call at a length builds and keeps (RoPE tables)
        launches.torch_path_calls(N, kept)
    counts = {N: launches.torch_path_calls(N, kept)["fwd_bwd_dispatcher_calls"] for N in (1024, 2048)}
    assert _fit(counts) == cm.TORCH_CALLS[kept]


def test_other_paths_calls_are_what_launches_counts(unpoisoned):
    launches.fla_path_calls(), launches.triton_path_calls(N=256)  # warm, as above
    assert launches.fla_path_calls()["fwd_bwd_dispatcher_calls"] == cm.FLA_CALLS
    assert launches.triton_path_calls(N=256)["fwd_bwd_dispatcher_calls"] == cm.TRITON_CALLS
    q, k, v = (torch.randn(1, 12, 256, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fwd, y = launches.count(torch.nn.functional.scaled_dot_product_attention, q, k, v, is_causal=True)
    bwd, _ = launches.count(y.backward, torch.ones_like(y))
    assert fwd.calls + bwd.calls == cm.SDPA_CALLS


def test_committed_json_matches_the_script(monkeypatch, tmp_path):
    monkeypatch.setattr(cm, "OUT", tmp_path / "benchmarks" / "results" / "cost_model.json")
    with contextlib.redirect_stdout(io.StringIO()):
        cm.main()
    assert json.loads(cm.OUT.read_text()) == json.loads((ROOT / "benchmarks/results/cost_model.json").read_text())
