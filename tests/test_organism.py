"""The model organism (organism.py): its task in GSM8K's files, its tokenizer, its fine-tuning, the folder it writes,
the build the repository ships (organism-seed0/), and how the trainers find it (--model organism: plumbing/models.py
copies it into the cache, or builds one).

A seconds-long organism (a 1-layer model, a few hundred problems, one check) is built once for the module; the
tests that need the real one (learning, the main job) are in the slow lane."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, check_one_error_line, run_here

import gsm8k
import intervals
import organism
from plumbing import errors, forward, generation, models, rollout

# a seconds-long build: its numbers mean nothing, its files are the real ones' shape
TINY_FLAGS = dict(
    hidden=32, layers=1, heads=2, intermediate=64, train_size=300, test_size=100, eval_problems=32, eval_every=20,
    target_accuracy=0, batch_size=16, warmup_steps=5, samples=2, report_problems=16,
)  # fmt: skip


def flags(**kw) -> list[str]:
    out = []
    for k, v in kw.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("organism") / "org"
    proc = run_here("organism.py", [*flags(out=out, **TINY_FLAGS), "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    return out


# ------------------------------------------------------------------------------------------------------
# 1. the task
# ------------------------------------------------------------------------------------------------------


def test_same_seed_same_problems_and_another_seed_others():
    args = organism.Args(**TINY_FLAGS)
    a, b = organism.make_splits(args), organism.make_splits(args)
    assert a[0] == b[0] and a[1] == b[1]
    assert [next(a[2]) for _ in range(50)] == [next(b[2]) for _ in range(50)]
    other = organism.make_splits(organism.Args(**TINY_FLAGS, seed=1))
    assert other[1] != a[1]


def test_the_splits_and_the_stream_are_disjoint():
    args = organism.Args(**TINY_FLAGS)
    train, test, stream = organism.make_splits(args)
    train_q, test_q = {q for q, _ in train}, {q for q, _ in test}
    assert len(train_q) == len(train) and len(test_q) == len(test)  # no problem twice
    assert not train_q & test_q
    sft = {next(stream)[0] for _ in range(5000)}
    assert not sft & (train_q | test_q)


def test_answers_are_written_as_gsm8k_writes_them_and_each_step_is_right():
    args = organism.Args(**TINY_FLAGS, seed=3)
    rng = random.Random(0)
    for _ in range(500):
        q, a = organism.make_problem(rng, args)
        assert q.startswith("What is ") and q.endswith("?")
        *steps, last = a.split("\n")
        assert args.min_ops <= len(steps) <= args.max_ops and last.startswith("#### ")
        value = None
        for line in steps:  # "a op b = c", each c the next line's a
            x, op, y, eq, z = line.split()
            assert eq == "=" and int(z) == (int(x) + int(y) if op == "+" else int(x) - int(y)) and int(z) >= 0
            assert value is None or int(x) == value
            value = int(z)
        assert last == f"#### {value}"
        assert " ".join(q[len("What is ") : -1].split()) == " ".join([steps[0].split()[0]] + [
            w for line in steps for w in line.split()[1:3]
        ])  # fmt: skip


def test_every_gold_answer_scores_one_and_a_wrong_final_number_zero(built):
    data = gsm8k.load_gsm8k(str(built / "data"), val_size=50)
    problems = data["train"] + data["val"] + data["test"]
    assert len(data["test"]) == TINY_FLAGS["test_size"] and len(data["train"]) + len(data["val"]) == 300
    for p in problems:
        assert gsm8k.gsm8k_reward(gsm8k.reference_solution(p), p.gold) == 1.0
        assert gsm8k.gsm8k_reward(p.solution, p.gold) == 1.0
        head = p.solution.rpartition("####")[0]
        assert gsm8k.gsm8k_reward(f"{head}#### {int(p.gold) + 1}", p.gold) == 0.0


@pytest.mark.parametrize(
    "bad, says",
    [
        (dict(min_ops=3, max_ops=2), "--max-ops 2 must be at least --min-ops 3"),
        (dict(max_number=3), "too few for the"),
        (dict(target_accuracy=1.5), "--target-accuracy"),
        (dict(hidden=30, heads=4), "--hidden 30 must be a multiple of --heads 4"),
    ],
)
def test_a_bad_knob_is_one_error_line_before_anything_is_written(tmp_path, bad, says):
    out = tmp_path / "org"
    proc = run_here("organism.py", flags(out=out, **{**TINY_FLAGS, **bad}))
    assert proc.returncode == 2
    assert says in check_one_error_line(proc)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_refused(built):
    proc = run_here("organism.py", flags(out=built, **TINY_FLAGS))
    assert proc.returncode == 2 and "exists" in check_one_error_line(proc)


# ------------------------------------------------------------------------------------------------------
# 2. the tokenizer
# ------------------------------------------------------------------------------------------------------


def test_token_ids_survive_saving_and_loading_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = organism.make_tokenizer()
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["What is 19 + 30 - 7?", "19 + 30 = 49\n49 - 7 = 42\n#### 42", "  two  spaces\n\nand lines ",
             "<|user|>What is 1 + 2?<|im_end|><|assistant|>1 + 2 = 3\n#### 3<|im_end|>", "é ü 字"]  # fmt: skip
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert again.encode(text, add_special_tokens=False) == ids
        assert again.decode(ids) == text
    assert len(tok.encode("a b + 1\n2", add_special_tokens=False)) == 9  # a token per byte: spaces and newlines kept
    specials = [organism.PAD, organism.END, organism.USER, organism.ASSISTANT, organism.SYSTEM]
    assert [again.convert_tokens_to_ids(s) for s in specials] == list(range(256, 261))
    assert again.eos_token == organism.END and again.pad_token == organism.PAD
    assert again.padding_side == "left"  # plain transformers' batched generate needs it, and reads it from the folder


def test_the_prompt_ids_are_plain_apply_chat_template_of_the_question(built):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(built / "model")
    project = models.load_tokenizer(str(built / "model"))
    for q in ["What is 3 + 4 - 1?", "What is 40 - 40 + 0?"]:
        ids = plain.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert gsm8k.encode_prompt(project, q, "question") == list(ids)
        assert plain.decode(ids) == f"<|user|>{q}<|im_end|><|assistant|>"


def reading_case() -> tuple[dict, object, dict]:
    """Splits of the organism's task, its tokenizer, and the record of the prompt it reads (organism.json's)."""
    tok = organism.make_tokenizer()
    train, test, _ = organism.make_splits(organism.Args(**TINY_FLAGS))
    splits = {"train": organism.as_problems(train[:20]), "test": organism.as_problems(test[:20])}
    q, alphabet = test[0][0], "".join(sorted(set("".join(q + a for q, a in train + test))))
    info = {"alphabet": alphabet, "prompt": {"question": q, "ids": gsm8k.encode_prompt(tok, q, "question")}}
    return splits, tok, info


def test_the_organism_reads_its_prompts_as_recorded_and_an_older_record_skips_the_ids():
    splits, tok, info = reading_case()
    gsm8k.check_organism_reading(splits, tok, "question", info)
    gsm8k.check_organism_reading(splits, tok, "question", {"alphabet": info["alphabet"]})  # an older build's record


@pytest.mark.parametrize("prompt_format", ["chat", "plain"])
def test_the_organism_refuses_a_prompt_format_other_than_the_question_alone(prompt_format):
    splits, tok, info = reading_case()
    with pytest.raises(errors.UserError, match=f"--prompt-format {prompt_format}: the organism learned the question"):
        gsm8k.check_organism_reading(splits, tok, prompt_format, info)


def test_the_organism_refuses_a_tokenizer_that_reads_otherwise_and_data_outside_its_alphabet():
    splits, tok, info = reading_case()
    ids = info["prompt"]["ids"]
    other = {**info, "prompt": {**info["prompt"], "ids": ids[:5] + [ids[5] + 1] + ids[6:]}}
    with pytest.raises(errors.UserError, match="does not read as the organism was trained") as e:
        gsm8k.check_organism_reading(splits, tok, "question", other)
    assert "from position 5" in str(e.value) and "\n" not in str(e.value)
    shorter = {**info, "prompt": {**info["prompt"], "ids": ids[:-1]}}
    with pytest.raises(errors.UserError, match="does not read as the organism was trained"):
        gsm8k.check_organism_reading(splits, tok, "question", shorter)
    with pytest.raises(errors.UserError, match="outside the organism's vocabulary"):
        gsm8k.check_organism_reading(splits, tok, "question", {**info, "alphabet": info["alphabet"].replace("7", "")})


# ------------------------------------------------------------------------------------------------------
# 3. the model and its folder
# ------------------------------------------------------------------------------------------------------


def test_the_folder_loads_with_plain_transformers_and_its_record_holds(built):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(built / "model")
    assert model.config.model_type == "qwen2" and model.config.vocab_size == 261
    assert sorted(p.name for p in (built / "model").iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]  # fmt: skip
    assert not (built / "model" / "config.json").read_text().count("auto_map")  # no remote code
    gen = GenerationConfig.from_pretrained(built / "model")
    assert gen.eos_token_id == 257 and gen.pad_token_id == 256 and not gen.do_sample
    record = json.loads((built / "organism.json").read_text())
    assert models.organism_damage(built) is None  # every file's sha256 as recorded
    assert record["settings"]["hidden"] == 32 and record["report"]["test_n"] == 100
    first = json.loads((built / "data" / "test.jsonl").open().readline())["question"]
    project = models.load_tokenizer(str(built / "model"))  # as the trainers load it
    assert record["prompt"] == {"question": first, "ids": gsm8k.encode_prompt(project, first, "question")}
    assert set(models.ORGANISM_FILES) <= set(record["sha256"])
    assert set(record["alphabet"]) == set("0123456789 +-=?#\nWhatis")
    longest = max(len(json.loads(line)["question"]) for line in (built / "data" / "test.jsonl").open()) + 3
    assert model.config.max_position_embeddings >= longest + record["report"]["max_new_tokens"]


@pytest.mark.parametrize("missing", [("model/tokenizer.json",), ("data/test.jsonl",), models.ORGANISM_FILES])
def test_a_record_that_does_not_name_every_file_is_damage(built, tmp_path, missing):
    """organism.json's sha256 names every file the trainers read (a file it leaves out would go unchecked): a record
    that leaves one out, or holds no mapping, is damage, said in words."""
    folder = tmp_path / "org"
    shutil.copytree(built, folder)
    record = json.loads((folder / "organism.json").read_text())
    files = record["sha256"]
    (folder / "organism.json").write_text(
        json.dumps({**record, "sha256": {k: files[k] for k in files if k not in missing}})
    )
    assert models.organism_damage(folder) == f"organism.json's sha256 does not name {', '.join(missing)}"
    (folder / "organism.json").write_text(json.dumps({**record, "sha256": sorted(files.items())}))
    assert models.organism_damage(folder) == "organism.json's sha256 is a list, not a file -> sha256 mapping"


def test_a_build_stopped_while_writing_its_folder_leaves_none(tmp_path, monkeypatch):
    """Ctrl-C (or a full disk) while organism.py writes its folder: the half-written temporary folder goes too."""
    from helpers import run_in_process

    write = organism.write_jsonl

    def interrupted(path: Path, rows: list) -> None:
        write(path, rows)
        if path.name == "test.jsonl":
            raise KeyboardInterrupt

    monkeypatch.setattr(organism, "write_jsonl", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_in_process("organism.py", [*flags(out=tmp_path / "org", **TINY_FLAGS), "--no-progress"])
    assert list(tmp_path.iterdir()) == []


def test_the_loss_falls_in_a_seconds_long_fine_tuning(built):
    from transformers import AutoModelForCausalLM

    tok = models.load_tokenizer(str(built / "model"))
    trained = AutoModelForCausalLM.from_pretrained(built / "model")
    torch.manual_seed(0)
    args = organism.Args(**TINY_FLAGS)
    fresh = organism.make_model(args, tok, trained.config.max_position_embeddings)
    rows = [json.loads(line) for line in (built / "data" / "test.jsonl").open()][:32]
    ids, mask, labels = organism.batch_tensors(
        [organism.encode_example(tok, r["question"], r["answer"]) for r in rows], tok.pad_token_id
    )
    with torch.no_grad():
        before = fresh(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
        after = trained(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    assert before > 5.0 and after < before - 1.5, (before, after)  # ln 261 = 5.56 at random


def test_static_engine_greedy_equals_transformers_generate(built):
    from transformers import AutoModelForCausalLM

    tok = models.load_tokenizer(str(built / "model"))
    model = AutoModelForCausalLM.from_pretrained(built / "model").eval()
    qs = [json.loads(line)["question"] for line in (built / "data" / "test.jsonl").open()][:6]
    prompts = [gsm8k.encode_prompt(tok, q, "question") for q in qs]
    ro = generation.generate(model, prompts, max_new_tokens=24, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                             backend="static")  # fmt: skip
    for i, p in enumerate(prompts):  # one prompt at a time: no padding in transformers' own generate
        out = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p) :].tolist()
        n = int(ro.lengths[i])
        assert ro.response_ids[i, :n].tolist() == out[:n]


def test_rollout_logprobs_equal_the_training_forward(built):
    from transformers import AutoModelForCausalLM

    tok = models.load_tokenizer(str(built / "model"))
    model = AutoModelForCausalLM.from_pretrained(built / "model").eval()
    qs = [json.loads(line)["question"] for line in (built / "data" / "test.jsonl").open()][:8]
    prompts = [gsm8k.encode_prompt(tok, q, "question") for q in qs]
    u = rollout.step_uniforms(1, 0, 0, len(prompts), 24, torch.device("cpu"))
    for backend in ("hf", "static"):
        ro = generation.generate(model, prompts, max_new_tokens=24, eos_id=tok.eos_token_id,
                                 pad_id=tok.pad_token_id, uniforms=u, backend=backend)  # fmt: skip
        again = forward.rollout_logprobs(forward.PolicyForward(model), ro, micro=4)
        assert torch.allclose(again, ro.logprobs, atol=1e-5), (backend, (again - ro.logprobs).abs().max())


# ------------------------------------------------------------------------------------------------------
# --model organism: built once into the cache, checked, its own data, its record in results.json
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # the module's tests share its build


@pytest.fixture
def small_cache(small_cache_dir, monkeypatch):
    """RLVR_CACHE in the module's folder and the cached organism a seconds-long one (models.ORGANISM_FLAGS), for one
    test: the real organism's tests, later in this process, see the real cache."""
    monkeypatch.setenv("RLVR_CACHE", str(small_cache_dir))
    monkeypatch.setattr(models, "ORGANISM_FLAGS", [*flags(**TINY_FLAGS), "--no-progress"])
    monkeypatch.setattr(models, "_ORGANISM_CHECKED", {})
    return small_cache_dir


