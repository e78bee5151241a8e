"""The README is the front door: short, its example runs, its set-up and test commands are what
CI runs, its results table and the full report's tables (results/README.md) are generated from
results/summary.json, and every relative link in it and in the files it links to resolves."""
import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REPORT = ROOT / "results" / "README.md"
DOCS = [README, REPORT, *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_api_snippet_runs():
    """The "Use the layer in your own model" block, as .ci/run extracts it (.ci/run also runs it
    from the folder that holds a clone named linear_rope, with the installed package)."""
    code = runpy.run_path(str(ROOT / ".ci" / "readme_example.py"))["example"](README)
    assert "from linear_rope import" in code
    exec(compile(code, "README.md", "exec"), {})


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


def test_ci_runs_the_readme_set_up_and_test_command():
    readme = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    set_up = re.search(r"```bash\n(.*?)\n```", readme, re.S).group(1)  # the first bash block
    assert set_up == ('python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 '
                      '&& pip install -e ".[dev]"')
    assert 'python -m pip install --quiet torch==2.13.0' in ci
    assert 'python -m pip install --quiet -e ".[dev]"' in ci
    # exactly the README's test command, followed only by the mutant check (tests/mutants.py)
    assert "python -m pytest -q" in ci
    after = [line for line in ci[ci.index("python -m pytest -q") + 1:] if not line.startswith("#")]
    assert after == ["python tests/mutants.py"], after
    assert "\n```bash\npython -m pytest -q\n```\n" in readme


def _between(text: str, name: str) -> str:
    begin, end = f"<!-- tables:{name} begin -->\n", f"<!-- tables:{name} end -->"
    assert begin in text and end in text, f"no {name} tables block"
    return text.split(begin, 1)[1].split(end, 1)[0]


def _figures_not_in(prose: str, generated: str) -> list[str]:
    """The 3-decimal figures of ``prose`` (outside the tables blocks) missing from ``generated``."""
    prose = re.sub(r"<!-- tables:(\w+) begin -->.*?<!-- tables:\1 end -->", "", prose, flags=re.S)
    return sorted(f for f in set(re.findall(r"(?<![\d.])\d\.\d{3}(?!\d)", prose)) if f not in generated)


def test_results_report_tables_are_generated_from_summary_json():
    """results/README.md's tables are `python -m linear_rope.plots tables` of results/ (the cpu20m
    ablation) and of results/cpu2m/ (the earlier 2M-byte runs), verbatim; and every 3-decimal
    figure in its prose appears in those tables (or in the sweep's CSV)."""
    from linear_rope.results import plots

    report = REPORT.read_text()
    generated = ""
    for name, out in (("cpu20m", ROOT / "results"), ("cpu2m", ROOT / "results" / "cpu2m")):
        table = plots.tables(out)
        assert _between(report, name).strip() == table.strip(), f"results/README.md {name} tables are stale"
        generated += table
    generated += (ROOT / "results" / "sweep" / "none-cpu20m-sweep.csv").read_text()  # the preset's sweep
    missing = _figures_not_in(report, generated)
    assert not missing, f"results/README.md figures not in the generated tables: {missing}"


def test_readme_headline_table_is_generated_from_summary_json():
    """The README's one results table is `python -m linear_rope.plots headline`, verbatim, and its
    Results section quotes no figure that is not in the report's tables."""
    from linear_rope.results import plots

    section = README.read_text().split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    assert _between(section, "headline").strip() == plots.headline(ROOT / "results").strip()
    assert not _figures_not_in(section, plots.tables(ROOT / "results"))
    assert "(results/README.md)" in section


def test_relative_links_and_images_resolve():
    """The long material moved out of the README: every relative link or image in the README,
    docs/ and results/README.md names a file that exists (anchors are not checked)."""
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            path = target.split("#", 1)[0]
            if path and not re.match(r"[a-z]+:", path) and not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken
