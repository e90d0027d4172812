"""Throughput of rollouts and updates on one GPU, side by side with transformers' generate() and TRL.

One process, one GPU, the same model (SmolLM2-135M, fp32 master weights, bf16 compute), the same GSM8K chat
prompts. Sections, in the order they run (--sections picks some):

  sdpa      the SDPA kernel PyTorch picks for the engine's decode and prefill shapes (its backends pinned)
  check     the engine's numerics in this dtype: greedy tokens against the plain path, sampled log-probs
            against a training forward, mean and max |rollout - training| (the plain path's own beside it)
  generate  generated tokens/s at batch 512 x 256 new tokens (EOS ignored, so every method makes the same
            tokens): the static engine (CUDA graph, with and without torch.compile) vs generate() with
            its dynamic cache; the decode step's time from arithmetic (bytes, FLOPs, kernels) beside the
            measured one
  hf_static the same with generate()'s static cache and torch.compile (compiles for a minute or more; off by
            default: its anchor HF_STATIC_ANCHOR stands in for it in the ratio)
  eval      the greedy evaluation over the whole test split (1,319 problems, <= 400 tokens), as trainers run it
  grpo      seconds per step of grpo.py vs TRL's GRPOTrainer, 64 prompts x 8 completions x 256 tokens
  ppo       seconds per step of ppo.py with the small critic at the same completions per step
  train     training forward + backward tokens/s, eager and (with --train-compile) compiled

Peak GPU memory is reported for each. Prints a table of ratios against the targets and writes JSON (after
every section, so a run stopped by its time limit keeps what it measured). Trainers run as subprocesses;
their step time is the median 'time/step' of metrics.jsonl after the warm-up steps (graph capture and
compilation happen there). TRL runs in its own process through bench/trl_grpo.py.

    python bench/throughput.py                          # on a GPU: the packaged model, or $SMOLLM2_GGUF
    python bench/throughput.py --device cpu --tiny      # every section at toy sizes (tests this script)
    pip install -r bench/requirements.txt               # TRL, for the grpo section's comparison
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gsm8k  # noqa: E402
from plumbing import (  # noqa: E402
    distributed,
    forward,
    generation,
    models,
    rollout,
    rundir,
    static_engine,
    static_kernels,
)

SECTIONS = ("sdpa", "check", "generate", "hf_static", "eval", "grpo", "ppo", "toy", "trl", "train")
VARIANTS = ("engine", "engine_flex", "engine_no_compile", "hf_dynamic")  # the generate section's, in this order
ENGINE_OPTS = {"engine": {}, "engine_flex": {"attention": "flex"}, "engine_no_compile": {"compile": False}}

# What the TRL ratio does not hold equal, printed beside it (from a review of both sides' settings)
TRL_CAVEATS = (
    "TRL generates with transformers' generate() (no vLLM, no static cache); grpo.py with its static engine",
    "optimizer steps per generation: grpo.py --num-minibatches, TRL 1 (listed below when they differ)",
    "prompt order: grpo.py's seeded sampler, TRL's own shuffled sampler (different prompts per step)",
    "both medians over the steps after --warmup-steps of --trainer-steps (the same count on each side)",
)
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s != "hf_static")

# generate() with a static cache and torch.compile at batch 512 x 256 on one H200: a figure reported to the project,
# never measured in this repository (its date not recorded); the ratio's denominator when hf_static does not run
HF_STATIC_ANCHOR = {"tokens_per_s": 34_700.0, "source": "reported figure, not measured here"}

# H200 SXM datasheet figures (assumptions of the arithmetic, not measurements): HBM bandwidth, dense bf16 peak,
# and the gap between two kernels of a replayed CUDA graph
H200 = {"hbm_bytes_per_s": 4.8e12, "bf16_flops": 989e12, "kernel_gap_s": 1.5e-6}

# (ratio or measurement, comparison, target): the targets the project set for the engine and the trainers, from one H200 run
TARGETS = {
    "engine_over_hf_static_compiled": (">=", 4.0),
    "trl_step_over_grpo_step": (">=", 6.0),
    "grpo_step_s": ("<=", 1.5),
    "ppo_step_over_grpo_step": ("<=", 1.1),
    "eval_full_test_s": ("<=", 10.0),
}


# The organism's CPU comparison (--organism-cpu): its own target against TRL, printed instead of the GPU's
ORGANISM_CPU_TARGETS = {"trl_step_over_grpo_step": (">=", 2.0), "ppo_step_over_grpo_step": ("<=", 1.1)}


@dataclass
class Args:
    device: str = "auto"
    """auto (cuda when present), cuda or cpu"""
    tiny: bool = False
    """the tiny random model at toy sizes: with --device cpu, a test of this script"""
    organism_cpu: bool = False
    """the organism's CPU comparison with TRL (ORGANISM_CPU: its sizes and sections); name its folders with
    --model, --data-dir and --prompt-format question"""
    model: str | None = None
    """default: $SMOLLM2_GGUF when set, else smollm2 (the packaged GGUF); tiny with --tiny; a folder (the organism)"""
    data_dir: str | None = None
    """GSM8K folder (default: $GSM8K_DIR); the organism's task folder with its model"""
    prompt_format: str = "chat"
    """the trainers' --prompt-format, also TRL's and this script's prompts: chat, or question (the organism's)"""
    trl_python: str | None = None
    """the interpreter that runs bench/trl_grpo.py (a venv with TRL and requirements.txt); None: this one"""
    trl_micro_batch_size: int = 64
    """TRL's per_device_train_batch_size (at most the completions per step); the CPU's organism runs: 256"""
    rounds: int = 1
    """runs of grpo.py and of TRL, alternated (grpo.py, TRL, grpo.py, ...) when both sections are chosen: each
    side's step time is the median over its runs' medians (a shared CPU: both sides see the same load)"""
    sections: str = ",".join(DEFAULT_SECTIONS)
    """comma-separated sections to run, from: sdpa, check, generate, hf_static, eval, grpo, ppo, toy, trl, train"""
    variants: str = ",".join(VARIANTS)
    """the generate section's variants, from: engine, engine_flex (GPU only), engine_no_compile, hf_dynamic"""
    out: str = "bench/out/throughput.json"
    """the JSON report (rewritten after every variant and trainer run)"""
    merge: bool = False
    """keep the sections an earlier process wrote to --out (run_gpu.sh's parts share one throughput.json)"""
    require_toy_rise: bool = False
    """exit 1 when the toy section's reward did not rise (run_gpu.sh on a GPU)"""
    work_dir: str = "bench/out/work"
    """trainer runs and logs"""
    deadline_s: float = 0.0
    """skip the sections (and trainer runs) that would start after this many seconds (0: no limit)"""
    table_from: str | None = None
    """only print the table of an existing JSON report (after a run stopped by its time limit)"""
    batch: int = 512
    """rows of the generation benchmark"""
    new_tokens: int = 256
    """new tokens per row (generation and trainers)"""
    reps: int = 3
    """timed repetitions after the warm-up (median reported)"""
    check_rows: int = 64
    """prompts of the correctness check"""
    grpo_prompts: int = 64
    """prompts per GRPO step"""
    group: int = 8
    """completions per prompt in GRPO (PPO gets grpo_prompts x group prompts, one completion each)"""
    trainer_steps: int = 6
    """steps each trainer runs"""
    warmup_steps: int = 2
    """first trainer steps left out of the median (capture, compilation)"""
    update_args: str = "--update-epochs 1 --num-minibatches 4"
    """arguments given to both grpo.py and ppo.py so that their updates have the same structure"""
    grpo_args: str = "--group-size {group} --batch-size {prompts}"
    """grpo.py's own arguments ({prompts}, {group} filled in; pass as --grpo-args="...")"""
    ppo_args: str = "--critic small --group-size 1 --batch-size {completions}"
    """ppo.py's own arguments ({completions} filled in)"""
    toy_steps: int = 20
    """steps of the toy GRPO run (the toy section: the GPU training path learning end to end)"""
    toy_args: str = "--task toy --group-size 8 --batch-size 16 --max-new-tokens 16 --lr 1e-5 --kl-coef 0"
    """grpo.py's arguments in the toy section (after the shared ones; pass as --toy-args="...")"""
    eval_size: int = 0
    """test problems in the eval section (0: all 1,319)"""
    eval_batch_size: int = 512
    """prompts per generation batch in the eval section"""
    eval_max_new_tokens: int = 400
    """longest completion in the eval section"""
    hf_eval: bool = False
    """also time the eval section through transformers' generate() (about 46 s on an H200)"""
    train_rows: int = 64
    """sequences per forward in the train section"""
    train_compile: bool = False
    """also time the compiled training forward (compiling takes a minute or more)"""
    subprocess_timeout_s: int = 300
    """limit for each trainer subprocess"""


