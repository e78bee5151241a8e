"""Per-token generation latency: our recurrent ``step`` vs performer-pytorch re-running the sequence.

    python -m benchmarks.generation [--quick]

Both models have the paper preset's width (dim 768, 12 heads x 64, m = 266) at a reduced depth
(``FULL["model"]["depth"]``; the same for both): performer-pytorch re-reads the whole context
for every token, so its per-token cost is a full forward pass and only a few of its tokens fit
the time budget. Latency per token scales with depth for both, so the ratios hardly depend on it.

* ours: ``linear_rope.model.PerformerLM`` prefilled to the context in one parallel pass
  (``output_final_state=True``), then one ``step`` per token (greedy): O(1) in the context.
* performer: ``AutoregressiveWrapper(performer_pytorch.PerformerLM(..., causal=True))``; one
  token is one ``generate(start_tokens, 1)`` call at exactly that context.

All per-token calls (every context, both models) run in one interleaved loop: ours for
``tokens`` rounds, performer for ``performer_tokens`` rounds, after one warmup round. The table
gives medians. Targets: ours@largest / ours@smallest context <= 1.2 (flat in the context), and
performer / ours at the reference context (1024) >= 50.
"""
from __future__ import annotations

import time

import torch

from linear_rope.model import ModelConfig, PerformerLM

from .common import cli, interleaved, median, quiet, report, setup, target

NAME = "generation"
FULL = dict(
    model=dict(dim=768, depth=2, heads=12, dim_head=64, nb_features=266),
    contexts=(512, 1024, 2048, 8192), tokens=20,
    performer_contexts=(512, 1024), performer_tokens=3, ref_context=1024,
)
QUICK = dict(
    model=dict(dim=32, depth=1, heads=2, dim_head=16, nb_features=16),
    contexts=(16, 32, 64), tokens=3,
    performer_contexts=(32,), performer_tokens=2, ref_context=32,
)
TARGET_FLAT = 1.2
TARGET_VS_PERFORMER = 50.0


def make_performer(model: dict, max_seq_len: int):
    with quiet():
        from performer_pytorch import AutoregressiveWrapper
        from performer_pytorch import PerformerLM as TheirLM

        net = TheirLM(num_tokens=256, max_seq_len=max_seq_len, dim=model["dim"], depth=model["depth"],
                      heads=model["heads"], dim_head=model["dim_head"], nb_features=model["nb_features"], causal=True)
    return AutoregressiveWrapper(net).eval()


@torch.no_grad()
def main(quick: bool = False, out_dir=None) -> dict:
    cfg = QUICK if quick else FULL
    setup(quick)
    ours = PerformerLM(ModelConfig(**cfg["model"])).eval()
    theirs = make_performer(cfg["model"], max(cfg["performer_contexts"]) + 8)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, max(cfg["contexts"])), generator=g)

    state, prefill_s = {}, {}
    for c in cfg["contexts"]:
        t0 = time.perf_counter()
        logits, states = ours(ids[:, :c], output_final_state=True)
        prefill_s[c] = time.perf_counter() - t0
        state[c] = {"tok": logits[:, -1].argmax(-1), "states": states, "pos": c}

    def ours_step(c):
        def call():
            s = state[c]
            logits, s["states"] = ours.step(s["tok"], s["states"], s["pos"])
            s["tok"], s["pos"] = logits.argmax(-1), s["pos"] + 1
        return call

    def performer_token(c):
        return lambda: theirs.generate(ids[:, :c], 1)

    calls = {f"ours@{c}": ours_step(c) for c in cfg["contexts"]}
    calls.update({f"performer@{c}": performer_token(c) for c in cfg["performer_contexts"]})
    rounds = {k: cfg["tokens"] if k.startswith("ours") else cfg["performer_tokens"] for k in calls}
    times = interleaved(calls, warmup=1, rounds=rounds)
    ms = {k: 1e3 * median(t) for k, t in times.items()}

    lo, hi, ref = min(cfg["contexts"]), max(cfg["contexts"]), cfg["ref_context"]
    flat = ms[f"ours@{hi}"] / ms[f"ours@{lo}"]
    vs = ms[f"performer@{ref}"] / ms[f"ours@{ref}"]
    rows = []
    for c in sorted(set(cfg["contexts"]) | set(cfg["performer_contexts"])):
        o, p = ms.get(f"ours@{c}"), ms.get(f"performer@{c}")
        rows.append([c, o if o is not None else "not run", p if p is not None else "not run",
                     p / o if o and p else "-", prefill_s[c] if c in prefill_s else "-"])
    result = {
        "name": NAME,
        "quick": quick,
        "config": {**cfg["model"], "contexts": list(cfg["contexts"]), "tokens": cfg["tokens"],
                   "performer_contexts": list(cfg["performer_contexts"]), "performer_tokens": cfg["performer_tokens"]},
        "ms_per_token": ms,
        "times_s": times,
        "prefill_s": prefill_s,
        "ratio_ours_longest_over_shortest": flat,
        "ratio_performer_over_ours": vs,
        "table": {"headers": ["context", "ours ms/token", "performer ms/token", "performer/ours", "ours prefill s"], "rows": rows},
        "targets": [
            target(f"ours@{hi} / ours@{lo} per-token latency", flat, "<=", TARGET_FLAT),
            target(f"performer@{ref} / ours@{ref} per-token latency", vs, ">=", TARGET_VS_PERFORMER),
        ],
        "notes": [
            f"depth {cfg['model']['depth']} for both models; ours: {cfg['tokens']} tokens per context, performer: "
            f"{cfg['performer_tokens']} (each a full forward pass over the context).",
        ],
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__)
