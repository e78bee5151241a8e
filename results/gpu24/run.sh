#!/usr/bin/env bash
# Issue 24's GPU item, for a session that is lent a device machine: the five variants at the
# `paper` width (12 x 768, 12 heads x 64, m = 266, L = 1024, global batch 128) on the shared
# sample, one seed each, with the cpu40m recipe's stabilisers (q/k norm, no FAVOR+ redraws) and
# no variant tuned for. Not yet run: no session of this project has had a GPU for it.
#
# The device gives 30 minutes a session and 10 a command, and keeps nothing between calls, so:
#   1. the first call runs `python -m benchmarks.gpu` (the brief's rule); its training part
#      reports the paper preset's tokens/s, which sets STEPS below (a step is 131,072 bytes);
#   2. each later call trains the variants it names and exports them into results/gpu24/, which
#      travels with the working tree: results of earlier calls stay in its runs.json and curves
#      (copy them here between calls), and the call's tarball holds all of them.
# Carry the shared sample as data/enwiki-sample.xml.bz2 (benchmarks/gpu_wheels.sh puts it there),
# then, on the device, from the repo root:
#   VARIANTS="none rope rope_pre" STEPS=150 bash results/gpu24/run.sh     (one call)
#   VARIANTS="rope_norm softmax" STEPS=150 bash results/gpu24/run.sh      (the next)
# and here: tar -xzf <files_at>/gpu24.tar.gz, then commit results/gpu24 with the command used.
# PRESET=tiny DEVICE=cpu runs the same pipeline on a CPU in a minute (tests/test_train.py).
set -u
cd "$(dirname "$0")/../.."
variants=${VARIANTS:-none rope rope_pre rope_norm softmax}
steps=${STEPS:-150}                        # same for every variant
lr=${LR:-6e-4}                             # GPT-3 small's lr (125M params): the paper's 1e-4 is for 100k steps
preset=${PRESET:-paper}
data=${DATA:-data/enwiki-sample.xml.bz2}
runs=${RUNS:-/tmp/gpu24-runs}
out=${RESULTS:-results/gpu24}
dest=${OUT:-/tmp}
micro=${MICRO_BATCH:-32}                   # paper: 4 micro-batches of 32
[ "$preset" = paper ] && batch=(--batch-size "$micro" --grad-accum $((128 / micro))) || batch=()
python -c "import torch, linear_rope" || { echo "python cannot import torch and linear_rope" >&2; exit 2; }
[ -f "$data" ] || { echo "no corpus at $data: carry the shared sample there" >&2; exit 2; }
mkdir -p "$out/logs"
for v in $variants; do
  echo "$(date -u +%FT%TZ) $v: start"
  python train_enwik8.py --preset "$preset" "${batch[@]}" --variants "$v" --seeds 0 \
    --steps "$steps" --decay-steps "$steps" --warmup-steps $((steps / 10 + 1)) --lr "$lr" \
    --eval-every $((steps / 5 > 0 ? steps / 5 : 1)) --qk-norm --feature-redraw-interval 0 \
    --device "${DEVICE:-auto}" --data "$data" --data-dir "$runs/data" --out "$runs" --resume \
    --on-nonfinite skip 2>&1 | tee -a "$out/logs/$v-seed0.log"
  echo "$(date -u +%FT%TZ) $v: exit ${PIPESTATUS[0]}"
done
python -m linear_rope.plots export --runs "$runs" --out "$out" &&
  python -m linear_rope.plots extrapolate --runs "$runs" --data "$data" --data-dir "$runs/data" --out "$out" &&
  python -m linear_rope.plots summary --runs "$runs" --out "$out" &&
  python -m linear_rope.plots tables --out "$out" | tee "$out/tables.md"
rc=$?
tar -czf "$dest/gpu24.tar.gz" "$out"  # one file back: the results of this call and the earlier ones
exit $rc
