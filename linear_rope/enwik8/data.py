"""Byte-level data: enwik8 or any other corpus split 90/5/5 and cached, batches, eval windows.

Data lands on disk as three flat ``uint8`` files per corpus (nanoGPT style), in a cache folder
that is never the working directory unless asked (:func:`cache_dir`: ``$LINEAR_ROPE_CACHE``, else
``$XDG_CACHE_HOME/linear_rope``, else ``~/.cache/linear_rope``; ``--data-dir`` picks another)::

    <cache>/enwik8.zip                             # the download, kept: it is fetched once
    <cache>/enwik8/{train,valid,test}.bin          # 90M / 5M / 5M bytes
    <cache>/<stem>-<sha256[:10]>/{train,valid,test}.bin

and is read back with :func:`load_split` as a read-only ``np.memmap``. Training draws
random crops with :func:`get_batch` from a dedicated ``torch.Generator``; evaluation walks
the whole split once with :func:`eval_batches`, so BPC is
``summed nats / count_eval_bytes(split) / ln 2``.

The raw bytes come from :mod:`linear_rope.enwik8.fetch` (read a compressed file, download, verify).
Every file is written with :func:`linear_rope.enwik8.files.atomic_write`, so an interrupted run
never leaves a truncated download or split behind.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from .fetch import (ARCHIVE_OVERHEAD, DataError, _missing_dirs, _remove_if_empty, download,
                    read_corpus, remove_stale_temps, verify_bytes)
from .files import atomic_write

__all__ = [
    "ENWIK8_URL", "ENWIK8_SIZE", "ENWIK8_MD5", "SPLITS", "CACHE_ENV", "DataError", "cache_dir",
    "read_corpus", "download", "verify_bytes", "split_sizes", "split_bytes",
    "prepare_enwik8", "prepare_corpus", "load_split", "draw_starts", "crops", "get_batch",
    "eval_batches",
    "count_eval_bytes", "corpus_digest",
]

ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
ENWIK8_SIZE = 100_000_000
ENWIK8_MD5 = "a1fa5ffddb56f4953e226637dabbb36a"  # of the decompressed 100 MB file
SPLITS = ("train", "valid", "test")
CACHE_ENV = "LINEAR_ROPE_CACHE"  # the cache folder, if set (else the XDG one)
FRACTIONS = (0.9, 0.05, 0.05)
MIN_SPLIT_BYTES = 2  # a split needs at least one (input, target) pair


# --------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Where downloads and splits are cached when no folder is given: ``$LINEAR_ROPE_CACHE`` if
    set, else ``$XDG_CACHE_HOME/linear_rope`` (an absolute ``XDG_CACHE_HOME`` only, as the XDG
    spec says), else ``~/.cache/linear_rope``. Never the working directory unless one of these
    names it."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "linear_rope"


# --------------------------------------------------------------------------- splitting


def split_sizes(n: int, fractions=FRACTIONS) -> tuple[int, ...]:
    """Byte counts of each split of an ``n``-byte corpus.

    Every split but the last gets ``floor(n * fraction)``; the last gets the rest. Fractions
    are read as exact decimals (0.9 is 9/10), so ``n = 10**8`` gives exactly 90M/5M/5M.
    """
    exact = [Fraction(f).limit_denominator(10**6) for f in fractions]
    if any(f <= 0 for f in exact) or sum(exact) != 1:
        raise ValueError(f"split fractions must be positive and sum to 1, got {fractions}")
    head = [n * f.numerator // f.denominator for f in exact[:-1]]
    return (*head, n - sum(head))


def split_bytes(raw: bytes, fractions=FRACTIONS) -> dict[str, bytes]:
    """Split ``raw`` in order into ``{"train", "valid", "test"}`` by :func:`split_sizes`."""
    sizes = split_sizes(len(raw), fractions)
    for name, k in zip(SPLITS, sizes):
        if k < MIN_SPLIT_BYTES:
            raise DataError(f"corpus of {len(raw)} bytes is too small to split "
                            f"{'/'.join(f'{f:g}' for f in fractions)}: {name} would have "
                            f"{k} bytes (need at least {MIN_SPLIT_BYTES})")
    parts, start = {}, 0
    for name, k in zip(SPLITS, sizes):
        parts[name] = raw[start:start + k]
        start += k
    return parts


# --------------------------------------------------------------------------- preparing


def prepare_enwik8(data_dir=None, *, source=None, url: str = ENWIK8_URL,
                   md5: str | None = ENWIK8_MD5, size: int | None = ENWIK8_SIZE,
                   ) -> dict[str, Path]:
    """Make ``data_dir/enwik8/{train,valid,test}.bin`` (90M/5M/5M) and return their paths
    (``data_dir`` None: :func:`cache_dir`).

    A complete set of ``.bin`` files with the expected sizes is reused. Otherwise the raw
    bytes come from ``source`` (a local .zip/.gz/.bz2/raw file) if given, else from
    ``data_dir/enwik8.zip``, which is downloaded from ``url`` first if absent and kept so
    re-runs do not download again. The *decompressed* bytes must match ``size`` and
    ``md5`` (of the raw 100 MB file); if not, no ``.bin`` file is written and a zip
    downloaded by this call is deleted again, with the folders the download created.

    Bounds, since the download is plain http: it is refused past ``size`` plus
    :data:`~linear_rope.enwik8.fetch.ARCHIVE_OVERHEAD` (``size`` None: enwik8's), and the
    archive is decompressed in chunks and refused once past ``size`` bytes, so a small file
    that inflates far beyond it costs no more memory than ``size``. Temporaries of
    ``enwik8.zip`` left by a killed download are removed (``fetch.remove_stale_temps``).
    """
    data_dir = cache_dir() if data_dir is None else Path(data_dir)
    out_dir = data_dir / "enwik8"
    zip_path = data_dir / "enwik8.zip"
    remove_stale_temps(zip_path)
    paths = _split_paths(out_dir)
    if _complete(paths, None if size is None else split_sizes(size)):
        return paths
    most = ENWIK8_SIZE if size is None else size  # what the decompressed corpus can be
    fresh = source is None and not zip_path.exists()
    created = _missing_dirs(data_dir) if fresh else []
    if fresh:
        try:
            download(url, zip_path, max_bytes=most + ARCHIVE_OVERHEAD)
        except DataError as e:  # offline, most often: say what to do instead
            raise DataError(f"could not fetch enwik8 ({e}); without internet, pass --data PATH to "
                            f"train on any byte corpus you have, or copy enwik8.zip into "
                            f"{data_dir}/") from None
    source = zip_path if source is None else Path(source)
    try:
        raw = read_corpus(source, max_size=most)
        verify_bytes(raw, size=size, md5=md5, name=f"enwik8 from {source}")
    except DataError as e:
        if fresh:
            zip_path.unlink(missing_ok=True)  # never cache a download that fails verification
            _remove_if_empty(created)
        elif source == zip_path:
            raise DataError(f"{e}; delete {zip_path} to download it again") from None
        raise
    _write_splits(paths, split_bytes(raw))
    return paths


def prepare_corpus(path, data_dir=None) -> dict[str, Path]:
    """Split any byte corpus 90/5/5 (no checksum) and return the ``.bin`` paths; ``path`` None:
    enwik8's (:func:`prepare_enwik8`), as ``--data`` not given means.

    Files are cached under ``data_dir/<stem>-<sha256[:10]>/`` (``data_dir`` None:
    :func:`cache_dir`) where the hash is of the decompressed bytes, so a changed corpus never
    reuses stale splits.
    """
    if path is None:
        return prepare_enwik8(data_dir)
    raw = read_corpus(path)
    sizes = split_sizes(len(raw))
    tag = hashlib.sha256(raw).hexdigest()[:10]
    data_dir = cache_dir() if data_dir is None else Path(data_dir)
    paths = _split_paths(data_dir / f"{_safe_stem(path)}-{tag}")
    if not _complete(paths, sizes):
        _write_splits(paths, split_bytes(raw))
    return paths


def _safe_stem(path) -> str:
    """``enwiki-sample.xml.bz2`` -> ``enwiki-sample``; odd characters become ``_``."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", Path(path).name.split(".")[0]).strip("_")
    return stem or "corpus"


