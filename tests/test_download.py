"""The enwik8 download cannot be turned against its user: a hostile or broken server on
127.0.0.1 (a short body, a huge declared length, an endless body, a small archive that inflates
to hundreds of MB) gets one line and costs neither disk nor memory beyond what the corpus can
be; temporaries a killed download left are removed, a live one's never; a failed download
leaves no folder it created.

The server and the small helpers are tests/test_data.py's.
"""
import bz2
import fcntl
import gzip
import io
import lzma
import os
import threading
import time
import tracemalloc
import zipfile
from pathlib import Path

import pytest

from linear_rope.enwik8 import data, fetch
from linear_rope.enwik8.data import DataError

from test_data import (_Handler, _closed_port_url, _corpus, _listing, _md5, _no_proxy,  # noqa: F401
                       _write_zip, fake_enwik8, serve, server)

CAP = 64 << 20  # the most any endless answer sends: a client without a bound stops here
INFLATED = 384 << 20  # what the archive bombs inflate to (each is about 0.4 MB)


class _Hostile(_Handler):
    """Scripted answers besides the served folder's files:

    /short            declares 100,000 bytes, sends 50,000, closes
    /malformed        declares "1_000" bytes (Python's int() would read 1000), sends 1000
    /huge             declares 10^12 bytes, sends zeros until the client hangs up (or CAP)
    /endless          declares nothing, sends zeros until the client hangs up (or CAP)
    /slow/NAME        serves NAME: half, then the rest once ``release`` is set
    /slow-cut/NAME    serves NAME: half, then closes once ``release`` is set

    Each answer appends the bytes it sent to ``sent`` (a subclass per test holds both).
    """

    release: threading.Event
    sent: list

    def do_GET(self):
        route, _, name = self.path.lstrip("/").partition("/")
        if route == "short":
            self._answer(b"x" * 50_000, declared=100_000)
        elif route == "malformed":
            self._answer(b"x" * 1000, declared="1_000")
        elif route == "huge":
            self._endless(declared=10**12)
        elif route == "endless":
            self._endless(declared=None)
        elif route in ("slow", "slow-cut"):
            body = (Path(self.directory) / name).read_bytes()
            half = len(body) // 2
            self._answer(body[:half], declared=len(body), then=None if route == "slow-cut" else body[half:])
        else:
            super().do_GET()

    def _headers(self, declared):
        self.send_response(200)
        self.send_header("Content-Type", "application/zip")
        if declared is not None:
            self.send_header("Content-Length", str(declared))
        self.end_headers()

    def _answer(self, first: bytes, declared, then: bytes | None = None):
        self._headers(declared)
        sent = 0
        try:
            self.wfile.write(first)
            sent += len(first)
            if self.path.startswith("/slow"):
                self.release.wait(60)
            if then is not None:
                self.wfile.write(then)
                sent += len(then)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            self.close_connection = True
            self.sent.append(sent)

    def _endless(self, declared):
        self._headers(declared)
        sent, block = 0, bytes(1 << 16)
        try:
            while sent < CAP:
                self.wfile.write(block)
                sent += len(block)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            self.close_connection = True
            self.sent.append(sent)


@pytest.fixture
def hostile(tmp_path):
    """(base_url, served_dir, handler class): a server with the scripted answers."""
    served = tmp_path / "served"
    served.mkdir()
    handler = type("Handler", (_Hostile,), {"release": threading.Event(), "sent": []})
    try:
        with serve(served, handler) as base:
            yield base, served, handler
    finally:
        handler.release.set()


def _wait_for(predicate, what: str, timeout: float = 60.0):
    """Poll until ``predicate()`` holds (no timing is asserted: the timeout only ends a hang)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def _one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def _temps(folder, name="enwik8.zip"):
    return sorted(p.name for p in folder.glob(f".{name}.*.tmp"))


def _locked(path) -> bool:
    """Whether another open file holds an flock on ``path`` (as a live download does)."""
    with open(path, "rb") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False


# --------------------------------------------------------------------------- the body's length


def test_a_short_body_is_refused_and_the_destination_is_untouched(tmp_path, hostile):
    """50,000 of 100,000 declared bytes: refused before the rename; an existing file under the
    destination's name keeps its bytes, and a fresh folder is not left behind."""
    base, _, handler = hostile
    dest = tmp_path / "dl" / "enwik8.zip"
    dest.parent.mkdir()
    dest.write_bytes(b"the old file")
    with pytest.raises(DataError) as e:
        data.download(f"{base}/short", dest)
    assert f"download of {base}/short failed: got 50000 of the 100000 bytes declared" in _one_line(e)
    assert dest.read_bytes() == b"the old file" and _listing(dest.parent) == ["enwik8.zip"]
    assert handler.sent == [50_000]

    fresh = tmp_path / "fresh" / "enwik8.zip"
    with pytest.raises(DataError, match="got 50000 of the 100000 bytes"):
        data.download(f"{base}/short", fresh)
    assert not fresh.parent.exists()


