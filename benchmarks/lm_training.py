"""LM training throughput, tokens/s: our PerformerLM vs performer-pytorch's, and our MFU.

    python -m benchmarks.lm_training [--quick]

How it measures: docs/performance.md, "Methods" (``benchmarks.lm_training``).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from linear_rope.model import ModelConfig, PerformerLM

from .attention import ours_flops
from .common import cli, fmt, gemm_n, gemm_probe, interleaved, machine_peak, median, quiet, report, setup, target

NAME = "lm_training"
FULL = dict(model=dict(dim=768, depth=2, heads=12, dim_head=64, nb_features=266), seq=1024, batch=1,
            max_rounds=5, budget_s=60.0)
QUICK = dict(model=dict(dim=32, depth=1, heads=2, dim_head=16, nb_features=16), seq=64, batch=2,
             max_rounds=2, budget_s=5.0)
LR = 3e-4
TARGET_SPEEDUP = 2.0
TARGET_MFU = 0.40


def make_performer(model: dict, seq: int):
    with quiet():
        from performer_pytorch import PerformerLM as TheirLM

        return TheirLM(num_tokens=256, max_seq_len=seq, dim=model["dim"], depth=model["depth"], heads=model["heads"],
                       dim_head=model["dim_head"], nb_features=model["nb_features"], causal=True)


def model_flops_per_token(lm: PerformerLM, seq: int) -> float:
    """6 x non-embedding parameters + attention (formula in the module docstring)."""
    c = lm.cfg
    dense = sum(p.numel() for name, p in lm.named_parameters() if not name.startswith(("tok_emb.", "pos_emb.")))
    attn = ours_flops(seq, d=c.dim_head, m=c.nb_features, heads=c.heads, backward=True) / seq
    return 6 * dense + c.depth * attn


def train_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)

    def call():
        opt.zero_grad(set_to_none=True)
        logits = model(x)  # (B, N, 256)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).backward()
        opt.step()
    return call


def main(quick: bool = False, out_dir=None) -> dict:
    cfg = QUICK if quick else FULL
    setup(quick)
    seq, batch = cfg["seq"], cfg["batch"]
    ours = PerformerLM(ModelConfig(**cfg["model"], seq_len=seq)).train()
    theirs = make_performer(cfg["model"], seq).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    gemm = gemm_probe(gemm_n(quick))
    calls = {"ours": train_step(ours, x, y), "performer": train_step(theirs, x, y), "gemm": gemm}
    times = interleaved(calls, warmup=1, rounds=cfg["max_rounds"], budget_s=cfg["budget_s"])
    times.pop("gemm")
    peak = median(gemm.rates[1:])  # [0] is the warmup call
    step_s = {k: median(t) for k, t in times.items()}
    tok_s = {k: batch * seq / s for k, s in step_s.items()}
    fpt = model_flops_per_token(ours, seq)
    mfu = {k: fpt * r / (peak * 1e9) for k, r in tok_s.items()}
    params = {"ours": ours.num_params(), "performer": sum(p.numel() for p in theirs.parameters())}
    speedup = tok_s["ours"] / tok_s["performer"]
    rows = [[k, params[k], step_s[k], tok_s[k], 100 * mfu[k]] for k in times]
    result = {
        "name": NAME, "quick": quick,
        "config": {**cfg["model"], "seq": seq, "batch": batch, "lr": LR, "rounds": len(times["ours"])},
        "step_s": step_s, "times_s": times, "tokens_per_s": tok_s, "params": params,
        "model_gflop_per_token": fpt / 1e9, "gemm_gflop_per_s_same_rounds": peak,
        "gemm_peak_gflop_per_s_at_start": machine_peak(quick), "mfu": mfu, "speedup_vs_performer": speedup,
        "table": {"headers": ["model", "params", "step s", "tokens/s", "MFU %"], "rows": rows},
        "targets": [
            target("ours / performer training tokens/s", speedup, ">=", TARGET_SPEEDUP),
            target("ours MFU (fraction of same-round fp32 GEMM rate)", mfu["ours"], ">=", TARGET_MFU),
        ],
        "notes": [
            f"depth {cfg['model']['depth']}, batch {batch} x {seq} tokens, {len(times['ours'])} timed steps each; "
            f"{fmt(fpt / 1e6)} MFLOP per token (model FLOPs), fp32 GEMM {fmt(peak)} GFLOP/s in the same rounds.",
        ],
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__)
