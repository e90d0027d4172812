"""DPO on GSM8K with preference pairs labelled by the verifier.

DPO's baseline is implicit: the log-ratio of the policy to a frozen reference. Pairs come from the same
strict reward as ppo.py and grpo.py: K completions are sampled per training prompt and a correct one
(chosen) is paired with an incorrect one (rejected); prompts without such a pair are counted and skipped.

Label regimes: `--pairs self` (both sides sampled) or `--pairs gold` (chosen is GSM8K's reference solution
ending in "#### N"; rejected is an incorrect sample). Gold is the default because a weak model rarely
samples a correct answer. Offline (default): pairs drawn once from the reference model and cached in the
run folder as pairs.jsonl. `--online`: drawn again from the current policy every step.

    python dpo.py                                                  # offline gold pairs, on a GPU
    python dpo.py --pairs self --online                            # online self-labelled pairs
    torchrun --standalone --nproc_per_node=8 dpo.py                # data parallel on one node
    torchrun --standalone --nproc_per_node=8 dpo.py --fsdp         # sharded (FSDP2), for a large model
    python dpo.py --model tiny --total-steps 2                     # a smoke run on the CPU

Papers: DPO https://arxiv.org/abs/2305.18290; IPO https://arxiv.org/abs/2310.12036; online / iterative
DPO with verifier labels https://arxiv.org/abs/2404.19733
"""

from __future__ import annotations

import copy
import dataclasses
import json
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
import gsm8k
import intervals
from plumbing import checkpoint, distributed, errors, forward, generation, logs, models, rollout, runtime


@dataclass
class Args:
    # --- run ---
    run_dir: str | None = None
    """folder for the checkpoint, metrics.jsonl and results.json; None: runs/dpo-{pairs}-{offline|online}-s{seed}"""
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
    batch_size: int = 64
    """pairs per step (offline) or prompts per step (online), over all ranks"""
    samples_per_prompt: int = 8
    """completions sampled per prompt (K) to find a correct and an incorrect one"""
    max_new_tokens: int = 256
    """longest completion, in tokens"""
    temperature: float = 1.0
    """sampling temperature of the completions"""
    top_p: float = 1.0
    """nucleus sampling threshold"""

    # --- optimisation ---
    total_steps: int = 200
    """training steps (one optimiser step each)"""
    token_budget: int = 0
    """stop once rollouts have generated this many tokens (0: no budget); offline, it caps the pair sampling"""
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
    micro_batch_size: int = 16
    """pairs per forward on each rank (gradient accumulation up to the step's pairs)"""

    # --- DPO ---
    pairs: Literal["self", "gold"] = "gold"
    """self: chosen and rejected both sampled; gold: chosen is GSM8K's reference solution"""
    online: bool = False
    """sample pairs from the current policy every step; off: once, from the reference model"""
    offline_prompts: int = 2048
    """training prompts sampled once for the offline pair set"""
    beta: float = 0.1
    """DPO's beta: the strength of the implicit KL to the reference"""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid (DPO) or ipo"""
    update_epochs: int = 1
    """passes over each step's pairs"""

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
    """prompts per generation batch in evaluation (and in offline pair sampling)"""
    eval_max_new_tokens: int = 400
    """longest completion in evaluation"""
    save_every: int = 25
    """checkpoint every this many steps (and at the end, and on SIGTERM)"""

    # --- sizes, filled at runtime from the above (not flags); recorded in results.json ---
    batch_per_rank: tyro.conf.Suppress[int] = 0
    """filled at runtime: batch_size / the world size (online, pairs are then spread evenly over the ranks)"""
    optimizer_steps: tyro.conf.Suppress[int] = 0
    """filled at runtime: total_steps x update_epochs, the learning-rate schedule's length"""


# The sizes above: they follow from the settings and the world size, so a resume (on any world) does not check them.
SIZES = ("batch_per_rank", "optimizer_steps")


def validate(args: Args) -> None:
    """Every numeric flag in its range, right after parsing: one `error:` line and exit 2 before anything loads."""
    logs.check_tracking(args)  # --track without wandb installed
    runtime.check_ranges(  # the method's own flags; the ones the trainers share are runtime.SHARED_RANGES
        args,
        positive=("samples_per_prompt", "offline_prompts", "beta"),
    )


