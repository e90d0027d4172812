#!/usr/bin/env bash
# sweep.sh: the study's three experiments (critic sweep, head-to-head, label regimes), every run seeded and
# resumable, then the report (report.py). ./sweep.sh --help says how; ./sweep.sh --smoke runs it all in minutes.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python}
STEP_CAP=10 # budget-matched runs may take up to this many times the reference's steps: the budget ends them

usage() {
  cat <<'EOF'
usage: ./sweep.sh [options] [-- flags for every trainer]

Runs the experiments into OUT/<experiment>/<method>-<variant>-s<seed>, then writes the report to OUT/report/
(report.md, summary.csv, runs.csv, crossover.png, curves.png, errors.png).

  critic   ppo.py --critic none, small, medium, large, full, for the scale's steps (MC measured at the prompt
           and at 2 states inside each completion, for the within-prompt error)
  h2h      matched compute: grpo.py first, for the scale's steps; its generated training tokens (results.json)
           are the budget. Then every PPO critic and dpo.py --pairs gold, online and offline, with
           --token-budget = that budget. MC tokens are counted apart: they never train.
  labels   dpo.py with --pairs self and gold, offline and online, for the scale's steps

options:
  --experiments LIST  comma-separated, from critic,h2h,labels (default: all three)
  --seeds LIST        comma-separated seeds (default: 1,2,3)
  --model NAME        the trainers' --model (default: smollm2)
  --scale S           the trainers' --scale: auto, study or cpu (default: auto)
  --out DIR           runs and report (default: runs/sweep; runs/smoke with --smoke)
  --launcher L        seq: one run after another (the default)
                      gpus: one run per GPU at a time, on this machine
                      torchrun: one run after another, each data-parallel over the GPUs (torchrun --standalone)
                      slurm: one array task per run (sbatch); with --gpus N > 1 each task runs torchrun over N
  --gpus N            GPUs to use (default: all visible); alone, it means --launcher gpus
  --jobs N            with --launcher seq: N runs at once on this machine's CPU (default 1; with --smoke, 2
                      when the machine has 2 cores or more, each run on one thread)
  --sbatch "ARGS"     extra sbatch options for --launcher slurm, e.g. "--partition=gpu --time=24:00:00"
  --dry-run           print what would run, run nothing
  --smoke             every experiment with --model tiny, seed 1, 2 steps, tiny evaluations, on the CPU
  --report-only       write the report from the runs already in OUT
  -h, --help          this text

A finished run (results.json) is skipped, an interrupted one resumes from its checkpoint, a damaged results.json
is named, kept aside (results.json.damaged-TIME) and the run redone from its checkpoint. A failed run is recorded
(OUT/logs/<experiment>/<run>.log and .status), the others go on, and the summary names it (exit status 1).
EOF
}

die() {
  echo "error: $*" >&2
  exit 2
}

# ======================================================================================================
# flags
# ======================================================================================================
EXPERIMENTS=critic,h2h,labels
SEEDS=1,2,3
SEEDS_GIVEN=0
MODEL=smollm2
SCALE=auto
OUT=""
LAUNCHER=""
GPUS=""
JOBS=""
JOBS_GIVEN=0
SBATCH_ARGS=""
DRY_RUN=0
SMOKE=0
REPORT_ONLY=0
SLURM_TASK=""
EXTRA=()

while [[ $# -gt 0 ]]; do
  case $1 in
  --) shift; EXTRA=("$@"); break ;;
  --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
  -h | --help) usage; exit 0 ;;
  --dry-run) DRY_RUN=1; shift; continue ;;
  --smoke) SMOKE=1; shift; continue ;;
  --report-only) REPORT_ONLY=1; shift; continue ;;
  --experiments | --seeds | --model | --scale | --out | --launcher | --gpus | --jobs | --sbatch | --slurm-task)
    [[ $# -ge 2 ]] || die "$1 needs a value (./sweep.sh --help)" ;;
  *) die "unknown option $1 (./sweep.sh --help)" ;;
  esac
  case $1 in
  --experiments) EXPERIMENTS=$2 ;;
  --seeds) SEEDS=$2; SEEDS_GIVEN=1 ;;
  --model) MODEL=$2 ;;
  --scale) SCALE=$2 ;;
  --out) OUT=$2 ;;
  --launcher) LAUNCHER=$2 ;;
  --gpus) GPUS=$2 ;;
  --jobs) JOBS=$2 JOBS_GIVEN=1 ;;
  --sbatch) SBATCH_ARGS=$2 ;;
  --slurm-task) SLURM_TASK=$2 ;; # internal: the array task's run, by its index in the plan
  esac
  shift 2
