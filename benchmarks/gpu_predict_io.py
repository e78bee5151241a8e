"""The JSON of ``benchmarks.gpu_predict``: rows merged with the committed file's, the table it
prints, the file written one kernel a line, the commit it was made at."""
from __future__ import annotations

import json
import re
import subprocess

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("rope", "none", "softmax")
BACKENDS = ("parallel", "fused")
DEVICES = {"h100": {"name": "H100 SXM", "hbm_bytes_s": 3.35e12}, "h200": {"name": "H200", "hbm_bytes_s": 4.8e12}}


def merge(old: dict | None, new: dict) -> dict:
    """``new``'s rows and runs in place of ``old``'s of the same (backend, variant, N); ``old``'s
    others kept (a row without a backend is a ``parallel`` one); ``old``'s decode kept when
    ``new`` has none. Rows ordered by N, backend (parallel first), variant."""
    if not old:
        return new
    key = lambda r: (r.get("backend", "parallel"), r["variant"], r["N"])  # noqa: E731
    done = {key(r) for r in new["rows"]}
    made = {"command": old.get("command"), "git_commit": old.get("git_commit")}  # an older row's provenance
    rows = [{**made, **r, "backend": r.get("backend", "parallel")} for r in old.get("rows", []) if key(r) not in done]
    runs = [dict(r, backend=r.get("backend", "parallel")) for r in old.get("runs", []) if key(r) not in done]
    def order(r):
        return r["N"], BACKENDS.index(r["backend"]), VARIANTS.index(r["variant"]), r.get("depth", 0)
    out = dict(new, rows=sorted(rows + new["rows"], key=order), runs=sorted(runs + new["runs"], key=order))
    if "decode" not in new and "decode" in old:
        out["decode"] = old["decode"]
    return out


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "linear_rope"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
        return head.stdout.strip() + ("+dirty(linear_rope)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def table(res: dict, devices) -> str:
    lines = []
    for d in devices:
        lines.append(f"{DEVICES[d]['name']} (predicted)            GB/layer  GB/step  ms/step   tokens/s    MFU  "
                     "saved GB  vs softmax (tokens/s, bytes)")
        soft = {r["N"]: r for r in res["rows"] if r["variant"] == "softmax"}
        for r in res["rows"]:
            if d not in r:
                continue
            sm = soft.get(r["N"])
            ratio = f"{r[d]['tokens_s'] / sm[d]['tokens_s']:.2f}x {r['step_bytes'] / sm['step_bytes']:.2f}x" \
                if sm and d in sm else "-"
            lines.append(f"{r['variant']:<8} {r.get('backend', 'parallel'):<8} N={r['N']:<6} B={r['B']:<3} "
                         f"{r['layer_bytes'] / 1e9:8.2f} {r['step_bytes'] / 1e9:8.1f} {r[d]['step_ms']:8.1f} "
                         f"{r[d]['tokens_s'] / 1e3:9.0f}K {100 * r[d]['mfu']:5.1f}% "
                         f"{r['step_saved_bytes'] / 1e9:8.1f}  "
                         f"{ratio}")
    if "decode" in res:
        dd = res["decode"]
        ms = ", ".join(f"{DEVICES[d]['name']} {v:.3f} ms" for d, v in dd["ms_per_step"].items())
        lines.append(f"decode (rope, batch {dd['batch']}): {dd['bytes_per_step'] / 1e9:.3f} GB a step "
                     f"(one token per row), {dd['kernels']} kernels, {ms}")
    return "\n".join(lines)


def _dumps(doc) -> str:
    """JSON with one kernel a line (the file stays readable and diffable)."""
    rows = []

    def compact(obj):
        if isinstance(obj, dict):
            return {k: ([compact_row(x) for x in v] if k == "kernels" and isinstance(v, list) else compact(v))
                    for k, v in obj.items()}
        if isinstance(obj, list):
            return [compact(x) for x in obj]
        return obj

    def compact_row(k):
        rows.append(json.dumps(k, separators=(",", ":")))
        return f"@@{len(rows) - 1}@@"
    text = json.dumps(compact(doc), indent=1)
    return re.sub(r'"@@(\d+)@@"', lambda m: rows[int(m.group(1))], text) + "\n"


def _ints(text: str):
    """Lengths from "1024,4096": positive multiples of 64 (whole chunks), else None."""
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        return None
    return vals if vals and all(v >= 64 and v % 64 == 0 for v in vals) else None
