"""Enwik8 ablation: RoPE vs no position in a byte-level Performer LM (see linear_rope/enwik8/train.py).

    python train_enwik8.py --preset tiny --steps 200 --out runs/first      # enwik8, downloaded once into the cache
    python train_enwik8.py --preset tiny --steps 200 --data PATH --out runs/first   # offline: a corpus you have
"""
import sys

from linear_rope.enwik8.train import main

if __name__ == "__main__":
    sys.exit(main(prog="train_enwik8.py"))
