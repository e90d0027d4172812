"""TRL's GRPOTrainer with the settings bench/throughput.py gives grpo.py: seconds per optimiser step.

The same model (fp32 master weights, bf16 autocast on a GPU), the same chat prompts and strict GSM8K reward
(gsm8k.py, plumbing/models.py), `prompts` x `generations` completions of at most `max_new_tokens` tokens per step, one pass
over them, generation through transformers' generate() (TRL's default without vLLM). Run by
bench/throughput.py in its own process; writes {"step_seconds": [...], "peak_gib": ..., "differs_from_grpo": {...}}
to --out: every TRL setting that differs from grpo.py's in the benchmark, printed beside the ratio. Gradient
checkpointing is off, as in grpo.py (TRL 1.16 turns it on by default: ~30% more time per step).

    pip install -r bench/requirements.txt
    python bench/trl_grpo.py --model-dir DIR --out trl.json
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gsm8k


@dataclass
class Args:
    model_dir: str
    """a transformers model folder with its tokenizer (bench/throughput.py passes models.resolve_model's)"""
    out: str
    """where to write the step times (JSON)"""
    data_dir: str | None = None
    """GSM8K folder (default: $GSM8K_DIR)"""
    device: str = "cuda"
    """cuda or cpu"""
    prompts: int = 64
    """prompts per step"""
    generations: int = 8
    """completions per prompt"""
    micro_batch_size: int = 64
    """completions per forward (TRL's per_device_train_batch_size)"""
    max_new_tokens: int = 256
    """longest completion"""
    steps: int = 4
    """optimiser steps to run"""
    beta: float = 0.04
    """KL coefficient (a reference model forward per step when > 0), as grpo.py's default"""
    lr: float = 1e-6
    """learning rate"""
    run_dir: str = "bench/out/trl-run"
    """TRL's output_dir (nothing is saved)"""
    grpo_args: str = ""
    """the arguments bench/throughput.py gives grpo.py (its settings are grpo.py's defaults with these)"""
    prompt_format: str = "chat"
    """chat (the question and the instruction as the user message) or question (the question alone: the organism's)"""


def grpo_settings(arg_string: str) -> dict:
    """grpo.py's Args as the benchmark runs it: its defaults, with the `--name value` / `--flag` / `--no-flag`
    arguments of arg_string applied (the few the benchmark passes; no validation)."""
    import grpo

    settings = dataclasses.asdict(grpo.Args())
    words = shlex.split(arg_string)
    i = 0
    while i < len(words):
        name = words[i][2:].replace("-", "_")
        if name in settings and isinstance(settings[name], bool):
            settings[name], i = True, i + 1
        elif name.startswith("no_") and isinstance(settings.get(name[3:]), bool):
            settings[name[3:]], i = False, i + 1
        elif name in settings and i + 1 < len(words):
            kind = type(settings[name]) if settings[name] is not None else str
            settings[name], i = kind(words[i + 1]), i + 2
        else:
            i += 1
    return settings


def differences_from_grpo(config, g: dict, completions: int) -> dict[str, dict]:
    """{TRL setting: {"trl": its value, "grpo.py": the equivalent}} for every compared setting that differs.
    config: a GRPOConfig (or anything with its attributes); g: grpo_settings(); completions per step."""
    minibatches = g["num_minibatches"]
    accumulation = getattr(config, "gradient_accumulation_steps", 1)
    # TRL counts micro-steps per generation (default: the accumulation steps, i.e. one optimiser step)
    steps_per_gen = (getattr(config, "steps_per_generation", None) or accumulation) // max(1, accumulation)
    pairs = {
        "learning_rate": (config.learning_rate, g["lr"]),
        "beta": (config.beta, g["kl_coef"]),
        "epsilon": (getattr(config, "epsilon", None), g["clip_eps"]),
        "epsilon_high": (
            getattr(config, "epsilon_high", None) or getattr(config, "epsilon", None),
            g["clip_eps_high"] or g["clip_eps"],
        ),
        "temperature": (config.temperature, g["temperature"]),
        "top_p": (config.top_p, g["top_p"]),
        "num_iterations": (config.num_iterations, g["update_epochs"]),
        "optimizer_steps_per_generation": (steps_per_gen, minibatches),
        "scale_rewards": (str(getattr(config, "scale_rewards", None)), g["scale_rewards"]),
        "loss_type": (getattr(config, "loss_type", None), f"loss_norm={g['loss_norm']}"),
        "max_grad_norm": (config.max_grad_norm, g["max_grad_norm"]),
        "weight_decay": (config.weight_decay, g["weight_decay"]),
        "lr_scheduler_type": (str(getattr(config, "lr_scheduler_type", None)).split(".")[-1].lower(), g["lr_schedule"]),
        "warmup_steps": (getattr(config, "warmup_steps", 0), g["warmup_steps"]),
        "gradient_checkpointing": (config.gradient_checkpointing, g["gradient_checkpointing"]),
        "num_generations": (config.num_generations, g["group_size"]),
        "max_completion_length": (config.max_completion_length, g["max_new_tokens"]),
        "completions_per_step": (completions, g["batch_size"] * g["group_size"]),
    }
    equal_names = {  # TRL's names for what grpo.py calls otherwise
        "scale_rewards": {"group": "group", "True": "group", "False": "none", "none": "none"},
        "loss_type": {"dapo": "loss_norm=token", "grpo": "loss_norm=sequence", "dr_grpo": "loss_norm=constant"},
    }
    out = {}
    for name, (trl, ours) in pairs.items():
        same = trl == ours or (name in equal_names and equal_names[name].get(str(trl)) == ours)
        if not same:
            out[name] = {"trl": trl, "grpo.py": ours}
    return out


def user_message(question: str, prompt_format: str) -> str:
    """The user message gsm8k.encode_prompt puts through the chat template: the question and the instruction
    (chat), or the question alone (question)."""
    return question.strip() if prompt_format == "question" else gsm8k.prompt_text(question)


class StepTimer:
    """A TrainerCallback that times each optimiser step (generation, scoring and update), synchronising the GPU."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._t0 = 0.0

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.seconds.append(time.perf_counter() - self._t0)


def main() -> None:
    args = tyro.cli(Args)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if args.prompt_format not in ("chat", "question"):
        raise SystemExit(
            f"--prompt-format {args.prompt_format!r}: TRL's prompts here are chat messages (chat or question)"
        )
    splits = gsm8k.load_gsm8k(args.data_dir)
    rows = [
        {"prompt": [{"role": "user", "content": user_message(p.question, args.prompt_format)}], "gold": p.gold}
        for p in splits["train"][: max(args.prompts * (args.steps + 1), 64)]
    ]

    def gsm8k_reward(completions, gold, **kwargs) -> list[float]:
        return [gsm8k.gsm8k_reward(c[0]["content"], g) for c, g in zip(completions, gold)]

    cuda = args.device.startswith("cuda")
    n = args.prompts * args.generations
    if n % args.micro_batch_size:
        raise SystemExit(f"completions per step ({n}) must be a multiple of --micro-batch-size")
    config = GRPOConfig(
        output_dir=args.run_dir,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=n // args.micro_batch_size,  # one generation of n completions per step
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        num_iterations=1,
        beta=args.beta,
        learning_rate=args.lr,
        temperature=1.0,
        top_p=1.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=cuda,
        use_cpu=not cuda,
        seed=1,
        disable_tqdm=True,
        gradient_checkpointing=False,  # as grpo.py (TRL 1.16's default is True)
    )
    differs = differences_from_grpo(config, grpo_settings(args.grpo_args), n)
    for name, pair in differs.items():
        print(f"TRL setting {name} = {pair['trl']!r}, grpo.py: {pair['grpo.py']!r}", flush=True)
    timer = StepTimer()
    callback = type(
        "Timer", (TrainerCallback,), {"on_step_begin": timer.on_step_begin, "on_step_end": timer.on_step_end}
    )
    trainer = GRPOTrainer(
        model=args.model_dir,
        reward_funcs=gsm8k_reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        callbacks=[callback()],
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    out = {
        "step_seconds": timer.seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "completions_per_step": n,
        "trl_version": __import__("trl").__version__,
        "differs_from_grpo": differs,
    }
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
