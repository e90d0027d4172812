#!/usr/bin/env bash
# The one GPU run (one H200), in priority order. Each part is its own process under its own time limit, so a
# part that hangs costs only its own numbers; every part adds to one $OUT/throughput.json (each variant and
# trainer run written the moment it is measured), and parts.tsv says how each part ended:
#   a. rng probe: does a failed capture leave this torch's CUDA generator in capture mode; does the engine's
#      restore take it out (bench/probe_rng.py)                                                   T_A = 30 s
#   b. the CUDA engine tests (growth first; the compiled test asserts compile is still on)      T_B = 150 s
#   c. generate: the compiled and the uncompiled engine, each recording whether it fell back    T_C = 150 s
#   d. the GRPO and PPO steps, and a short GRPO run on --task toy whose reward must rise       T_D = 240 s
#   e. TRL's GRPOTrainer at grpo.py's sizes and step count                                      T_E = 150 s
#   f. what is left if time remains: SDPA kernels, numerics check, hf_dynamic, eval        T_F = 180 s
# Total limit 900 s; PARTS=a,b,c picks parts; T_A..T_F override the limits.
#
# On the GPU machine, from the repository root, after ../shared/device/prepare ran here:
#     bash .device/stage.sh a
#     source /tmp/stage/stage.sh b && bash bench/run_gpu.sh
# Every log and JSON goes under $OUT when set, else bench/out: env.txt, <part>.log, parts.tsv, throughput.json
# (and the trainers' logs under $OUT/work).
# --tiny: the same parts on the CPU with the tiny model at toy sizes (what tests/test_bench.py rehearses).
# PYTHON: the interpreter (default python3; the tests pass theirs).
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
if [ "$tiny" = 1 ]; then
  bench=(--device cpu --tiny)
  rise=()  # the tiny random model on the CPU: the toy reward is recorded, not required to rise
else
  bench=()
  rise=(--require-toy-rise)
fi
parts=",${PARTS:-a,b,c,d,e,f},"
json="$out/throughput.json"
rm -f "$out/parts.tsv" "$json"
py=${PYTHON:-python3}
tp=("$py" bench/throughput.py "${bench[@]}" --merge --out "$json" --work-dir "$out/work")

{
  timeout 20 "$py" -c 'import sys, torch, transformers
print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'
  "$py" -c 'import trl; print("trl", trl.__version__)' 2>/dev/null || echo "trl: not importable (the TRL comparison is skipped)"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null || true
} 2>&1 | tee "$out/env.txt"

# part NAME LIMIT CMD...: run CMD under its own limit (timeout signals the whole process group, trainers too)
part() {
  local name=$1 limit=$2 t=$SECONDS rc
  shift 2
  [[ "$parts" == *",${name%%_*},"* ]] || return 0
  echo "== part $name (limit $limit s)" | tee "$out/$name.log"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$out/$name.log"
  rc=${PIPESTATUS[0]}
  echo "$name $rc $((SECONDS - t))" >>"$out/parts.tsv"
  echo "part $name: exit $rc after $((SECONDS - t)) s" | tee -a "$out/$name.log"
}

part a_probe "${T_A:-30}" "$py" bench/probe_rng.py "$json"
part b_tests "${T_B:-150}" "$py" -m pytest tests/test_engine.py -k cuda -q -x -p no:cacheprovider -n 0  # one process
part c_generate "${T_C:-150}" "${tp[@]}" --sections generate --variants engine,engine_no_compile
# shellcheck disable=SC2086  # BENCH_ARGS: extra flags, split into words on purpose
part d_train "${T_D:-240}" "${tp[@]}" --sections grpo,ppo,toy "${rise[@]}" ${BENCH_ARGS:-}
part e_trl "${T_E:-150}" "${tp[@]}" --sections trl
part f_rest "${T_F:-180}" "${tp[@]}" --sections sdpa,check,generate,eval --variants hf_dynamic

"$py" bench/throughput.py --table-from "$json" 2>&1 | tee "$out/table.txt"
failed=$(awk '$2 != 0 {print $1}' "$out/parts.tsv" | tr '\n' ' ')
[ -z "$failed" ] || echo "parts that did not finish cleanly: $failed"
[ -z "$failed" ]
