#!/usr/bin/env bash
# One command for a lent GPU machine (repo root; the GPU image has torch, pytest, ncu and
# compute-sanitizer): build the CUDA extension, check the prefill kernel against float64, time it
# with both schedules against SDPA, sanitize it, and read the L2 counters behind the short-prompt
# gap (docs/performance.md, "Prefill kernel, warp-specialized"). Prints a short summary last;
# logs go to $OUT (or /tmp/device_check).
#
#   bash benchmarks/device_check.sh            # the prefill checks and timings (~4 min on an H100/H200)
#   bash benchmarks/device_check.sh decode     # also the decode GPU tests and --only flush,quick,list_loads
#   [BASE=.gpu/base] bash benchmarks/device_check.sh graphs
#       # only the CUDA-graph decode step: its GPU tests (and the worker's, with the .whl wheels
#       # below; and the C++ planner against the Python one), then benchmarks/model_step.py
#       # --launch-cost on the 1B shape (new, base, new, base with BASE; each tree runs its own script:
#       # copy this tree's benchmarks/model_step.py into BASE to measure both alike)
#   VARIANTS="nopp=-DKVPAGER_PREFILL_WS_PINGPONG=0;base=" NCU=0 bash benchmarks/device_check.sh
#       # times the prefill table for each build variant (kernels.py --variants) instead of once;
#       # the checks (tests, memcheck, racecheck) run on the first variant's build
#   BASE=.gpu/base NCU=0 bash benchmarks/device_check.sh
#       # A/B against a committed checkout: times base, working tree, base, working tree (each tree
#       # builds its own extension; the build cache is keyed by the sources). Here, first:
#       # git archive <commit> | (mkdir -p .gpu/base && tar -x -C .gpu/base); carry [".gpu"] there.
#   NCU_AB=1 NCU=0 VARIANTS="whole=-DKVPAGER_PREFILL_WS_NARROW=0;base=" bash benchmarks/device_check.sh
#       # also each variant's single launches under ncu (median of 3, clocks locked and free): the
#       # steadier A/B for changes of a few percent
#   NCU=0 bash benchmarks/device_check.sh      # without the L2 counters
#   PROFILE=1 bash benchmarks/device_check.sh  # also a full source-level ncu profile of 32 x 512 and
#       # 4K prompts: details and SASS exports (gzipped) in $OUT, summarized by ncu_sass_summary.py;
#       # and cuDNN's SDPA kernel on 32 x 512 (prefill_shape.py --sdpa cudnn), its details page
#
# The GPU image's grpcio (1.84) is older than our generated stubs need, so tests that import the
# worker's gRPC side (tests/gpu/test_worker_graph_steps_gpu.py) need newer wheels: here, first,
#   .venv/bin/pip download --no-deps -d .whl --python-version 3.12 --platform manylinux2014_x86_64 \
#       --only-binary=:all: grpcio==1.85.1 protobuf==7.36.2 grpcio-health-checking==1.85.1 \
#       grpcio-reflection==1.85.1 grpcio-status==1.85.1
# and carry [".whl"]: they are installed (--no-deps, offline) when present.
#
# Every step has a time limit (a kernel that deadlocks on its barriers would otherwise spin until
# the device command's own limit). The tests run with --noconftest: tests/conftest.py imports the gRPC client, whose health-check
# package the GPU image lacks, and the kernel tests need none of its fixtures.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
summary=()

