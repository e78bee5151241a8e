"""A corpus's raw bytes: read a local file (``.zip``, ``.gz``, ``.bz2``, ``.xz`` or plain), download
a URL atomically, check a size and an md5. :mod:`linear_rope.enwik8.data` splits what these return.

Both sides are bounded, since enwik8 comes over plain http: a download is refused past what the
corpus can be (:data:`MAX_DOWNLOAD_BYTES`, or the caller's bound), and a compressed file is read
in chunks and refused as soon as it passes the size it should have, so a small archive that
inflates to gigabytes costs no more memory than the corpus itself.

A missing, corrupt, oversized or mismatched file and a failed download raise :class:`DataError`:
one line, which the CLI prints before it exits 2.
"""

from __future__ import annotations

import bz2
import contextlib
import fcntl
import gzip
import hashlib
import http.client
import io
import lzma
import os
import re
import stat
import sys
import time
import urllib.error
import urllib.request
import zipfile
import zlib
from pathlib import Path

from .files import TMP_SUFFIX, atomic_write

__all__ = ["DataError", "read_corpus", "verify_bytes", "download", "remove_stale_temps",
           "ARCHIVE_OVERHEAD", "MAX_DOWNLOAD_BYTES"]

_CHUNK = 1 << 20
_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}

# The most an archive adds to the n bytes it holds: deflate's worst case on incompressible data
# (zlib's deflateBound: about n/4096 + n/16384, 31 KB for enwik8's 10^8 bytes) plus the zip's
# headers, names, extra fields and comment (each under 64 KB). A download of a corpus of n bytes
# is refused past n + this.
ARCHIVE_OVERHEAD = 1 << 20
# download()'s default bound: enwik8 (data.ENWIK8_SIZE, 10^8 bytes), the corpus this module
# downloads, in a zip, even one that stores it uncompressed (the real enwik8.zip is 36 MB).
MAX_DOWNLOAD_BYTES = 100_000_000 + ARCHIVE_OVERHEAD
# A temporary of a download that no process holds is stale once its last write is this old. A
# live download holds an exclusive flock on its temporary from its first byte to its last; the
# age covers the instants around that (between creating the file and locking it, between closing
# it and renaming it into place), whose mtime is always fresh.
STALE_TEMP_AGE_S = 60.0


class DataError(Exception):
    """Clear, one-line, user-facing error (the CLI prints it and exits 2)."""


# --------------------------------------------------------------------------- reading