# The organism on 2 CPU cores (the CPU's study): 32 prompts x 8 completions of at most 64 tokens, one optimiser
# step a batch in one forward of 256 rows, both sides run three times, alternated. With --model and --data-dir
# naming the organism's folders and --prompt-format question (docs/throughput.md).
ORGANISM_CPU = dict(
    grpo_prompts=32,
    group=8,
    new_tokens=64,
    update_args="--update-epochs 1 --num-minibatches 1 --micro-batch-size 256 --lr 3e-5",
    trl_micro_batch_size=256,
    trainer_steps=6,
    warmup_steps=1,
    rounds=3,
    sections="grpo,ppo,trl",
)


def apply_organism_cpu(args: Args) -> None:
    """The organism's CPU sizes (only the fields left at their defaults)."""
    defaults = Args()
    for key, value in ORGANISM_CPU.items():
        if getattr(args, key) == getattr(defaults, key):
            setattr(args, key, value)


def apply_tiny(args: Args) -> None:
    """Toy sizes for the tiny model on the CPU (only the fields left at their defaults)."""
    toy = dict(
        batch=8,
        new_tokens=16,
        reps=1,
        check_rows=6,
        grpo_prompts=2,
        group=2,
        trainer_steps=3,
        warmup_steps=1,
        toy_steps=8,
        toy_args="--task toy --group-size 8 --batch-size 4 --max-new-tokens 4 --lr 1e-2 --kl-coef 0",
        eval_size=16,
        eval_batch_size=8,
        eval_max_new_tokens=24,
        train_rows=4,
        subprocess_timeout_s=240,
    )
    defaults = Args()
    for key, value in toy.items():
        if getattr(args, key) == getattr(defaults, key):
            setattr(args, key, value)


# ======================================================================================================
# helpers: timing, memory, the report
# ======================================================================================================


