"""Training configuration: the TrainConfig dataclass, the presets, the LR schedule, and the
checks every run passes before anything is loaded (the command line is in ``cli.py``)."""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace

from ..model import MODEL_PRESETS, ModelConfig, PerformerLM, check_field_types

__all__ = ["ConfigError", "TrainConfig", "TRAIN_PRESETS", "RESUMABLE", "MAX_SEQ_LEN", "lr_at",
           "check_model", "check_run", "resume_diffs", "PRECISIONS", "COMPILE_MODES", "MAX_SEED", "MAX_BATCH_TOKENS",
           "MAX_STEP_TOKENS"]

PRECISIONS = ("auto", "bf16", "fp32")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
NONFINITE = ("stop", "skip")
# Seeds are 32-bit, as numpy's: the run's generators are seeded with seed * 1000 (+ an offset per
# rank) and seed + 1_000_003, which must stay inside torch's 64-bit seed range.
MAX_SEED = 2**32 - 1
# A sanity cap on the tokens of one (micro-)batch, batch_size x seq_len (and eval_batch_size x
# seq_len): a typo such as --batch-size 1000000000 fails at once instead of asking for terabytes
# once the data is loaded. 2**24 tokens is 512k sequences of the tiny preset, 16k of paper's.
MAX_BATCH_TOKENS = 2**24
# The same for a whole optimizer step on one rank (batch_size x grad_accum x seq_len): its window
# offsets are drawn at once, so --grad-accum 100000000000000000 asked for exabytes.
MAX_STEP_TOKENS = 2**30
# --threads above this many per core is a typo: thousands of threads fail to start.
MAX_THREADS_PER_CORE = 4


class ConfigError(ValueError):
    """A run the model rejects or a --resume that does not match its checkpoint (CLI: exit 2)."""


