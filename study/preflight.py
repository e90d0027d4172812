"""The sweep's preflight: can the study's model answer the question at the study's settings, before a GPU-day?

A baseline matters only where 0 < p < 1: a prompt the model always or never solves carries no information about any
baseline (docs/science.md). This samples the reference GRPO line of the sweep's plan (its model, task, prompt
format, temperature, top-p, max new tokens and group size G, read from the trainer as it would run them) for a few
hundred train prompts, G times each, and makes the run's Monte Carlo measurement on the first completion of each. It
writes OUT/preflight.json: the pass rate, the outcome variance E[p(1-p)] (unbiased), the informative share (of
prompts with 0 < p_hat < 1), the share d of the outcome's variance resolved inside (+- its standard error), and the
standard error of each nmse the report compares, for one run: GRPO's leave-one-out mean and a perfect critic, at the
prompt states and over the token-weighted states (predicted_errors), with the median half-width of the report's
3-seed interval of GRPO's nmse at the prompt. It prints one line and exits 0 when that half-width is at most the
smallest effect worth detecting (--smallest-effect, docs/measurement.md), 3 when it is not. ./sweep.sh runs it
(docs/sweep.md):

    ./sweep.sh --preflight                       # the plan's reference GRPO line, on this machine
    python -m study.preflight --out runs/sweep -- grpo.py --model smollm2 --task gsm8k    # any GRPO command

Holds: the sampling (gsm8k.encode_prompt, generation.generate, measure.mc_values, gsm8k.score: the trainers' own
prompt, sampler, measurement and reward), the estimators, the predicted standard errors, the verdict. Does not hold:
any training, the plan (sweep.sh), the scheduling (sweep_runner.py), the report (report.py). The trainer's settings
come from the trainer itself: the preflight imports the one its command names and parses the command with
runtime.cli, as the trainer would.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from plumbing import threads

if __name__ == "__main__":  # run, not imported: OpenMP's wait, before torch loads libgomp (plumbing/threads.py)
    threads.wait_passively()

import torch

import common
import gsm8k
import intervals
import measure
from plumbing import cmdline, distributed, errors, generation, models, rollout, rundir, runtime

REPO = Path(__file__).resolve().parents[1]
SMALLEST_EFFECT = 0.05  # refuse when GRPO's 3-seed nmse interval at the prompt is wider than +- this (measurement.md)
MIN_INFORMATIVE = 0.2  # report.py warns of a run whose measured prompt states have a smaller informative share
GPU_PROMPTS, CPU_PROMPTS = 256, 8  # the default sample: 256 x G on a GPU, a handful on the CPU
EXIT_NO_SIGNAL = 3


@dataclass
class Args:
    """python -m study.preflight [OPTIONS] -- grpo.py [its flags], from the repository's root: the GRPO command after
    --, as the sweep would run it (./sweep.sh --preflight builds it from the plan). Exit 0: enough signal; 3: refused;
    2: a bad command."""

    out: str = "runs/sweep"
    """folder for preflight.json (the sweep's --out)"""
    prompts: int = 0
    """train prompts sampled, group-size times each (0: 256 on a GPU, 8 on the CPU)"""
    smallest_effect: float = SMALLEST_EFFECT
    """the smallest difference in nmse worth detecting: exit 3 when the report's 3-seed interval of GRPO's nmse at the prompt is predicted wider (docs/measurement.md); 0: any signal passes"""


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


def state_stats(
    scores: torch.Tensor, comp: torch.Tensor, t: torch.Tensor, w: torch.Tensor, returns: torch.Tensor
) -> dict[str, float]:
    """One measurement as a run makes it, on the preflight's sample, for the standard errors over states.
    scores [n, G]: each prompt's G 0/1 rewards, the measured completion first (column 0); per measured state s:
    comp [S] its prompt, t [S] the tokens written (0: the prompt state), w [S] its token weight
    (measure.mc_state_positions), returns [S, K] K fresh 0/1 returns from it.  -> dict

    With X = (b - p_hat)^2 - s^2/K and D = s^2 at each state (measure.baseline_error's terms) and, per measured
    completion c, X_c = sum w X, D_c = sum w D over its states (the prompt's and those inside share one b):
      nmse_grpo_states   sum X_c / sum D_c for b = the leave-one-out mean of the other G - 1 rewards
      var_grpo_states    mean_c (X_c - r D_c)^2 / mean_c(D_c)^2, r = nmse_grpo_states: one completion's share of
                         the variance of the pooled ratio (delta method with the completions as units: its states
                         share b, so they are not independent); SE over m completions = sqrt(var / m)
      var_perfect_states mean_c sum w^2 c2 q2 / mean_c(D_c)^2 for b = the true value (its states independent:
                         E[X^2] = c2 q^2, c2 = 2 / (K (K - 1)), q2 unbiased for q^2 = (V(1 - V))^2 from K >= 4
                         returns; below, the bound q^2 <= q / 4)
      resolved           d = 1 - sum w s^2 / sum w q over the states inside: the share of the outcome's variance
                         already resolved where the run measures inside (E[V(1 - V)] = p(1 - p) - Var(V) for any
                         value process). q, the prompt's p(1 - p), is estimated without the measured completion,
                         from the other G - 1 rewards and the K returns of its prompt state (all Bernoulli(p)):
                         a completion's length, hence its states' weights w, can follow its own outcome (a wrong
                         answer running to the token limit), so q from a group holding that outcome is correlated
                         with w and biases d (downward where right answers are short); pooling the K returns also
                         halves d's noise at small G. A ratio of unbiased sums: consistent, bias O(1 / completions)
      se_resolved        its standard error, by the delta method with the completions as units (their states share
                         one q): at a few prompts d reads below 0 by noise alone (docs/measurement.md)
    No process model: the completions' own states and returns carry it. nan where no state has signal.
    """
    n, G = scores.shape
    K = returns.shape[1]
    j = scores.double().sum(-1)  # [n]
    b = (j - scores[:, 0].double()) / (G - 1)  # [n] the measured completion's leave-one-out mean
    w = w.double()
    kk = returns.double().sum(-1)  # [S] successes of K
    p_hat, s2 = kk / K, returns.double().var(-1)  # [S], [S] unbiased
    X, D = (b[comp] - p_hat) ** 2 - s2 / K, s2
    Xc = torch.zeros(n, dtype=torch.float64).index_add_(0, comp, w * X)  # [n]
    Dc = torch.zeros(n, dtype=torch.float64).index_add_(0, comp, w * D)  # [n]
    if K >= 4:
        q2 = kk * (kk - 1) * (K - kk) * (K - kk - 1) / (K * (K - 1) * (K - 2) * (K - 3))
    else:
        q2 = s2 / 4
    nan = math.nan
    mean_d = Dc.mean().item()
    resolved, se_resolved = resolved_share(scores, comp, t, w, returns)
    if mean_d <= 0:
        return {"nmse_grpo_states": nan, "var_grpo_states": nan, "var_perfect_states": nan, "resolved": nan,
                "se_resolved": nan, "measured_completions": n, "measured_states": len(t),
                "q2_unbiased": K >= 4}  # fmt: skip
    r = (Xc.sum() / Dc.sum()).item()
    Z = Xc - r * Dc
    var_perfect = torch.zeros(n, dtype=torch.float64).index_add_(0, comp, w * w * 2 / (K * (K - 1)) * q2).mean()
    return {
        "nmse_grpo_states": r,
        "var_grpo_states": (Z * Z).sum().item() / max(1, n - 1) / mean_d**2,
        "var_perfect_states": var_perfect.item() / mean_d**2,
        "resolved": resolved,
        "se_resolved": se_resolved,
        "measured_completions": n,
        "measured_states": len(t),
        "q2_unbiased": K >= 4,
    }


def resolved_share(
    scores: torch.Tensor, comp: torch.Tensor, t: torch.Tensor, w: torch.Tensor, returns: torch.Tensor
) -> tuple[float, float]:
    """d, the share of the outcome's variance resolved at the states inside, and its standard error (state_stats
    says how and why). scores [n, G], column 0 the measured completion; comp, t, w [S]; returns [S, K].
    (nan, nan) where no state inside has a prompt with signal."""
    n, G = scores.shape
    K = returns.shape[1]
    at_prompt, inside, w = t == 0, t > 0, w.double()
    kk = returns.double().sum(-1)[at_prompt]  # [prompt states] successes of K
    # [n] the prompt's successes and draws without the measured completion: the other G - 1, its prompt state's K
    hits = scores.double()[:, 1:].sum(-1) + torch.zeros(n, dtype=torch.float64).index_add_(0, comp[at_prompt], kk)
    draws = G - 1 + torch.zeros(n, dtype=torch.float64).index_add_(0, comp[at_prompt], torch.full_like(kk, K))
    q = hits * (draws - hits) / (draws * (draws - 1)).clamp(min=1)  # [n] unbiased for p (1 - p); 0 with 1 draw
    a = torch.zeros(n, dtype=torch.float64).index_add_(0, comp[inside], (w * returns.double().var(-1))[inside])
    b = torch.zeros(n, dtype=torch.float64).index_add_(0, comp[inside], (w * q[comp])[inside])  # [n] each
    if b.sum() <= 0:
        return math.nan, math.nan
    ratio = (a.sum() / b.sum()).item()
    z = a - ratio * b  # [n] each completion's share of the ratio's error (delta method)
    return 1 - ratio, math.sqrt((z * z).sum().item() / max(1, n - 1) / n) / b.mean().item()


def predicted_errors(stats: dict, states: dict, prompt_states: float, k: int, group_size: int) -> dict[str, float]:
    """The standard error of each nmse the report compares, for one run of `prompt_states` measured completions:
    GRPO's leave-one-out mean and a perfect critic, at the prompt states (predicted_se: exact over the binomial
    laws, from E[q] and E[q^2] of the G rewards) and over every token-weighted state (state_stats: the run's
    measurement made on the preflight's sample), with GRPO's values there and the resolved share d, +- its
    standard error."""
    q, q2 = stats["signal"], stats["signal_sq"]
    m = float(prompt_states)

    def root(var: float) -> float:
        return math.sqrt(var / m) if m > 0 and math.isfinite(var) else math.nan

    return {
        "nmse_grpo_prompt": 1 / (group_size - 1),  # its leave-one-out mean at the prompt state, whatever p
        "nmse_grpo_states": states["nmse_grpo_states"],
        "resolved": states["resolved"],
        "se_resolved": states.get("se_resolved", math.nan),
        "se_grpo_prompt": predicted_se(q, q2, m, k, group_size - 1),
        "se_perfect_prompt": predicted_se(q, q2, m, k, None),
        "se_grpo_states": root(states["var_grpo_states"]),
        "se_perfect_states": root(states["var_perfect_states"]),
    }


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


def bound_names(stats: dict, measured: dict) -> list[str]:
    """The predicted standard errors that are upper bounds, not estimates: at the prompt below G = 4 (E[q^2] then
    bounded by E[q] / 4), the perfect critic's over states below K = 4 (q^2 by q / 4)."""
    out = [] if stats.get("signal_sq_unbiased", True) else ["se_grpo_prompt", "se_perfect_prompt", "half_width_3_seeds"]
    return out + ([] if measured.get("q2_unbiased", True) else ["se_perfect_states"])


def threads_said(settings: dict) -> str:
    """' (1 CPU thread, OpenMP wait passive)': the threads the sampling ran on, where settings record them."""
    return f" ({settings['threads']})" if settings.get("threads") else ""


def verdict(stats: dict, smallest_effect: float) -> tuple[bool, str]:
    """(passed, the one line the preflight prints). It passes when the predicted half-width of the report's 3-seed
    interval of GRPO's nmse at the prompt is at most the smallest effect worth detecting (0: any signal passes)."""
    se = stats["predicted"]

    def num(key: str) -> str:
        x = se.get(key)
        shown = "n/a" if x is None or not math.isfinite(x) else f"{x:.3f}"
        return ("<= " if key in se.get("bounds", []) and shown != "n/a" else "") + shown

    half = se.get("half_width_3_seeds")
    line = (
        f"preflight: {stats['settings']['model']} on {stats['settings']['task']}{threads_said(stats['settings'])}: "
        f"pass rate {stats['pass_rate']:.3f}, "
        f"outcome variance E[p(1-p)] {stats['signal']:.4f}, informative share {stats['informative']:.2f} "
        f"({stats['informative_prompts']} of {stats['prompts']} prompts x {stats['samples_per_prompt']}), "
        f"resolved inside d {num('resolved')} +- {num('se_resolved')}; one run's nmse, value +- SE ({se['prompt_states']} prompt states; "
        f"{se['effective_states']:,.0f} effective of {se['states']:,} token-weighted states; K {se['mc_samples']}): "
        f"GRPO {num('nmse_grpo_prompt')} +- {num('se_grpo_prompt')} at the prompt, {num('nmse_grpo_states')} +- "
        f"{num('se_grpo_states')} over states; a perfect critic 0 +- {num('se_perfect_prompt')} at the prompt, 0 +- "
        f"{num('se_perfect_states')} over states; GRPO's 3-seed half-width at the prompt {num('half_width_3_seeds')}"
    )
    if half is None:
        why = "no prompt with 0 < p < 1" if stats["signal"] <= 0 else "the run measures nothing (--mc-every 0)"
        return (
            False,
            line + f" -> refused: no half-width to set against the smallest effect {smallest_effect:g} ({why})",
        )
    if not smallest_effect:
        return True, line + " -> enough signal (no smallest effect asked: --smallest-effect 0)"
    if half <= smallest_effect:
        return True, line + f" -> enough signal: half-width {half:.3f} <= smallest effect {smallest_effect:g}"
    return False, line + f" -> refused: half-width {half:.3f} > smallest effect {smallest_effect:g}"


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
            "python -m study.preflight -- grpo.py --model tiny"
        )
    import dpo  # the trainers sit a layer below the preflight (tests/test_layout.py): their Args and CPU presets
    import grpo
    import ppo

    trainer = {"ppo.py": ppo, "grpo.py": grpo, "dpo.py": dpo}[script.name]
    args, _ = runtime.cli(trainer.Args, trainer.CPU_SCALE, command[1:])
    settings = dataclasses.asdict(args)
    if "group_size" not in settings:
        raise errors.UserError(f"{command[0]} has no --group-size: the preflight samples a GRPO line")
    return settings


