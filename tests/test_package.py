"""linear_rope/__init__.py: one version, written once, and the public names."""
from __future__ import annotations

import importlib.metadata
import json
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
