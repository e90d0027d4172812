"""The model organism: a 0.6M-parameter Qwen2 that does multi-step arithmetic, and its task in GSM8K's own files.

The study's question needs a model that solves some problems and not others (0 < p < 1), and on 2 CPU cores the
packaged SmolLM2-135M solves almost nothing of GSM8K. So, as biologists do, this builds a small organism that can
answer, on a task whose files are GSM8K's: the same schema, answers written as GSM8K writes them (worked steps on
lines, then "#### N"), read by the same gsm8k.py (splits, fingerprint, the strict reward, evaluation). The trainers
take it as `--model organism`. The repository ships this script's build of seed 0 (organism-seed0/, the one the study in
docs/organism ran on: a build is the same bit for bit on one machine, not on every machine, and a shipped one starts
every machine from the same weights); plumbing/models.py copies it into the project's cache, or, when this file is not
the one that made it, runs this script once, with its own seed.

    python organism.py --out runs/organism            # OUT/model (a Hugging Face folder), OUT/data, OUT/organism.json
    python organism.py --out runs/organism --seed 7   # another organism: any seed reaches the starting point
    python organism.py --out organism-seed0           # the shipped one, made again (4 minutes; rm -r it first)

What it does, in order:
  1. the task: a seeded generator of problems ("What is 19 + 30 - 7?" -> "19 + 30 = 49\\n49 - 7 = 42\\n#### 42"): the
     test problems first, then train, then a stream for supervised fine-tuning, each disjoint from those before it;
  2. the tokenizer: a token per byte (a byte-level BPE without merges: it survives AutoTokenizer's reload, which
     rebuilds a Qwen2 folder's pre-tokenizer; a character-level WordLevel one came back without its spaces), and
     tokens of its own for padding, the turn's end and the roles, with a chat template. The prompt is the template
     applied to the question alone (gsm8k.encode_prompt's "question" format), no instruction;
  3. the model: a random Qwen2 (hidden 96, 4 layers, 616,896 parameters) trained on the stream, the loss on the
     answer and the turn's end, until its greedy accuracy on held-out problems of the stream reaches
     --target-accuracy. Where it stops is the starting point the
     study needs, whatever the seed: room to learn, and prompts a baseline matters on (sampled at T = 1, most are
     solved by some samples and not all). Accuracy rises steeply once carrying is learned (a wider model went from
     34% to 66% in 50 steps at batch 64), so the check is made every --eval-every steps once it passes a quarter of
     the target;
  4. the report: greedy accuracy on the test split, and on --report-problems of them --samples samples each at T = 1:
     the pass rate and the informative share (solved by some samples, not all); OUT/organism.json records them with
     the settings, the sha256 of this script (the recipe), the loss and held-out accuracy at every check, the
     alphabet, the prompt it reads (the first test question and its ids: a tokenizer that reads otherwise is refused)
     and the sha256 of every file. A build stopped while writing its folder leaves none.

Simplifications: no dropout, no weight decay, a constant learning rate after warmup (the stop ends it, not a schedule).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import gsm8k
from plumbing import cmdline, errors, generation, models, rollout, runtime


@dataclass
class Args:
    out: str = "runs/organism"
    """folder to write (it must not exist yet): OUT/model, OUT/data (train.jsonl, test.jsonl), OUT/organism.json"""
    seed: int = 0
    """seed of the problems, the initial weights and the training stream"""
    progress: bool = True
    """show a progress bar"""

    # --- the task ---
    min_ops: int = 2
    """fewest operations (+ or -) in a problem"""
    max_ops: int = 3
    """most operations in a problem"""
    max_number: int = 40
    """numbers are drawn from 0 to this (a subtraction never goes below 0)"""
    train_size: int = 5000
    """problems in train.jsonl: the RL runs' prompts (and their validation split)"""
    test_size: int = 1000
    """problems in test.jsonl: the final accuracy"""

    # --- the model ---
    hidden: int = 96
    """hidden size"""
    layers: int = 4
    """transformer layers"""
    heads: int = 4
    """attention heads, each of hidden / heads dimensions"""
    intermediate: int = 384
    """the MLP's inner width"""

    # --- supervised fine-tuning ---
    batch_size: int = 64
    """sequences per step"""
    lr: float = 3e-3
    """AdamW learning rate after warmup"""
    warmup_steps: int = 50
    """steps of linear warmup"""
    max_steps: int = 4000
    """an organism that has not reached the target by then is an error"""
    target_accuracy: float = 0.4
    """stop once the greedy accuracy on the held-out problems reaches this (0: at the first check)"""
    eval_every: int = 10
    """steps between checks of the held-out accuracy once it passes a quarter of the target (5x as many before)"""
    eval_problems: int = 256
    """held-out problems of the stream, never trained on, for that check"""

    # --- the report ---
    samples: int = 8
    """samples per problem at temperature 1, for the pass rate and the informative share"""
    report_problems: int = 256
    """test problems sampled for the pass rate"""


