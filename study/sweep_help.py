"""The sweep's --help: what ./sweep.sh does and in what order, every experiment of the plan with its runs a seed and
what the plan's own comment says of it, and examples.

Text for a person, read from sweep.sh's plan: it builds no command and runs nothing (study/sweep_runner.py does,
and calls help_text when it parses its options). Imports plumbing/cmdline.py alone (no torch: sweep.sh starts
before any trainer).
"""

from __future__ import annotations

import re

from plumbing import cmdline


def describe(text: str, experiments: list[str]) -> dict[str, str]:
    """Each experiment's line in --help, from the plan's own comments: a comment `# NAME: what it is...` (or
    `# NAME (a note): ...`) and the comment lines under it, up to the first full stop."""
    rows = text.splitlines()
    out = {}
    for i, row in enumerate(rows):
        m = re.fullmatch(r"#\s*([\w-]+)(?:\s*\([^)]*\))?:\s*(.*)", row.strip())
        if not m or m.group(1) not in experiments or m.group(1) in out:
            continue
        words = [m.group(2)]
        for more in rows[i + 1 :]:
            if not more.startswith("#"):
                break
            words.append(more.lstrip("# "))
        out[m.group(1)] = re.split(r"\.(?:\s|$)", " ".join(words))[0]
    return out


def help_text(
    plan: str, lines: list[tuple[str, str, str, list[str]]], default: list[str], opening: str, smallest_effect: float
) -> str:
    """--help's description: the opening line (sweep_runner.py's docstring's), what the sweep does and in what order
    (the preflight's smallest effect named), the experiments, examples."""
    experiments = list(dict.fromkeys(e for e, *_ in lines))
    about = describe(plan, experiments)
    width = max(len(e) for e in experiments) + 2
    rows = []
    for e in experiments:
        n = sum(1 for ln in lines if ln[0] == e and not ln[2].startswith("study."))
        steps = sum(1 for ln in lines if ln[0] == e and ln[2].startswith("study."))  # once for every seed
        first = f"  {e:<{width}}{'*' if e in default else ' '} "
        count = f"{n} runs a seed" + (f" and {steps} step{'s' * (steps > 1)}" if steps else "")
        rows.append(cmdline.fill(f"{count}{': ' + about[e] if e in about else ''}", first, " " * len(first)))
    paragraphs = [
        "The runs go to OUT/<experiment>/<name>-s<seed>, the report to OUT/report/ (report.md, summary.csv, runs.csv "
        "and three plots). Each trainer's command is its plan line's, with the sweep's --run-dir, --seed, --model, "
        "--scale and --no-progress; the flags after -- (./sweep.sh [OPTIONS] -- FLAGS) come last in every command, "
        "so they win.",
        "The preflight first (study/preflight.py, on this machine; reused from OUT/preflight.json when its command is "
        "the same): it samples the reference GRPO line (--budget-from) with the sweep's settings and predicts the "
        "half-width of the report's 3-seed interval of GRPO's nmse at the prompt. When that is wider than the "
        f"smallest effect worth detecting ({smallest_effect:g}, preflight.py's --smallest-effect; --smoke asks for "
        "none, only some signal), or cannot be predicted (no prompt with 0 < p < 1), the sweep stops with exit status "
        "3 before any run folder exists, unless --force.",
        "A finished run (results.json) is skipped, an interrupted one resumes from its checkpoint, a damaged "
        "results.json is kept aside (results.json.damaged-TIME) and the run redone. A PPO line whose flags are "
        "another's without --count-critic-init-tokens (the amortised twin of that paid run) continues the paid run's "
        "last checkpoint once it has finished (not under --launcher slurm): under a constant learning rate the paid "
        "run is its first steps. A "
        "failed run is logged (OUT/logs/<experiment>/<run>.log), the others go on, and the summary names it (exit "
        "status 1). A lock "
        "(OUT/.lock) keeps a second sweep, or a trainer, off the folder. More in docs/sweep.md.",
    ]
    examples = [
        ("./sweep.sh --dry-run", "every command, run nothing"),
        ("./sweep.sh --smoke", "all of it on the CPU, a tiny random model, in minutes"),
        ("./sweep.sh --organism", "the study on the model organism, on 2 CPU cores, under 2 hours"),
        ("./sweep.sh --organism --experiments crossover", "where a pretrained critic equals GRPO's G: ~95 min"),
        ("./sweep.sh --organism --experiments spread,size", "how that moves with the task's spread and the size"),
        ("./sweep.sh --preflight", "only the preflight: has the model the signal the study needs?"),
        ("./sweep.sh --experiments h2h --seeds 1,2", "a subset"),
        ("./sweep.sh --gpus 8", "one run per GPU at a time, on this machine"),
        ('./sweep.sh --launcher slurm --sbatch "-p gpu"', "one SLURM array task per run"),
        ("./sweep.sh -- --eval-size 256", "a flag for every trainer"),
        ("./sweep.sh --report-only", "the report again, from the runs already there"),
    ]
    wide = max(len(c) for c, _ in examples) + 4
    examples_text = "\n".join(cmdline.fill(what, f"  {c:<{wide - 2}}", " " * wide) for c, what in examples)
    return "\n\n".join(
        [
            cmdline.fill(opening),
            *map(cmdline.fill, paragraphs),
            "experiments (* runs unless --experiments says otherwise):\n" + "\n".join(rows),
            "examples:\n" + examples_text,
        ]
    )
