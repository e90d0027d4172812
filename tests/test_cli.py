"""The trainers' command line: every choice is a Literal that --help lists and tyro refuses when wrong (one
`error:` line, exit 2, nothing written); the CPU scale is a preset passed to tyro as its default, so that
--help shows what runs on this machine; the step's named sums are reduced in one call."""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest
import torch
from helpers import TINY, check_one_error_line, cli, run_here

from plumbing import cmdline, distributed, runtime

# (script, flag, the choices --help must list)
CHOICES = [
    ("ppo.py", "--critic", "none,small,medium,large,full"),
    ("ppo.py", "--kl-mode", "loss,reward"),
    ("ppo.py", "--lr-schedule", "constant,linear,cosine"),
    ("ppo.py", "--scale", "auto,study,cpu"),
    ("ppo.py", "--prompt-format", "chat,question,plain"),
    ("ppo.py", "--task", "gsm8k,toy"),
    ("grpo.py", "--baseline", "mean,loo"),
    ("grpo.py", "--scale-rewards", "group,none"),
    ("grpo.py", "--loss-norm", "token,sequence,constant"),
    ("dpo.py", "--pairs", "self,gold"),
    ("dpo.py", "--loss", "sigmoid,ipo"),
]


def help_text(script: str, monkeypatch, capsys, gpu: bool = False) -> str:
    """`python script --help` in this process, on a machine with or without a GPU."""
    module = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    with pytest.raises(SystemExit) as e:
        runtime.cli(module.Args, module.CPU_SCALE, ["--help"])
    assert e.value.code == 0
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().out).split())  # the box's lines joined


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "dpo.py"])
def test_help_lists_every_choice_and_the_preset_that_runs_here(script, monkeypatch, capsys):
    text = help_text(script, monkeypatch, capsys)
    for s, flag, choices in CHOICES:
        if s == script or flag in ("--lr-schedule", "--scale", "--prompt-format", "--task"):
            assert f"{flag} {{{choices}}}" in text, flag
    module = importlib.import_module(script.removesuffix(".py"))
    # without a GPU the defaults shown are the CPU preset's; with one, the study's
    for key, value in module.CPU_SCALE["organism"].items():
        flag = "--" + key.replace("_", "-")
        shown = re.search(rf"{flag} \S+ .*?\(default: ([^)]*)\)", text)
        assert shown and shown.group(1) == str(value), (flag, shown and shown.group(1))
    study = help_text(script, monkeypatch, capsys, gpu=True)
    assert re.search(rf"--batch-size INT .*?\(default: {module.Args().batch_size}\)", study)
    assert "completions-per-step" not in text and "optimizer-steps" not in text  # filled at runtime, not flags


