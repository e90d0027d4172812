#!/usr/bin/env bash
# The one GPU run, on one H200, in under 8 minutes; each step has its own time limit:
#   1. the CUDA growth test (one engine grows: T 16 -> 80, 6 -> 70 rows, prompt bucket 128 -> 192; no exception,
#      the same tokens as a fresh engine), then the other CUDA engine tests          <= 150 s
#   2. the SDPA kernel chosen for the engine's decode and prefill shapes              <= 60 s
#   3. the benchmark (sections that would start after its deadline are skipped; the table is printed from
#      the JSON whatever happened)                                                     <= 240 s
# Total limit 20 + 150 + 60 + 240 = 470 s.
#
# On the GPU machine, from the repository root, after ../shared/device/prepare ran here:
#     bash .device/stage.sh a
#     source /tmp/stage/stage.sh b && bash bench/run_gpu.sh
# Every log and JSON goes under $OUT when set, else bench/out: env.txt, tests.log, sdpa.log, sdpa.json,
# bench.log, throughput.json (and the trainers' logs under $OUT/work).
# --tiny: the same flow on the CPU with the tiny model at toy sizes (what tests/test_bench.py rehearses).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
tiny=0
if [ "${1:-}" = "--tiny" ]; then
  tiny=1
elif [ -n "${1:-}" ]; then
  echo "error: unknown argument $1 (usage: bash bench/run_gpu.sh [--tiny])" >&2
  exit 2
fi
if [ "$tiny" = 0 ] && { [ -z "${SMOLLM2_GGUF:-}" ] || [ -z "${GSM8K_DIR:-}" ]; }; then
  echo "error: SMOLLM2_GGUF and GSM8K_DIR are unset: source /tmp/stage/stage.sh b first" >&2
  exit 2
fi
tests=(tests/test_engine.py -k cuda)  # on the CPU they are collected and skipped: the flow only
if [ "$tiny" = 1 ]; then
  bench=(--device cpu --tiny --sections sdpa,check,generate,eval,ppo)
  t_tests=200 t_sdpa=300 t_bench=700 deadline=0 t_trainer=300  # a shared CPU: generous limits, no deadline
else
  bench=()
  t_tests=150 t_sdpa=60 t_bench=240 deadline=170 t_trainer=90
fi
t0=$SECONDS

{
  timeout 20 python3 -c 'import sys, torch, transformers
print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'
  python3 -c 'import trl; print("trl", trl.__version__)' 2>/dev/null || echo "trl: not importable (the TRL comparison is skipped)"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null || true
} 2>&1 | tee "$out/env.txt"

# 1. the growth test first (-x: stop at the first failure), then the other CUDA tests of the engine
echo "== 1. engine tests: ${tests[*]}" | tee "$out/tests.log"
timeout "$t_tests" python3 -m pytest "${tests[@]}" -q -x -p no:cacheprovider 2>&1 | tee -a "$out/tests.log"
echo "tests: exit ${PIPESTATUS[0]} at $((SECONDS - t0)) s" | tee -a "$out/tests.log"

# 2. the SDPA kernels
echo "== 2. SDPA kernels" | tee "$out/sdpa.log"
timeout "$t_sdpa" python3 bench/throughput.py "${bench[@]}" --sections sdpa --out "$out/sdpa.json" \
  --work-dir "$out/work" 2>&1 | tee -a "$out/sdpa.log"
echo "sdpa: exit ${PIPESTATUS[0]} at $((SECONDS - t0)) s" | tee -a "$out/sdpa.log"

# 3. the benchmark
echo "== 3. benchmark" | tee "$out/bench.log"
# shellcheck disable=SC2086  # BENCH_ARGS: extra flags, split into words on purpose
timeout "$t_bench" python3 bench/throughput.py "${bench[@]}" --out "$out/throughput.json" --work-dir "$out/work" \
  --deadline-s "$deadline" --subprocess-timeout-s "$t_trainer" ${BENCH_ARGS:-} 2>&1 | tee -a "$out/bench.log"
status=${PIPESTATUS[0]}
if [ "$status" != 0 ] && [ -f "$out/throughput.json" ]; then
  echo "benchmark stopped (exit $status): the sections it finished" | tee -a "$out/bench.log"
  python3 bench/throughput.py --table-from "$out/throughput.json" 2>&1 | tee -a "$out/bench.log"
fi
echo "total $((SECONDS - t0)) s" | tee -a "$out/bench.log"
exit "$status"
