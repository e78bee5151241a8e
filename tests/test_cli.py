"""The CLIs as processes: bad input exits 2 with one clear line on stderr, never a traceback."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from linear_rope.enwik8 import train
from linear_rope.enwik8.cli import OneLineParser, build_parser, parse_runs
from linear_rope.model import ModelConfig
from linear_rope.enwik8.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, "-m", "linear_rope.train"]
SHIM = [sys.executable, str(ROOT / "train_enwik8.py")]
SAMPLE = [sys.executable, "-m", "linear_rope.sample"]

# name -> (command, expected exit code, text expected in the error line, argparse error?)
CASES = {
    "unknown-variant": (TRAIN + ["--variants", "rope,bogus"], 2, "unknown variant 'bogus'", False),
    "bad-preset": (TRAIN + ["--preset", "huge"], 2, "invalid choice: 'huge'", True),
    "missing-data": (TRAIN + ["--data", "{tmp}/nope.txt"], 2, "data file not found", False),
    "zero-steps": (TRAIN + ["--steps", "0"], 2, "steps must be >= 1", False),
    "shim-variant": (SHIM + ["--variants", "alibi"], 2, "train_enwik8.py: error: unknown variant", False),
    # no abbreviations: --step is not taken as --steps
    "shim-abbreviation": (SHIM + ["--step", "10"], 2, "unrecognized arguments: --step 10", True),
    "sample-missing": (SAMPLE + ["{tmp}/nope.pt", "--prompt", "x"], 2, "checkpoint not found", False),
    "help": (TRAIN + ["--help"], 0, None, False),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Start every case at once, then collect: each process spends seconds importing torch, so
    only these few run as processes and the other bad inputs are checked in-process below."""
    tmp = tmp_path_factory.mktemp("cli")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    for name, (cmd, *_) in CASES.items():
        cmd = [c.replace("{tmp}", str(tmp)) for c in cmd]
        if cmd[:3] == TRAIN or cmd[:2] == SHIM:  # never write into the repository
            cmd += ["--out", str(tmp / name / "runs"), "--data-dir", str(tmp / name / "data")]
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return {name: (p.wait(timeout=120), *p.communicate()) for name, p in procs.items()}


@pytest.mark.parametrize("name", [n for n in CASES if n != "help"])
def test_bad_input_exits_2_with_one_line(results, name):
    _, code, text, argparse_error = CASES[name]
    rc, out, err = results[name]
    assert rc == code, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    if argparse_error:  # argparse's own errors come without its usage dump
        assert "(see --help)" in lines[0]
    assert len(lines) == 1, err
    assert text in lines[0] and "error:" in lines[0]
    assert out == ""


def test_help_names_every_config_field(results):
    rc, out, err = results["help"]
    assert rc == 0, err
    flags = {"--" + f.name.replace("_", "-") for f in fields(ModelConfig) + fields(TrainConfig)}
    flags -= {"--position", "--seed"}  # set per run by --variants / --seeds
    missing = sorted(f for f in flags | {"--variants", "--seeds", "--preset", "--resume"}
                     if f not in out)
    assert not missing
    assert "ModelConfig.position" in " ".join(out.split())


