"""The sweep's table from its run directories: val BPC at every evaluation, the largest rise
between evaluations, test BPC, and the train-BPC change across steps 1000 and 2000 (the FAVOR+
redraws at the default interval; for a candidate without redraws, the same windows as a control).

    python results/recipe_sweep/report.py /work/runs24/sweep old qk qk-noredraw qk-lr4e-3
"""
import sys
from pathlib import Path

from linear_rope.results.analysis import read_scalars
from linear_rope.results.plots import _redraw_jumps


def row(run_dir: Path) -> dict:
    sc = read_scalars(run_dir)
    val = sc.get("val/bpc", [])
    rises = [b[1] - a[1] for a, b in zip(val, val[1:])]
    test = sc.get("test/bpc", [])
    return {"val": val, "max_rise": max(rises, default=float("nan")), "test": test[-1][1] if test else None,
            "jumps": _redraw_jumps(sc.get("train/bpc", []), 1000)}


def main(root: str, names: list[str]) -> None:
    rows = {n: row(Path(root) / n / "none-seed0") for n in names if (Path(root) / n / "none-seed0").is_dir()}
    steps = sorted({s for r in rows.values() for s, _ in r["val"]})
    print("| candidate | " + " | ".join(str(s) for s in steps) + " | best | largest rise | test | train-BPC change at 1000 / 2000 |")
    print("|---|" + "---|" * (len(steps) + 4))
    for n, r in rows.items():
        v = dict(r["val"])
        cells = [f"{v[s]:.3f}" if s in v else "–" for s in steps]
        best = min(v.values()) if v else float("nan")
        test = f"{r['test']:.3f}" if r["test"] is not None and r["val"] and r["val"][-1][0] == steps[-1] else "–"
        rise = f"{r['max_rise']:+.3f}" if r["max_rise"] > 0 else "none"
        jumps = " / ".join(f"{j:+.3f}" for j in r["jumps"]) or "–"
        print(f"| `{n}` | " + " | ".join(cells) + f" | {best:.3f} | {rise} | {test} | {jumps} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