def validate(args: Args) -> None:
    """Every knob in its range, and a problem space large enough for every problem a build draws to be new (the
    test and train problems are never trained on): one `error:` line before anything is written."""
    runtime.check_ranges(
        args,
        positive=("min_ops", "max_number", "train_size", "test_size", "hidden", "layers", "heads", "intermediate",
                  "batch_size", "lr", "max_steps", "eval_every", "eval_problems", "samples", "report_problems"),
        non_negative=("warmup_steps",),
        unit=("target_accuracy",),
    )  # fmt: skip
    if args.max_ops < args.min_ops:
        raise errors.UserError(f"--max-ops {args.max_ops} must be at least --min-ops {args.min_ops}")
    if args.hidden % args.heads:
        raise errors.UserError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    space = sum((args.max_number + 1) ** (n + 1) for n in range(args.min_ops, args.max_ops + 1))  # additions alone
    needed = args.train_size + args.test_size + args.eval_problems + args.max_steps * args.batch_size
    if space < 2 * needed:
        raise errors.UserError(
            f"--max-number {args.max_number} with {args.min_ops}-{args.max_ops} operations gives ~{space:,} problems "
            f"(additions alone), too few for the {needed:,} distinct ones a build may draw (the splits and at most "
            "--max-steps x --batch-size to train on): raise --max-number or --max-ops"
        )
    if Path(args.out).exists():
        raise errors.UserError(f"--out {args.out} exists: give a new folder")


# ======================================================================================================
# 1. The task: multi-step arithmetic, written as GSM8K writes its answers
# ======================================================================================================


def make_problem(rng: random.Random, args: Args) -> tuple[str, str]:
    """One problem: its question and its answer as GSM8K writes it (worked steps, then "#### N")."""
    value = rng.randint(0, args.max_number)
    terms, steps = [str(value)], []
    for _ in range(rng.randint(args.min_ops, args.max_ops)):
        op = rng.choice("+-")
        b = rng.randint(0, args.max_number) if op == "+" else rng.randint(0, min(value, args.max_number))
        new = value + b if op == "+" else value - b
        steps.append(f"{value} {op} {b} = {new}")
        terms += [op, str(b)]
        value = new
    return f"What is {' '.join(terms)}?", "\n".join(steps) + f"\n#### {value}"


def problems(seed: int, args: Args, exclude: set[str]) -> Iterator[tuple[str, str]]:
    """Problems whose questions are new: not in exclude, and not given before by this stream."""
    rng, seen = random.Random(seed), set(exclude)
    while True:
        q, a = make_problem(rng, args)
        if q not in seen:
            seen.add(q)
            yield q, a


def make_splits(args: Args) -> tuple[list[tuple[str, str]], list[tuple[str, str]], Iterator[tuple[str, str]]]:
    """train, test, and the fine-tuning stream: the test problems first, then train, both left out of the stream."""
    first = problems(args.seed, args, set())
    test = [next(first) for _ in range(args.test_size)]
    train = [next(first) for _ in range(args.train_size)]
    stream = problems(args.seed + 1, args, {q for q, _ in test + train})
    return train, test, stream