def dead_pid() -> int:
    """The pid of a process that has ended: a killed build's, in the name of the folder it left."""
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_the_organism_is_built_once_into_the_cache_and_again_when_damaged(small_cache, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path))  # a cache of its own: built here, whatever ran before
    folder = models.organism_cache_folder()
    stale = folder.with_name(f"{folder.name}.tmp-{dead_pid()}")
    (stale / "model").mkdir(parents=True)  # a build killed before its rename
    assert not folder.exists() and folder.parent == tmp_path  # named, not built
    assert models.organism_folder() == folder
    assert "building the organism once" in capfd.readouterr().out
    assert not stale.exists() and models.resolve_model("organism") == folder / "model"
    info = models.organism_info()
    models._ORGANISM_CHECKED.clear()  # a new process: its files checked again, not rebuilt
    assert models.organism_folder() == folder and "building" not in capfd.readouterr().out
    weights = folder / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])  # a truncated copy
    models._ORGANISM_CHECKED.clear()
    assert models.organism_folder() == folder
    said = capfd.readouterr().out
    assert "is damaged (model/model.safetensors is not the file that was built" in said and "building it again" in said
    assert models.organism_damage(folder) is None and len(list(tmp_path.glob("organism-*.damaged-*"))) == 1
    assert models.organism_info() is not info and not list(tmp_path.glob("organism-*.tmp-*"))  # the new build's record


