"""What a person reads first: `--help` of the trainers, report.py, the preflight and sweep.sh (an opening line that says
what the script does, each default once, no line broken inside a phrase, no advice to install what requirements.txt
installs), and the banner a trainer prints before it runs (every setting once, grouped as Args groups them, no
line over 120 characters). In this process, through the scripts' own parsing."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import cli

from plumbing import logs, runtime

ROOT = Path(__file__).resolve().parents[1]
# `python report.py` runs study/report.py's main (the root's report.py is its entry point), and
# `python -m study.preflight` the preflight: the help a person reads is these modules'
SCRIPTS = ["ppo.py", "grpo.py", "dpo.py", "study/report.py", "study/preflight.py"]
BANNER_WIDTH = 120


def module_of(script: str):
    """The module a script's path names: "study/report.py" -> study.report."""
    return importlib.import_module(script.removesuffix(".py").replace("/", "."))


def help_of(script: str, monkeypatch, capsys, columns: int) -> str:
    """`python script --help` in this process, on a terminal `columns` wide (no GPU: the CPU preset's defaults)."""
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = module_of(script)
    with pytest.raises(SystemExit) as e:
        if hasattr(module, "CPU_SCALE"):  # a trainer
            runtime.cli(module.Args, module.CPU_SCALE, ["--help"])
        else:
            module.main(["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def entries(text: str) -> dict[str, list[str]]:
    """The help's arguments: each one's first line (its flags) -> its description lines, box borders dropped.
    tyro prints an argument's flags at the left, its description in a column to the right (on the next lines when
    the flags are long)."""
    out: dict[str, list[str]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.rstrip().removesuffix("│").rstrip()
        if not line.startswith(("│", "  ")) or set(line.strip()) <= set("─-"):
            current = None  # usage, the description, a box's title or rule
            continue
        body = line[2:]  # "│ " in a box (a terminal), two spaces in plain text (a pipe)
        if body[:1] not in (" ", ""):  # a new argument: its flags, then (two spaces on) its description
            flags, _, desc = body.partition("  ")
            current = flags
            out[current] = [desc.strip()] if desc.strip() else []
        elif current is not None:
            out[current].append(body.strip())
    return out


def first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_opens_with_what_the_script_does(script, monkeypatch, capsys):
    """The first line of the help after the usage: the script's docstring's first line (wrapped at words)."""
    module = module_of(script)
    for columns in (200, 80):
        text = help_of(script, monkeypatch, capsys, columns)
        before_options = text.split("-h, --help")[0].split(" options")[0].split(" positional arguments")[0]
        opening = [line for line in before_options.splitlines() if line.strip() and not line.startswith("usage:")]
        assert opening and " ".join(" ".join(opening).split()).startswith(first_line(module.__doc__)), opening[:2]
        assert all(len(line) <= columns for line in opening), f"the opening runs past {columns} columns: {opening}"


def opening_of(script: str, flags: list[str], monkeypatch, capsys, gpu: bool = False) -> str:
    """The help's text above its options, joined into one line: what `python script FLAGS --help` says first."""
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    module = importlib.import_module(script.removesuffix(".py"))
    with pytest.raises(SystemExit):
        runtime.cli(module.Args, module.CPU_SCALE, [*flags, "--help"])
    text = capsys.readouterr().out.split("-h, --help")[0].split(" options")[0]
    return " ".join(line for line in text.splitlines()[1:] if line.strip()).replace("  ", " ").strip()


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "dpo.py"])
def test_help_says_first_that_the_cpu_preset_runs_the_organism(script, monkeypatch, capsys):
    """Without a GPU the defaults --help shows are the CPU preset's (the organism, its learning rate and batch):
    the opening says so before the first option, and how to see the study's; with a GPU, or --scale study, the
    defaults are the study's and no such sentence is there; --model smollm2 names its own preset, not the organism."""
    module = importlib.import_module(script.removesuffix(".py"))
    said = " ".join(opening_of(script, [], monkeypatch, capsys).split())
    assert said.startswith(first_line(module.__doc__)), said
    assert "No GPU here: the defaults below are the CPU preset, the model organism" in said, said
    assert "not GSM8K" in said and "--scale study" in said, said
    for flags, gpu in (([], True), (["--scale", "study"], False)):
        said = " ".join(opening_of(script, flags, monkeypatch, capsys, gpu).split())
        assert "CPU preset" not in said and "organism" not in said, (flags, gpu, said)
    said = " ".join(opening_of(script, ["--model", "smollm2"], monkeypatch, capsys).split())
    assert "the CPU preset of --model smollm2" in said and "organism" not in said, said


def help_problems(text: str) -> list[str]:
    """An argument that shows "(default:" twice, and a description broken onto a new line where the next word would
    have fitted: tyro fills each line of the description's column, so a break in the middle of a phrase (a
    docstring's own line break) leaves a line shorter than the column's widest."""
    found = entries(text)
    widest = max((len(line) for lines in found.values() for line in lines), default=0)
    problems = []
    for flags, lines in found.items():
        if " ".join(lines).count("(default:") > 1:
            problems.append(f"{flags}: two defaults: {' '.join(lines)}")
        for this, following in zip(lines, lines[1:]):
            word = following.split()[0]
            if len(this) + 1 + len(word) <= widest:
                problems.append(f"{flags}: broken mid-phrase after {this!r} (next: {word!r})")
    return problems


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("columns", [80, 120])
def test_help_shows_each_default_once_and_breaks_lines_only_where_they_are_full(script, columns, monkeypatch, capsys):
    """No argument shows "(default:" twice (its docstring says what a value means, tyro prints the default), and no
    description breaks in the middle of a phrase (help_problems)."""
    text = help_of(script, monkeypatch, capsys, columns)
    assert len(entries(text)) > 3, text[:500]
    assert not help_problems(text)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_never_asks_to_install_what_requirements_installs(script, monkeypatch, capsys):
    text = " ".join(help_of(script, monkeypatch, capsys, 200).split())
    required = {re.split(r"[<>=\s#]", line)[0].lower() for line in (ROOT / "requirements.txt").read_text().splitlines()}
    for package in re.findall(r"pip install ([\w.-]+)", text):
        assert package.lower() not in required, f"--help says `pip install {package}`; requirements.txt installs it"


def banner_of(script: str, flags: list[str], monkeypatch) -> tuple[str, object, list[str]]:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = module_of(script)
    args, scaled = runtime.cli(module.Args, module.CPU_SCALE, flags)
    dist_ = SimpleNamespace(device=torch.device("cpu"), world=1)
    extra = {"model": "tiny (3,219,776 parameters)", "run_dir": "runs/x"}
    return logs.describe_run(module.METHOD.upper(), args, dist_, extra, scaled), args, scaled


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "dpo.py"])
def test_the_banner_shows_every_setting_once_grouped_as_args_and_within_120_columns(script, monkeypatch):
    text, args, scaled = banner_of(script, ["--total-steps", "1", "--model", "tiny"], monkeypatch)
    lines = text.splitlines()
    assert lines[0] == f"== {script.removesuffix('.py').upper()} ==" and "runs/x" in text
    long = [line for line in lines if len(line) > BANNER_WIDTH]
    assert not long, f"{len(long)} lines over {BANNER_WIDTH} characters, the longest {max(map(len, long))}"
    names = [f.name for f in dataclasses.fields(args)]
    shown = [m.group(1) for line in lines for m in re.finditer(r"(?:^|\s)(\w+)=\S*", line)]
    assert shown == names, "every setting once, in Args's order, each name=value whole on one line"
    for f in dataclasses.fields(args):  # its value as the run sees it (a 0 or None that means more: the next test)
        value = getattr(args, f.name)
        if value in logs.MEANINGS.get(f.name, {}) or (value is None and f.name in logs.FALLBACKS):
            continue
        assert re.search(rf"(?:^|\s){f.name}={re.escape(str(value))}(?:\s|$)", text), f.name
    source = (ROOT / script).read_text()
    groups = [g.split(",")[0].strip() for g in re.findall(r"\n    # --- (.+?) ---\n", source.split("class Args")[1])]
    labels = [line.split(":")[0].strip() for line in lines if line.startswith("  ") and not line.startswith("    ")]
    assert labels == groups, labels  # one group a line (its continuation lines indented further)
    # the CPU preset's changes: a short list, each change whole on one line
    assert scaled and all(any(change in line for line in lines) for change in scaled), scaled