class Bench:
    def __init__(self, args: Args) -> None:
        self.args = args
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(auto if args.device == "auto" else args.device)
        self.cuda = self.device.type == "cuda"
        self.t_start = time.perf_counter()
        self.model_name = "tiny" if args.tiny else (args.model or os.environ.get("SMOLLM2_GGUF") or "smollm2")
        tok_name = (os.environ.get("SMOLLM2_GGUF") or "tiny") if args.tiny else self.model_name
        self.tok = models.load_tokenizer(tok_name)
        self.lm = models.load_model(self.model_name, self.tok, seed=0).to(self.device).eval()
        self.splits = gsm8k.load_gsm8k(args.data_dir)
        self.eos, self.pad = self.tok.eos_token_id, self.tok.pad_token_id
        self.report: dict[str, Any] = {
            "device": distributed.device_description(self.device, 1),
            "versions": {"torch": torch.__version__, "transformers": _version("transformers"), "trl": _version("trl")},
            # what decides CPU timings besides the code: the threads, and whether idle OpenMP threads spin
            "env": {"threads": torch.get_num_threads(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
            "model": self.model_name,
            "dtype": distributed.dtype_name(self.device),
            "settings": asdict(args),
            "sections": {},
        }
        if args.merge and Path(args.out).is_file():  # an earlier part's sections stay in the report
            earlier = json.loads(Path(args.out).read_text())
            self.report["sections"] = earlier.get("sections", {})
            self.report["parts"] = earlier.get("parts", {})
        self.current: dict[str, Any] = {}  # the running section's dict in the report (filled as it measures)
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)

    def prompts(self, n: int, split: str = "train") -> list[list[int]]:
        problems = self.splits[split]
        fmt = self.args.prompt_format
        return [gsm8k.encode_prompt(self.tok, problems[i % len(problems)].question, fmt) for i in range(n)]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - t0, out

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None

    def over_deadline(self) -> str | None:
        elapsed = time.perf_counter() - self.t_start
        if self.args.deadline_s and elapsed > self.args.deadline_s:
            return f"time budget: {elapsed:.0f} s > {self.args.deadline_s:.0f} s"
        return None

    def save(self) -> None:
        self.report["ratios"] = ratios(self.report["sections"])
        self.report["elapsed_s"] = time.perf_counter() - self.t_start
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        rundir.write_json_atomic(out, self.report)


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return None


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(sections: dict[str, Any]) -> dict[str, float | None]:
    """The headline numbers, from whatever sections ran."""
    gen, hfs = sections.get("generate", {}), sections.get("hf_static", {})
    grpo, ppo, ev = sections.get("grpo", {}), sections.get("ppo", {}), sections.get("eval", {})
    engine = gen.get("engine", {}).get("tokens_per_s")
    grpo_s = grpo.get("grpo", {}).get("step_s")
    check = sections.get("check", {}).get("logprob_abs_error_engine", {})
    hf_static = hfs.get("tokens_per_s") or HF_STATIC_ANCHOR["tokens_per_s"]
    floor = gen.get("engine", {}).get("floor", {})
    return {
        "engine_tokens_per_s": engine,
        "engine_over_hf_dynamic": _div(engine, gen.get("hf_dynamic", {}).get("tokens_per_s")),
        "engine_over_hf_static_compiled": _div(engine, hf_static),
        "decode_step_ms_measured": floor.get("measured_ms"),
        "decode_step_ms_floor": floor.get("expected_ms"),
        "logprob_abs_error_mean": check.get("mean"),
        "logprob_abs_error_max": check.get("max"),
        "engine_compiled_over_graph_only": _div(engine, gen.get("engine_no_compile", {}).get("tokens_per_s")),
        "grpo_step_s": grpo_s,
        "trl_step_over_grpo_step": _div((sections.get("trl") or grpo.get("trl") or {}).get("step_s"), grpo_s),
        "ppo_step_over_grpo_step": _div(ppo.get("ppo", {}).get("step_s"), grpo_s),
        "eval_full_test_s": ev.get("warm_s"),
        "eval_hf_over_engine": _div(ev.get("hf_s"), ev.get("warm_s")),
    }


def print_table(report: dict[str, Any]) -> None:
    rows = []
    organism = (report.get("settings") or {}).get("organism_cpu")
    targets = ORGANISM_CPU_TARGETS if organism else TARGETS
    for key, value in report["ratios"].items():
        target = targets.get(key)
        verdict = ""
        if target is not None and value is not None:
            op, bound = target
            verdict = "ok" if (value >= bound if op == ">=" else value <= bound) else "MISSED"
        shown = "-" if value is None else (f"{value:,.0f}" if value >= 1000 else f"{value:.3g}")
        rows.append((key, shown, f"{target[0]} {target[1]}" if target else "", verdict))
        if key == "engine_over_hf_static_compiled" and value is not None and "hf_static" not in report["sections"]:
            rows.append(("  (hf_static)", "anchor", HF_STATIC_ANCHOR["source"][:40], ""))
        if key == "trl_step_over_grpo_step":
            trl = report["sections"].get("trl") or report["sections"].get("grpo", {}).get("trl", {})
            grpo = report["sections"].get("grpo", {}).get("grpo", {})
            if value is not None:
                steps = f"TRL {trl.get('steps_timed')} steps, grpo.py {grpo.get('steps_timed')}"
                rows.append(("  steps in the medians", steps[:12], steps[12:52], ""))
                for caveat in trl.get("caveats") or TRL_CAVEATS:
                    rows.append(("  caveat", "", caveat, ""))
            for name, pair in (trl.get("differs_from_grpo") or {}).items():
                rows.append((f"  TRL {name}", str(pair.get("trl"))[:12], f"grpo.py: {pair.get('grpo.py')}"[:40], ""))
    for name, part in (report.get("parts") or {}).items():
        if part.get("rc") != 0:
            why = "killed by its time limit" if part.get("rc") in (124, 137) else f"exit {part.get('rc')}"
            rows.append((f"part {name}", "STOPPED", f"{why} after {part.get('seconds')} s", ""))
    for name, sec in report["sections"].items():
        for key, val in sec.items():
            ran = isinstance(val, dict) and (val.get("backend") or val.get("rollout_backend"))
            if ran:  # what the variant or trainer ran as, and why it fell back
                fell = "; ".join(f["reason"] for f in val.get("fallbacks") or val.get("rollout_fallbacks") or [])
                rows.append((f"ran as: {name}/{key}", ran[:12], ("FELL BACK: " + fell)[:80] if fell else "", ""))
            if isinstance(val, dict) and val.get("peak_gib") is not None:
                rows.append((f"peak GiB: {name}/{key}", f"{val['peak_gib']:.2f}", "", ""))
            if isinstance(val, dict) and val.get("skipped"):
                rows.append((f"{name}/{key}", "skipped", val["skipped"][:60], ""))
        if sec.get("skipped"):
            rows.append((name, "skipped", sec["skipped"][:60], ""))
        if sec.get("running"):
            rows.append((name, "UNFINISHED", sec["running"][:60], ""))
        if name == "toy" and sec.get("reward_rose") is not None:
            rise = f"{sec['reward_first']:.3f} -> {sec['reward_last']:.3f}"
            rows.append(
                ("toy reward (first -> last third)", "rose" if sec["reward_rose"] else "DID NOT RISE", rise, "")
            )
        if sec.get("error"):
            rows.append((name, "ERROR", sec["error"][:60], ""))
        for key, val in sec.items():
            if isinstance(val, dict) and val.get("error"):
                rows.append((f"{name}/{key}", "ERROR", val["error"][:60], ""))
        if name == "sdpa":
            for key in ("decode", "prefill"):
                rows.append((f"sdpa kernel: {key}", str(sec.get(key, "-"))[:12], str(sec.get(f"shape_{key}", "")), ""))
    w = max(len(r[0]) for r in rows)
    print(f"\n== throughput on {report['device']} ({report['model']}, {report['dtype']}) ==")
    for r in rows:
        print(f"{r[0]:<{w}}  {r[1]:>12}  {r[2]:<12} {r[3]}")


# ======================================================================================================
# sections
# ======================================================================================================


def section_check(b: Bench) -> dict[str, Any]:
    """Greedy agreement with the plain path; sampled log-probs against the training forward (mean |diff|)."""
    n, T = b.args.check_rows, min(b.args.new_tokens, 128)
    prompts = b.prompts(n, "test")
    kw = dict(max_new_tokens=T, eos_id=b.eos, pad_id=b.pad)
    ours = generation.generate(b.lm, prompts, backend="static", **kw)
    plain = generation.generate(b.lm, prompts, backend="hf", **kw)
    first_diff = []
    for x, y, lx, ly in zip(ours.response_ids.tolist(), plain.response_ids.tolist(), ours.lengths, plain.lengths):
        x, y = x[: int(lx)], y[: int(ly)]
        first_diff.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))))
    same = [a == c for a, c in zip(rollout.decode_responses(b.tok, ours)[1], rollout.decode_responses(b.tok, plain)[1])]

    def logprob_error(ro: rollout.Rollout) -> dict[str, float]:
        with torch.no_grad(), distributed.autocast_ctx(b.device):
            lp, _, _ = forward.PolicyForward(b.lm)(ro.input_ids, ro.attention_mask, ro.prompt_ids.shape[1])
        d = (ro.logprobs - lp).abs() * ro.response_mask
        return {"mean": (d.sum() / ro.response_mask.sum()).item(), "max": d.max().item()}

    u = rollout.step_uniforms(0, 0, 0, n, T, b.device)
    s_ours = generation.generate(b.lm, prompts, backend="static", uniforms=u, **kw)
    s_plain = generation.generate(b.lm, prompts, backend="hf", uniforms=u, **kw)
    same_sampled = [
        a == c for a, c in zip(rollout.decode_responses(b.tok, s_ours)[1], rollout.decode_responses(b.tok, s_plain)[1])
    ]
    return {
        "rows": n,
        "max_new_tokens": T,
        "greedy_rows_identical": sum(same) / n,
        "greedy_mean_first_difference": sum(first_diff) / n,
        "sampled_rows_identical": sum(same_sampled) / n,
        "logprob_abs_error_engine": logprob_error(s_ours),
        "logprob_abs_error_hf_path": logprob_error(s_plain),
    }


