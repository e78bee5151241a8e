"""Training step time of a preset, compiled (model.compile()) against eager, alternating children.

    python benchmarks/op_experiments/compile_train.py cpu20m 1 1 30 rope    # preset threads rounds steps variant
"""
# Time train_step of a preset with compile on/off, alternating children. usage: python compile_train.py PRESET THREADS ROUNDS STEPS
import json, subprocess, sys, statistics
CODE = r'''
import sys, json, statistics, time, tempfile, numpy as np, torch
from linear_rope.enwik8.config import TRAIN_PRESETS, TrainConfig
from linear_rope.enwik8.trainer import Trainer
from linear_rope.model import MODEL_PRESETS, ModelConfig
preset, comp, threads, steps, variant = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.set_num_threads(threads)
raw = np.random.default_rng(0).integers(0, 256, 2_000_000, dtype=np.uint8)
splits = {"train": raw[:1_800_000], "valid": raw[1_800_000:1_900_000], "test": raw[1_900_000:]}
with tempfile.TemporaryDirectory() as out:
    mc = ModelConfig(**MODEL_PRESETS[preset])
    tc = TrainConfig(**{**TRAIN_PRESETS[preset], "out": out, "threads": threads, "compile": comp})
    t = Trainer(variant + "-seed0", mc, tc, splits)
    t._open()
    ts = []
    for s in range(5 + steps):
        t0 = time.perf_counter(); t.train_step(s); ts.append(time.perf_counter() - t0)
    t._close()
print(json.dumps({"warm": sum(ts[:5]), "step": statistics.median(ts[5:]), "compiled": t.compiled}))
'''
preset, threads, rounds, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
variant = sys.argv[5] if len(sys.argv) > 5 else "rope"
res = {"0": [], "1": []}
for r in range(rounds):
    for c in ("0", "1"):
        p = subprocess.run([sys.executable, "-c", CODE, preset, c, threads, steps, variant], capture_output=True, text=True)
        if p.returncode:
            print(p.stderr[-3000:]); sys.exit(1)
        d = json.loads(p.stdout.strip().splitlines()[-1]); res[c].append(d); print(preset, variant, "compile" if c == "1" else "eager", d, flush=True)
e = min(d["step"] for d in res["0"]); c = min(d["step"] for d in res["1"])
print(f"{preset} {variant}: eager {e:.4f} s/step, compiled {c:.4f} s/step, eager/compiled {e/c:.3f}")