# a setting whose 0 or None means something else than that number, given so, and what the banner shows for it
ZERO_MEANS = {
    "test-size": ("0", "test_size=all"),
    "eval-size": ("0", "eval_size=all"),
    "token-budget": ("0", "token_budget=none"),
    "eval-every": ("0", "eval_every=end-only"),
    "save-every": ("0", "save_every=end-only"),
}
OWN_ZERO_MEANS = {
    "ppo.py": {"mc-every": ("0", "mc_every=never"), "vf-clip": ("0", "vf_clip=off")},
    "grpo.py": {"mc-every": ("0", "mc_every=never"), "clip-eps": ("0.3", "clip_eps_high=0.3")},  # None: clip_eps
    "dpo.py": {},
}


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "dpo.py"])
def test_the_banner_shows_what_a_zero_or_none_means_not_the_zero(script, monkeypatch):
    """test_size=0 is the whole test split, run_dir=None a folder named for the run: the banner shows what the run
    does (the folder it writes, "all"), never the 0 or None a reader would take for a count or an absence."""
    given = {**ZERO_MEANS, **OWN_ZERO_MEANS[script]}
    flags = [x for flag, (value, _) in given.items() for x in (f"--{flag}", value)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = importlib.import_module(script.removesuffix(".py"))
    args, scaled = runtime.cli(module.Args, module.CPU_SCALE, ["--model", "tiny", *flags])
    dist_ = SimpleNamespace(device=torch.device("cpu"), world=1)
    text = logs.describe_run(module.METHOD.upper(), args, dist_, {}, scaled, Path("runs/x-s1"), "/data/gsm8k")
    shown = set(text.split())
    for _, said in given.values():
        assert said in shown, (said, text)
    assert {"run_dir=runs/x-s1", "data_dir=/data/gsm8k", "wandb_entity=default"} <= shown, text
    assert not re.search(r"\b(test_size|eval_size|token_budget|eval_every|save_every|mc_every|vf_clip)=0\b", text)
    assert not re.search(r"\b(run_dir|data_dir|wandb_entity|clip_eps_high)=None\b", text), text


class BannerShown(Exception):
    """Raised by the patched describe_run: the banner a trainer prints, and nothing after it."""


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "dpo.py"])
def test_a_trainer_shows_the_run_folder_and_the_data_it_actually_uses(script, tmp_path, monkeypatch):
    """A run without --run-dir or --data-dir: its banner names the folder it writes (runs/<name>, relative to where it
    runs) and the data folder it read, where the settings once said run_dir=None and data_dir=None."""
    from helpers import TINY, gsm8k_sample_dir, run_in_process

    monkeypatch.chdir(tmp_path)
    real = logs.describe_run

    def shown(*a, **k):
        raise BannerShown(real(*a, **k))

    monkeypatch.setattr(logs, "describe_run", shown)
    dpo = {k: v for k, v in TINY.items() if k not in ("num-minibatches", "mc-every")}  # flags dpo.py has not
    flags = cli(tmp_path / "unused", dpo if script == "dpo.py" else None, test_size=0)[2:]  # no --run-dir
    with pytest.raises(BannerShown) as e:
        run_in_process(script, flags)
    text = str(e.value)
    run_dir = re.search(r"^run_dir: (\S+)", text, re.M).group(1)
    assert run_dir.startswith(f"runs/{script.removesuffix('.py')}-") and f"run_dir={run_dir}" in text.split(), text
    folder = str(Path(gsm8k_sample_dir()).resolve())
    assert f"data_dir={folder}" in text.split() and "test_size=all" in text.split(), text


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "dpo.py"])
def test_the_banner_says_no_gpu_the_organism_only_when_the_cpu_preset_chose_it(script, monkeypatch):
    """Without a GPU and without --model the preset runs the organism, and the banner's second line says so; a
    --model organism given, or another model, prints no such line (the user chose it)."""
    chosen = banner_of(script, ["--total-steps", "1"], monkeypatch)[0].splitlines()
    assert chosen[1].startswith("no GPU: the model organism"), chosen[:3]
    assert max(map(len, chosen)) <= BANNER_WIDTH, max(chosen, key=len)  # that line too, wrapped
    for flags in (["--model", "organism"], ["--model", "tiny"]):
        text = banner_of(script, ["--total-steps", "1", *flags], monkeypatch)[0]
        assert "no GPU: the model organism" not in text, flags