def section_generate(b: Bench) -> dict[str, Any]:
    """Tokens/s at a fixed length: the engine (graph + compile, graph only) and generate()'s dynamic cache."""
    B, T = b.args.batch, b.args.new_tokens
    prompts = b.prompts(B)
    u = rollout.step_uniforms(0, 0, 0, B, T, b.device)
    out = b.current  # the report's own dict: each variant is in throughput.json once measured
    out.update(batch=B, new_tokens=T, mean_prompt_tokens=sum(map(len, prompts)) / B)
    for name in [v.strip() for v in b.args.variants.split(",") if v.strip()]:
        if name == "engine_flex" and not b.cuda:  # flex: each row reads only its valid KV blocks (GPU only)
            out[name] = {"skipped": "flex attention runs on a GPU only"}
        elif b.over_deadline():
            out[name] = {"skipped": b.over_deadline()}
        else:
            print(f"[{name}] ...", flush=True)
            try:
                if name == "hf_dynamic":
                    out[name] = _hf_generate(b, prompts, T, static=False)
                else:
                    out[name] = _time_engine(b, prompts, u, ENGINE_OPTS[name], name)
            except Exception as e:  # one variant failing must not lose the others
                import traceback

                traceback.print_exc()
                out[name] = {"error": f"{type(e).__name__}: {e}"}
        b.save()
    return out


def _time_engine(b: Bench, prompts: list[list[int]], u: torch.Tensor, opts: dict, name: str) -> dict[str, Any]:
    """One engine variant: its first call (capture, compilation), the median of the timed calls, and its
    decode step measured (prefill excluded) beside the arithmetic floor."""
    B, T = b.args.batch, b.args.new_tokens
    b.reset_peak()
    eng = static_engine.StaticEngine(b.lm, **opts)
    run = lambda: eng.generate(prompts, max_new_tokens=T, eos_id=-1, pad_id=b.pad, uniforms=u)  # noqa: E731
    first_s, ro = b.timed(run)
    assert int(ro.lengths.sum()) == B * T
    ran = {"backend": eng.backend_name, "compile": eng.compile, "fell_back": bool(eng.fallbacks)}
    ran["fallbacks"] = list(eng.fallbacks)
    b.current[name] = {"first_call_s": first_s, **ran}  # on the record before the timed calls
    b.save()
    eng.timing = True
    times, decode = [], []
    for _ in range(b.args.reps):
        times.append(b.timed(run)[0])
        decode.append(eng.last_timing["decode_s"] / eng.last_timing["steps"])
    groups = eng.groups_for(eng.rows_for(B))  # the probes decode in as many row groups as the variant did
    eager_ops = count_step_ops(eng, prompts[:4], b.pad, groups)
    kernels, source = count_step_kernels(eng, prompts[:4], b.pad, groups)
    floor = decode_floor(eng, [len(p) for p in prompts], T, kernels if kernels else eager_ops)
    floor["ops_per_step_eager"], floor["ops_per_step"], floor["ops_source"] = eager_ops, floor["ops"], source
    floor["measured_ms"] = 1e3 * _median(decode)
    floor["prefill_ms_measured"] = 1e3 * eng.last_timing["prefill_s"]
    print(
        f"[{name}] decode step: measured {floor['measured_ms']:.3f} ms, arithmetic {floor['expected_ms']:.3f} ms "
        f"({floor['explain']})",
        flush=True,
    )
    ran.update(backend=eng.backend_name, compile=eng.compile, fell_back=bool(eng.fallbacks))
    ran["fallbacks"] = list(eng.fallbacks)
    return {
        **ran,
        "first_call_s": first_s,
        "capture_and_compile_s": eng.compile_seconds,
        "seconds": _median(times),
        "tokens_per_s": B * T / _median(times),
        "peak_gib": b.peak_gib(),
        "floor": floor,
    }


