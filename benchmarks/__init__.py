"""Side-by-side benchmarks of linear_rope against its anchors; see benchmarks/run.py."""