def test_the_checks_catch_a_phrase_broken_by_a_docstring_and_a_second_default():
    """The help as tyro printed --model before (its docstring's own line break) and --run-dir (two defaults)."""
    text = (
        "  --model STR            qwen2.5-0.5b (the study's, from the hub), qwen2.5-1.5b, smollm2-360m, smollm2-1.7b\n"
        "                         (the packaged\n"
        "                         SmolLM2-135M-Instruct GGUF), a hub id, folder or .gguf (default: smollm2)\n"
        "  --run-dir {None}|STR   folder for the checkpoint (default: runs/ppo-{critic}-s{seed}) (default: None)\n"
    )
    assert list(entries(text)) == ["--model STR", "--run-dir {None}|STR"]
    problems = help_problems(text)
    assert len(problems) == 2 and "after '(the packaged'" in problems[0] and "two defaults" in problems[1], problems


def sweep_help(monkeypatch, capsys, columns: int) -> str:
    """`./sweep.sh --help` in this process (sweep_runner on sweep.sh's plan), on a terminal `columns` wide."""
    from study import sweep_runner

    monkeypatch.setenv("COLUMNS", str(columns))
    plan = (ROOT / "sweep.sh").read_text().split("<<'PLAN'\n")[1].split("\nPLAN")[0]
    lines, _ = sweep_runner.read_plan(plan)
    experiments = list(dict.fromkeys(e for e, *_ in lines))
    with pytest.raises(SystemExit) as e:  # sweep.sh's own flags first, as it passes them
        sweep_runner.parse_args(["--default-experiments", "h2h,critic,labels", "--help"], experiments, plan)
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("columns", [80, 120])
def test_the_sweeps_help_says_what_it_does_lists_the_experiments_and_shows_examples(columns, monkeypatch, capsys):
    """A person reads `./sweep.sh --help`: the opening line, the preflight's rule as preflight.py applies it (the
    3-seed half-width of GRPO's nmse against the smallest effect, not an informative-share threshold), every
    experiment of the plan with its runs a seed and what it is, which run by default, examples; every option once,
    each default once, no line broken mid-phrase and none past the terminal."""
    from study import preflight, sweep_runner

    text = sweep_help(monkeypatch, capsys, columns)
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())
    assert flat.startswith(f"usage: ./sweep.sh [-h] [OPTIONS] {first_line(sweep_runner.__doc__)}"), flat[:200]
    assert "3-seed interval of GRPO's nmse at the prompt" in flat and "threshold" not in flat
    assert f"smallest effect worth detecting ({preflight.SMALLEST_EFFECT:g}, preflight.py's --smallest-effect" in flat
    for row in ["h2h * 9 runs a seed: the three methods at matched compute", "critic-lambda 4 runs a seed: the critics",
                "labels * 4 runs a seed: DPO's label regimes", "critic * 5 runs a seed: every capacity"]:  # fmt: skip
        assert row in flat, row
    assert "examples: ./sweep.sh --dry-run" in flat and "./sweep.sh -- --eval-size 256 a flag for every trainer" in flat
    lines = text.splitlines()
    options_box = "\n".join(lines[next(i for i, line in enumerate(lines) if "-h, --help" in line) :])
    options = entries(options_box)  # the description above is wrapped by cmdline.fill: the check is for tyro's part
    for flag in ["--experiments", "--seeds", "--model", "--scale", "--out", "--launcher", "--gpus", "--jobs", "--sbatch",
                 "--dry-run", "--smoke", "--report-only", "--preflight", "--preflight-prompts", "--force"]:  # fmt: skip
        assert any(f.split()[0] == flag for f in options), flag
    assert "(default:h2h,critic,labels)" in "".join("".join(options["--experiments STR"]).split())  # sweep.sh's
    assert not help_problems(options_box)
    assert all(len(line) <= columns for line in lines), max(lines, key=len)
