"""The named organisms (plumbing/models.py ORGANISMS: --model organism-small, -large, -wide): each name resolves to
its own recipe and cache folder, selects the organism's CPU preset and its own settings, builds the same files twice
on one machine (a seconds-long version of each recipe: the tests' tiny sizes, then the recipe's knobs), and is read
by the trainers as the organism is; an unknown one is one `error:` line before anything is written. Each one's build
ships (models.SHIPPED_ORGANISMS: organism-small-seed0/, ...; the ones the committed study ran on), is copied into the
cache while it is this organism.py's build of its recipe, and is refused, the name then built, when it is not. And
GRPO's baseline measured on Monte Carlo returns (measure.group_mean_error), the crossover study's line for G."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import REPO, check_ok, check_one_error_line, check_results, cli, run_here
from test_organism import TINY_FLAGS, flags

import intervals
import measure
from plumbing import cmdline, models, runtime

BUILT = [name for name in models.ORGANISMS if name != models.ORGANISM]


@pytest.fixture
def tiny_recipes(tmp_path, monkeypatch):
    """A cache of the test's own, and every organism's build the tests' tiny one with its recipe's knobs after."""
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "ORGANISM_FLAGS", [*flags(**TINY_FLAGS), "--no-progress"])
    monkeypatch.setattr(models, "_ORGANISM_CHECKED", {})
    return tmp_path / "cache"


def test_each_name_has_its_own_recipe_and_cache_folder():
    folders = {name: models.organism_cache_folder(name) for name in models.ORGANISMS}
    assert len(set(folders.values())) == len(folders)  # a recipe is never another's cached build
    for name, folder in folders.items():
        assert folder.name.startswith(f"{name}-") and models.is_organism(name)
        assert models.organism_flags(name)[-len(models.ORGANISMS[name]) or None :] == list(models.ORGANISMS[name])
    assert all(models.why_not_shipped(name) is None for name in models.ORGANISMS)  # each one's build ships
    assert not models.is_organism("organism-huge") and not models.is_organism("tiny")


def test_the_recipes_are_the_organisms_knobs_at_the_sizes_said():
    """The organism's recipe but for its knobs; the larger model about 4x the parameters, the smaller under half."""
    import organism

    def parameters(name: str) -> int:
        args = organism.Args()
        knobs = models.ORGANISMS[name]
        for key, value in zip(knobs[::2], knobs[1::2]):
            field = key[2:].replace("-", "_")
            setattr(args, field, type(getattr(args, field))(value))
        h, i, v = args.hidden, args.intermediate, 261  # 256 bytes and 5 special tokens; tied embeddings
        return args.layers * (4 * h * h + 3 * h + 3 * h * i + 2 * h) + v * h + h

    base = parameters(models.ORGANISM)
    for name in models.ORGANISMS:  # each shipped build is the size its recipe gives
        assert parameters(name) == shipped_record(name)["report"]["parameters"], name
    assert 3.5 <= parameters("organism-large") / base <= 5 and parameters("organism-small") / base < 0.5
    assert parameters("organism-wide") == base  # the same model: only the task differs


def test_a_recipe_selects_the_organisms_cpu_preset_and_its_own_settings():
    import ppo
    from study import pretrain_critic

    base = runtime.cpu_preset(ppo.Args, ppo.CPU_SCALE, models.ORGANISM)
    for name in BUILT:
        args = runtime.cpu_preset(ppo.Args, ppo.CPU_SCALE, name)
        assert args.model == name and args.batch_size == base.batch_size and args.prompt_format == "question"
    wide = runtime.cpu_preset(ppo.Args, ppo.CPU_SCALE, "organism-wide")
    assert wide.max_new_tokens == wide.eval_max_new_tokens == 96 > base.max_new_tokens  # five lines fit
    assert pretrain_critic.parse(["--model", "organism-wide"]).max_new_tokens == 96  # the critic file's sampling too
    args, _ = runtime.cli(ppo.Args, ppo.CPU_SCALE, ["--model", "organism-wide", "--max-new-tokens", "80"])
    assert args.max_new_tokens == 80  # a flag given wins


