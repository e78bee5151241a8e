"""Tests for linear_rope.enwik8.data: reading, download, verification, splits, batches, eval windows.

Network access is confined to a throwaway HTTP server on 127.0.0.1; every file goes under
pytest's ``tmp_path``.
"""

import bz2
import contextlib
import gzip
import hashlib
import http.server
import socket
import threading
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from linear_rope.enwik8 import data
from linear_rope.enwik8.data import DataError

from fixtures.wikitext import wiki_text

# 400 KB of generated Wikipedia-like text (tests/fixtures/wikitext.py), the same on every machine
WIKI_SIZE = 400_000
WIKI_SHA256 = "24eb2dcd82d384def45ec97ac3b1e2c727d136d14f35ef04c8a7d918445fa429"


def _corpus(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _md5(raw: bytes) -> str:
    return hashlib.md5(raw).hexdigest()


def _write_zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, payload in members.items():
            zf.writestr(name, payload)
    return path


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/enwik8.zip"


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    """Keep urllib off any proxy configured in the environment: only loopback is used."""
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


# --------------------------------------------------------------------------- local server


class _Handler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/error500"):
            self.send_error(500, "Internal Server Error")
        else:
            super().do_GET()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(served: Path, handler_class=_Handler):
    """Serve the folder ``served`` over HTTP on 127.0.0.1 with ``handler_class``; yields the
    base URL (tests/test_download.py serves its hostile answers through this too)."""
    def handler(*args, **kwargs):
        return handler_class(*args, directory=str(served), **kwargs)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.fixture
def server(tmp_path):
    """Serve ``tmp_path/served`` over HTTP on 127.0.0.1; yields (base_url, served_dir)."""
    served = tmp_path / "served"
    served.mkdir()
    with serve(served) as base:
        yield base, served


@pytest.fixture
def fake_enwik8(server):
    """A 2000-byte stand-in for enwik8, served as ``enwik8.zip``; yields (url, raw)."""
    base, served = server
    raw = _corpus(2000, seed=8)
    _write_zip(served / "enwik8.zip", {"enwik8": raw})
    return f"{base}/enwik8.zip", raw


# --------------------------------------------------------------------------- splits


@pytest.mark.parametrize("n, expected", [
    (100, (90, 5, 5)),
    (1000, (900, 50, 50)),
    (1001, (900, 50, 51)),
    (100_000_000, (90_000_000, 5_000_000, 5_000_000)),
    (6_089_746, (5_480_771, 304_487, 304_488)),  # the 2016 Wikipedia sample (README)
], ids=["100", "1000", "1001", "enwik8", "sample"])
def test_split_sizes(n, expected):
    assert data.split_sizes(n) == expected
    assert sum(expected) == n


@pytest.mark.parametrize("n", [100, 1000])
def test_split_bytes_in_order(n):
    raw = _corpus(n, seed=n)
    parts = data.split_bytes(raw)
    assert tuple(parts) == data.SPLITS
    assert tuple(len(p) for p in parts.values()) == data.split_sizes(n)
    assert b"".join(parts.values()) == raw


@pytest.mark.parametrize("n", [0, 1, 10, 39])
def test_split_bytes_too_small(n):
    with pytest.raises(DataError, match="too small"):
        data.split_bytes(bytes(n))


def test_split_sizes_rejects_bad_fractions():
    with pytest.raises(ValueError):
        data.split_sizes(100, (0.9, 0.2, 0.05))


# --------------------------------------------------------------------------- reading


@pytest.mark.parametrize("suffix", ["", ".bin", ".gz", ".bz2", ".xz", ".zip"])
def test_read_corpus_round_trip(tmp_path, suffix):
    raw = _corpus(3000, seed=1)
    path = tmp_path / f"corpus{suffix}"
    if suffix == ".zip":
        _write_zip(path, {"inner/corpus.txt": raw})
    elif suffix in (".gz", ".bz2", ".xz"):
        import lzma
        opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[suffix]
        with opener(path, "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)
    assert data.read_corpus(path) == raw
    assert data.read_corpus(str(path)) == raw


def test_read_zip_picks_member_named_like_stem(tmp_path):
    raw = _corpus(500, seed=2)
    path = _write_zip(tmp_path / "enwik8.zip", {"README": b"hello", "enwik8": raw})
    assert data.read_corpus(path) == raw


def test_read_zip_ambiguous_or_empty(tmp_path):
    path = _write_zip(tmp_path / "corpus.zip", {"a": b"1", "b": b"2"})
    with pytest.raises(DataError, match="several members"):
        data.read_corpus(path)
    empty = _write_zip(tmp_path / "empty.zip", {})
    with pytest.raises(DataError, match="empty"):
        data.read_corpus(empty)


def test_read_corpus_missing(tmp_path):
    missing = tmp_path / "nope.bz2"
    with pytest.raises(DataError, match="data file not found") as info:
        data.read_corpus(missing)
    assert str(missing) in str(info.value)


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".zip"])
def test_read_corpus_corrupt(tmp_path, suffix):
    path = tmp_path / f"corpus{suffix}"
    path.write_bytes(b"this is not an archive at all" * 10)
    with pytest.raises(DataError) as info:
        data.read_corpus(path)
    assert str(path) in str(info.value)