# --------------------------------------------------------------------------- the bound


def test_the_bound_is_enwik8_in_an_archive():
    """The default bound is enwik8's 10^8 bytes plus an archive's overhead, and that overhead
    covers a real zip of incompressible bytes scaled to enwik8's size (deflate's worst case)."""
    assert fetch.MAX_DOWNLOAD_BYTES == data.ENWIK8_SIZE + fetch.ARCHIVE_OVERHEAD
    n = 1 << 22
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("enwik8", _corpus(n, seed=11))
    growth = len(buf.getvalue()) - n
    assert 0 < growth * data.ENWIK8_SIZE / n < fetch.ARCHIVE_OVERHEAD / 4


def test_a_declared_length_above_the_bound_is_refused_before_anything_is_written(tmp_path, hostile):
    """A declared Content-Length of 10^12 is refused on the headers, with the default bound
    (enwik8's) and with prepare_enwik8's (the corpus's size plus an archive's overhead): one line
    naming the URL, no folder, no temporary, and the client hangs up at once."""
    base, _, handler = hostile
    url = f"{base}/huge"
    dest = tmp_path / "dl" / "enwik8.zip"
    with pytest.raises(DataError) as e:
        data.download(url, dest)
    assert (f"download of {url} refused: the server declares 1000000000000 bytes, more than the "
            f"{fetch.MAX_DOWNLOAD_BYTES}") in _one_line(e)
    assert not dest.parent.exists()

    data_dir = tmp_path / "cache"
    with pytest.raises(DataError) as e:
        data.prepare_enwik8(data_dir, url=url, md5=None, size=2000)
    assert f"more than the {2000 + fetch.ARCHIVE_OVERHEAD} the file can be" in _one_line(e)
    assert not data_dir.exists()
    _wait_for(lambda: len(handler.sent) == 2, "the server to see the client hang up")
    assert max(handler.sent) < CAP // 2


@pytest.mark.parametrize("how", ["download", "prepare_enwik8"])
def test_a_body_growing_past_the_bound_is_cut_off(tmp_path, hostile, how):
    """A body with no declared length that never ends is cut off one byte past the bound and
    refused; nothing stays on disk and the server sees the client hang up long before CAP."""
    base, _, handler = hostile
    url = f"{base}/endless"
    if how == "download":
        limit, dest = 100_000, tmp_path / "dl" / "enwik8.zip"
        with pytest.raises(DataError) as e:
            data.download(url, dest, max_bytes=limit)
        folder = dest.parent
    else:
        limit, folder = 2000 + fetch.ARCHIVE_OVERHEAD, tmp_path / "cache"
        with pytest.raises(DataError) as e:
            data.prepare_enwik8(folder, url=url, md5=None, size=2000)
    assert f"download of {url} refused: the body passes {limit} bytes" in _one_line(e)
    assert not folder.exists()
    _wait_for(lambda: handler.sent, "the server to see the client hang up")
    assert handler.sent[0] < CAP // 2


def test_a_length_above_size_or_a_malformed_one_is_refused_up_front(tmp_path, hostile):
    """``size`` bounds the download too; a Content-Length that is not digits is refused (one
    line naming the URL and the header) rather than read the way int() reads it."""
    base, served, _ = hostile
    url = f"{base}/enwik8.zip"
    _write_zip(served / "enwik8.zip", {"enwik8": _corpus(2000, seed=8)})
    zip_size = (served / "enwik8.zip").stat().st_size
    dest = tmp_path / "dl" / "enwik8.zip"
    with pytest.raises(DataError, match=f"declares {zip_size} bytes, more than the {zip_size - 1} "):
        data.download(url, dest, size=zip_size - 1)
    with pytest.raises(DataError) as e:
        data.download(f"{base}/malformed", dest)
    assert f"download of {base}/malformed failed: malformed Content-Length '1_000'" in _one_line(e)
    assert not dest.parent.exists()


