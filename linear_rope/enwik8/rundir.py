"""Run folders: one writer at a time (a lock per run), the files a run writes, config.json's history.

**The lock.** A run ``<out>/<name>/`` has one writer: the process that holds
``<out>/.<name>.lock``, an exclusive ``flock`` taken before anything is read or written and held
for the life of the process (every run of one command, variants x seeds, is locked at its
start). The file names its holder (pid, host, start time, command), so a second command for the
same run exits 2 with one line that says who has it. The kernel drops a ``flock`` when its
process ends, however it ends (``kill -9`` included), so a lock file whose ``flock`` is free is
stale: the next run takes it over and says so in one line. Runs of other names may share
``--out`` (two variants trained side by side, each in its own process). The lock relies on
``flock``: on a network file system that does not share it between hosts, two hosts are not
kept apart.

**What a run writes** (``is_run_file``): checkpoints, config.json, nonfinite.json, TensorBoard
event files and their temporary files. ``--overwrite`` deletes those and nothing else.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

from .files import atomic_write

__all__ = ["RunDirError", "RunBusyError", "RunLocks", "lock_path", "is_run_file", "run_files", "clear_run_dir",
           "write_config", "start_entry", "os_error_line"]

CONFIG = "config.json"
_RUN_FILE = re.compile(r"^(ckpt-\d{8}\.pt|checkpoint\.pt|config\.json|nonfinite\.json|events\.out\.tfevents\..+"
                       r"|\.(ckpt-\d{8}\.pt|config\.json|nonfinite\.json)\..+\.tmp)$")
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunDirError(ValueError):
    """An --out that holds an earlier or different run, or cannot hold one (the CLI prints it and
    exits 2)."""


class RunBusyError(RunDirError):
    """Another live process holds the run's lock."""


def lock_path(out, name: str) -> Path:
    return Path(out) / f".{name}.lock"


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %z")


def _holder(info: dict | None) -> str:
    if not info:
        return "a process that has not written its name yet"
    return (f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}"
            + (f": {info['command']}" if info.get("command") else ""))


def _read(path: Path) -> dict | None:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _alive_here(info: dict) -> bool:
    """Whether the holder named in ``info`` runs on this host (where flock is not available)."""
    if info.get("host") != socket.gethostname():
        return True  # cannot tell from here: assume it runs
    try:
        os.kill(int(info.get("pid")), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


class RunLocks:
    """The locks of ``names`` in ``out``: ``acquire()`` (all or none) returns notes about stale
    locks it took over; ``release()`` drops them, deletes the lock files and any folder that
    ``acquire`` created and that is still empty."""

    def __init__(self, out, names):
        self.out, self.names = Path(out), sorted(set(names))
        self.held: list[tuple[Path, int]] = []
        self.created: list[Path] = []

    def acquire(self) -> list[str]:
        if self.out.exists() and not self.out.is_dir():
            raise RunDirError(f"--out {self.out} is a file, not a directory")
        missing = [p for p in (self.out, *self.out.parents) if not p.exists()]
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"cannot create --out {self.out}: {e.strerror or e}") from None
        self.created = missing  # deepest first
        notes = []
        try:
            for name in self.names:
                note = self._take(lock_path(self.out, name), self.out / name)
                if note:
                    notes.append(note)
        except BaseException:
            self.release()
            raise
        return notes

    def _take(self, path: Path, run_dir: Path) -> str | None:
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                flocked = True
            except BlockingIOError:
                os.close(fd)
                raise RunBusyError(f"{run_dir} is in use by another run ({_holder(_read(path))}); wait for "
                                   f"it to end, or choose another --out (lock: {path})") from None
            except OSError as e:
                if e.errno not in _NO_FLOCK:
                    os.close(fd)
                    raise
                flocked = False  # this file system has no flock: judge by the pid alone
            try:  # a holder that was releasing may have deleted the file we opened: open again
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        old = _read(path)
        if old and not flocked and _alive_here(old):
            os.close(fd)
            raise RunBusyError(f"{run_dir} is in use by another run ({_holder(old)}); wait for it to end, "
                               f"or delete {path} if that run is gone")
        self.held.append((path, fd))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now(),
              "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        if old:
            return (f"took over the stale lock of {run_dir}: its holder ({_holder(old)}) is no longer "
                    f"running")
        return None

    def release(self) -> None:
        for path, fd in reversed(self.held):
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    path.unlink()  # while still locked: the next taker opens a fresh file
            os.close(fd)
        self.held = []
        for d in self.created:  # a failed start leaves no empty --out behind
            try:
                d.rmdir()
            except OSError:
                break
        self.created = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


def is_run_file(name: str) -> bool:
    """Whether a file of that name in a run folder is one a run writes."""
    return bool(_RUN_FILE.match(name))


def run_files(run_dir) -> list[Path]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if is_run_file(p.name) and p.is_file() and not p.is_symlink())


def clear_run_dir(run_dir) -> list[str]:
    """``--overwrite``: delete the files a run wrote; return the names of the other entries,
    which are kept (notes, plots, anything the user put there)."""
    for p in run_files(run_dir):
        p.unlink()
    return sorted(p.name for p in Path(run_dir).iterdir())


def write_config(run_dir, config: dict, entry: dict) -> None:
    """config.json: ``config`` (the run as it is now) plus ``history``, one entry per start or
    resume, oldest first, kept across resumes (a config.json without one keeps its contents as
    the first entry)."""
    path = Path(run_dir) / CONFIG
    old = None
    with contextlib.suppress(OSError, ValueError):
        old = json.loads(path.read_text())
    history = []
    if isinstance(old, dict):
        history = old.get("history")
        if not isinstance(history, list):
            history = [{"note": "config.json as written before it kept a history",
                        **{k: v for k, v in old.items() if k != "history"}}]
    atomic_write(path, json.dumps({**config, "history": [*history, entry]}, indent=2) + "\n")


def start_entry(step: int, train: dict, corpus: dict | None) -> dict:
    """One ``history`` entry: when and where the run (re)started, from which step, with what."""
    return {"started": _now(), "host": socket.gethostname(), "pid": os.getpid(), "from_step": step,
            "train": train, "corpus": corpus}


def os_error_line(e: OSError) -> str:
    """An OSError in one line: what failed, on which path, and what to do about a full disk."""
    what = e.strerror or type(e).__name__
    where = f": {e.filename}" + (f" -> {e.filename2}" if e.filename2 else "") if e.filename else ""
    line = f"{what}{where}" if e.strerror else " ".join(str(e).split()) or what
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        line += ("; free some space, then continue with --resume (the checkpoints already written are "
                 "intact)")
    return line
