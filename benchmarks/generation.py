"""Per-token generation latency: our recurrent ``step`` vs performer-pytorch re-running the
sequence, and the in-place ``Decoder`` vs the functional ``PerformerLM.step`` at batch 8.

    python -m benchmarks.generation [--quick]

How it measures: docs/performance.md, "Methods" (``benchmarks.generation``).
"""
from __future__ import annotations

import time

import torch

from linear_rope.decode import Decoder
from linear_rope.model import ModelConfig, PerformerLM

from .counting import count
from .common import cli, format_table, interleaved, load_average, median, quiet, report, setup, target

NAME = "generation"
FULL = dict(
    model=dict(dim=768, depth=2, heads=12, dim_head=64, nb_features=266), contexts=(512, 1024, 2048, 8192), tokens=20,
    performer_contexts=(512, 1024), performer_tokens=3, ref_context=1024,
)
QUICK = dict(
    model=dict(dim=32, depth=1, heads=2, dim_head=16, nb_features=16), contexts=(16, 32, 64), tokens=3,
    performer_contexts=(32,), performer_tokens=2, ref_context=32,
)
TARGET_FLAT = 1.2
TARGET_VS_PERFORMER = 50.0
DECODE = dict(preset="cpu", batch=8, contexts=(1024, 16384), tokens=30)
DECODE_QUICK = dict(preset="tiny", batch=8, contexts=(16, 64), tokens=3)
TARGET_LAUNCHES_PER_LAYER = 60

def count_dispatch(fn) -> dict:
    """Run ``fn()`` once under the one counter (``benchmarks.counting``): ``{"launches": n,
    "syncs": n, "by_op": {...}, "syncs_by_op": {...}}`` (syncs by site and kind)."""
    c, _ = count(fn)
    return {"launches": c.launches, "syncs": c.syncs, "by_op": dict(c.ops),
            "syncs_by_op": {f"{w} ({what})": n for (w, what), n in c.sync_at.items()}}


