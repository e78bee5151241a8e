"""The README's API snippet runs, and the README shows the test command that .ci/run runs."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_api_snippet_runs():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use the layer in your own model", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == "python -m pytest -q"
    assert "\npython -m pytest -q\n" in readme
    assert "pip install torch==2.13.0" in readme and "pip install -e \".[dev]\"" in readme


def _between(text: str, name: str) -> str:
    begin, end = f"<!-- tables:{name} begin -->\n", f"<!-- tables:{name} end -->"
    assert begin in text and end in text, f"README has no {name} tables block"
    return text.split(begin, 1)[1].split(end, 1)[0]


def test_readme_results_tables_are_generated_from_summary_json():
    """The Results tables are `python -m linear_rope.plots tables` of results/ (the cpu20m
    ablation) and of results/cpu2m/ (the earlier 2M-byte runs), verbatim; and every 3-decimal
    figure in the Results section's prose appears in those tables (or in the sweep's CSV)."""
    from linear_rope.results import plots

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    generated = ""
    for name, out in (("cpu20m", ROOT / "results"), ("cpu2m", ROOT / "results" / "cpu2m")):
        table = plots.tables(out)
        assert _between(section, name).strip() == table.strip(), f"README {name} tables are stale"
        generated += table
    generated += (ROOT / "results" / "sweep" / "none-cpu20m-sweep.csv").read_text()  # the preset's sweep
    prose = re.sub(r"<!-- tables:(\w+) begin -->.*?<!-- tables:\1 end -->", "", section, flags=re.S)
    figures = set(re.findall(r"(?<![\d.])\d\.\d{3}(?!\d)", prose))
    missing = sorted(f for f in figures if f not in generated)
    assert not missing, f"README Results figures not in the generated tables: {missing}"