def count_step_ops(eng: static_engine.StaticEngine, prompts: list[list[int]], pad: int, row_groups: int = 1) -> int:
    """ATen ops (views left out) one eager decode step dispatches, in row_groups row groups: about its kernels
    without torch.compile, which fuses the norms, RoPE and the elementwise ops of each layer piece and of the
    sampler."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            aliases = [r.alias_info for r in func._schema.returns if r.alias_info is not None]
            if not aliases or any(a.is_write for a in aliases):  # a view launches no kernel
                Count.n += 1
            return func(*args, **(kwargs or {}))

    probe = static_engine.StaticEngine(
        eng._lm(), cuda_graph=False, compile=False, check_every=1000, row_groups=row_groups
    )
    step, counts = probe._decode_step, []

    def counted(*a):
        Count.n = 0
        with Count():
            step(*a)
        counts.append(Count.n)

    probe._decode_step = counted
    probe.generate(prompts, max_new_tokens=2, eos_id=-1, pad_id=pad)
    return counts[-1]


def count_step_kernels(
    eng: static_engine.StaticEngine, prompts: list[list[int]], pad: int, row_groups: int = 1
) -> tuple[int | None, str]:
    """The GPU kernels one decode step of this variant launches (its own compile and attention settings and
    row_groups, run without a graph under torch.profiler), or (None, why) where that cannot be counted (the
    CPU): then the expected line uses the eager ATen op count, an upper bound for a compiled variant."""
    if eng.device.type != "cuda":
        return None, "eager ATen ops (no GPU: kernels not counted)"
    try:
        from torch.profiler import ProfilerActivity, profile

        probe = static_engine.StaticEngine(
            eng._lm(),
            cuda_graph=False,
            compile=eng.compile,
            attention=eng.attention,
            check_every=1000,
            row_groups=row_groups,
        )
        step, counts = probe._decode_step, []

        def counted(*a):
            torch.cuda.synchronize(eng.device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step(*a)
                torch.cuda.synchronize(eng.device)
            counts.append(sum(1 for e in prof.events() if e.device_type.name == "CUDA"))

        probe._decode_step = counted
        probe.generate(prompts, max_new_tokens=3, eos_id=-1, pad_id=pad)
        return counts[-1], "CUDA kernels of one step of this variant (torch.profiler, no graph)"
    except Exception as e:  # a profiler problem must not lose the measurement
        return None, f"eager ATen ops (kernel count failed: {type(e).__name__}: {e})"[:200]


def decode_floor(
    eng: static_engine.StaticEngine, prompt_lens: list[int], T: int, ops: int, row_groups: int | None = None
) -> dict[str, Any]:
    """The decode step's time from arithmetic on H200's datasheet: max(bytes / bandwidth, FLOPs / peak) plus
    a launch gap per kernel, averaged over T steps. Bytes: every weight matrix and the LM head once; the KV
    slots (valid: each row's prompt + t + 1; read by this engine: with SDPA, every row of a row group reads
    its group's width, static_kernels.group_widths over the rows sorted longest first as the engine sorts them (one
    group: the longest row's chunk for every row); with flex, each row's own FLEX_BLOCK blocks); the fp32
    logits' passes (write, log-softmax read and write, block sums, gather: ~5 x rows x V x 4). Kernels (ops):
    the variant's own kernel count on a GPU (count_step_kernels), else the ATen ops of one eager step (compile
    fuses some: an upper bound). row_groups: the engine's own rule (groups_for) when None."""
    elt = torch.finfo(eng.dtype).bits // 8
    rows = eng.rows_for(len(prompt_lens))
    groups = eng.groups_for(rows) if row_groups is None else row_groups
    lens = sorted(prompt_lens, reverse=True) if groups > 1 else list(prompt_lens)
    lens = [max(1, p) for p in lens] + [1] * (rows - len(prompt_lens))  # extra rows hold one token
    weights = sum(x.numel() for x in (eng.qkv, eng.o, eng.gate_up, eng.down)) + eng.vocab * eng.hidden_size
    kv_slot = eng.n_layers * 2 * eng.n_kv * eng.head_dim * elt  # bytes of one slot, all layers
    valid = sum(sum(p + t + 1 for p in lens) for t in range(T)) / T  # slots per step, all rows
    if eng.attention == "flex":
        block = static_kernels.FLEX_BLOCK
        read = sum(sum(round_up(p + t + 1, block) for p in lens) for t in range(T)) / T
    else:
        sizes = [b - a for a, b in itertools.pairwise(static_kernels.row_group_bounds(rows, groups))]  # rows per group
        cap = round_up(max(lens) + T, 256)  # the cache's slots (engine.reserve's rounding)
        widths = [static_kernels.group_widths(lens, groups, t, eng.kv_chunk, cap) for t in range(T)]
        read = sum(sum(r * w for r, w in zip(sizes, ws)) for ws in widths) / T
    logits = 5 * rows * eng.vocab * 4
    bytes_valid = weights * elt + valid * kv_slot + logits
    bytes_read = weights * elt + read * kv_slot + logits
    flops = 2 * rows * weights + 4 * valid * eng.n_heads * eng.head_dim * eng.n_layers
    hw = H200
    t_mem, t_flop = bytes_read / hw["hbm_bytes_per_s"], flops / hw["bf16_flops"]
    t_kern = ops * hw["kernel_gap_s"]
    return {
        "rows": rows,
        "attention": eng.attention,
        "row_groups": groups if eng.attention != "flex" else 1,
        "weight_bytes": weights * elt,
        "kv_bytes_valid": valid * kv_slot,
        "kv_bytes_read": read * kv_slot,
        "logit_bytes": logits,
        "bytes_valid": bytes_valid,
        "bytes_read": bytes_read,
        "flops": flops,
        "ops": ops,
        "memory_ms": 1e3 * t_mem,
        "memory_ms_valid_only": 1e3 * bytes_valid / hw["hbm_bytes_per_s"],
        "flops_ms": 1e3 * t_flop,
        "kernel_gap_ms": 1e3 * t_kern,
        "expected_ms": 1e3 * (max(t_mem, t_flop) + t_kern),
        "assumptions": hw,
        "explain": f"{bytes_read / 1e9:.2f} GB read ({bytes_valid / 1e9:.2f} GB valid), {flops / 1e12:.3f} TFLOP, "
        f"{ops} kernels",
    }


