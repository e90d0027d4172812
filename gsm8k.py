"""GSM8K, the task: its data, the prompt, the reward, and greedy evaluation with its interval.

Holds: GSM8K's files read and checked (a fixed validation split carved out of train, a fingerprint of each split
for resume), the prompt sampler (the run's data order), the reference solutions (gold-pair DPO), the one prompt
builder that training and evaluation share (the chat template), the strict reward (a marked final answer, "#### N"
or \\boxed{N}, never the last number) and the toy task of the learning tests, and evaluate(): greedy accuracy with
its Wilson interval, per problem.
Does not hold: losses (common.py), the Monte Carlo measurement (measure.py), intervals over seeds (intervals.py),
generation itself (plumbing/generation.py). Imports intervals.py and the plumbing, never a trainer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import intervals
from plumbing import distributed, errors, generation, models, rollout, runtime

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
        raise errors.UserError(f"{path} is not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise errors.UserError(f"cannot read {path}: {e.strerror or e}") from None


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
            raise errors.UserError(f"{path}:{lineno}: malformed GSM8K line ({type(e).__name__}: {e})") from None
        gold = extract_final_answer(solution)
        if gold is None:
            raise errors.UserError(f"{path}:{lineno}: the answer has no final '#### N' number")
        check_question_length(question, f"{path}:{lineno}")
        problems.append(Problem(question, solution, gold, f"{path}:{lineno}"))
    return problems


def check_question_length(question: str, where: str) -> None:
    if len(question) > MAX_QUESTION_CHARS:
        raise errors.UserError(
            f"{where}: a question of {len(question):,} characters, over the limit of {MAX_QUESTION_CHARS:,} "
            "(gsm8k.MAX_QUESTION_CHARS; GSM8K's longest is 985): remove or shorten that line"
        )


def check_prompt_lengths(
    splits: dict[str, list[Problem]], tokenizer: Any, prompt_format: str, model: str, max_new_tokens: int
) -> int:
    """The longest prompt of every split, in tokens (the few longest questions by UTF-8 bytes tokenised: a byte
    -level tokenizer never gives more tokens than bytes). A prompt that with max_new_tokens exceeds the model's
    context is refused naming its file and line; the memory estimate made before loading is made again with
    the longest prompt in place of models.PROMPT_TOKENS. The organism's prompts are checked first
    (check_organism_reading). Returns the longest prompt's length."""
    if models.is_organism(model):
        check_organism_reading(splits, tokenizer, prompt_format, models.organism_info(model))
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
        raise errors.UserError(
            f"{where}: a prompt of {longest:,} tokens, which with {max_new_tokens} new tokens exceeds the model's "
            f"context of {context:,}: remove or shorten that line"
        )
    models.recheck_generation_memory(longest)
    return longest


def check_organism_reading(
    splits: dict[str, list[Problem]], tokenizer: Any, prompt_format: str, info: dict[str, Any]
) -> None:
    """The organism reads the run's prompts as it was trained to, or the run is refused in one line: the question
    alone through its chat template (--prompt-format question), the characters of its own task (check_alphabet),
    and the tokenizer loaded giving the ids its build recorded for a question (info: its organism.json; a record
    without "prompt", an older build's, skips that check)."""
    models.check_organism_prompt(prompt_format)
    check_alphabet(splits, set(info["alphabet"]))
    if "prompt" in info:
        question, ids = info["prompt"]["question"], info["prompt"]["ids"]
        if (got := encode_prompt(tokenizer, question, "question")) != ids:
            at = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
            raise errors.UserError(
                f"the tokenizer loaded does not read as the organism was trained: its prompt of {question!r} has ids "
                f"{got[at : at + 4]} from position {at}, where the build recorded {ids[at : at + 4]}: the installed "
                "transformers or tokenizers reads its tokenizer otherwise than the ones that built it (requirements.txt)"
            )


