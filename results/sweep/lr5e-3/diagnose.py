import json, torch, sys
from pathlib import Path
from linear_rope.model import ModelConfig
from linear_rope.enwik8.config import TrainConfig
from linear_rope.enwik8 import data
from linear_rope.enwik8.trainer import Trainer
torch.set_num_threads(1)
cfg = json.loads(Path("/work/runs15/diag/rope-seed0/config.json").read_text())
mc = ModelConfig(**cfg["model"]); tc = TrainConfig(**{**cfg["train"], "out": "/work/runs15/diag", "data_dir": "/work/runs15/code/data"})
paths = data.prepare_corpus(tc.data, tc.data_dir)
splits = {k: data.load_split(p) for k, p in paths.items()}
tr = Trainer("rope-seed0", mc, tc, splits)
assert tr.resume()
st = tr.state
print("resumed at", st.step, flush=True)
stats = {}
def hook(name):
    def f(mod, args, out):
        stats[name] = (args[0].abs().max().item(), out.abs().max().item())
    return f
for i, b in enumerate(tr.model.blocks):
    b.attn.register_forward_hook(hook(i))
for step in range(st.step, 606):
    try:
        loss, gn, _ = tr.train_step(step)
    except Exception as e:
        print("step", step, "error", e); 
        print({k: v for k, v in stats.items()})
        break
    if step >= 560 or step % 20 == 0:
        print(step, round(loss, 4), round(gn, 3), "max|attn out| per layer", [round(stats[i][1], 1) for i in range(12)], flush=True)
torch.save(tr.model.state_dict(), "/work/runs15/diag/model605.pt")
