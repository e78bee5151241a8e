"""benchmarks/launches.py: its counting rules on small known examples, its depth extrapolation,
and a smoke run of ``--quick`` (no timing asserts; the output goes to a temporary directory)."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; it runs from the repo root
    sys.path.insert(0, str(ROOT))

from benchmarks import launches as L  # noqa: E402
from benchmarks.counting import count  # noqa: E402
from linear_rope.checks import require  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.library.custom_op("linear_rope_test::twice_plus_one", mutates_args=())
def twice_plus_one(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).add(1).view(-1)  # two launches and a view


@twice_plus_one.register_fake
def _(x):
    return x.new_empty(x.numel())


@torch.library.custom_op("linear_rope_test::batched_matmul", mutates_args=())
def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b  # a composite (matmul) below autograd: it reaches the mode whole


def _count(fn):
    return count(fn)[0]


def test_a_value_read_is_one_sync_and_no_launch():
    x, i = torch.arange(4.0), torch.ones((), dtype=torch.long)
    for read in (lambda: x.sum().item(), lambda: bool(x[1] > 0), lambda: int(x[2]), lambda: float(x[3]),
                 lambda: x.tolist(), lambda: [0, 1, 2][i]):
        c = _count(read)
        assert c.syncs == 1, c.as_dict()
    c = _count(lambda: x.item() if x.numel() == 1 else x[0].item())
    assert (c.syncs, c.launches) == (1, 0)  # item's _local_scalar_dense is not counted again, nor launched


def test_python_data_to_a_tensor_is_a_sync_a_tensor_is_not():
    assert _count(lambda: torch.tensor([1, 2])).syncs == 1
    assert _count(lambda: torch.as_tensor([1.0])).syncs == 1
    t = torch.ones(2)
    assert _count(lambda: torch.as_tensor(t)).syncs == 0


def test_views_and_allocations_are_not_launches_ops_are():
    x = torch.randn(4, 6)
    # (the ATen allocation itself: conftest's torch.empty fills what it allocates with NaN)
    c = _count(lambda: (x.view(24), x.t(), x[0], x.reshape(6, 4), x.detach(), torch.ops.aten.empty.memory_format([3])))
    assert c.launches == 0 and c.syncs == 0 and c.calls >= 6, dict(c.ops)
    c = _count(lambda: x + 1)
    assert (c.launches, c.syncs, dict(c.ops)) == (1, 0, {"add": 1})


def test_value_sized_outputs_are_a_launch_and_a_sync():
    x = torch.tensor([0.0, 1.0, 0.0, 2.0])
    c = _count(lambda: x.nonzero())
    assert (c.launches, c.syncs) == (1, 1)
    m = x > 0
    for by_mask in (lambda: x[m], lambda: x.clone().index_put_((m,), x.new_ones(()))):
        c = _count(by_mask)  # runs nonzero inside its kernel
        assert c.syncs == 1 and c.sync_at.most_common(1)[0][0][1].endswith("by a bool mask"), c.as_dict()
    assert _count(lambda: torch.equal(x, x)).syncs == 1


def test_a_custom_op_is_counted_inside():
    x = torch.ones(2, 3)
    c = _count(lambda: twice_plus_one(x))
    assert (c.launches, c.custom) == (2, 1)
    assert dict(c.ops) == {"mul": 1, "add": 1}


def test_composites_inside_a_custom_op_count_as_their_parts_and_gemm_flops_by_dtype():
    a, b = torch.randn(5, 2, 3), torch.randn(5, 3, 4)
    c = _count(lambda: batched_matmul(a, b))
    assert c.ops["bmm"] == 1 and "matmul" not in c.ops
    assert c.gemm_flops == {"float32": 2 * 5 * 2 * 3 * 4}
    c = _count(lambda: torch.mm(a[0].bfloat16(), b[0].bfloat16()))
    assert c.gemm_flops == {"bfloat16": 2 * 2 * 3 * 4}


def test_a_sync_is_attributed_to_its_line_in_linear_rope():
    """A sync in a shared check (checks.py) belongs to the package line that called the check."""
    from linear_rope.ops.utils import check_final_state

    c = _count(lambda: check_final_state(torch.ones(1, 2, 2), torch.ones(1, 2), torch.ones(1, 1, 1)))
    assert c.syncs == 1
    ((where, what),) = c.sync_at
    assert what == "bool" and where.startswith("linear_rope/ops/utils.py:"), c.report()
    c = _count(lambda: require(torch.tensor([True]), "never"))  # no package line calls it: no site
    assert c.syncs == 2 and {w for w, _ in c.sync_at} == {None}


def test_backward_ops_are_counted():
    x = torch.randn(3, requires_grad=True)
    y = (x * x).sum()
    c = _count(y.backward)
    assert c.launches >= 2 and c.syncs == 0


def test_extrapolation_is_linear_in_depth_or_fails():
    pts = {1: {"launches": 12, "syncs": 2}, 2: {"launches": 22, "syncs": 3}, 3: {"launches": 32, "syncs": 4}}
    e = L.extrapolate(pts, 12)
    assert e["per_layer"] == {"launches": 10, "syncs": 1} and e["fixed"] == {"launches": 2, "syncs": 1}
    assert e["depth_12"] == {"launches": 122, "syncs": 13}
    pts[3]["launches"] = 33
    with pytest.raises(AssertionError, match="not linear"):
        L.extrapolate(pts, 12)


def test_quick_run_writes_its_json(tmp_path, monkeypatch):
    monkeypatch.delenv("LINEAR_ROPE_BACKEND", raising=False)
    out = tmp_path / "launches.json"
    res = L.main(["--quick", "--backend", "torch", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["backend"] == "torch" and data["quick"] is True and data["preset"] == "tiny"
    assert data["b_independent"]["equal"] is True
    att = data["attention"]["64"]
    assert att["layer_fwd"]["launches"] > 0 and att["layer_fwd"]["custom_op_calls"] == 1
    assert att["layer_bwd"]["custom_op_calls"] == 1  # the backward's custom op, counted inside
    ms = data["model_step"]["64"]
    total = ms["total"]["depth_2"]["launches"]
    assert total == sum(ms[p]["depth_2"]["launches"] for p in ("forward", "loss", "backward", "clip"))
    steady = data["train_step"]["64"]["steady"]
    assert steady["depth_2"]["syncs"] >= 1 and steady["sync_sources"]
    assert all(k.startswith("linear_rope/") for k in steady["sync_sources"])
    assert not any(k.startswith("linear_rope/checks.py") for k in steady["sync_sources"])  # the shared check's caller
    assert set(data["decode"]) == set(L.DECODERS)
    assert data["decode"]["PerformerLM.step"]["eager"]["launches"] > 0
    assert data["dynamo"]["graphs"] >= 1
    assert res["ns"] == [64]


def test_a_bad_backend_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.delenv("LINEAR_ROPE_BACKEND", raising=False)
    with pytest.raises(SystemExit) as e:
        L.main(["--quick", "--backend", "nonsense"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("launches: error: --backend") and "\n" not in err
