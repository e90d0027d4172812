"""The method the three trainers share: GSM8K, the prompt, the reward, the losses, the measurement, evaluation.

The trainers import this file (and engine.py, models.py, runtime.py, critics.py), never each other, so that no
method gets a quietly different reward, prompt, loss, measurement or evaluation. Everything here is a small
function with shape comments and, where it implements a paper, a link to it; the call sites and the sum of the
loss stay inline in each trainer.

Holds, in order: GSM8K and the prompt sampler, the prompt builder, the reward (and the toy task of the learning
tests), the losses and advantages, the dealing of rows over ranks, the Monte Carlo measurement of a baseline's
error, evaluation and its intervals.
Does not hold: an nn.Module, a forward pass or generation (engine.py), files other than GSM8K's, distributed
setup, logging or checkpoints (runtime.py), loading (models.py), the critics (critics.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import engine
import models
import runtime

# ======================================================================================================
# Data: GSM8K (https://github.com/openai/grade-school-math), a fixed validation split carved out of train
# ======================================================================================================


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # the reference solution, ending in "#### N"
    gold: str  # its final answer, normalised by normalize_number
    source: str = ""  # where it was read: "path:line" (or "openai/gsm8k test row N"), for the refusals


# The longest question a data file may hold, in characters: GSM8K's longest is 985 (train) and 848 (test). A
# longer one (a 200 KB question) is refused when the data loads, naming its file and line, before any work.
MAX_QUESTION_CHARS = 4000


_PARSED: dict[tuple, list[Problem]] = {}  # (path, size, mtime_ns, inode) -> its problems, the latest 4 files


def _read_jsonl(path: Path) -> list[Problem]:
    """A GSM8K file's problems. Parsed once per process and file version (its size, mtime and inode): a process
    that loads the data again (the tests' in-process runs; a preflight before its run) skips the 0.3 s parse,
    and a file changed in between is read again."""
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
        if key not in _PARSED:
            with open(path, encoding="utf-8") as f:
                problems = _parse_jsonl(path, f)
            _PARSED[key] = problems
            while len(_PARSED) > 4:  # GSM8K's train and test, and a test's own copies: no growth over a session
                del _PARSED[next(iter(_PARSED))]
        return list(_PARSED[key])
    except UnicodeDecodeError as e:
        raise runtime.UserError(f"{path} is not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise runtime.UserError(f"cannot read {path}: {e.strerror or e}") from None


def _parse_jsonl(path: Path, f: Any) -> list[Problem]:
    problems = []
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question, solution = row["question"], row["answer"]
            if not isinstance(question, str) or not isinstance(solution, str):
                raise TypeError("question and answer must be strings")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise runtime.UserError(f"{path}:{lineno}: malformed GSM8K line ({type(e).__name__}: {e})") from None
        gold = extract_final_answer(solution)
        if gold is None:
            raise runtime.UserError(f"{path}:{lineno}: the answer has no final '#### N' number")
        check_question_length(question, f"{path}:{lineno}")
        problems.append(Problem(question, solution, gold, f"{path}:{lineno}"))
    return problems


def check_question_length(question: str, where: str) -> None:
    if len(question) > MAX_QUESTION_CHARS:
        raise runtime.UserError(
            f"{where}: a question of {len(question):,} characters, over the limit of {MAX_QUESTION_CHARS:,} "
            "(common.MAX_QUESTION_CHARS; GSM8K's longest is 985): remove or shorten that line"
        )


def check_prompt_lengths(
    splits: dict[str, list[Problem]], tokenizer: Any, prompt_format: str, model: str, max_new_tokens: int
) -> int:
    """The longest prompt of every split, in tokens (the few longest questions by UTF-8 bytes tokenised: a byte
    -level tokenizer never gives more tokens than bytes). A prompt that with max_new_tokens exceeds the model's
    context is refused naming its file and line; the memory estimate made before loading is made again with
    the longest prompt in place of models.PROMPT_TOKENS. Returns the longest prompt's length."""
    try:
        context = models._model_config(model).max_position_embeddings
    except Exception:  # an unknown model or config: loading the model reports it
        context = None
    longest, where = 0, ""
    for problems in splits.values():
        for p in sorted(problems, key=lambda p: len(p.question.encode()), reverse=True)[:8]:
            n = len(encode_prompt(tokenizer, p.question, prompt_format))
            if n > longest:
                longest, where = n, p.source
    if context and longest + max_new_tokens > context:
        raise runtime.UserError(
            f"{where}: a prompt of {longest:,} tokens, which with {max_new_tokens} new tokens exceeds the model's "
            f"context of {context:,}: remove or shorten that line"
        )
    models.recheck_generation_memory(longest)
    return longest


def resolve_data_dir(data_dir: str | None) -> str | None:
    """--data-dir, else $GSM8K_DIR, else None (the hub id openai/gsm8k through `datasets`)."""
    return data_dir or os.environ.get("GSM8K_DIR") or None


def load_gsm8k(data_dir: str | None, val_size: int = 500, val_seed: int = 0) -> dict[str, list[Problem]]:
    """GSM8K as {"train", "val", "test"}. val is a fixed, seeded sample of train, removed from train."""
    data_dir = resolve_data_dir(data_dir)
    if data_dir is not None:
        root = Path(data_dir)
        if not root.is_dir():
            raise runtime.UserError(f"GSM8K folder {root} does not exist (set --data-dir or GSM8K_DIR)")
        splits = {}
        for split in ("train", "test"):
            path = root / f"{split}.jsonl"
            if not path.is_file():
                raise runtime.UserError(f"{path} is missing: the GSM8K folder must hold train.jsonl and test.jsonl")
            splits[split] = _read_jsonl(path)
    else:
        splits = _load_gsm8k_hub()
    for split, rows in splits.items():
        if not rows:
            raise runtime.UserError(f"the GSM8K {split} split is empty")
    if not 0 <= val_size < len(splits["train"]):
        raise runtime.UserError(f"--val-size {val_size} must be in [0, {len(splits['train'])})")
    order = list(range(len(splits["train"])))
    random.Random(val_seed).shuffle(order)
    val_idx = set(order[:val_size])
    train = [p for i, p in enumerate(splits["train"]) if i not in val_idx]
    val = [splits["train"][i] for i in sorted(val_idx)]
    return {"train": train, "val": val, "test": splits["test"]}


def data_fingerprint(splits: dict[str, list[Problem]]) -> dict[str, dict[str, Any]]:
    """What data a run used: per split, its count and a SHA-256 over its problems' questions and answers in
    order ({"train": {"n": 6973, "sha256": "..."}, "val": ..., "test": ...}). The toy task samples its prompts
    from the same GSM8K problems, so the same fingerprint covers it."""
    out = {}
    for split, problems in splits.items():
        h = hashlib.sha256()
        for p in problems:  # each field length-prefixed, so that no two lists of problems hash alike by joining
            for text in (p.question, p.solution):
                b = text.encode("utf-8")
                h.update(len(b).to_bytes(8, "little") + b)
        out[split] = {"n": len(problems), "sha256": h.hexdigest()}
    return out


def data_record(data_dir: str | None, splits: dict[str, list[Problem]]) -> dict[str, Any]:
    """results.json's and the checkpoint's "data": the folder actually read (--data-dir, else $GSM8K_DIR,
    resolved to an absolute path; "hub:openai/gsm8k" without one) and data_fingerprint. args.data_dir is left as
    given, so that a resume compares the flags the user passed."""
    folder = resolve_data_dir(data_dir)
    return {
        "folder": str(Path(folder).resolve()) if folder is not None else "hub:openai/gsm8k",
        **data_fingerprint(splits),
    }


def check_data_change(saved: Any, now: dict[str, Any], allow: bool) -> str | None:
    """A resume's data against its checkpoint's (saved: state.json's "data", or None in a checkpoint from
    before fingerprints). Different problems in a split are refused in one line naming the split and its counts,
    unless allow (--allow-data-change); returns a notice to print, or None when nothing changed."""
    if not isinstance(saved, dict):
        return "note: the checkpoint records no data fingerprint (saved before they existed); resuming unchecked"
    changed = [
        s for s in ("train", "val", "test")
        if isinstance(saved.get(s), dict) and saved[s].get("sha256") != now[s]["sha256"]
    ]  # fmt: skip
    if not changed:
        return None
    shown = "; ".join(
        f"{s} {saved[s].get('n')} -> {now[s]['n']} problems"
        + (", same count" if saved[s].get("n") == now[s]["n"] else "")
        for s in changed
    )
    where = f"{saved.get('folder')} -> {now['folder']}" if saved.get("folder") != now["folder"] else str(now["folder"])
    if not allow:
        raise runtime.UserError(
            f"--resume on different data: the {', '.join(changed)} split{'s' if len(changed) > 1 else ''} changed "
            f"({shown}; {where}); restore the data, or pass --allow-data-change if the change is meant"
        )
    return f"note: --allow-data-change: resuming on changed data ({shown}); the new fingerprint is recorded"


def _load_gsm8k_hub() -> dict[str, list[Problem]]:
    try:
        import datasets

        ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as e:  # offline, or no datasets
        raise runtime.UserError(
            f"no GSM8K folder given (--data-dir or GSM8K_DIR) and the hub copy could not be read: {type(e).__name__}"
        ) from None
    out = {}
    for split in ("train", "test"):
        rows = []
        for i, row in enumerate(ds[split]):
            gold = extract_final_answer(row["answer"])
            if gold is None:
                raise runtime.UserError(f"openai/gsm8k {split} row {i}: the answer has no final '#### N' number")
            check_question_length(row["question"], f"openai/gsm8k {split} row {i}")
            rows.append(Problem(row["question"], row["answer"], gold, f"openai/gsm8k {split} row {i}"))
        out[split] = rows
    return out


class PromptSampler:
    """Deterministic batches of problem indices: a seeded permutation per epoch, a position within it.

    Its state (epoch, position) goes into the checkpoint, so a resumed run sees the same prompts.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(self.n))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation()
            take = min(k - len(out), self.n - self.pos)
            out += self._perm[self.pos : self.pos + take]
            self.pos += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        if not 0 <= int(state["pos"]) <= self.n:  # a checkpoint of other data, or a crafted one
            raise runtime.UserError(
                f"the checkpoint's data position {state['pos']} is beyond the {self.n} items this run samples from; "
                "it was saved on other data"
            )
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._perm = self._permutation()


def reference_solution(problem: Problem) -> str:
    """GSM8K's reference solution as a completion: calculator annotations <<a*b=c>> removed, ending in '#### N'."""
    text, out, i = problem.solution, [], 0
    while i < len(text):
        j = text.find("<<", i)
        k = text.find(">>", j + 2) if j != -1 else -1
        if j == -1 or k == -1:
            out.append(text[i:])
            break
        out.append(text[i:j])
        i = k + 2
    body = "".join(out).rstrip()
    head, sep, _ = body.rpartition("####")
    return f"{head.rstrip()}\n#### {problem.gold}" if sep else f"{body}\n#### {problem.gold}"


# ======================================================================================================
# Prompts: the model's chat template, for training and evaluation alike
# ======================================================================================================

INSTRUCTION = 'Solve the problem step by step. On the last line, write "####" followed by the final answer as a number.'


def prompt_text(question: str) -> str:
    """The user message for one problem: the question, then the one instruction."""
    return f"{question.strip()}\n\n{INSTRUCTION}"


def encode_prompt(tokenizer: Any, question: str, prompt_format: str = "chat") -> list[int]:
    """Token ids of the prompt for one problem. The only prompt builder: training and evaluation call it."""
    content = prompt_text(question)
    if prompt_format == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise runtime.UserError(
                "this tokenizer has no chat template; pass --prompt-format plain to use plain-text prompts"
            )
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    if prompt_format == "plain":
        return tokenizer(f"Question: {content}\nAnswer:", add_special_tokens=True)["input_ids"]
    raise runtime.UserError(f"unknown --prompt-format {prompt_format!r}: use chat or plain")


# ======================================================================================================
# Reward: a strict final answer ("#### N" or \boxed{N}), never the last number in the text
# ======================================================================================================

_MAX_NUMBER_CHARS = 64  # longer "numbers" are rejected: bounded work per marker, no int() of 100 KB
_BOXED = "\\boxed{"
_BRACES = re.compile(r"[{}]")


def normalize_number(text: str) -> str | None:
    """A canonical string for a number, or None. '$1,000.50' -> '1000.5', '+7' -> '7', '50%' -> '50'.

    Commas must group thousands (1,000 yes, 1,00 no). No eval: the digits go through Decimal.
    """
    s = text.strip().replace("\\$", "$").replace("\\%", "%").replace("{,}", ",").replace("\\!", "")
    if len(s) > _MAX_NUMBER_CHARS or not s:
        return None
    sign, signed = "", False
    for _ in range(2):  # sign and currency in either order: -$5, $-5; one sign at most ('--5' is not a number)
        if s[:1] in "+-" and s[:1] and not signed:
            signed = True
            sign, s = ("-" if s[0] == "-" else ""), s[1:].lstrip()
        if s[:1] == "$":
            s = s[1:].lstrip()
    if s.endswith("%"):
        s = s[:-1].rstrip()
    if not s:
        return None
    whole, dot, frac = s.partition(".")
    if dot and (not frac.isdigit() or not frac.isascii()):
        return None
    if "," in whole:
        groups = whole.split(",")
        if not (1 <= len(groups[0]) <= 3 and all(len(g) == 3 for g in groups[1:])):
            return None
        whole = "".join(groups)
    if whole and not (whole.isdigit() and whole.isascii()):
        return None
    if not whole and not frac:
        return None
    try:
        value = Decimal(f"{sign}{whole or '0'}.{frac or '0'}")
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value, "f").rstrip("0")  # exact: normalize() would round to the context's 28 digits


