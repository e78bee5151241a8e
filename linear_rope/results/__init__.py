"""Results tooling: the numbers (analysis.py) and figures / tables (plots.py) behind the README's
results. It may import the library and the app; neither imports it."""
