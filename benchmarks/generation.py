"""Decoding at batch 8: the in-place `Decoder` vs the functional `PerformerLM.step`, ms per step.

    python -m benchmarks.generation [--quick]

Also what one step asks of a device (launches, syncs), at a short and a long context. How it
measures: docs/performance.md, "Methods" (``benchmarks.generation``).
"""
from __future__ import annotations

import time

import torch

from linear_rope.decode import Decoder
from linear_rope.model import PerformerLM

from .counting import count
from .common import cli, interleaved, load_average, median, report, setup, target

NAME = "generation"
TARGET_FLAT = 1.2
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
        "times_s": times, "prefill_s": prefill_s, "counts_per_step": counts, "counts_per_layer": per_layer, "load": load,
        "ratio_decoder_longest_over_shortest": ms[f"decoder@{hi}"] / ms[f"decoder@{lo}"],
        "speedup_decoder_over_step": {c: ms[f"step@{c}"] / ms[f"decoder@{c}"] for c in cfg["contexts"]},
    }


@torch.no_grad()
def main(quick: bool = False, out_dir=None) -> dict:
    setup(quick)
    dsec = decode_section(quick)
    cfg = dsec["config"]
    lo, hi = min(cfg["contexts"]), max(cfg["contexts"])
    rows = []
    for c in cfg["contexts"]:
        for kind in ("step", "decoder"):
            k, cnt = f"{kind}@{c}", dsec["counts_per_layer"][f"{kind}@{c}"]
            rows.append([k, dsec["ms_per_step"][k], cnt["launches"], cnt["syncs"]])
    worst = max(v["launches"] for k, v in dsec["counts_per_layer"].items() if k.startswith("decoder"))
    dsyncs = sum(v["syncs"] for k, v in dsec["counts_per_step"].items() if k.startswith("decoder"))
    result = {
        "name": NAME, "quick": quick, "config": cfg, "decoder": dsec,
        "table": {"headers": [f"batch {cfg['batch']}, call@context", "ms/step", "launches/layer",
                              "syncs (host reads included)/layer"], "rows": rows},
        "targets": [
            target(f"decoder@{hi} / decoder@{lo} ms per step", dsec["ratio_decoder_longest_over_shortest"], "<=",
                   TARGET_FLAT),
            target("Decoder.step launches per layer (eager, ragged rows)", worst, "<=", TARGET_LAUNCHES_PER_LAYER),
            target("Decoder.step syncs (host reads included) per step", dsyncs, "<=", 0),
        ],
        "notes": [f"preset {cfg['preset']}, batch {cfg['batch']}, {cfg['tokens']} steps per call and context; load "
                  f"(1/5/15 min) {dsec['load']['before']} before, {dsec['load']['after']} after."],
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__)