def check_alphabet(splits: dict[str, list[Problem]], alphabet: set[str]) -> None:
    """The organism knows only the characters of its own task (its other bytes' embeddings were never trained):
    a question or answer with any other character is refused in one line, naming its file and line."""
    for problems in splits.values():
        for p in problems:
            if outside := set(p.question + p.solution) - alphabet:
                raise errors.UserError(
                    f"{p.source}: {''.join(sorted(outside))[:20]!r} outside the organism's vocabulary (the characters "
                    f"of its own task, {''.join(sorted(alphabet))!r}): the organism reads its own problems; drop "
                    "--data-dir, or give another --model"
                )


def resolve_data_dir(data_dir: str | None, model: str = "") -> str | None:
    """--data-dir, else the organism's own task for --model organism (GSM8K_DIR names GSM8K's folder, not the
    organism's), else $GSM8K_DIR, else None (the hub id openai/gsm8k through `datasets`)."""
    if data_dir:
        return data_dir
    if models.is_organism(model):
        return str(models.organism_folder(model) / "data")
    return os.environ.get("GSM8K_DIR") or None


def load_gsm8k(
    data_dir: str | None, val_size: int = 500, val_seed: int = 0, model: str = ""
) -> dict[str, list[Problem]]:
    """GSM8K (or a task in its files) as {"train", "val", "test"}. val is a fixed, seeded sample of train, removed
    from train. model: the run's --model (the organism reads its own task unless data_dir says otherwise)."""
    data_dir = resolve_data_dir(data_dir, model)
    if data_dir is not None:
        root = Path(data_dir)
        if not root.is_dir():
            raise errors.UserError(f"GSM8K folder {root} does not exist (set --data-dir or GSM8K_DIR)")
        splits = {}
        for split in ("train", "test"):
            path = root / f"{split}.jsonl"
            if not path.is_file():
                raise errors.UserError(f"{path} is missing: the GSM8K folder must hold train.jsonl and test.jsonl")
            splits[split] = _read_jsonl(path)
    else:
        splits = _load_gsm8k_hub()
    for split, rows in splits.items():
        if not rows:
            raise errors.UserError(f"the GSM8K {split} split is empty")
    if not 0 <= val_size < len(splits["train"]):
        n = len(splits["train"])
        raise errors.UserError(f"--val-size {val_size}: must be from 0 to {n - 1} (the train split holds {n} problems)")
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


def data_record(data_dir: str | None, splits: dict[str, list[Problem]], model: str = "") -> dict[str, Any]:
    """results.json's and the checkpoint's "data": the folder actually read (--data-dir, else $GSM8K_DIR,
    resolved to an absolute path; "hub:openai/gsm8k" without one) and data_fingerprint. args.data_dir is left as
    given, so that a resume compares the flags the user passed."""
    folder = resolve_data_dir(data_dir, model)
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
        raise errors.UserError(
            f"--resume on different data: the {', '.join(changed)} split{'s' if len(changed) > 1 else ''} changed "
            f"({shown}; {where}); restore the data, or pass --allow-data-change if the change is meant"
        )
    return f"note: --allow-data-change: resuming on changed data ({shown}); the new fingerprint is recorded"


def _load_gsm8k_hub() -> dict[str, list[Problem]]:
    """openai/gsm8k through `datasets`: from the hub; while the hub cannot be reached (models.hub_unreachable), from
    datasets' cache alone, at once (its offline mode: no request, so none of the libraries' retries); in neither, one
    line naming the way out."""
    offline = models.hub_unreachable()
    try:
        import datasets

        with _datasets_offline(offline is not None):
            ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as e:  # offline and not cached, the hub's refusal, or no datasets
        if offline is not None and not isinstance(e, ImportError):
            raise errors.UserError(
                f"GSM8K: openai/gsm8k is not cached and the hub cannot be reached ({offline}); use --data-dir DIR "
                "or GSM8K_DIR=DIR, a folder with train.jsonl and test.jsonl"
            ) from None
        raise errors.UserError(
            f"no GSM8K folder given (--data-dir DIR or GSM8K_DIR=DIR, a folder with train.jsonl and test.jsonl) and "
            f"the hub copy could not be read: {type(e).__name__}"
        ) from None
    out = {}
    for split in ("train", "test"):
        rows = []
        for i, row in enumerate(ds[split]):
            gold = extract_final_answer(row["answer"])
            if gold is None:
                raise errors.UserError(f"openai/gsm8k {split} row {i}: the answer has no final '#### N' number")
            check_question_length(row["question"], f"openai/gsm8k {split} row {i}")
            rows.append(Problem(row["question"], row["answer"], gold, f"openai/gsm8k {split} row {i}"))
        out[split] = rows
    return out