def test_an_unknown_organism_is_one_error_line_before_anything_is_written(tmp_path):
    line = check_one_error_line(run_here("grpo.py", cli(tmp_path / "run", model="organism-huge")))
    assert "unknown model 'organism-huge'" in line and "organism-wide" in line
    assert not (tmp_path / "run").exists()
    with pytest.raises(models.UserError, match="unknown organism 'organism-huge'"):
        models.organism_flags("organism-huge")


# ------------------------------------------------------------------------------------------------------
# The shipped builds: one for each name, the committed study's, copied into the cache; another recipe's refused
# ------------------------------------------------------------------------------------------------------


def shipped_record(name: str) -> dict:
    return json.loads((models.SHIPPED_ORGANISMS[name] / models.ORGANISM_RECORD).read_text())


def recipe_defaults(name: str) -> dict:
    """organism.py's Args at its defaults but for the recipe's knobs, as its record's settings: parsed by
    organism.py's own command line (cmdline.parse_args on its Args), not as models.recipe_settings reads them (the
    script's text, the flags by hand), so that each checks the other."""
    import organism

    args = cmdline.parse_args(organism.Args, ["--seed", str(models.ORGANISM_SEED), *models.ORGANISMS[name]])
    return {k: v for k, v in dataclasses.asdict(args).items() if k not in models.UNRECORDED_SETTINGS}


@pytest.mark.parametrize("name", list(models.ORGANISMS))
def test_each_name_ships_the_build_of_its_recipe(name):
    """Every named organism has its build in the repository, and it is the one its name resolves to
    (why_not_shipped: its files as recorded, seed 0, this organism.py's): its record's settings are organism.py's
    defaults with the recipe's knobs, so a recipe changed in ORGANISMS fails here until its build is made again; the
    folder holds organism-seed0/'s files and no others (no checkpoint, no stray file)."""
    shipped = models.SHIPPED_ORGANISMS[name]
    remake = f"rm -r {shipped.name} && python organism.py --out {shipped.name} {' '.join(models.ORGANISMS[name])}"
    assert shipped.parent == models.ORGANISM_SCRIPT.parent and shipped.name == f"{name}-seed{models.ORGANISM_SEED}"
    record = shipped_record(name)
    assert record["settings"] == recipe_defaults(name) == models.recipe_settings(name), f"another recipe: {remake}"
    assert models.why_not_shipped(name) is None, f"organism.py changed since {shipped.name}/ was built: {remake}"
    files = sorted(str(p.relative_to(shipped)) for p in shipped.rglob("*") if p.is_file())
    assert files == sorted([*record["sha256"], models.ORGANISM_RECORD])
    origin = models.SHIPPED_ORGANISMS[models.ORGANISM]
    assert files == sorted(str(p.relative_to(origin)) for p in origin.rglob("*") if p.is_file())


@pytest.mark.parametrize("experiment, name", [("spread", "organism-wide"), ("size", "organism-large"),
                                              ("size", "organism-small")])  # fmt: skip
def test_the_committed_moves_study_ran_on_the_shipped_builds(experiment, name):
    """docs/organism's study of how the crossover moves: each organism's card (organisms/NAME.json) is its shipped
    build's organism.json byte for byte, its curve measured those weights, and every run on it recorded that very
    build (its settings, trajectory, report and files' sha256)."""
    study = REPO / "docs" / "organism"
    shipped = models.SHIPPED_ORGANISMS[name] / models.ORGANISM_RECORD
    assert (study / "organisms" / f"{name}.json").read_bytes() == shipped.read_bytes()
    record = json.loads(shipped.read_text())
    curve = json.loads((study / experiment / f"curve-{name.split('-')[1]}" / "curve.json").read_text())
    assert curve["organism"]["weights_sha256"] == record["sha256"]["model/model.safetensors"]
    assert curve["organism"]["settings"] == record["settings"] and curve["organism"]["report"] == record["report"]
    runs = [json.loads(r.read_text()) for r in (study / experiment).glob("*/results.json")]
    mine = [r["organism"] for r in runs if r["args"]["model"] == name]
    assert all(r == record for r in mine) and len(mine) == (0 if name == "organism-small" else 15)