def section_sdpa(b: Bench) -> dict[str, Any]:
    """The SDPA kernel picked for the engine's decode (batch x longest chunk) and prefill (batch x prompt) shapes."""
    eng = static_engine.StaticEngine(b.lm, cuda_graph=False, compile=False)
    rows, Lk, P = eng.rows_for(b.args.batch), round_up(192 + b.args.new_tokens, 64), 192
    out = eng.attention_backends(rows, Lk, P)
    out.update(shape_decode=f"{rows} x {Lk} slots", shape_prefill=f"{rows} x {P} tokens")
    print(f"[sdpa] decode {out['decode']} ({out['shape_decode']}), prefill {out['prefill']} ({out['shape_prefill']})")
    return out


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _hf_model(b: Bench) -> torch.nn.Module:
    """A copy of the policy in the compute dtype (bf16 on a GPU), as transformers' own generation runs best."""
    return copy.deepcopy(b.lm).to(torch.bfloat16 if b.cuda else torch.float32).eval()


def _hf_generate(b: Bench, prompts: list[list[int]], T: int, static: bool) -> dict[str, Any]:
    hf = _hf_model(b)
    ids, mask = rollout.left_pad(prompts, b.pad)
    ids, mask = ids.to(b.device), mask.to(b.device)
    extra = {"cache_implementation": "static"} if static else {}

    def run(n_tokens: int) -> torch.Tensor:
        torch.manual_seed(0)
        with torch.no_grad():
            return hf.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=n_tokens,
                min_new_tokens=n_tokens,  # EOS ignored: the same token count as the engine
                eos_token_id=b.eos,
                pad_token_id=b.pad,
                **extra,
            )

    b.reset_peak()
    # a static cache compiles for its length: warm up at the full length; the dynamic cache needs only a little
    first_s, seq = b.timed(lambda: run(T if static else min(8, T)))
    times = [b.timed(lambda: run(T))[0] for _ in range(1 if static else max(1, b.args.reps - 2))]
    return {
        "first_call_s": first_s,
        "seconds": _median(times),
        "tokens_per_s": len(prompts) * T / _median(times),
        "peak_gib": b.peak_gib(),
    }


def section_hf_static(b: Bench) -> dict[str, Any]:
    """generate() with a static cache (and, on a GPU, transformers' automatic torch.compile of the step)."""
    B, T = b.args.batch, b.args.new_tokens
    return {"batch": B, "new_tokens": T, **_hf_generate(b, b.prompts(B), T, static=True)}


def section_eval(b: Bench) -> dict[str, Any]:
    """gsm8k.evaluate over the test split: the first call (graph capture) and a second, warm one."""
    problems = b.splits["test"][: b.args.eval_size or None]
    kw = dict(
        task="gsm8k",
        prompt_format="chat",
        max_new_tokens=b.args.eval_max_new_tokens,
        batch_size=b.args.eval_batch_size,
        show_progress=False,
    )
    b.reset_peak()
    cold_s, res = b.timed(lambda: gsm8k.evaluate(b.lm, b.tok, problems, backend="static", **kw))
    warm_s, res = b.timed(lambda: gsm8k.evaluate(b.lm, b.tok, problems, backend="static", **kw))
    out = {
        "problems": len(problems),
        "batch_size": b.args.eval_batch_size,
        "max_new_tokens": b.args.eval_max_new_tokens,
        "cold_s": cold_s,
        "warm_s": warm_s,
        "accuracy": res["accuracy"],
        "generated_tokens": res["generated_tokens"],
        "tokens_per_s": res["generated_tokens"] / warm_s,
        "peak_gib": b.peak_gib(),
    }
    if b.args.hf_eval:
        b.reset_peak()
        hf_s, hf_res = b.timed(lambda: gsm8k.evaluate(b.lm, b.tok, problems, backend="hf", **kw))
        out.update(hf_s=hf_s, hf_accuracy=hf_res["accuracy"], hf_peak_gib=b.peak_gib())
    return out


def _trainer_args(b: Bench, run_dir: Path) -> list[str]:
    """The arguments grpo.py and ppo.py share here: study settings, no MC measurement, a short final eval."""
    a = b.args
    opts = {
        "--model": b.model_name,
        "--scale": "study",
        "--device": b.device.type,
        "--total-steps": a.trainer_steps,
        "--max-new-tokens": a.new_tokens,
        "--mc-every": 0,
        "--eval-every": 0,
        "--save-every": 0,
        "--eval-size": 4 if a.tiny else 32,
        "--test-size": 4 if a.tiny else 32,
        "--eval-max-new-tokens": a.new_tokens,  # after the timed steps; within a small model's context
        "--prompt-format": a.prompt_format,
        "--run-dir": run_dir,
    }
    if a.data_dir:
        opts["--data-dir"] = a.data_dir
    if a.tiny:
        opts.update({"--micro-batch-size": 2, "--eval-batch-size": 4, "--eval-max-new-tokens": 8})
    return [str(x) for kv in opts.items() for x in kv] + ["--no-progress"] + shlex.split(a.update_args)