def _split_paths(out_dir: Path) -> dict[str, Path]:
    return {name: out_dir / f"{name}.bin" for name in SPLITS}


def _complete(paths: dict[str, Path], sizes) -> bool:
    """All split files exist and, if ``sizes`` is given, have exactly those byte counts."""
    if not all(p.is_file() for p in paths.values()):
        return False
    return sizes is None or all(p.stat().st_size == k for p, k in zip(paths.values(), sizes))


def _write_splits(paths: dict[str, Path], parts: dict[str, bytes]) -> None:
    for name, path in paths.items():
        atomic_write(path, parts[name])


# --------------------------------------------------------------------------- batches


def load_split(path) -> np.memmap:
    """Open a ``.bin`` split as a read-only ``uint8`` memmap of shape ``[N]``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    if path.stat().st_size == 0:
        raise DataError(f"data file is empty: {path}")
    return np.memmap(path, dtype=np.uint8, mode="r")


def draw_starts(data, count: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` crop starts drawn uniformly from ``[0, len(data) - seq_len)``: int64 `[count]`.

    Only ``generator`` is consumed, never the global RNG, so a seed fixes the data stream
    regardless of what the model draws. Training draws one global batch of starts per step
    (``world * grad_accum * batch_size``) and each rank and micro-step takes its own slice, so
    ranks see distinct crops and the global batch does not depend on how it is split.
    """
    data = _as_array(data)
    if count < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {count}, {seq_len}")
    if len(data) < seq_len + 1:
        raise DataError(f"split of {len(data)} bytes is too short for seq_len={seq_len} "
                        f"(needs at least {seq_len + 1})")
    return torch.randint(len(data) - seq_len, (count,), generator=generator)


