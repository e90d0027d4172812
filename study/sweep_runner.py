"""The study's sweep: every run of the plan in sweep.sh, one per plan line and seed, then the report.

Run ./sweep.sh (it passes the plan on stdin), not this file. Holds: the options (Args, parsed by tyro), the plan's
reading (one run per plan line and seed; a study module's line, a step such as the critics' learning curve, once for
every seed), each run's state (finished, resume or new; a damaged results.json or a run that never saved is set aside,
never deleted), the matched budget read from a reference run (each experiment's own), the launchers (one after
another, a pool over GPUs or CPU jobs, torchrun, SLURM arrays), the logs and status files, the lock on the sweep's
folder, the summary, and the call of report.py.
Does not hold: the experiments or their commands (sweep.sh), --help's text (sweep_help.py), any training (the
trainers, started as processes), the report (report.py). It imports plumbing/rundir.py and plumbing/cmdline.py (no torch) to read results.json, find
checkpoints and refuse links as the trainers do, and to parse its flags as every script does.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tyro

from plumbing import cmdline, rundir
from plumbing.errors import UserError
from study.sweep_help import help_text
from study.twins import fork, pair_paid

REPO = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("PYTHON") or sys.executable

# ======================================================================================================
# Options and the plan
# ======================================================================================================


@dataclass
class Args:
    experiments: str = ""
    """comma-separated experiments of the plan (above)"""
    seeds: str = "1,2,3"
    """comma-separated seeds (--smoke: 1 unless given)"""
    model: str | None = None
    """the trainers' --model; None: their scale's, qwen2.5-0.5b at study (as on a GPU), the model organism at cpu"""
    scale: Literal["auto", "study", "cpu"] = "auto"
    """the trainers' --scale (--smoke: study, whose sizes its flags set)"""
    out: Path = Path("runs/sweep")
    """folder of the runs, their logs and the report (--smoke: runs/smoke unless given)"""
    launcher: Literal["seq", "gpus", "torchrun", "slurm"] = "seq"
    """seq: one run after another; gpus: one run per GPU at a time, on this machine; torchrun: one run after another, each data-parallel over the GPUs; slurm: one array task per run (sbatch), each a torchrun over --gpus when more than 1"""
    gpus: int | None = None
    """GPUs to use; None: all visible. Without --launcher it means --launcher gpus"""
    jobs: int = 1
    """with --launcher seq: runs at once on this machine's CPU (--smoke: one a core, 2 at most, each on one thread)"""
    sbatch: str = ""
    """extra sbatch options for --launcher slurm, e.g. "--partition=gpu --time=24:00:00" """
    dry_run: bool = False
    """print what would run, run nothing"""
    smoke: bool = False
    """every experiment with --model tiny, seed 1, 2 steps and tiny evaluations, on the CPU, in minutes"""
    organism: bool = False
    """the study on the model organism (organism.py), on this machine's CPU: --model organism at --scale cpu (the trainers' organism presets), 2 runs at once each on one thread, the preflight on 128 prompts, OUT runs/organism unless given; under 2 hours on 2 cores"""
    report_only: bool = False
    """write the report from the runs already in --out"""
    preflight: bool = False
    """only the preflight, on this machine: OUT/preflight.json and one line; exit 0 with enough signal, 3 without"""
    preflight_prompts: int | None = None
    """train prompts the preflight samples, group-size times each; None: 256 on a GPU, 8 on the CPU"""
    force: bool = False
    """start the sweep without the preflight's check (an OUT/preflight.json already there still opens the report)"""
    default_experiments: str = ""
    """sweep.sh's: the experiments that run when --experiments is not given"""
    budget_from: str = ""
    """sweep.sh's: the experiment/name whose run's generated tokens and steps fill {tokens} and {steps}"""
    slurm_task: int | None = None
    """a SLURM array task's (OUT/slurm/task.sh): the index of the one run it runs"""


@dataclass
class Options:
    """The sweep's settings: Args resolved (--smoke's and --gpus's implications applied) and checked."""

    experiments: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    model: str = ""  # "": the trainers' scale picks it (study: qwen2.5-0.5b; cpu: the organism)
    scale: str = "auto"
    out: Path = Path("runs/sweep")
    launcher: str = "seq"
    gpus: int = 0  # 0: all visible
    jobs: int = 1
    sbatch: str = ""
    dry_run: bool = False
    smoke: bool = False
    organism: bool = False  # the study on the model organism, on this CPU
    report_only: bool = False
    preflight: bool = False  # only the preflight
    preflight_prompts: int = 0  # 0: preflight.py's default (256 on a GPU, 8 on the CPU; --organism's 128)
    force: bool = False  # start the sweep without the preflight
    slurm_task: int | None = None
    budget_from: str = ""  # experiment/name of the run whose tokens and steps fill {tokens} and {steps}
    extra: list[str] = field(default_factory=list)


