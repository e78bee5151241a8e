#!/usr/bin/env bash
# Fetch here (where PyPI is reachable) what `python -m benchmarks.gpu` needs on the device machine
# (which has torch, triton, numpy, setuptools, transformers, but no network), for its `carry`:
#
#   .whl/                          pure-Python wheels: performer-pytorch and its dependencies
#                                  (FavorFeatures draws its projection with it; the performer
#                                  baseline), fla-core (fla's chunk_linear_attn kernels), einops
#   data/enwiki-sample.xml.bz2     the shared sample, for the training part's loss curve
#
# Both paths are git-ignored (.whl/ through .git/info/exclude, data/* through .gitignore), so
# they travel only when named in `carry`. Run from anywhere in the checkout:
#
#   bash benchmarks/gpu_wheels.sh                    # EXTRA="flash-linear-attention==0.6.0" adds fla's
#                                                    # layers and models (not used here; they import transformers)
#
# then on the device, in one call: carry [".whl", "data/enwiki-sample.xml.bz2"] and
#
#   set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; nvidia-smi; \
#   PYTHONUNBUFFERED=1 timeout 570 python3 -m benchmarks.gpu --out $OUT/gpu.json 2>&1 | tee $OUT/gpu.log
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
# Pinned: one version of each (two stop the install there). All are py3-none-any.
WHEELS="performer-pytorch==1.1.4 local-attention==1.11.2 axial-positional-embedding==0.3.12 hyper-connections==0.4.11
torch-einops-utils==0.2.0 einops==0.8.2 fla-core==0.6.0 ${EXTRA:-}"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $WHEELS
sample=""
for p in ../shared/data/enwiki-sample.xml.bz2 shared/data/enwiki-sample.xml.bz2; do
  [ -f "$p" ] && sample="$p" && break
done
if [ -n "$sample" ]; then
  mkdir -p data && cp "$sample" data/enwiki-sample.xml.bz2
else
  echo "note: no shared sample found; the training part will use random bytes (and say so)" >&2
fi
ls -l .whl
du -sh .whl ${sample:+data/enwiki-sample.xml.bz2}
echo 'carry: [".whl", "data/enwiki-sample.xml.bz2"]'