def test_read_corpus_truncated_gzip(tmp_path):
    path = tmp_path / "corpus.gz"
    path.write_bytes(gzip.compress(_corpus(5000, seed=3))[:-100])
    with pytest.raises(DataError, match="corpus.gz"):
        data.read_corpus(path)


def test_verify_bytes():
    raw = b"abc" * 10
    data.verify_bytes(raw, size=30, md5=_md5(raw))
    with pytest.raises(DataError, match="enwik8 has 30 bytes, expected 31"):
        data.verify_bytes(raw, size=31, name="enwik8")
    with pytest.raises(DataError, match="md5"):
        data.verify_bytes(raw, md5="0" * 32)


# --------------------------------------------------------------------------- a text archive


def test_generated_text_is_fixed_and_compresses_like_text():
    """The stand-in for real text is the same bytes everywhere (the sha256 pins the generator) and
    is no repeated sentence: bz2 keeps a quarter of it, as of English Wikipedia XML (28%)."""
    raw = wiki_text(WIKI_SIZE)
    assert len(raw) == WIKI_SIZE and hashlib.sha256(raw).hexdigest() == WIKI_SHA256
    assert wiki_text(1 << 16) == raw[:1 << 16]  # the training tests' 64 KB is its head
    assert 0.2 < len(bz2.compress(raw)) / len(raw) < 0.35
    assert 0.3 < len(gzip.compress(raw)) / len(raw) < 0.4
    assert raw.startswith(b"<mediawiki") and raw.count(b"<page>") > 50


def test_prepare_corpus_on_a_bz2_text_archive(tmp_path):
    src = tmp_path / "wiki-like.xml.bz2"
    src.write_bytes(bz2.compress(wiki_text(WIKI_SIZE)))
    paths = data.prepare_corpus(src, tmp_path / "data")
    assert tuple(paths) == data.SPLITS
    assert paths["train"].parent.name == f"wiki-like-{WIKI_SHA256[:10]}"
    sizes = tuple(p.stat().st_size for p in paths.values())
    assert sizes == (360_000, 20_000, 20_000)
    joined = b"".join(p.read_bytes() for p in paths.values())
    assert hashlib.sha256(joined).hexdigest() == WIKI_SHA256

    mtimes = [p.stat().st_mtime_ns for p in paths.values()]
    again = data.prepare_corpus(src, tmp_path / "data")
    assert again == paths
    assert [p.stat().st_mtime_ns for p in again.values()] == mtimes