nvidia-smi --query-gpu=name --format=csv,noheader
if ls .whl/grpcio-*.whl > /dev/null 2>&1; then python3 -m pip install -q --no-deps --no-index .whl/*.whl; fi
build="from kvpager.kernels import cuda; assert cuda.available(), cuda.load_error()"
variants=${VARIANTS:-}
base=${BASE:-}
[ -n "$base" ] && (cd "$base" && PYTHONPATH=$PWD timeout 600 python3 -c "$build" > "$out/build_base.log" 2>&1) &
if [ -n "$variants" ]; then
  # The checks below run on the first variant's build: kernels.py --variants builds each variant
  # in <tempdir>/kvpager_variant_<name> with its flags, and finds this one built.
  # The other variants build meanwhile, in the background.
  IFS=';' read -ra specs <<< "$variants"
  for spec in "${specs[@]:1}"; do
    name=$(echo "${spec%%=*}" | xargs)
    KVPAGER_EXT_DIR=/tmp/kvpager_variant_$name KVPAGER_EXT_CUDA_FLAGS=${spec#*=} timeout 600 python3 -c "$build" \
        > "$out/build_$name.log" 2>&1 &
  done
  first=${variants%%;*}
  export KVPAGER_EXT_DIR=/tmp/kvpager_variant_$(echo "${first%%=*}" | xargs) KVPAGER_EXT_CUDA_FLAGS=${first#*=}
fi
timeout 600 python3 -c "$build" || exit 1

if [ "${1:-}" = "graphs" ]; then
  worker_test=$(ls .whl/grpcio-*.whl > /dev/null 2>&1 && echo tests/gpu/test_worker_graph_steps_gpu.py)
  timeout 300 python3 -m pytest -q --noconftest -p no:cacheprovider tests/gpu/test_decode_graphs_gpu.py \
      tests/gpu/test_staging_gpu.py $worker_test "tests/gpu/test_cuda_kernels.py::test_host_planners_agree" \
      tests/unit/test_decode_stage_cpp.py > "$out/test_graphs.log" 2>&1
  summary+=("graph GPU tests: $(grep -E 'passed|failed|error' "$out/test_graphs.log" | tail -1)")
  wait   # the base tree's build
  for who in new ${base:+base new base}; do
    echo "=== $who" | tee -a "$out/launch_cost.log"
    (if [ "$who" = base ]; then cd "$base" && export PYTHONPATH=$PWD; fi
     timeout 150 python3 benchmarks/model_step.py --model 1b --workdir /tmp/kvpager_ckpt --launch-cost 32,64,128,256,32 \
         --context 1277 --steps 30 2>&1 | tee -a "$out/launch_cost.log")
  done
  printf '\n== summary\n'
  printf '%s\n' "${summary[@]}"
  exit 0
fi

timeout 300 python3 -m pytest -q --noconftest -p no:cacheprovider tests/gpu/test_prefill_gpu.py > "$out/test_prefill.log" 2>&1
summary+=("tests/gpu/test_prefill_gpu.py: $(grep -E 'passed|failed|error' "$out/test_prefill.log" | tail -1)")

for tool in memcheck racecheck; do
  for schedule in static dynamic; do
    line=$(timeout 200 compute-sanitizer --tool $tool python3 benchmarks/prefill_shape.py "ragged: 24 prompts 16-1K" \
           --schedule $schedule 2>&1 | grep -E "SUMMARY" | tail -1)
    summary+=("$tool, $schedule schedule: ${line:-no summary}")
  done
done

wait
if [ -n "$variants" ]; then
  (unset KVPAGER_EXT_DIR KVPAGER_EXT_CUDA_FLAGS
   timeout 600 python3 benchmarks/kernels.py --variants "$variants" --only prefill_kernel 2>&1 | grep -v "SDPA backends" \
       | tee "$out/prefill_kernel.log")
elif [ -n "$base" ]; then
  for who in base new base new; do   # alternately, so that drift on the machine shows as spread
    echo "=== $who" | tee -a "$out/prefill_kernel.log"
    (if [ "$who" = base ]; then cd "$base" && export PYTHONPATH=$PWD; fi
     timeout 200 python3 benchmarks/kernels.py --only prefill_kernel 2>&1 | grep -v "SDPA backends" \
         | tee -a "$out/prefill_kernel.log")
  done
else
  timeout 300 python3 benchmarks/kernels.py --only prefill_kernel 2>&1 | grep -v "SDPA backends" | tee "$out/prefill_kernel.log"
fi

metrics=gpu__time_duration.sum,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
for shape in "32 x 512 prompts" "8 x 2K prompts" "1 x 4K prompt"; do
  [ "${NCU:-1}" = 0 ] && break
  for schedule in static dynamic; do
    timeout 120 ncu --kernel-name regex:paged_prefill_ws --launch-skip 2 --launch-count 1 --metrics $metrics \
        python3 benchmarks/prefill_shape.py "$shape" --schedule $schedule > "$out/ncu.log" 2>&1
    vals=$(grep -E "duration|hit_rate|dram__bytes|hmma" "$out/ncu.log" | awk '{print $1"="$(NF)" "$(NF-1)}' | tr '\n' ' ')
    summary+=("ncu $shape, $schedule: $vals")
  done
done

if [ "${PROFILE:-0}" = 1 ]; then
  for shape in "32 x 512 prompts" "1 x 4K prompt"; do
    tag=$(echo "$shape" | tr -cd '0-9x')
    timeout 200 ncu --kernel-name regex:paged_prefill_ws --launch-skip 2 --launch-count 1 --set full \
        --import-source yes -o "/tmp/prefill_$tag" -f python3 benchmarks/prefill_shape.py "$shape" > /dev/null 2>&1
    ncu -i "/tmp/prefill_$tag.ncu-rep" --page details > "$out/details_$tag.txt" 2>&1
    ncu -i "/tmp/prefill_$tag.ncu-rep" --page source --csv --print-source sass > "/tmp/sass_$tag.csv" 2>/dev/null
    python3 benchmarks/ncu_sass_summary.py "/tmp/sass_$tag.csv" > "$out/stalls_$tag.txt" 2>&1
    gzip -c "/tmp/sass_$tag.csv" > "$out/sass_$tag.csv.gz"
    summary+=("profile $shape: $(grep -E '^(consumers|producer)' "$out/stalls_$tag.txt" | tr '\n' ' ')")
  done
  # The kernel we are measured against on the short prompts, profiled alike (its details page only).
  timeout 200 ncu --kernel-name regex:"cudnn|flash|fmha|sm90" --launch-skip 2 --launch-count 1 --set full \
      -o /tmp/sdpa_32x512 -f python3 benchmarks/prefill_shape.py "32 x 512 prompts" --sdpa cudnn > /dev/null 2>&1
  ncu -i /tmp/sdpa_32x512.ncu-rep --page details > "$out/details_sdpa_32x512.txt" 2>&1
  summary+=("profile cuDNN 32 x 512: $(grep -E 'Duration|Issue Slots Busy|SM Busy|L2 Hit Rate' \
      "$out/details_sdpa_32x512.txt" | awk '{print $1"="$NF}' | tr '\n' ' ')")
fi

# NCU_AB=1 with VARIANTS: the variants' single launches timed by ncu, clocks locked (base) and
# free (none), the median of 3 launches each: steadier than the prefill table, whose spread on the
# short shapes (8% and more between runs, 2026-11-26) hides changes of a few percent. Each variant
# runs with its build directory and its flags (a directory without its flags rebuilds, under ncu).
if [ "${NCU_AB:-0}" = 1 ] && [ -n "$variants" ]; then
  for shape in "32 x 512 prompts" "8 x 2K prompts" "1 x 4K prompt"; do
    for clocks in base none; do
      line="ncu $shape, clocks $clocks:"
      for spec in "${specs[@]}"; do
        name=$(echo "${spec%%=*}" | xargs)
        us=$(KVPAGER_EXT_DIR=/tmp/kvpager_variant_$name KVPAGER_EXT_CUDA_FLAGS=${spec#*=} timeout 90 \
             ncu --clock-control $clocks --kernel-name regex:paged_prefill_ws --launch-skip 2 --launch-count 3 \
             --metrics gpu__time_duration.sum python3 benchmarks/prefill_shape.py "$shape" --runs 6 2> /dev/null \
             | awk '/gpu__time_duration.sum/ {print $NF}' | sort -n | sed -n 2p)
        line="$line $name ${us:-?}"
      done
      summary+=("$line us")
    done
  done
fi

if [ "${1:-}" = "decode" ]; then
  timeout 600 python3 -m pytest -q --noconftest -p no:cacheprovider tests/gpu/test_cuda_kernels.py tests/gpu/test_fp8_model_gpu.py \
      tests/gpu/test_layer_ops_gpu.py tests/gpu/test_decode_graphs_gpu.py tests/gpu/test_cuda_swap.py \
      tests/gpu/test_staging_gpu.py $(ls .whl/grpcio-*.whl > /dev/null 2>&1 && echo tests/gpu/test_worker_graph_steps_gpu.py) \
      > "$out/test_decode.log" 2>&1
  summary+=("decode GPU tests: $(grep -E 'passed|failed|error' "$out/test_decode.log" | tail -1)")
  # flush: short shapes under both L2 flushes; quick: the loads x splits sweep; list_loads: the work
  # list with 2 and 4 loads in flight (on an H200 the kernel stopped near 78% of the copy ceiling)
  timeout 400 python3 benchmarks/kernels.py --only flush,quick,list_loads 2>&1 | tee "$out/decode.log"
fi

printf '\n== summary\n'
printf '%s\n' "${summary[@]}"