_ESCAPES = "$%!,"  # what may follow a backslash inside a number: \\$ \\% \\! \\, (normalize_number reads them)


def _number_after_marker(text: str, i: int) -> str | None:
    """The number that starts at text[i] (after spaces), or None. Looks at most a few dozen characters.

    A backslash belongs to the number only as one of the escapes \\$ \\% \\! \\,; any other ends it
    ('#### 7 \\boxed{8}' reads 7, so that the two markers are seen to disagree)."""
    n = len(text)
    while i < n and text[i] in " \t\n\r*:":  # '#### 42', '####: 42', '#### **42**'
        i += 1
    j = i
    while j < n and j - i <= _MAX_NUMBER_CHARS:
        c = text[j]
        if c == "\\":
            if j + 1 < n and text[j + 1] in _ESCAPES:
                j += 2
                continue
            break
        if not (c.isdigit() or c in "+-$,.% "):
            break
        j += 1
    token = text[i:j].rstrip(" ,.\\")
    if j < n and j - i <= _MAX_NUMBER_CHARS and text[j].isalnum() and not text[j - 1] == " ":
        return None  # '#### 72kg', '#### 3x': not a plain number
    if j < n and j - i <= _MAX_NUMBER_CHARS and text[j] in "/^{":
        return None  # '#### 3/4', '#### 2^10', '#### 1{,}000': not the first number of it
    return normalize_number(token) if token else None