@pytest.mark.parametrize("name", BUILT)
def test_an_empty_cache_is_filled_from_each_shipped_build_without_building(name, tmp_path, monkeypatch, capfd):
    """organism_folder(name) copies the name's shipped build into the cache (no organism.py run) and checks the copy;
    resolve_model and organism_info read it."""
    shipped = models.SHIPPED_ORGANISMS[name]
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_ORGANISM_CHECKED", {})
    monkeypatch.setattr(models, "_ORGANISM_INFO", {})
    monkeypatch.setattr(subprocess, "Popen", None)  # organism.py is not run
    folder = models.organism_folder(name)
    assert f"{name}: the repository's build ({shipped.name}/) copied into {folder}" in capfd.readouterr().out
    assert folder == models.organism_cache_folder(name) and folder.parent == tmp_path
    assert models.organism_damage(folder) is None and models.organism_info(name) == shipped_record(name)
    assert models.resolve_model(name) == folder / "model"
    assert models.file_sha256(folder / "model" / "model.safetensors") == models.shipped_weights(name)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{folder.name}.lock", folder.name]


class NotBuilt(Exception):
    """organism.py's process, not started: the test stops where the build would begin."""


def build_instead(name: str, monkeypatch, capfd) -> list[str]:
    """organism_folder(name) into an empty cache, organism.py's process replaced by a stop: the command it would run,
    after its one line saying why the shipped build was not copied."""
    commands: list[list[str]] = []

    def popen(command, *args, **kw):
        commands.append(command)
        raise NotBuilt

    monkeypatch.setattr(models, "_ORGANISM_CHECKED", {})
    monkeypatch.setattr(subprocess, "Popen", popen)
    capfd.readouterr()
    with pytest.raises(NotBuilt):
        models.organism_folder(name)
    assert len(commands) == 1 and commands[0][1] == str(models.ORGANISM_SCRIPT)
    assert " ".join(models.organism_flags(name)) in " ".join(commands[0])  # the recipe's flags
    return [capfd.readouterr().out, *commands[0]]


def damage(copy: Path, monkeypatch) -> str:
    weights = copy / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    return "it is damaged: model/model.safetensors is not the file that was built (its sha256 differs)"


def other_settings(copy: Path, monkeypatch) -> str:
    """The folder holds another recipe's record (organism-small's files under organism-large's settings would pass
    every sha256: organism.json does not hash itself)."""
    record = json.loads((copy / models.ORGANISM_RECORD).read_text())
    record["settings"]["hidden"] = 96
    (copy / models.ORGANISM_RECORD).write_text(json.dumps(record))
    return "it was built with other settings than organism.py --hidden 64 --intermediate 256 gives: hidden 96, not 64"


def other_script(copy: Path, monkeypatch) -> str:
    script = copy.parent / "organism.py"
    script.write_text(models.ORGANISM_SCRIPT.read_text() + "# another recipe\n")
    monkeypatch.setattr(models, "ORGANISM_SCRIPT", script)
    return "organism.py has changed since it was built"


