#!/usr/bin/env bash
# Issue 24's recipe sweep on `none` alone: the cpu20m model and batch, the 40M-byte schedule
# (decay at 9800 steps), its first 2450 steps (10M bytes, two FAVOR+ redraws), one thread each,
# one candidate after another (the ones named, or all). Re-running it resumes a candidate a
# session end stopped. Two at a time on the 2-core box:
#   nohup nice -n 19 bash results/recipe_sweep/sweep.sh qk > sweep-a.log 2>&1 &      (from the repo root)
#   nohup nice -n 19 bash results/recipe_sweep/sweep.sh qk-noredraw > sweep-b.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
runs=${RUNS:-/work/runs24}  # outside the checkout
common="--preset cpu20m --variants none --seeds 0 --steps 2450 --decay-steps 9800 --eval-every 245 --threads 1
        --data ../shared/data/enwiki-sample.xml.bz2 --data-dir $runs/data --on-nonfinite skip"
run() { name=$1; shift; python train_enwik8.py $common --out "$runs/sweep/$name" --resume "$@" >> "$runs/sweep-$name.log" 2>&1; }
flags() {
  case $1 in
    old) echo --lr 2e-3 ;;
    qk) echo --lr 2e-3 --qk-norm ;;
    qk-lr4e-3) echo --lr 4e-3 --qk-norm ;;
    qk-noredraw) echo --lr 2e-3 --qk-norm --feature-redraw-interval 0 ;;
    lr1e-3) echo --lr 1e-3 ;;
    *) echo "unknown candidate $1" >&2; exit 2 ;;
  esac
}
for name in ${@:-old qk qk-lr4e-3 qk-noredraw lr1e-3}; do
  f=$(flags "$name") || exit 2
  run "$name" $f
done
