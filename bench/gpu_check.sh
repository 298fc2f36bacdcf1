#!/bin/bash
# One device call: kernels' GPU tests (4 pytest processes in parallel: compiles are CPU-bound) + benchmark.
# Usage (device tool, carry .gpu): source .gpu/activate.sh && bash bench/gpu_check.sh "<bench args>" ["<sweep args>"]
# The optional sweep runs first (its log: $OUT/sweep.txt); the main benchmark's table is printed last.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
T=tests/test_kernels_gpu.py
run() { timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -x -p no:cacheprovider $T -k "$2" > $OUT/test_$1.log 2>&1; echo "tests[$1]: rc=$? $(tail -1 $OUT/test_$1.log)"; }
run a "test_identity" &
run b "test_swiglu_scale or test_dswiglu" &
run c "test_group_vector or test_mxfp8_exact" &
run d "test_pingpong" &
wait
if [ -n "$2" ]; then python3 bench/bench_grouped_gemm.py $2 > $OUT/sweep.txt 2>&1; grep "ours\|dense" $OUT/sweep.txt; fi
python3 bench/bench_grouped_gemm.py $1 2>&1 | tee $OUT/bench.txt | grep -v "^{'shape'"
