"""The one atomic-write helper: every file the app writes (splits, downloads, checkpoints,
config.json) goes through :func:`atomic_write`.

The content goes to a hidden temporary file in the target's directory, is flushed and fsynced,
then ``os.replace``-d onto the target and the directory fsynced. A crash, ``kill -9`` or an
exception at any moment leaves either the old file or the new one, never a partial file under
the target's name; on an exception the temporary file is removed and the error propagates.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["atomic_write", "fsync_dir", "TMP_SUFFIX"]

TMP_SUFFIX = ".tmp"  # temporary files are ".<name>.<random>.tmp"


def fsync_dir(path) -> None:
    """fsync a directory, so a rename in it survives a power cut (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, content: bytes | str | Callable[[BinaryIO], None]) -> Path:
    """Write ``content`` (bytes, text as UTF-8, or a function that writes to a binary file)
    to ``path`` atomically; return ``path``. The function may raise to abort the write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)  # a no-op once os.replace has moved it
    fsync_dir(path.parent)
    return path
