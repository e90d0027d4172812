"""Planning, not reporting: how long the full sweep takes, and what a model needs on one GPU.

Holds: estimate() and estimate_markdown(), the full sweep's duration from measured step times (report.py
--estimate); and a memory and time model of one H200 (model shapes, the datasheet's peaks, fitted constants:
MODEL_SHAPES, GPUS, MFU, ACT_BYTES_*) for each run of the plan (report.py --estimate-model), stated as arithmetic,
never as a measurement. Does not hold: reading runs (read_runs.py), the report (report.py).
"""

from __future__ import annotations

from typing import Any

from plumbing import errors, models
from study.read_runs import finite, fmt_num, fmt_time, mean, sort_key

# ======================================================================================================
# The full sweep's duration from measured step times
# ======================================================================================================


def estimate(
    runs: list[dict[str, Any]], steps: int, seeds: int, eval_every: int = 25
) -> tuple[list[dict[str, Any]], float]:
    """Seconds per run of the full sweep, one run after another on the hardware the runs were made on.

    Per run: steps_planned x s/step (time/step less the MC measurement in it, after the first step: warm-up)
    + MC measurements (one every --mc-every steps) x their mean seconds + evaluations (one every eval_every
    steps and a final one) x mean val seconds + the test + the rest of the run's wall time (offline DPO's pair
    sampling, checkpoints). steps_planned = steps; a budget-matched run scales its measured steps by steps / its
    GRPO reference's steps (its budget grows with GRPO's steps), and budget-matched offline DPO's pair sampling
    scales the same way. Process start-up and model loading (before a run's clock starts) are not counted.
    """
    ref_steps = {r["seed"]: r["steps"] for r in runs if r["experiment"] == "h2h" and r["method"] == "grpo"}
    kinds: dict[tuple[str, str], list[float]] = {}
    detail: dict[tuple[str, str], dict[str, Any]] = {}
    for r in runs:
        train = [row for row in r["rows"] if finite(row.get("time/step"))]
        no_mc = [row["time/step"] - (row.get("mc/seconds") or 0.0) for row in train]
        t_step = mean(no_mc[1:] if len(no_mc) > 1 else no_mc)
        t_mc = mean([row["mc/seconds"] for row in train if finite(row.get("mc/seconds"))])
        evals = [row["val/seconds"] for row in r["rows"] if finite(row.get("val/seconds"))]
        t_eval = mean(evals)
        t_test = r["test_seconds"] if finite(r["test_seconds"]) else t_eval
        other = max(0.0, r["wall_time_s"] - sum(r["step_times"]) - sum(evals) - (t_test if finite(t_test) else 0.0))
        planned = steps
        if r["token_budget"] and r["seed"] in ref_steps:
            factor = steps / max(ref_steps[r["seed"]], 1)
            if r["method"] != "dpo" or r["args"].get("online"):
                planned = round(r["steps"] * factor)
            else:
                other *= factor  # offline DPO: sampling its pairs is what the budget pays for
        mc_every = int(r["args"].get("mc_every") or 0)
        n_mc = -(-planned // mc_every) if mc_every and finite(t_mc) else 0
        n_evals = ((planned - 1) // eval_every if eval_every else 0) + 1  # during training, then the final one
        total = planned * t_step + n_mc * (t_mc if n_mc else 0.0) + n_evals * t_eval + t_test + other
        key = (r["experiment"], r["run"])
        kinds.setdefault(key, []).append(total)
        detail[key] = {
            "experiment": r["experiment"],
            "run": r["run"],
            "device": r["device"],
            "s_per_step": t_step,
            "s_per_mc": t_mc,
            "s_per_eval": t_eval,
            "planned_steps": planned,
            "other_s": other,
        }
    out = []
    grand = 0.0
    for key in sorted(kinds, key=lambda k: sort_key(*k)):
        per_seed = mean(kinds[key])
        grand += per_seed * seeds
        out.append({**detail[key], "per_seed_s": per_seed, "all_seeds_s": per_seed * seeds})
    return out, grand


def estimate_markdown(runs: list[dict[str, Any]], steps: int, seeds: int, eval_every: int = 25) -> str:
    rows, total = estimate(runs, steps, seeds, eval_every)
    lines = [
        f"Estimated from the step times in these runs' metrics.jsonl, for {steps} steps, an evaluation every "
        f"{eval_every} steps and {seeds} seed(s), one run after another on the hardware they ran on "
        "(`python report.py --estimate OUT --steps S --seeds N`; start-up and model loading not counted):",
        "",
        "| experiment | run | measured on | s/step | s/MC | s/eval | steps | per seed | all seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['experiment']} | {r['run']} | {r['device']} | {fmt_num(r['s_per_step'], 2)} | "
            f"{fmt_num(r['s_per_mc'], 1)} | {fmt_num(r['s_per_eval'], 1)} | {r['planned_steps']} | "
            f"{fmt_time(r['per_seed_s'])} | {fmt_time(r['all_seeds_s'])} |"
        )
    lines += ["", f"**Total: {fmt_time(total)}** ({total / 3600:.2f} h) on one device, one run after another."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# Before any run: the study's memory and time on one GPU, from the model's shape (read, not run)
# ------------------------------------------------------------------------------------------------------

# the shapes of the --model short names, from their config.json (hub, 2026-12-01); tied: one embedding matrix
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, inter=1536, tied=True),
    "smollm2-360m": dict(vocab=49152, hidden=960, layers=32, heads=15, kv_heads=5, head_dim=64, inter=2560, tied=True),
    "smollm2-1.7b": dict(vocab=49152, hidden=2048, layers=24, heads=32, kv_heads=32, head_dim=64, inter=8192,
                         tied=True),
    "qwen2.5-0.5b": dict(vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, inter=4864, tied=True,
                         qkv_bias=True),
    "qwen2.5-1.5b": dict(vocab=151936, hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128, inter=8960,
                         tied=True, qkv_bias=True),
}  # fmt: skip
# one GPU: memory (bytes, as torch reports it), dense bf16 peak (FLOP/s) and HBM bandwidth (bytes/s)
GPUS = {"h200": dict(name="H200", memory=139 * 2**30, flops=989e12, bandwidth=4.8e12)}  # 141 GB sold, ~139 GiB usable
# what one decoder layer saves for its backward under bf16 autocast, bytes per token: 31 H + 8 I (fitted to the
# saved-tensor bytes of a Qwen2 layer at 0.5B's and 1.5B's shapes, torch.autograd.graph.saved_tensors_hooks on the
# CPU under bf16 autocast: 66,368 and 118,840 bytes per token)
ACT_BYTES_H, ACT_BYTES_I = 31, 8
MFU = 0.30  # the training forward and backward's share of the bf16 peak (HF eager layers, micro-batches of 64)
KERNEL_GAP_S = 36 * 1.5e-6  # per layer per decode step: 36 kernels x ~1.5 us between kernels (docs/throughput.md)
PROMPT_TOKENS = models.PROMPT_TOKENS  # a generous GSM8K chat prompt
GSM8K_TEST = 1319
# the study's settings (each trainer's Args() defaults; tests/test_qwen2.py checks they agree)
STUDY = {
    "ppo": dict(batch_size=512, group_size=1, max_new_tokens=256, micro_batch_size=64, update_epochs=2,
                mc_every=10, mc_prompts=32, mc_samples=8, mc_states=2, eval_size=500, eval_batch_size=256,
                eval_max_new_tokens=400, kl_coef=0.04),
    "grpo": dict(batch_size=64, group_size=8, max_new_tokens=256, micro_batch_size=64, update_epochs=2,
                 mc_every=10, mc_prompts=32, mc_samples=8, mc_states=2, eval_size=500, eval_batch_size=256,
                 eval_max_new_tokens=400, kl_coef=0.04),
    "dpo": dict(batch_size=64, samples_per_prompt=8, max_new_tokens=256, micro_batch_size=16, update_epochs=1,
                eval_size=500, eval_batch_size=256, eval_max_new_tokens=400, offline_prompts=2048),
}  # fmt: skip


def model_params(s: dict[str, Any]) -> dict[str, int]:
    """Parameters of a shape: total (the tied embedding once), embedding (V x H), and per layer."""
    H, d, q, kv = s["hidden"], s["head_dim"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    layer = H * (q + 2 * kv) + q * H + 3 * H * s["inter"] + 2 * H + ((q + 2 * kv) if s.get("qkv_bias") else 0)
    embed = s["vocab"] * H
    total = embed * (1 if s["tied"] else 2) + s["layers"] * layer + H
    del d
    return {"total": total, "embedding": embed, "layer": layer, "trunk": total - (0 if s["tied"] else embed)}


def kv_bytes(s: dict[str, Any], rows: int, slots: int) -> float:
    """The static engine's bf16 KV cache: layers x (k, v) x rows x kv heads x slots x head dim x 2 bytes."""
    return s["layers"] * 2 * rows * s["kv_heads"] * slots * s["head_dim"] * 2


def _bucket(rows: int) -> int:
    return next((b for b in (64, 256, 512, 1024) if b >= rows), -(-rows // 1024) * 1024)


def run_memory(s: dict[str, Any], method: str, critic: str, micro: int | None = None) -> dict[str, float]:
    """Peak bytes of one run on one GPU, by part: the training state (fp32 weights, gradients and AdamW's two
    moments: 16 bytes a parameter), the fp32 reference, a full critic's own training state, the engine's weight
    copies, the largest generation batch (KV cache, logits, hidden states) and the training micro-batch's
    activations (ACT_BYTES per token per layer, a full critic's trunk as many again, the chunked LM head's fp32
    logits). Training and generation do not overlap: the peak holds the larger of the two."""
    st, p = STUDY[method], model_params(s)
    V, H, L = s["vocab"], s["hidden"], s["layers"]
    out = {"policy (weights, grads, AdamW)": 16.0 * p["total"]}
    if st.get("kl_coef", 0) > 0 or method == "dpo":
        out["reference (fp32)"] = 4.0 * p["total"]
    if critic == "full":
        out["full critic (weights, grads, AdamW)"] = 16.0 * p["trunk"]
    out["engine weights (fp32 embedding, bf16 rest)"] = (
        4.0 * p["embedding"] + 2.0 * (p["total"] - p["embedding"]) + 2.0 * V * H
    )
    # generation: the training batch, the evaluation, the MC measurement (1 + states states, k rollouts each)
    G = st.get("group_size", st.get("samples_per_prompt", 1))
    slots = lambda n: -(-(PROMPT_TOKENS + n) // 256) * 256  # noqa: E731
    hidden = method == "ppo" and critic != "none"  # PPO's rollout keeps each state's hidden state for the critic
    batches = [(st["batch_size"] * G, slots(st["max_new_tokens"]), hidden)]
    batches.append((st["eval_batch_size"], slots(st["eval_max_new_tokens"]), False))
    if "mc_every" in st:  # measure.mc_values: the states' k rollouts each, in two batches, prefix + rest <= max_new
        mc_rows = st["mc_prompts"] * G * (1 + st["mc_states"]) * st["mc_samples"]
        batches.append((-(-mc_rows // 2), slots(st["max_new_tokens"]), False))
    gen = max(
        kv_bytes(s, _bucket(r), n) + _bucket(r) * V * 4 * 4 + (_bucket(r) * st["max_new_tokens"] * H * 4 if h else 0)
        for r, n, h in batches
    )  # the KV cache, the sampler's [rows, V] fp32 buffers (logits, log-softmax, weights, their blocks), hidden
    micro = micro or st["micro_batch_size"]  # DPO's micro-batch is of pairs: two sequences each
    tokens = micro * (PROMPT_TOKENS + st["max_new_tokens"]) * (2 if method == "dpo" else 1)
    act = tokens * L * (ACT_BYTES_H * H + ACT_BYTES_I * s["inter"]) * (2 if critic == "full" else 1)
    act += 3 * 1024 * V * 4  # the chunked LM head: a chunk's logits, log-softmax and gradient in fp32
    if gen >= act:
        out["generation (KV cache, logits, hidden)"] = gen
    else:
        out["training micro-batch activations"] = act
    return out


def run_seconds(s: dict[str, Any], method: str, critic: str, steps: int, eval_every: int) -> dict[str, float]:
    """Seconds of one run: generation (a decode step as docs/throughput.md's: max(bytes / bandwidth, FLOPs / peak)
    + kernels x gap, its bytes the bf16 weights, the KV cache read and the sampler's fp32 [rows, V] passes),
    training (6 FLOPs per parameter per token trained, a full critic as many again, 2 for the reference's forward,
    at MFU), the MC measurements and the evaluations."""
    st, p, gpu = STUDY[method], model_params(s), GPUS["h200"]
    G = st.get("group_size", st.get("samples_per_prompt", 1))
    T = st["max_new_tokens"]

    def decode(rows: int, new: int, prompt: int = PROMPT_TOKENS // 2) -> float:  # seconds for `new` steps
        per_step = 0.0
        weights = 2.0 * (p["total"] - p["embedding"]) + 2.0 * p["embedding"]  # bf16 trunk and head
        for t in range(0, new, 16):
            kv = kv_bytes(s, rows, prompt + t)
            flops = 2.0 * p["total"] * rows + 4.0 * rows * (prompt + t) * s["heads"] * s["head_dim"] * s["layers"]
            per_step += 16 * (max((weights + kv + rows * s["vocab"] * 4 * 6) / gpu["bandwidth"], flops / gpu["flops"])
                              + KERNEL_GAP_S * s["layers"])  # fmt: skip
        return per_step

    rows = st["batch_size"] * G
    trained = (2 * st["batch_size"] if method == "dpo" else rows) * (PROMPT_TOKENS // 2 + T)  # DPO: its pairs
    factor = 6.0 * p["total"] * st["update_epochs"] + (
        6.0 * p["trunk"] * st["update_epochs"] if critic == "full" else 0
    )
    if st.get("kl_coef", 0) > 0 or method == "dpo":  # the reference's forward
        factor += 2.0 * p["total"]
    out = {"rollouts": steps * decode(rows, T), "training": steps * trained * factor / (gpu["flops"] * MFU)}
    if method == "dpo" and critic == "offline":  # its pairs sampled once, from offline_prompts prompts
        out["rollouts"] = decode(st["batch_size"] * G, T) * st["offline_prompts"] / st["batch_size"]
    if "mc_every" in st:
        mc_rows = st["mc_prompts"] * G * (1 + st["mc_states"]) * st["mc_samples"]
        out["MC measurement"] = -(-steps // st["mc_every"]) * decode(mc_rows, T // 2, PROMPT_TOKENS // 2 + T // 2)
    n_evals = ((steps - 1) // eval_every if eval_every else 0) + 1
    val = -(-st["eval_size"] // st["eval_batch_size"]) * decode(st["eval_batch_size"], st["eval_max_new_tokens"])
    test = -(-GSM8K_TEST // st["eval_batch_size"]) * decode(st["eval_batch_size"], st["eval_max_new_tokens"])
    out["evaluations"] = n_evals * val + (2 if st.get("test_before", True) else 1) * test  # before and after
    return out


SWEEP_RUNS = [  # one seed of the default experiments (sweep.sh): (method, critic) per run
    *[("ppo", c) for c in ("none", "small", "medium", "large", "full")] * 2,  # critic, and h2h at the same steps
    ("grpo", "none"), ("grpo", "none"),  # h2h: grpo-group and grpo-group-unscaled
    ("dpo", "online"), ("dpo", "offline"),  # h2h: DPO gold online and offline
    ("dpo", "offline"), ("dpo", "online"), ("dpo", "offline"), ("dpo", "online"),  # labels: self and gold
]  # fmt: skip


def model_estimate_markdown(model: str, steps: int, seeds: int, eval_every: int = 25, gpu: str = "h200") -> str:
    """The study's memory per run and the full sweep's time on one GPU, by arithmetic from the model's shape."""
    if model not in MODEL_SHAPES:
        raise errors.UserError(f"--estimate-model {model!r}: choose one of {', '.join(MODEL_SHAPES)}")
    s, g = MODEL_SHAPES[model], GPUS[gpu]
    p = model_params(s)
    lines = [
        f"{model}: {p['total'] / 1e6:,.1f}M parameters ({'tied' if s['tied'] else 'untied'} embeddings, vocabulary "
        f"{s['vocab']:,}, hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads on {s['kv_heads']} kv heads), "
        f"the study's settings, one {g['name']} ({g['memory'] / 2**30:.0f} GiB). Arithmetic, not a measurement "
        f"(`python report.py --estimate-model {model} --steps {steps} --seeds {seeds}`): training at {MFU:.0%} of the "
        f"bf16 peak, a decode step at max(bytes / HBM bandwidth, FLOPs / peak) + {KERNEL_GAP_S * 1e6:.0f} us per "
        f"layer, activations {ACT_BYTES_H} H + "
        f"{ACT_BYTES_I} I bytes per token per layer.",
        "",
        "| run | peak memory | fits | the largest part | rollouts | training | MC | evaluations | per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    total = 0.0
    for method, critic in dict.fromkeys(SWEEP_RUNS):
        mem = run_memory(s, method, critic)
        peak = sum(mem.values())
        big = max(mem, key=mem.get)
        sec = run_seconds(s, method, critic, steps, eval_every)
        name = method if method == "grpo" else f"{method}-{critic}"
        fits = "yes"
        if peak > g["memory"]:  # the largest micro-batch that fits, halving from the preset's
            micro = STUDY[method]["micro_batch_size"] // 2
            while micro > 1 and sum(run_memory(s, method, critic, micro).values()) > g["memory"]:
                micro //= 2
            need = sum(run_memory(s, method, critic, micro).values())
            fits = f"**no**: at --micro-batch-size {micro}, {need / 2**30:.0f} GiB"
        lines.append(
            f"| {name} | {peak / 2**30:.1f} GiB | {fits} | {big}: "
            f"{mem[big] / 2**30:.1f} GiB | {fmt_time(sec['rollouts'])} | {fmt_time(sec['training'])} | "
            f"{fmt_time(sec.get('MC measurement', 0.0))} | {fmt_time(sec['evaluations'])} | "
            f"{fmt_time(sum(sec.values()))} |"
        )
    for method, critic in SWEEP_RUNS:
        total += sum(run_seconds(s, method, critic, steps, eval_every).values())
    lines += [
        "",
        f"**The full sweep: {len(SWEEP_RUNS)} runs x {seeds} seeds, {total * seeds / 3600:.1f} h on one {g['name']}**, "
        "one run after another (the budget-matched runs taken at GRPO's steps; process start-up and model loading "
        "not counted).",
    ]
    return "\n".join(lines)