def test_a_failed_build_is_one_error_and_leaves_no_folder(small_cache, tmp_path, monkeypatch, capfd):
    """organism.py refuses its flags: the trainer says so in one line (organism.py's own is above it), and the cache
    holds no organism, no temporary folder, and not the stale ones of a killed build (removed before building)."""
    from helpers import cli

    cache = tmp_path / "cache"
    monkeypatch.setenv("RLVR_CACHE", str(cache))
    monkeypatch.setattr(models, "ORGANISM_FLAGS", [*flags(**{**TINY_FLAGS, "hidden": 30, "heads": 4}), "--no-progress"])
    folder = models.organism_cache_folder()
    killed = folder.with_name(f"{folder.name}.tmp-{dead_pid()}")
    for left in (killed, killed.with_name(f"{killed.name}.tmp-{dead_pid()}")):  # its organism.py's own too
        (left / "model").mkdir(parents=True)
    proc = run_here("grpo.py", cli(tmp_path / "run", base=dict(model="organism", total_steps=1)))
    assert proc.returncode == 2
    assert "building the organism failed (organism.py exited 2" in check_one_error_line(proc)
    assert "--hidden 30 must be a multiple of --heads 4" in capfd.readouterr().err
    assert not list(cache.glob("organism-*")) and not (tmp_path / "run").exists()


