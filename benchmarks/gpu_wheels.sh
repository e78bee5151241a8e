#!/usr/bin/env bash
# Fetch here (where PyPI is reachable) what the GPU benchmark needs on a device machine without
# network: pure-Python wheels into .whl/ (fla-core and einops, for the window's op row; EXTRA
# adds more) and the shared sample into data/. Both paths are git-ignored, so the
# device call carries them: carry [".whl", "data/enwiki-sample.xml.bz2"], then
# `bash benchmarks/gpu_plan.sh window` there installs the wheels itself (docs/gpu.md).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
# Pinned: one version of each (two stop the install there). All are py3-none-any.
WHEELS="einops==0.8.2 fla-core==0.6.0 ${EXTRA:-}"
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