def _matching_braces(text: str) -> dict[int, int]:
    """{position of '{': position of its matching '}'} for every matched pair, in one pass over the braces.

    re finds the braces (C speed); each one is pushed or popped once, so the work is linear in the text."""
    match, stack = {}, []
    for m in _BRACES.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            match[stack.pop()] = m.start()
    return match


def _boxed_contents(text: str, start: int, match: dict[int, int]) -> str | None:
    """What stands inside \\boxed{...} starting at text[start] (just after the brace), or None when the brace
    is never closed or the contents are longer than a number could be; nested braces count (match: _matching_braces)."""
    close = match.get(start - 1)
    if close is None or close - start > 4 * _MAX_NUMBER_CHARS:
        return None
    return text[start:close]


def _boxed_number(inner: str) -> str | None:
    s = inner.strip()
    for wrapper in ("\\text{", "\\mathrm{", "\\textbf{"):
        if s.startswith(wrapper) and s.endswith("}"):
            s = s[len(wrapper) : -1]
    return normalize_number(s.replace("\\,", ","))


def extract_final_answer(text: str) -> str | None:
    """The marked final answer of a completion, normalised; None when there is none or two disagree.

    Reads only '#### N' and '\\boxed{N}'. A marker followed by something that is not a number gives
    no answer; two markers with different numbers give None (a completion may not hedge).
    Linear in len(text): str.find, bounded scans and one pass over the braces, no backtracking regular expression.
    """
    answers: set[str] = set()
    i = text.find("####")
    while i != -1:
        j = i
        while j < len(text) and text[j] == "#":  # '#####' counts as one marker
            j += 1
        number = _number_after_marker(text, j)
        if number is not None:
            answers.add(number)
        i = text.find("####", j)
    i = text.find(_BOXED)
    match = _matching_braces(text) if i != -1 else {}
    while i != -1:
        inner = _boxed_contents(text, i + len(_BOXED), match)
        if inner is not None:
            number = _boxed_number(inner)
            if number is not None:
                answers.add(number)
        i = text.find(_BOXED, i + len(_BOXED))
    return answers.pop() if len(answers) == 1 else None


def gsm8k_reward(completion: str, gold: str) -> float:
    """1.0 when the completion's marked final answer equals the gold answer, else 0.0."""
    answer = extract_final_answer(completion)
    gold_norm = normalize_number(gold)
    return 1.0 if answer is not None and gold_norm is not None and answer == gold_norm else 0.0


# The toy verifiable task for learning tests: a tiny random model can learn it within a few dozen CPU steps.
TOY_TARGET_MODULUS = 16


def toy_reward(completion_ids: Sequence[int]) -> float:
    """1.0 when the completion holds a token from the target set (ids divisible by 16), else 0.0."""
    return 1.0 if any(int(t) % TOY_TARGET_MODULUS == 0 for t in completion_ids) else 0.0


TASKS = ("gsm8k", "toy")  # what score() knows


def score(task: str, texts: Sequence[str], token_ids: Sequence[Sequence[int]], golds: Sequence[str]) -> list[float]:
    """The one reward every trainer calls: gsm8k_reward on the text, or the toy task on the token ids."""
    if task == "gsm8k":
        return [gsm8k_reward(t, g) for t, g in zip(texts, golds)]
    if task == "toy":
        return [toy_reward(ids) for ids in token_ids]
    raise runtime.UserError(f"unknown --task {task!r}: use gsm8k or toy")


# ======================================================================================================
# Losses: small pure functions, each tested against a plain loop
# ======================================================================================================


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor, global_: bool = False) -> torch.Tensor:
    """Mean of x over mask == 1.  [...], [...] -> [].

    global_=True reduces over every rank and returns a statistic without a gradient (an all-reduce does not
    carry one): for whitening and logging, never for a loss, whose normaliser is a count passed in instead.
    """
    s = torch.stack([masked_sum(x, mask), mask.sum().to(x.dtype)])
    if global_:
        s = runtime.all_reduce_sum(s.detach())
    return s[0] / s[1].clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, global_: bool = False) -> torch.Tensor:
    """Unbiased variance of x over mask == 1 (n / (n - 1) correction, as in the N implementation details)."""
    dtype, x, mask = x.dtype, x.detach().double(), mask.double()  # fp64 sums: E[x^2] - E[x]^2 cancels in fp32
    s = torch.stack([masked_sum(x, mask), masked_sum(x * x, mask), mask.sum()])
    if global_:
        s = runtime.all_reduce_sum(s)
    n = s[2].clamp(min=1)
    mean = s[0] / n
    return ((s[1] / n - mean**2).clamp(min=0) * n / (n - 1).clamp(min=1)).to(dtype)  # 0 for fewer than 2 values


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, global_: bool = False) -> torch.Tensor:
    """(x - mean) / std over mask == 1; padding stays 0.  [B, T] -> [B, T]. global_ whitens over all ranks."""
    mean = masked_mean(x.detach(), mask, global_)
    var = masked_var(x.detach(), mask, global_)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token clipped objective, as a loss (https://arxiv.org/abs/1707.06347).  [B, T] x3 -> [B, T] x2

    Returns the loss max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) and where the clip was active.
    """
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp(logp - old_logp)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(loss1, loss2), (loss2 > loss1).float()


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    """PPO's per-token value loss, 0.5 (V - R)^2, with V kept within `clip` of the rollout's values by taking the
    larger of the clipped and unclipped errors (0: no clipping; the N implementation details,
    https://arxiv.org/abs/2403.17031).  [B, T] x3 -> [B, T]"""
    loss = (values - returns) ** 2
    if clip > 0:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (v_clip - returns) ** 2)
    return 0.5 * loss