@contextlib.contextmanager
def _datasets_offline(on: bool) -> Iterator[None]:
    """With on: datasets and huggingface_hub in their offline mode (HF_HUB_OFFLINE=1) for the calls inside, and
    datasets' warnings ("Using the latest cached version ...") silenced; all as they were after. Both libraries read
    HF_HUB_OFFLINE once, when imported: huggingface_hub's maintainers give its constant as the way to change it at
    run time (huggingface/transformers#42308), and datasets keeps its own copy (datasets.config)."""
    if not on:
        yield
        return
    import datasets
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.logging.get_verbosity()
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved[:2]
        datasets.logging.set_verbosity(saved[2])


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
            raise errors.UserError(
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
    """Token ids of the prompt for one problem. The only prompt builder: training and evaluation call it.
    chat: the question and the instruction through the chat template; question: the question alone through it (the
    organism, which learned the answer's format in its fine-tuning); plain: "Question: ... Answer:"."""
    content = question.strip() if prompt_format == "question" else prompt_text(question)
    if prompt_format in ("chat", "question"):
        if not getattr(tokenizer, "chat_template", None):
            raise errors.UserError(
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
    raise errors.UserError(f"unknown --prompt-format {prompt_format!r}: use chat, question or plain")


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


def score(task: str, texts: Sequence[str], token_ids: Sequence[Sequence[int]], golds: Sequence[str]) -> list[float]:
    """The one reward every trainer calls: gsm8k_reward on the text, or the toy task on the token ids."""
    if task == "gsm8k":
        return [gsm8k_reward(t, g) for t, g in zip(texts, golds)]
    if task == "toy":
        return [toy_reward(ids) for ids in token_ids]
    raise errors.UserError(f"unknown --task {task!r}: use gsm8k or toy")


# ======================================================================================================


# ======================================================================================================
# Evaluation: greedy, on the validation split during training and the test split at the end
# ======================================================================================================


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

    backend: as in generation.generate ("auto": the static engine on a GPU, transformers' generation on the CPU)."""
    from tqdm.auto import tqdm

    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed.world_size() > 1 else (0, 1)
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
        ro = generation.generate(
            model,
            prompts,
            max_new_tokens=max_new_tokens,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            backend=backend,
        )
        texts, ids = rollout.decode_responses(tokenizer, ro)
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
    totals = distributed.all_reduce_sum(
        torch.tensor([correct, tokens, formatted, float(len(mine))], dtype=torch.float64)
    )
    gathered = sorted((js for part in distributed.all_gather_objects(samples) for js in part), key=lambda js: js[0])
    samples = [s for _, s in gathered[:3]]  # the first three problems, whichever ranks evaluated them
    correct_each = [r for _, r in sorted(jr for part in distributed.all_gather_objects(per_problem) for jr in part)]
    correct, tokens, formatted, n = totals.tolist()
    n = int(n)
    lo, hi = intervals.wilson_interval(correct, n)
    return {
        "accuracy": intervals.ratio(correct, n),  # None over zero problems: absent, never 0.0
        "ci95": [lo, hi] if n else [None, None],
        "n": n,
        "format_rate": intervals.ratio(formatted, n),
        "mean_tokens": intervals.ratio(tokens, n),
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
