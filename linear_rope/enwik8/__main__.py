"""``python -m linear_rope.enwik8``: the same as ``python -m linear_rope.train``."""
import sys

from .train import main

sys.exit(main(prog="python -m linear_rope.enwik8"))