BAD = {
    "unknown critic": ("ppo.py", ["--critic", "bogus"], "--critic", "none", "full"),
    "unknown task": ("ppo.py", ["--task", "bogus"], "--task", "gsm8k", "toy"),
    "unknown loss norm": ("grpo.py", ["--loss-norm", "mean"], "--loss-norm", "token", "constant"),
    "unknown pairs": ("dpo.py", ["--pairs", "silver"], "--pairs", "self", "gold"),
    "malformed number": ("ppo.py", ["--batch-size", "eight"], "--batch-size", "eight", "int"),
    "the old flag": ("ppo.py", ["--rollouts-per-prompt", "2"], "--rollouts-per-prompt", "Unrecognized", ""),
    "the removed --print-args": ("grpo.py", ["--print-args"], "--print-args", "Unrecognized", ""),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_flag_is_one_error_line_and_nothing_written(tmp_path, case):
    script, flags, named, *words = BAD[case]
    proc = run_here(script, cli(tmp_path / "run") + flags)
    line = check_one_error_line(proc)
    assert proc.returncode == 2
    assert named in line and all(w in line for w in words), line
    assert not (tmp_path / "run").exists()


# a flag of another trainer given to this one: the one line says whose flag it is (its value not listed as an option)
FOREIGN = [
    ("grpo.py", ["--critic", "small"], "--critic is ppo.py's flag, not grpo.py's"),
    ("dpo.py", ["--critic=small"], "--critic is ppo.py's flag, not dpo.py's"),
    ("dpo.py", ["--mc-every", "2"], "--mc-every is ppo.py's and grpo.py's flag, not dpo.py's"),
    ("ppo.py", ["--beta", "0.2", "--scale-rewards", "none"],
     "--beta is dpo.py's flag, not ppo.py's; --scale-rewards is grpo.py's flag, not ppo.py's"),
    ("ppo.py", ["--no-online"], "--no-online is dpo.py's flag, not ppo.py's"),
    ("grpo.py", ["--critic", "small", "--critc", "x"], "--critic is ppo.py's flag, not grpo.py's; Unrecognized options: --critc, x"),
]  # fmt: skip


@pytest.mark.parametrize(("script", "flags", "said"), FOREIGN, ids=[" ".join([f[0], *f[1]]) for f in FOREIGN])
def test_another_trainers_flag_is_named_as_its(tmp_path, script, flags, said):
    base = {k: v for k, v in TINY.items() if k not in ("num-minibatches", "mc-every")} if script == "dpo.py" else None
    proc = run_here(script, cli(tmp_path / "run", base) + flags)
    assert check_one_error_line(proc) == f"error: {said}" and proc.returncode == 2
    assert not (tmp_path / "run").exists()


def test_a_flag_no_trainer_has_is_tyros_refusal_alone(tmp_path):
    proc = run_here("ppo.py", cli(tmp_path / "run") + ["--critc", "small"])
    assert check_one_error_line(proc) == "error: Unrecognized options: --critc, small"


@pytest.mark.parametrize("script", cmdline.TRAINERS)
def test_the_trainers_flags_read_from_source_are_their_args(script):
    """cmdline reads each trainer's flags from its source (it may not import a trainer): the same as its Args's
    fields, less those filled at runtime (tyro.conf.Suppress, not flags); and their defaults."""
    module = importlib.import_module(script.removesuffix(".py"))
    fields = {f.name for f in dataclasses.fields(module.Args) if "Suppress" not in str(f.type)}
    assert cmdline.trainer_flags(script) == fields
    for f in dataclasses.fields(module.Args):  # and each default, as the study's figures read one
        assert cmdline.trainer_default(script, f.name) == f.default, f.name


def test_the_scale_picks_a_preset_and_flags_given_win(monkeypatch):
    from ppo import CPU_SCALE, Args

    cpu, preset = CPU_SCALE, runtime.cpu_preset(Args, CPU_SCALE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args, changed = runtime.cli(Args, cpu, ["--batch-size", "6"])
    assert (args.batch_size, args.max_new_tokens, changed) == (6, Args().max_new_tokens, [])  # auto on a GPU
    args, changed = runtime.cli(Args, cpu, ["--scale", "cpu", "--batch-size", "6"])
    assert args.batch_size == 6 and args.max_new_tokens == preset.max_new_tokens
    assert f"max_new_tokens {Args().max_new_tokens} -> {preset.max_new_tokens}" in changed
    assert not any(c.startswith("batch_size") for c in changed)
    args, _ = runtime.cli(Args, cpu, ["--device", "cpu"])  # auto where --device resolves to the CPU
    assert args.total_steps == preset.total_steps
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args, changed = runtime.cli(Args, cpu, ["--scale", "study"])
    assert args == Args(scale="study") and changed == []


def test_the_command_line_is_parsed_once(monkeypatch):
    """runtime.cli reads --scale and --device first, then runs tyro once, with the chosen preset as its default."""
    import tyro

    from ppo import CPU_SCALE, Args

    calls: list = []
    real = tyro.cli
    monkeypatch.setattr(tyro, "cli", lambda *a, **k: calls.append(k.get("default")) or real(*a, **k))
    cpu = runtime.cpu_preset(Args, CPU_SCALE)
    for gpu, flags, preset in [
        (False, ["--batch-size", "6"], cpu),
        (True, ["--batch-size", "6"], Args()),
        (True, ["--scale=cpu"], cpu),
        (True, ["--device=cpu"], cpu),  # auto, where --device resolves to the CPU
        (False, ["--scale", "study", "--device", "cpu"], Args()),
        (False, ["--device", "cpu", "--scale", "auto", "--scale", "study"], Args()),  # the last one given counts
    ]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        calls.clear()
        args, _ = runtime.cli(Args, CPU_SCALE, flags)
        assert calls == [preset], (gpu, flags)
        assert args.max_new_tokens == preset.max_new_tokens


def test_a_flag_given_is_never_reported_as_scaled(monkeypatch):
    """Under the CPU preset, a flag given with the study's default wins and so does one given with the preset's own
    value (in any spelling tyro takes: dashes or underscores, `=` or a space); neither is reported as scaled, and
    every field left to the preset that differs from the study's is."""
    from ppo import CPU_SCALE, Args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    study, preset = Args(), CPU_SCALE["smollm2"]
    flags = ["--model", "smollm2", "--num-minibatches", str(study.num_minibatches),
             f"--max_new_tokens={preset['max_new_tokens']}", "--total-steps", str(preset["total_steps"]),
             "--no-progress"]  # fmt: skip
    args, changed = runtime.cli(Args, CPU_SCALE, flags)
    assert args.num_minibatches == study.num_minibatches and args.progress is False
    assert (args.max_new_tokens, args.total_steps) == (preset["max_new_tokens"], preset["total_steps"])
    left = [k for k in preset if k not in ("model", "num_minibatches", "max_new_tokens", "total_steps")]
    assert changed == [f"{k} {getattr(study, k)} -> {preset[k]}" for k in Args.__dataclass_fields__ if k in left]
    for k in left:
        assert getattr(args, k) == preset[k]


def test_help_shows_the_preset_the_flags_given_choose(monkeypatch, capsys):
    """--scale study --help on a machine without a GPU shows the study's defaults: the ones that would run."""
    from ppo import CPU_SCALE, Args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        runtime.cli(Args, CPU_SCALE, ["--scale", "study", "--help"])
    assert e.value.code == 0
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().out).split())
    assert re.search(rf"--batch-size INT .*?\(default: {Args().batch_size}\)", text), text[:400]


