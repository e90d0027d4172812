"""The sweep's preflight: can the study's model answer the question at the study's settings, before a GPU-day?

A baseline matters only where 0 < p < 1: a prompt the model always or never solves carries no information about
any baseline (docs/science.md). This samples the reference GRPO line of the sweep's plan (its model, task, prompt
format, temperature, top-p, max new tokens and group size G, read from the trainer as it would run them) for a few
hundred train prompts, G times each, and writes OUT/preflight.json: the pass rate, the signal E[p(1-p)] (unbiased),
the share of informative prompts (0 < p_hat < 1), their counts, and the standard error that the run's Monte Carlo
measurement would then have for GRPO's nmse and for a perfect critic's (predicted_se). It prints one line and exits
0 when the informative share reaches the threshold, 3 when it does not. ./sweep.sh runs it (docs/sweep.md):

    ./sweep.sh --preflight                       # the plan's reference GRPO line, on this machine
    python preflight.py --out runs/sweep -- grpo.py --model smollm2 --task gsm8k    # any GRPO command

Holds: the sampling (gsm8k.encode_prompt, generation.generate, gsm8k.score: the trainers' own prompt, sampler and
reward), the estimators, the predicted standard error of nmse, the verdict. Does not hold: any training, the plan
(sweep.sh), the scheduling (sweep_runner.py), the report (report.py). The trainer's settings come from the trainer
itself: the preflight imports the one its command names and parses the command with runtime.cli, as the trainer would.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import common
import gsm8k
import measure
from plumbing import distributed, errors, generation, models, rollout, rundir, runtime

REPO = Path(__file__).resolve().parent
MIN_INFORMATIVE = 0.2  # refuse below this share of prompts with 0 < p_hat < 1
GPU_PROMPTS, CPU_PROMPTS = 256, 8  # the default sample: 256 x G on a GPU, a handful on the CPU
EXIT_NO_SIGNAL = 3


@dataclass
class Args:
    """python preflight.py [OPTIONS] -- grpo.py [its flags]: the GRPO command after --, as the sweep would run it (./sweep.sh
    --preflight builds it from the plan). Exit 0: enough signal; 3: refused; 2: a bad command."""

    out: str = "runs/sweep"
    """folder for preflight.json (the sweep's --out)"""
    prompts: int = 0
    """train prompts sampled, group-size times each (0: 256 on a GPU, 8 on the CPU)"""
    min_informative: float = MIN_INFORMATIVE
    """the threshold: exit 3 when fewer than this share of the prompts have 0 < p_hat < 1"""


# ======================================================================================================
# The estimators: per prompt G samples of a 0/1 reward
# ======================================================================================================


def signal_stats(scores: torch.Tensor) -> dict[str, float]:
    """The signal of G 0/1 rewards per prompt.  scores [n, G] -> dict

    With j successes of G at prompt i (p_hat = j / G) and q = p(1 - p):
      pass_rate   = mean of the scores
      signal      = mean_i p_hat (1 - p_hat) G / (G - 1)             unbiased for E[q] (j (G - j) / (G (G - 1)))
      signal_sq   = mean_i j (j-1) (G-j) (G-j-1) / (G (G-1) (G-2) (G-3))   unbiased for E[q^2], G >= 4; below
                    G = 4 no unbiased estimator exists and the bound E[q^2] <= E[q] / 4 (q <= 1/4) stands in
      informative = share of prompts with 0 < p_hat < 1 (their G rewards not all equal)
    """
    n, G = scores.shape
    if G < 2:
        raise errors.UserError(f"the preflight needs a group of at least 2 samples per prompt, got {G}")
    j = scores.double().sum(-1)  # [n] successes per prompt
    q = j * (G - j) / (G * (G - 1))  # [n] unbiased for p (1 - p)
    if G >= 4:
        q2 = j * (j - 1) * (G - j) * (G - j - 1) / (G * (G - 1) * (G - 2) * (G - 3))  # [n] unbiased for q^2
        signal_sq = q2.mean().item()
    else:
        signal_sq = q.mean().item() / 4
    mixed = (j > 0) & (j < G)
    return {
        "pass_rate": scores.double().mean().item(),
        "signal": q.mean().item(),
        "signal_sq": signal_sq,
        "signal_sq_unbiased": G >= 4,
        "informative": mixed.double().mean().item(),
        "prompts": n,
        "samples_per_prompt": G,
        "samples": n * G,
        "correct": int(j.sum().item()),
        "informative_prompts": int(mixed.sum().item()),
    }


def predicted_se(signal: float, signal_sq: float, states: float, k: int, baseline_samples: int | None) -> float:
    """The standard error of a run's pooled nmse (measure.baseline_error) over `states` measured states.

    At each state a baseline b, K fresh 0/1 returns with mean p_hat and unbiased variance s^2, q = p(1 - p).
    baseline_error pools X = (b - p_hat)^2 - s^2 / K over D = s^2: nmse = sum X / sum D, E[D | p] = q. For b the
    mean of n rewards of the same state, independent of the K (GRPO's leave-one-out mean at the prompt: n = G - 1),
    E[X | p] = q / n, so nmse -> r = 1 / n; a perfect critic (b = p): r = 0. By the delta method
    Var(nmse) = sum Var(X - r D) / (sum E[D])^2, and exactly, over the binomial laws of the n and the K samples,
      E[(X - r D)^2 | p] = c1 q + c2 q^2
      perfect critic:  c1 = 0,                  c2 = 2 / (K (K - 1))
      mean of n:       c1 = (K + n) / (K n^3),  c2 = 2 (K + n)(K n - 3K + n^2 + 3) / (K (K - 1) n^3)
    so  SE = sqrt((c1 E[q] + c2 E[q^2]) / N) / E[q],  with N the states (for unequal weights w, N = (sum w)^2 /
    sum w^2). Assumes the states are independent draws of the prompts' p: exact for the perfect critic (its X are
    uncorrelated given the states), GRPO's at the prompt states only. baseline_samples None: the perfect critic.
    Returns nan when E[q] = 0 (nothing to measure).
    """
    if signal <= 0 or states <= 0:
        return math.nan
    if baseline_samples is None:
        c1, c2 = 0.0, 2 / (k * (k - 1))
    else:
        n = baseline_samples
        c1 = (k + n) / (k * n**3)
        c2 = 2 * (k + n) * (k * n - 3 * k + n * n + 3) / (k * (k - 1) * n**3)
    return math.sqrt(max(0.0, c1 * signal + c2 * signal_sq) / states) / signal


def measurement_plan(args: dict, lengths: Sequence[int]) -> dict[str, float]:
    """What one run measures (report.py pools its measurements after the first): measurements, prompt states, all
    states and their effective number under the token weights of measure.mc_state_positions, for completions as
    long as the preflight's (lengths)."""
    if not args.get("mc_every"):
        return {"measurements": 0, "prompt_states": 0, "states": 0, "effective_states": 0.0}
    taken = len(range(0, int(args["total_steps"]), int(args["mc_every"])))
    m = taken - 1 if taken > 1 else taken  # report.py leaves the first out (the untrained critic)
    per = [[w for _, w in measure.mc_state_positions(int(n), int(args["mc_states"]), 0)] for n in lengths] or [[1.0]]
    sum_w = sum(sum(w) for w in per) / len(per)  # per completion, averaged
    sum_w2 = sum(sum(x * x for x in w) for w in per) / len(per)
    count = sum(len(w) for w in per) / len(per)
    completions = m * int(args["mc_prompts"])
    return {
        "measurements": m,
        "prompt_states": completions,
        "states": round(completions * count),
        "effective_states": completions * sum_w**2 / sum_w2,
    }


def verdict(stats: dict, threshold: float) -> tuple[bool, str]:
    """(passed, the one line the preflight prints)."""
    se = stats["predicted"]

    def num(x: float | None) -> str:
        return "n/a" if x is None or not math.isfinite(x) else f"{x:.3f}"

    ok = stats["informative"] >= threshold
    line = (
        f"preflight: {stats['settings']['model']} on {stats['settings']['task']}: pass rate {stats['pass_rate']:.3f}, "
        f"signal E[p(1-p)] {stats['signal']:.4f}, informative {stats['informative']:.2f} "
        f"({stats['informative_prompts']} of {stats['prompts']} prompts x {stats['samples_per_prompt']}); "
        f"predicted SE of one run's nmse: GRPO {num(se['se_nmse_grpo'])} (its value {num(se['nmse_grpo'])}), "
        f"perfect critic {num(se['se_nmse_perfect'])} ({se['states']} states, K {se['mc_samples']}) -> "
    )
    if ok:
        return True, line + f"enough signal (informative {stats['informative']:.2f} >= {threshold:g})"
    return False, line + f"refused: informative {stats['informative']:.2f} < {threshold:g}"


# ======================================================================================================
# Sampling: the reference GRPO line's settings, through the trainers' prompt, sampler and reward
# ======================================================================================================


TRAINERS = ("ppo.py", "grpo.py", "dpo.py")  # the scripts whose command the preflight reads


def trainer_settings(command: Sequence[str]) -> dict:
    """The settings a trainer command would run with, its preset applied: the trainer named first (a trainer of
    this repository) is imported and its Args and CPU preset go through runtime.cli, in this process. Anything
    else, a bad flag among the trainer's, or a trainer without a group, is a UserError of one line."""
    script = Path(command[0]) if command else None
    if script is None or script.name not in TRAINERS or (REPO / script).resolve() != REPO / script.name:
        given = f" (got {command[0]})" if command else ""
        raise errors.UserError(
            f"give a trainer's command after --, one of {', '.join(TRAINERS)} of this repository{given}: "
            "python preflight.py -- grpo.py --model tiny"
        )
    import dpo  # the trainers sit a layer below the preflight (tests/test_layout.py): their Args and CPU presets
    import grpo
    import ppo

    trainer = {"ppo.py": ppo, "grpo.py": grpo, "dpo.py": dpo}[script.name]
    args, _ = runtime.cli(trainer.Args, trainer.Args(**trainer.CPU_SCALE), command[1:])
    settings = dataclasses.asdict(args)
    if "group_size" not in settings:
        raise errors.UserError(f"{command[0]} has no --group-size: the preflight samples a GRPO line")
    return settings


@torch.no_grad()
def sample(args: dict, prompts: int) -> tuple[torch.Tensor, list[int], dict]:
    """G samples of the first `prompts` train prompts of the run's order.  -> scores [n, G], lengths [n G], info"""
    dist_ = distributed.setup_distributed(args["device"])
    device = dist_.device
    n = prompts or (GPU_PROMPTS if device.type == "cuda" else CPU_PROMPTS)
    G, T = int(args["group_size"]), int(args["max_new_tokens"])
    splits = gsm8k.load_gsm8k(args["data_dir"], args["val_size"])
    try:
        tokenizer = models.load_tokenizer(args["model"])
        model = models.load_model(args["model"], tokenizer, args["seed"]).to(device).eval()
    except errors.UserError as e:  # a model that cannot be fetched: the loader's reason, on one line
        raise errors.UserError(" ".join(str(e).split())) from None
    train = splits["train"]
    idx = gsm8k.PromptSampler(len(train), args["seed"]).next(n)  # the run's own first prompts
    chunk = max(G, int(args["batch_size"]) * G)  # the trainer's rollout batch: its memory is already checked
    rows = [i for i in idx for _ in range(G)]
    scores, lengths = [], []
    for first in range(0, len(rows), chunk):
        part = rows[first : first + chunk]
        ro = generation.generate(
            model,
            [gsm8k.encode_prompt(tokenizer, train[i].question, args["prompt_format"]) for i in part],
            max_new_tokens=T,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            uniforms=common.uniform_rows(args["seed"], 5, first, len(part), T, device),  # stream 5: the preflight's
            temperature=float(args["temperature"]),
            top_p=float(args["top_p"]),
        )
        texts, ids = rollout.decode_responses(tokenizer, ro)
        scores += gsm8k.score(args["task"], texts, ids, [train[i].gold for i in part])
        lengths += [len(x) for x in ids]
    info = {"device": distributed.device_description(device, 1), "train_prompts": len(train)}
    return torch.tensor(scores, dtype=torch.float64).view(n, G), lengths, info


def preflight(a: Args, command: Sequence[str]) -> tuple[bool, dict]:
    """Sample, estimate, predict; write OUT/preflight.json. -> (passed, its contents)"""
    runtime.check_range("min_informative", a.min_informative, 0, 1)
    runtime.check_range("prompts", a.prompts, 0)
    args = trainer_settings(command)
    t0 = time.time()
    scores, lengths, info = sample(args, a.prompts)
    stats = signal_stats(scores)
    plan = measurement_plan(args, lengths)
    k, G = int(args["mc_samples"]), int(args["group_size"])
    stats["settings"] = {
        key: args[key]
        for key in ("model", "task", "prompt_format", "temperature", "top_p", "max_new_tokens", "group_size", "seed")
    } | {"scale": args["scale"], **info}
    stats["mean_length"] = sum(lengths) / max(1, len(lengths))
    stats["predicted"] = {
        **plan,
        "mc_samples": k,
        "mc_prompts": int(args["mc_prompts"]),
        "mc_states": int(args["mc_states"]),
        "nmse_grpo": 1 / (G - 1),  # its leave-one-out mean at the prompt state
        "se_nmse_grpo": predicted_se(stats["signal"], stats["signal_sq"], plan["prompt_states"], k, G - 1),
        "se_nmse_perfect": predicted_se(stats["signal"], stats["signal_sq"], plan["effective_states"], k, None),
        "grpo_at": "the prompt states (leave-one-out mean of G - 1)",
        "perfect_at": "all token-weighted states (effective_states)",
    }
    stats["predicted"] = {
        key: (None if isinstance(v, float) and not math.isfinite(v) else v) for key, v in stats["predicted"].items()
    }
    stats["threshold"] = {"informative": a.min_informative}
    stats["min_informative_states"] = math.ceil(a.min_informative * plan["states"])
    passed, line = verdict(stats, a.min_informative)
    stats.update(passed=passed, verdict=line, command=list(command), seconds=time.time() - t0)
    stats["written"] = time.strftime("%Y-%m-%d %H:%M")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rundir.write_json_atomic(out / "preflight.json", stats)
    return passed, stats


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    a = runtime.parse_args(Args, argv[:cut])
    passed, stats = preflight(a, argv[cut + 1 :])
    print(stats["verdict"], flush=True)
    if not passed:
        sys.exit(EXIT_NO_SIGNAL)


if __name__ == "__main__":
    runtime.run_main(main)
