#!/usr/bin/env bash
# sweep.sh: the study's plan. Each line below is one run per seed: its experiment, its name (the run's folder is
# OUT/<experiment>/<name>-s<seed>) and the trainer command. study/sweep_runner.py adds to every command --run-dir,
# --seed, --model (when given; else the trainers' scale picks it: qwen2.5-0.5b at study, the organism at cpu), --scale,
# --no-progress and the flags given after `--`; it schedules the runs (one after another,
# a pool over GPUs or CPU jobs, torchrun, or SLURM arrays), skips finished runs, resumes interrupted ones, sets a
# damaged results.json aside, records failures, and writes the report (study/report.py) at the end.
#
#   ./sweep.sh --help      the options          ./sweep.sh --dry-run   the commands, run nothing
#   ./sweep.sh --smoke     all of it on the CPU with a tiny random model, in minutes (docs/sweep.md)
#
# {tokens} and {steps} are the generated training tokens and the steps of the same seed's reference GRPO run (its
# results.json; --budget-from: the experiment's own, h2h/grpo-group by default): matched compute is the same number of
# generated training tokens, and a run that reads them starts after every run that does not. {10*steps} is a step cap
# the token budget, not the cap, ends. {out} is the sweep's folder: a line that names it reads what another line made
# there, so it starts after every line that does not (as a budget's reader does).
# A line whose script is a study module (study.pretrain_critic) is a step, not a trainer: it runs once for every seed,
# among the runs without a budget, into OUT/<experiment>/<name> (--out, --model, --no-progress; no trainer's flag);
# it resumes by itself, so it runs again each time and redoes only what is missing.
# The experiments named in --default-experiments run unless --experiments says otherwise.
set -euo pipefail
# study/sweep_runner.py runs as a module of the repository's root (its imports are the root's), wherever this is run
# from: the root first on the path, the working folder not on it (-P: a folder named study/ there cannot stand in)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" -P -m study.sweep_runner \
  --default-experiments h2h,critic,labels --budget-from h2h/grpo-group,crossover/grpo-group,spread/grpo-group-g4,size/grpo-group "$@" <<'PLAN'
# h2h: the three methods at matched compute. GRPO first, for the scale's steps: its tokens are the budget.
# grpo-group-unscaled is Dr. GRPO's advantage (no division by the group's std): the baseline alone compared.
h2h            grpo-group            grpo.py
h2h            grpo-group-unscaled   grpo.py --scale-rewards none --token-budget {tokens} --total-steps {10*steps}
h2h            ppo-none              ppo.py --critic none   --token-budget {tokens} --total-steps {10*steps}
h2h            ppo-small             ppo.py --critic small  --token-budget {tokens} --total-steps {10*steps}
h2h            ppo-medium            ppo.py --critic medium --token-budget {tokens} --total-steps {10*steps}
h2h            ppo-large             ppo.py --critic large  --token-budget {tokens} --total-steps {10*steps}
h2h            ppo-full              ppo.py --critic full   --token-budget {tokens} --total-steps {10*steps}
h2h            dpo-gold-online       dpo.py --pairs gold --online --token-budget {tokens} --total-steps {10*steps}
# offline DPO spends the budget once, sampling its pairs (from as many prompts as it takes), then trains GRPO's steps
h2h            dpo-gold-offline      dpo.py --pairs gold --token-budget {tokens} --offline-prompts 1000000 --total-steps {steps}

# critic: every capacity for the scale's steps, measured against Monte Carlo at the prompt and 2 states inside
# each completion (the within-prompt error)
critic         ppo-none              ppo.py --critic none   --mc-states 2
critic         ppo-small             ppo.py --critic small  --mc-states 2
critic         ppo-medium            ppo.py --critic medium --mc-states 2
critic         ppo-large             ppo.py --critic large  --mc-states 2
critic         ppo-full              ppo.py --critic full   --mc-states 2

# critic-lambda (optional: --experiments critic-lambda): the critics at GAE lambda = 0.95, where a constant offset
# of the critic is no longer removed by whitening (no ppo-none: without a critic, lambda only discounts the reward)
critic-lambda  ppo-small             ppo.py --critic small  --mc-states 2 --lam 0.95
critic-lambda  ppo-medium            ppo.py --critic medium --mc-states 2 --lam 0.95
critic-lambda  ppo-large             ppo.py --critic large  --mc-states 2 --lam 0.95
critic-lambda  ppo-full              ppo.py --critic full   --mc-states 2 --lam 0.95