done

if ((SMOKE)); then
  MODEL=tiny
  SCALE=study # the smoke flags below are the scale; the trainers must not rescale them
  ((SEEDS_GIVEN)) || SEEDS=1
  OUT=${OUT:-runs/smoke}
  if [[ -z $JOBS ]]; then # one run per core, two at most: the runs are small
    JOBS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1) # nproc reads OMP_NUM_THREADS
    ((JOBS > 2)) && JOBS=2
  fi
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} # one thread per run: far faster on a small, shared CPU
fi
JOBS=${JOBS:-1}
OUT=${OUT:-runs/sweep}
[[ $OUT == /* ]] || OUT="$PWD/$OUT"

IFS=, read -ra items <<<"$EXPERIMENTS"
EXP_LIST=()
for e in ${items[@]+"${items[@]}"}; do
  case $e in
  "") ;;
  critic | h2h | labels) [[ " ${EXP_LIST[*]-} " == *" $e "* ]] || EXP_LIST+=("$e") ;;
  *) die "unknown experiment '$e': choose from critic, h2h, labels" ;;
  esac
done
[[ ${#EXP_LIST[@]} -gt 0 ]] || die "--experiments is empty: choose from critic, h2h, labels"
IFS=, read -ra items <<<"$SEEDS"
SEED_LIST=()
for s in ${items[@]+"${items[@]}"}; do
  [[ -z $s ]] && continue
  [[ $s =~ ^[0-9]+$ ]] || die "--seeds $SEEDS: '$s' is not a seed (a whole number); e.g. --seeds 1,2,3"
  SEED_LIST+=("$s")
done
[[ ${#SEED_LIST[@]} -gt 0 ]] || die "--seeds is empty: give one or more seeds, e.g. --seeds 1,2,3"
case $SCALE in auto | study | cpu) ;; *) die "unknown --scale '$SCALE': use auto, study or cpu" ;; esac
[[ -z $GPUS || $GPUS =~ ^[1-9][0-9]*$ ]] || die "--gpus $GPUS is not a positive number"
[[ $JOBS =~ ^[1-9][0-9]*$ ]] || die "--jobs $JOBS is not a positive number"
if [[ -z $LAUNCHER ]]; then
  if [[ -n $GPUS ]]; then LAUNCHER=gpus; else LAUNCHER=seq; fi
fi
case $LAUNCHER in seq | gpus | torchrun | slurm) ;; *) die "unknown --launcher '$LAUNCHER': use seq, gpus, torchrun or slurm" ;; esac
[[ $LAUNCHER == seq || $JOBS_GIVEN == 0 ]] || die "--jobs runs several runs at once on the CPU: it goes with --launcher seq"

# ======================================================================================================
# the trainers' flags
# ======================================================================================================
COMMON=(--model "$MODEL" --scale "$SCALE" --no-progress)
SMOKE_STEPS=2
SMOKE_ALL=(--max-new-tokens 8 --eval-every 1 --eval-size 8 --test-size 8 --eval-max-new-tokens 8)
SMOKE_PPO=(--eval-batch-size 8 --batch-size 4 --micro-batch-size 4 --num-minibatches 2 --mc-every 1 --mc-prompts 2 --mc-samples 4)
SMOKE_GRPO=(--eval-batch-size 8 --batch-size 2 --group-size 2 --micro-batch-size 4 --num-minibatches 2 --mc-every 1 --mc-prompts 2 --mc-samples 4)
# --eval-batch-size 2: offline DPO samples its pairs in chunks of this many prompts, so a small budget stops it early
SMOKE_DPO=(--eval-batch-size 2 --batch-size 2 --micro-batch-size 2 --samples-per-prompt 2 --offline-prompts 8)

# ======================================================================================================
# the plan: one entry per run; h2h's GRPO runs come first, its budget-matched runs last
# ======================================================================================================
P_EXP=() P_NAME=() P_SCRIPT=() P_SEED=() P_ARGS=() P_REF=() P_DIR=()

add_run() { # experiment name script seed reference-dir trainer-flags...
  P_EXP+=("$1") P_NAME+=("$2") P_SCRIPT+=("$3") P_SEED+=("$4") P_REF+=("$5")
  P_ARGS+=("${*:6}")
  P_DIR+=("$OUT/$1/$2-s$4")
}

has_exp() { [[ " ${EXP_LIST[*]} " == *" $1 "* ]]; }

CRITICS=(none small medium large full)
if has_exp h2h; then
  for s in "${SEED_LIST[@]}"; do add_run h2h grpo-group grpo.py "$s" ""; done
fi
if has_exp critic; then
  for s in "${SEED_LIST[@]}"; do
    for c in "${CRITICS[@]}"; do add_run critic "ppo-$c" ppo.py "$s" "" --critic "$c" --mc-states 2; done
  done
fi
if has_exp labels; then
  for s in "${SEED_LIST[@]}"; do
    for pairs in self gold; do
      add_run labels "dpo-$pairs-offline" dpo.py "$s" "" --pairs "$pairs"
      add_run labels "dpo-$pairs-online" dpo.py "$s" "" --pairs "$pairs" --online
    done
  done
fi
if has_exp h2h; then
  for s in "${SEED_LIST[@]}"; do
    ref="$OUT/h2h/grpo-group-s$s"
    for c in "${CRITICS[@]}"; do add_run h2h "ppo-$c" ppo.py "$s" "$ref" --critic "$c"; done
    add_run h2h dpo-gold-online dpo.py "$s" "$ref" --pairs gold --online
    add_run h2h dpo-gold-offline dpo.py "$s" "$ref" --pairs gold
  done
fi
N_RUNS=${#P_DIR[@]}

# ======================================================================================================
# one run
# ======================================================================================================
declare -A BUDGET=() # reference folder -> "tokens steps", read once from its results.json
CMD=()
CHILD=""
STOP=0
POOL=()

# shellcheck disable=SC2329  # invoked by the trap
on_signal() { # finish the current step, save, exit: the trainers do that on SIGTERM; --resume continues
  STOP=1
  for pid in ${CHILD:+"$CHILD"} ${POOL[@]+"${POOL[@]}"}; do kill -TERM "$pid" 2>/dev/null || true; done
}
trap on_signal INT TERM

launcher_prefix() {
  if [[ $LAUNCHER == torchrun || ($LAUNCHER == slurm && ${GPUS:-1} -gt 1) ]]; then
    echo "torchrun --standalone --nproc_per_node=${GPUS}"
  else
    echo "$PYTHON"
  fi
}

# build_cmd i [symbolic]: the run's command into CMD. A budget-matched run reads its reference's results.json
# (symbolic: a placeholder for a budget not known yet, for --dry-run). On failure: BUILD_ERR, return 1.
BUILD_ERR=""
build_cmd() {
  local i=$1 symbolic=${2:-0} script=${P_SCRIPT[$1]} ref=${P_REF[$1]}
  local -a args=() smoke=()
  read -ra args <<<"${P_ARGS[$i]}"
  if ((SMOKE)); then
    smoke=("${SMOKE_ALL[@]}")
    case $script in
    ppo.py) smoke+=("${SMOKE_PPO[@]}") ;;
    grpo.py) smoke+=("${SMOKE_GRPO[@]}") ;;
    dpo.py) smoke+=("${SMOKE_DPO[@]}") ;;
    esac
    [[ -n $ref ]] || smoke+=(--total-steps "$SMOKE_STEPS")
    # the tiny random model never solves GSM8K (every reward 0): the toy task gives the critics something to learn
    # and DPO self pairs; gold pairs are GSM8K's reference solutions, so those runs stay on GSM8K
    [[ ${P_ARGS[$i]} == *"--pairs gold"* ]] || smoke+=(--task toy)
  fi
  # shellcheck disable=SC2207  # the prefix is one or three plain words
  CMD=($(launcher_prefix) "$script" --run-dir "${P_DIR[$i]}" --seed "${P_SEED[$i]}" "${COMMON[@]}"
    ${args[@]+"${args[@]}"} ${smoke[@]+"${smoke[@]}"} ${EXTRA[@]+"${EXTRA[@]}"})
  [[ -n $ref ]] || return 0
  local tokens steps out
  if [[ -z ${BUDGET[$ref]:-} && -f $ref/results.json ]]; then
    if out=$("$PYTHON" "$REPO/report.py" --budget "$ref" 2>&1); then
      BUDGET[$ref]=$out
    else
      BUILD_ERR="no budget: $(tail -n 1 <<<"$out")"
      return 1
    fi
  fi
  if [[ -n ${BUDGET[$ref]:-} ]]; then
    read -r tokens steps <<<"${BUDGET[$ref]}"
  elif ((symbolic)); then
    tokens="<generated_tokens of $ref>" steps="<its steps>"
  else
    BUILD_ERR="no budget: the reference run $ref has no results.json (failed or not run)"
    return 1
  fi
  if [[ $script == dpo.py && ${P_ARGS[$i]} != *--online* ]]; then
    # offline: the budget pays for sampling the pairs once (from as many prompts as it takes); then the
    # reference's number of steps
    CMD+=(--token-budget "$tokens" --offline-prompts 1000000 --total-steps "$steps")
  elif ((symbolic)) && [[ -z ${BUDGET[$ref]:-} ]]; then
    CMD+=(--token-budget "$tokens" --total-steps "<$STEP_CAP x its steps>")
  else
    CMD+=(--token-budget "$tokens" --total-steps "$((STEP_CAP * steps))")
  fi
}

label() { echo "${P_EXP[$1]}/$(basename "${P_DIR[$1]}")"; }
log_path() { echo "$OUT/logs/${P_EXP[$1]}/$(basename "${P_DIR[$1]}").log"; }
status_path() { echo "$OUT/logs/${P_EXP[$1]}/$(basename "${P_DIR[$1]}").status"; }

# run_one i state [slot]: run (or resume) one run, its output into its log; record ok, failed or stopped.
# A slot is a GPU id (the run sees that GPU alone) or cpu<k> (one of --jobs runs on the CPU).
run_one() {
  local i=$1 state=$2 slot=${3:-} log status rc=0 t0=$SECONDS gpu=""
  [[ -n $slot && $slot != cpu* ]] && gpu=$slot
  log=$(log_path "$i") status=$(status_path "$i")
  if [[ $state == finished ]]; then
    echo "skip  $(label "$i"): finished"
    return 0
  fi
  mkdir -p "$(dirname "$log")"
  if ! build_cmd "$i"; then
    echo "FAIL  $(label "$i"): $BUILD_ERR"
    echo "=== $(date '+%F %T') $BUILD_ERR" >>"$log"
    echo "failed 1 0 $BUILD_ERR" >"$status"
    return 0
  fi
  local note=""
  if [[ $state == resume ]]; then
    CMD+=(--resume)
    note=" (resuming from its checkpoint)"
  fi
  echo "run   $(label "$i")${gpu:+ on GPU $gpu}$note: ${CMD[*]}"
  echo "=== $(date '+%F %T') ${CMD[*]}" >>"$log"
  if [[ -n $gpu ]]; then
    CUDA_VISIBLE_DEVICES=$gpu "${CMD[@]}" >>"$log" 2>&1 &
  else
    "${CMD[@]}" >>"$log" 2>&1 &
  fi
  CHILD=$!
  wait "$CHILD" || rc=$?
  while kill -0 "$CHILD" 2>/dev/null; do # a signal interrupted wait: the trainer is saving; wait for it
    rc=0
    wait "$CHILD" || rc=$?
  done
  CHILD=""
  local secs=$((SECONDS - t0))
  if [[ $rc == 0 && -f ${P_DIR[$i]}/results.json ]]; then
    echo "ok 0 $secs" >"$status"
    echo "done  $(label "$i") in ${secs}s"
  elif [[ $rc == 0 ]]; then
    echo "stopped 0 $secs" >"$status"
    echo "stop  $(label "$i"): stopped by a signal, checkpoint saved; ./sweep.sh resumes it"
  else
    echo "failed $rc $secs" >"$status"
    echo "FAIL  $(label "$i"): exit $rc after ${secs}s; last lines of $log:"
    tail -n 3 "$log" | sed 's/^/      /'
  fi
}

# states i...: finished, resume or new for each run (report.py --check; a damaged results.json is set aside)
declare -A STATE=()
states() {
  local -a dirs=() got=()
  local i
  for i in "$@"; do dirs+=("${P_DIR[$i]}"); done
  local flag=()
  ((DRY_RUN)) && flag=(--dry-run)
  mapfile -t got < <("$PYTHON" "$REPO/report.py" --check "${dirs[@]}" ${flag[@]+"${flag[@]}"})
  [[ ${#got[@]} == "$#" ]] || die "report.py --check failed (see above)"
  local k=0
  for i in "$@"; do STATE[$i]=${got[$k]}; k=$((k + 1)); done
}

# ======================================================================================================
# launchers
# ======================================================================================================
gpu_ids() { # the GPUs to use: CUDA_VISIBLE_DEVICES' entries, else nvidia-smi's count, limited by --gpus
  local -a ids=()
  if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -ra ids <<<"$CUDA_VISIBLE_DEVICES"
  elif command -v nvidia-smi >/dev/null; then
    mapfile -t ids < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null || true)
  fi
  if [[ -n $GPUS ]]; then
    if ((${#ids[@]} == 0)); then mapfile -t ids < <(seq 0 $((GPUS - 1))); fi # a dry run on a machine without GPUs
    ids=("${ids[@]:0:$GPUS}")
  fi
  ((${#ids[@]} > 0)) || die "no GPU found (nvidia-smi): pass --gpus N, or use --launcher seq"
  echo "${ids[@]}"
}

run_seq() { # indices...
  local i
  for i in "$@"; do
    ((STOP)) && return 0
    run_one "$i" "${STATE[$i]}"
  done
}

run_pool() { # indices...: one run per slot (a GPU, or one of --jobs on the CPU) at a time; a freed slot takes the next
  local -a ids
  local found
  if [[ $LAUNCHER == gpus ]]; then
    found=$(gpu_ids) || exit 2
    read -ra ids <<<"$found"
    echo "one run per GPU on GPUs ${ids[*]}"
  else
    mapfile -t ids < <(seq 1 "$JOBS" | sed 's/^/cpu/')
    echo "$JOBS runs at once on the CPU"
  fi
  declare -A busy=()
  local i g free
  for i in "$@"; do
    ((STOP)) && break
    if [[ ${STATE[$i]} == finished ]]; then
      run_one "$i" finished
      continue
    fi
    build_cmd "$i" >/dev/null 2>&1 || true # read the reference's budget here, once, before forking
    free=""
    while [[ -z $free ]]; do
      for g in "${ids[@]}"; do
        if [[ -z ${busy[$g]:-} ]] || ! kill -0 "${busy[$g]}" 2>/dev/null; then free=$g && break; fi
      done
      [[ -n $free ]] || sleep 1
      ((STOP)) && break 2
    done
    (
      POOL=()
      trap on_signal INT TERM
      run_one "$i" "${STATE[$i]}" "$free"
    ) &
    busy[$free]=$!
    POOL=("${busy[@]}")
  done
  while [[ -n $(jobs -pr) ]]; do wait || true; done # a signal interrupts wait; the runs are still saving
  POOL=()
}

run_indices() { # indices...: with the chosen launcher
  if [[ $LAUNCHER == gpus || ($LAUNCHER == seq && $JOBS -gt 1) ]]; then run_pool "$@"; else run_seq "$@"; fi
}

N_OK=0
summary() { # one line per unfinished run, then the count (N_OK); returns 1 when a run failed
  local i n_ok=0 st rc=0
  local -a bad=()
  for ((i = 0; i < N_RUNS; i++)); do
    if [[ -f ${P_DIR[$i]}/results.json ]]; then
      n_ok=$((n_ok + 1))
      continue
    fi
    st=$(cut -d' ' -f1-2 "$(status_path "$i")" 2>/dev/null || echo "not-run")
    case $st in
    failed*) bad+=("$(label "$i") (exit ${st#failed }; log $(log_path "$i"))"); rc=1 ;;
    stopped*) bad+=("$(label "$i") (stopped; ./sweep.sh resumes it)") ;;
    *) bad+=("$(label "$i") (not run)") ;;
    esac
  done
  N_OK=$n_ok
  echo "sweep: $n_ok of $N_RUNS runs finished in $OUT"
  local b
  for b in ${bad[@]+"${bad[@]}"}; do echo "  unfinished: $b"; done
  return $rc
}

make_report() {
  "$PYTHON" "$REPO/report.py" "$OUT"
}

submit_slurm() { # one array task per unfinished run; h2h's budget-matched runs after the GRPO runs; then the report
  ((DRY_RUN)) || command -v sbatch >/dev/null || die "--launcher slurm needs sbatch, which is not on PATH"
  local -a first=() second=()
  local i
  for ((i = 0; i < N_RUNS; i++)); do
    [[ ${STATE[$i]} == finished ]] && continue
    if [[ -n ${P_REF[$i]} ]]; then second+=("$i"); else first+=("$i"); fi
  done
  mkdir -p "$OUT/slurm" "$OUT/logs"
  local task="$OUT/slurm/task.sh"
  {
    echo "#!/usr/bin/env bash"
    echo "# one run of the sweep per array task (written by sweep.sh); SIGTERM reaches the trainer, which saves"
    printf 'cd %q\n' "$REPO"
    local -a again=(--experiments "$EXPERIMENTS" --seeds "$SEEDS" --model "$MODEL" --scale "$SCALE" --out "$OUT"
      --launcher slurm ${GPUS:+--gpus "$GPUS"})
    ((SMOKE)) && again+=(--smoke)
    printf 'exec ./sweep.sh'
    printf ' %q' "${again[@]}"
    # shellcheck disable=SC2016  # expanded by the task, not here
    printf ' --slurm-task "$SLURM_ARRAY_TASK_ID"'
    ((${#EXTRA[@]})) && printf ' %q' -- "${EXTRA[@]}"
    printf '\n'
  } >"$task"
  chmod +x "$task"
  local -a opts
  # shellcheck disable=SC2206  # the user's sbatch options, split into words on purpose
  opts=(--parsable --requeue --open-mode=append --signal=B:TERM@300 --gres="gpu:${GPUS:-1}"
    --output="$OUT/logs/slurm-%A_%a.out" $SBATCH_ARGS)
  local dep="" jid
  if ((${#first[@]})); then
    local list
    list=$(IFS=,; echo "${first[*]}")
    if ((DRY_RUN)); then jid=A; echo "sbatch ${opts[*]} --job-name=sweep --array=$list $task"; else
      jid=$(sbatch "${opts[@]}" --job-name=sweep --array="$list" "$task")
      echo "submitted runs $list as array job $jid"
    fi
    dep="--dependency=afterany:${jid%%;*}"
  fi
  if ((${#second[@]})); then
    local list
    list=$(IFS=,; echo "${second[*]}")
    if ((DRY_RUN)); then jid=B; echo "sbatch ${opts[*]} ${dep} --job-name=sweep-h2h --array=$list $task"; else
      jid=$(sbatch "${opts[@]}" ${dep:+"$dep"} --job-name=sweep-h2h --array="$list" "$task")
      echo "submitted the budget-matched runs $list as array job $jid (after the GRPO runs)"
    fi
    dep="--dependency=afterany:${jid%%;*}"
  fi
  local report_cmd
  report_cmd="cd $(printf %q "$REPO") && $(printf %q "$PYTHON") report.py $(printf %q "$OUT")"
  if ((DRY_RUN)); then echo "sbatch --parsable ${dep} --job-name=sweep-report --output=$OUT/logs/report-%j.out --wrap '$report_cmd'"; else
    jid=$(sbatch --parsable ${dep:+"$dep"} --job-name=sweep-report --output="$OUT/logs/report-%j.out" --wrap "$report_cmd")
    echo "submitted the report as job $jid; watch with: squeue --me; logs in $OUT/logs/"
  fi
}

# ======================================================================================================
# main
# ======================================================================================================
cd "$REPO"
if ((REPORT_ONLY)); then
  make_report
  exit 0
fi

if [[ -n $SLURM_TASK ]]; then # inside an array task: one run, requeued when a signal stopped it
  [[ $SLURM_TASK =~ ^[0-9]+$ && $SLURM_TASK -lt $N_RUNS ]] || die "--slurm-task $SLURM_TASK is not a run of this plan"
  [[ ${GPUS:-1} -gt 1 ]] && LAUNCHER=torchrun || LAUNCHER=seq
  states "$SLURM_TASK"
  run_one "$SLURM_TASK" "${STATE[$SLURM_TASK]}"
  st=$(cut -d' ' -f1 "$(status_path "$SLURM_TASK")" 2>/dev/null || echo ok)
  if [[ $st == stopped && -n ${SLURM_JOB_ID:-} ]]; then
    scontrol requeue "${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}${SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}" || true
  fi
  [[ $st == failed ]] && exit 1
  exit 0
fi

if [[ $LAUNCHER == torchrun ]]; then
  ((DRY_RUN)) || command -v torchrun >/dev/null || die "--launcher torchrun needs torchrun on PATH"
  if [[ -z $GPUS ]]; then
    gpu_list=$(gpu_ids) || exit 2
    GPUS=$(wc -w <<<"$gpu_list")
  fi
fi

if ((!DRY_RUN)); then
  mkdir -p "$OUT"
  if command -v flock >/dev/null; then # two sweeps on one folder would run the same runs twice
    exec 9>"$OUT/.sweep.lock"
    flock -n 9 || die "another sweep.sh is running on $OUT (it holds $OUT/.sweep.lock)"
  fi
fi
all=()
for ((i = 0; i < N_RUNS; i++)); do all+=("$i"); done
states "${all[@]}"
echo "sweep: ${#EXP_LIST[@]} experiment(s) (${EXP_LIST[*]}), seeds ${SEED_LIST[*]}, model $MODEL, scale $SCALE," \
  "launcher $LAUNCHER$([[ $LAUNCHER == seq && $JOBS -gt 1 ]] && echo " ($JOBS at once)"): $N_RUNS runs into $OUT"
if ((!DRY_RUN)); then
  for ((i = 0; i < N_RUNS; i++)); do printf '%s\t%s\t%s\n' "${P_EXP[$i]}" "${P_NAME[$i]}" "${P_DIR[$i]}"; done >"$OUT/plan.tsv"
fi

if ((DRY_RUN)); then
  for ((i = 0; i < N_RUNS; i++)); do
    if [[ ${STATE[$i]} == finished ]]; then
      echo "# $(label "$i"): finished"
      continue
    fi
    if ! build_cmd "$i" 1; then
      echo "# $(label "$i"): $BUILD_ERR"
      continue
    fi
    [[ ${STATE[$i]} == resume ]] && CMD+=(--resume)
    [[ $LAUNCHER == gpus ]] && CMD=("CUDA_VISIBLE_DEVICES=<free GPU>" "${CMD[@]}")
    echo "${CMD[*]}"
  done
  [[ $LAUNCHER == slurm ]] && submit_slurm
  exit 0
fi

if [[ $LAUNCHER == slurm ]]; then
  submit_slurm
  exit 0
fi
first=() second=()
for ((i = 0; i < N_RUNS; i++)); do
  if [[ -n ${P_REF[$i]} ]]; then second+=("$i"); else first+=("$i"); fi
done
t0=$SECONDS
run_indices ${first[@]+"${first[@]}"}
run_indices ${second[@]+"${second[@]}"}
echo "sweep: ran for $((SECONDS - t0))s"
rc=0
summary || rc=$?
if ((STOP)); then
  echo "sweep: stopped by a signal; run the same command again to resume"
  exit 130
fi
if ((N_OK > 0)); then make_report || rc=$?; fi
exit $rc