@torch.no_grad()
def sample(args: dict, prompts: int) -> tuple[torch.Tensor, list[int], dict, dict]:
    """G samples of the first `prompts` train prompts of the run's order, and the run's measurement of the first
    completion of each (sample_states).  -> scores [n, G], lengths [n G], info, states"""
    dist_ = distributed.setup_distributed(args["device"])
    device = dist_.device
    n = prompts or (GPU_PROMPTS if device.type == "cuda" else CPU_PROMPTS)
    G, T = int(args["group_size"]), int(args["max_new_tokens"])
    splits = gsm8k.load_gsm8k(args["data_dir"], args["val_size"], model=args["model"])
    try:
        tokenizer = models.load_tokenizer(args["model"])
        model = models.load_model(args["model"], tokenizer, args["seed"]).to(device).eval()
    except errors.UserError as e:  # a model that cannot be fetched: the loader's reason, on one line
        raise errors.UserError(" ".join(str(e).split())) from None
    cpu_threads = threads.use_threads(model)  # as the trainer would for this model
    train = splits["train"]
    idx = gsm8k.PromptSampler(len(train), args["seed"]).next(n)  # the run's own first prompts
    chunk = max(G, int(args["batch_size"]) * G)  # the trainer's rollout batch: its memory is already checked
    rows = [i for i in idx for _ in range(G)]
    scores, lengths, responses = [], [], []
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
        responses += ids
    info = {
        "device": distributed.device_description(device, 1),
        "threads": cpu_threads.short(),
        "train_prompts": len(train),
    }
    states = sample_states(args, model, tokenizer, [train[i] for i in idx], responses[::G], chunk, device)
    return torch.tensor(scores, dtype=torch.float64).view(n, G), lengths, info, states