def read_corpus(path, *, max_size: int | None = None) -> bytes:
    """Return the raw bytes of a ``.zip``, ``.gz``, ``.bz2``, ``.xz`` or plain file.

    A zip must hold one file, or one member named like the archive's stem (``enwik8`` in
    ``enwik8.zip``). The format is chosen by suffix (case-insensitive). The file is read in
    chunks; with ``max_size``, one that holds more than ``max_size`` bytes (once decompressed)
    raises :class:`DataError` as soon as it passes the limit (a zip member that declares more,
    before inflating anything), so memory never grows past the limit and a chunk.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    try:
        with contextlib.ExitStack() as stack:
            if suffix == ".zip":
                f = _open_zip_member(path, stack, max_size)
            else:
                f = stack.enter_context(_OPENERS.get(suffix, open)(path, "rb"))
            return _read_at_most(f, max_size, path)
    except (zipfile.BadZipFile, zlib.error, lzma.LZMAError, EOFError, OSError) as e:
        raise DataError(f"cannot read {path}: {e} (corrupt or truncated file?)") from None
    except (RuntimeError, NotImplementedError) as e:  # zipfile: encrypted, unknown compression
        raise DataError(f"cannot read {path}: {e}") from None


def _open_zip_member(path: Path, stack: contextlib.ExitStack, max_size: int | None):
    zf = stack.enter_context(zipfile.ZipFile(path))
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
    member = members[0]
    if max_size is not None and member.file_size > max_size:  # zipfile stops at the declared size
        raise DataError(f"{member.filename} in {path} declares {member.file_size} bytes, more than "
                        f"the {max_size} expected (wrong or hostile file?)")
    return stack.enter_context(zf.open(member))


def _read_at_most(f, max_size: int | None, path: Path) -> bytes:
    """Read ``f`` to its end in chunks, refusing it once past ``max_size`` bytes. (A BytesIO's
    getvalue hands over its buffer without a copy: the corpus is in memory once.)"""
    buf = io.BytesIO()
    while chunk := f.read(_CHUNK):
        if max_size is not None and buf.tell() + len(chunk) > max_size:
            raise DataError(f"{path} decompresses to more than the {max_size} bytes expected "
                            f"(wrong or hostile file?)")
        buf.write(chunk)
    return buf.getvalue()


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
             max_bytes: int = MAX_DOWNLOAD_BYTES, timeout: float = 60.0) -> Path:
    """Stream ``url`` to ``dest`` atomically, checking the body's length and the file's size
    and md5.

    At most ``max_bytes`` (``size`` if smaller) are accepted: a declared Content-Length above
    that is refused before anything is written, and a body that grows past it is cut off and
    refused. A body shorter than its declared Content-Length is refused too. The bytes go to a
    temporary file beside ``dest`` (``.<name>.<random>.tmp``, flock-ed while the download
    lives), which is moved into place only after every check passes. On any failure (HTTP
    status, connection, bound, length, mismatch, Ctrl-C) the temporary file is removed,
    ``dest`` is left untouched, and folders this call created for ``dest`` are removed again
    if still empty; network and check failures raise :class:`DataError`,
    ``KeyboardInterrupt`` propagates as is. First, temporaries of ``dest`` left by a killed
    download are removed (:func:`remove_stale_temps`).
    """
    dest = Path(dest)
    limit = max_bytes if size is None else min(size, max_bytes)
    remove_stale_temps(dest)
    created = _missing_dirs(dest.parent)
    try:
        _download(url, dest, limit, md5, size, timeout)
    except BaseException:
        _remove_if_empty(created)
        raise
    return dest


def _download(url: str, dest: Path, limit: int, md5: str | None, size: int | None,
              timeout: float) -> None:
    def fetch(f) -> None:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # live: remove_stale_temps leaves it alone
        got_size, got_md5 = _stream(resp, f, url, limit, declared)
        if size is not None and got_size != size:
            raise DataError(f"download of {url} failed: got {got_size} bytes, "
                            f"expected {size} (truncated?)")
        if md5 is not None and got_md5 != md5.lower():
            raise DataError(f"checksum mismatch for {url}: md5 got {got_md5}, expected {md5}")

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            declared = _declared_length(resp, url)
            if declared is not None and declared > limit:
                raise DataError(f"download of {url} refused: the server declares {declared} "
                                f"bytes, more than the {limit} the file can be")
            print(f"downloading {url} -> {dest}", file=sys.stderr)
            atomic_write(dest, fetch)
    except urllib.error.HTTPError as e:
        raise DataError(f"download of {url} failed: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise DataError(f"download of {url} failed: {e.reason}") from None
    except (OSError, http.client.HTTPException) as e:
        raise DataError(f"download of {url} failed: {type(e).__name__}: {e}") from None


def _declared_length(resp, url: str) -> int | None:
    """The response's Content-Length as an int, None if it has none; malformed: DataError."""
    value = resp.headers.get("Content-Length")
    if value is None:
        return None
    if not re.fullmatch(r"\s*[0-9]+\s*", value):
        raise DataError(f"download of {url} failed: malformed Content-Length {value!r}")
    return int(value)


def _stream(resp, f, url: str, limit: int, declared: int | None) -> tuple[int, str]:
    """Copy the body of ``resp`` into ``f``, at most ``limit`` bytes and exactly ``declared``
    if the server declared a length; return (bytes written, md5 hex)."""
    digest, written = hashlib.md5(usedforsecurity=False), 0
    bar = _progress_bar(declared, Path(url).name)
    try:
        while chunk := resp.read(min(_CHUNK, limit + 1 - written)):
            written += len(chunk)
            if written > limit:
                raise DataError(f"download of {url} refused: the body passes {limit} bytes, "
                                f"more than the file can be")
            f.write(chunk)
            digest.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    if declared is not None and written != declared:  # http.client ends a cut body silently
        raise DataError(f"download of {url} failed: got {written} of the {declared} bytes "
                        f"declared (connection cut?)")
    return written, digest.hexdigest()


def remove_stale_temps(dest) -> list[Path]:
    """Remove the temporaries of ``dest`` (``.<name>.<8 random>.tmp`` beside it) that no live
    download holds, and return them.

    A download holds an exclusive ``flock`` on its temporary while it writes, and the kernel
    drops it when the process dies, even by ``kill -9``: a temporary whose lock can be taken and
    whose last write is over :data:`STALE_TEMP_AGE_S` old was left by a dead download. A
    concurrent download's temporary is never removed; symlinks, folders and other names are
    never touched, and an unreadable folder is skipped without a word.
    """
    dest = Path(dest)
    pattern = re.compile(re.escape(f".{dest.name}.") + r"[a-z0-9_]{8}" + re.escape(TMP_SUFFIX))
    try:
        entries = [e for e in os.scandir(dest.parent) if pattern.fullmatch(e.name)]
    except OSError:
        return []
    removed = []
    for entry in entries:
        path = Path(entry.path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone, a symlink, unreadable
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live download's
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime > STALE_TEMP_AGE_S \
                    and os.stat(path, follow_symlinks=False).st_ino == st.st_ino:
                path.unlink()
                removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _missing_dirs(folder: Path) -> list[Path]:
    """The folders from ``folder`` up that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_if_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) while they are empty: a folder holding anything, or
    one that is not a folder, stops it."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _progress_bar(total: int | None, desc: str):
    """A tqdm bar if tqdm is installed and stderr is a terminal, else None."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=None)
