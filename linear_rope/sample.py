"""``python -m linear_rope.sample``: sample from a checkpoint (see ``linear_rope/enwik8/sample.py``)."""
import sys

from .enwik8.sample import load_model, main

__all__ = ["load_model", "main"]

if __name__ == "__main__":
    sys.exit(main())