@torch.no_grad()
def sample_states(args: dict, model, tokenizer, problems: list, responses: list, chunk: int, device) -> dict:
    """The run's Monte Carlo measurement made on the preflight's sample: the first completion of each prompt (as
    the run measures one completion of a measured prompt), its prompt state and `mc_states` states inside
    (measure.mc_state_positions), mc_samples fresh returns from each (measure.mc_values, the run's own). -> comp,
    t, w [S] and returns [S, K] for state_stats; empty when the run measures nothing (--mc-every 0)."""
    K, M, T = int(args["mc_samples"]), int(args["mc_states"]), int(args["max_new_tokens"])
    if not args.get("mc_every"):
        return {}
    picked = [(c, t, w) for c, ids in enumerate(responses) for t, w in measure.mc_state_positions(len(ids), M, c)]
    per = max(1, chunk // K)  # states per batch: at most the trainer's rollout batch of rows
    returns = []
    for first in range(0, len(picked), per):
        part = picked[first : first + per]
        r, _, _ = measure.mc_values(
            model, tokenizer,
            [gsm8k.encode_prompt(tokenizer, problems[c].question, args["prompt_format"]) for c, _, _ in part],
            [list(responses[c][:t]) for c, t, _ in part],
            [problems[c].gold for c, _, _ in part],
            task=args["task"], k=K, max_new_tokens=T, temperature=float(args["temperature"]),
            top_p=float(args["top_p"]), buckets=1,
            uniforms=common.uniform_rows(args["seed"], 6, first * K, len(part) * K, T, device),  # stream 6: here
        )  # fmt: skip
        returns.append(r)
    return {
        "comp": torch.tensor([c for c, _, _ in picked]),
        "t": torch.tensor([t for _, t, _ in picked]),
        "w": torch.tensor([w for _, _, w in picked], dtype=torch.float64),
        "returns": torch.cat(returns),
    }


def preflight(a: Args, command: Sequence[str]) -> tuple[bool, dict]:
    """Sample, estimate, predict; write OUT/preflight.json. -> (passed, its contents)"""
    runtime.check_range("smallest_effect", a.smallest_effect, 0)
    runtime.check_range("prompts", a.prompts, 0)
    args = trainer_settings(command)
    t0 = time.time()
    scores, lengths, info, states = sample(args, a.prompts)
    stats = signal_stats(scores)
    plan = measurement_plan(args, lengths)
    k, G = int(args["mc_samples"]), int(args["group_size"])
    stats["settings"] = {
        key: args[key]
        for key in ("model", "task", "prompt_format", "temperature", "top_p", "max_new_tokens", "group_size", "seed")
    } | {"scale": args["scale"], **info}
    stats["mean_length"] = sum(lengths) / max(1, len(lengths))
    measured = state_stats(scores, **states) if states else {}
    errors_ = predicted_errors(stats, measured, plan["prompt_states"], k, G) if measured else {}
    stats["predicted"] = {
        **plan,
        "mc_samples": k,
        "mc_prompts": int(args["mc_prompts"]),
        "mc_states": int(args["mc_states"]),
        **errors_,
        "half_width_3_seeds": intervals.median_half_width(errors_.get("se_grpo_prompt", math.nan), 3),
        "bounds": bound_names(stats, measured),
        "measured_completions": measured.get("measured_completions", 0),
        "measured_states": measured.get("measured_states", 0),
    }
    stats["predicted"] = {
        key: (None if isinstance(v, float) and not math.isfinite(v) else v) for key, v in stats["predicted"].items()
    }
    stats["smallest_effect"] = a.smallest_effect
    passed, line = verdict(stats, a.smallest_effect)
    stats.update(passed=passed, verdict=line, command=list(command), seconds=time.time() - t0)
    stats["written"] = time.strftime("%Y-%m-%d %H:%M")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rundir.write_json_atomic(out / "preflight.json", stats)
    return passed, stats


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    a = cmdline.parse(Args, Args(), argv[:cut], prog="python -m study.preflight")
    passed, stats = preflight(a, argv[cut + 1 :])
    print(stats["verdict"], flush=True)
    if not passed:
        sys.exit(EXIT_NO_SIGNAL)


if __name__ == "__main__":
    runtime.run_main(main)
