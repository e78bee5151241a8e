"""linear_rope/__init__.py: one version, written once, and the public names; the wheel a user
installs: the package, LICENSE and py.typed only, and the README example runs from it."""
from __future__ import annotations

import importlib.metadata
import json
import os
import runpy
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import pytest

import linear_rope

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_reads_the_version_from_the_package():
    """pyproject.toml writes no version of its own: setuptools takes ``linear_rope.__version__``."""
    from setuptools.config.pyprojecttoml import read_configuration

    project = read_configuration(ROOT / "pyproject.toml")["project"]
    assert project["dynamic"] == ["version"]
    assert project["version"] == linear_rope.__version__ == "0.2.0"


def test_installed_metadata_is_the_package_version():
    """``importlib.metadata.version("linear_rope") == linear_rope.__version__`` for an install of
    this checkout (``.ci/run`` makes one). An install of another checkout says nothing here."""
    dist = importlib.metadata.distribution("linear_rope")
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if Path(url2pathname(urlparse(url).path)).resolve() != ROOT:
        pytest.skip(f"linear_rope is installed from {url or 'a wheel'}, not from {ROOT}")
    assert importlib.metadata.version("linear_rope") == linear_rope.__version__


def test_public_names_are_importable():
    assert sorted(linear_rope.__all__) == sorted(set(linear_rope.__all__))
    assert all(hasattr(linear_rope, name) for name in linear_rope.__all__)


def test_import_loads_neither_the_compiler_nor_an_extra():
    """``import linear_rope`` costs about what ``import torch`` does: no ``torch._dynamo`` (a
    second on a 2-core box), no Inductor or sympy, and none of the extras (triton, transformers,
    fla), even where they are installed. A fresh interpreter, run from the checkout's root."""
    code = ("import sys, linear_rope; roots = ('torch._dynamo', 'torch._inductor', 'sympy', 'triton', "
            "'transformers', 'fla'); bad = sorted(m for m in sys.modules if m.split('.')[0] in roots or "
            "any(m == r or m.startswith(r + '.') for r in roots)); print(linear_rope.__file__); assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert Path(res.stdout.strip()).resolve() == ROOT / "linear_rope" / "__init__.py"


def test_rope_limbs_carry_what_assume_constant_result_marks():
    """``rotary._limbs`` is marked a constant for ``torch.compile`` by hand (the decorator imports
    ``torch._dynamo``): it must carry every attribute the decorator sets, with the same value."""
    import torch

    from linear_rope import rotary

    def probe():
        return 0

    marked = torch.compiler.assume_constant_result(probe)
    attrs = dict(vars(marked))
    assert attrs, "assume_constant_result no longer marks the function: update rotary._limbs"
    assert {k: getattr(rotary._limbs, k, None) for k in attrs} == attrs


# --- the wheel, as a user installs it ---------------------------------------------------------

# Copied to a temporary folder before building: setuptools builds in <source>/build/, and the
# build must leave the checkout as it was. Everything else is copied, results/ and tests/
# included, so that the wheel's file list would show any of them leaking in.
_NOT_COPIED = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".venv",
                                     "runs", "*.bin", "*.bz2", "*.zip")