def loss_weights(
    mask: torch.Tensor, mode: str, n_tokens: torch.Tensor, n_seqs: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Per-token weights that turn a per-token loss into the minibatch loss.  [B, T] -> [B, T]

    token: sum / all tokens of the minibatch (DAPO); sequence: each sequence's mean, then the mean over
    sequences (the original GRPO); constant: sum / (sequences x max_len) (Dr. GRPO, no length bias).
    n_tokens and n_seqs count the whole minibatch over all ranks, so that N ranks compute one process's loss.
    """
    if mode == "token":
        return mask / n_tokens.clamp(min=1)
    if mode == "sequence":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1) / n_seqs.clamp(min=1)
    if mode == "constant":
        return mask / (n_seqs.clamp(min=1) * max_len)
    raise runtime.UserError(f"unknown --loss-norm {mode!r}: use token, sequence or constant")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimates of KL(pi || ref) from samples of pi (http://joschu.net/blog/kl-approx.html).

    k1 = log r, k2 = (log r)^2 / 2, k3 = (r' - 1) - log r' with r' = ref / pi (via expm1).  [B, T] x2 -> [B, T]
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio  # expm1: no cancellation to 0 when the ratio is ~1
    raise ValueError(f"unknown KL estimator {kind!r}")


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (https://arxiv.org/abs/1506.02438).  [B, T] x3 -> [B, T] x2

    values[:, t] = V(s_t); the value after the last real token is 0 (the episode ends). Returns the
    advantages and the returns (advantages + values), both 0 on padding.
    """
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, device=rewards.device, dtype=rewards.dtype)
    next_value = torch.zeros_like(last)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * m
        adv[:, t] = last
        next_value = values[:, t] * m  # a padded step passes 0 back to the last real token
    return adv, (adv + values) * mask


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", baseline: str = "mean"
) -> torch.Tensor:
    """GRPO's advantage per completion (https://arxiv.org/abs/2402.03300).  [B] -> [B], B = groups * G

    baseline "mean": r - mean(group); "loo": r - mean of the other G - 1 (RLOO, https://arxiv.org/abs/2402.14740).
    scale "group": divide by the group's std (GRPO); "none": don't (Dr. GRPO, https://arxiv.org/abs/2503.20783).
    """
    r = rewards.view(-1, group_size)  # [groups, G]
    mean = r.mean(-1, keepdim=True)
    if baseline == "mean":
        adv = r - mean
    elif baseline == "loo":
        adv = (r - mean) * group_size / (group_size - 1)  # r - (sum - r) / (G - 1)
    else:
        raise ValueError(f"unknown baseline {baseline!r}")
    if scale == "group":
        adv = adv / (r.std(-1, keepdim=True) + 1e-4)
    elif scale != "none":
        raise ValueError(f"unknown scale {scale!r}")
    return adv.reshape(-1)