@pytest.mark.parametrize("change", [damage, other_settings, other_script])
def test_a_shipped_build_that_is_not_the_recipes_is_refused_and_the_name_is_built(change, tmp_path, monkeypatch, capfd):
    """A copy of organism-small's shipped build, damaged, holding another recipe's settings, or made by another
    organism.py: why_not_shipped says so, the cache's folder is named for a build made here (never the shipped
    one's), and organism_folder runs organism.py with the recipe's flags, saying why in its one line."""
    name = "organism-small"
    copy = tmp_path / "shipped" / models.SHIPPED_ORGANISMS[name].name
    shutil.copytree(models.SHIPPED_ORGANISMS[name], copy)
    monkeypatch.setitem(models.SHIPPED_ORGANISMS, name, copy)
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    shipped_key = models.organism_cache_folder(name)
    why = change(copy, monkeypatch)
    assert models.why_not_shipped(name) == why
    folder = models.organism_cache_folder(name)
    assert folder != shipped_key and folder.parent == tmp_path / "cache"
    said, *command = build_instead(name, monkeypatch, capfd)
    assert f"building {name} once" in said and f"not the repository's build, {why}" in said
    assert command[command.index("--out") + 1].startswith(f"{folder}.tmp-") and not folder.exists()


def test_a_changed_recipe_or_a_new_one_is_not_the_shipped_build(monkeypatch):
    """A knob changed in ORGANISMS is a difference of settings, named; a name without a build in the repository says
    so; either builds."""
    for name in BUILT:
        with monkeypatch.context() as m:
            m.setitem(models.ORGANISMS, name, (*models.ORGANISMS[name], "--max-number", "30"))
            assert models.why_not_shipped(name).endswith("gives: max_number 40, not 30"), name
    monkeypatch.setitem(models.ORGANISMS, "organism-new", ("--hidden", "48"))
    assert models.why_not_shipped("organism-new") == "the repository ships no build of organism-new"


# why_not_shipped's reason for a recipe flag it cannot read
UNREAD = "its recipe cannot be read as organism.py's settings: "


@pytest.mark.parametrize("knobs, why", [
    (("--hidden=64", "--intermediate", "256"), None),  # argparse's other spelling: the same build
    (("--hidden", "64", "--intermediate", "256", "--target-accuracy=0.5"), "gives: target_accuracy 0.4, not 0.5"),
    (("--hidden", "64", "--intermediate_256"), UNREAD + "--intermediate_256 is not a setting organism.py records"),
    (("--hiden", "80"), UNREAD + "--hiden is not a setting organism.py records"),
    (("--hidden", "64", "--intermediate", "256", "--seed", "1"),
     UNREAD + "--seed is not a setting organism.py records"),
    (("--hidden", "64", "--max-steps", "4e3"), UNREAD + "--max-steps 4e3: expected int"),
    (("--hidden", "64", "--intermediate"), UNREAD + "--intermediate has no value"),
])  # fmt: skip
def test_a_recipe_is_read_as_organism_py_reads_its_flags(knobs, why, monkeypatch):
    """organism-small's recipe spelled another way argparse takes is its shipped build; a knob in the `=` form is
    read (and here differs); a flag organism.py has not, --seed, a value not of its default's type or a flag without
    its value is a reason in one line, never an exception out of every run on the name, and the name is built."""
    monkeypatch.setitem(models.ORGANISMS, "organism-small", knobs)
    said = models.why_not_shipped("organism-small")
    assert said == why if why is None or why.startswith(UNREAD) else said.endswith(why), said


def test_the_tests_tiny_builds_never_take_a_shipped_one(tiny_recipes):
    """ORGANISM_FLAGS (the tests' seconds-long sizes) before each recipe's knobs: no shipped build has those settings,
    so each name is built, into a folder named for a build made here."""
    for name in models.ORGANISMS:
        why = models.why_not_shipped(name)
        assert why.startswith("it was built with other settings than organism.py --hidden 32 --layers 1"), why
        assert "layers 4, not 1" in why and models.organism_cache_folder(name).parent == tiny_recipes


def build(name: str, out: Path) -> dict:
    """organism.py in this process with the recipe's flags (the tests' tiny sizes, then its knobs), as the cache's
    build runs it in its own (models._build_organism: that path is the run's below and test_organism.py's); its
    organism.json."""
    check_ok(run_here("organism.py", [*models.organism_flags(name), "--seed", "0", "--out", str(out)]))
    return json.loads((out / models.ORGANISM_RECORD).read_text())


