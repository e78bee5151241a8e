"""A corpus's raw bytes: read a local file (``.zip``, ``.gz``, ``.bz2``, ``.xz`` or plain), download
a URL atomically, check a size and an md5. :mod:`linear_rope.enwik8.data` splits what these return.

A missing, corrupt or mismatched file and a failed download raise :class:`DataError`: one line,
which the CLI prints before it exits 2.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import http.client
import lzma
import sys
import urllib.error
import urllib.request
import zipfile
import zlib
from pathlib import Path

from .files import atomic_write

__all__ = ["DataError", "read_corpus", "verify_bytes", "download"]

_CHUNK = 1 << 20
_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


class DataError(Exception):
    """Clear, one-line, user-facing error (the CLI prints it and exits 2)."""


# --------------------------------------------------------------------------- reading


def read_corpus(path) -> bytes:
    """Return the raw bytes of a ``.zip``, ``.gz``, ``.bz2``, ``.xz`` or plain file.

    A zip must hold one file, or one member named like the archive's stem (``enwik8`` in
    ``enwik8.zip``). The format is chosen by suffix (case-insensitive).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".zip":
            return _read_zip(path)
        if suffix in _OPENERS:
            with _OPENERS[suffix](path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (zipfile.BadZipFile, zlib.error, lzma.LZMAError, EOFError, OSError) as e:
        raise DataError(f"cannot read {path}: {e} (corrupt or truncated file?)") from None


def _read_zip(path: Path) -> bytes:
    with zipfile.ZipFile(path) as zf:
        members = [m for m in zf.infolist() if not m.is_dir()]
        if not members:
            raise DataError(f"zip archive {path} is empty")
        if len(members) > 1:
            named = [m for m in members if Path(m.filename).name == path.stem]
            if len(named) != 1:
                names = ", ".join(m.filename for m in members)
                raise DataError(f"zip archive {path} has several members ({names}) "
                                f"and none is uniquely named {path.stem!r}")
            members = named
        return zf.read(members[0])


def verify_bytes(raw: bytes, *, size: int | None = None, md5: str | None = None,
                 name: str = "data") -> None:
    """Raise :class:`DataError` unless ``raw`` has ``size`` bytes and md5 ``md5`` (if given)."""
    if size is not None and len(raw) != size:
        raise DataError(f"{name} has {len(raw)} bytes, expected {size} "
                        f"(truncated or wrong file?)")
    if md5 is not None:
        got = hashlib.md5(raw, usedforsecurity=False).hexdigest()
        if got != md5.lower():
            raise DataError(f"checksum mismatch for {name}: md5 got {got}, expected {md5}")


# --------------------------------------------------------------------------- download


def download(url: str, dest, *, md5: str | None = None, size: int | None = None,
             timeout: float = 60.0) -> Path:
    """Stream ``url`` to ``dest`` atomically, checking the downloaded file's size and md5.

    The bytes go to a temporary file beside ``dest``, which is moved into place only after
    every check passes. On any failure (HTTP status, connection, mismatch, Ctrl-C) the
    temporary file is removed and ``dest`` is left untouched; network and check failures
    raise :class:`DataError`, ``KeyboardInterrupt`` propagates as is.
    """
    dest = Path(dest)

    def fetch(f) -> None:
        got_size, got_md5 = _stream(url, f, timeout, f"downloading {url} -> {dest}")
        if size is not None and got_size != size:
            raise DataError(f"download of {url} failed: got {got_size} bytes, "
                            f"expected {size} (truncated?)")
        if md5 is not None and got_md5 != md5.lower():
            raise DataError(f"checksum mismatch for {url}: md5 got {got_md5}, expected {md5}")

    try:
        atomic_write(dest, fetch)
    except urllib.error.HTTPError as e:
        raise DataError(f"download of {url} failed: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise DataError(f"download of {url} failed: {e.reason}") from None
    except (OSError, http.client.HTTPException) as e:
        raise DataError(f"download of {url} failed: {type(e).__name__}: {e}") from None
    return dest


def _stream(url: str, f, timeout: float, note: str) -> tuple[int, str]:
    """Copy the response body of ``url`` into ``f``; return (bytes written, md5 hex). ``note``
    goes to stderr once the server has answered (offline, the error is the only line)."""
    digest, written = hashlib.md5(usedforsecurity=False), 0
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        print(note, file=sys.stderr)
        total = resp.headers.get("Content-Length")
        bar = _progress_bar(int(total) if total else None, Path(url).name)
        try:
            while chunk := resp.read(_CHUNK):
                f.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                if bar is not None:
                    bar.update(len(chunk))
        finally:
            if bar is not None:
                bar.close()
    return written, digest.hexdigest()


def _progress_bar(total: int | None, desc: str):
    """A tqdm bar if tqdm is installed and stderr is a terminal, else None."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=None)
