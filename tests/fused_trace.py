"""What ``torch.compile`` sees of the fused path, traced with fake tensors on a machine without
a GPU: Triton's active driver replaced by one that names an sm_90 target (Inductor's analysis of
a user kernel lowers it to TTIR for that target; nothing runs). Prints one JSON object: the call
targets of the forward graph AOTAutograd hands its compiler, and of the joint forward + backward
graph (``make_fx``). Run by ``tests/test_fused_kernel.py`` in a process of its own (the driver
replaced): ``python tests/fused_trace.py``.
"""
from __future__ import annotations

import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402
import triton  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from linear_rope.ops.fused.op import fused_causal  # noqa: E402
from linear_rope.ops.utils import Options, check_args  # noqa: E402


class _Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


class _Stop(Exception):
    pass


def _loss(q, k, v, w):
    opts = Options(causal=True, rotary=True, offset=0, base=10000.0, projection=w, mask=None, key_mask=None,
                   cu_seqlens=None, initial_state=None, allow_negative=False, output_final_state=True)
    a = check_args(q, k, v, opts, read_values=False)
    out, S, z = fused_causal(q, k, v, w, a, True, 0, 10000.0, True)
    return out.float().sum() + S.sum() + z.sum()


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"
            and ("triton" in str(n.target) or "linear_rope" in str(n.target))]


def main() -> dict:
    triton.runtime.driver.set_active(_Sm90())
    q, k, v = (torch.randn(1, 2, 70, x).bfloat16().requires_grad_() for x in (16, 16, 16))
    w = torch.randn(20, 16)
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return lambda *a: (_ for _ in ()).throw(_Stop())

    try:
        torch.compile(lambda q, k, v: _loss(q, k, v, w), fullgraph=True,
                      backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))(q, k, v)
    except _Stop:
        pass
    joint = make_fx(lambda q, k, v, w: torch.autograd.grad(_loss(q, k, v, w), (q, k, v)), tracing_mode="fake")(q, k, v, w)
    return dict(forward=_targets(graphs[0]), joint=_targets(joint))


if __name__ == "__main__":
    print(json.dumps(main()))
