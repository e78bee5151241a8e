"""``python -m linear_rope.train`` and ``torchrun ... -m linear_rope.train``: the Enwik8 ablation
(the app lives in ``linear_rope/enwik8/``; see ``linear_rope/enwik8/train.py``)."""
import sys

from .enwik8.train import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