@torch.no_grad()
def compiled_step_kernels(preset: str = "cpu", batch: int = 8) -> dict:
    """Compile ``Decoder.step`` for this machine (Inductor: C++ on a CPU, Triton on a GPU) and
    count the kernels its generated ``call`` runs per step: GEMMs (``extern_kernels.*``) and
    fused kernels (``cpp_fused_*`` / ``triton_*``)."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = PerformerLM.from_preset(preset).eval()
    ids = torch.randint(0, 256, (batch, 16), generator=torch.Generator().manual_seed(0))
    dec = Decoder(model, batch, 32, compile=False)
    tok = dec.prefill(ids).argmax(-1)
    t0 = time.perf_counter()
    _, codes = run_and_get_code(torch.compile(dec._forward_step, fullgraph=True, dynamic=False), tok)
    seconds = time.perf_counter() - t0
    call = "\n".join(c.split("def call(", 1)[1].split("\n\n\n", 1)[0] for c in codes if "def call(" in c)
    gemms = len(re.findall(r"^\s+extern_kernels\.\w+\(", call, re.M))
    fused = len(re.findall(r"^\s+(?:cpp_fused\w*|triton_\w+\.run)\(", call, re.M))
    return {"preset": preset, "batch": batch, "depth": model.cfg.depth, "gemms": gemms, "fused": fused,
            "kernels": gemms + fused, "per_layer": (gemms + fused) / model.cfg.depth, "compile_s": seconds}


@torch.no_grad()
def decode_section(quick: bool) -> dict:
    """``Decoder.step`` vs ``PerformerLM.step`` at each context: ms per step and dispatch counts."""
    cfg = DECODE_QUICK if quick else DECODE
    torch.manual_seed(0)
    model = PerformerLM.from_preset(cfg["preset"]).eval()
    B, depth, n = cfg["batch"], model.cfg.depth, cfg["tokens"]
    g = torch.Generator().manual_seed(0)
    load = {"before": load_average()}
    calls, counts, prefill_s = {}, {}, {}
    for c in cfg["contexts"]:
        ids = torch.randint(0, 256, (B, c), generator=g)
        mask = torch.ones(B, c, dtype=torch.bool)
        mask[0, : c // 4] = False  # ragged: row 0 is a quarter shorter, so positions differ per row
        t0 = time.perf_counter()
        dec = Decoder(model, B, c + n + 4)
        logits = dec.prefill(ids, mask)
        prefill_s[c] = time.perf_counter() - t0
        states = [type(s)(s.S.clone(), s.z.clone()) for s in dec.states]
        st = {"tok": logits.argmax(-1), "states": states, "pos": mask.sum(1), "dec": dec, "dtok": logits.argmax(-1)}

        def functional(st=st):
            out, st["states"] = model.step(st["tok"], st["states"], st["pos"])
            st["tok"], st["pos"] = out.argmax(-1), st["pos"] + 1

        def decoder(st=st):
            st["dtok"] = st["dec"].step(st["dtok"]).argmax(-1)

        counts[f"step@{c}"] = count_dispatch(lambda st=st: model.step(st["tok"], st["states"], st["pos"]))
        counts[f"decoder@{c}"] = count_dispatch(lambda st=st: st["dec"].step(st["dtok"]))
        calls[f"step@{c}"], calls[f"decoder@{c}"] = functional, decoder
    times = interleaved(calls, warmup=1, rounds=n)
    load["after"] = load_average()
    ms = {k: 1e3 * median(t) for k, t in times.items()}
    per_layer = {k: {"launches": v["launches"] / depth, "syncs": v["syncs"] / depth} for k, v in counts.items()}
    lo, hi = min(cfg["contexts"]), max(cfg["contexts"])
    return {
        "config": {**cfg, "threads": torch.get_num_threads(), "ragged": "row 0 a quarter shorter"}, "ms_per_step": ms,
        "times_s": times, "prefill_s": prefill_s,
        "counts_per_step": counts,
        "counts_per_layer": per_layer, "load": load,
        "ratio_decoder_longest_over_shortest": ms[f"decoder@{hi}"] / ms[f"decoder@{lo}"],
        "speedup_decoder_over_step": {c: ms[f"step@{c}"] / ms[f"decoder@{c}"] for c in cfg["contexts"]},
    }


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

    dsec = decode_section(quick)
    if not quick:  # minutes of C++ compilation on a CPU
        try:
            dsec["compiled"] = compiled_step_kernels()
        except Exception as e:  # a machine without a compiler: say so, keep the rest
            dsec["compiled"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    lo, hi, ref = min(cfg["contexts"]), max(cfg["contexts"]), cfg["ref_context"]
    flat = ms[f"ours@{hi}"] / ms[f"ours@{lo}"]
    vs = ms[f"performer@{ref}"] / ms[f"ours@{ref}"]
    rows = []
    for c in sorted(set(cfg["contexts"]) | set(cfg["performer_contexts"])):
        o, p = ms.get(f"ours@{c}"), ms.get(f"performer@{c}")
        rows.append([c, o if o is not None else "not run", p if p is not None else "not run",
                     p / o if o and p else "-", prefill_s[c] if c in prefill_s else "-"])
    drows = []
    for c in DECODE_QUICK["contexts"] if quick else DECODE["contexts"]:
        for kind in ("step", "decoder"):
            k, cnt = f"{kind}@{c}", dsec["counts_per_layer"][f"{kind}@{c}"]
            drows.append([k, dsec["ms_per_step"][k], cnt["launches"], cnt["syncs"]])
    worst = max(dsec["counts_per_layer"][k]["launches"] for k in dsec["counts_per_layer"] if k.startswith("decoder"))
    dsyncs = sum(dsec["counts_per_step"][k]["syncs"] for k in dsec["counts_per_step"] if k.startswith("decoder"))
    result = {
        "name": NAME, "quick": quick,
        "config": {**cfg["model"], "contexts": list(cfg["contexts"]), "tokens": cfg["tokens"],
                   "performer_contexts": list(cfg["performer_contexts"]), "performer_tokens": cfg["performer_tokens"]},
        "ms_per_token": ms, "times_s": times, "prefill_s": prefill_s, "ratio_ours_longest_over_shortest": flat,
        "ratio_performer_over_ours": vs,
        "table": {"headers": ["context", "ours ms/token", "performer ms/token", "performer/ours", "ours prefill s"], "rows": rows},
        "decoder": dsec,
        "decoder_table": {"headers": ["batch 8, call@context", "ms/step", "launches/layer",
                                      "syncs (host reads included)/layer"], "rows": drows},
        "targets": [
            target(f"ours@{hi} / ours@{lo} per-token latency", flat, "<=", TARGET_FLAT),
            target(f"performer@{ref} / ours@{ref} per-token latency", vs, ">=", TARGET_VS_PERFORMER),
            target("Decoder.step launches per layer (eager, ragged rows)", worst, "<=", TARGET_LAUNCHES_PER_LAYER),
            target("Decoder.step syncs (host reads included) per step", dsyncs, "<=", 0),
        ],
        "notes": [
            f"decoder section: preset {dsec['config']['preset']}, batch {dsec['config']['batch']}, load (1/5/15 min) "
            f"{dsec['load']['before']} before, {dsec['load']['after']} after.",
            f"depth {cfg['model']['depth']} for both models; ours: {cfg['tokens']} tokens per context, performer: "
            f"{cfg['performer_tokens']} (each a full forward pass over the context).",
        ],
    }
    print(format_table(result["decoder_table"]["headers"], result["decoder_table"]["rows"]))
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__)
