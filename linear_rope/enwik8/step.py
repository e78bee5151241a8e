"""The pieces one training step is made of, apart from the loop: the run's model and generators
(:func:`build_run`), the precision (:func:`autocast`), the optimizer, the batch's way onto the
device, whether ``torch.compile`` can run and how it compiles the model, and the one BPC evaluation (:func:`evaluate`).
:class:`linear_rope.enwik8.trainer.Trainer` puts them together.
"""
from __future__ import annotations

import math
import os
import shutil

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..model import ModelConfig, PerformerLM
from ..ops.backend import record_paths
from . import data
from .config import TrainConfig
from .runtime import Dist

__all__ = ["attention_path", "build_run", "uses_bf16", "autocast", "evaluate", "make_optimizer", "on_device", "compile_unavailable",
           "compile_blocks", "FEATURE_SEED_OFFSET"]

FEATURE_SEED_OFFSET = 1_000_003  # feature generator seed = run seed + this


def build_run(mc: ModelConfig, seed: int):
    """Model, data generator and feature generator of one run at step 0 (on CPU).

    The same ``seed`` gives every variant (and every rank) the same initial weights, FAVOR+
    projections and data stream.
    """
    torch.manual_seed(seed)
    model = PerformerLM(mc)
    feature_gen = torch.Generator().manual_seed(seed + FEATURE_SEED_OFFSET)
    model.redraw_features(feature_gen)
    data_gen = torch.Generator().manual_seed(seed * 1000)
    return model, data_gen, feature_gen


def uses_bf16(device: torch.device, precision: str = "auto") -> bool:
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def autocast(device: torch.device, precision: str = "auto"):
    """bf16 autocast for ``precision`` bf16, or auto on CUDA: the projections and feed-forward
    run in bf16, the attention op keeps its feature map and running sums in fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_bf16(device, precision))


@torch.no_grad()
def evaluate(model, split, seq_len: int, batch_size: int, dd: Dist = Dist(),
             precision: str = "auto") -> float:
    """BPC over the whole split: summed nats / summed bytes / ln 2, both summed across ranks."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=dd.device)  # nats, predicted bytes
    for i, (x, y) in enumerate(data.eval_batches(split, seq_len, batch_size)):
        if i % dd.world != dd.rank:
            continue
        with autocast(dd.device, precision):
            logits = model(x.to(dd.device))
        sums[0] += F.cross_entropy(logits.float().flatten(0, 1), y.to(dd.device).flatten(),
                                   reduction="sum").double()
        sums[1] += y.numel()
    if dd.world > 1:
        dist.all_reduce(sums)
    model.train(was_training)
    nats, n_bytes = sums.tolist()
    assert n_bytes == data.count_eval_bytes(split), (n_bytes, data.count_eval_bytes(split))
    return nats / n_bytes / math.log(2)


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only, through the fused kernel (one
    pass per tensor, no per-parameter Python loop) where the device has one, else the for-each
    one. A resumed checkpoint keeps the kernel it was saved with (``load_state_dict`` restores
    the group's ``fused`` flag), so a resume stays bit-exact."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tc.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=tc.lr, fused=True)
    except RuntimeError:  # no fused AdamW for this device
        return torch.optim.AdamW(groups, lr=tc.lr, foreach=True)


def on_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous CPU batch on ``device``: through pinned memory on CUDA, so that the copy is
    asynchronous (``non_blocking`` from pageable memory is a synchronous copy); as is on the CPU."""
    if device.type != "cuda":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)


def compile_unavailable(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot run on ``device`` here, or None. Inductor writes C++ for the
    CPU, so it needs a compiler there (``$CXX``, g++, c++ or clang++ on the PATH)."""
    if device.type != "cpu":
        return None
    names = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    if any(shutil.which(n) for n in names if n):
        return None
    return "no C++ compiler on the PATH ($CXX, g++, c++, clang++), which torch.compile needs on the CPU"


def compile_blocks(model: PerformerLM, **kw) -> str:
    """Regional compilation, in place (``state_dict`` keys stay clean): each block's forward
    compiled with ``fullgraph=True`` (``kw``: ``mode``, ``backend``). The blocks are alike and
    their weights are the graph's inputs, so the first block's compile serves every layer: the
    start-up is one block's, not the unrolled model's (the ``tiny`` preset at depth 6 on 1 CPU
    thread: first step 18.6 s against 68.0 s whole). Embedding, final norm and head stay eager."""
    for block in model.blocks:
        block.compile(fullgraph=True, **kw)
    return f"regional: the {len(model.blocks)} blocks' forward compiled once (fullgraph=True), the rest eager"


def attention_path(model: PerformerLM, device: torch.device, precision: str, compile_mode: str | None) -> str:
    """The path the model's attention takes in training, from a two-token probe forward in the
    training precision: "parallel path (<why>)", "torch path (<why>)", or softmax attention;
    ``compile_mode`` (None: eager) is added, since a compiled graph holds the path the probe took."""
    if model.cfg.position == "softmax":
        return "softmax attention (torch scaled_dot_product_attention)"
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    was = model.training
    with record_paths() as paths, torch.no_grad(), autocast(device, precision):
        model.eval()(ids)
    model.train(was)
    path = "; ".join(dict.fromkeys(paths)) or "no linear attention call"
    return path + (f", compiled ({compile_mode})" if compile_mode is not None else "")