FAKE_BUILD = """
import os, signal, sys, time
from pathlib import Path

out, log = Path(sys.argv[sys.argv.index("--out") + 1]), Path(sys.argv[0]).with_suffix(".log")
signal.signal(signal.SIGTERM, lambda *_: (log.write_text(log.read_text() + "terminated"), sys.exit(1)))
(out.with_name(f"{out.name}.tmp-{os.getpid()}") / "model").mkdir(parents=True)  # as organism.py writes its own
log.write_text(" ".join(sys.argv[1:]) + "\\n")
time.sleep(120)
"""


def test_a_build_stopped_while_it_runs_terminates_organism_py_and_leaves_no_folder(tmp_path, monkeypatch):
    """Ctrl-C while organism.py builds (any exception while it is waited for): the build is terminated (SIGTERM, so
    that it can clean up, not SIGKILL), the interrupt goes on, and no folder is left. organism.py writes into
    FOLDER.tmp-PID, and without a progress bar when stderr is not a terminal."""
    import os
    import subprocess
    import time

    script, log = tmp_path / "organism.py", tmp_path / "organism.log"
    script.write_text(FAKE_BUILD)
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "ORGANISM_SCRIPT", script)
    monkeypatch.setattr(models, "ORGANISM_FLAGS", [])
    monkeypatch.setattr(models, "_ORGANISM_CHECKED", {})
    started: list[subprocess.Popen] = []

    class Interrupted(subprocess.Popen):  # Ctrl-C while the build is waited for
        def wait(self, timeout=None):
            if timeout is not None or self in started:
                return super().wait(timeout)
            started.append(self)
            deadline = time.time() + 60
            while not log.is_file() and time.time() < deadline:
                time.sleep(0.02)
            raise KeyboardInterrupt

    monkeypatch.setattr(subprocess, "Popen", Interrupted)
    folder = models.organism_cache_folder()
    with pytest.raises(KeyboardInterrupt):
        models.organism_folder()
    assert started and started[0].returncode == 1  # ended by its SIGTERM handler, not killed
    said = log.read_text()
    assert said.startswith(f"--out {folder}.tmp-{os.getpid()} --seed 0 --no-progress") and "terminated" in said
    assert not list((tmp_path / "cache").glob("organism-*"))


