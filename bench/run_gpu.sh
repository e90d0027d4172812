#!/usr/bin/env bash
# The one GPU run: the rollout engine's correctness on the GPU, then the throughput benchmark, on one H200.
# About 6 to 8 minutes; hard limits keep it under 9 (sections that would start late are skipped, and the
# table is printed from the JSON whatever happened).
#
# On the GPU machine, from the repository root, after ../shared/device/prepare ran here:
#     bash .device/stage.sh a
#     source /tmp/stage/stage.sh b && bash bench/run_gpu.sh
# It writes env.txt, pytest.log, bench.log and throughput.json under $OUT when set, else bench/out.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -z "${SMOLLM2_GGUF:-}" ] || [ -z "${GSM8K_DIR:-}" ]; then
  echo "SMOLLM2_GGUF and GSM8K_DIR are unset: source /tmp/stage/stage.sh b first" >&2
  exit 2
fi
t0=$SECONDS

{
  python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__,
    "transformers", transformers.__version__, torch.cuda.get_device_name())'
  python3 -c 'import trl; print("trl", trl.__version__)' || echo "trl: not importable (the TRL comparison is skipped)"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
} 2>&1 | tee "$out/env.txt"

# 1. correctness: the CUDA tests (bf16 log-probs against the training forward, CUDA graphs against the eager
#    step with and without torch.compile, no stale weights after an update) and the fp32 CPU tests.
#    The first model load converts the GGUF once (~20 s); later loads read the cache.
timeout 110 python3 -m pytest tests/test_engine.py -q -x -p no:cacheprovider 2>&1 | tee "$out/pytest.log"
echo "tests done at $((SECONDS - t0)) s"

# 2. the benchmark: check, generate, hf_static, eval, grpo (grpo.py and TRL), ppo, train
# shellcheck disable=SC2086  # BENCH_ARGS: extra flags, split into words on purpose
timeout 400 python3 bench/throughput.py --out "$out/throughput.json" --work-dir /tmp/bench-work \
  --deadline-s 300 --subprocess-timeout-s 120 ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
status=${PIPESTATUS[0]}
if [ "$status" != 0 ] && [ -f "$out/throughput.json" ]; then
  echo "benchmark stopped (exit $status): the sections it finished" | tee -a "$out/bench.log"
  python3 bench/throughput.py --table-from "$out/throughput.json" 2>&1 | tee -a "$out/bench.log"
fi
echo "total $((SECONDS - t0)) s"
