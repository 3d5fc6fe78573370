#!/usr/bin/env bash
# Side-by-side timing of a committed checkout against the working tree, in one device command:
# each tree builds its own CUDA extension (the build cache is keyed by the sources), the working
# tree's prefill GPU tests and memcheck run, then `benchmarks/kernels.py --only PARTS` alternates
# base, new, base, new, so that drift on the machine shows as spread rather than as a difference.
#
#   git archive <commit> | (mkdir -p .gpu/base && tar -x -C .gpu/base)   # here; .gpu/ is ignored
#   bash benchmarks/ab_checkout.sh .gpu/base prefill_kernel              # there, with carry [".gpu"]
set -uo pipefail
base=${1:?usage: ab_checkout.sh BASE_DIR [PARTS]}
parts=${2:-prefill_kernel}
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/ab}
mkdir -p "$out"
build='from kvpager.kernels import cuda; assert cuda.available(), cuda.load_error()'
(cd "$base" && PYTHONPATH=$PWD timeout 500 python3 -c "$build" > "$out/build_base.log" 2>&1) &
PYTHONPATH=$PWD timeout 500 python3 -c "$build" || exit 1
wait
export PYTHONPATH=$PWD
timeout 240 python3 -m pytest -q --noconftest -p no:cacheprovider -x tests/gpu/test_prefill_gpu.py > "$out/test_prefill.log" 2>&1
echo "tests: $(grep -E 'passed|failed|error' "$out/test_prefill.log" | tail -1)"
echo "memcheck: $(timeout 150 compute-sanitizer --tool memcheck python3 benchmarks/prefill_shape.py "ragged: 24 prompts 16-1K" 2>&1 | grep SUMMARY | tail -1)"
for who in base new base new; do
  echo "=== $who"
  if [ "$who" = base ]; then
    (cd "$base" && PYTHONPATH=$PWD timeout 200 python3 benchmarks/kernels.py --only "$parts" 2>&1 | grep -v "SDPA backends")
  else
    timeout 200 python3 benchmarks/kernels.py --only "$parts" 2>&1 | grep -v "SDPA backends"
  fi
done