def crops(data, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x, y`` int64 `[len(starts), seq_len]`: ``x = data[s:s + seq_len]``, ``y`` shifted by one."""
    data = _as_array(data)
    idx = starts.numpy()[:, None] + np.arange(seq_len + 1)  # (B, T+1)
    window = torch.from_numpy(data[idx].astype(np.int64))
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def get_batch(data, batch_size: int, seq_len: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random crops (nanoGPT style): ``x, y`` int64 of shape `[B, seq_len]`.

    ``crops(data, draw_starts(data, batch_size, seq_len, generator), seq_len)``.
    """
    return crops(data, draw_starts(data, batch_size, seq_len, generator), seq_len)


def eval_batches(data, seq_len: int,
                 batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, non-overlapping windows that predict every byte of ``data[1:]`` exactly once.

    Windows start at ``0, seq_len, 2 * seq_len, ...``; full windows come ``batch_size`` at a
    time as int64 `[b, seq_len]` pairs, and a final shorter window of ``r`` targets comes
    alone as `[1, r]`. Each window starts without context, as in the usual enwik8 protocol
    with non-overlapping windows.
    """
    data = _as_array(data)
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    n_pred = count_eval_bytes(data)
    n_full = n_pred // seq_len
    for first in range(0, n_full, batch_size):
        b = min(batch_size, n_full - first)
        chunk = torch.from_numpy(
            data[first * seq_len:(first + b) * seq_len + 1].astype(np.int64))
        yield chunk[:-1].view(b, seq_len), chunk[1:].view(b, seq_len)
    start = n_full * seq_len
    if start < n_pred:
        chunk = torch.from_numpy(data[start:].astype(np.int64))
        yield chunk[:-1].view(1, -1), chunk[1:].view(1, -1)


def corpus_digest(splits: dict) -> dict:
    """``{"sha256", "bytes"}`` of the corpus the splits were cut from: the sha256 of train, valid
    and test in order, which is the sha256 of the corpus's bytes (``prepare_corpus``'s cache
    folder is named by its first 10 hex digits). A resume compares it, not the --data path."""
    h, n = hashlib.sha256(), 0
    for name in SPLITS:
        part = np.ascontiguousarray(_as_array(splits[name]))
        h.update(part)
        n += len(part)
    return {"sha256": h.hexdigest(), "bytes": n}


def count_eval_bytes(data) -> int:
    """Number of predicted bytes in a split: ``len(data) - 1``, the BPC denominator."""
    return max(len(data) - 1, 0)


def _as_array(data) -> np.ndarray:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    return data