def test_all_reduce_sums_returns_each_named_sum_as_a_float():
    sums = {"tokens": torch.tensor(3.0), "count": 2.0, "lengths": torch.tensor(7), "p": torch.tensor(0.1).double()}
    out = distributed.all_reduce_sums(sums)
    assert out == {"count": 2.0, "lengths": 7.0, "p": float(torch.tensor(0.1)), "tokens": 3.0}
    assert all(type(v) is float for v in out.values())


# tyro draws its error box with rich: in a terminal or a pipe with box characters and the title in the top border;
# under pytest's capture (run_here) plain, the title on its own line above a rule of dashes. Both captured verbatim.
BOXES = {
    "rich": "╭─ Invalid choice ─────────────────────────────────────────────────────────────╮\n"
    "│ invalid choice 'bogus' for argument '--task'. Expected one of ('gsm8k',      │\n"
    "│ 'toy').                                                                      │\n"
    "│ ──────────────────────────────────────────────────────────────────────────── │\n"
    "│ For full helptext, run - --help                                              │\n"
    "╰──────────────────────────────────────────────────────────────────────────────╯\n",
    "plain": " Invalid choice                                                                 \n"
    " ------------------------------------------------------------------------------ \n"
    "  invalid choice 'bogus' for argument '--task'. Expected one of ('gsm8k', 'toy')\n"
    "  .                                                                             \n"
    "  ------------------------------------------------------------------------------\n"
    "  For full helptext, run ppo.py --help                                          \n"
    "                                                                                \n",
}


@pytest.mark.parametrize("form", list(BOXES))
def test_tyro_error_box_becomes_its_message(form):
    assert (
        cmdline.tyro_message(BOXES[form])
        == "invalid choice 'bogus' for argument '--task'. Expected one of ('gsm8k', 'toy')."
    )


def test_an_unknown_choice_in_process_is_the_same_one_line(tmp_path):
    """run_here (pytest's capture, tyro's plain box) gives the line a terminal gives: the message, not the help hint."""
    proc = run_here("ppo.py", cli(tmp_path / "run") + ["--task", "bogus"])
    assert proc.returncode == 2 and "invalid choice 'bogus' for argument '--task'" in proc.stderr, proc.stderr
    assert "helptext" not in proc.stderr and not (tmp_path / "run").exists()


def test_help_into_a_closed_pipe_is_no_traceback():
    """`python ppo.py --help | head`: the reader goes away before the help is written; the trainer exits without a
    traceback (Python's advice for a broken pipe: stdout to devnull, exit 1), as a Unix tool would."""
    import subprocess
    import sys

    from helpers import REPO, trainer_env

    proc = subprocess.Popen([sys.executable, "ppo.py", "--help"], cwd=REPO, env=trainer_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    proc.stdout.close()  # before the interpreter has imported torch: every write of the help fails
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err