def write_jsonl(path: Path, rows: list[tuple[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for q, a in rows:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")


# ======================================================================================================
# 2. The tokenizer: a token per byte, tokens of its own for padding, the turn's end and the roles
# ======================================================================================================

PAD, END, USER, ASSISTANT, SYSTEM = models.PAD_TOKEN, "<|im_end|>", "<|user|>", "<|assistant|>", "<|system|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer() -> Any:
    """A byte-level BPE without merges (the 256 byte symbols) and five special tokens, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in (PAD, END, USER, ASSISTANT, SYSTEM):
        vocab[special] = len(vocab)
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=END, pad_token=PAD, additional_special_tokens=[USER, ASSISTANT, SYSTEM],
        padding_side="left",  # saved with it: plain transformers' batched generate pads on the left too
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_example(tok: Any, question: str, answer: str) -> tuple[list[int], int]:
    """The prompt (the project's own builder), the answer and the turn's end; and the prompt's length."""
    prompt = gsm8k.encode_prompt(tok, question, "question")
    return prompt + tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id], len(prompt)


# ======================================================================================================
# 3. The model, and its supervised fine-tuning
# ======================================================================================================


def make_model(args: Args, tok: Any, positions: int) -> Any:
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=positions, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model


def batch_tensors(examples: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ids [B, L], the attention mask [B, L] and the labels [B, L] (-100 but on the answer's tokens)."""
    L = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), L), pad_id)
    mask = torch.zeros((len(examples), L), dtype=torch.long)
    labels = torch.full((len(examples), L), -100)
    for i, (seq, p) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, p : len(seq)] = torch.tensor(seq[p:])
    return ids, mask, labels


def as_problems(rows: list[tuple[str, str]]) -> list[gsm8k.Problem]:
    return [gsm8k.Problem(q, a, gsm8k.extract_final_answer(a)) for q, a in rows]


def greedy_accuracy(model: Any, tok: Any, probs: list[gsm8k.Problem], max_new_tokens: int) -> float:
    res = gsm8k.evaluate(
        model, tok, probs, task="gsm8k", prompt_format="question", max_new_tokens=max_new_tokens,
        batch_size=512, show_progress=False,
    )  # fmt: skip
    return res["accuracy"]


@torch.no_grad()
def pass_rates(model: Any, tok: Any, probs: list[gsm8k.Problem], k: int, max_new_tokens: int, seed: int) -> list[float]:
    """Each problem's share of k samples at temperature 1 that score 1 (the reward the trainers use)."""
    prompts = [gsm8k.encode_prompt(tok, p.question, "question") for p in probs for _ in range(k)]
    golds = [p.gold for p in probs for _ in range(k)]
    rewards: list[float] = []
    for i in range(0, len(prompts), 512):
        n = min(512, len(prompts) - i)
        u = rollout.step_uniforms(seed, i, 1, n, max_new_tokens, torch.device("cpu"))
        ro = generation.generate(model, prompts[i : i + n], max_new_tokens=max_new_tokens,
                                 eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, uniforms=u)  # fmt: skip
        texts, ids = rollout.decode_responses(tok, ro)
        rewards += gsm8k.score("gsm8k", texts, ids, golds[i : i + n])
    return [sum(rewards[j * k : (j + 1) * k]) / k for j in range(len(probs))]


def main() -> None:
    args = cmdline.parse_args(Args)
    validate(args)
    models.quiet_transformers()
    # one thread, whatever the machine: the weights are then the same build after build on one machine (two threads
    # sum in another order, and the stop falls elsewhere: 1,350 steps instead of 810 for seed 0), and a second thread
    # hardly pays at this size (3.4 steps/s on 2 idle cores against ~4 on one; 2026-12-04). Not the same everywhere:
    # another machine's kernels or libraries may round otherwise (seed 0 stopped at 560 steps on 2026-12-04's
    # machine, 40.8% greedy, and at 530 on 2026-12-05's, 45.4%), so a run records its organism's sha256
    torch.set_num_threads(1)
    out, t0 = Path(args.out), time.time()
    settings = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("out", "progress")}
    print(f"organism: {', '.join(f'{k}={v}' for k, v in settings.items())}", flush=True)

    # 1. the task, 2. the tokenizer
    train, test, stream = make_splits(args)
    held_out = as_problems([next(stream) for _ in range(args.eval_problems)])
    tok = make_tokenizer()
    answer_tokens = max(len(tok.encode(a)) for _, a in test + train) + 1  # the turn's end too
    max_new_tokens = 2 * answer_tokens  # room to go wrong at length
    prompt_tokens = max(len(gsm8k.encode_prompt(tok, q, "question")) for q, _ in test + train)
    positions = 1 << math.ceil(math.log2(2 * (prompt_tokens + max_new_tokens)))  # a power of two, with room

    # 3. the model, trained until the held-out accuracy reaches the target
    torch.manual_seed(args.seed)
    model = make_model(args, tok, positions)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2, {n_params:,} parameters, {len(tok)} tokens, {positions} positions", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    bar = tqdm(total=args.max_steps, desc="organism", disable=not args.progress)
    step, held, trajectory = 0, 0.0, []  # trajectory: [step, the step's loss, held-out accuracy] at every check
    while True:
        model.train()
        examples = [encode_example(tok, *next(stream)) for _ in range(args.batch_size)]
        ids, mask, labels = batch_tensors(examples, tok.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        if step % (args.eval_every * (1 if held >= args.target_accuracy / 4 else 5)) == 0:
            model.eval()
            held = greedy_accuracy(model, tok, held_out, max_new_tokens)
            trajectory.append([step, round(loss.item(), 6), held])
            bar.set_postfix(loss=f"{loss.item():.3f}", held_out=f"{100 * held:.1f}%")
            if held >= args.target_accuracy:
                break
        if step == args.max_steps:
            raise errors.UserError(
                f"the organism reached {100 * held:.1f}% held-out in {step} steps, short of --target-accuracy "
                f"{args.target_accuracy}: raise --max-steps or --lr"
            )
    bar.close()

    # 4. the report, and the folder (written aside, then renamed into place)
    model.eval()
    test_res = gsm8k.evaluate(model, tok, as_problems(test), task="gsm8k", prompt_format="question",
                              max_new_tokens=max_new_tokens, batch_size=512, show_progress=False)  # fmt: skip
    p = pass_rates(model, tok, as_problems(test[: args.report_problems]), args.samples, max_new_tokens, args.seed)
    report = {
        "steps": step, "seconds": round(time.time() - t0, 1), "loss": round(loss.item(), 4), "held_out": held,
        "test_greedy": test_res["accuracy"], "test_greedy_ci95": test_res["ci95"], "test_n": test_res["n"],
        "pass_rate": sum(p) / len(p), "informative": sum(0 < x < 1 for x in p) / len(p), "sampled": len(p),
        "samples": args.samples, "max_new_tokens": max_new_tokens, "parameters": n_params,
    }  # fmt: skip
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:  # stopped or failed while writing (Ctrl-C, a full disk): no half-written folder left behind
        (tmp / "data").mkdir(parents=True)
        write_jsonl(tmp / "data" / "train.jsonl", train)
        write_jsonl(tmp / "data" / "test.jsonl", test)
        model.save_pretrained(tmp / "model")
        tok.save_pretrained(tmp / "model")
        files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        question = test[0][0]  # the prompt it reads, as ids: a tokenizer that reads otherwise is refused (gsm8k.py)
        record = {
            "settings": settings,
            "script_sha256": models.file_sha256(Path(__file__)),  # the recipe: this file, as it built the folder
            "trajectory": trajectory,
            "alphabet": "".join(sorted(set("".join(q + a for q, a in train + test)))),
            "prompt": {"question": question, "ids": gsm8k.encode_prompt(tok, question, "question")},
            "report": report,
            "sha256": {f: models.file_sha256(tmp / f) for f in files},
        }
        (tmp / models.ORGANISM_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    lo, hi = test_res["ci95"]
    print(
        f"organism: {step} steps in {report['seconds']:.0f} s; held-out greedy {100 * held:.1f}%; test greedy "
        f"{100 * report['test_greedy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] of {report['test_n']}; sampled "
        f"(T = 1, {args.samples} each, {len(p)} test problems) pass rate {report['pass_rate']:.3f}, informative share "
        f"{report['informative']:.2f}; written to {out}",
        flush=True,
    )


if __name__ == "__main__":
    runtime.run_main(main)