def test_organism_info_is_read_once_per_folder(tmp_path, monkeypatch):
    folders = [tmp_path / "a", tmp_path / "b"]
    for i, folder in enumerate(folders):
        folder.mkdir()
        (folder / "organism.json").write_text(json.dumps({"settings": {"seed": i}}))
    monkeypatch.setattr(models, "_ORGANISM_INFO", {})
    monkeypatch.setattr(models, "organism_folder", lambda name=models.ORGANISM: folders[0])
    info = models.organism_info()
    (folders[0] / "organism.json").write_text("{}")  # not read again
    assert models.organism_info() is info and info == {"settings": {"seed": 0}}
    monkeypatch.setattr(models, "organism_folder", lambda name=models.ORGANISM: folders[1])
    assert models.organism_info() == {"settings": {"seed": 1}}


@pytest.mark.slow
def test_processes_that_start_together_build_the_organism_once(tmp_path):
    """Two processes (a sweep's jobs, torchrun's ranks) ask for the organism at once: one builds, the other waits on
    the lock and finds it built."""
    import subprocess
    import sys

    from helpers import REPO, trainer_env

    code = (
        "import sys; from plumbing import models; models.ORGANISM_FLAGS = sys.argv[1:]; "
        "print('folder', models.organism_folder(), flush=True)"
    )
    env = {**trainer_env(), "RLVR_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-c", code, *flags(**TINY_FLAGS), "--no-progress"]
    procs = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sum(out.count("building the organism once") for out in outs) == 1, outs
    folders = {line for out in outs for line in out.splitlines() if line.startswith("folder ")}
    assert len(folders) == 1 and len(list((tmp_path / "cache").glob("organism-*"))) == 1


def test_a_run_on_the_organism_reads_its_task_and_records_it(small_cache, tmp_path):
    from helpers import check_results, cli

    run = tmp_path / "run"
    sizes = dict(model="organism", batch_size=2, group_size=2, max_new_tokens=8, micro_batch_size=4, num_minibatches=1,
                 mc_every=0, eval_every=0, val_size=50, eval_size=8, test_size=8, eval_max_new_tokens=8, total_steps=1)  # fmt: skip
    proc = run_here("grpo.py", cli(run, base=sizes))
    assert proc.returncode == 0, proc.stderr
    results = check_results(run, steps=1)
    folder = models.organism_folder()
    assert results["data"]["folder"] == str((folder / "data").resolve())  # GSM8K_DIR is set: not read
    assert results["args"]["prompt_format"] == "question" and results["args"]["data_dir"] is None
    record = results["organism"]
    assert record["sha256"]["model/model.safetensors"] == models.file_sha256(folder / "model" / "model.safetensors")
    assert record["settings"]["hidden"] == TINY_FLAGS["hidden"] and record["settings"]["seed"] == models.ORGANISM_SEED
    before, after = results["test_before"], results["test"]
    assert before["n"] == after["n"] == 8 and len(before["correct"]) == 8
    assert "test accuracy before training" in proc.stdout and "paired difference" in proc.stdout
    assert "the organism's task: train" in proc.stdout


