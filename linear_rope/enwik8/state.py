"""TrainState: everything a checkpoint holds, and nothing else. Its ``state_dict()`` *is* the
checkpoint and ``load_state_dict()`` restores it (model, optimizer, step, metrics, and the torch /
data / feature generator states of every rank), as in torchtitan; :mod:`.checkpoint` writes and
reads it, :class:`linear_rope.enwik8.trainer.Trainer` trains it.
"""
from __future__ import annotations

import torch

from ..model import PerformerLM
from .runtime import Dist, param_digest

__all__ = ["TrainState"]


class TrainState:
    """What a checkpoint holds. ``state_dict()`` is collective under DDP (it gathers every rank's
    RNG state and parameter digest, and fails if the ranks' weights differ)."""

    def __init__(self, model: PerformerLM, optimizer, data_gen, feature_gen, config: dict,
                 dd: Dist):
        self.model, self.optimizer, self.config, self.dd = model, optimizer, config, dd
        self.data_gen, self.feature_gen = data_gen, feature_gen
        self.step = 0
        self.metrics: dict = {"val_bpc": None, "val_step": None, "test_bpc": None}  # val_step: the step val_bpc is of

    def state_dict(self) -> dict:
        dd = self.dd
        digests = dd.gather(param_digest(self.model))  # identical weights are checked, not assumed
        if len(set(digests)) != 1:
            raise RuntimeError(f"ranks hold different weights at step {self.step}: {digests}")
        torch_states = dd.gather(torch.get_rng_state())  # each rank's dropout stream
        rng = {"torch": torch_states[0], "data": self.data_gen.get_state(),
               "features": self.feature_gen.get_state()}
        if dd.world > 1:
            rng["torch_ranks"] = torch_states
        if dd.device.type == "cuda":
            cuda_states = dd.gather(torch.cuda.get_rng_state())
            rng["cuda"] = cuda_states[0]
            if dd.world > 1:
                rng["cuda_ranks"] = cuda_states
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "step": self.step, "rng": rng, "config": self.config,
                "metrics": dict(self.metrics), "world": dd.world, "param_sha256": digests}

    def load_state_dict(self, sd: dict) -> None:
        """Restore a checkpoint of this version or of linear_rope 0.1 (per-rank data list)."""
        dd, rng = self.dd, sd["rng"]
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.step = sd["step"]
        self.metrics = {"val_bpc": None, "val_step": None, "test_bpc": None, **sd.get("metrics", {})}
        torch.set_rng_state(rng["torch_ranks"][dd.rank] if dd.world > 1 else rng["torch"])
        if dd.device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda_ranks"][dd.rank] if dd.world > 1 else rng["cuda"])
        self.data_gen.set_state(rng["data"][0] if isinstance(rng["data"], list) else rng["data"])
        self.feature_gen.set_state(rng["features"])
