#!/usr/bin/env bash
# The paper-width ablation, the GPU plan's third command (docs/gpu.md, `bash benchmarks/gpu_plan.sh
# ablation`): the five variants at the `paper` width (12 x 768, 12 heads x 64, m = 266, L = 1024,
# global batch 128 as 4 micro-batches of 32) on the shared sample, one seed each, the same steps,
# lr and schedule for every variant, the cpu40m recipe's stabilisers (q/k norm, no FAVOR+
# redraws), nothing tuned per variant. Not yet run: no session of this project has had a GPU.
#
# Every linear variant runs on the same attention path: LINEAR_ROPE_BACKEND=torch by default
# (rope_norm's ones column makes e = 65, which the Triton kernels do not take, so `auto` would put
# it on another path than the others); softmax is exact attention (scaled_dot_product_attention).
# Each run's config.json names the path it took ("attention"), and tables.md repeats it.
#
# Budget: each variant gets at most VARIANT_S seconds (default 85; 5 variants + exports < 8 min):
# a variant cut short by it is stopped with SIGTERM, which checkpoints, and its row shows the
# steps it reached; rerunning with the same RUNS resumes it. After each variant the results are
# exported into $RESULTS and packed into $OUT/gpu_paper_width.tar.gz (written whole, then moved),
# so a command stopped at the device's limit still returns every variant that finished.
# PRESET=tiny DEVICE=cpu STEPS=2 runs the same pipeline on a CPU in a minute (CI's dry run).
set -u
cd "$(dirname "$0")/../.."
variants=${VARIANTS:-none rope rope_pre rope_norm softmax}
steps=${STEPS:-30}                         # same for every variant
lr=${LR:-6e-4}                             # GPT-3 small's lr (125M params): the paper's 1e-4 is for 100k steps
preset=${PRESET:-paper}
data=${DATA:-data/enwiki-sample.xml.bz2}
runs=${RUNS:-/tmp/gpu-paper-width-runs}
out=${RESULTS:-results/gpu_paper_width}
dest=${OUT:-/tmp}
micro=${MICRO_BATCH:-32}                   # paper: 4 micro-batches of 32
variant_s=${VARIANT_S:-85}
py=${PYTHON:-python3}
export LINEAR_ROPE_BACKEND=${LINEAR_ROPE_BACKEND:-torch}
[ "$preset" = paper ] && batch=(--batch-size "$micro" --grad-accum $((128 / micro))) || batch=()
"$py" -c "import torch, linear_rope" || { echo "$py cannot import torch and linear_rope" >&2; exit 2; }
[ -f "$data" ] || { echo "no corpus at $data: carry the shared sample there (benchmarks/gpu_wheels.sh)" >&2; exit 2; }
mkdir -p "$out/logs" "$dest"
pack() {  # export what finished so far, and pack it into one file for $OUT
  "$py" -m linear_rope.plots export --runs "$runs" --out "$out" >/dev/null &&
    "$py" -m linear_rope.plots summary --runs "$runs" --out "$out" >/dev/null &&
    "$py" -m linear_rope.plots tables --out "$out" > "$out/tables.md"
  local rc=$?
  "$py" - "$runs" "$out" <<'PY'
import json, pathlib, sys
runs, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
paths = {d.name: json.loads((d / "config.json").read_text()).get("attention", "not recorded")
         for d in sorted(runs.glob("*-seed*")) if (d / "config.json").is_file()}
(out / "attention_paths.json").write_text(json.dumps(paths, indent=1) + "\n")
with open(out / "tables.md", "a") as f:
    f.write("\nAttention path of each run (LINEAR_ROPE_BACKEND=%s):\n\n" % __import__("os").environ["LINEAR_ROPE_BACKEND"]
            + "".join(f"- {k}: {v}\n" for k, v in paths.items()))
PY
  tar -czf "$dest/gpu_paper_width.tar.gz.tmp" "$out" && mv "$dest/gpu_paper_width.tar.gz.tmp" "$dest/gpu_paper_width.tar.gz"
  return $rc
}
rc=0
for v in $variants; do
  echo "$(date -u +%FT%TZ) $v: start (at most ${variant_s} s)"
  timeout -s TERM -k 30 "$variant_s" "$py" train_enwik8.py --preset "$preset" "${batch[@]}" --variants "$v" --seeds 0 \
    --steps "$steps" --decay-steps "$steps" --warmup-steps $((steps / 10 + 1)) --lr "$lr" \
    --eval-every $((steps / 5 > 0 ? steps / 5 : 1)) --qk-norm --feature-redraw-interval 0 \
    --device "${DEVICE:-auto}" --data "$data" --data-dir "$runs/data" --out "$runs" --resume \
    --on-nonfinite skip 2>&1 | tee -a "$out/logs/$v-seed0.log"
  status=${PIPESTATUS[0]}
  [ "$status" = 124 ] && echo "$v: stopped by its ${variant_s} s budget (checkpointed; rerun to resume)" | tee -a "$out/logs/$v-seed0.log"
  echo "$(date -u +%FT%TZ) $v: exit $status"
  pack || rc=$?
done
exit $rc