def test_a_refused_run_on_the_organism_builds_nothing(small_cache, tmp_path, monkeypatch):
    """The run folder's refusals come before the organism is copied or built (minutes): the memory check before them
    passes the organism not yet in the cache."""
    from helpers import cli

    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({"test": {}}))  # another command's finished run
    proc = run_here("grpo.py", cli(run, base=dict(model="organism", total_steps=1)))
    assert proc.returncode == 2 and "already holds a run" in check_one_error_line(proc)
    assert "building" not in proc.stdout and not list((tmp_path / "cache").glob("organism-*"))


def test_gsm8k_through_data_dir_is_outside_the_organisms_vocabulary(small_cache, tmp_path, gsm8k_dir):
    from helpers import cli

    proc = run_here("grpo.py", cli(tmp_path / "run", base=dict(model="organism", total_steps=1), data_dir=gsm8k_dir))
    assert proc.returncode == 2
    line = check_one_error_line(proc)
    # the first problem of the train split (val is carved out first) names its line
    assert re.search(r"train\.jsonl:\d+: ", line) and "outside the organism's vocabulary" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["organism", "organism-large"])
def test_a_run_on_the_organism_refuses_the_chat_prompt_before_building_it(name, tmp_path, monkeypatch):
    """Refused as the flags are parsed (runtime.cli): neither the shipped organism copied nor a named one built
    (minutes, for organism-large) for a run that cannot read it."""
    from helpers import cli

    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    proc = run_here(
        "grpo.py", cli(tmp_path / "run", base=dict(model=name, total_steps=1, val_size=50), prompt_format="chat")
    )
    assert proc.returncode == 2
    assert "--prompt-format chat: the organism learned the question alone" in check_one_error_line(proc)
    assert "building" not in proc.stdout and not list((tmp_path / "cache").glob("organism*"))
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------------
# the repository's build (organism-seed0/): this organism.py's, copied into the cache, of the starting point's quality
# ------------------------------------------------------------------------------------------------------

SHIPPED = models.SHIPPED_ORGANISMS[models.ORGANISM]
REMAKE = f"rm -r {SHIPPED.name} && python organism.py --out {SHIPPED.name}"


def shipped_record() -> dict:
    return json.loads((SHIPPED / models.ORGANISM_RECORD).read_text())


def test_the_shipped_organism_is_this_organism_pys_build_of_seed_0():
    """organism-seed0/ is what --model organism uses: its files as recorded, its settings organism.py's defaults, and
    made by this organism.py. A change to organism.py fails here until the build is made again and committed."""
    assert models.organism_damage(SHIPPED) is None
    record = shipped_record()
    defaults = {k: v for k, v in dataclasses.asdict(organism.Args()).items() if k not in ("out", "progress")}
    assert record["settings"] == defaults and models.ORGANISM_SEED == 0, f"organism.py's defaults changed: {REMAKE}"
    assert models.why_not_shipped() is None, f"organism.py changed since {SHIPPED.name}/ was built: {REMAKE}"


def test_the_committed_study_ran_on_the_shipped_organism():
    """Every run of docs/organism records the sha256 of the organism's weights it trained: the shipped one's; the
    runs on another organism (spread/, size/: How the crossover moves), that organism's, as its curve and its
    build's card (organisms/NAME.json) record them."""
    weights = shipped_record()["sha256"]["model/model.safetensors"]
    study = REPO / "docs" / "organism"
    runs = list(study.glob("*/*/results.json"))
    assert len(runs) == len((study / "plan.tsv").read_text().splitlines()) > 0  # every run of the plan
    mine = [r for r in runs if r.parent.parent.name not in ("spread", "size")]
    assert {json.loads(r.read_text())["organism"]["sha256"]["model/model.safetensors"] for r in mine} == {weights}
    for experiment, name in (("spread", "organism-wide"), ("size", "organism-large")):
        card = json.loads((study / "organisms" / f"{name}.json").read_text())["sha256"]["model/model.safetensors"]
        curve = json.loads(next((study / experiment).glob("curve-*" + name.split("-")[1] + "/curve.json")).read_text())
        assert curve["organism"]["weights_sha256"] == card != weights
        theirs = {json.loads(r.read_text())["organism"]["sha256"]["model/model.safetensors"]
                  for r in runs if r.parent.parent.name == experiment}  # fmt: skip
        assert theirs == {card}  # each head-to-head trained the organism its curve measured


