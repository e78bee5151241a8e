"""Enwik8 ablation: RoPE vs no position in a byte-level Performer LM (see linear_rope/train.py).

    python train_enwik8.py --preset tiny --data ../shared/data/enwiki-sample.xml.bz2 --out runs/tiny
"""
import sys

from linear_rope.train import main

if __name__ == "__main__":
    sys.exit(main(prog="train_enwik8.py"))