@dataclass
class Run:
    experiment: str
    name: str
    seed: int
    script: str
    flags: list[str]  # the plan line's flags, placeholders unfilled
    dir: Path
    continues: Run | None = None  # an amortised run's paid twin, whose steps are its first (study/twins.py)

    @property
    def label(self) -> str:
        return f"{self.experiment}/{self.dir.name}"

    @property
    def needs_budget(self) -> bool:
        return any(PLACEHOLDER.search(f) for f in self.flags)

    @property
    def after_others(self) -> bool:  # it reads a budget, or what another line made in the sweep's folder ({out})
        return self.needs_budget or any("{out}" in f for f in self.flags)

    @property
    def step(self) -> bool:  # a study module's line (study.pretrain_critic): once for every seed, in OUT/<exp>/<name>
        return self.script.startswith("study.")

    @property
    def result(self) -> Path:  # the file that says it finished
        return self.dir / ("curve.json" if self.step else "results.json")


PLACEHOLDER = re.compile(r"\{(?:(\d+)\*)?(tokens|steps)\}")


def read_plan(text: str) -> tuple[list[tuple[str, str, str, list[str]]], dict[str, list[str]]]:
    """sweep.sh's plan: (experiment, name, script, flags) per run line, and the smoke flags per script ('*': all)."""
    lines, smoke = [], {}
    for n, raw in enumerate(text.splitlines(), 1):
        words = shlex.split(raw, comments=True)
        if not words:
            continue
        if len(words) < 3:
            raise UserError(f"sweep.sh's plan, line {n}: want 'experiment name script flags...', got {raw.strip()!r}")
        if words[0] == "smoke":
            smoke[words[1]] = words[2:]
        else:
            lines.append((words[0], words[1], words[2], words[3:]))
    return lines, smoke


def positive(flag: str, value: int | None) -> int:
    if value is None or value < 1:
        raise UserError(f"{flag} {value} is not a positive number")
    return value


def parse_args(argv: list[str], experiments: list[str], plan: str = "") -> Options:
    """The options (sweep.sh's, then the user's) through tyro, then resolved and checked, before anything is
    written. The words after the first `--` go to every trainer. plan: sweep.sh's text, for --help's experiments."""
    cut = argv.index("--") if "--" in argv else len(argv)
    flags, extra = list(argv[:cut]), list(argv[cut + 1 :])
    i = 0
    while i < len(flags) - 1:  # --sbatch "--partition=gpu": a value that starts with a dash, as one word
        if flags[i] == "--sbatch":
            flags[i : i + 2] = [f"--sbatch={flags[i + 1]}"]
        i += 1
    default_exp = cmdline.flag_value(flags, "default_experiments", "")
    lines = read_plan(plan)[0] if plan else [(e, "", "", []) for e in experiments]
    description = help_text(plan, lines, default_exp.split(","), __doc__.strip().splitlines()[0], SMALLEST_EFFECT)
    a = cmdline.parse(
        Args,
        Args(experiments=default_exp),
        flags,
        prog="./sweep.sh",
        description=description,
        config=(tyro.conf.FlagCreatePairsOff,),
    )
    given = cmdline.given_fields(Args, flags)

    o = Options(extra=extra, dry_run=a.dry_run, smoke=a.smoke, organism=a.organism, report_only=a.report_only)
    o.preflight = a.preflight
    if o.organism and (o.smoke or given & {"model", "scale", "gpus", "launcher"}):
        raise UserError("--organism is its own sweep, on this CPU: drop --smoke, --model, --scale, --gpus, --launcher")
    o.force, o.sbatch, o.budget_from, o.slurm_task = a.force, a.sbatch, a.budget_from, a.slurm_task
    for e in a.experiments.split(","):
        if e and e not in experiments:
            raise UserError(f"unknown experiment '{e}': choose from {', '.join(experiments)}")
        if e and e not in o.experiments:
            o.experiments.append(e)
    if not o.experiments:
        raise UserError(f"--experiments is empty: choose from {', '.join(experiments)}")
    seeds = a.seeds if "seeds" in given or not o.smoke else "1"
    for s in seeds.split(","):
        if s and not re.fullmatch(r"[0-9]+", s):
            raise UserError(f"--seeds {seeds}: '{s}' is not a seed (a whole number); e.g. --seeds 1,2,3")
        if s:
            o.seeds.append(int(s))
    if not o.seeds:
        raise UserError("--seeds is empty: give one or more seeds, e.g. --seeds 1,2,3")
    o.model = "tiny" if o.smoke else "organism" if o.organism else (a.model or "")
    o.scale = "study" if o.smoke else "cpu" if o.organism else a.scale  # --smoke's flags are the scale
    default_out = Path("runs/smoke") if o.smoke else Path("runs/organism") if o.organism else a.out
    o.out = (a.out if "out" in given else default_out).absolute()
    o.gpus = positive("--gpus", a.gpus) if a.gpus is not None else 0
    if "jobs" in given:
        o.jobs = positive("--jobs", a.jobs)
    elif o.smoke or o.organism:  # one run per core, two at most: the runs are small
        o.jobs = min(2, len(os.sched_getaffinity(0)))
    o.launcher = a.launcher if "launcher" in given or not o.gpus else "gpus"
    if o.launcher != "seq" and "jobs" in given:
        raise UserError("--jobs runs several runs at once on the CPU: it goes with --launcher seq")
    prompts = ORGANISM_PREFLIGHT_PROMPTS if a.preflight_prompts is None and o.organism else a.preflight_prompts
    if prompts is not None:
        o.preflight_prompts = positive("--preflight-prompts", prompts)
    if o.slurm_task is not None and o.slurm_task < 0:
        raise UserError(f"--slurm-task {o.slurm_task} is not a run of this plan")
    return o