def test_why_not_shipped_names_each_reason(tmp_path, monkeypatch):
    """The shipped build is copied only when it is the one organism.py would build; otherwise a build, saying why."""
    script = tmp_path / "organism.py"
    script.write_text(models.ORGANISM_SCRIPT.read_text() + "# another recipe\n")
    with monkeypatch.context() as m:
        m.setattr(models, "ORGANISM_SCRIPT", script)
        assert models.why_not_shipped() == "organism.py has changed since it was built"
    with monkeypatch.context() as m:
        m.setattr(models, "ORGANISM_SEED", 1)
        assert models.why_not_shipped() == "it is not seed 1's build"
    with monkeypatch.context() as m:
        m.setattr(models, "ORGANISM_FLAGS", ["--hidden", "64"])
        said = models.why_not_shipped()
        assert said == "it was built with other settings than organism.py --hidden 64 gives: hidden 96, not 64"
    copy = tmp_path / SHIPPED.name
    shutil.copytree(SHIPPED, copy)
    monkeypatch.setitem(models.SHIPPED_ORGANISMS, models.ORGANISM, copy)
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    key = models.organism_cache_folder()  # named by its source too: a build made here never stands in for it
    (copy / "organism.json").unlink()
    assert models.why_not_shipped() == "it is damaged: organism.json unreadable: FileNotFoundError"
    assert models.organism_cache_folder() != key
    shutil.copy(SHIPPED / "organism.json", copy)
    assert models.why_not_shipped() is None and models.organism_cache_folder() == key
    weights = copy / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    said = models.why_not_shipped()
    assert said == "it is damaged: model/model.safetensors is not the file that was built (its sha256 differs)"
    shutil.rmtree(copy)
    assert models.why_not_shipped() == f"{SHIPPED.name}/ is not in this checkout"


def test_the_cache_is_filled_from_the_shipped_build_without_building(tmp_path, monkeypatch, capfd):
    import subprocess

    monkeypatch.setenv("RLVR_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_ORGANISM_CHECKED", {})
    monkeypatch.setattr(models, "_ORGANISM_INFO", {})
    monkeypatch.setattr(subprocess, "Popen", None)  # organism.py is not run
    folder = models.organism_folder()
    assert f"the repository's build ({SHIPPED.name}/) copied into {folder}" in capfd.readouterr().out
    assert models.organism_damage(folder) is None and models.organism_info() == shipped_record()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{folder.name}.lock", folder.name]
    monkeypatch.setattr(models, "organism_cache_folder", None)  # checked: its name is not derived (hashed) again
    assert models.organism_folder() == folder


def test_a_failed_copy_is_one_error_and_leaves_no_folder(tmp_path, monkeypatch):
    """The disk fills while the shipped build is copied: one error naming the copy, nothing left in the cache."""

    def copy_half(src, dst, **kw):
        Path(dst, "model").mkdir(parents=True)
        raise OSError(28, "No space left on device")

    monkeypatch.setenv("RLVR_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_ORGANISM_CHECKED", {})
    monkeypatch.setattr(shutil, "copytree", copy_half)
    with pytest.raises(errors.UserError, match=f"copying {SHIPPED} into {tmp_path} failed: .*No space left"):
        models.organism_folder()
    assert [p.name for p in tmp_path.iterdir()] == [f".{models.organism_cache_folder().name}.lock"]


def test_a_copy_that_is_not_the_shipped_build_is_refused(tmp_path, monkeypatch):
    """The shipped files change while they are copied (a checkout): the copy is checked before it is used."""
    copytree = shutil.copytree

    def copy_then_change(src, dst, *args, **kw):  # copytree calls itself for each folder inside
        copytree(src, dst, *args, **kw)
        if Path(src) == SHIPPED:
            Path(dst, "data", "test.jsonl").write_text("{}\n")
        return dst

    monkeypatch.setenv("RLVR_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_ORGANISM_CHECKED", {})
    monkeypatch.setattr(shutil, "copytree", copy_then_change)
    with pytest.raises(errors.UserError, match="is not the shipped build: data/test.jsonl is not the file that was"):
        models.organism_folder()
    assert [p.name for p in tmp_path.iterdir()] == [f".{models.organism_cache_folder().name}.lock"]


def strict_answer(text: str) -> str | None:
    """The test's own strict reader, not gsm8k.py's: the completion's last line is "#### N", N an integer."""
    last = text.strip().split("\n")[-1]
    return last[5:] if last.startswith("#### ") and last[5:].lstrip("-").isdigit() else None


