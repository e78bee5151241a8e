"""Print the README's "Use the layer in your own model" code block (.ci/run and
tests/test_readme.py run it)."""
import re
from pathlib import Path

HEADING = "## Use the layer in your own model"


def example(readme: Path = Path(__file__).resolve().parents[1] / "README.md") -> str:
    section = readme.read_text().split(HEADING, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


if __name__ == "__main__":
    print(example(), end="")