def make_runs(o: Options, lines: list[tuple[str, str, str, list[str]]]) -> list[Run]:
    """One Run per chosen plan line and seed. The order is the schedule's: runs without a budget first, then those
    that read one or what another line made ({out}); within each, by experiment (in the plan's order), seed, line."""
    order = list(dict.fromkeys(e for e, *_ in lines))
    runs = []
    for budget in (False, True):
        for exp in order:
            if exp not in o.experiments:
                continue
            for seed in o.seeds:
                for e, name, script, flags in lines:
                    run = Run(e, name, seed, script, flags, o.out / e / f"{name}-s{seed}")
                    if run.step:  # a study module's line runs once for every seed, in the first seed's turn
                        run.dir = o.out / e / name
                    if e == exp and run.after_others == budget and (not run.step or seed == o.seeds[0]):
                        runs.append(run)
    return runs


# ======================================================================================================
# The runs' state, the budget, the command
# ======================================================================================================


def states(runs: list[Run], dry_run: bool) -> list[str]:
    """finished (a readable results.json), resume (a checkpoint) or new, per run. A damaged results.json is named
    and renamed aside (never deleted), so the run is redone from its checkpoint; a folder left by a run that died
    before its first checkpoint is renamed aside whole, so the run starts afresh."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = []
    for run in runs:
        if run.step:  # a step resumes by itself (pretrain_critic.py keeps what it made, and redoes nothing done)
            out.append("new")
            continue
        res = run.dir / "results.json"
        if res.exists():
            try:
                r = rundir.read_results(res)
                int(r["generated_tokens"]), int(r["steps"]), float(r["test"]["accuracy"])
                out.append("finished")
                continue
            except UserError as e:
                problem = str(e)
            except (KeyError, TypeError, ValueError) as e:
                problem = f"{res} is damaged: missing or malformed {e}"
            if dry_run:
                print(f"warning: {problem}; the sweep would set it aside and redo the run", file=sys.stderr)
            else:
                aside = res.with_name(f"results.json.damaged-{stamp}")
                res.rename(aside)
                print(f"warning: {problem}; kept as {aside.name}, redoing the run", file=sys.stderr)
        if rundir.find_checkpoint(run.dir) is not None:
            out.append("resume")
            continue
        if run.dir.is_dir() and any(p.name not in ("tb", ".lock") for p in run.dir.iterdir()):
            aside = run.dir.with_name(f"{run.dir.name}.interrupted-{stamp}")
            if dry_run:
                print(
                    f"warning: {run.dir} holds a run that never saved a checkpoint; it would move to {aside}",
                    file=sys.stderr,
                )
            else:
                run.dir.rename(aside)
                print(f"warning: {run.dir} held a run that never saved a checkpoint; moved to {aside}", file=sys.stderr)
        out.append("new")
    return out


def read_budget(ref: Path) -> tuple[int, int]:
    """A reference run's generated training tokens and steps, from its results.json."""
    path = ref / "results.json"
    if not path.is_file():
        raise UserError(f"no budget: the reference run {ref} has no results.json (failed or not run)")
    try:
        r = json.loads(path.read_text())
        tokens, steps = int(r["generated_tokens"]), int(r["steps"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"no budget: {path} is damaged ({e})") from None
    if tokens <= 0:
        raise UserError(f"no budget: {path} records no generated tokens")
    return tokens, steps


def fill(flags: list[str], budget: tuple[int, int] | None, ref: Path) -> list[str]:
    """The plan line's flags with {tokens}, {steps} and {N*steps} filled in (budget None: shown symbolically)."""

    def one(m: re.Match) -> str:
        times, what = int(m.group(1) or 1), m.group(2)
        if budget is None:
            name = f"generated_tokens of {ref}" if what == "tokens" else "its steps"
            return f"<{times} x {name}>" if times > 1 else f"<{name}>"
        return str(times * (budget[0] if what == "tokens" else budget[1]))

    return [PLACEHOLDER.sub(one, f) for f in flags]


def command(o: Options, run: Run, smoke: dict[str, list[str]], budget: tuple[int, int] | None) -> list[str]:
    """The run's command: the launcher, the script, the sweep's flags, the smoke sizes, the plan line ({out} the
    sweep's folder), the extra. A step (a study module) runs on this machine with its folder, the model and its own
    smoke sizes, no trainer's flag (its own --seed: one for every seed)."""
    model = ["--model", o.model] if o.model else []
    torchrun = ["torchrun", "--standalone", f"--nproc_per_node={o.gpus}"]
    if run.step:
        cmd = [PYTHON, "-m", run.script, "--out", str(run.dir), *model, "--no-progress"]
    else:
        prefix = torchrun if o.launcher == "torchrun" or (o.launcher == "slurm" and o.gpus > 1) else [PYTHON]
        cmd = [*prefix, run.script, "--run-dir", str(run.dir), "--seed", str(run.seed), *model, "--scale", o.scale]
        cmd += ["--no-progress"]
    if o.smoke:
        cmd += ([] if run.step else smoke.get("*", [])) + smoke.get(run.script, [])
        if "--pairs gold" not in " ".join(run.flags):
            cmd += ["--task", "toy"]
    flags = [f.replace("{out}", str(o.out)) for f in fill(run.flags, budget, reference(o, run))]
    if o.smoke:  # a line's own --model (another organism) gives way to --smoke's tiny one
        flags = without_flag(flags, "--model")
    return cmd + flags + ([] if run.step else o.extra)


def without_flag(flags: list[str], name: str) -> list[str]:
    """flags without `name VALUE` and `name=VALUE`."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f == name:
            skip = True
        elif not f.startswith(name + "="):
            out.append(f)
    return out


def reference(o: Options, run: Run) -> Path:
    """The run whose tokens and steps fill run's {tokens} and {steps}: --budget-from's of its experiment, else its
    first (--budget-from h2h/grpo-group,crossover/grpo-group: each experiment's own GRPO line)."""
    refs = o.budget_from.split(",")
    return o.out / f"{next((r for r in refs if r.split('/')[0] == run.experiment), refs[0])}-s{run.seed}"


# ======================================================================================================
# The preflight: the reference GRPO line's command, sampled by preflight.py before any run starts
# ======================================================================================================

EXIT_NO_SIGNAL = 3  # preflight.py's: the model lacks the signal the study needs
SMALLEST_EFFECT = 0.05  # preflight.py's default --smallest-effect (this file imports no torch, so not preflight)
ORGANISM_PREFLIGHT_PROMPTS = 128  # --organism's preflight: train prompts sampled, G times each


def preflight_command(
    o: Options, lines: list[tuple[str, str, str, list[str]]], smoke: dict[str, list[str]]
) -> list[str]:
    """preflight.py with the reference GRPO line's command (--budget-from's line, else the plan's first grpo.py
    line), built by command() as the sweep would run it for the first seed: --smoke's sizes and the extra flags in."""
    want = o.budget_from.split(",")[0].split("/", 1)
    found = [ln for ln in lines if ln[2] == "grpo.py" and [ln[0], ln[1]] == want]
    found = found or [ln for ln in lines if ln[2] == "grpo.py"]
    if not found:
        raise UserError("the plan has no grpo.py line for the preflight to sample")
    e, name, script, flags = found[0]
    run = Run(e, name, o.seeds[0], script, flags, o.out / e / f"{name}-s{o.seeds[0]}")
    trainer = command(o, run, smoke, None)
    cmd = [PYTHON, "-m", "study.preflight", "--out", str(o.out)]  # from the repository root (cwd=REPO)
    cmd += ["--prompts", str(o.preflight_prompts)] if o.preflight_prompts else []
    # --smoke: its measurement (2 prompt states) tells no effect apart; the preflight checks that there is signal
    cmd += ["--smallest-effect", "0"] if o.smoke else []
    return cmd + ["--", *trainer[trainer.index(script) :]]


def preflight_effect(cmd: list[str]) -> float:
    """The smallest effect a preflight command asks for (preflight.py's default where it names none)."""
    flags = cmd[: cmd.index("--")]
    return float(flags[flags.index("--smallest-effect") + 1]) if "--smallest-effect" in flags else SMALLEST_EFFECT


def run_preflight(o: Options, cmd: list[str], reuse: bool) -> int:
    """Run the preflight (or reuse OUT/preflight.json of the same command); its exit status. A refusal that stops
    the sweep is one line naming its numbers."""
    path = o.out / "preflight.json"
    old = None
    if reuse and path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = None
    same = isinstance(old, dict) and old.get("command") == cmd[cmd.index("--") + 1 :]
    if same and "passed" in old and old.get("smallest_effect") == preflight_effect(cmd):  # written by this rule
        print(f"{old.get('verdict', 'preflight')} (reused from {path})", flush=True)
        rc = 0 if old["passed"] else EXIT_NO_SIGNAL
    else:
        rc = subprocess.run(cmd, cwd=REPO, env=run_env(o), stdin=subprocess.DEVNULL).returncode
    return rc


def run_env(o: Options) -> dict[str, str]:
    """A run's (and the preflight's) environment: --smoke's and --organism's on one thread, unless OMP_NUM_THREADS
    says otherwise (two runs side by side on a small CPU: a second thread of one would spin beside the other)."""
    return {**({"OMP_NUM_THREADS": "1"} if o.smoke or o.organism else {}), **os.environ}


def refusal(o: Options) -> str:
    """The line that stops a sweep the preflight refused: its numbers, the smallest effect, the ways on."""
    try:
        p = json.loads((o.out / "preflight.json").read_text())
        half = p["predicted"].get("half_width_3_seeds")
        counts = (
            f"informative share {p['informative']:.2f}: {p['informative_prompts']} of {p['prompts']} prompts x "
            f"{p['samples_per_prompt']} with 0 < p < 1; pass rate {p['pass_rate']:.3f}, outcome variance "
            f"{p['signal']:.4f}"
        )
        if half is None:
            numbers = f"no standard error to predict ({counts})"
        else:
            numbers = (
                f"GRPO's nmse at the prompt +- {half:.3f} over 3 seeds (predicted), wider than the smallest effect "
                f"{p['smallest_effect']:g} ({counts})"
            )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        numbers = "too little signal"
    return (
        f"sweep: not started: the preflight ({o.out / 'preflight.json'}) found {numbers}: too few prompts where a "
        "baseline can matter to tell the baselines apart; choose a model that solves part of the task, more "
        "measurement (--mc-prompts, --mc-every), or --force"
    )


# ======================================================================================================
# Running: one run, then the pool of slots (GPUs, CPU jobs, or one) that every launcher but SLURM uses
# ======================================================================================================


class Sweep:
    """The chosen runs, their states and budgets, and the trainers running now (one per slot)."""

    def __init__(self, o: Options, runs: list[Run], smoke: dict[str, list[str]]):
        self.o, self.runs, self.smoke = o, runs, smoke
        self.state: list[str] = []
        self.budgets: dict[Path, tuple[int, int]] = {}
        self.live: dict[str, tuple[int, subprocess.Popen, float]] = {}  # slot -> (run index, process, start)
        self.stop = False
        self.lock: rundir.RunLock | None = None  # OUT/.lock, held for the sweep's life

    def log(self, i: int, suffix: str) -> Path:
        r = self.runs[i]
        return self.o.out / "logs" / r.experiment / f"{r.dir.name}.{suffix}"

    def budget(self, run: Run) -> tuple[int, int] | None:
        if not run.needs_budget:
            return None
        ref = reference(self.o, run)
        if ref not in self.budgets:
            self.budgets[ref] = read_budget(ref)
        return self.budgets[ref]

    def record(self, i: int, status: str) -> None:
        self.log(i, "status").write_text(status + "\n")

    def start(self, i: int, slot: str) -> None:
        """Start run i on slot (a GPU id, cpu<k>, or ''), its output into its log; a run that cannot start fails."""
        run, log = self.runs[i], self.log(i, "log")
        log.parent.mkdir(parents=True, exist_ok=True)
        try:
            holder = rundir.holder_of(run.dir / rundir.LOCK_FILE)
            if holder is not None:
                raise UserError(f"{run.dir} is in use by {holder}")
            cmd = command(self.o, run, self.smoke, self.budget(run))
        except UserError as e:
            print(f"FAIL  {run.label}: {e}", flush=True)
            with open(log, "a") as f:
                f.write(f"=== {time.strftime('%F %T')} {e}\n")
            self.record(i, f"failed 1 0 {e}")
            return
        note = ""
        if self.state[i] == "new" and run.continues is not None:  # an amortised run: from its paid twin (twins.py)
            j = next(j for j, r in enumerate(self.runs) if r is run.continues)
            twin_cmd = command(self.o, run.continues, self.smoke, self.budget(run.continues))
            note = fork(run, twin_cmd, self.log(j, "log"))
            self.state[i] = "resume" if rundir.find_checkpoint(run.dir) is not None else "new"
        if self.state[i] == "resume":
            cmd.append("--resume")
            note = note or " (resuming from its checkpoint)"
        gpu = slot if slot and not slot.startswith("cpu") else ""
        print(f"run   {run.label}{f' on GPU {gpu}' if gpu else ''}{note}: {' '.join(cmd)}", flush=True)
        env = {**run_env(self.o), **({"CUDA_VISIBLE_DEVICES": gpu} if gpu else {})}
        with open(log, "a") as f:
            f.write(f"=== {time.strftime('%F %T')} {' '.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=f)
        self.live[slot] = (i, proc, time.time())

    def finish(self, slot: str) -> None:
        i, proc, t0 = self.live.pop(slot)
        run, log, rc, secs = self.runs[i], self.log(i, "log"), proc.returncode, round(time.time() - t0)
        if rc == 0 and run.result.is_file():
            self.record(i, f"ok 0 {secs}")
            print(f"done  {run.label} in {secs}s", flush=True)
        elif rc == 0:
            self.record(i, f"stopped 0 {secs}")
            print(f"stop  {run.label}: stopped by a signal, checkpoint saved; ./sweep.sh resumes it", flush=True)
        else:
            self.record(i, f"failed {rc} {secs}")
            tail = log.read_text(errors="replace").splitlines()[-3:]
            print(f"FAIL  {run.label}: exit {rc} after {secs}s; last lines of {log}:", flush=True)
            print("\n".join(f"      {line}" for line in tail), flush=True)

    def on_signal(self, signum: int, frame: object) -> None:
        """Every trainer finishes its step, saves and exits on SIGTERM; --resume continues it."""
        self.stop = True
        for _, proc, _ in self.live.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def pool(self, indices: list[int], slots: list[str]) -> None:
        """One run per slot at a time; a freed slot takes the next run. Waits for every run it started."""
        queue = list(indices)

        def ready(i: int) -> bool:  # a new amortised run waits while its paid twin is to run or running (twins.py)
            twin = self.runs[i].continues if self.state[i] == "new" else None
            return not [j for j in queue + [j for j, _, _ in self.live.values()] if self.runs[j] is twin]

        while queue or self.live:
            for slot in [s for s, (_, p, _) in self.live.items() if p.poll() is not None]:
                self.finish(slot)
            while queue and not self.stop:
                if any(self.state[i] == "finished" for i in queue):  # in the plan's order, before any waits
                    for i in [i for i in queue if self.state[i] == "finished"]:
                        print(f"skip  {self.runs[i].label}: finished", flush=True)
                        queue.remove(i)
                    continue
                free = [s for s in slots if s not in self.live]
                nxt = next((i for i in queue if ready(i)), None)
                if not free or nxt is None:
                    break
                queue.remove(nxt)
                self.start(nxt, free[0])
            if self.stop:
                queue = []
            if self.live:
                time.sleep(0.2)

    def summary(self) -> tuple[int, bool]:
        """One line per unfinished run, then the count; (finished runs, whether a run failed)."""
        n_ok, failed, bad = 0, False, []
        for i, run in enumerate(self.runs):
            if run.result.is_file():
                n_ok += 1
                continue
            status = self.log(i, "status")
            st = status.read_text().split() if status.is_file() else ["not-run"]
            if st[0] == "failed":
                bad.append(f"{run.label} (exit {st[1]}; log {self.log(i, 'log')})")
                failed = True
            elif st[0] == "stopped":
                bad.append(f"{run.label} (stopped; ./sweep.sh resumes it)")
            else:
                bad.append(f"{run.label} (not run)")
        print(f"sweep: {n_ok} of {len(self.runs)} runs finished in {self.o.out}")
        for b in bad:
            print(f"  unfinished: {b}")
        return n_ok, failed


def gpu_ids(o: Options) -> list[str]:
    """The GPUs to use: CUDA_VISIBLE_DEVICES' entries, else nvidia-smi's, the first --gpus of them."""
    ids = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    if not ids:
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True
            )
            ids = smi.stdout.split() if smi.returncode == 0 else []
        except OSError:
            ids = []
    if o.gpus:
        ids = (ids or [str(g) for g in range(o.gpus)])[: o.gpus]  # none found: a dry run on a machine without GPUs
    if not ids:
        raise UserError("no GPU found (nvidia-smi): pass --gpus N, or use --launcher seq")
    return ids


# ======================================================================================================
# SLURM: one array job for the runs without a budget, one after it for those with one, then the report
# ======================================================================================================


def submit_slurm(s: Sweep) -> None:
    o = s.o
    if not o.dry_run and subprocess.run(["sh", "-c", "command -v sbatch"], capture_output=True).returncode != 0:
        raise UserError("--launcher slurm needs sbatch, which is not on PATH")
    task = o.out / "slurm" / "task.sh"
    again = ["--experiments", ",".join(o.experiments), "--seeds", ",".join(map(str, o.seeds))]
    again += ["--model", o.model] if o.model else []
    again += ["--scale", o.scale, "--out", str(o.out), "--launcher", "slurm"]
    again += [*(["--gpus", str(o.gpus)] if o.gpus else []), *(["--smoke"] if o.smoke else [])]
    line = f'exec ./sweep.sh {shlex.join(again)} --slurm-task "$SLURM_ARRAY_TASK_ID"'
    if o.extra:
        line += " " + shlex.join(["--", *o.extra])
    if not o.dry_run:
        (o.out / "logs").mkdir(parents=True, exist_ok=True)
        task.parent.mkdir(parents=True, exist_ok=True)
        task.write_text(
            "#!/usr/bin/env bash\n# one run of the sweep per array task (written by sweep.sh); SIGTERM reaches the"
            f" trainer, which saves\ncd {shlex.quote(str(REPO))}\n{line}\n"
        )
        task.chmod(0o755)
    opts = ["--parsable", "--requeue", "--open-mode=append", "--signal=B:TERM@300", f"--gres=gpu:{o.gpus or 1}"]
    opts += [f"--output={o.out}/logs/slurm-%A_%a.out", *shlex.split(o.sbatch)]
    dep: list[str] = []
    todo = [i for i, st in enumerate(s.state) if st != "finished"]
    for name, part, what in (
        ("sweep", [i for i in todo if not s.runs[i].after_others], "the runs without a budget"),
        ("sweep-h2h", [i for i in todo if s.runs[i].after_others], "the budget-matched runs (after the others)"),
        ("sweep-report", None, "the report"),
    ):
        if part == []:
            continue
        if part is None:
            wrap = f"cd {shlex.quote(str(REPO))} && {shlex.quote(PYTHON)} report.py {shlex.quote(str(o.out))}"
            args = ["--parsable", *dep, f"--job-name={name}", f"--output={o.out}/logs/report-%j.out", "--wrap", wrap]
        else:
            args = [*opts, *dep, f"--job-name={name}", f"--array={','.join(map(str, part))}", str(task)]
        if o.dry_run:
            print("sbatch " + shlex.join(args))
            jid = name
        else:
            jid = subprocess.run(["sbatch", *args], capture_output=True, text=True, check=True).stdout.strip()
            print(f"submitted {what} as job {jid}")
        dep = [f"--dependency=afterany:{jid.split(';')[0]}"]
    if not o.dry_run:
        print(f"watch with: squeue --me; logs in {o.out}/logs/")


def slurm_task(s: Sweep, i: int) -> int:
    """Inside an array task: one run, requeued when a signal stopped it."""
    if i >= len(s.runs):
        raise UserError(f"--slurm-task {i} is not a run of this plan")
    s.o.launcher = "torchrun" if s.o.gpus > 1 else "seq"
    s.state = [""] * len(s.runs)
    s.state[i] = states([s.runs[i]], False)[0]
    s.pool([i], [""])
    st = s.log(i, "status").read_text().split()[0] if s.log(i, "status").is_file() else "ok"
    if st == "stopped" and os.environ.get("SLURM_JOB_ID"):
        job, task = (
            os.environ.get("SLURM_ARRAY_JOB_ID", os.environ["SLURM_JOB_ID"]),
            os.environ.get("SLURM_ARRAY_TASK_ID"),
        )
        subprocess.run(["scontrol", "requeue", f"{job}_{task}" if task else job])
    return 1 if st == "failed" else 0


# ======================================================================================================
# main
# ======================================================================================================


def report(o: Options) -> int:
    return subprocess.run([PYTHON, str(REPO / "report.py"), str(o.out)], cwd=REPO).returncode


def main(argv: list[str]) -> int:
    plan = "" if sys.stdin.isatty() else sys.stdin.read()
    lines, smoke = read_plan(plan)
    if not lines:
        raise UserError("study/sweep_runner.py reads its plan from sweep.sh on stdin: run ./sweep.sh")
    o = parse_args(argv, list(dict.fromkeys(e for e, *_ in lines)), plan)
    if o.report_only:
        return report(o)
    runs = make_runs(o, lines)
    if o.launcher != "slurm":  # an array's tasks start together: none can wait for its twin
        pair_paid(runs, o.extra)
    s = Sweep(o, runs, smoke)
    signal.signal(signal.SIGTERM, s.on_signal)  # from here on a signal stops the sweep as it stops the trainers
    signal.signal(signal.SIGINT, s.on_signal)
    if o.slurm_task is not None:
        return slurm_task(s, o.slurm_task)
    pre = preflight_command(o, lines, smoke)
    if o.preflight:  # the preflight alone: on this machine, whatever the launcher
        if o.dry_run:
            print(" ".join(pre))
            return 0
        s.lock = rundir.RunLock(o.out, "sweep", "--out", "a sweep").acquire()  # held until this process exits
        rc = run_preflight(o, pre, reuse=False)
        if rc not in (0, EXIT_NO_SIGNAL):  # the preflight failed (its error line said why): no OUT left that this
            s.lock.release()  # sweep created and nothing wrote in (the lock's release removes it)
        return rc
    if o.launcher == "torchrun":
        if not o.dry_run and subprocess.run(["sh", "-c", "command -v torchrun"], capture_output=True).returncode:
            raise UserError("--launcher torchrun needs torchrun on PATH")
        o.gpus = o.gpus or len(gpu_ids(o))
    slots = [""]
    if o.launcher == "gpus":
        slots = gpu_ids(o)
    elif o.launcher == "seq" and o.jobs > 1:
        slots = [f"cpu{k}" for k in range(1, o.jobs + 1)]
    rundir.refuse_links(o.out, "--out", "a sweep")  # before anything is read or written in it
    if not o.dry_run:
        # held until this process exits: two sweeps on one folder would run runs twice
        s.lock = rundir.RunLock(o.out, "sweep", "--out", "a sweep").acquire()
        if o.force:
            print("preflight: not run (--force)", flush=True)
        elif o.launcher == "slurm":
            print("preflight: not run under --launcher slurm (this machine may have no GPU): run "
                  "./sweep.sh --preflight with the same options on a GPU node first", flush=True)  # fmt: skip
        else:
            rc = run_preflight(o, pre, reuse=True)
            if rc == EXIT_NO_SIGNAL:
                print(refusal(o), file=sys.stderr, flush=True)
                return EXIT_NO_SIGNAL
            if rc != 0:
                s.lock.release()  # as above: no OUT left that this sweep created and nothing wrote in
                return rc  # the preflight printed its error line
    s.state = states(runs, o.dry_run)
    jobs = f" ({o.jobs} at once)" if len(slots) > 1 and o.launcher == "seq" else ""
    print(
        f"sweep: {len(o.experiments)} experiment(s) ({' '.join(o.experiments)}), seeds {' '.join(map(str, o.seeds))},"
        f" model {o.model or 'of the scale'}, scale {o.scale}, launcher {o.launcher}{jobs}: {len(runs)} runs into {o.out}",
        flush=True,
    )
    if o.dry_run:
        if o.launcher != "slurm" and not o.force:
            ref = o.budget_from.split(",")[0] or "the first grpo.py line"
            print(f"# preflight first: {ref} for seed {o.seeds[0]} (exit 3 stops the sweep unless --force; the same"
                  " options with --preflight --dry-run show its command)")  # fmt: skip
        for i, run in enumerate(runs):
            if s.state[i] == "finished":
                print(f"# {run.label}: finished")
                continue
            budget = None  # a reference that has not run yet: its budget shown symbolically
            if run.needs_budget and (reference(o, run) / "results.json").is_file():
                try:
                    budget = s.budget(run)
                except UserError as e:
                    print(f"# {run.label}: {e}")
                    continue
            if run.continues is not None and s.state[i] == "new":
                print(f"# {run.label}: continues {run.continues.label}'s last checkpoint once that has finished at this "
                      "budget (its first steps: study/twins.py), with --resume; else from scratch as below")  # fmt: skip
            cmd = command(o, run, smoke, budget) + (["--resume"] if s.state[i] == "resume" else [])
            print(" ".join((["CUDA_VISIBLE_DEVICES=<free GPU>"] if o.launcher == "gpus" else []) + cmd))
        if o.launcher == "slurm":
            submit_slurm(s)
        return 0
    plan_tsv = o.out / "plan.tsv"  # report.py names the planned runs that did not finish
    plan_tsv.write_text("".join(f"{r.experiment}\t{r.name}\t{r.dir.relative_to(o.out)}\n" for r in runs if not r.step))
    if o.launcher == "slurm":
        submit_slurm(s)
        return 0
    if o.launcher == "gpus":
        print(f"one run per GPU on GPUs {' '.join(slots)}", flush=True)
    elif len(slots) > 1:
        print(f"{len(slots)} runs at once on the CPU", flush=True)
    t0 = time.time()
    for after in (False, True):  # the budget-matched runs (and {out}'s readers) after every other: references first
        s.pool([i for i, r in enumerate(runs) if r.after_others == after], slots)
    print(f"sweep: ran for {round(time.time() - t0)}s")
    n_ok, failed = s.summary()
    if s.stop:
        print("sweep: stopped by a signal; run the same command again to resume")
        return 130
    rc = report(o) if n_ok else 0
    return 1 if failed else rc


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