@dataclass
class TrainConfig:
    steps: int = 2000  # optimizer steps in total
    batch_size: int = 8  # sequences per micro-batch on each rank
    grad_accum: int = 1  # micro-batches per step (global batch = batch_size * grad_accum * ranks)
    lr: float = 1e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 100  # linear warmup steps
    decay_steps: int | None = None  # step where the cosine ends (None: steps)
    weight_decay: float = 0.01  # AdamW weight decay on matrices and embeddings
    grad_clip: float = 1.0  # max global grad norm (0: no clipping)
    eval_every: int = 250  # val BPC every N steps (0: only at the last step)
    eval_batch_size: int = 32  # eval windows per forward pass
    log_every: int = 10  # train scalars every N steps (the only steps that read statistics back from the device)
    checkpoint_every: int = 0  # also checkpoint every N steps (0: at evals, the end and signals)
    keep_checkpoints: int = 3  # newest checkpoints kept per run (older ones are deleted)
    seed: int = 0  # init, data order and redraws (set per run by --seeds)
    data: str | None = None  # any byte corpus (.bz2/.gz/.xz/.zip/raw); None: enwik8
    data_dir: str | None = None  # where the splits (and enwik8.zip) are cached (None: $LINEAR_ROPE_CACHE, else $XDG_CACHE_HOME/linear_rope, else ~/.cache/linear_rope)
    out: str | None = None  # experiment dir, one subdir per run (None: runs/<preset>)
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    compile: bool | None = None  # each block compiled in place, fullgraph=True (step.compile_blocks) (None: on for CUDA, off for CPU; on CPU it needs a C++ compiler, else it trains eagerly and says so)
    compile_mode: str = "default"  # torch.compile mode: default | reduce-overhead (CUDA graphs) | max-autotune | max-autotune-no-cudagraphs
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32
    threads: int | None = None  # torch CPU threads (None: the idle cores at start, see runtime.py)
    deterministic: bool = False  # torch.use_deterministic_algorithms (bitwise-repeatable runs)
    on_nonfinite: str = "stop"  # stop | skip: a non-finite loss or grad norm is never applied; stop ends the run at the next logging interval (or checkpoint) at the latest, skip goes on (20 in a row stop it)
    init_from: str | None = None  # start from this checkpoint's (or run folder's newest) weights and model config (flags and --variants override), then train from step 0 with a new optimizer

    def __post_init__(self):
        check_field_types(self)  # a bool is not a number; every float is finite
        for f in ("steps", "batch_size", "grad_accum", "eval_batch_size", "log_every",
                  "keep_checkpoints"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        for f in ("warmup_steps", "weight_decay", "grad_clip", "eval_every", "checkpoint_every",
                  "seed"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.seed > MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}] (32 bits), got {self.seed}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.on_nonfinite not in NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {', '.join(NONFINITE)}, got {self.on_nonfinite!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")
        if self.compile_mode == "reduce-overhead" and self.grad_accum > 1:  # a replay overwrites the last one's outputs
            raise ValueError(f"compile_mode reduce-overhead (CUDA graphs) takes grad_accum 1, got {self.grad_accum}: "
                             "raise batch_size instead, or use compile_mode default")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for f in ("decay_steps", "threads"):
            if getattr(self, f) is not None and getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1 or None, got {getattr(self, f)}")
        for f in ("data", "data_dir", "out", "init_from"):  # "--out $OUT" with OUT unset: not the default folder
            if getattr(self, f) is not None and not getattr(self, f).strip():
                raise ValueError(f"{f} is an empty path; leave --{f.replace('_', '-')} out for its default")


TRAIN_PRESETS: dict[str, dict] = {
    # RoFormer section 4.4: lr 1e-4, batch 128. The step count is not stated there; ours.
    "paper": dict(lr=1e-4, batch_size=128, steps=100_000, warmup_steps=1000, eval_every=1000,
                  eval_batch_size=16, log_every=50),
    # about 0.56 s/step on 2 idle EPYC cores: 1000 steps ~ 9.5 min plus ~25 s per full-val eval
    "cpu": dict(lr=1e-3, batch_size=8, steps=1000, warmup_steps=100, eval_every=250,
                eval_batch_size=32, log_every=10),
    # 4900 steps x 16 x 256 = 20.07M training bytes (3.6 epochs of the sample's train split).
    # lr 2e-3, not the sweep's best 5e-3: with 5e-3 Eq. 19 (`rope`) diverged at step 606 (one
    # layer's output jumped to 3188, the float32 gradient overflowed); see results/sweep.
    # about 1.35 steps/s at 1 thread with a second run beside it: 61 min plus evals
    "cpu20m": dict(lr=2e-3, batch_size=16, steps=4900, warmup_steps=100, eval_every=490,
                   eval_batch_size=32, log_every=10),
    # 9800 steps x 16 x 256 = 40.14M training bytes; the headline ablation (--preset cpu20m is the
    # earlier recipe). lr 4e-3 with qk_norm: the sweep's best on `none` (results/recipe_sweep). About
    # 0.75 s/step at 1 thread with a second run beside it: 2 h plus evals.
    "cpu40m": dict(lr=4e-3, batch_size=16, steps=9800, warmup_steps=100, eval_every=490,
                   eval_batch_size=32, log_every=10),
    "tiny": dict(lr=1e-3, batch_size=4, steps=20, warmup_steps=2, eval_every=10,
                 eval_batch_size=256, log_every=1),
}
assert set(TRAIN_PRESETS) == set(MODEL_PRESETS)

# Train fields a --resume may change: they do not alter the training trajectory.
RESUMABLE = {"steps", "eval_every", "eval_batch_size", "log_every", "checkpoint_every",
             "keep_checkpoints", "data", "data_dir", "out", "device", "compile", "compile_mode", "precision",
             "threads", "deterministic", "on_nonfinite"}

# A sanity cap on --seq-len per preset (16x its training length): a typo such as --seq-len 1024000
# fails at once instead of allocating for minutes. Evaluation at longer windows has no cap.
MAX_SEQ_LEN = {name: 16 * cfg["seq_len"] for name, cfg in MODEL_PRESETS.items()}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of the update at 0-based ``step``: a pure function of the step.

    Linear warmup over ``warmup_steps``, then a cosine from ``lr`` down to ``lr * min_lr_ratio``
    at ``decay_steps`` (default ``steps``), flat after. To extend a run with ``--resume --steps``
    on exactly the schedule an uninterrupted run would have had, fix ``--decay-steps`` at the start.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    end = cfg.decay_steps or cfg.steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, end - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def check_model(mc: ModelConfig) -> None:
    """Raise :class:`ConfigError` now if the library would reject ``mc`` (e.g. ``--feature-map
    elu`` with FAVOR+'s ``--nb-features``), by building one block of it: no data is loaded yet."""
    try:
        PerformerLM(replace(mc, depth=1))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{mc.position}: {e}") from None


def check_run(mc: ModelConfig, tc: TrainConfig) -> None:
    """ValueError for a model and training config the byte-level app cannot train together."""
    if mc.vocab_size < 256:
        raise ValueError(f"vocab_size {mc.vocab_size}: the corpus is bytes (ids 0-255), so it must be "
                         f">= 256")
    for flag, b in (("batch_size", tc.batch_size), ("eval_batch_size", tc.eval_batch_size)):
        if b * mc.seq_len > MAX_BATCH_TOKENS:
            raise ValueError(f"{flag} {b} x seq_len {mc.seq_len} = {b * mc.seq_len:,} tokens per batch is "
                             f"above the sanity cap of {MAX_BATCH_TOKENS:,}; use --grad-accum for a larger "
                             f"global batch")
    step = tc.batch_size * tc.grad_accum * mc.seq_len
    if step > MAX_STEP_TOKENS:
        raise ValueError(f"batch_size {tc.batch_size} x grad_accum {tc.grad_accum} x seq_len {mc.seq_len} = {step:,} "
                         f"tokens per step is above the sanity cap of {MAX_STEP_TOKENS:,}")
    if not mc.causal:
        raise ValueError("causal False: a bidirectional model sees the byte it is trained to predict; pass "
                         "--causal (its weights are kept)")
    cores = os.cpu_count() or 1
    if tc.threads is not None and tc.threads > MAX_THREADS_PER_CORE * cores:
        raise ValueError(f"threads {tc.threads} is more than {MAX_THREADS_PER_CORE} per CPU core ({cores} cores "
                         f"here); leave --threads out to use the idle cores")


# ModelConfig fields added after runs were written, with the value every earlier run had.
NEW_MODEL_FIELDS = {"causal": True, "input_pos": "none", "head_bias": False}


def resume_diffs(old: dict, mc: ModelConfig, tc: TrainConfig) -> list[str]:
    """What differs between a run's saved config (``{"model", "train"}``, from config.json or a
    checkpoint, any version) and this one, among the fields a resume must keep."""
    # a field added since the checkpoint was written had its default then
    old_m, old_t = {**NEW_MODEL_FIELDS, **old.get("model", {})}, {**asdict(TrainConfig()), **old.get("train", {})}
    diffs = [f"{k}: checkpoint {old_m.get(k)!r}, now {v!r}" for k, v in asdict(mc).items()
             if old_m.get(k) != v]
    return diffs + [f"{k}: checkpoint {old_t.get(k)!r}, now {v!r}" for k, v in asdict(tc).items()
                    if k not in RESUMABLE and old_t.get(k) != v]
