"""The named organisms (plumbing/models.py ORGANISMS: --model organism-small, -large, -wide): each name resolves to
its own recipe and cache folder, selects the organism's CPU preset and its own settings, builds the same files twice
on one machine (a seconds-long version of each recipe: the tests' tiny sizes, then the recipe's knobs), and is read
by the trainers as the organism is; an unknown one is one `error:` line before anything is written. And GRPO's
baseline measured on Monte Carlo returns (measure.group_mean_error), the crossover study's line for G."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import check_ok, check_one_error_line, check_results, cli, run_here
from test_organism import TINY_FLAGS, flags

import intervals
import measure
from plumbing import models, runtime

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
    assert models.why_not_shipped(models.ORGANISM) is None  # only the organism is the shipped build
    for name in BUILT:
        assert models.why_not_shipped(name) == "the repository ships organism alone"
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
    assert base == json.loads((models.SHIPPED_ORGANISM / models.ORGANISM_RECORD).read_text())["report"]["parameters"]
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
