"""Results tooling: the numbers (analysis.py) and figures / tables (plots.py) behind results/README.md
and the README's headline table. It may import the library and the app; neither imports it."""