# crossover (optional, --organism --experiments crossover): where a critic pretrained on the frozen policy equals
# GRPO's group of G, sized for the organism's CPU preset (256 completions a step). First the critics' learning curve
# (a step: study/pretrain_critic.py into OUT/crossover/curve, one pool of the frozen policy's rollouts, a critic per
# capacity and number of rollouts, each measured on 512 held-out prompts against 16-sample Monte Carlo at the prompt
# and 2 states inside, and the linear read-out beside them; the full critic, a copy of the policy whose own layers may
# compute what the policy's features do not say, at its learning rate 1e-4, the heads' 1e-3), and beside it GRPO at G = 2, 4, 8, 16 with batch x G =
# 256 completions a step (the same generated tokens a step) for 50 steps, its baseline measured on 32 completions
# every 2 steps (G = 16: 16 every step); then, at the tokens of the same seed's G = 8 run, PPO with each capacity's
# critic pretrained on 4,096 rollouts (156k tokens, a third of the ~490k budget) at both prices: paid (its
# pretraining's tokens spent from the budget: --count-critic-init-tokens) and amortised (free, as when one critic
# serves many runs); under the constant learning rate the paid run is the amortised one stopped early, step for step,
# so the sweep continues each paid run's last checkpoint into its amortised twin rather than train those steps twice
# (study/twins.py). And PPO with the full critic pretrained on 16,384 rollouts (the one critic below
# the constant baseline there), amortised only: its pretraining's 624k tokens exceed the budget. 3 seeds.
# ~95 min on 2 cores, 2 runs at once on one thread each (docs/sweep.md: measured in two parts, 2026-12-07): the curve
# (920 s) beside the 12 GRPO runs (~5 min each), 40 min; the fit steps and the 24 PPO runs (none ~5 min, paid ~4, the
# amortised ones ~2 after their paid twin, the full critic's ~8), 52-58 min; then the report.
# A stopped sweep resumes where it stopped.
crossover      curve                 study.pretrain_critic --critics small medium large full --rollouts 256 1024 4096 16384 --measure
# the fit's settings: each head fitted again on the curve's first 4,096 rollouts at other learning rates and epochs,
# measured on the curve's held-out targets (--pool-from: its rollouts and Monte Carlo linked, none sampled again)
crossover      fit-lr3e-4-e4         study.pretrain_critic --critics small medium large --rollouts 4096 --lr 3e-4 --epochs 4 --measure --pool-from {out}/crossover/curve
crossover      fit-lr3e-3-e4         study.pretrain_critic --critics small medium large --rollouts 4096 --lr 3e-3 --epochs 4 --measure --pool-from {out}/crossover/curve
crossover      fit-lr1e-2-e4         study.pretrain_critic --critics small medium large --rollouts 4096 --lr 1e-2 --epochs 4 --measure --pool-from {out}/crossover/curve
crossover      fit-lr1e-3-e16        study.pretrain_critic --critics small medium large --rollouts 4096 --lr 1e-3 --epochs 16 --measure --pool-from {out}/crossover/curve
crossover      fit-lr3e-3-e16        study.pretrain_critic --critics small medium large --rollouts 4096 --lr 3e-3 --epochs 16 --measure --pool-from {out}/crossover/curve
crossover      grpo-group-g2         grpo.py --group-size 2 --batch-size 128 --total-steps 50
crossover      grpo-group-g4         grpo.py --group-size 4 --batch-size 64 --total-steps 50
crossover      grpo-group            grpo.py --group-size 8 --batch-size 32 --total-steps 50
crossover      grpo-group-g16        grpo.py --group-size 16 --batch-size 16 --total-steps 50 --mc-prompts 16 --mc-every 1
# the control: PPO without a critic (its baseline the batch's mean reward, the same for every token) at the same
# budget, so that what a pretrained critic adds is read against PPO itself, not only against GRPO, which differs from
# PPO in more than its baseline (prompts a step, the advantage's scale)
crossover      ppo-none                    ppo.py --critic none --token-budget {tokens} --total-steps {10*steps}
crossover      ppo-full-n16384-amortised   ppo.py --critic full --critic-init {out}/crossover/curve/critic-full-n16384.safetensors --token-budget {tokens} --total-steps {10*steps}
crossover      ppo-small-n4096-paid        ppo.py --critic small --critic-init {out}/crossover/curve/critic-small-n4096.safetensors --count-critic-init-tokens --token-budget {tokens} --total-steps {10*steps}
crossover      ppo-medium-n4096-paid       ppo.py --critic medium --critic-init {out}/crossover/curve/critic-medium-n4096.safetensors --count-critic-init-tokens --token-budget {tokens} --total-steps {10*steps}
crossover      ppo-large-n4096-paid        ppo.py --critic large --critic-init {out}/crossover/curve/critic-large-n4096.safetensors --count-critic-init-tokens --token-budget {tokens} --total-steps {10*steps}
crossover      ppo-small-n4096-amortised   ppo.py --critic small --critic-init {out}/crossover/curve/critic-small-n4096.safetensors --token-budget {tokens} --total-steps {10*steps}
crossover      ppo-medium-n4096-amortised  ppo.py --critic medium --critic-init {out}/crossover/curve/critic-medium-n4096.safetensors --token-budget {tokens} --total-steps {10*steps}
crossover      ppo-large-n4096-amortised   ppo.py --critic large --critic-init {out}/crossover/curve/critic-large-n4096.safetensors --token-budget {tokens} --total-steps {10*steps}

