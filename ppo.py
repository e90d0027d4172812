"""PPO on GSM8K with a critic of selectable capacity, and its advantage error measured against Monte Carlo.

PPO's baseline is a learned value function, the one baseline of the three methods here that can be
wrong. `--critic` picks its capacity (critics.py): none (REINFORCE with a batch-mean baseline), small,
medium and large heads on the policy's own hidden states, or a full separate transformer. Every
`--mc-every` steps the critic's values at token-weighted states are compared with Monte Carlo estimates
from fresh rollouts (measure.monte_carlo), raw and with the constant offset removed (docs/measurement.md).

Simplifications, said plainly: one reward at the final token (gamma = lambda = 1 by default, the value targets'
--critic-lam too: Monte Carlo returns); the rollout's log-probs are the old ones (--recompute-logprobs: a forward).

    python ppo.py --critic small                                   # the study's settings on a GPU
    torchrun --standalone --nproc_per_node=8 ppo.py --critic small # data parallel on one node
    torchrun --standalone --nproc_per_node=8 ppo.py --critic full --fsdp  # sharded (FSDP2), for a large model
    python ppo.py --critic small --model tiny --total-steps 2      # a smoke run on the CPU

Papers: PPO https://arxiv.org/abs/1707.06347; GAE https://arxiv.org/abs/1506.02438; the N implementation
details of RLHF with PPO https://arxiv.org/abs/2403.17031; VinePPO's critic measurement https://arxiv.org/abs/2410.01679
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from plumbing import threads

if __name__ == "__main__":  # run, not imported: OpenMP's wait, before torch loads libgomp (plumbing/threads.py)
    threads.wait_passively()

import torch
import tyro
from tqdm.auto import tqdm

import common
import critics
import gsm8k
import measure
from plumbing import checkpoint, distributed, errors, forward, generation, logs, models, rollout, runtime


@dataclass
class Args:
    # --- run ---
    run_dir: str | None = None
    """folder for the checkpoint, metrics.jsonl and results.json; None: runs/ppo-{critic}-s{seed}"""
    seed: int = 1
    """seed of the model init, the data order and the sampling"""
    resume: bool = False
    """continue the run in run_dir from its checkpoint"""
    resume_from_backup: bool = False
    """with --resume, accept the previous checkpoint a killed save set aside (.checkpoint.old-*) when checkpoint/ is gone"""
    allow_data_change: bool = False
    """with --resume, accept GSM8K data that differs from the checkpoint's (its fingerprint: counts and SHA-256 per split)"""
    device: str = "auto"
    """auto (cuda when present), cpu or cuda"""
    fsdp: bool = False
    """under torchrun, shard the policy, reference and critic over the ranks (FSDP2) for a model one GPU cannot hold"""
    scale: Literal["auto", "study", "cpu"] = "auto"
    """auto: the CPU preset on a machine without a GPU, else the study's settings; study; cpu (the CPU preset)"""
    progress: bool = True
    """show tqdm progress bars"""
    track: bool = False
    """log the metrics to Weights & Biases too (WANDB_MODE=offline keeps them in run_dir/wandb)"""
    wandb_project: str = "rlvr-baselines"
    """--track: the W&B project"""
    wandb_entity: str | None = None
    """--track: the W&B team or user; None: your own"""

    # --- model and data ---
    # qwen2.5-0.5b from the hub; organism: a 0.6M-parameter Qwen2 of multi-step arithmetic, the CPU preset's
    # (organism-seed0/, organism.py's build); smollm2: the packaged SmolLM2-135M-Instruct GGUF (it shows the
    # pipeline on GSM8K, not the answer: docs/science.md); tiny, tiny-qwen2: random weights, for tests; a path: a
    # folder or .gguf
    model: str = "qwen2.5-0.5b"
    """qwen2.5-0.5b (the study's), qwen2.5-1.5b, smollm2-360m, smollm2-1.7b, organism (shipped), smollm2 (packaged), tiny, hub id or path"""
    prompt_format: Literal["chat", "question", "plain"] = "chat"
    """chat (the question and the instruction through the chat template), question (the question alone through it: the organism's), or plain (a model without one)"""
    task: Literal["gsm8k", "toy"] = "gsm8k"
    """gsm8k, or toy (reward 1 when a target token appears: the learning tests' task)"""
    data_dir: str | None = None
    """folder with GSM8K's train.jsonl and test.jsonl; None: the organism's own task for --model organism, else $GSM8K_DIR, else the hub"""
    val_size: int = 500
    """problems carved out of train (fixed seed) for evaluation during training"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    compile: bool = False
    """torch.compile the transformer trunk of the training forward (policy and reference)"""

    # --- rollout ---
    batch_size: int = 512
    """prompts per step, over all ranks"""
    group_size: int = 1
    """completions per prompt (G); 1 is the point of a critic: PPO needs no group"""
    max_new_tokens: int = 256
    """longest completion, in tokens"""
    temperature: float = 1.0
    """sampling temperature (the policy's log-probs use the same one)"""
    top_p: float = 1.0
    """nucleus sampling threshold; below 1 refused here (the engine's log-probs are the untruncated softmax's)"""

    # --- optimisation ---
    total_steps: int = 200
    """training steps (one batch of rollouts each)"""
    token_budget: int = 0
    """stop once training rollouts have generated this many tokens (0: no budget); matches methods on compute"""
    lr: float = 1e-6
    """policy learning rate"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """the learning rate's decay after warmup"""
    warmup_steps: int = 0
    """optimiser steps of linear warmup"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clipping, of each network apart"""
    micro_batch_size: int = 64
    """sequences per forward on each rank (gradient accumulation up to a minibatch)"""
    update_epochs: int = 2
    """passes over each batch of rollouts"""
    num_minibatches: int = 4
    """minibatches (optimiser steps) per epoch"""
    clip_eps: float = 0.2
    """clip range for the probability ratio"""
    kl_coef: float = 0.04
    """KL coefficient beta (0: no reference model)"""
    recompute_logprobs: bool = False
    """recompute old log-probs with a training forward instead of using the rollout's"""

    # --- PPO ---
    critic: Literal["none", "small", "medium", "large", "full"] = "small"
    """the critic's capacity (critics.py); none: REINFORCE with the batch-mean score as the baseline"""
    critic_lr: float | None = None
    """critic learning rate; None: 1e-4 for a head, 1e-5 for the full critic"""
    critic_grad: bool = False
    """let the value loss flow into the policy's trunk (heads read detached hidden states by default)"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    vf_clip: float = 0.2
    """value clipping range around the rollout's values (0 turns it off)"""
    gamma: float = 1.0
    """discount"""
    lam: float = 1.0
    """GAE lambda of the policy's advantages"""
    critic_lam: float = 1.0
    """GAE lambda of the critic's value targets (1: Monte Carlo returns; VC-PPO and VAPO decouple it from --lam)"""
    whiten_advantages: bool = True
    """whiten advantages over the whole batch (all ranks)"""
    kl_mode: Literal["loss", "reward"] = "loss"
    """where the KL to the reference goes: loss (k3, as GRPO) or reward (k1 per token, as classic RLHF PPO)"""
    # Value pretraining (VC-PPO, VAPO), so that a capacity is not confounded with how fast a head learns from zero:
    # warm-up steps (they count as steps), or a critic pretrained once on the frozen policy and loaded (--critic-init)
    critic_warmup_steps: int = 0
    """the first N steps train the critic alone, the policy fixed (VAPO's value pretraining; they count as steps)"""
    critic_init: str | None = None
    """a critic file of study/pretrain_critic.py, pretrained on this policy's rollouts: loaded before step 0"""
    count_critic_init_tokens: bool = False
    """spend --critic-init's pretraining tokens from --token-budget (the paid price; without: amortised, free)"""

    # --- measurement against Monte Carlo ---
    mc_every: int = 10
    """measure the baseline against Monte Carlo every this many steps (0: never)"""
    mc_samples: int = 8
    """fresh Monte Carlo rollouts per measured state (K), apart from the training rollouts"""
    mc_prompts: int = 32
    """prompts of the step measured, over all ranks"""
    mc_states: int = 2
    """states drawn uniformly inside each measured completion besides its prompt (token-weighted; VinePPO)"""

    # --- evaluation and checkpoints ---
    eval_every: int = 25
    """greedy accuracy on the validation split every this many steps (0: only at the end)"""
    eval_size: int = 500
    """validation problems per evaluation (at least 256 for a readable curve)"""
    test_size: int = 0
    """test problems for the final number (0: the whole test split)"""
    test_before: bool = True
    """evaluate the same test problems before training too: results.json's test_before and the paired difference"""
    eval_batch_size: int = 256
    """prompts per generation batch in evaluation"""
    eval_max_new_tokens: int = 400
    """longest completion in evaluation"""
    save_every: int = 25
    """checkpoint every this many steps (and at the end, and on SIGTERM)"""

    # --- sizes, filled at runtime from the above (not flags); recorded in results.json ---
    completions_per_step: tyro.conf.Suppress[int] = 0
    """filled at runtime: batch_size x group_size, over all ranks"""
    completions_per_rank: tyro.conf.Suppress[int] = 0
    """filled at runtime: completions_per_step / the world size (a group stays on one rank)"""
    minibatch_size: tyro.conf.Suppress[int] = 0
    """filled at runtime: completions_per_rank / num_minibatches, the rows of one optimiser step on each rank"""
    micro_batch: tyro.conf.Suppress[int] = 0
    """filled at runtime: min(micro_batch_size, minibatch_size), the rows of one forward"""
    optimizer_steps: tyro.conf.Suppress[int] = 0
    """filled at runtime: total_steps x update_epochs x num_minibatches, the learning-rate schedule's length"""


# The sizes above: they follow from the settings and the world size, so a resume (on any world) does not check them.
SIZES = ("completions_per_step", "completions_per_rank", "minibatch_size", "micro_batch", "optimizer_steps")


def validate(args: Args) -> None:
    """Every numeric flag in its range, right after parsing: one `error:` line and exit 2 before anything loads."""
    logs.check_tracking(args)  # --track without wandb installed
    runtime.check_ranges(  # the method's own flags; the ones the trainers share are runtime.SHARED_RANGES
        args,
        positive=("group_size", "critic_lr", "num_minibatches", "clip_eps"),
        non_negative=("vf_coef", "vf_clip", "critic_warmup_steps"),
        unit=("gamma", "lam", "critic_lam"),
    )
    if args.critic_warmup_steps and args.critic == "none":
        raise errors.UserError(f"--critic-warmup-steps {args.critic_warmup_steps} needs a critic")
    if args.fsdp and args.kl_mode == "reward" and args.kl_coef > 0 and args.mc_every:  # see docs/distributed.md
        raise errors.UserError(
            "--kl-mode reward with --fsdp cannot be measured against Monte Carlo: the reference's KL of the fresh "
            "rollouts would take a different number of sharded forwards on each rank; pass --mc-every 0 or drop --fsdp"
        )
    if args.top_p < 1:  # the ratio, the KL and the MC return need the log-probs of the distribution sampled from
        raise errors.UserError(
            f"--top-p {args.top_p} biases {METHOD}.py's ratio, KL and Monte Carlo return: the engine's log-probs are "
            "the untruncated softmax's, not the nucleus it samples from; use --top-p 1 (dpo.py takes it)"
        )


# The CPU presets: what this script runs on a machine without a GPU, minutes on 2 cores (runtime.cli: the first is
# the default model's; a model without its own takes the last). organism: the model organism (organism.py), which
# solves some of its problems and not others, so a run shows learning: the test split before and after, paired
# (docs/organism/README.md: how the sizes were chosen). smollm2: GSM8K on the packaged SmolLM2-135M, every part of a
# run small: it shows the pipeline, not the answer (0% either way).
CPU_SCALE = {
    "organism": dict(
        model="organism", batch_size=256, max_new_tokens=64, total_steps=30, micro_batch_size=256, lr=5e-5,
        mc_every=5, mc_prompts=72, eval_every=10, eval_size=500, test_size=0, eval_batch_size=500,
        eval_max_new_tokens=64, save_every=10,
    ),
    "smollm2": dict(
        model="smollm2", batch_size=8, max_new_tokens=64, total_steps=3, micro_batch_size=8, num_minibatches=2,
        lr=2e-6, mc_every=2, mc_prompts=2, mc_samples=4, eval_every=3, eval_size=16, test_size=32, eval_batch_size=32,
        eval_max_new_tokens=96, save_every=3,
    ),
}  # fmt: skip

METHOD = "ppo"  # the banner's title, the progress bar's, results.json's method


def main() -> None:
    # ==================================================================================================
    # TRY NOT TO MODIFY: arguments and processes. TRY NOT TO MODIFY marks the skeleton that ppo.py, grpo.py and
    # dpo.py share line for line (tests/test_skeleton.py keeps it so); ALGO LOGIC marks the method
    # ==================================================================================================
    args, scaled = runtime.cli(Args, CPU_SCALE)
    validate(args)
    dist_ = distributed.setup_distributed(args.device, args.fsdp)
    device, world = dist_.device, dist_.world

    # ==================================================================================================
    # ALGO LOGIC: the sizes (filled in and checked to divide), the largest generation batches, the run folder
    # ==================================================================================================
    measure.check_measurement(args, world)  # --mc-samples, --mc-prompts, --mc-states
    args.completions_per_step = args.batch_size * args.group_size  # over all ranks; groups stay on one rank
    runtime.check_divides("--batch-size", args.batch_size, world, "the world size")
    args.completions_per_rank = args.completions_per_step // world
    runtime.check_divides("completions per rank", args.completions_per_rank, args.num_minibatches, "--num-minibatches")
    args.minibatch_size = args.completions_per_rank // args.num_minibatches
    args.micro_batch = min(args.micro_batch_size, args.minibatch_size)
    runtime.check_divides("the minibatch per rank", args.minibatch_size, args.micro_batch, "--micro-batch-size")
    args.optimizer_steps = args.total_steps * args.update_epochs * args.num_minibatches
    models.check_generation_memory(args.model, device, {  # the largest generation batches, before anything loads
        "--batch-size x --group-size": (args.completions_per_rank, args.max_new_tokens),
        "--eval-batch-size": (args.eval_batch_size, args.eval_max_new_tokens),
    })  # fmt: skip
    args.critic_lr = args.critic_lr or (1e-5 if args.critic == "full" else 1e-4)
    G, micro = args.group_size, args.micro_batch
    run_dir = Path(args.run_dir or f"runs/ppo-{args.critic}-s{args.seed}")

    # ==================================================================================================
    # TRY NOT TO MODIFY: the run folder, seeds, data, the prompts
    # ==================================================================================================
    checkpoint.prepare_run_dir(run_dir, args.resume, dist_.main, args.resume_from_backup)
    runtime.seed_everything(args.seed)
    splits = gsm8k.load_gsm8k(args.data_dir, args.val_size, model=args.model)
    data_used = gsm8k.data_record(args.data_dir, splits, args.model)  # the folder read and each split's fingerprint
    tokenizer = models.load_tokenizer(args.model)
    new_tokens = max(args.max_new_tokens, args.eval_max_new_tokens)
    gsm8k.check_prompt_lengths(splits, tokenizer, args.prompt_format, args.model, new_tokens)  # before any work
    prompt_cache: dict[int, list[int]] = {}

    def prompt_ids(i: int) -> list[int]:  # training prompts, through the same builder as evaluation
        if i not in prompt_cache:
            prompt_cache[i] = gsm8k.encode_prompt(tokenizer, splits["train"][i].question, args.prompt_format)
        return prompt_cache[i]

    # ==================================================================================================
    # ALGO LOGIC: the networks. The policy: its weights (policy), its training forward (policy_fwd), that
    # forward data-parallel (policy_ddp), its whole weights for generation (policy_full)
    # ==================================================================================================
    home = torch.device("cpu") if args.fsdp else device  # --fsdp: the weights reach the GPU as shards
    policy = models.load_model(args.model, tokenizer, args.seed).to(home)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = copy.deepcopy(policy).eval().requires_grad_(False) if args.kl_coef > 0 else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        critic = critics.build_critic(args.critic, policy.config.hidden_size, policy)
    critic = critic.to(home) if critic is not None else None
    init = critics.load_critic_init(args, critic, policy)  # --critic-init: {} or {"critic_init": what it was}
    policy_fwd = forward.PolicyForward(policy, critic, args.critic_grad, compile=args.compile)
    ref_fwd = forward.PolicyForward(ref, compile=args.compile) if ref is not None else None
    policy_ddp = distributed.parallelize(policy_fwd, ref_fwd, dist_, args.fsdp)  # DDP, FSDP2 or policy_fwd itself
    policy_full = distributed.FullWeights(policy, device)  # a gathered copy under --fsdp, else the policy itself
    groups = [{"params": list(policy.parameters()), "lr": args.lr}]
    if critic is not None:
        groups.append({"params": list(critic.parameters()), "lr": args.critic_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=args.weight_decay, eps=1e-8)
    guard = runtime.FiniteGuard(policy, critic)  # a non-finite loss or gradient skips the step; a second stops
    per_step = args.update_epochs * args.num_minibatches  # optimiser steps a training step
    progress = common.BudgetProgress(args.token_budget, per_step) if args.token_budget else None  # the decay's length
    lr_factor = common.lr_schedule(args.lr_schedule, args.warmup_steps, args.optimizer_steps, progress)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    banner = {
        "critic": f"{args.critic} ({distributed.count_params(critic):,} trainable parameters)",
        "batch": f"{args.completions_per_step} completions/step = {args.batch_size} prompts x {G}; "
        f"{args.num_minibatches} minibatches x {args.update_epochs} epochs",
    }

    # ==================================================================================================
    # TRY NOT TO MODIFY: resume, banner, logging, evaluation, checkpoints
    # ==================================================================================================
    cpu_threads = threads.use_threads(policy)  # the CPU's threads for the policy's size, on every rank
    state: dict = {}  # the checkpoint's, on --resume
    counters = {"step": 0, "generated_tokens": 0, "mc_tokens": 0, "eval_tokens": 0, "wall_time": 0.0}
    args_dict = dataclasses.asdict(args)  # results.json: every setting and the sizes
    settings = {k: v for k, v in args_dict.items() if k not in SIZES}  # the checkpoint's: a resume must match
    modules = dict(policy=policy, critic=critic, optimizer=optimizer, scheduler=scheduler, args=settings)
    if args.resume:
        state = checkpoint.load_checkpoint(run_dir, **modules, map_location=device)
        notice = gsm8k.check_data_change(state.get("data"), data_used, args.allow_data_change)
        if notice and dist_.main:
            print(notice, flush=True)
        counters.update(state["counters"])
    test_before = state.get("test_before")  # the test split before training: evaluated once, before the loop
    if dist_.main:
        task = "the organism's task" if models.is_organism(args.model) and not args.data_dir else "GSM8K"
        data = f"{task}: train {len(splits['train'])}, val {len(splits['val'])}, test {len(splits['test'])}"
        banner = {
            "model": f"{args.model} ({distributed.count_params(policy):,} parameters)",
            "threads": str(cpu_threads),
            **banner,
            "data": f"{data} ({data_used['folder']}), task {args.task}",
            "run_dir": str(run_dir) + (f" (resuming at step {counters['step']})" if args.resume else ""),
        }
        print(logs.describe_run(METHOD.upper(), args, dist_, banner, scaled, run_dir, data_used["folder"]), flush=True)
    stopper = runtime.StopSignal()
    logger = logs.MetricsLogger(
        run_dir, dist_.main, resume_step=counters["step"] if args.resume else None,
        resume_rows=counters.get("metrics_rows"), first_row=generation.rollout_record, track=args,
    )  # the first line says what the rollouts ran on  # fmt: skip
    ctx = distributed.autocast_ctx(device)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    t_start = time.time() - counters["wall_time"]

    def run_eval(split: str, size: int) -> dict:
        res = gsm8k.evaluate(
            policy_full.get(), tokenizer, splits[split][: size or None], task=args.task,
            prompt_format=args.prompt_format, max_new_tokens=args.eval_max_new_tokens,
            batch_size=args.eval_batch_size, desc=f"eval {split}", show_progress=args.progress,
        )  # fmt: skip
        counters["eval_tokens"] += res["generated_tokens"]
        return res

    def save() -> None:  # on every rank: rank 0 writes, and under --fsdp every rank writes its shards
        counters["wall_time"], counters["metrics_rows"] = time.time() - t_start, logger.rows
        state = {
            "counters": counters,
            "sampler": sampler.state_dict(),
            "world": world,
            "data": data_used,
            "test_before": test_before,
        }
        checkpoint.save_checkpoint(run_dir, tokenizer=tokenizer, state=state, **modules)

    # ==================================================================================================
    # ALGO LOGIC: what the steps draw from: the train prompts in a seeded order, resumed where it was, and the
    # token budget that ends the loop
    # ==================================================================================================
    sampler = gsm8k.PromptSampler(len(splits["train"]), args.seed)  # the train prompts' order, seeded
    if args.resume:
        sampler.load_state_dict(state["sampler"])  # where the checkpoint left it
    budget = args.token_budget  # the loop ends once the training rollouts have generated this many tokens

    # ==================================================================================================
    # TRY NOT TO MODIFY: the loop: each step's method (ALGO LOGIC), then its evaluation, metrics and checkpoint
    # ==================================================================================================
    if args.test_before and args.total_steps > 0 and counters["step"] == 0 and test_before is None:
        before = run_eval("test", args.test_size)
        test_before = {k: before[k] for k in ("accuracy", "ci95", "n", "correct")}
    show = dist_.main and args.progress
    bar = tqdm(total=args.total_steps, initial=counters["step"], desc=METHOD, disable=not show)
    while counters["step"] < args.total_steps and not (budget and counters["generated_tokens"] >= budget):
        step = counters["step"]
        metrics: dict[str, float] = {}
        t0 = time.time()
        sums: dict[str, torch.Tensor] = {}  # the step's named sums on this rank, reduced over the ranks once
        # ALGO LOGIC: the step, 1. to 7.
        # --- 1. rollouts: G completions of each of this rank's prompts, from the policy's whole weights -------
        batch_idx = sampler.next(args.batch_size)  # the global batch; this rank takes its contiguous share
        lo, hi = common.shard_range(args.batch_size, dist_.rank, world)
        local_idx = [i for i in batch_idx[lo:hi] for _ in range(G)]
        uniforms = rollout.step_uniforms(args.seed, step, 0, args.completions_per_step, args.max_new_tokens, device)
        prompts = [prompt_ids(i) for i in local_idx]
        policy_gen = policy_full.get()
        ro = generation.generate(
            policy_gen, prompts, max_new_tokens=args.max_new_tokens, eos_id=eos, pad_id=pad,
            uniforms=uniforms[lo * G : hi * G], temperature=args.temperature, top_p=args.top_p,
            return_hidden=critic is not None and not critic.needs_trunk,
        )  # fmt: skip
        P = ro.prompt_ids.shape[1]
        input_ids, attn, rmask = ro.input_ids, ro.attention_mask, ro.response_mask  # [B, P+T], [B, P+T], [B, T]
        old_logp = ro.logprobs
        seq_len = attn.sum(-1).cpu()  # [B] tokens per sequence, on the host once: micro-batches of similar length
        t_rollout = time.time() - t0

        # --- 2. ALGO LOGIC: reference log-probs and the critic's values (no gradient) -------------------------
        with torch.no_grad(), ctx:
            ref_logp = torch.zeros_like(old_logp)
            old_values = torch.zeros_like(old_logp)
            for rows in forward.length_sorted_micro_batches(torch.arange(len(prompts)), seq_len, micro):
                if ref_fwd is not None:
                    ref_logp[rows] = ref_fwd(input_ids[rows], attn[rows], P, args.temperature)[0]
                if args.recompute_logprobs:  # the training forward: log-probs, and a full critic's values with them
                    old_logp[rows], _, v = policy_fwd(input_ids[rows], attn[rows], P, args.temperature)
                    if critic is not None and critic.needs_trunk:
                        old_values[rows] = v
                elif critic is not None and critic.needs_trunk:  # the full critic's trunk alone
                    ids_, attn_, p_, t_ = forward.trim_padding(input_ids[rows], attn[rows], P)
                    v = critic(ids_, attn_, rollout.position_ids_from_mask(attn_))[:, p_ - 1 : -1]
                    old_values[rows, :t_] = v.float() * rmask[rows, :t_]
            if critic is not None and not critic.needs_trunk:
                old_values = critic(ro.hidden).float() * rmask

        # --- 3. rewards: the shared verifier's score of each completion ---------------------------------------
        texts, ids = rollout.decode_responses(tokenizer, ro)
        golds = [splits["train"][i].gold for i in local_idx]
        scores = torch.tensor(gsm8k.score(args.task, texts, ids, golds), device=device)  # [B]
        lengths = ro.lengths  # [B]
        kl_tok = common.kl_estimate(old_logp, ref_logp, "k1") * rmask if ref is not None else torch.zeros_like(old_logp)

        # --- 4. ALGO LOGIC: advantages ------------------------------------------------------------------------
        rewards = torch.zeros_like(old_logp)  # [B, T]: the score at each completion's last token
        rewards[torch.arange(len(prompts), device=device), lengths - 1] = scores
        if args.kl_mode == "reward":
            rewards = rewards - args.kl_coef * kl_tok
        if critic is None:  # REINFORCE: the baseline is the batch-mean score, over all ranks
            mean = distributed.all_reduce_sums({"score": scores.sum(), "n": float(len(scores))})
            old_values = torch.full_like(rewards, mean["score"] / mean["n"]) * rmask
        advantages, returns = common.gae_decoupled(rewards, old_values, rmask, args.gamma, args.lam, args.critic_lam)
        if args.whiten_advantages:
            advantages = common.masked_whiten(advantages, rmask, global_=True)

        # --- 5. ALGO LOGIC: the baseline measured against Monte Carlo, every mc_every steps -------------------
        if args.mc_every and step % args.mc_every == 0:  # measure the baseline against Monte Carlo
            t_mc = time.time()
            measured = measure.measured_prompts(args.batch_size, args.mc_prompts, dist_.rank, world)
            rows = [i * G for i in measured]  # one completion per measured prompt

            def kl_to_go(mc_ro: rollout.Rollout, used: torch.Tensor) -> torch.Tensor:  # [B]: beta * sum of k1 ahead
                ref_lp = forward.rollout_logprobs(ref_fwd, mc_ro, micro, args.temperature)  # [B, T']
                ahead = torch.arange(ref_lp.shape[1], device=device)[None, :] < used.to(device)[:, None]  # [B, T']
                return args.kl_coef * (common.kl_estimate(mc_ro.logprobs, ref_lp, "k1") * ahead).sum(-1)

            report, mc_tok = measure.monte_carlo(
                policy_gen, tokenizer, prompts=[prompts[r] for r in rows], responses=[ids[r] for r in rows],
                golds=[golds[r] for r in rows], groups=[local_idx[r] for r in rows], row_ids=[lo * G + r for r in rows],
                baselines={"value": old_values[rows]},  # the critic's V(s_t), the baseline of token t
                states=args.mc_states, k=args.mc_samples, max_new_tokens=args.max_new_tokens, seed=args.seed,
                step=step, task=args.task, temperature=args.temperature, top_p=args.top_p,
                penalty=kl_to_go if args.kl_mode == "reward" and ref is not None else None,  # the return it regresses
            )  # fmt: skip
            metrics.update({f"mc/{key}": v for key, v in report.items()})
            counters["mc_tokens"] += mc_tok
            metrics["mc/seconds"] = time.time() - t_mc

        # --- 6. update: update_epochs passes of num_minibatches optimiser steps over the same global rows -----
        if progress is not None:  # the schedule follows the token budget: this step's rollout tokens, on all ranks
            spent = distributed.all_reduce_sum(lengths.sum().double()).item()
            progress.start_step(counters["generated_tokens"], spent, scheduler.last_epoch)
        t_update = time.time()
        B = len(prompts)
        warm = step < args.critic_warmup_steps  # value-only updates: the policy stays where it is
        for epoch in range(args.update_epochs):
            # the same global minibatches on one rank or N; this rank holds minibatch_size rows of each
            deal = common.minibatch_rows(
                B, args.num_minibatches, lo * G, args.completions_per_step, args.seed * 7 + step * 131 + epoch
            )
            for mb_rows in deal:
                n_tok = distributed.all_reduce_sum(rmask[mb_rows].sum().detach())  # the minibatch's tokens, all ranks
                n_seq = torch.tensor(float(args.minibatch_size * world), device=device)  # and its sequences
                micro_batches = forward.length_sorted_micro_batches(mb_rows, seq_len, micro)
                for j, rows in enumerate(micro_batches):
                    m = rmask[rows]
                    with distributed.no_sync(policy_ddp, last_micro=j == len(micro_batches) - 1), ctx:
                        logp, entropy, values = policy_ddp(input_ids[rows], attn[rows], P, args.temperature)
                        # ALGO LOGIC: the loss per token
                        pg_loss, clipped = common.clipped_surrogate(
                            logp, old_logp[rows], advantages[rows], args.clip_eps
                        )
                        loss_tok = torch.zeros_like(pg_loss) if warm else pg_loss
                        if args.kl_mode == "loss" and ref is not None and not warm:
                            kl = common.kl_estimate(logp, ref_logp[rows], "k3")
                            loss_tok = loss_tok + args.kl_coef * kl
                        if values is not None:
                            v_loss = common.clipped_value_loss(values, old_values[rows], returns[rows], args.vf_clip)
                            loss_tok = loss_tok + args.vf_coef * v_loss
                        # normalised over the whole minibatch on all ranks; DDP averages, so scale by world
                        w = common.loss_weights(m, "token", n_tok, n_seq, args.max_new_tokens)
                        loss = (loss_tok * w).sum() * world
                    loss.backward()
                    guard.track(loss)
                    with torch.no_grad():
                        stats = {
                            "pg_loss": pg_loss * m,
                            "clipfrac": clipped * m,
                            "entropy": entropy * m,
                            "approx_kl": common.kl_estimate(old_logp[rows], logp, "k3") * m,  # KL(old || new)
                            "tokens": m,
                        }
                        if values is not None:
                            stats["vf_loss"] = v_loss * m
                        for key, v in stats.items():
                            sums[key] = sums.get(key, 0.0) + v.sum().double()
                if warm:  # no gradient, no step, no weight decay for the policy (a shared trunk's value grads too)
                    for p in policy.parameters():
                        p.grad = None
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                critic_norm = (
                    None if critic is None else torch.nn.utils.clip_grad_norm_(critic.parameters(), args.max_grad_norm)
                )
                if guard.ok(step + 1, grad_norm, critic_norm):  # else skipped: zero_grad drops its gradients
                    optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm.double()
        t_update = time.time() - t_update

        # --- 7. logging: the rollouts' sums joined to the update's, reduced over ranks in one all_reduce ------
        sums |= {
            "reward": scores.sum(),
            "completions": float(B),
            "response_len": lengths.sum(),
            "truncated": (~(ro.response_ids == eos).any(-1)).sum(),  # no EOS: cut at max_new_tokens
            "kl_ref": kl_tok.sum(),
            "format_rate": float(sum(gsm8k.extract_final_answer(t) is not None for t in texts)),
        }
        total = distributed.all_reduce_sums(sums)
        n, n_tok = total["completions"], total["tokens"]
        gen_tokens = int(total["response_len"])
        counters["generated_tokens"] += gen_tokens
        counters["trained_tokens"] = counters.get("trained_tokens", 0) + int(n_tok)  # completion tokens x epochs
        counters["step"] = step + 1
        ev = common.explained_variance_masked(old_values, returns, rmask) if critic is not None else float("nan")
        metrics.update(
            {
                **{k: total[k] / n for k in ("reward", "format_rate", "response_len", "truncated")},
                "kl_ref": total["kl_ref"] / max(total["response_len"], 1),
                **{k: total[k] / n_tok for k in ("pg_loss", "clipfrac", "entropy", "approx_kl")},
                "vf_loss": total["vf_loss"] / n_tok if critic is not None else None,
                "value_explained_variance": ev,
                "critic_warmup": float(warm),
                **critics.init_metrics(init),  # --critic-init's pretraining rollouts and tokens, apart
                "grad_norm": total["grad_norm"] / (world * args.update_epochs * args.num_minibatches),
                "nonfinite_skips": guard.take_skips(),
                "lr": scheduler.get_last_lr()[0],
                "generated_tokens": counters["generated_tokens"],
                "time/rollout": t_rollout,
                "time/update": t_update,
                "time/step": time.time() - t0,
                "tokens_per_s": gen_tokens / max(t_rollout, 1e-9),
            }
        )
        postfix = dict(reward=f"{metrics['reward']:.3f}", len=f"{metrics['response_len']:.0f}")  # the progress bar's

        # --- TRY NOT TO MODIFY: the step's end: an evaluation every eval_every steps, the metrics row, and a
        # checkpoint every save_every steps, and now on a stop signal to any rank ----------------------------
        if device.type == "cuda":
            metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if args.eval_every and counters["step"] % args.eval_every == 0 and counters["step"] < args.total_steps:
            metrics.update(gsm8k.eval_metrics("val", run_eval("val", args.eval_size)))
        logger.log(counters["step"], metrics)
        val = {"val": f"{metrics['val/accuracy']:.3f}"} if "val/accuracy" in metrics else {}
        bar.set_postfix(**postfix, **val)
        bar.update(1)

        saved = args.save_every and counters["step"] % args.save_every == 0
        if saved:
            save()
        if stopper.should_stop():  # a signal during the step or its save: the run stops now
            if not saved:
                save()
            if dist_.main:
                print(
                    f"\nstopped by {stopper.name or 'a signal on another rank'} after step {counters['step']}; "
                    f"checkpoint in {run_dir / checkpoint.CHECKPOINT}; continue with --resume",
                    flush=True,
                )
            return
    bar.close()

    # ==================================================================================================
    # ALGO LOGIC: what results.json says of the method: its variant, and its own counts
    # ==================================================================================================
    variant = args.critic
    own = {"trained_tokens": counters.get("trained_tokens", 0), "policy_params": distributed.count_params(policy)}
    own |= init  # --critic-init: its pretraining, apart from the training's counts

    # ==================================================================================================
    # TRY NOT TO MODIFY: the end: a checkpoint, the validation and test accuracy, results.json
    # ==================================================================================================
    save()
    val = run_eval("val", args.eval_size)
    logger.log(counters["step"], gsm8k.eval_metrics("val", val))
    test = run_eval("test", args.test_size)
    counters["wall_time"] = time.time() - t_start
    if dist_.main:
        results = {
            "method": METHOD,
            "variant": variant,
            "seed": args.seed,
            "steps": counters["step"],
            "val": val,
            "generated_tokens": counters["generated_tokens"],
            "mc_tokens": counters["mc_tokens"],
            **own,  # the method's own counts
            "eval_tokens": counters["eval_tokens"],
            "wall_time_s": counters["wall_time"],
            "critic_params": distributed.count_params(critic),
            "args": args_dict,
            "data": data_used,  # the folder actually read (args.data_dir as given) and the fingerprint
            "scaled_down": scaled,
            "test_before": test_before,  # the same test problems before training, or None
            **models.organism_record(args.model),  # the organism's settings and the sha256 of its weights, if it
            **generation.rollout_record(),  # the rollout backend actually used, every fallback and its reason
        }
        logs.write_results(run_dir, results, test, device, world)
    logger.close()


if __name__ == "__main__":
    runtime.run_main(main)