def dpo_loss(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    kind: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's per-pair loss from sequence log-probs (https://arxiv.org/abs/2305.18290).  [N] x4 -> [N] x2

    margin h = (pi_c - ref_c) - (pi_r - ref_r). sigmoid: -log sigmoid(beta h). ipo: (h - 1 / (2 beta))^2
    (https://arxiv.org/abs/2310.12036). Returns the loss and the margin h.
    """
    margin = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    if kind == "sigmoid":
        return -F.logsigmoid(beta * margin), margin
    if kind == "ipo":
        return (margin - 1.0 / (2.0 * beta)) ** 2, margin
    raise ValueError(f"unknown DPO loss {kind!r}")


def lr_schedule(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate multiplier as a function of the optimiser step, for LambdaLR: the choice checked once."""
    if schedule not in ("constant", "linear", "cosine"):
        raise runtime.UserError(f"unknown --lr-schedule {schedule!r}: use constant, linear or cosine")
    return lambda step: lr_factor(step, warmup, total, schedule)


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """The learning-rate multiplier at an optimiser step: linear warmup, then constant, linear or cosine decay."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - frac
    return 0.5 * (1.0 + math.cos(math.pi * frac))  # cosine (lr_schedule checked the name)


# ======================================================================================================
# Dealing rows over ranks: the same global rows, whatever the world size
# ======================================================================================================


def shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """The contiguous, disjoint share [lo, hi) of n items that a rank takes; n must divide by world."""
    per = n // world
    return rank * per, (rank + 1) * per


def minibatch_rows(rows: int, minibatches: int, first: int, total: int, seed: int) -> list[torch.Tensor]:
    """This rank's rows [0, rows) dealt into `minibatches` minibatches, the same deal whatever the world size.

    The global batch (`total` rows; this rank's share starts at global row `first`) is cut into consecutive
    chunks of `minibatches` rows, and a seeded shuffle of each chunk sends one of its rows to each minibatch.
    A rank's contiguous share is whole chunks, so minibatch m is the same set of global rows on one rank or
    on N, each rank holding rows / minibatches of them: N processes take the optimiser steps one process takes.
    -> `minibatches` tensors of local row indices, [rows / minibatches] each
    """
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(total // minibatches, minibatches, generator=g)  # [chunks, M]: the same table on every rank
    order = keys.argsort(-1)[first // minibatches : (first + rows) // minibatches]  # [this rank's chunks, M]
    start = torch.arange(order.shape[0])[:, None] * minibatches  # the local row where each chunk starts
    return list((start + order).T)


def uniform_rows(
    seed: int, stream: int, first: int, rows: int, steps: int, device: torch.device, block: int = 1024
) -> torch.Tensor:
    """Rows [first, first + rows) of an unbounded table of uniforms, one per (global row, decode step).  -> [rows, steps]

    The table is drawn in blocks of `block` rows, block b from engine.step_uniforms(seed, b, stream): only the
    blocks these rows touch are drawn, so the memory is in proportion to the rows asked for, not to the table
    (offline DPO's pair sampling over --offline-prompts 1000000), and a row's uniforms depend only on its
    global index: the same samples on one rank or N, chunked one way or another."""
    out = []
    for b in range(first // block, (first + rows - 1) // block + 1 if rows > 0 else first // block):
        u = engine.step_uniforms(seed, b, stream, block, steps, device)  # [block, steps]
        out.append(u[max(first, b * block) - b * block : min(first + rows, (b + 1) * block) - b * block])
    return torch.cat(out) if out else torch.empty(0, steps, dtype=torch.float64, device=device)


def measured_prompts(n: int, measured: int, rank: int, world: int) -> list[int]:
    """Which of this rank's n / world prompts the Monte Carlo measurement takes: `measured` prompts spread
    evenly over the global batch of n (global position j * n // measured), the same ones on one rank or N.
    Returns positions within this rank's share; `measured` must divide by world."""
    lo, _ = shard_range(n, rank, world)
    per = measured // world
    return [j * n // measured - lo for j in range(rank * per, (rank + 1) * per)]


# ======================================================================================================
# Advantage-error metrics: how wrong a baseline is, against Monte Carlo estimates
# ======================================================================================================
#
# The measurement (docs/measurement.md): at each measured state s a baseline predicts b(s); K fresh rollouts from s
# give the Monte Carlo mean p_hat(s) of the return. common.monte_carlo picks the states, runs the rollouts and hands
# (b, p_hat) to common.baseline_error, which scales the baseline's error by the reward's own variance there.


def mc_state_positions(length: int, states: int, seed: int) -> list[tuple[int, float]]:
    """The measured states of one completion of `length` tokens, as (t, weight): t tokens of it already written.

    The prompt state (t = 0, the baseline of the first token) with weight 1, then `states` distinct positions
    drawn uniformly from 1..length-1, each weighted (length - 1) / drawn: the weights sum to `length`, so that
    pooled over completions every token counts once, as in a token-mean loss (with gamma = lambda = 1 the
    advantage of token t is R - V(s_t)). A completion shorter than states + 1 tokens gives all its positions.
    """
    inside = list(range(1, length))
    if len(inside) > states:
        inside = sorted(random.Random(seed).sample(inside, states))
    w = (length - 1) / len(inside) if inside else 0.0
    return [(0, 1.0)] + [(t, w) for t in inside]


@torch.no_grad()
def mc_values(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    prefixes: Sequence[Sequence[int]],
    golds: Sequence[str],
    *,
    task: str,
    k: int,
    max_new_tokens: int,
    uniforms: torch.Tensor,
    temperature: float,
    top_p: float,
    penalty: Any = None,
    buckets: int = 2,
    scores_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, int]:
    """The returns of k fresh rollouts from each state (prompt + response prefix).  -> [N, k], used, generated

    A state whose prefix holds t response tokens has max_new_tokens - t left, as the policy had: its rollouts
    are cut there and only those tokens count (`used`). The states are generated in up to `buckets` batches of
    similar budget, each batch for its largest budget (`generated`: what the engine ran, cut-off tokens too).
    The reward reads the whole completion (prefix + continuation). uniforms: [N * k, >= max_new_tokens].
    penalty(rollout, used_lengths [B]) -> [B]: a shaped part of the return to subtract (PPO's KL in the reward).
    scores_out: [N, k], filled (when given) with the verifier's scores before the penalty: the 0/1 outcome whose
    variance is the reward's own (baseline_error's signal_var).
    """
    n = len(prompts)
    budget = [max_new_tokens - len(x) for x in prefixes]  # [N] tokens each state may still write
    order = sorted(range(n), key=lambda i: -budget[i])
    per = -(-n // max(1, buckets)) if n else 1
    returns = torch.zeros(n, k, dtype=torch.float64)
    used_total = generated = 0
    batches = [order[b0 : b0 + per] for b0 in range(0, n, per)]
    for b in range(max(1, buckets)):  # as many passes on every rank: stop_point is a collective under torchrun
        runtime.stop_point()
        if b >= len(batches):
            continue
        states = batches[b]
        rows = [i * k + j for i in states for j in range(k)]  # rows of the uniform table, k per state
        ro = engine.generate(
            model,
            [list(prompts[i]) + list(prefixes[i]) for i in states for _ in range(k)],
            max_new_tokens=budget[states[0]],
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            uniforms=uniforms[rows],
            temperature=temperature,
            top_p=top_p,
        )
        lengths = ro.lengths.cpu()
        used = torch.tensor([min(int(lengths[r]), budget[states[r // k]]) for r in range(len(rows))])  # [b * k]
        ids = [
            list(prefixes[states[r // k]]) + row[: int(u)]
            for r, (row, u) in enumerate(zip(ro.response_ids.tolist(), used))
        ]
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        scores = torch.tensor(
            score(task, texts, ids, [golds[states[r // k]] for r in range(len(rows))]), dtype=torch.float64
        )
        if scores_out is not None:
            scores_out[torch.tensor(states)] = scores.view(len(states), k).to(scores_out.dtype)
        if penalty is not None:
            scores = scores - penalty(ro, used).double().cpu()
        returns[torch.tensor(states)] = scores.view(len(states), k)
        used_total += int(used.sum())
        generated += int(lengths.sum())
    return returns, used_total, generated


def baseline_error(
    pred: torch.Tensor,
    mc: torch.Tensor,
    k: int,
    groups: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    mc_var: torch.Tensor | None = None,
    signal_var: torch.Tensor | None = None,
) -> dict[str, float]:
    """How wrong a baseline is, on the scale of the reward's own variance, noise-corrected.  [N] x (2-6) -> dict

    pred: the baseline b_i at each measured state i; mc: the mean p_i of K fresh returns there (K = k); groups:
    the prompt of each state; weights w_i (default 1; common.mc_state_positions: token weights); mc_var: the
    unbiased sample variance of the K returns (default, for 0/1 rewards: K/(K-1) p_i (1 - p_i)); signal_var: the
    unbiased sample variance s_i^2 of the K 0/1 scores (default mc_var), which differs from mc_var only when the
    return holds a shaped part (PPO's --kl-mode reward: the KL ahead is not the reward's own variance).
    With e_i = b_i - p_i, the MC noise of state i, Var(p_i) = mc_var_i / K =: v_i, W = sum w, and sums over i:

      nmse          = (sum w e^2 - sum w v) / sum w s^2
                      the baseline's MSE against the true value, over E[Var(R | s)]: the share by which it
                      inflates Var(R - b) over a perfect baseline's (0 perfect). The crossover's x axis. A
                      leave-one-out mean of G rollouts reads 1/(G-1) at the prompt state whatever the success
                      rate; at a state inside the completion, where a share d of the outcome's variance is
                      already resolved, its one constant reads (1/(G-1) + d) / (1 - d) (docs/measurement.md).
      nmse_centred  = (sum w (e - e_bar)^2 - (sum w v - sum w^2 v / W)) / sum w s^2,  e_bar = sum w e / W
                      the same after removing the mean error (what whitening removes); the noise share of a
                      centred MSE is (1 - 1/N) of the noise for equal weights.
      within_nmse   = sum over prompts g of (sum_g w (e - e_bar_g)^2 - (sum_g w v - sum_g w^2 v / W_g)) / sum w s^2
                      after removing each prompt's mean error ((1 - 1/m) of the noise for m equal states).
      bias = e_bar;  rmse = sqrt(max(0, (sum w e^2 - sum w v) / W))
      explained_variance = 1 - (centred error variance) / (variance of the true values), both noise-corrected
      signal_fraction: the share of prompts (of states without groups) whose K returns are not all equal
                      (0 < p < 1 for 0/1 rewards): where a baseline can matter at all.

    Every ratio is of pooled sums, never of roots: the sum_* and count entries let report.py (pool_baseline_errors)
    pool measurements and seeds again. Noise terms assume the K returns of a state are independent of the others'.
    """
    e = (pred.double() - mc.double()).flatten()
    p = mc.double().flatten()
    w = torch.ones_like(e) if weights is None else weights.double().flatten()
    var = p * (1 - p) * k / (k - 1) if mc_var is None else mc_var.double().flatten()  # [N] Var(return | s)
    v = var / k  # [N] Var(p_hat)
    s2 = var if signal_var is None else signal_var.double().flatten()  # [N] Var(R | s) of the 0/1 score, unbiased
    W = w.sum()
    sum_e, sum_e2, sum_v, sum_w2v, sum_s2 = (
        (w * e).sum(),
        (w * e * e).sum(),
        (w * v).sum(),
        (w * w * v).sum(),
        (w * s2).sum(),
    )
    centred = sum_e2 - sum_e**2 / W - (sum_v - sum_w2v / W)
    value_var = (w * p * p).sum() - (w * p).sum() ** 2 / W - (sum_v - sum_w2v / W)
    mixed = s2 > 0
    out = {
        "n": float(e.numel()),
        "weight": W.item(),
        "sum_err": sum_e.item(),
        "sum_sq_err_nc": (sum_e2 - sum_v).item(),
        "sum_centred_sq_nc": centred.item(),
        "sum_signal_var": sum_s2.item(),
        "sum_value_var_nc": value_var.item(),
        "noise_var": (sum_v / W).item(),
        "target_mean": ((w * p).sum() / W).item(),
    }
    if groups is not None:
        _, g = torch.unique(groups.flatten().long(), return_inverse=True)
        m = int(g.max()) + 1
        Wg = torch.zeros(m, dtype=e.dtype).index_add_(0, g, w)
        eg = torch.zeros(m, dtype=e.dtype).index_add_(0, g, w * e) / Wg
        noise_g = (
            torch.zeros(m, dtype=e.dtype).index_add_(0, g, w * v)
            - torch.zeros(m, dtype=e.dtype).index_add_(0, g, w * w * v) / Wg
        )
        out["sum_within_sq_nc"] = ((w * (e - eg[g]) ** 2).sum() - noise_g.sum()).item()
        out["groups"] = float(m)
        out["signal_groups"] = float(torch.zeros(m, dtype=e.dtype).index_add_(0, g, mixed.double()).gt(0).sum())
    else:
        out["groups"], out["signal_groups"] = float(e.numel()), float(mixed.sum())
    out.update(baseline_error_ratios(out))
    return out


# The states baseline_error_by_state scores apart from all of them: "" (every state, token-weighted), "_prompt"
# (t = 0: what GRPO's group mean estimates) and "_inside" (t > 0, token-weighted). metrics.jsonl: mc/<name><part>/<key>.
STATE_PARTS = ("", "_prompt", "_inside")


def baseline_error_by_state(
    pred: torch.Tensor,
    mc: torch.Tensor,
    k: int,
    t: torch.Tensor,
    groups: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    mc_var: torch.Tensor | None = None,
    signal_var: torch.Tensor | None = None,
) -> dict[str, dict[str, float]]:
    """baseline_error over every state, over the prompt states (t = 0) and over the states inside (t > 0), keyed by
    STATE_PARTS.  [N] x (4-8) -> {part: dict}; a part with no state is left out.

    Why apart: GRPO's baseline is one constant per completion, a Monte Carlo estimate of the prompt's value. At the
    prompt its leave-one-out mean of G reads nmse = 1/(G-1) whatever p: noise. Inside, it cannot follow V(s_t):
    with d the share of the outcome's variance resolved by s_t, it reads (1/(G-1) + d) / (1 - d): a baseline that
    does not track the value, not a noisier one. A critic is "less noisy" than the group at the prompt, and
    "tracks the value better" inside."""
    t = t.flatten()
    out = {}
    for part, keep in (("", None), ("_prompt", t == 0), ("_inside", t > 0)):
        if keep is not None and not bool(keep.any()):
            continue
        xs = [
            x if x is None or keep is None else x.flatten()[keep]
            for x in (pred, mc, groups, weights, mc_var, signal_var)
        ]
        out[part] = baseline_error(xs[0], xs[1], k, *xs[2:])
    return out


def baseline_error_ratios(sums: dict[str, float]) -> dict[str, float]:
    """nmse, nmse_centred, within_nmse, bias, rmse, explained_variance, signal_fraction from baseline_error's sums."""
    nan = float("nan")
    W, S = sums.get("weight", 0.0), sums.get("sum_signal_var", 0.0)
    out = {
        "nmse": sums["sum_sq_err_nc"] / S if S > 0 else nan,
        "nmse_centred": sums["sum_centred_sq_nc"] / S if S > 0 else nan,
        "within_nmse": sums["sum_within_sq_nc"] / S if S > 0 and "sum_within_sq_nc" in sums else nan,
        "bias": sums["sum_err"] / W if W > 0 else nan,
        "rmse": math.sqrt(max(0.0, sums["sum_sq_err_nc"] / W)) if W > 0 else nan,
        "explained_variance": 1 - sums["sum_centred_sq_nc"] / sums["sum_value_var_nc"]
        if sums.get("sum_value_var_nc", 0.0) > 0
        else nan,
        "signal_fraction": sums["signal_groups"] / sums["groups"] if sums.get("groups", 0.0) > 0 else nan,
    }
    return out


POOLED_SUMS = (
    "n", "weight", "sum_err", "sum_sq_err_nc", "sum_centred_sq_nc", "sum_signal_var", "sum_value_var_nc",
    "sum_within_sq_nc", "groups", "signal_groups",
)  # fmt: skip


def pool_baseline_errors(measurements: Sequence[dict[str, float]]) -> dict[str, float]:
    """Several baseline_error results (measurements, seeds) as one: their sums added, then the ratios.

    The centred and within-prompt sums stay centred per measurement (whitening acts on each batch apart).
    A sum missing from any measurement (within_nmse without groups) is left out."""
    measurements = [m for m in measurements if m]
    if not measurements:
        return {}
    sums = {key: sum(float(m[key]) for m in measurements) for key in POOLED_SUMS if all(key in m for m in measurements)}
    sums["measurements"] = float(len(measurements))
    return {**sums, **baseline_error_ratios(sums)}


def check_measurement(args: Any, world: int) -> None:
    """The Monte Carlo flags of ppo.py and grpo.py, checked before anything loads (a UserError, one line): K of at
    least 2 (the noise correction divides by K - 1), the measured prompts a positive multiple of the world size and
    at most the batch; --mc-states above a completion's T - 1 inside states is clamped, with a note."""
    if not args.mc_every:
        return
    if args.mc_samples < 2:
        raise runtime.UserError(
            f"--mc-samples {args.mc_samples} must be at least 2 (the noise correction divides by K - 1)"
        )
    runtime.check_range("mc_prompts", args.mc_prompts, 0, low_open=True, what="positive")
    runtime.check_divides("--mc-prompts", args.mc_prompts, world, "the world size")
    if args.mc_prompts > args.batch_size:
        raise runtime.UserError(f"--mc-prompts {args.mc_prompts} exceeds --batch-size {args.batch_size}")
    inside = max(0, args.max_new_tokens - 1)
    if args.mc_states > inside:
        runtime._notice_once(
            f"--mc-states {args.mc_states} exceeds the {inside} states inside a completion of --max-new-tokens "
            f"{args.max_new_tokens}: clamped to {inside}"
        )
        args.mc_states = inside


@torch.no_grad()
@runtime.stoppable("the Monte Carlo measurement")  # a stop signal ends the run within a decode step
def monte_carlo(
    model: nn.Module,
    tokenizer: Any,
    *,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    golds: Sequence[str],
    groups: Sequence[int],
    row_ids: Sequence[int],
    baselines: dict[str, torch.Tensor],
    states: int,
    k: int,
    max_new_tokens: int,
    seed: int,
    step: int,
    task: str,
    temperature: float,
    top_p: float,
    penalty: Any = None,
) -> tuple[dict[str, float], int]:
    """The shared Monte Carlo measurement of baselines at token-weighted states of this rank's measured completions.

    prompts, responses, golds, groups (prompt ids), row_ids (global row of each completion: seeds its states):
    the measured completions on this rank. baselines: name -> [R, >= T] the baseline's value at each state t of
    each completion (PPO: its critic's V(s_t); GRPO: the group's mean at every t). Per completion the states of
    mc_state_positions (the prompt, and `states` positions inside); k rollouts from each (mc_values, stream 1 of
    the step's uniforms, indexed by the state's global place); everything gathered over ranks, then baseline_error
    per baseline, over every state and over the prompt states and the states inside apart (baseline_error_by_state;
    nmse's denominator and signal_fraction from the 0/1 scores, before any penalty). Returns {"<name><part>/<key>":
    ...} (part: STATE_PARTS) plus states, informative_states (those whose K 0/1 scores are not all equal: where a
    baseline can matter; report.py warns when a run has few) and tokens, and the MC tokens used on all ranks.
    k is at least 2 (check_measurement refuses less before anything loads).
    """
    picked = [
        (i, t, w)
        for i, (resp, rid) in enumerate(zip(responses, row_ids))
        for t, w in mc_state_positions(len(resp), states, seed * 1_000_003 + step * 7_919 + int(rid))
    ]
    counts = runtime.all_gather_objects(len(picked))
    rank = dist.get_rank() if runtime.world_size() > 1 else 0
    first, total = sum(counts[:rank]), sum(counts)
    u = engine.step_uniforms(seed, step, 1, total * k, max_new_tokens, torch.device("cpu"))[
        first * k : (first + len(picked)) * k
    ]
    scores = torch.zeros(len(picked), k, dtype=torch.float64)  # [S, k] the 0/1 scores, before any penalty
    returns, used, generated = mc_values(
        model,
        tokenizer,
        [prompts[i] for i, _, _ in picked],
        [list(responses[i][:t]) for i, t, _ in picked],
        [golds[i] for i, _, _ in picked],
        task=task,
        k=k,
        max_new_tokens=max_new_tokens,
        uniforms=u.to(next(runtime.unwrap(model).parameters()).device),
        temperature=temperature,
        top_p=top_p,
        penalty=penalty,
        scores_out=scores,
    )
    i_idx, t_idx = torch.tensor([i for i, _, _ in picked]), torch.tensor([t for _, t, _ in picked])
    local = {
        "mc": returns.mean(-1),
        "var": returns.var(-1, unbiased=True),
        "signal_var": scores.var(-1, unbiased=True),  # the reward's own variance: the 0/1 score's, without the KL
        "t": t_idx,
        "w": torch.tensor([w for _, _, w in picked], dtype=torch.float64),
        "group": torch.tensor([int(groups[i]) for i, _, _ in picked]),
        **{f"b/{name}": b.detach().double().cpu()[i_idx, t_idx] for name, b in baselines.items()},
    }
    cat = {key: torch.cat([g[key] for g in runtime.all_gather_objects(local)]) for key in local}
    out: dict[str, float] = {}
    for name in baselines:  # every state, then the prompt states and the states inside apart (STATE_PARTS)
        parts = baseline_error_by_state(
            cat[f"b/{name}"], cat["mc"], k, cat["t"], cat["group"], cat["w"], cat["var"], cat["signal_var"]
        )
        out.update({f"{name}{part}/{key}": v for part, err in parts.items() for key, v in err.items()})
    tokens = runtime.all_reduce_sum(torch.tensor([float(used), float(generated)], dtype=torch.float64)).tolist()
    out["states"], out["tokens"], out["tokens_generated"] = float(total), tokens[0], tokens[1]
    out["informative_states"] = float((cat["signal_var"] > 0).sum())  # states whose K 0/1 scores differ
    return out, int(tokens[0])


def explained_variance_masked(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over mask == 1 on all ranks, as CleanRL logs it.  [B, T] x3 -> float"""
    var_r = masked_var(returns, mask, global_=True)
    var_e = masked_var(returns - values, mask, global_=True)
    return (1 - var_e / var_r).item() if var_r > 0 else float("nan")


# ======================================================================================================
# Evaluation: greedy, on the validation split during training and the test split at the end
# ======================================================================================================


def ratio(total: float, n: float) -> float | None:
    """total / n, or None over zero items: a statistic of nothing is absent (null in JSON), never 0.0."""
    return total / n if n else None


def wilson_interval(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval for k successes in n trials."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


@functools.lru_cache(maxsize=256)
def t_quantile(q: float, dof: int) -> float:
    """The q quantile of Student's t with dof degrees of freedom (q in (0.5, 1)): bisection on its CDF, the
    density integrated by Simpson's rule. t_quantile(0.975, 2) = 4.303, (0.975, 29) = 2.045."""
    if dof < 1 or not 0.5 < q < 1:
        raise ValueError(f"t_quantile needs dof >= 1 and 0.5 < q < 1, got {q}, {dof}")
    log_c = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)

    def cdf(x: float, n: int = 2000) -> float:  # P(T <= x) for x >= 0
        h = x / n
        f = [math.exp(log_c - (dof + 1) / 2 * math.log1p((i * h) ** 2 / dof)) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < q:
        lo, hi = hi, 2 * hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return (lo + hi) / 2


def mean_interval(values: Sequence[float], z: float | None = None) -> tuple[float, float, float]:
    """Mean and a 95% interval of a list of numbers (across seeds, say): mean +- t sd / sqrt(n), with t the 0.975
    quantile of Student's t with n - 1 degrees of freedom (4.30 for 3 seeds; a normal 1.96 there covers ~81%).
    z overrides the quantile.

    One number has no spread to estimate: its interval is (nan, nan), not a zero-width interval that would
    look certain; so are numbers that all agree (three seeds at 0% accuracy): they say the spread is small, not
    that it is zero, and the interval needs more of them. No numbers: all three are nan.
    """
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    m = sum(values) / n
    if n < 2:
        return m, math.nan, math.nan
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    if sd == 0:
        return m, math.nan, math.nan
    q = t_quantile(0.975, n - 1) if z is None else z
    return m, m - q * sd / math.sqrt(n), m + q * sd / math.sqrt(n)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """Mean of a - b over paired items (the same test problems) and its 95% t interval.  [n], [n] -> 3 floats"""
    if len(a) != len(b):
        raise ValueError(f"paired_difference needs equal lengths, got {len(a)} and {len(b)}")
    return mean_interval([float(x) - float(y) for x, y in zip(a, b)])


def paired_seed_difference(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> tuple[float, float, float]:
    """The difference in accuracy of two methods on the same test problems over seeds, and its 95% interval.
    a[s][i], b[s][i]: seed s's 0/1 result on test problem i (the same n problems for every seed) -> mean, lo, hi

    Seeds differ by more than problem-level noise (a run-level effect: one seed's policy is simply better), so the
    interval is the t interval over the per-seed paired differences d_s = mean_i (a[s][i] - b[s][i]), with S - 1
    degrees of freedom (t = 4.30 for 3 seeds: wide, and honest). Pooling the problems of all seeds into one paired
    t interval ignores that variance (in simulation its 95% interval covered 44-73%).
    One seed: its problems' paired t interval (common.paired_difference), which knows nothing of other seeds.
    Seeds (or, with one seed, problems) that all agree give (mean, nan, nan): no interval rather than a certain one.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_seed_difference needs the same seeds, at least one, got {len(a)} and {len(b)}")
    n = {len(x) for x in (*a, *b)}
    if len(n) != 1 or n == {0}:
        raise ValueError(f"paired_seed_difference needs the same test problems in every seed, got sizes {sorted(n)}")
    if len(a) == 1:
        return paired_difference(a[0], b[0])
    return mean_interval([sum(float(x) - float(y) for x, y in zip(xs, ys)) / len(xs) for xs, ys in zip(a, b)])


def ratio_interval(nums: Sequence[float], dens: Sequence[float]) -> tuple[float, float, float]:
    """A pooled ratio sum(nums) / sum(dens) and its 95% interval, with clusters (seeds) as the units.  [S], [S] -> 3

    The linearised (delta-method) interval of a ratio estimator: R = sum N / sum D, residuals z_s = (N_s - R D_s)
    / mean(D), R +- t(0.975, S - 1) sd(z) / sqrt(S). Centred on the pooled value that the report prints (a t
    interval over per-seed ratios is centred on their mean, not on it) and carrying the clusters' variance:
    with one cluster per seed, the seed-to-seed variance (tests/test_stats.py: coverage near 95% with a run-level
    effect and skewed per-seed ratios, where the t interval over per-seed ratios under-covers). Fewer than two
    clusters, a non-positive denominator or residuals that all agree: (R, nan, nan).
    """
    if len(nums) != len(dens):
        raise ValueError(f"ratio_interval needs as many numerators as denominators, got {len(nums)}, {len(dens)}")
    S, num, den = len(nums), float(sum(nums)), float(sum(dens))
    if S == 0 or den <= 0:
        return math.nan, math.nan, math.nan
    r = num / den
    if S < 2:
        return r, math.nan, math.nan
    z = [(float(n) - r * float(d)) / (den / S) for n, d in zip(nums, dens)]  # [S], mean 0
    sd = math.sqrt(sum(x * x for x in z) / (S - 1))
    if sd == 0:
        return r, math.nan, math.nan
    half = t_quantile(0.975, S - 1) * sd / math.sqrt(S)
    return r, r - half, r + half


@torch.no_grad()
@runtime.stoppable("an evaluation")  # a stop signal ends the run within a decode step
def evaluate(
    model: nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    task: str,
    prompt_format: str,
    max_new_tokens: int,
    batch_size: int,
    desc: str = "eval",
    show_progress: bool = True,
    backend: str = "auto",
) -> dict[str, Any]:
    """Greedy accuracy with a 95% Wilson interval, and each problem's reward ("correct", in order). Under torchrun
    each rank takes a share; totals are summed.

    backend: as in engine.generate ("auto": the static engine on a GPU, transformers' generation on the CPU)."""
    from tqdm.auto import tqdm

    rank, world = (dist.get_rank(), dist.get_world_size()) if runtime.world_size() > 1 else (0, 1)
    mine = list(range(rank, len(problems), world))
    correct = tokens = formatted = 0.0
    samples, per_problem = [], []
    t0 = time.time()
    bar = tqdm(total=len(mine), desc=desc, leave=False, disable=not show_progress or rank != 0)
    most = -(-len(problems) // world)  # rank 0's share, the largest: every rank passes as many stop points
    for i in range(0, most, batch_size):
        runtime.stop_point()  # under torchrun a collective: a signal that reached one rank stops them all here
        if i >= len(mine):
            continue
        batch = [problems[j] for j in mine[i : i + batch_size]]
        prompts = [encode_prompt(tokenizer, p.question, prompt_format) for p in batch]
        ro = engine.generate(
            model,
            prompts,
            max_new_tokens=max_new_tokens,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            backend=backend,
        )
        texts, ids = engine.decode_responses(tokenizer, ro)
        rewards = score(task, texts, ids, [p.gold for p in batch])
        correct += sum(rewards)
        per_problem += [(j, r) for j, r in zip(mine[i : i + batch_size], rewards)]
        tokens += ro.lengths.sum().item()
        formatted += sum(extract_final_answer(t) is not None for t in texts)
        if len(samples) < 3:
            samples += [
                (j, {"question": p.question, "completion": t, "gold": p.gold, "reward": r})
                for j, p, t, r in zip(mine[i : i + batch_size], batch, texts, rewards)
            ][: 3 - len(samples)]
        bar.update(len(batch))
    bar.close()
    totals = runtime.all_reduce_sum(torch.tensor([correct, tokens, formatted, float(len(mine))], dtype=torch.float64))
    gathered = sorted((js for part in runtime.all_gather_objects(samples) for js in part), key=lambda js: js[0])
    samples = [s for _, s in gathered[:3]]  # the first three problems, whichever ranks evaluated them
    correct_each = [r for _, r in sorted(jr for part in runtime.all_gather_objects(per_problem) for jr in part)]
    correct, tokens, formatted, n = totals.tolist()
    n = int(n)
    lo, hi = wilson_interval(correct, n)
    return {
        "accuracy": ratio(correct, n),  # None over zero problems: absent, never 0.0
        "ci95": [lo, hi] if n else [None, None],
        "n": n,
        "format_rate": ratio(formatted, n),
        "mean_tokens": ratio(tokens, n),
        "generated_tokens": int(tokens),
        "seconds": time.time() - t0,
        "samples": samples,
        "correct": correct_each,  # per problem, in the split's order: a paired comparison of methods reads it
    }


def eval_metrics(split: str, res: dict[str, Any]) -> dict[str, float]:
    """The metrics.jsonl keys of one evaluation: accuracy with its 95% interval, format rate, seconds. Those of
    an evaluation of zero problems are absent (None), never 0.0."""
    row = {
        f"{split}/accuracy": res["accuracy"],
        f"{split}/ci_low": res["ci95"][0],
        f"{split}/ci_high": res["ci95"][1],
        f"{split}/format_rate": res["format_rate"],
        f"{split}/seconds": res["seconds"],
    }
    return {k: v for k, v in row.items() if v is not None}
