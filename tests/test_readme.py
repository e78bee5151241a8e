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