def test_prepare_corpus_small_and_too_small(tmp_path):
    raw = _corpus(1000, seed=4)
    src = tmp_path / "my corpus.txt"
    src.write_bytes(raw)
    paths = data.prepare_corpus(src, tmp_path / "data")
    assert paths["valid"].parent.name.startswith("my_corpus-")
    assert [p.read_bytes() for p in paths.values()] == list(data.split_bytes(raw).values())

    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"x" * 20)
    with pytest.raises(DataError, match="too small"):
        data.prepare_corpus(tiny, tmp_path / "data2")
    assert not (tmp_path / "data2").exists()


# --------------------------------------------------------------------------- enwik8 pipeline


def test_prepare_enwik8_download_success(tmp_path, fake_enwik8):
    url, raw = fake_enwik8
    data_dir = tmp_path / "data"
    paths = data.prepare_enwik8(data_dir, url=url, md5=_md5(raw), size=len(raw))
    assert paths == {s: data_dir / "enwik8" / f"{s}.bin" for s in data.SPLITS}
    assert [p.stat().st_size for p in paths.values()] == [1800, 100, 100]
    assert b"".join(p.read_bytes() for p in paths.values()) == raw
    assert (data_dir / "enwik8.zip").is_file()  # kept so re-runs do not download again
    assert _listing(data_dir) == ["enwik8", "enwik8.zip", "enwik8/test.bin",
                                  "enwik8/train.bin", "enwik8/valid.bin"]

    split = data.load_split(paths["valid"])
    assert split.dtype == np.uint8 and split.mode == "r" and len(split) == 100
    assert split.tobytes() == raw[1800:1900]


def test_cache_dir_is_never_the_working_directory_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(data.CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert data.cache_dir() == tmp_path / "home/.cache/linear_rope"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not absolute: ignored, as the XDG spec says
    assert data.cache_dir() == tmp_path / "home/.cache/linear_rope"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.cache_dir() == tmp_path / "xdg/linear_rope"
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "mine"))
    assert data.cache_dir() == tmp_path / "mine"
    raw = _corpus(1000, seed=3)
    (tmp_path / "c.txt").write_bytes(raw)
    assert data.prepare_corpus(tmp_path / "c.txt")["train"].parent.parent == tmp_path / "mine"