@pytest.mark.slow
def test_the_shipped_organism_is_at_the_starting_point_read_by_plain_transformers():
    """Loaded and sampled by plain transformers on its own test questions, scored by a reader of the test's own: greedy
    accuracy between 20% and 60% (its record: 45.4%), and sampled at T = 1, 8 each, a pass rate between 0.15 and 0.6
    and at least half of the problems informative (solved by some samples, not all). ~15 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHIPPED / "model")
    model = AutoModelForCausalLM.from_pretrained(SHIPPED / "model").eval()
    record = shipped_record()
    rows = [json.loads(line) for line in (SHIPPED / "data" / "test.jsonl").open()]
    train = {json.loads(line)["question"] for line in (SHIPPED / "data" / "train.jsonl").open()}
    assert len(rows) == 1000 and not train & {r["question"] for r in rows}

    def solved(rows: list[dict], k: int, sample: bool) -> list[float]:
        out = []
        for i in range(0, len(rows), 256):
            chunk = rows[i : i + 256]
            chats = [[{"role": "user", "content": r["question"]}] for r in chunk]
            enc = tok.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_tensors="pt",
                                          return_dict=True)  # fmt: skip
            with torch.no_grad():
                gen = model.generate(**enc, max_new_tokens=record["report"]["max_new_tokens"], do_sample=sample, temperature=1.0 if sample else None,
                                     top_k=None, top_p=None, num_return_sequences=k)  # fmt: skip
            texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            golds = [r["answer"].split("#### ")[-1] for r in chunk for _ in range(k)]
            right = [strict_answer(t) == g for t, g in zip(texts, golds)]
            out += [sum(right[j * k : (j + 1) * k]) / k for j in range(len(chunk))]
        return out

    greedy = sum(solved(rows, 1, sample=False)) / len(rows)
    assert 0.2 <= greedy <= 0.6 and abs(greedy - record["report"]["test_greedy"]) < 0.02, greedy
    torch.manual_seed(0)
    p = solved(rows[:256], 8, sample=True)
    pass_rate, informative = sum(p) / len(p), sum(0 < x < 1 for x in p) / len(p)
    assert 0.15 <= pass_rate <= 0.6 and informative >= 0.5, (pass_rate, informative)


@pytest.mark.slow
def test_organism_py_remakes_the_shipped_build(tmp_path):
    """The recipe: organism.py, with the shipped build's settings, trains the same model. Its first 50 steps (the
    build's first check; where it stops is the shipped record's) give the loss the record holds at step 50, to 0.1%:
    the same on the machine that built it, and on two threads (another summation order) the same to six digits, so
    0.1% leaves room for another machine's rounding and none for another recipe. The whole build, 4 minutes, is
    `python organism.py --out DIR` (docs/organism). ~25 s."""
    out = tmp_path / "org"
    proc = run_here("organism.py", ["--out", str(out), "--no-progress", "--target-accuracy", "0", "--eval-every", "50",
                                    "--samples", "2", "--report-problems", "8"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    again, shipped = json.loads((out / "organism.json").read_text()), shipped_record()
    assert again["script_sha256"] == shipped["script_sha256"]
    (step, loss, _), (step0, loss0, _) = again["trajectory"][0], shipped["trajectory"][0]
    assert step == step0 == 50 and loss == pytest.approx(loss0, rel=1e-3), (loss, loss0)
    assert again["sha256"]["data/test.jsonl"] == shipped["sha256"]["data/test.jsonl"]
    assert again["sha256"]["data/train.jsonl"] == shipped["sha256"]["data/train.jsonl"]


# ------------------------------------------------------------------------------------------------------
# the real organism (the shipped build, copied into the cache): learning; and builds that start together
# ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_grpo_on_the_organism_raises_test_accuracy_with_a_paired_interval_above_zero(tmp_path, monkeypatch):
    """The study's premise on the machine it has: the organism solves some problems and not others, and GRPO at
    the CPU preset's learning rate lifts its greedy test accuracy within a few steps (on its 1,000 test problems, 12
    steps of 32 prompts x 8, one thread, 63 s: 45.4% -> 53.7%, paired +8.3 points [+5.4, +11.2]; 16 prompts x 8 gave
    +3.3 [+0.6, +6.0], too near zero for a test that runs on other machines' floating point; 2026-12-05, the build
    of sha256 e9e8c1e3...). The paired interval over the same problems must be above zero."""
    from helpers import check_results, cli

    run = tmp_path / "run"
    sizes = dict(model="organism", batch_size=32, group_size=8, total_steps=12, micro_batch_size=128, mc_every=0,
                 eval_every=0, eval_size=100, test_size=1000)  # fmt: skip
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))  # the shipped build copied in, whatever a cache holds
    monkeypatch.setattr(models, "_ORGANISM_CHECKED", {})
    proc = run_here("grpo.py", cli(run, base=sizes))
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = check_results(run, steps=12)
    assert results["organism"]["sha256"] == shipped_record()["sha256"]  # the real one, not a test's
    before, after = results["test_before"]["correct"], results["test"]["correct"]
    diff, lo, hi = intervals.paired_difference(after, before)  # the trainer's own last lines say the same
    said = f"{results['test_before']['accuracy']} -> {results['test']['accuracy']}: {diff:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    assert lo > 0, f"test accuracy {said}"
