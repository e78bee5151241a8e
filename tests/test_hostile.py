"""Hostile input: one line on stderr, exit 2, no traceback, and no existing file changed.

Each case runs ``train.main`` in-process next to a finished earlier run, the corpus and its
cached splits; afterwards every file that existed before must be byte-for-byte unchanged.
"""
from __future__ import annotations

import bz2
import gzip
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import ENV, ROOT, run_main
from linear_rope.enwik8.checkpoint import latest_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory, corpus):
    """A workspace holding a finished tiny run in runs/, a corpus, archives and a fake enwik8."""
    root = tmp_path_factory.mktemp("hostile")
    raw = corpus.read_bytes()
    for pack in (gzip.compress, bz2.compress):  # text, not a repeated line: a cut at 5000 B cuts
        assert len(pack(raw)) > 10_000, pack     # (one repeated sentence packs into 199 B of bz2)
    (root / "corpus.txt").write_bytes(raw)
    (root / "short.txt").write_bytes(raw[:400])
    (root / "trunc.gz").write_bytes(gzip.compress(raw)[:5000])
    (root / "trunc.bz2").write_bytes(bz2.compress(raw)[:5000])
    (root / "garbage.bz2").write_bytes(b"BZh9 this is not bzip2 data at all" * 10)
    with zipfile.ZipFile(root / "full.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("trunc", raw)
    (root / "trunc.zip").write_bytes((root / "full.zip").read_bytes()[:5000])
    (root / "enwik8").mkdir()
    with zipfile.ZipFile(root / "enwik8/enwik8.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", bytes(100_000_000))  # the right name and size, the wrong md5
    code, _, err = run_main(base(root, "corpus.txt") + ["--steps", "2"])
    assert code == 0, err
    return root


def base(root: Path, data: str | None) -> list[str]:
    argv = ["--preset", "tiny", "--variants", "rope", "--eval-every", "0",
            "--data-dir", str(root / "data"), "--out", str(root / "runs")]
    return argv + (["--data", str(root / data)] if data else [])


NEW = ["--out", "{root}/new"]  # data errors are checked in a fresh --out
CASES = {  # name: (data file, extra argv, text in the error line)
    "missing data file": ("nope.txt", NEW, "data file not found"),
    "truncated gz": ("trunc.gz", NEW, "trunc.gz"),
    "truncated bz2": ("trunc.bz2", NEW, "trunc.bz2"),
    "corrupt bz2": ("garbage.bz2", NEW, "garbage.bz2"),
    "truncated zip": ("trunc.zip", NEW, "trunc.zip"),
    "wrong enwik8 checksum": (None, ["--data-dir", "{root}/enwik8", *NEW], "md5"),
    "corpus shorter than a window": ("short.txt", ["--seq-len", "512", "--out", "{root}/new"],
                                     "corpus too short"),
    "seq_len above the preset maximum": ("corpus.txt", ["--seq-len", "513"],
                                         "above the tiny preset's maximum 512"),
    "odd nb_features with rotary": ("corpus.txt", ["--nb-features", "15"], "m must be even"),
    "unknown variant": ("corpus.txt", ["--variants", "alibi"], "unknown variant 'alibi'"),
    "unknown preset": ("corpus.txt", ["--preset", "huge"], "invalid choice: 'huge'"),
    "batch size 0": ("corpus.txt", ["--batch-size", "0"], "batch_size must be >= 1"),
    "negative steps": ("corpus.txt", ["--steps", "-5"], "steps must be >= 1"),
    "resume with another model shape": ("corpus.txt", ["--resume", "--dim", "64", "--steps", "4"],
                                        "cannot resume"),
    "out dir holds a different experiment": ("corpus.txt", ["--dim", "64"],
                                             "holds a different experiment"),
    "out dir holds the same experiment": ("corpus.txt", [], "pass --resume to continue it"),
    "out is a file": ("corpus.txt", ["--out", "{root}/corpus.txt"], "is a file"),
    "resume and overwrite": ("corpus.txt", ["--resume", "--overwrite"], "contradict"),
    "out under a file": ("corpus.txt", ["--out", "{root}/corpus.txt/runs"], "cannot create --out"),
    "out in /proc": ("corpus.txt", ["--out", "/proc/linear-rope-runs"], "cannot create --out /proc/linear-rope-runs"),
    "data dir under a file": ("corpus.txt", ["--data-dir", "{root}/corpus.txt/data", *NEW],
                              "Not a directory: "),
    "data dir in /proc": ("corpus.txt", ["--data-dir", "/proc/linear-rope-data", *NEW], "/proc/linear-rope-data"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_and_overwrites_nothing(world, name):
    data, extra, text = CASES[name]
    before = snapshot(world)
    code, out, err = run_main(base(world, data) + [a.replace("{root}", str(world)) for a in extra])
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and text in lines[0], err
    after = snapshot(world)
    changed = [p for p, h in before.items() if after.get(p) != h]
    assert not changed, changed  # nothing overwritten or deleted (new split caches may appear)


def test_wrong_checksum_keeps_the_cached_zip_and_says_how_to_refetch(world):
    code, _, err = run_main(base(world, None) + ["--data-dir", str(world / "enwik8"),
                                                 "--out", str(world / "new")])
    assert code == 2 and "delete" in err and (world / "enwik8/enwik8.zip").is_file()


def test_overwrite_replaces_a_different_experiment(tmp_path, corpus):
    argv = ["--preset", "tiny", "--variants", "rope", "--steps", "2", "--eval-every", "0",
            "--data", str(corpus), "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "runs")]
    assert run_main(argv)[0] == 0
    assert run_main(argv + ["--dim", "64"])[0] == 2
    code, _, err = run_main(argv + ["--dim", "64", "--overwrite"])
    assert code == 0, err
    from linear_rope.enwik8.checkpoint import load_checkpoint
    ckpt = load_checkpoint(latest_checkpoint(tmp_path / "runs/rope-seed0"))
    assert ckpt["config"]["model"]["dim"] == 64


# ------------------------------------------------------------------ sampling prompts


@pytest.fixture(scope="module")
def run_dir(world):
    return world / "runs" / "rope-seed0"


def sample(args: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "linear_rope.sample", *args], cwd=ROOT, env=ENV,
                          capture_output=True, timeout=120, **kw)


def test_prompts_are_bytes_utf8_or_not(run_dir, tmp_path):
    """Invalid UTF-8 on the command line and in a file reach the model byte for byte."""
    prompt = b"caf\xe9 \xff\xfe"  # Latin-1 e-acute and two bytes that are never UTF-8
    (tmp_path / "p.bin").write_bytes(prompt)
    for args in ([b"--prompt", prompt], ["--prompt-file", str(tmp_path / "p.bin")]):
        proc = sample([str(run_dir).encode(), *args, b"--max-new-tokens", b"8", b"--raw"])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(prompt) and len(proc.stdout) == len(prompt) + 8
    proc = sample([str(run_dir).encode(), b"--prompt", prompt, b"--max-new-tokens", b"8"])
    assert proc.returncode == 0 and proc.stdout.decode("utf-8").startswith("caf\ufffd \ufffd\ufffd")


@pytest.mark.parametrize("args", [["--prompt", ""], ["--prompt-file", "{empty}"]],
                         ids=["empty --prompt", "empty file"])
def test_empty_prompt_is_a_clear_error(run_dir, tmp_path, args):
    (tmp_path / "empty").write_bytes(b"")
    proc = sample([str(run_dir), *[a.replace("{empty}", str(tmp_path / "empty")) for a in args]],
                  text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "prompt is empty" in proc.stderr
