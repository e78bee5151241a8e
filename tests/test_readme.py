"""The README is the front door: short, its example runs, its set-up and test commands are what
CI runs, its results table and the full report's tables (results/README.md) are generated from
results/summary.json, and every relative link in it and in the files it links to resolves."""
import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REPORT = ROOT / "results" / "README.md"
REPORTS = sorted((ROOT / "results").glob("**/README.md"))
DOCS = [README, *REPORTS, *sorted((ROOT / "docs").glob("*.md"))]


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
    # exactly the README's test command, with the README's set-up only: no extra installed before it
    assert "python -m pytest -q" in ci
    before = ci[:ci.index("python -m pytest -q")]
    installs = [line for line in before if "pip install" in line and not line.lstrip().startswith("#")]
    assert all("--upgrade pip" in line or "torch==2.13.0" in line or '".[dev]"' in line or line.endswith("--no-deps -e .")
               for line in installs), installs
    # then the extras, the tests that skipped without them, and the mutants (tests/mutants.py)
    after = ci[ci.index("python -m pytest -q") + 1:]
    assert any('-e ".[hf]"' in line for line in after) and any('-e ".[predict]"' in line for line in after)
    assert "python tests/mutants.py" in after
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
    """Every ``tables:<name>`` block of the results reports (results/**/README.md) is
    `python -m linear_rope.plots tables` of results/<name>/, verbatim; and every 3-decimal figure
    in a report's prose appears in the generated tables (or in a sweep's CSV)."""
    from linear_rope.results import plots

    sweeps = "".join(p.read_text() for p in sorted((ROOT / "results").glob("sweep*/*.csv")))
    seen, generated = set(), sweeps
    for doc in REPORTS:
        text = doc.read_text()
        for name in re.findall(r"<!-- tables:(\w+) begin -->", text):
            table = plots.tables(ROOT / "results" / name)
            assert _between(text, name).strip() == table.strip(), f"{doc.relative_to(ROOT)}: {name} tables are stale"
            generated += table
            seen.add(name)
    for doc in REPORTS:  # a report may quote another's table (the cpu20m report quotes cpu2m)
        if "<!-- tables:" in doc.read_text():
            missing = _figures_not_in(doc.read_text(), generated)
            assert not missing, f"{doc.relative_to(ROOT)}: figures not in the generated tables: {missing}"
    from linear_rope.results.plots import HEADLINE

    assert {"cpu20m", "cpu2m", HEADLINE} <= seen


def test_readme_headline_table_is_generated_from_summary_json():
    """The README's one results table is `python -m linear_rope.plots headline`, verbatim, and its
    Results section quotes no figure that is not in the generated tables of the headline
    ablation or of its m = 128 runs (the same issue's other folder)."""
    from linear_rope.results import plots

    section = README.read_text().split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    assert _between(section, "headline").strip() == plots.headline(ROOT / "results" / plots.HEADLINE).strip()
    generated = "".join(plots.tables(ROOT / "results" / name) for name in (plots.HEADLINE, "m128"))
    assert not _figures_not_in(section, generated)
    assert "(results/README.md)" in section


def test_fill_rewrites_a_stale_block_and_leaves_the_rest(tmp_path):
    """`python -m linear_rope.plots fill` is how the blocks above are kept current."""
    import shutil

    from linear_rope.results import plots

    shutil.copytree(ROOT / "results", tmp_path / "results")
    shutil.copy(README, tmp_path / "README.md")
    assert plots.fill(tmp_path) == []  # everything is current
    doc = tmp_path / "results" / "cpu20m" / "README.md"
    fresh = doc.read_text()
    doc.write_text(fresh.replace("| `rope` | 3 |", "| `rope` | 4 |", 1))
    assert plots.fill(tmp_path) == [doc] and doc.read_text() == fresh


def test_relative_links_and_images_resolve():
    """The long material moved out of the README: every relative link or image in the README,
    docs/ and the results reports names a file that exists (anchors are not checked)."""
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            path = target.split("#", 1)[0]
            if path and not re.match(r"[a-z]+:", path) and not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


# How the project was made (its issue numbers, the machines and sessions of its development) is
# no part of what a user reads. Another project's issue (``fla-org/flash-linear-attention PR 826,
# issue 640``) may be cited.
MAKING = re.compile(r"(?i)\bissues?[ -]?#?\d+|this project's (?:own )?machine|\bthis task\b|\blent (?:one|a GPU)|"
                    r"\bsessions?\b|\blast turn\b|\bour (?:dev )?machine")


def test_docs_say_nothing_of_how_the_project_was_made():
    """README.md, docs/ and every results report: no issue number of this project, nothing about
    the machines or sessions it was developed in (a measurement names its hardware instead)."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in MAKING.finditer(text):
            before = text[max(0, m.start() - 60):m.start()]
            if m.group(0).lower().startswith("issue") and re.search(r"[\w.-]+/[\w.-]+ [^()\n]*$", before):
                continue  # another repository's issue, cited
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{doc.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert not found, found


def test_readme_names_every_scalar_the_runs_log():
    """Every TensorBoard tag the trainer writes (``add_scalar`` / ``add_hparams`` metrics) is named
    in the README's "Where to look"."""
    source = (ROOT / "linear_rope" / "enwik8" / "metrics.py").read_text()
    tags = set(re.findall(r'"((?:train|val|test|perf|grad|hparam)/\w+|lr)"', source))
    assert len(tags) >= 9, tags
    readme = README.read_text()
    missing = sorted(t for t in tags if f"`{t}`" not in readme)
    assert not missing, missing