def _site_dirs() -> list[str]:
    """This interpreter's site-packages (torch and the other dependencies live there)."""
    dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    return sorted(d for d in dirs if Path(d).is_dir())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel --no-deps`` of a copy of this checkout. No network: ``--no-build-isolation``
    builds with this environment's setuptools (>= 77, as pyproject.toml's build-system asks)."""
    from setuptools import __version__ as setuptools_version

    if int(setuptools_version.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools_version} < 77 cannot build this pyproject.toml without a download")
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, tmp / "src", ignore=_NOT_COPIED, symlinks=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(tmp / "dist"), str(tmp / "src")], check=True, capture_output=True)
    (found,) = (tmp / "dist").glob("linear_rope-*.whl")
    return found


@pytest.mark.wheel
def test_wheel_holds_the_package_license_and_py_typed_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = f"linear_rope-{linear_rope.__version__}.dist-info/"
    assert f"{dist_info}licenses/LICENSE" in names
    assert "linear_rope/py.typed" in names and "linear_rope/__init__.py" in names
    assert "linear_rope/ops/chunk.py" in names and "linear_rope/enwik8/trainer.py" in names
    stray = [n for n in names if not (n.startswith("linear_rope/") or n.startswith(dist_info))]
    assert not stray, f"files outside the package: {stray}"
    inside = [n for n in names if n.startswith("linear_rope/")]
    assert all(n.endswith((".py", "py.typed")) for n in inside), [n for n in inside if not n.endswith(".py")]
    tracked = {p.relative_to(ROOT).as_posix() for p in (ROOT / "linear_rope").rglob("*.py")}
    assert tracked <= set(inside), sorted(tracked - set(inside))
    meta = zipfile.ZipFile(wheel).read(f"{dist_info}METADATA").decode()
    assert "License-Expression: MIT" in meta and "License-File: LICENSE" in meta
    license_text = zipfile.ZipFile(wheel).read(f"{dist_info}licenses/LICENSE").decode()
    assert license_text == (ROOT / "LICENSE").read_text() and "MIT License" in license_text


@pytest.mark.wheel
def test_wheel_installs_in_a_fresh_venv_and_runs_the_readme_example(wheel, tmp_path):
    """A fresh venv (``--system-site-packages``, and a .pth naming this interpreter's
    site-packages: when this interpreter is itself a venv, ``--system-site-packages`` reaches
    the base Python only) gets the wheel with ``--no-deps``, so torch comes from here without a
    download; the README's example then runs from a folder outside the clone."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    (purelib,) = json.loads(subprocess.run([str(py), "-c", "import json, sysconfig; "
                                            "print(json.dumps([sysconfig.get_paths()['purelib']]))"],
                                           check=True, capture_output=True, text=True).stdout)
    Path(purelib, "_host_env.pth").write_text("\n".join(_site_dirs()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True)
    code = runpy.run_path(str(ROOT / ".ci" / "readme_example.py"))["example"](ROOT / "README.md")
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "example.py").write_text(code + "\nimport linear_rope\nprint(linear_rope.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([str(py), "example.py"], cwd=work, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    where = Path(res.stdout.strip().splitlines()[-1]).resolve()
    assert where.is_relative_to(venv.resolve()), f"imported {where}, not the installed wheel"


def test_citation_and_ignored_build_outputs():
    """CITATION.cff cites the package and the two papers it implements; the build outputs a
    ``pip install .`` or ``pip wheel .`` leaves in a clone are ignored by git."""
    cff = (ROOT / "CITATION.cff").read_text()
    assert cff.startswith("cff-version: 1.2.0\n") and "\ntitle: " in cff and "\nlicense: MIT\n" in cff
    assert f"\nversion: {linear_rope.__version__}\n" in cff
    for arxiv, title in (("2104.09864", "RoFormer: Enhanced Transformer with Rotary Position Embedding"),
                         ("2009.14794", "Rethinking Attention with Performers")):
        assert f'value: "arXiv:{arxiv}"' in cff and f'title: "{title}"' in cff
    ignored = set((ROOT / ".gitignore").read_text().split())
    assert {"/build/", "/dist/", "*.egg-info/"} <= ignored


def test_metadata_names_the_project_urls_and_dev_builds_the_package():
    """A wheel's metadata links its home, source, issue tracker and docs; ``.[dev]`` has what
    ``python -m build`` needs."""
    from setuptools.config.pyprojecttoml import read_configuration

    project = read_configuration(ROOT / "pyproject.toml")["project"]
    urls = project["urls"]
    assert set(urls) == {"Homepage", "Repository", "Issues", "Documentation"}
    assert all(u.startswith("https://") for u in urls.values())
    assert any(d.split(">")[0].split("=")[0].strip() == "build" for d in project["optional-dependencies"]["dev"])


def test_missing_extras_name_the_install_a_wheel_user_can_run():
    """Without an extra's packages, the message names ``pip install "linear_rope[<extra>]"``,
    which works for a wheel install and for a clone alike (not ``pip install -e ".[hf]"``,
    which needs the clone's folder); no message or docstring in the package says ``-e``."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import linear_rope.hf\nexcept ImportError as e:\n    print(e)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert 'linear_rope.hf needs transformers: pip install "linear_rope[hf]"' in res.stdout, res.stderr[-2000:]
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from linear_rope.results import runs\n"
            "try:\n    runs._plt()\nexcept runs.ResultsError as e:\n    print(e)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert 'pip install "linear_rope[plot]"' in res.stdout, res.stderr[-2000:]
    editable = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in (ROOT / "linear_rope").rglob("*.py")
                for line in p.read_text().splitlines() if "pip install -e" in line]
    assert not editable, editable