# The CPU presets: what this script runs on a machine without a GPU, minutes on 2 cores (runtime.cli: the first is
# the default model's; a model without its own takes the last). organism: the model organism (organism.py), which
# solves some of its problems and not others, so a run shows learning: the test split before and after, paired
# (docs/organism/README.md: how the sizes were chosen). smollm2: GSM8K on the packaged SmolLM2-135M, every part of a
# run small: it shows the pipeline, not the answer (0% either way).
CPU_SCALE = {
    "organism": dict(
        model="organism", batch_size=32, samples_per_prompt=4, max_new_tokens=64, total_steps=30, micro_batch_size=64,
        offline_prompts=512, lr=1e-5, eval_every=10, eval_size=500, test_size=0, eval_batch_size=500,
        eval_max_new_tokens=64, save_every=10,
    ),
    "smollm2": dict(
        model="smollm2", batch_size=4, samples_per_prompt=4, max_new_tokens=96, total_steps=6, micro_batch_size=4,
        offline_prompts=16, lr=2e-6, eval_every=6, eval_size=32, test_size=64, eval_batch_size=32,
        eval_max_new_tokens=192, save_every=6,
    ),
}  # fmt: skip

METHOD = "dpo"  # the banner's title, the progress bar's, results.json's method


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
    if args.pairs == "gold" and args.task != "gsm8k":
        raise errors.UserError("--pairs gold needs --task gsm8k (the reference solutions are GSM8K's)")
    if args.samples_per_prompt < (2 if args.pairs == "self" else 1):
        raise errors.UserError(f"--samples-per-prompt {args.samples_per_prompt} cannot give a {args.pairs} pair")
    runtime.check_divides("--batch-size", args.batch_size, world, "the world size")
    args.batch_per_rank = args.batch_size // world
    args.optimizer_steps = args.total_steps * args.update_epochs
    micro = args.micro_batch_size
    sampled = args.batch_size // world if args.online else args.eval_batch_size  # prompts per sampling batch
    models.check_generation_memory(args.model, device, {  # the largest generation batches, before anything loads
        "--batch-size (online) or --eval-batch-size (offline) x --samples-per-prompt": (
            sampled * args.samples_per_prompt, args.max_new_tokens),
        "--eval-batch-size": (args.eval_batch_size, args.eval_max_new_tokens),
    })  # fmt: skip
    run_dir = Path(args.run_dir or f"runs/dpo-{args.pairs}-{'online' if args.online else 'offline'}-s{args.seed}")

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
    ref = copy.deepcopy(policy).eval().requires_grad_(False)  # DPO's baseline: the log-ratio to this model
    critic = None  # DPO has no critic
    policy_fwd = forward.PolicyForward(policy, compile=args.compile)
    ref_fwd = forward.PolicyForward(ref, compile=args.compile)
    policy_ddp = distributed.parallelize(policy_fwd, ref_fwd, dist_, args.fsdp)  # DDP, FSDP2 or policy_fwd itself
    policy_full = distributed.FullWeights(policy, device)  # a gathered copy under --fsdp, else the policy itself
    groups = [{"params": list(policy.parameters()), "lr": args.lr}]
    optimizer = torch.optim.AdamW(groups, weight_decay=args.weight_decay, eps=1e-8)
    guard = runtime.FiniteGuard(policy)  # a non-finite loss or gradient skips the step; a second stops
    per_step = args.update_epochs  # optimiser steps a training step
    progress = common.BudgetProgress(args.token_budget, per_step) if args.token_budget and args.online else None
    lr_factor = common.lr_schedule(args.lr_schedule, args.warmup_steps, args.optimizer_steps, progress)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    online = "online" if args.online else "offline"
    banner = {
        "pairs": f"{args.pairs}, {online}, {args.loss} loss, beta {args.beta}",
        "batch": f"{args.batch_size} {'prompts x ' + str(args.samples_per_prompt) if args.online else 'pairs'}"
        f"/step; {args.update_epochs} epochs",
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
    # ALGO LOGIC: the pairs: sampled K times a prompt and labelled by the verifier, their summed log-probs under a
    # model, the reference's (DPO's baseline), and the pairs spread evenly over the ranks
    # ==================================================================================================
    def sample_pairs(idx: list[int], first: int, n_global: int, step: int, stream: int, lm) -> tuple:
        """This rank's prompts idx (global positions first.. of n_global), sampled K times each by lm ->
        (pairs, named sums). Scored by the shared reward; a pair is (chosen, rejected) token ids; prompts
        without one are counted."""
        k = args.samples_per_prompt
        if not idx:
            return [], {"reward": 0.0, "completions": 0.0, "no_pair": 0.0, "response_len": 0.0}
        if args.online:
            u = rollout.step_uniforms(args.seed, step, stream, n_global * k, args.max_new_tokens, device)
            u = u[first * k : (first + len(idx)) * k]  # this rank's rows of the global table
        else:  # only these rows of the offline table: memory in proportion to the chunk, not to --offline-prompts
            u = common.uniform_rows(args.seed, stream, first * k, len(idx) * k, args.max_new_tokens, device)
        ro = generation.generate(
            lm, [prompt_ids(i) for i in idx for _ in range(k)], max_new_tokens=args.max_new_tokens, eos_id=eos,
            pad_id=pad, uniforms=u, temperature=args.temperature, top_p=args.top_p,
        )  # fmt: skip
        texts, ids = rollout.decode_responses(tokenizer, ro)
        golds = [splits["train"][i].gold for i in idx for _ in range(k)]
        scores = gsm8k.score(args.task, texts, ids, golds)
        pairs = []
        for j, i in enumerate(idx):
            group = range(j * k, (j + 1) * k)
            right = [r for r in group if scores[r] == 1.0]
            wrong = [r for r in group if scores[r] == 0.0]
            if args.pairs == "gold" and wrong:
                solution = gsm8k.reference_solution(splits["train"][i])
                chosen = tokenizer(solution, add_special_tokens=False)["input_ids"] + [eos]
                pairs.append({"prompt": i, "chosen": chosen, "rejected": ids[wrong[0]]})
            elif args.pairs == "self" and right and wrong:
                pairs.append({"prompt": i, "chosen": ids[right[0]], "rejected": ids[wrong[0]]})
        n_no_pair = float(len(idx) - len(pairs))
        stats = {"reward": sum(scores), "completions": float(len(scores)), "no_pair": n_no_pair}
        return pairs, stats | {"response_len": ro.lengths.sum()}

    def seq_logps(module: torch.nn.Module, pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed response log-probs of chosen and rejected, one forward over both.  -> [N], [N]"""
        ids, attn, P = rollout.join_prompt_response(
            [prompt_ids(p["prompt"]) for p in pairs] * 2,
            [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs],
            pad,
        )
        ids, attn = ids.to(device), attn.to(device)
        seq = module(ids, attn, P)[0].sum(-1)  # [2N, T] log-probs, 0 on padding -> [2N]
        return seq[: len(pairs)], seq[len(pairs) :]

    def reference_logps(pairs: list[dict]) -> None:
        """DPO's baseline, computed once per pair with the frozen reference, in micro-batches."""
        with torch.no_grad(), ctx:
            for s in range(0, len(pairs), micro):
                c, r = seq_logps(ref_fwd, pairs[s : s + micro])
                for p, rc, rr in zip(pairs[s : s + micro], c.tolist(), r.tolist()):
                    p["ref_chosen"], p["ref_rejected"] = rc, rr

    def spread(pairs: list[dict]) -> tuple[int, list[dict]]:
        """Every rank's pairs gathered, then dealt out evenly, each pair whole; the last shares are padded with
        zero-weight copies, so that every rank runs the same forwards.  -> (pairs over all ranks, this rank's share)"""
        everyone = [p for part in distributed.all_gather_objects(pairs) for p in part]
        per_rank = -(-len(everyone) // world)
        padded = everyone + [dict(everyone[0], weight=0.0)] * (per_rank * world - len(everyone)) if everyone else []
        return len(everyone), padded[dist_.rank * per_rank : (dist_.rank + 1) * per_rank]

    # ==================================================================================================
    # ALGO LOGIC: what the steps draw from: offline, the pairs drawn once from the reference model and cached
    # in the run folder; online, the train prompts; and the token budget that ends the loop
    # ==================================================================================================
    pair_set: list[dict] = []
    pairs_path = run_dir / "pairs.jsonl"
    if not args.online:
        if pairs_path.is_file():
            try:
                pair_set = [json.loads(line) for line in pairs_path.read_text().splitlines()]
            except ValueError:
                raise errors.UserError(f"{pairs_path} is damaged; remove it to sample the pairs again") from None
        else:
            offline = gsm8k.PromptSampler(len(splits["train"]), args.seed + 1).next(args.offline_prompts)
            chunk = args.eval_batch_size * world
            ref_gen = distributed.FullWeights(ref, device).get()  # the reference with whole weights, for sampling
            pair_stats = {"reward": 0.0, "completions": 0.0, "no_pair": 0.0, "response_len": 0.0}  # named sums
            bar = tqdm(total=len(offline), desc="offline pairs", disable=not (dist_.main and args.progress))
            with runtime.stoppable("the offline pair sampling"):  # a stop signal: at once, nothing saved
                for start in range(0, len(offline), chunk):
                    runtime.stop_point()  # every rank passes it once a chunk: under torchrun they stop together
                    part = offline[start : start + chunk]
                    per = -(-len(part) // world)  # the last chunk may leave a rank fewer prompts, or none
                    mine = part[dist_.rank * per : (dist_.rank + 1) * per]
                    # uniforms indexed by the prompt's place in the whole offline list: the same samples on 1 rank or N
                    pairs, stats = sample_pairs(mine, start + dist_.rank * per, len(offline), 0, 10, ref_gen)
                    _, pairs = spread(pairs)  # the same number of reference forwards on every rank
                    reference_logps(pairs)
                    for gathered in distributed.all_gather_objects(pairs):
                        pair_set += [p for p in gathered if p.get("weight", 1.0) > 0]
                    for key, v in distributed.all_reduce_sums(stats).items():
                        pair_stats[key] += v
                    bar.update(len(part))
                    if args.token_budget and pair_stats["response_len"] >= args.token_budget:
                        break
            bar.close()
            del ref_gen
            counters["generated_tokens"] = int(pair_stats["response_len"])
            if dist_.main:
                tmp = pairs_path.with_name(".pairs.jsonl.tmp")
                tmp.write_text("".join(json.dumps(p) + "\n" for p in pair_set))
                tmp.replace(pairs_path)
                offline_metrics = {
                    "pairs/count": len(pair_set),
                    "pairs/no_pair_share": intervals.ratio(pair_stats["no_pair"], len(offline)),
                    "pairs/sampled_reward": intervals.ratio(pair_stats["reward"], pair_stats["completions"]),
                    "generated_tokens": counters["generated_tokens"],
                }
                logger.log(0, offline_metrics)
        if not pair_set:
            raise errors.UserError(
                f"no prompt yielded a {args.pairs} pair (every sample was {'right' if args.pairs == 'self' else 'wrong'}"
                " or the other side never came up); try --pairs gold or more --samples-per-prompt"
            )
        if dist_.main:
            print(f"offline pairs: {len(pair_set)} in {pairs_path}", flush=True)
    # the reference scored each cached pair once, before the first step
    offline_reference_tokens = sum(len(p["chosen"]) + len(p["rejected"]) for p in pair_set)
    sampler = gsm8k.PromptSampler(len(pair_set) if not args.online else len(splits["train"]), args.seed)
    if args.resume:
        sampler.load_state_dict(state["sampler"])  # where the checkpoint left it
    budget = args.token_budget if args.online else 0  # offline, it capped the pair sampling

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
        # ALGO LOGIC: the step, 1. to 5.
        # --- 1. rollouts: online, K completions of each of this rank's prompts; offline, cached pairs --------
        lo, hi = common.shard_range(args.batch_size, dist_.rank, world)
        if args.online:  # K fresh samples per prompt from the current policy
            batch_idx = sampler.next(args.batch_size)
            pairs, stats = sample_pairs(batch_idx[lo:hi], lo, args.batch_size, step, 0, policy_full.get())
            sums |= {f"sampled/{key}": v for key, v in stats.items()}
        else:  # a batch of the cached pairs
            pairs = [pair_set[i] for i in sampler.next(args.batch_size)[lo:hi]]
        t_rollout = time.time() - t0

        # --- 2. rewards: the pairs, labelled by the shared verifier, spread evenly over the ranks -------------
        if args.online:  # pairs stay whole; spread them evenly over ranks, padding with zero-weight copies
            n_real, pairs = spread(pairs)
            if not n_real and step == 0:
                raise errors.UserError(
                    f"no prompt of the first batch yielded a {args.pairs} pair; try --pairs gold or more "
                    "--samples-per-prompt"
                )
        else:
            n_real = args.batch_size

        # --- 3. ALGO LOGIC: the reference's log-probs (DPO's baseline: the log-ratio to it) ------------------
        if args.online:
            reference_logps(pairs)
        weights = torch.tensor([p.get("weight", 1.0) for p in pairs], device=device)  # [N]
        # the tokens the update trains (each real pair's chosen and rejected) and, online, the reference scored
        sums["pair_tokens"] = float(sum(len(p["chosen"]) + len(p["rejected"]) for p in pairs if p.get("weight", 1.0)))
        ref_c = torch.tensor([p["ref_chosen"] for p in pairs], device=device)  # [N]
        ref_r = torch.tensor([p["ref_rejected"] for p in pairs], device=device)  # [N]

        # --- 4. update: update_epochs optimiser steps over the step's pairs ----------------------------------
        if progress is not None:  # online: the schedule follows the token budget: this step's sampled tokens, all ranks
            spent = distributed.all_reduce_sum(torch.as_tensor(sums["sampled/response_len"]).double()).item()
            progress.start_step(counters["generated_tokens"], spent, scheduler.last_epoch)
        t_update = time.time()
        N = len(pairs)
        for _epoch in range(args.update_epochs):
            if not n_real:  # no pair, no update; the schedule still moves on, so that it ends where it should
                scheduler.step()
                continue
            for s in range(0, N, micro):
                sl = slice(s, s + micro)
                with distributed.no_sync(policy_ddp, last_micro=s + micro >= N), ctx:
                    pi_c, pi_r = seq_logps(policy_ddp, pairs[sl])
                    # ALGO LOGIC: the loss per pair
                    loss_pair, margin = common.dpo_loss(pi_c, pi_r, ref_c[sl], ref_r[sl], args.beta, args.loss)
                    # mean over the step's real pairs on all ranks; DDP averages, so scale by world
                    loss = (loss_pair * weights[sl]).sum() / n_real * world
                loss.backward()
                guard.track(loss)
                with torch.no_grad():
                    w = weights[sl]
                    stats = {
                        "loss": loss_pair * w,
                        "reward_accuracy": (margin > 0).float() * w,
                        "margin": margin * w,
                        "chosen_reward": args.beta * (pi_c - ref_c[sl]) * w,
                        "rejected_reward": args.beta * (pi_r - ref_r[sl]) * w,
                        "weight": w,
                    }
                    for key, v in stats.items():
                        sums[key] = sums.get(key, 0.0) + v.sum().double()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            if guard.ok(step + 1, grad_norm):  # else skipped: zero_grad drops its gradients
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm.double()
        t_update = time.time() - t_update

        # --- 5. logging: the step's sums, reduced over ranks in one all_reduce -------------------------------
        total = distributed.all_reduce_sums(sums)
        n_pairs = total.get("weight", 0.0)  # 0 when no prompt of an online step yielded a pair: logged as null
        counters["step"] = step + 1
        counters["trained_tokens"] = counters.get("trained_tokens", 0) + int(total["pair_tokens"]) * args.update_epochs
        if args.online:  # offline, the reference scored every cached pair once, before step 1 (results.json)
            counters["reference_tokens"] = counters.get("reference_tokens", 0) + int(total["pair_tokens"])
        keys = ("loss", "reward_accuracy", "margin", "chosen_reward", "rejected_reward")
        metrics.update({k: total[k] / n_pairs if n_pairs else float("nan") for k in keys})
        metrics.update(
            {
                "pairs": n_real,
                "grad_norm": total.get("grad_norm", 0.0) / (world * max(1, args.update_epochs)),
                "nonfinite_skips": guard.take_skips(),
                "lr": scheduler.get_last_lr()[0],
                "time/rollout": t_rollout,
                "time/update": t_update,
                "time/step": time.time() - t0,
            }
        )
        if args.online:  # the round's samples
            sampled = {key.removeprefix("sampled/"): v for key, v in total.items() if key.startswith("sampled/")}
            counters["generated_tokens"] += int(sampled["response_len"])
            metrics.update(
                {
                    "reward": intervals.ratio(sampled["reward"], sampled["completions"]),
                    "no_pair_share": sampled["no_pair"] / args.batch_size,
                    "tokens_per_s": sampled["response_len"] / max(t_rollout, 1e-9),
                }
            )
        metrics["generated_tokens"] = counters["generated_tokens"]
        postfix = dict(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['reward_accuracy']:.2f}")  # the progress bar's

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
    variant = f"{args.pairs}-{online}"
    own = {  # what compute it took (report.py's FLOPs): the pair tokens trained, and those the reference scored
        "trained_tokens": counters.get("trained_tokens", 0),
        "reference_tokens": counters.get("reference_tokens", 0) + offline_reference_tokens,
        "policy_params": distributed.count_params(policy),
    }

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
