"""Process runtime for training: torch.distributed setup, graceful stop on signals, hashes.

Scale-out is PyTorch's own: ``torchrun`` sets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, we join
the process group (gloo on CPU, nccl on CUDA) and wrap the model in DDP. No launcher of our own.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Dist", "init_distributed", "StopSignals", "param_digest", "resume_command"]


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def lead(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> Dist:
    """One process, or one rank of a torchrun launch (``WORLD_SIZE > 1``)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(device=torch.device(device))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, dev)


class StopSignals:
    """Turn the first SIGTERM / SIGINT into a request to checkpoint and stop after this step.

    A second signal of the same kind gets the default behaviour (terminate / KeyboardInterrupt),
    for when the checkpoint itself is not wanted. Use as a context manager around training.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, quiet: bool = False):
        self.received: str | None = None
        self.quiet = quiet
        self._old = {}

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        if not self.quiet:
            print(f"\nreceived {self.received}: saving a checkpoint after the current step "
                  f"(send it again to stop at once)", file=sys.stderr, flush=True)
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))

    def __enter__(self):
        for s in self.SIGNALS:
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        return False


def param_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's bytes, in order: equal digests mean bitwise-equal models."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def resume_command(argv: list[str], prog: str, world: int) -> str:
    """The command line that continues this run: the same arguments plus ``--resume``."""
    args = [a for a in argv if a != "--overwrite"]
    if "--resume" not in args:
        args.append("--resume")
    if prog.endswith(".py"):
        launch = (["torchrun", "--standalone", f"--nproc_per_node={world}", prog] if world > 1
                  else ["python", prog])
    else:  # "python -m linear_rope.train"
        module = prog.split()[-1]
        launch = (["torchrun", "--standalone", f"--nproc_per_node={world}", "-m", module] if world > 1
                  else ["python", "-m", module])
    return shlex.join(launch + args)
