"""Fixtures shared by the training tests (helpers live in helpers.py)."""
from __future__ import annotations

import bz2
import os
from pathlib import Path

import pytest
import torch

# test_triton.py runs the Triton kernels in Triton's interpreter on the CPU. Triton fixes that
# choice when triton.language is first imported (helpers' imports already do, through torch),
# so set it first; on a CUDA machine the kernels run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import SAMPLE  # noqa: E402

# In-process training runs keep the test process's threads (no idle-core probe at every start;
# runtime.choose_threads is tested on its own). Subprocesses get the same from helpers.ENV.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """64 KB of the shared sample, or synthetic text without it."""
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    if SAMPLE.is_file():
        with bz2.open(SAMPLE, "rb") as f:
            path.write_bytes(f.read(1 << 16))
    else:
        path.write_bytes(b"the rotary linear attention of a performer language model\n" * 1200)
    return path