@pytest.mark.parametrize("argv, text", [
    (["--steps", "-3"], "steps must be >= 1"),
    (["--batch-size", "0"], "batch_size must be >= 1"),
    (["--eval-every", "-1"], "eval_every must be >= 0"),
    (["--lr", "0"], "lr must be > 0"),
    (["--dim", "0"], "dim must be >= 1"),
    (["--dropout", "1.5"], "dropout must be in [0, 1)"),
    (["--seeds", "0,x"], "--seeds must be"),
    (["--variants", ","], "--variants is empty"),
    (["--nb-features", "15", "--variants", "rope"], "m must be even"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_more_bad_numbers_in_process(tmp_path, capsys, argv, text):
    (tmp_path / "c.txt").write_bytes(b"abc " * 500)
    with pytest.raises(SystemExit) as exc:
        train.main(argv + ["--preset", "tiny", "--data", str(tmp_path / "c.txt"),
                           "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "runs")],
                   prog="train_enwik8.py")
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_enwik8.py: error: ") and text in lines[0]


@pytest.mark.parametrize("argv, text", [(["--lr", "fast"], "invalid float value: 'fast'"),
                                        (["--nb-features", "x"], "invalid int value: 'x'")])
def test_argparse_type_errors_in_process(capsys, argv, text):
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    assert exc.value.code == 2
    assert text in capsys.readouterr().err


def _entry_points():
    """The command lines callable in-process: ``{name: (main, argv, the words refused)}``."""
    from benchmarks import gpu, run
    from linear_rope.enwik8 import sample
    from linear_rope.results import plots

    return {"train": (train.main, ["--step", "10"], "--step 10"),
            "sample": (sample.main, ["x.pt", "--prom", "a"], "--prom a"),
            "plots": (plots.main, ["tables", "--ru", "r"], "--ru r"),
            "benchmarks.run": (run.main, ["--rend"], "--rend"),
            "benchmarks.gpu": (gpu.main, ["--quic"], "--quic")}


@pytest.mark.parametrize("name", ["train", "sample", "plots", "benchmarks.run", "benchmarks.gpu"])
def test_no_entry_point_takes_an_abbreviated_flag(capsys, name):
    """argparse's default would take ``--step`` for ``--steps``; every parser refuses it."""
    main, argv, refused = _entry_points()[name]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert f"unrecognized arguments: {refused}" in capsys.readouterr().err


def test_every_argument_parser_refuses_abbreviations():
    """The parsers that only run under ``__main__`` (benchmarks' children) are read, not run:
    each ``ArgumentParser(`` in the project passes ``allow_abbrev=False``."""
    calls = {}
    for path in [*ROOT.glob("*.py"), *ROOT.glob("linear_rope/**/*.py"), *ROOT.glob("benchmarks/**/*.py"),
                 *ROOT.glob("results/**/*.py")]:
        for m in re.finditer(r"\bArgumentParser\((.*)", path.read_text()):
            calls[f"{path.relative_to(ROOT)}: {m.group(0)[:60]}"] = "allow_abbrev=False" in m.group(1)
    assert len(calls) >= 4  # benchmarks/ has four (common, run, gpu, launches)
    assert all(calls.values()), [c for c, ok in calls.items() if not ok]
    assert OneLineParser().allow_abbrev is False  # train, sample and plots


# ------------------------------------------------------------------ flags checked before data

EARLY = [  # (argv, text in the one error line)
    (["--lr", "-1e-3"], "lr must be > 0, got -0.001"),  # a negative value, not a missing one
    (["--warmup-steps", "-2"], "warmup_steps must be >= 0"),
    (["--feature-map", "elu"], "elementwise"),  # FAVOR+'s nb_features with elu+1
    (["--feature-map", "relu", "--variants", "none,rope"], "elementwise"),
    (["--device", "tpu"], "unknown --device 'tpu'"),
    (["--precision", "fp8"], "precision must be one of"),
    (["--dim", "None"], "invalid int value: 'None'"),  # None only where a field is optional
    (["--rope-base", "nan"], "rope_base must be a finite number, got nan"),
    (["--rope-base", "0"], "rope_base must be a positive number"),  # refused at the first step before
    (["--lr", "inf"], "lr must be a finite number, got inf"),
    (["--grad-clip", "nan"], "grad_clip must be a finite number"),
    (["--weight-decay", "nan"], "weight_decay must be a finite number"),
    (["--vocab-size", "10"], "vocab_size 10: the corpus is bytes"),
    (["--batch-size", "1000000000"], "batch_size 1000000000 x seq_len 32"),
    (["--eval-batch-size", "1000000000"], "eval_batch_size 1000000000 x seq_len 32"),
    (["--seeds", str(2**64)], "seed must be in [0, 4294967295]"),
    (["--grad-accum", str(10**17)], "tokens per step is above the sanity cap"),  # drew 10**17 offsets at once
    (["--threads", "100000"], "threads 100000 is more than 4 per CPU core"),  # thousands of threads failed to start
    # a CUDA graph's replay overwrites the outputs the previous micro-batch's backward still needs
    (["--compile-mode", "reduce-overhead", "--grad-accum", "2"], "reduce-overhead (CUDA graphs) takes grad_accum 1"),
]
if not torch.cuda.is_available():
    EARLY.append((["--device", "cuda"], "CUDA is not available"))
    EARLY.append((["--device", "cuda:1"], "CUDA is not available"))


@pytest.mark.parametrize("argv, text", EARLY, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_flags_fail_before_data_and_leave_no_file(tmp_path, capsys, argv, text):
    """--data names a file that does not exist: the flag's error must come first; and the new
    --out (no TensorBoard events file, no config.json) and --data-dir are never created."""
    out, data_dir = tmp_path / "runs", tmp_path / "data"
    with pytest.raises(SystemExit) as exc:
        train.main(argv + ["--preset", "tiny", "--data", str(tmp_path / "missing.txt"),
                           "--data-dir", str(data_dir), "--out", str(out)])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and text in lines[0], lines
    assert "data file not found" not in lines[0]
    assert not out.exists() and not data_dir.exists()


def test_device_cuda_without_cuda_is_one_line_as_a_process(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run(TRAIN + ["--device", "cuda", "--lr", "-1e-3", "--out", str(tmp_path / "r")],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, field, want", [
    (["--nb-features", "None"], "nb_features", None),  # not dropped: the preset says 16
    (["--nb-features", "none", "--feature-map", "elu"], "nb_features", None),
    (["--decay-steps", "None"], "decay_steps", None),
    (["--lr", "2e-3"], "lr", 2e-3),
    (["--lr=-0"], None, None),  # "lr must be > 0": checked below, not here
])
def test_values_reach_the_configs(argv, field, want):
    if field is None:
        with pytest.raises(ValueError, match="lr must be > 0"):
            parse_runs(build_parser(), argv + ["--preset", "tiny"])
        return
    _, runs = parse_runs(build_parser(), argv + ["--preset", "tiny"])
    for _, mc, tc in runs:
        assert getattr(mc if hasattr(mc, field) else tc, field) == want


def _float_fields() -> list[str]:
    import typing

    return [f.name for cls in (ModelConfig, TrainConfig) for f in fields(cls)
            if float in (typing.get_type_hints(cls)[f.name], *typing.get_args(typing.get_type_hints(cls)[f.name]))]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("field", _float_fields())
def test_every_float_flag_refuses_a_non_finite_value(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be a finite number, got {value}$"):
        parse_runs(build_parser(), ["--preset", "tiny", "--" + field.replace("_", "-"), value])


def test_flags_not_given_keep_the_preset():
    _, runs = parse_runs(build_parser(), ["--preset", "tiny", "--no-compile"])
    (_, mc, tc), _ = runs
    assert mc.nb_features == 16 and tc.steps == 20 and tc.compile is False and tc.out == "runs/tiny"


# ------------------------------------------------------------------ enwik8 without internet

@pytest.mark.parametrize("server", ["closed-port", "http-404"])
def test_enwik8_unreachable_is_one_line_naming_data(tmp_path, capsys, monkeypatch, server):
    """No --data and no enwik8 to be had: one line that says so and names --data (no download
    line first, no traceback), and neither a zip, nor the cache folder it made, nor a run
    directory is left behind."""
    import functools
    import http.server
    import socket
    import threading

    from helpers import run_main
    from linear_rope.enwik8 import data

    if server == "closed-port":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}/enwik8.zip"
    else:
        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):  # the server's own access log would go to stderr
                pass

        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=tmp_path))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}/no/enwik8.zip"  # 404
    monkeypatch.setattr(data, "prepare_enwik8", functools.partial(data.prepare_enwik8, url=url))
    try:
        code, out, err = run_main(["--preset", "tiny", "--steps", "1", "--out", str(tmp_path / "runs"),
                                   "--data-dir", str(tmp_path / "data")])
    finally:
        if server != "closed-port":
            httpd.shutdown()
            httpd.server_close()
    lines = err.strip().splitlines()
    assert code == 2 and out == ""
    assert len(lines) == 1, err
    assert lines[0].startswith("python -m linear_rope.train: error: could not fetch enwik8 (download of ")
    assert url in lines[0] and "pass --data PATH" in lines[0]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()  # nor the cache folder


# ------------------------------------------------------------------ LINEAR_ROPE_BACKEND at start

REFUSED_BACKENDS = [("garbage", "LINEAR_ROPE_BACKEND='garbage' is not a backend: use one of auto, torch"),
                    ("triton", "LINEAR_ROPE_BACKEND=triton: the Triton kernels (LINEAR_ROPE_BACKEND=triton) were removed")]
if not torch.cuda.is_available():  # a CPU run
    REFUSED_BACKENDS += [("fla", "fla-core's kernels need a CUDA device")]


@pytest.mark.parametrize("value, text", REFUSED_BACKENDS)
def test_a_backend_the_run_cannot_use_fails_first_and_writes_nothing(tmp_path, capsys, monkeypatch, value, text):
    """A backend the trainer cannot use (an unknown name; triton, removed; fla on a CPU) is one
    line and exit 2 before any data is read or any file written."""
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", value)
    out, data_dir = tmp_path / "runs", tmp_path / "data"
    (tmp_path / "c.txt").write_bytes(b"abc " * 500)
    with pytest.raises(SystemExit) as exc:
        train.main(["--preset", "tiny", "--steps", "1", "--data", str(tmp_path / "c.txt"),
                    "--data-dir", str(data_dir), "--out", str(out)])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and text in lines[0], lines
    assert not out.exists() and not data_dir.exists()


def test_every_backend_a_cpu_run_can_use_passes_the_start_check(monkeypatch):
    """auto, torch and parallel run anywhere (fla and fused need CUDA)."""
    from linear_rope.ops.backend import BACKENDS, check_backend

    for name in BACKENDS:
        if name not in ("fla", "fused"):
            monkeypatch.setenv("LINEAR_ROPE_BACKEND", name.upper())
            assert check_backend("cpu") == name
    monkeypatch.delenv("LINEAR_ROPE_BACKEND")
    assert check_backend("cpu") == "auto"


def test_a_bad_backend_is_one_line_as_a_process(tmp_path):
    """As a user meets it: no traceback, exit 2, nothing in --out."""
    (tmp_path / "c.txt").write_bytes(b"abc " * 500)
    proc = subprocess.run(TRAIN + ["--preset", "tiny", "--steps", "1", "--data", str(tmp_path / "c.txt"),
                                   "--out", str(tmp_path / "r"), "--data-dir", str(tmp_path / "d")],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "LINEAR_ROPE_BACKEND": "garbage"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


@pytest.mark.parametrize("what", ["summary", "decay", "all", "tables"])
def test_plots_without_out_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, what):
    """``python -m linear_rope.plots`` writes only where ``--out`` says: without it, one line and
    exit 2, and nothing in the caller's folder (no ``results/`` appears there)."""
    from linear_rope.results import plots

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(SystemExit) as exc:
        plots.main([what, "--runs", "runs"])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{what} needs --out" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("flag", ["--out", "--data", "--data-dir"])
def test_an_empty_path_is_refused_not_taken_for_the_default(tmp_path, monkeypatch, capsys, flag):
    """``--out "$OUT"`` with OUT unset wrote into runs/<preset>, ``--data ""`` fetched enwik8:
    an empty path is one line and exit 2, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_bytes(b"abc " * 500)
    given = {"--out": "o", "--data": "c.txt", "--data-dir": "d", flag: " "}
    with pytest.raises(SystemExit) as exc:
        train.main(["--preset", "tiny", "--steps", "1", *(x for kv in given.items() for x in kv)])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"is an empty path; leave {flag} out for its default" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


@pytest.mark.parametrize("module", ["linear_rope.train", "linear_rope.sample", "linear_rope.plots",
                                    "linear_rope.export"])
def test_help_is_plain_text(module, capsys):
    """--help shows no reST markup (``x``, :func:`x`) from the docstrings it is made of."""
    import importlib

    if module == "linear_rope.export":
        pytest.importorskip("transformers", reason="the hf extra (transformers)")
    mod = importlib.import_module(module)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "usage:" in out and "`" not in out, out
