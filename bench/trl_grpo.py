"""TRL's GRPOTrainer with the settings bench/throughput.py gives grpo.py: seconds per optimiser step.

The same model (fp32 master weights, bf16 autocast on a GPU), the same chat prompts and strict GSM8K reward
(common.py, runtime.py), `prompts` x `generations` completions of at most `max_new_tokens` tokens per step, one pass
over them, generation through transformers' generate() (TRL's default without vLLM). Run by
bench/throughput.py in its own process; writes {"step_seconds": [...], "peak_gib": ...} to --out.

    pip install -r bench/requirements.txt
    python bench/trl_grpo.py --model-dir DIR --out trl.json
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402


@dataclass
class Args:
    model_dir: str
    """a transformers model folder with its tokenizer (bench/throughput.py passes runtime.resolve_model's)"""
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

    splits = common.load_gsm8k(args.data_dir)
    rows = [
        {"prompt": [{"role": "user", "content": common.prompt_text(p.question)}], "gold": p.gold}
        for p in splits["train"][: max(args.prompts * (args.steps + 1), 64)]
    ]  # the same user message as common.encode_prompt's chat prompt

    def gsm8k_reward(completions, gold, **kwargs) -> list[float]:
        return [common.gsm8k_reward(c[0]["content"], g) for c, g in zip(completions, gold)]

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
    )
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
    }
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