def test_prepare_corpus_without_a_path_is_enwik8(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(data, "prepare_enwik8", lambda data_dir=None: calls.append(data_dir) or {})
    assert data.prepare_corpus(None, tmp_path) == {} and calls == [tmp_path]


def test_the_plain_command_downloads_enwik8_once_into_the_cache(tmp_path, server, monkeypatch):
    """The README's first run, as a fresh machine runs it (no --data, no --data-dir, from any
    folder): enwik8 is fetched into the cache, checked, split and trained on; the folder the
    command runs in gets its --out and nothing else, and a second run fetches nothing."""
    import functools

    from helpers import run_main

    base, served = server
    raw = wiki_text(1 << 16)  # a 64 KB stand-in for enwik8, with its own size and md5
    _write_zip(served / "enwik8.zip", {"enwik8": raw})
    monkeypatch.setattr(data, "prepare_enwik8", functools.partial(
        data.prepare_enwik8, url=f"{base}/enwik8.zip", md5=_md5(raw), size=len(raw)))
    cache, work = tmp_path / "cache", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv(data.CACHE_ENV, str(cache))
    monkeypatch.chdir(work)
    argv = ["--preset", "tiny", "--variants", "rope", "--steps", "2", "--eval-every", "0"]
    code, out, err = run_main([*argv, "--out", "runs/first"])
    assert code == 0, err
    assert f"-> {cache / 'enwik8.zip'}" in err and "test bpc" in out
    assert sorted(p.name for p in work.iterdir()) == ["runs"]
    assert _listing(cache) == ["enwik8", "enwik8.zip", "enwik8/test.bin", "enwik8/train.bin", "enwik8/valid.bin"]
    (served / "enwik8.zip").unlink()  # the server has nothing now: the cache serves the second run
    code, _, err = run_main([*argv, "--out", "runs/second"])
    assert code == 0 and "downloading" not in err, err


def test_prepare_enwik8_reuses_zip_and_rebuilds_bad_bins(tmp_path, fake_enwik8):
    url, raw = fake_enwik8
    data_dir = tmp_path / "data"
    paths = data.prepare_enwik8(data_dir, url=url, md5=_md5(raw), size=len(raw))
    paths["test"].write_bytes(b"short")  # an inconsistent set is rebuilt from the kept zip
    again = data.prepare_enwik8(data_dir, url=_closed_port_url(), md5=_md5(raw), size=len(raw))
    assert again["test"].read_bytes() == raw[1900:]


def test_prepare_enwik8_existing_bins_need_no_network(tmp_path):
    raw = _corpus(2000, seed=5)
    out = tmp_path / "data" / "enwik8"
    out.mkdir(parents=True)
    for name, part in data.split_bytes(raw).items():
        (out / f"{name}.bin").write_bytes(part)
    paths = data.prepare_enwik8(tmp_path / "data", url=_closed_port_url(), md5="0" * 32,
                                size=len(raw))
    assert [p.read_bytes() for p in paths.values()] == list(data.split_bytes(raw).values())


def test_prepare_enwik8_closed_port_is_data_error(tmp_path):
    with pytest.raises(DataError, match="download of .* failed"):
        data.prepare_enwik8(tmp_path / "data", url=_closed_port_url(), size=2000)
    assert _listing(tmp_path / "data") == []


def test_prepare_enwik8_checksum_mismatch_leaves_nothing(tmp_path, fake_enwik8):
    url, raw = fake_enwik8
    data_dir = tmp_path / "data"
    with pytest.raises(DataError, match="checksum mismatch.*md5"):
        data.prepare_enwik8(data_dir, url=url, md5="0" * 32, size=len(raw))
    assert _listing(data_dir) == []  # no .bin, no temp file, and the bad download is not kept


def test_prepare_enwik8_bad_cached_zip_is_kept_with_hint(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    _write_zip(data_dir / "enwik8.zip", {"enwik8": _corpus(1000, seed=9)})
    with pytest.raises(DataError, match="1000 bytes, expected 2000.*delete .*enwik8.zip"):
        data.prepare_enwik8(data_dir, url=_closed_port_url(), md5=None, size=2000)
    assert _listing(data_dir) == ["enwik8.zip"]  # a file the user put there is never deleted


@pytest.mark.parametrize("path, status", [("/missing.zip", 404), ("/error500", 500)])
def test_prepare_enwik8_http_error_leaves_nothing(tmp_path, server, path, status):
    base, _ = server
    data_dir = tmp_path / "data"
    with pytest.raises(DataError, match=f"HTTP {status}"):
        data.prepare_enwik8(data_dir, url=base + path, md5=None, size=2000)
    assert _listing(data_dir) == []


def test_prepare_enwik8_truncated_source(tmp_path):
    raw = _corpus(2000, seed=6)
    source = tmp_path / "enwik8.gz"
    source.write_bytes(gzip.compress(raw[:1500]))
    data_dir = tmp_path / "data"
    with pytest.raises(DataError, match="1500 bytes, expected 2000"):
        data.prepare_enwik8(data_dir, source=source, url=_closed_port_url(), md5=_md5(raw),
                            size=len(raw))
    assert not data_dir.exists() or _listing(data_dir) == []


def test_download_wrong_md5_leaves_nothing(tmp_path, fake_enwik8):
    url, _ = fake_enwik8
    dest = tmp_path / "dl" / "enwik8.zip"
    with pytest.raises(DataError, match="checksum mismatch.*md5"):
        data.download(url, dest, md5="0" * 32)
    assert not dest.exists()
    assert _listing(dest.parent) == []


def test_download_wrong_size_and_success(tmp_path, fake_enwik8):
    url, _ = fake_enwik8
    dest = tmp_path / "enwik8.zip"
    zip_bytes = (tmp_path / "served" / "enwik8.zip").read_bytes()
    with pytest.raises(DataError, match="bytes, expected"):
        data.download(url, dest, size=len(zip_bytes) + 1)
    assert _listing(tmp_path / "served") == ["enwik8.zip"] and not dest.exists()
    assert data.download(url, dest, md5=_md5(zip_bytes), size=len(zip_bytes)) == dest
    assert dest.read_bytes() == zip_bytes


def test_download_interrupted_leaves_nothing(tmp_path, monkeypatch):
    class Interrupted:
        headers = {}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self, n):
            raise KeyboardInterrupt

    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: Interrupted())
    dest = tmp_path / "dl" / "enwik8.zip"
    with pytest.raises(KeyboardInterrupt):
        data.download("http://127.0.0.1:9/enwik8.zip", dest)
    assert _listing(dest.parent) == []