# How the crossover moves (optional, --organism --experiments spread,size): the crossover's measurement on the other
# organisms (plumbing/models.py ORGANISMS, each its shipped build copied into the cache): the critics' learning curve on
# the frozen starting policy (256, 1,024, 4,096 rollouts; every head; 512 held-out prompts x 20-sample Monte Carlo,
# K = 20 so that GRPO's group of 16 is measured too), the linear read-out's ceiling and GRPO's leave-one-out mean at
# G = 2, 4, 8, 16, each against the same Monte Carlo. The organism itself is the crossover experiment's curve.
# spread: a task whose problems differ more in difficulty (1-5 operations, not 2-3)
spread         curve-wide            study.pretrain_critic --model organism-wide --critics small medium large --rollouts 256 1024 4096 --measure --mc-samples 20
# size: the same task on a smaller (0.28M) and a ~4x larger (2.4M) policy
size           curve-small           study.pretrain_critic --model organism-small --critics small medium large --rollouts 256 1024 4096 --measure --mc-samples 20
size           curve-large           study.pretrain_critic --model organism-large --critics small medium large --rollouts 256 1024 4096 --measure --mc-samples 20
# the head-to-head where G* was measured (2026-12-07; docs/organism: G* 3.4 on organism-wide, 5.6 on organism-large):
# GRPO at the two group sizes either side of it (batch x G = 256 completions a step, 50 steps, as the crossover's),
# and PPO with the best head pretrained on 4,096 rollouts, amortised and paid (the amortised run continues the paid
# one, as the crossover's), and without a critic (the control), at the tokens of the same seed's GRPO run at the larger
# G. 3 seeds: organism-wide 15 runs (~55 min on 2 idle cores: GRPO ~8.5 min a run, PPO ~8.5 without a critic, ~6.5
# paid, ~3 more for its amortised twin), organism-large 15 runs of a policy 3.9x the organism's (~90 min)
spread         grpo-group-g2         grpo.py --model organism-wide --group-size 2 --batch-size 128 --total-steps 50
spread         grpo-group-g4         grpo.py --model organism-wide --group-size 4 --batch-size 64 --total-steps 50
spread         ppo-none                    ppo.py --model organism-wide --critic none --token-budget {tokens} --total-steps {10*steps}
spread         ppo-large-n4096-amortised   ppo.py --model organism-wide --critic large --critic-init {out}/spread/curve-wide/critic-large-n4096.safetensors --token-budget {tokens} --total-steps {10*steps}
spread         ppo-large-n4096-paid        ppo.py --model organism-wide --critic large --critic-init {out}/spread/curve-wide/critic-large-n4096.safetensors --count-critic-init-tokens --token-budget {tokens} --total-steps {10*steps}
size           grpo-group-g4         grpo.py --model organism-large --group-size 4 --batch-size 64 --total-steps 50
size           grpo-group            grpo.py --model organism-large --group-size 8 --batch-size 32 --total-steps 50
size           ppo-none                    ppo.py --model organism-large --critic none --token-budget {tokens} --total-steps {10*steps}
size           ppo-small-n4096-amortised   ppo.py --model organism-large --critic small --critic-init {out}/size/curve-large/critic-small-n4096.safetensors --token-budget {tokens} --total-steps {10*steps}
size           ppo-small-n4096-paid        ppo.py --model organism-large --critic small --critic-init {out}/size/curve-large/critic-small-n4096.safetensors --count-critic-init-tokens --token-budget {tokens} --total-steps {10*steps}

# labels: DPO's label regimes, self-labelled or gold pairs, offline or online, for the scale's steps
labels         dpo-self-offline      dpo.py --pairs self
labels         dpo-self-online       dpo.py --pairs self --online
labels         dpo-gold-offline      dpo.py --pairs gold
labels         dpo-gold-online       dpo.py --pairs gold --online

# --smoke: --model tiny at --scale study, seed 1, --task toy except for gold pairs (the tiny random model never
# solves GSM8K; gold pairs are its reference solutions), and these flags, placed before a line's own, which win.
# DPO's --eval-batch-size 2: offline DPO samples its pairs in chunks of this many prompts, so a small budget ends it.
smoke          *                     --total-steps 2 --max-new-tokens 8 --eval-every 1 --eval-size 8 --test-size 8 --eval-max-new-tokens 8
smoke          ppo.py                --eval-batch-size 8 --batch-size 4 --micro-batch-size 4 --num-minibatches 2 --mc-every 1 --mc-prompts 2 --mc-samples 4
smoke          grpo.py               --eval-batch-size 8 --batch-size 2 --group-size 2 --micro-batch-size 4 --num-minibatches 2 --mc-every 1 --mc-prompts 2 --mc-samples 4
smoke          dpo.py                --eval-batch-size 2 --batch-size 2 --micro-batch-size 2 --samples-per-prompt 2 --offline-prompts 8
# the crossover's curve (a step: none of the trainers' flags above): the runs' sampling, a small held-out measurement
smoke          study.pretrain_critic --max-new-tokens 8 --holdout 64 --mc-prompts 8 --mc-samples 4
PLAN