# --------------------------------------------------------------------------- decompression


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    """Archives of INFLATED zero bytes (about 0.4 MB each): a zip, a gzip, and a zip whose
    headers claim 2000 bytes."""
    root = tmp_path_factory.mktemp("bombs")
    zeros = bytes(1 << 20)
    with zipfile.ZipFile(root / "enwik8.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("enwik8", "w") as f:
            for _ in range(INFLATED // len(zeros)):
                f.write(zeros)
    with gzip.open(root / "enwik8.gz", "wb") as f:
        for _ in range(INFLATED // len(zeros)):
            f.write(zeros)
    raw = bytearray((root / "enwik8.zip").read_bytes())
    local, central = raw.find(b"PK\x03\x04"), raw.find(b"PK\x01\x02")
    assert int.from_bytes(raw[central + 24:central + 28], "little") == INFLATED
    raw[local + 22:local + 26] = raw[central + 24:central + 28] = (2000).to_bytes(4, "little")
    (root / "lying").mkdir()
    (root / "lying" / "enwik8.zip").write_bytes(raw)
    for name in ("enwik8.zip", "enwik8.gz", "lying/enwik8.zip"):
        assert (root / name).stat().st_size < 500_000
    return root


@pytest.mark.parametrize("kind", ["downloaded zip", "gzip", "zip with lying headers"])
def test_a_small_archive_that_inflates_far_is_refused_without_the_memory(tmp_path, server, bombs, kind):
    """An archive of 0.4 MB that inflates to 384 MB, given for a 2000-byte corpus, is refused
    with one line naming the file, and the whole call allocates a few MB at most (Python's
    allocations, traced): the archive is read in chunks against the expected size."""
    base, served = server
    data_dir = tmp_path / "cache"
    kwargs = dict(url=_closed_port_url(), md5=None, size=2000)
    if kind == "downloaded zip":
        (served / "enwik8.zip").write_bytes((bombs / "enwik8.zip").read_bytes())
        kwargs["url"], named, text = f"{base}/enwik8.zip", data_dir / "enwik8.zip", "declares"
    elif kind == "gzip":
        named = kwargs["source"] = bombs / "enwik8.gz"
        text = "decompresses to more than the 2000 bytes expected"
    else:
        named = kwargs["source"] = bombs / "lying" / "enwik8.zip"
        text = "cannot read"  # zipfile stops at the claimed 2000 bytes, whose CRC is wrong
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as e:
            data.prepare_enwik8(data_dir, **kwargs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MB allocated to refuse a 2000-byte corpus"
    assert text in _one_line(e) and str(named) in str(e.value)
    assert not data_dir.exists()  # the downloaded bomb is deleted, with the folder it made


def test_read_corpus_bounds_every_format(tmp_path):
    """``max_size`` holds for every format read_corpus takes: a file of max_size bytes passes,
    one byte more is refused."""
    raw = _corpus(3000, seed=12)
    files = {"plain": tmp_path / "c.txt", "zip": _write_zip(tmp_path / "c.zip", {"c": raw})}
    files["plain"].write_bytes(raw)
    for suffix, pack in {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}.items():
        files[suffix] = tmp_path / f"c{suffix}"
        files[suffix].write_bytes(pack(raw))
    for kind, path in files.items():
        assert fetch.read_corpus(path, max_size=3000) == raw, kind
        with pytest.raises(DataError) as e:
            fetch.read_corpus(path, max_size=2999)
        assert str(path) in _one_line(e) and "2999" in str(e.value), kind


# --------------------------------------------------------------------------- temporaries


def _old(path, age: float = 3600.0):
    t = time.time() - age
    os.utime(path, (t, t), follow_symlinks=False)
    return path


def test_a_killed_downloads_temporaries_are_removed_and_nothing_else(tmp_path, fake_enwik8):
    """Before downloading, prepare_enwik8 removes the temporaries of enwik8.zip that no live
    download holds: unlocked and over a minute old. A locked one (a live download's), a fresh
    one, other names, a symlink and what it points to are kept."""
    url, raw = fake_enwik8
    data_dir = tmp_path / "cache"
    data_dir.mkdir()
    stale = [data_dir / ".enwik8.zip.k1ll3d_a.tmp", data_dir / ".enwik8.zip.zzzzzzzz.tmp"]
    kept = {".enwik8.zip.fresh123.tmp": 0, ".enwik8.zip.live0000.tmp": 3600, ".enwik8.zip.short.tmp": 3600,
            ".train.bin.abcd1234.tmp": 3600, "enwik8.zip.abcd1234.tmp": 3600, ".enwik8.zip.abcd1234.tmp.x": 3600}
    for path in stale:
        path.write_bytes(b"part of a download")
        _old(path)
    for name, age in kept.items():
        (data_dir / name).write_bytes(b"keep")
        _old(data_dir / name, age)
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    (data_dir / ".enwik8.zip.link1234.tmp").symlink_to(target)
    _old(data_dir / ".enwik8.zip.link1234.tmp")
    (data_dir / ".enwik8.zip.dir12345.tmp").mkdir()
    _old(data_dir / ".enwik8.zip.dir12345.tmp")
    with open(data_dir / ".enwik8.zip.live0000.tmp", "rb") as live:
        fcntl.flock(live.fileno(), fcntl.LOCK_EX)  # as a live download holds it
        data.prepare_enwik8(data_dir, url=url, md5=_md5(raw), size=len(raw))
    assert not any(p.exists() for p in stale)
    assert _temps(data_dir) == sorted([".enwik8.zip.dir12345.tmp", ".enwik8.zip.fresh123.tmp",
                                       ".enwik8.zip.link1234.tmp", ".enwik8.zip.live0000.tmp",
                                       ".enwik8.zip.short.tmp"])
    assert all((data_dir / name).read_bytes() == b"keep" for name in kept)
    assert target.read_bytes() == b"keep" and (data_dir / "enwik8.zip").is_file()


def test_three_concurrent_downloads_agree_and_keep_each_others_temporaries(tmp_path, hostile):
    """Three prepare_enwik8 calls download the same zip at once, each into its own locked
    temporary. Midway, with their temporaries made to look an hour old, the stale-temporary
    sweep removes none of them; released, all three finish with the same splits."""
    base, served, handler = hostile
    raw = _corpus(200_000, seed=13)
    _write_zip(served / "enwik8.zip", {"enwik8": raw})
    data_dir = tmp_path / "cache"
    results, errors = [], []

    def one():
        try:
            results.append(data.prepare_enwik8(data_dir, url=f"{base}/slow/enwik8.zip",
                                               md5=_md5(raw), size=len(raw)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        _wait_for(lambda: len(_temps(data_dir)) == 3 and all(
            _locked(data_dir / n) for n in _temps(data_dir)), "three downloads midway")
        for name in _temps(data_dir):
            _old(data_dir / name)
        assert fetch.remove_stale_temps(data_dir / "enwik8.zip") == []
        assert len(_temps(data_dir)) == 3
    finally:
        handler.release.set()
        for t in threads:
            t.join(60)
    assert errors == [] and len(results) == 3
    assert results[0] == results[1] == results[2]
    assert b"".join(p.read_bytes() for p in results[0].values()) == raw
    assert _listing(data_dir) == ["enwik8", "enwik8.zip", "enwik8/test.bin", "enwik8/train.bin",
                                  "enwik8/valid.bin"]


# --------------------------------------------------------------------------- folders


@pytest.mark.parametrize("failure", ["closed port", "HTTP 404", "short body", "checksum"])
def test_a_failed_download_leaves_no_folder_it_created(tmp_path, hostile, failure):
    """The cache folder (two levels here) made for a download that fails is removed again; a
    folder that was there before stays."""
    base, served, _ = hostile
    raw = _corpus(2000, seed=8)
    _write_zip(served / "enwik8.zip", {"enwik8": raw})
    url, md5 = {"closed port": (_closed_port_url(), None), "HTTP 404": (f"{base}/nope.zip", None),
                "short body": (f"{base}/short", None),
                "checksum": (f"{base}/enwik8.zip", "0" * 32)}[failure]
    with pytest.raises(DataError):
        data.prepare_enwik8(tmp_path / "new" / "cache", url=url, md5=md5, size=len(raw))
    assert not (tmp_path / "new").exists()
    old = tmp_path / "old"
    old.mkdir()
    with pytest.raises(DataError):
        data.prepare_enwik8(old, url=url, md5=md5, size=len(raw))
    assert old.is_dir() and _listing(old) == []


def test_a_folder_the_download_created_is_kept_once_it_holds_something_else(tmp_path, hostile):
    """A folder made for the download but given another file while it ran stays, with the file."""
    base, served, handler = hostile
    _write_zip(served / "enwik8.zip", {"enwik8": _corpus(200_000, seed=14)})
    data_dir = tmp_path / "new" / "cache"
    errors = []

    def one():
        try:
            data.prepare_enwik8(data_dir, url=f"{base}/slow-cut/enwik8.zip", md5=None, size=200_000)
        except DataError as e:
            errors.append(e)

    thread = threading.Thread(target=one)
    thread.start()
    try:
        _wait_for(lambda: len(_temps(data_dir)) == 1, "the download midway")
        (data_dir / "notes.txt").write_text("mine")
    finally:
        handler.release.set()
        thread.join(60)
    assert len(errors) == 1 and "got " in str(errors[0]) and "bytes declared" in str(errors[0])
    assert _listing(tmp_path / "new") == ["cache", "cache/notes.txt"]