def test_load_split_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        data.load_split(tmp_path / "train.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        data.load_split(tmp_path / "empty.bin")


# --------------------------------------------------------------------------- batches


@pytest.fixture
def split_file(tmp_path):
    path = tmp_path / "train.bin"
    path.write_bytes(_corpus(1000, seed=7))
    return data.load_split(path)


@pytest.mark.parametrize("batch_size, seq_len", [(1, 1), (4, 16), (3, 999)])
def test_get_batch_shapes_and_shift(split_file, batch_size, seq_len):
    x, y = data.get_batch(split_file, batch_size, seq_len, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (batch_size, seq_len)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    torch.testing.assert_close(x[:, 1:], y[:, :-1], rtol=0, atol=0)
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(split_file), seq_len + 1)
    for row in torch.cat([x[:, :1], y], dim=1).numpy():  # each row is a real crop of the split
        assert (windows == row).all(axis=1).any()


def test_get_batch_seeded_and_isolated(split_file):
    torch.manual_seed(123)
    global_state = torch.get_rng_state()
    a = data.get_batch(split_file, 8, 32, torch.Generator().manual_seed(1))
    b = data.get_batch(split_file, 8, 32, torch.Generator().manual_seed(1))
    c = data.get_batch(split_file, 8, 32, torch.Generator().manual_seed(2))
    assert torch.equal(torch.get_rng_state(), global_state)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_get_batch_too_short():
    with pytest.raises(DataError, match="too short"):
        data.get_batch(np.zeros(16, np.uint8), 2, 16, torch.Generator().manual_seed(0))
    x, _ = data.get_batch(np.arange(17, dtype=np.uint8), 2, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x[0], torch.arange(16))  # exactly seq_len + 1 bytes: one possible crop


@pytest.mark.parametrize("n", [1, 2, 17, 64, 65, 257])
@pytest.mark.parametrize("seq_len", [1, 8, 16])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_eval_batches_cover_every_byte_once(n, seq_len, batch_size):
    arr = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    batches = list(data.eval_batches(arr, seq_len, batch_size))
    assert sum(y.numel() for _, y in batches) == data.count_eval_bytes(arr) == max(n - 1, 0)
    xs, ys = [], []
    for i, (x, y) in enumerate(batches):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape
        if x.shape[1] == seq_len:
            assert 1 <= x.shape[0] <= batch_size
        else:  # the final partial window comes alone
            assert i == len(batches) - 1 and x.shape[0] == 1 and x.shape[1] < seq_len
        xs.append(x.reshape(-1))
        ys.append(y.reshape(-1))
    if n > 1:
        full = torch.from_numpy(arr.astype(np.int64))
        assert torch.equal(torch.cat(xs), full[:-1])
        assert torch.equal(torch.cat(ys), full[1:])
    else:
        assert batches == []


def test_eval_batches_on_memmap(split_file):
    batches = list(data.eval_batches(split_file, 100, 4))
    assert [tuple(y.shape) for _, y in batches] == [(4, 100), (4, 100), (1, 100), (1, 99)]


def test_no_test_reads_a_folder_beside_the_checkout():
    """The tests pass in a fresh clone anywhere: none of them names the data folder that this
    project's own machines keep beside the checkout (real text comes from fixtures/wikitext.py)."""
    needle = "shared" + "/data"
    assert [p.name for p in Path(__file__).parent.rglob("*.py") if needle in p.read_text()] == []
