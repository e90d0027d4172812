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
# Not in the default list, only with PARTS=q (docs/throughput.md, "Part q"):
#   q. Qwen2.5 0.5B ($QWEN_GGUF) on GSM8K, in priority order (bench/qwen_part.py): the preflight at the study's
#      GRPO settings (256 prompts x 8); greedy accuracy on the whole test set before training; GRPO and PPO-small at
#      one token budget sized from a first step of each, Monte Carlo measurement on, each with its curves and its
#      test accuracy after; every result under $OUT/q the moment it exists, $OUT/q/summary.json after each step
#                                                                                                T_Q = 400 s
#      Without QWEN_GGUF (and without --tiny) it is skipped, its reason in q_qwen.log and $OUT/q/summary.json.
#      Q_ARGS: more flags of bench/qwen_part.py (e.g. Q_ARGS="--margin-s 40" keeps 40 s free at the end).
#
# On the GPU machine, from the repository root, after ../shared/device/prepare ran here:
#     bash .device/stage.sh a
#     source /tmp/stage/stage.sh b && bash bench/run_gpu.sh
# Part q, after QWEN=1 ../shared/device/prepare here and the eight `bash /tmp/stage/stage.sh q` calls there:
#     source /tmp/stage/stage.sh b && PARTS=q bash bench/run_gpu.sh
# Every log and JSON goes under $OUT when set, else bench/out: env.txt, <part>.log, parts.tsv, throughput.json
# (and the trainers' logs under $OUT/work; part q's runs under $OUT/q).
# --tiny: the same parts on the CPU with the tiny model at toy sizes (what tests/test_bench.py rehearses); part q
# with the tiny random Qwen2 (tiny-qwen2, whatever QWEN_GGUF says; Q_MODEL=FILE.gguf picks another model).
# PYTHON: the interpreter (default python3; the tests pass theirs).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
out=${OUT:-bench/out}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
tiny=0
if [ "${1:-}" = "--tiny" ]; then
  tiny=1
elif [ -n "${1:-}" ]; then
  echo "error: unknown argument $1 (usage: bash bench/run_gpu.sh [--tiny])" >&2
  exit 2
fi
parts=",${PARTS:-a,b,c,d,e,f},"
for p in ${parts//,/ }; do
  case "$p" in a | b | c | d | e | f | q) ;; *)
    echo "error: unknown part '$p' in PARTS=${PARTS:-} (the parts: a,b,c,d,e,f and q)" >&2
    exit 2
    ;;
  esac
done
smollm2=0  # does a part run the packaged SmolLM2 (a-f); part q runs Qwen2.5 alone
[[ "$parts" =~ ,[a-f], ]] && smollm2=1
if [ "$tiny" = 0 ] && { { [ "$smollm2" = 1 ] && [ -z "${SMOLLM2_GGUF:-}" ]; } || [ -z "${GSM8K_DIR:-}" ]; }; then
  need="SMOLLM2_GGUF and GSM8K_DIR are"
  [ "$smollm2" = 1 ] || need="GSM8K_DIR is"  # part q alone needs GSM8K, and QWEN_GGUF or it is skipped
  echo "error: $need unset: source /tmp/stage/stage.sh b first" >&2
  exit 2
fi
mkdir -p "$out"
if [ "$tiny" = 1 ]; then
  bench=(--device cpu --tiny)
  rise=()  # the tiny random model on the CPU: the toy reward is recorded, not required to rise
else
  bench=()
  rise=(--require-toy-rise)
fi
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
# part q: --tiny runs tiny-qwen2 (or $Q_MODEL); else $QWEN_GGUF, and an empty --model skips the part on the record
if [ "$tiny" = 1 ]; then qwen=(--tiny --model "${Q_MODEL:-}"); else qwen=(--model "${QWEN_GGUF:-}"); fi
# shellcheck disable=SC2086  # Q_ARGS: extra flags of bench/qwen_part.py (--margin-s 40), split into words on purpose
part q_qwen "${T_Q:-400}" "$py" bench/qwen_part.py --out "$out/q" --limit-s "${T_Q:-400}" --python "$py" "${qwen[@]}" ${Q_ARGS:-}

if [ "$smollm2" = 1 ]; then
  "$py" bench/throughput.py --table-from "$json" 2>&1 | tee "$out/table.txt"
fi
q_rc=$(awk '$1 == "q_qwen" {print $2}' "$out/parts.tsv" 2>/dev/null)
if [ "$q_rc" = 124 ] || [ "$q_rc" = 137 ]; then  # stopped by its limit: its table, from summary.json
  "$py" bench/qwen_part.py --show "$out/q/summary.json" 2>&1 | tee -a "$out/q_qwen.log"
fi
failed=$(awk '$2 != 0 {print $1}' "$out/parts.tsv" | tr '\n' ' ')
[ -z "$failed" ] || echo "parts that did not finish cleanly: $failed"
[ -z "$failed" ]