def run_trainer(b: Bench, script: str, extra: list[str], name: str) -> dict[str, Any]:
    """Run a trainer for a few steps in its own process; the median of its logged step times after warm-up."""
    if not (ROOT / script).is_file():
        return {"skipped": f"{script} is not on this branch"}
    if b.over_deadline():
        return {"skipped": b.over_deadline()}
    run_dir = Path(b.args.work_dir) / name
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cmd = [sys.executable, script, *_trainer_args(b, run_dir), *extra]
    log = Path(b.args.work_dir) / f"{name}.log"
    print(f"[{name}] {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        with open(log, "w") as f:
            proc = subprocess.run(
                cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=b.args.subprocess_timeout_s
            )
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    rows = []
    if (run_dir / "metrics.jsonl").is_file():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out: dict[str, Any] = {"command": cmd, "returncode": code, "wall_s": time.perf_counter() - t0}
    if rows:  # the first line says what the rollouts ran on
        out["rollout_backend"] = rows[0].get("rollout_backend")
        out["rollout_fallbacks"] = rows[0].get("rollout_fallbacks")
    if (run_dir / "results.json").is_file():  # the whole run's record, when it finished
        res = json.loads((run_dir / "results.json").read_text())
        out["rollout_backend"] = res.get("rollout_backend", out.get("rollout_backend"))
        out["rollout_fallbacks"] = res.get("rollout_fallbacks", out.get("rollout_fallbacks"))
    rows = [r for r in rows if "time/step" in r]
    out["rewards"] = [r.get("reward") for r in rows]
    kept = rows[b.args.warmup_steps :]
    if code != 0 or not kept:  # the step times it logged are kept beside the error
        out["error"] = f"exit {code}, {len(rows)} steps logged: " + log.read_text()[-1500:]
        out["step_times_logged"] = [r["time/step"] for r in rows]
        if not kept:
            return out
    for key in ("time/step", "time/rollout", "time/update"):
        vals = [r[key] for r in kept if r.get(key) is not None]
        out[key.split("/")[1] + "_s"] = _median(vals)
    out["steps_timed"] = len(kept)
    out["response_len"] = _median([r["response_len"] for r in kept if "response_len" in r])
    peaks = [r["memory/peak_gib"] for r in rows if r.get("memory/peak_gib") is not None]
    out["peak_gib"] = max(peaks) if peaks else None
    return out


def _fill(template: str, **values: int) -> list[str]:
    return shlex.split(template.format(**values))


def section_grpo(b: Bench) -> dict[str, Any]:
    """grpo.py's step; with --rounds > 1 and the trl section chosen, grpo.py and TRL alternated, run by run."""
    a = b.args
    out = b.current
    out.update(prompts=a.grpo_prompts, group=a.group, new_tokens=a.new_tokens)
    extra = _fill(a.grpo_args, prompts=a.grpo_prompts, group=a.group)
    if a.rounds <= 1 or "trl" not in [x.strip() for x in a.sections.split(",")]:
        out["grpo"] = run_trainer(b, "grpo.py", extra, "grpo")
        return out
    runs: dict[str, list[dict[str, Any]]] = {"grpo": [], "trl": []}
    for _ in range(a.rounds):  # the same load for both sides: one run of each, in turn
        runs["grpo"].append(run_trainer(b, "grpo.py", extra, "grpo"))
        runs["trl"].append({**run_trl(b), "caveats": list(TRL_CAVEATS)})
        out["grpo"], out["trl"] = (combine_rounds(runs[k]) for k in ("grpo", "trl"))
        b.save()
    return out


def combine_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's alternated runs as one record: the last run's fields, each time the median over the runs that
    measured it, and every run's own figures (rounds)."""
    out = dict(runs[-1])
    for key in ("step_s", "rollout_s", "update_s"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = _median(vals)
        out[f"{key}_rounds"] = vals
    out["rounds"] = len(runs)
    errors = [r["error"] for r in runs if r.get("error")]
    if errors:
        out["error"] = errors[-1]
    else:
        out.pop("error", None)
    return out


def section_trl(b: Bench) -> dict[str, Any]:
    """TRL's GRPOTrainer at grpo.py's sizes and step count, with what the ratio does not hold equal (already
    measured, alternated with grpo.py, when the grpo section ran with --rounds > 1)."""
    alternated = b.report["sections"].get("grpo", {}).get("trl")
    if alternated:
        return dict(alternated)
    return {**run_trl(b), "caveats": list(TRL_CAVEATS)}


def reward_rise(rewards: list[float | None]) -> dict[str, Any]:
    """The mean reward of the last third of the steps against the first third's."""
    r = [x for x in rewards if x is not None]
    k = max(1, len(r) // 3)
    if len(r) < 2:
        return {"reward_first": None, "reward_last": None, "reward_rose": None}
    first, last = sum(r[:k]) / k, sum(r[-k:]) / k
    return {"reward_first": first, "reward_last": last, "reward_rose": last > first}


def section_toy(b: Bench) -> dict[str, Any]:
    """A short GRPO run on --task toy (reward 1 when a target token appears): the training path learning end
    to end on this device (GSM8K cannot show it on the packaged model)."""
    a = b.args
    extra = shlex.split(a.toy_args) + ["--total-steps", str(a.toy_steps), "--micro-batch-size", "32"]
    out = run_trainer(b, "grpo.py", extra, "toy")
    return {**out, **reward_rise(out.get("rewards") or [])}


def section_ppo(b: Bench) -> dict[str, Any]:
    a = b.args
    n = a.grpo_prompts * a.group
    return {"completions": n, "ppo": run_trainer(b, "ppo.py", _fill(a.ppo_args, completions=n), "ppo")}


def run_trl(b: Bench) -> dict[str, Any]:
    """TRL's GRPOTrainer at the same sizes, in its own process (bench/trl_grpo.py)."""
    python = b.args.trl_python or sys.executable
    if not b.args.trl_python and importlib.util.find_spec("trl") is None:
        return {
            "skipped": "trl is not installed (pip install -r bench/requirements.txt, or name a venv's --trl-python)"
        }
    if b.over_deadline():
        return {"skipped": b.over_deadline()}
    a = b.args
    model_dir = Path(a.work_dir) / "tiny-model"
    if a.tiny:  # TRL loads a folder: save the tiny model there
        b.lm.save_pretrained(model_dir)
        b.tok.save_pretrained(model_dir)
    else:
        model_dir = Path(models.resolve_model(b.model_name))
    out_json = Path(a.work_dir) / "trl.json"
    cmd = [python, "bench/trl_grpo.py", "--model-dir", str(model_dir), "--out", str(out_json)]
    cmd += ["--device", b.device.type, "--prompts", str(a.grpo_prompts), "--generations", str(a.group)]
    cmd += [
        "--max-new-tokens",
        str(a.new_tokens),
        "--steps",
        str(a.trainer_steps),
        "--run-dir",
        f"{a.work_dir}/trl-run",
    ]
    cmd += ["--micro-batch-size", str(min(a.trl_micro_batch_size, a.grpo_prompts * a.group))]
    cmd += ["--prompt-format", a.prompt_format]
    grpo_args = (
        f"--max-new-tokens {a.new_tokens} {a.update_args} {a.grpo_args.format(prompts=a.grpo_prompts, group=a.group)}"
    )
    cmd += [f"--grpo-args={grpo_args}"]  # one word: its value starts with a dash
    lr = shlex.split(grpo_args)
    if "--lr" in lr:  # the learning rate grpo.py runs with
        cmd += ["--lr", lr[lr.index("--lr") + 1]]
    if a.data_dir:
        cmd += ["--data-dir", a.data_dir]
    log = Path(a.work_dir) / "trl.log"
    print(f"[trl] {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    try:
        with open(log, "w") as f:
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=a.subprocess_timeout_s)
            code = code.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    if code != 0 or not out_json.is_file():
        return {"command": cmd, "error": f"exit {code}: " + log.read_text()[-1500:]}
    res = json.loads(out_json.read_text())
    kept = res["step_seconds"][a.warmup_steps :] or res["step_seconds"]  # the same steps as grpo.py's median
    return {"command": cmd, "step_s": _median(kept), "steps_timed": len(kept), **res}


def section_train(b: Bench) -> dict[str, Any]:
    """Forward + backward tokens/s of the training forward on full-length sequences, eager and compiled."""
    a = b.args
    rows, T = a.train_rows, a.new_tokens
    prompts = b.prompts(rows)
    ids, mask = rollout.left_pad(prompts, b.pad)
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(3, len(b.tok) - 1, (rows, T), generator=g)
    input_ids = torch.cat([ids, resp], 1).to(b.device)
    attn = torch.cat([mask, torch.ones(rows, T, dtype=torch.long)], 1).to(b.device)
    tokens = int(attn.sum())
    out: dict[str, Any] = {"rows": rows, "tokens_per_forward": tokens}
    variants = [("eager", False)] + ([("compiled", True)] if a.train_compile else [])
    for name, compile_ in variants:
        model = forward.PolicyForward(b.lm, compile=compile_)
        b.lm.train()

        def step(model: forward.PolicyForward = model) -> None:
            with distributed.autocast_ctx(b.device):
                logp, _, _ = model(input_ids, attn, ids.shape[1])
            logp.sum().backward()
            b.lm.zero_grad(set_to_none=True)

        b.reset_peak()
        first_s, _ = b.timed(step)
        times = [b.timed(step)[0] for _ in range(a.reps)]
        out[name] = {
            "first_call_s": first_s,
            "seconds": _median(times),
            "tokens_per_s": tokens / _median(times),
            "peak_gib": b.peak_gib(),
        }
        b.lm.eval()
    return out


def main() -> None:
    args = tyro.cli(Args)
    if args.table_from:
        path = Path(args.table_from)
        report = json.loads(path.read_text()) if path.is_file() else {"sections": {}, "device": "?", "model": "?"}
        report.setdefault("dtype", "?")
        parts = path.with_name("parts.tsv")  # run_gpu.sh: one line per part, "name exit-status seconds"
        if parts.is_file():
            report["parts"] = {
                n: {"rc": int(rc), "seconds": int(t)} for n, rc, t in map(str.split, parts.read_text().splitlines())
            }
        report["ratios"] = ratios(report["sections"])
        rundir.write_json_atomic(path, report)
        print_table(report)
        return
    if args.tiny:
        apply_tiny(args)
    if args.organism_cpu:
        apply_organism_cpu(args)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}: choose from {', '.join(SECTIONS)}")
    bad = sorted({v.strip() for v in args.variants.split(",") if v.strip()} - set(VARIANTS))
    if bad:
        raise SystemExit(f"unknown variants {bad}: choose from {', '.join(VARIANTS)}")
    b = Bench(args)
    print(f"device {b.report['device']}, model {b.model_name}, sections {', '.join(chosen)}", flush=True)
    fns = {
        "sdpa": section_sdpa,
        "check": section_check,
        "generate": section_generate,
        "hf_static": section_hf_static,
        "eval": section_eval,
        "grpo": section_grpo,
        "ppo": section_ppo,
        "toy": section_toy,
        "trl": section_trl,
        "train": section_train,
    }
    for name in SECTIONS:  # always in this order
        if name not in chosen:
            continue
        elapsed = time.perf_counter() - b.t_start
        if b.over_deadline():
            b.report["sections"][name] = {"skipped": b.over_deadline()}
            continue
        print(f"-- {name} ({elapsed:.0f} s in)", flush=True)
        t0 = time.perf_counter()
        sec = b.report["sections"].get(name, {}) if args.merge else {}  # --merge: a part adds its variants
        sec.pop("error", None)
        b.current = b.report["sections"][name] = sec  # filled as the section measures
        sec["running"] = f"started at {elapsed:.0f} s; still running when throughput.json was last written"
        b.save()
        try:
            res = fns[name](b)
            if res is not sec:
                sec.update(res)
        except Exception as e:  # one failing section must not lose the others, nor its own finished parts
            import traceback

            traceback.print_exc()
            sec["error"] = f"{type(e).__name__}: {e}"
        sec.pop("running", None)
        sec["section_s"] = time.perf_counter() - t0
        b.save()
        print(json.dumps({name: b.report["sections"][name]}, default=str)[:2000], flush=True)
    b.save()
    print_table(b.report)
    print(f"\nwritten: {args.out}")
    toy = b.report["sections"].get("toy", {})
    if args.require_toy_rise and "toy" in chosen and toy.get("reward_rose") is not True:
        print(f"error: the toy run's reward did not rise ({toy.get('reward_first')} -> {toy.get('reward_last')})")
        sys.exit(1)


if __name__ == "__main__":
    main()