@pytest.mark.parametrize("name", BUILT)
def test_each_recipe_builds_the_same_files_twice(name, tiny_recipes, tmp_path):
    first, second = build(name, tmp_path / "a"), build(name, tmp_path / "b")
    assert first["sha256"] == second["sha256"]  # weights, tokenizer and the task's splits, bit for bit
    knobs = models.ORGANISMS[name]
    for key, value in zip(knobs[::2], knobs[1::2]):  # the recipe's knobs, after the tests' tiny sizes
        assert str(first["settings"][key[2:].replace("-", "_")]) == value


def test_a_run_on_a_named_organism_reads_its_task_and_records_it(tiny_recipes, tmp_path):
    """A run on organism-wide builds it (one build: an organism.py process, the test's few seconds), reads its task,
    whose problems span one to five operations, and records it."""
    run = tmp_path / "run"
    sizes = dict(model="organism-wide", batch_size=2, group_size=2, max_new_tokens=8, micro_batch_size=4,
                 num_minibatches=1, mc_every=0, eval_every=0, val_size=50, eval_size=8, test_size=8,
                 eval_max_new_tokens=8, total_steps=1)  # fmt: skip
    proc = run_here("grpo.py", cli(run, base=sizes))
    assert proc.returncode == 0, proc.stderr
    assert "building organism-wide once" in proc.stdout  # through the cache, in organism.py's own process
    results = check_results(run, steps=1)
    folder = models.organism_folder("organism-wide")
    assert results["data"]["folder"] == str((folder / "data").resolve())
    assert results["organism"]["settings"]["min_ops"] == 1 and results["organism"]["settings"]["max_ops"] == 5
    assert "the organism's task: train" in proc.stdout
    rows = [json.loads(line) for line in (folder / "data" / "train.jsonl").read_text().splitlines()]
    assert {len(r["answer"].splitlines()) - 1 for r in rows} == {1, 2, 3, 4, 5}  # worked lines before "#### N"


# ------------------------------------------------------------------------------------------------------
# GRPO's baseline measured on Monte Carlo returns
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [2, 4, 8, 16])
def test_the_measured_group_mean_reads_one_over_g_minus_one(group):
    """Bernoulli returns of prompts whose success rates spread over (0, 1): the split-sample measurement is unbiased
    for 1/(G-1) whatever the rates, so the formula lies inside a few of its own standard errors."""
    g = torch.Generator().manual_seed(group)
    p = torch.rand(4000, 1, generator=g)
    returns = (torch.rand(4000, 20, generator=g) < p).float()
    err, scale = measure.group_mean_error(returns, group, seed=1)
    nmse, lo, hi = intervals.ratio_interval(err.tolist(), scale.tolist())
    se = (hi - lo) / (2 * 1.96)
    assert abs(nmse - intervals.group_nmse(group)) < 4 * se, (nmse, lo, hi)


def test_the_measured_group_means_scale_is_the_prompts_p_one_minus_p():
    """The scale each prompt contributes estimates its p(1-p) without bias (the K returns' variance, K - 1 below):
    its mean over 4,000 prompts lies within 5% of E[p(1-p)] (~0.17, a standard error of ~1% of it)."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(4000, 1, generator=g)
    returns = (torch.rand(4000, 20, generator=g) < p).float()
    _, scale = measure.group_mean_error(returns, 2, seed=1)
    assert scale.mean().item() == pytest.approx((p * (1 - p)).mean().item(), rel=0.05)
    assert torch.all(scale >= 0) and math.isfinite(scale.sum().item())


def test_too_few_samples_for_the_group_is_refused():
    with pytest.raises(ValueError, match="needs at least 17 Monte Carlo samples"):
        measure.group_mean_error(torch.zeros(3, 16), 16)
