"""``python -m linear_rope.plots``: results tables and figures (see ``linear_rope/results/plots.py``)."""
import sys

from .results.plots import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
