"""The crossover study: its plan (GRPO's G as an axis at batch x G constant, the critics' learning curve as a step,
PPO with each pretrained critic (each head at both prices) and its budget from its own G = 8 run), the runs'
names, and its report section and figure (study/crossover.py) on known inputs: a synthetic curve.json and synthetic runs whose
numbers the tests compute again on their own. The end to end run of a small crossover plan is in the slow lane.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, check_ok, check_one_error_line, run_here, run_sweep, step_rows, trainer_env

import intervals
from study import crossover, read_runs, report, sweep_runner, twins

PNG = b"\x89PNG\r\n\x1a\n"
PLAN = (REPO / "sweep.sh").read_text().split("<<'PLAN'\n")[1].split("\nPLAN")[0]


def commands(out: Path, *args: str) -> list[list[str]]:
    """The dry run's commands, each as its words (a budget not known yet is one word, <...>)."""
    proc = run_sweep("--organism", "--experiments", "crossover", "--dry-run", "--out", out, *args)
    check_ok(proc)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("/")]
    return [re.findall(r"<[^>]*>|\S+", line) for line in lines]


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


# ======================================================================================================
# The plan
# ======================================================================================================


def test_the_plan_runs_grpo_at_each_g_at_matched_tokens_and_ppo_with_each_pretrained_critic(tmp_path):
    """./sweep.sh --organism --experiments crossover --dry-run: the curve once (not per seed) into OUT/crossover/curve;
    GRPO at G = 2, 4, 8, 16 with batch x G the organism preset's 256 completions a step, every G the same steps and
    the same measured completions; PPO with each head the curve fits, its critic file one the curve writes,
    each head amortised and paid (the amortised run continues the paid one: the tests below), and with the full critic of the curve's largest n amortised only (its pretraining exceeds the budget), the budget
    read from the same seed's G = 8 run of the crossover (not the head-to-head's)."""
    out = tmp_path / "out"
    cmds = commands(out)
    steps = [c for c in cmds if "study.pretrain_critic" in c and "--pool-from" not in c]
    assert len(steps) == 1, "the curve runs once for every seed"
    (step,) = steps
    assert flag(step, "--out") == str(out / "crossover" / "curve") and flag(step, "--model") == "organism"
    assert "--measure" in step and "--seed" not in step and "--run-dir" not in step
    capacities = step[step.index("--critics") + 1 : step.index("--rollouts")]
    rollouts = [int(n) for n in step[step.index("--rollouts") + 1 : step.index("--measure")]]
    assert capacities == ["small", "medium", "large", "full"] and rollouts == [256, 1024, 4096, 16384]
    heads = capacities[:-1]
    for seed in (1, 2, 3):
        grpo = [c for c in cmds if "grpo.py" in c and flag(c, "--seed") == str(seed)]
        sizes = {int(flag(c, "--group-size")): c for c in grpo}
        assert sorted(sizes) == [2, 4, 8, 16]
        for g, c in sizes.items():
            assert g * int(flag(c, "--batch-size")) == 256, c  # the organism preset's completions a step
            measured = int(c[c.index("--mc-prompts") + 1]) if "--mc-prompts" in c else 32  # grpo.py's preset
            every = int(c[c.index("--mc-every") + 1]) if "--mc-every" in c else 2
            assert measured <= int(flag(c, "--batch-size")) and measured / every == 16  # the same completions measured
            name = "grpo-group" if g == 8 else f"grpo-group-g{g}"
            assert flag(c, "--run-dir") == str(out / "crossover" / f"{name}-s{seed}")
        assert len({flag(c, "--total-steps") for c in grpo}) == 1
        ppo = [c for c in cmds if "ppo.py" in c and flag(c, "--seed") == str(seed) and flag(c, "--critic") != "none"]
        assert len(ppo) == 2 * len(heads) + 1
        # the control: PPO without a critic (the batch's mean reward) at the same seed's G = 8 budget
        (none,) = [
            c for c in cmds if "ppo.py" in c and flag(c, "--seed") == str(seed) and flag(c, "--critic") == "none"
        ]
        assert "--critic-init" not in none and flag(none, "--run-dir") == str(out / "crossover" / f"ppo-none-s{seed}")
        assert flag(none, "--token-budget") == f"<generated_tokens of {out / 'crossover' / 'grpo-group'}-s{seed}>"
        for c in ppo:
            critic, init = flag(c, "--critic"), Path(flag(c, "--critic-init"))
            m = re.fullmatch(rf"critic-{critic}-n(\d+)\.safetensors", init.name)
            assert init.parent == out / "crossover" / "curve" and m and int(m.group(1)) in rollouts, c
            assert flag(c, "--token-budget") == f"<generated_tokens of {out / 'crossover' / 'grpo-group'}-s{seed}>"
            price = "paid" if "--count-critic-init-tokens" in c else "amortised"
            assert flag(c, "--run-dir").endswith(f"ppo-{critic}-n{m.group(1)}-{price}-s{seed}")
        for critic in heads:  # each head at both prices
            prices = sorted("--count-critic-init-tokens" in c for c in ppo if flag(c, "--critic") == critic)
            assert prices == [False, True], critic
        (full,) = [c for c in ppo if flag(c, "--critic") == "full"]  # 16,384 rollouts' tokens exceed the budget:
        assert "--count-critic-init-tokens" not in full and flag(full, "--critic-init").endswith(
            f"-n{rollouts[-1]}.safetensors"
        )
    # the fit's settings: the curve's heads at an n their PPO runs load, refitted on its pool under other settings
    # (none the curve's own: 1e-3, 4 epochs), once for every seed, each after every line that does not read {out}
    fits = [c for c in cmds if "--pool-from" in c]
    loaded = {
        int(re.search(r"-n(\d+)\.", flag(c, "--critic-init")).group(1))
        for c in cmds
        if "--critic-init" in c and flag(c, "--critic") != "full"
    }
    assert len(fits) >= 2 and len({(flag(c, "--lr"), flag(c, "--epochs")) for c in fits}) == len(fits)
    last_grpo = max(i for i, c in enumerate(cmds) if "grpo.py" in c)
    for c in fits:
        assert flag(c, "--pool-from") == str(out / "crossover" / "curve") and "--measure" in c and "--seed" not in c
        assert c[c.index("--critics") + 1 : c.index("--rollouts")] == heads
        assert int(flag(c, "--rollouts")) in loaded and (float(flag(c, "--lr")), flag(c, "--epochs")) != (1e-3, "4")
        assert flag(c, "--out") == str(out / "crossover" / f"fit-lr{flag(c, '--lr')}-e{flag(c, '--epochs')}")
        assert cmds.index(c) > last_grpo
    assert not out.exists()
    default = run_sweep("--organism", "--dry-run", "--out", out)  # the default study: no crossover line in it
    check_ok(default)
    assert (
        "crossover" not in default.stdout
        and "--token-budget <generated_tokens of " + str(out / "h2h") in default.stdout
    )


PAIRS = """\
x  ppo-small-paid       ppo.py --critic small --critic-init c.safetensors --count-critic-init-tokens --token-budget {tokens}
x  ppo-small-amortised  ppo.py --critic small --critic-init c.safetensors --token-budget {tokens}
x  ppo-full-amortised   ppo.py --critic full --critic-init f.safetensors --token-budget {tokens}
x  ppo-cos-amortised    ppo.py --critic small --critic-init c.safetensors --token-budget {tokens} --lr-schedule cosine
x  ppo-cos-paid         ppo.py --critic small --critic-init c.safetensors --token-budget {tokens} --lr-schedule cosine --count-critic-init-tokens
"""


def pair_runs(tmp_path: Path, extra: tuple[str, ...] = ()) -> list[sweep_runner.Run]:
    lines, _ = sweep_runner.read_plan(PAIRS)
    o = sweep_runner.Options(experiments=["x"], seeds=[1, 2], out=tmp_path, extra=list(extra))
    runs = sweep_runner.make_runs(o, lines)
    twins.pair_paid(runs, o.extra)
    return runs


def test_each_amortised_run_continues_its_paid_twin_of_the_same_seed_under_a_constant_learning_rate(tmp_path):
    """The runner's fork: the amortised line continues the line that is it and --count-critic-init-tokens, seed by
    seed; a line without a paid twin, a decaying schedule (the paid run's learning rate differs from the first step)
    and the flag given to every run (--extra) pair nothing."""
    runs = pair_runs(tmp_path)
    pairs = {r.dir.name: r.continues.dir.name for r in runs if r.continues is not None}
    assert pairs == {"ppo-small-amortised-s1": "ppo-small-paid-s1", "ppo-small-amortised-s2": "ppo-small-paid-s2"}
    assert not any(r.continues for r in pair_runs(tmp_path, ("--count-critic-init-tokens",)))
    cosine = pair_runs(tmp_path, ("--lr-schedule", "cosine"))
    assert not any(r.continues for r in cosine)


def test_the_fork_copies_only_a_twin_that_finished_as_the_plan_runs_it_now(tmp_path):
    """fork(): the twin's checkpoint and the metrics rows it counts (not the final evaluation's row after it), into
    the run's folder, where the twin finished and ran with the command the plan gives it now (its log's starts, the
    interpreter and --resume aside; its --token-budget, the same reference run's as the amortised run's, among its
    flags). A twin not finished, made with other flags, at another budget (another reference run), or a copy that
    fails: nothing left, from scratch."""
    (twin_dir := tmp_path / "paid").mkdir()
    (twin_dir / "checkpoint").mkdir()
    (twin_dir / "checkpoint" / "state.json").write_text(json.dumps({"counters": {"step": 2, "metrics_rows": 2}}))
    (twin_dir / "checkpoint" / "weights").write_text("w")
    (twin_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 2, "val/accuracy": 0.5}\n')
    results = {"steps": 2, "test": {"accuracy": 0.5}}
    twin = sweep_runner.Run("x", "paid", 1, "ppo.py", ["--count-critic-init-tokens"], twin_dir)  # label x/paid
    twin_cmd = ["python", "ppo.py", "--critic", "small", "--count-critic-init-tokens", "--token-budget", "40"]
    log = tmp_path / "paid.log"
    log.write_text("=== 2026-12-07 10:00:00 /other/python ppo.py --critic small --count-critic-init-tokens "
                   "--token-budget 40\nstep 1 ...\n=== 2026-12-07 10:05:00 python3 ppo.py --critic small "
                   "--count-critic-init-tokens --token-budget 40 --resume\n")  # fmt: skip

    def fork(name: str, cmd: list[str] = twin_cmd) -> tuple[str, Path]:
        run = sweep_runner.Run("x", name, 1, "ppo.py", [], tmp_path / name, continues=twin)
        return twins.fork(run, cmd, log), run.dir

    note, amortised = fork("first")
    assert note == " (from scratch: its paid twin x/paid has not finished)" and not amortised.exists()
    (twin_dir / "results.json").write_text(json.dumps(results))
    note, amortised = fork("other-flags", [*twin_cmd, "--lr", "1e-3"])  # the plan's line changed since
    assert note.endswith("ran with other flags than the plan's now)") and not amortised.exists()
    note, amortised = fork("other-budget", [*twin_cmd[:-1], "50"])  # the plan's budget now: another reference run's
    assert note.endswith("ran with other flags than the plan's now)") and not amortised.exists()
    (twin_dir / "metrics.jsonl").rename(twin_dir / "metrics.moved")  # the copy fails: nothing left behind
    note, amortised = fork("failed-copy")
    assert "copying its paid twin x/paid failed" in note and list(amortised.iterdir()) == []
    (twin_dir / "metrics.moved").rename(twin_dir / "metrics.jsonl")
    note, amortised = fork("amortised")
    assert note == " (continuing x/paid's 2 steps)"
    assert (amortised / "checkpoint" / "weights").read_text() == "w"
    assert (amortised / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert sorted(p.name for p in amortised.iterdir()) == ["checkpoint", "metrics.jsonl"], "no temporary left"


def test_an_amortised_run_starts_after_its_paid_twin_has_finished_and_the_pool_never_idles_meanwhile(tmp_path):
    """Two slots: the amortised run, first in its seed's order after the paid one, waits while its twin runs, the
    slot taking the next run that does not wait; it starts once the twin has finished, from the twin's checkpoint."""
    runs = [r for r in pair_runs(tmp_path) if "cos" not in r.name]
    runs.sort(key=lambda r: (r.seed, "paid" in r.name))  # the amortised before its twin in the queue
    s = sweep_runner.Sweep(sweep_runner.Options(out=tmp_path), runs, {})
    s.state = ["new"] * len(runs)
    events: list[str] = []

    class Done:  # a trainer that finishes at its first poll after one round of the pool's loop
        def __init__(self) -> None:
            self.polls = 0

        def poll(self) -> int | None:
            self.polls += 1
            return 0 if self.polls > 1 else None

    def start(i: int, slot: str) -> None:
        events.append(f"start {runs[i].dir.name}")
        s.live[slot] = (i, Done(), 0.0)

    def finish(slot: str) -> None:
        events.append(f"end {runs[s.live.pop(slot)[0]].dir.name}")

    s.start, s.finish = start, finish
    s.pool(list(range(len(runs))), ["cpu1", "cpu2"])
    for seed in (1, 2):
        twin_end = events.index(f"end ppo-small-paid-s{seed}")
        assert events.index(f"start ppo-small-amortised-s{seed}") > twin_end, events
    assert set(events[:2]) == {"start ppo-small-paid-s1", "start ppo-full-amortised-s1"}, "both slots from the start"
    assert len([e for e in events if e.startswith("end")]) == len(runs)


def test_each_experiment_reads_its_own_reference_and_a_step_is_no_run_of_the_plan():
    """--budget-from names one reference per experiment (sweep.sh's h2h/grpo-group,crossover/grpo-group); an
    experiment without one reads the first. A step's command has no trainer's flags (not the ones after --)."""
    lines, smoke = sweep_runner.read_plan(PLAN)
    experiments = list(dict.fromkeys(e for e, *_ in lines))
    argv = ["--default-experiments", "h2h,critic,labels", "--budget-from", "h2h/grpo-group,crossover/grpo-group"]
    o = sweep_runner.parse_args([*argv, "--organism", "--experiments", "h2h,crossover", "--", "--eval-size", "8"],
                                experiments, PLAN)  # fmt: skip
    runs = sweep_runner.make_runs(o, lines)
    by = {(r.experiment, r.name, r.seed): r for r in runs}
    assert sweep_runner.reference(o, by[("h2h", "ppo-small", 2)]) == o.out / "h2h" / "grpo-group-s2"
    ppo = by[("crossover", "ppo-small-n4096-paid", 2)]
    assert sweep_runner.reference(o, ppo) == o.out / "crossover" / "grpo-group-s2"
    other = sweep_runner.Run("critic-lambda", "x", 1, "ppo.py", ["--token-budget", "{tokens}"], o.out / "x")
    assert sweep_runner.reference(o, other) == o.out / "h2h" / "grpo-group-s1"
    steps = [r for r in runs if r.step]
    assert [(r.name, r.dir) for r in steps][0] == ("curve", o.out / "crossover" / "curve")
    assert runs.index(steps[0]) < min(i for i, r in enumerate(runs) if r.needs_budget)  # before what reads a budget
    fits = steps[1:]  # they read the curve's pool ({out}): after every line that does not, as a budget's readers
    assert fits and all(r.name.startswith("fit-") and r.dir == o.out / "crossover" / r.name for r in fits)
    assert all(r.after_others and not r.needs_budget for r in fits)
    assert min(runs.index(r) for r in fits) > max(i for i, r in enumerate(runs) if not r.after_others)
    cmd = sweep_runner.command(o, steps[0], smoke, None)
    assert cmd[1:4] == ["-m", "study.pretrain_critic", "--out"] and "--eval-size" not in cmd and "--scale" not in cmd
    assert sweep_runner.command(o, ppo, smoke, (1000, 7))[-2:] == ["--eval-size", "8"]
    assert f"{o.out}/crossover/curve/critic-small-n4096.safetensors" in sweep_runner.command(o, ppo, smoke, (1000, 7))


# ======================================================================================================
# The runs' names
# ======================================================================================================


def test_a_runs_name_carries_g_where_g_is_an_axis_and_a_pretrained_critics_rollouts_and_price(tmp_path):
    test = {"accuracy": 0.5, "n": 4, "ci95": [0.1, 0.9]}
    cases = [
        ("crossover", {"method": "grpo", "variant": "group", "args": {"group_size": 4}}, "grpo-group-g4"),
        ("crossover", {"method": "grpo", "variant": "group", "args": {"group_size": 8}}, "grpo-group"),
        ("h2h", {"method": "grpo", "variant": "group", "args": {"group_size": 2}}, "grpo-group"),  # the smoke sweep's
        ("crossover", {"method": "ppo", "variant": "small", "args": {},
                       "critic_init": {"rollouts": 4096, "tokens": 9, "paid": True}}, "ppo-small-n4096-paid"),
        ("crossover", {"method": "ppo", "variant": "large", "args": {},
                       "critic_init": {"rollouts": 256, "tokens": 9, "paid": False}}, "ppo-large-n256-amortised"),
    ]  # fmt: skip
    for i, (experiment, res, name) in enumerate(cases):
        run_dir = tmp_path / experiment / f"r{i}-s1"
        run_dir.mkdir(parents=True)
        (run_dir / "results.json").write_text(json.dumps({**res, "seed": 1, "generated_tokens": 5, "test": test}))
        assert read_runs.load_run(run_dir, experiment)["run"] == name
    names = ["grpo-group-g16", "ppo-small-n4096-paid", "grpo-group", "grpo-group-g2", "ppo-small",
             "ppo-large-n256-amortised", "grpo-group-g4", "ppo-small-n1024-amortised", "dpo-gold-online"]  # fmt: skip
    assert sorted(names, key=lambda n: read_runs.sort_key("crossover", n)) == [
        "ppo-small", "ppo-small-n1024-amortised", "ppo-small-n4096-paid", "ppo-large-n256-amortised", "grpo-group",
        "grpo-group-g2", "grpo-group-g4", "grpo-group-g16", "dpo-gold-online",
    ]  # fmt: skip


# ======================================================================================================
# The section and the figure on known inputs
# ======================================================================================================

# the synthetic curve: (capacity, n) -> nmse at the prompt, its half-width; inside and over all states follow
CURVE = {
    ("small", 256): (0.40, 0.03), ("small", 1024): (0.20, 0.05), ("small", 4096): (0.13, 0.03),
    ("large", 256): (0.30, 0.03), ("large", 1024): (0.15, 0.03), ("large", 4096): (0.10, 0.02),
}  # fmt: skip


def part(x: float, half: float) -> dict:
    return {"nmse": x, "nmse_lo": x - half, "nmse_hi": x + half}


def write_curve(folder: Path, linear: bool = False) -> Path:
    rows = [{"capacity": "constant", "rollouts": n, "tokens": 40 * n, "prompt": part(0.27, 0.03),
             "inside": part(0.9, 0.1), "all": part(0.7, 0.1), "value_explained_variance": 0.0}
            for n in (256, 1024, 4096)]  # fmt: skip
    for (cap, n), (x, half) in CURVE.items():
        rows.append({"capacity": cap, "rollouts": n, "tokens": 40 * n, "prompt": part(x, half),
                     "inside": part(2 * x, 0.1), "all": part(1.5 * x, 0.05), "value_explained_variance": 0.2})  # fmt: skip
    if linear:
        rows.append({"capacity": "linear", "rollouts": None, "folds": 8, "prompt": part(0.22, 0.02),
                     "inside": part(0.53, 0.05), "all": part(0.4, 0.04)})  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    curve = {"heldout": {"prompts": 512, "states": 1536, "mc_samples": 16, "pass_rate": 0.24,
                         "mean_p_1_minus_p": 0.147}, "rows": rows[::-1]}  # fmt: skip
    (folder / "curve.json").write_text(json.dumps(curve))
    return folder / "curve.json"


def test_g_star_and_the_crossings_on_a_known_curve(tmp_path):
    curve = crossover.read_curve(write_curve(tmp_path))
    assert [(r["capacity"], r["rollouts"]) for r in curve["rows"]][:4] == [
        ("constant", 256), ("constant", 1024), ("constant", 4096), ("small", 256)
    ]  # fmt: skip
    for x, half in CURVE.values():
        g, lo, hi = crossover.g_star(x, x - half, x + half)
        assert (g, lo, hi) == pytest.approx((1 + 1 / x, 1 + 1 / (x + half), 1 + 1 / (x - half)))
    found = crossover.crossings(curve, (2, 4, 8, 16))
    for cap in ("small", "large"):
        for G in (2, 4, 8, 16):
            line = 1 / (G - 1)
            ns = sorted(n for c, n in CURVE if c == cap)
            first = next((n for n in ns if CURVE[(cap, n)][0] < line), None)
            sure = next((n for n in ns if sum(CURVE[(cap, n)]) < line), None)
            assert found[(cap, G)] == (first, sure), (cap, G)
    assert found[("small", 8)] == (4096, None) and found[("large", 8)] == (4096, 4096)  # one straddles, one is sure
    assert found[("small", 16)] == (None, None)
    # over states: against the lines given (GRPO's measured nmse over states), a G without one left out
    over = crossover.crossings(curve, (2, 4, 8, 16), "all", {4: 0.5, 8: 0.2})
    assert over[("small", 4)] == (1024, 1024) and over[("large", 8)] == (4096, None) and ("small", 2) not in over
    assert crossover.bracket(crossover.g_star(0.2, 0.17, 0.23), (2, 4, 8, 16)).startswith(
        "between G = 4 and G = 8, its whole interval too"
    )
    assert "its interval reaches G = 8" in crossover.bracket(crossover.g_star(0.13, 0.10, 0.16), (2, 4, 8, 16))
    assert crossover.bracket(crossover.g_star(-0.01, -0.05, 0.03), (2, 4, 8, 16)).startswith("above G = 16")
    for bad in ([1, 4], [0], [2.5], []):
        with pytest.raises(crossover.errors.UserError, match="G must be|no group size"):
            crossover.check_groups(bad)


def test_the_curve_table_shows_each_critics_paired_difference_from_the_constant(tmp_path):
    """The curve table's "vs constant" column reads the row's prompt vs_constant (pretrain_critic's paired
    differences), signed; a row without one (the constant, a curve made before them) shows '-'."""
    curve = crossover.read_curve(write_curve(tmp_path))
    (small,) = [r for r in curve["rows"] if (r["capacity"], r["rollouts"]) == ("small", 4096)]
    small["prompt"]["vs_constant"] = [-0.021, -0.034, -0.008]
    lines = crossover.curve_table(curve, (2, 4, 8, 16))
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    column = head.index("vs constant at prompt [95%, paired]")
    rows = {(c[0], c[1]): c for c in ([x.strip() for x in line.strip("|").split("|")] for line in lines[2:]
                                      if line.startswith("| "))}  # fmt: skip
    assert rows["small", "4,096"][column] == "-0.021 [-0.034, -0.008]"
    assert rows["constant", "4,096"][column] == rows["small", "1,024"][column] == "-"


def test_the_fit_settings_table_sets_each_fit_beside_the_curves_own_at_the_same_rollouts(tmp_path):
    """OUT/crossover/fit-*/curve.json (other --lr/--epochs on the curve's pool): each of their critics beside the
    curve's own fit at the same n, the curve's other n left out; none of those folders: no table."""
    curve = crossover.read_curve(write_curve(tmp_path / "crossover" / "curve"))
    assert crossover.fit_settings_table(tmp_path, curve) == []
    for r in curve["rows"]:
        r.update(lr=1e-3, epochs=4, final_loss=0.09)
    fit = {"heldout": curve["heldout"], "rows": [
        {"capacity": "small", "rollouts": 4096, "lr": 3e-3, "epochs": 16, "final_loss": 0.08,
         "prompt": {**part(0.111, 0.02), "vs_constant": [-0.159, -0.2, -0.118]},
         "all": {**part(0.222, 0.02), "vs_constant": [-0.03, -0.05, -0.01]},
         "value_explained_variance": 0.05},
        {"capacity": "constant", "rollouts": 4096, "prompt": part(0.27, 0.03)},
    ]}  # fmt: skip
    (tmp_path / "crossover" / "fit-lr3e-3-e16").mkdir()
    (tmp_path / "crossover" / "fit-lr3e-3-e16" / "curve.json").write_text(json.dumps(fit))
    lines = crossover.fit_settings_table(tmp_path, curve)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")][1:]
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows] == [
        ("small", "4,096", "0.001", "4", "the curve"), ("small", "4,096", "0.003", "16", "fit-lr3e-3-e16"),
    ]  # fmt: skip
    assert rows[1][6].startswith("0.111 [0.091, 0.131]") and rows[1][5] == "0.0800"
    assert rows[1][7] == "-0.159 [-0.200, -0.118]" and rows[1][9].startswith("0.222 [0.202, 0.242]")
    assert rows[1][10] == "-0.030 [-0.050, -0.010]" and rows[0][10] == "-"  # over all states, where given
    assert rows[0][7] == rows[1][8] == "-"  # a curve with no paired differences (made before them): none shown
    (tmp_path / "crossover" / "fit-broken").mkdir()
    (tmp_path / "crossover" / "fit-broken" / "curve.json").write_text("{")
    assert "fit-broken" in crossover.fit_settings_table(tmp_path, curve)[0]


def write_run(root: Path, name: str, res: dict, rows: list[dict]) -> None:
    run_dir = root / "crossover" / name
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps(res))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def synthetic_sweep(out: Path) -> dict[tuple[str, int], list[float]]:
    """GRPO at G = 2, 4, 8, 16 and PPO small at both prices, 3 seeds, each with per-problem correctness and
    baseline sums at the prompt and over states; -> (run, seed) -> its correctness."""
    import torch

    from measure import baseline_error

    g = torch.Generator().manual_seed(0)
    correct: dict[tuple[str, int], list[float]] = {}
    arms = [(f"grpo-group-g{G}" if G != 8 else "grpo-group", "grpo", G, None) for G in (2, 4, 8, 16)]
    arms += [(f"ppo-small-n4096-{p}", "ppo", None, p) for p in ("amortised", "paid")] + [
        ("ppo-none", "ppo", None, None)
    ]
    for name, method, G, price in arms:
        for seed in (1, 2, 3):
            rows = []
            for step in (1, 2, 3):
                truth = torch.rand(24, generator=g, dtype=torch.float64)
                mc = (torch.rand(24, 8, generator=g, dtype=torch.float64) < truth[:, None]).double().mean(-1)
                pred = truth + 0.3 * torch.randn(24, generator=g, dtype=torch.float64)
                key = "loo" if method == "grpo" else "value"
                err, first = baseline_error(pred, mc, 8, torch.arange(24) // 3), baseline_error(pred[::3], mc[::3], 8)
                rows.append({"step": step, **{f"mc/{key}/{k}": v for k, v in err.items()},
                             **{f"mc/{key}_prompt/{k}": v for k, v in first.items()}})  # fmt: skip
            correct[(name, seed)] = (torch.rand(100, generator=g) < 0.5).float().tolist()
            variant = "group" if method == "grpo" else name.split("-")[1]
            res = {"method": method, "variant": variant, "seed": seed, "steps": 3,
                   "generated_tokens": 1000 + seed, "trained_tokens": 2000, "policy_params": 10, "critic_params": 5,
                   "args": {"group_size": G, "batch_size": 256 // G} if G else {"critic": variant},
                   "test": {"accuracy": sum(correct[(name, seed)]) / 100, "n": 100, "ci95": [0.4, 0.6],
                            "correct": correct[(name, seed)]}}  # fmt: skip
            if price:
                res["critic_init"] = {"rollouts": 4096, "tokens": 150_000 + seed, "paid": price == "paid"}
            write_run(out, f"{name}-s{seed}", res, rows)
    return correct


def test_the_section_on_known_inputs_and_its_figure(tmp_path):
    """report.md's "Where the crossover lies": the learning curve's rows with G*, each capacity's G* and half-width,
    the crossings at the prompt and over states, accuracy at matched compute paired with GRPO at G = 8, the ceiling
    (a TODO without the linear row); the figure written."""
    out = tmp_path / "out"
    write_curve(out / "crossover" / "curve")
    correct = synthetic_sweep(out)
    md = report.write_report(out, out / "report").read_text()
    section = md.split("## Where the crossover lies", 1)[1].split("\n## ", 1)[0]
    # (i) each row: nmse at the prompt with its interval, and G* = 1 + 1/nmse with the interval mapped
    for (cap, n), (x, half) in CURVE.items():
        gs = f"{1 + 1 / x:.1f} [{1 + 1 / (x + half):.1f}, {1 + 1 / (x - half):.1f}]"
        under = ", ".join(str(G) for G in (2, 4, 8, 16) if x < 1 / (G - 1))
        row = f"| {cap} | {n:,} | {40 * n / 1000:.3g}k | {x:.3f} [{x - half:.3f}, {x + half:.3f}] | {gs} | {under} |"
        assert row in section, row
    assert "G = 2: 1.000; G = 4: 0.333; G = 8: 0.143; G = 16: 0.067" in section
    # (ii) at the largest n: G* and the half-width reached
    assert "- large, 4,096 rollouts: G* = 11.0 [9.3, 13.5] at the prompt (nmse 0.100 [0.080, 0.120], half-width " \
           "reached 0.020): between G = 8 and G = 16, its whole interval too." in section  # fmt: skip
    # (iii) the crossings at the prompt
    assert "| small | 256 [256] | 1,024 [1,024] | 4,096 [never] | never |" in section
    assert "| large | 256 [256] | 256 [256] | 4,096 [4,096] | never |" in section
    assert "Over all states, against GRPO's nmse over states" in section
    # (iv) accuracy: the paired difference from GRPO at G = 8, per seed then the t interval, computed here again
    for name in ("ppo-small-n4096-paid", "grpo-group-g2"):
        per_seed = [sum(a - b for a, b in zip(correct[(name, s)], correct[("grpo-group", s)])) / 100 for s in (1, 2, 3)]
        d, lo, hi = intervals.mean_interval(per_seed)
        cell = f"{100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
        (line,) = [x for x in section.splitlines() if x.startswith(f"| {name} |")]
        assert cell in line, (cell, line)
    # and a pretrained critic's from the control, PPO without a critic; the control itself has no such cell
    for name in ("ppo-small-n4096-paid", "ppo-small-n4096-amortised"):
        per_seed = [sum(a - b for a, b in zip(correct[(name, s)], correct[("ppo-none", s)])) / 100 for s in (1, 2, 3)]
        d, lo, hi = intervals.mean_interval(per_seed)
        (line,) = [x for x in section.splitlines() if x.startswith(f"| {name} |")]
        assert line.split(" | ")[6] == f"{100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]", line
    (none,) = [x for x in section.splitlines() if x.startswith("| ppo-none |")]
    assert none.split(" | ")[1:3] == ["none", "-"] and none.split(" | ")[6] == "-"
    (paid,) = [x for x in section.splitlines() if x.startswith("| ppo-small-n4096-paid |")]
    assert "| small | paid | 3 |" in paid and paid.endswith("| 150k |")
    assert [x.split(" | ")[1] for x in section.splitlines() if x.startswith("| grpo-group")] == [
        "G = 2", "G = 4", "G = 8", "G = 16"
    ]  # fmt: skip
    assert "seed 1: 1,001 generated tokens in 3 steps" in section
    # (v) the ceiling: not measured here, and said so
    assert "TODO: not measured" in section
    png = out / "report" / crossover.FIGURE
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 20_000 and f"![{crossover.FIGURE}]" in section
    # with the linear read-out in the curve: its row, no TODO
    write_curve(out / "crossover" / "curve", linear=True)
    md = report.write_report(out, out / "report").read_text()
    assert "TODO" not in md and "nmse at the prompt 0.220 [0.200, 0.240]; inside completions 0.530" in md
    assert (
        "| linear | none (fitted on the held-out targets, 8 folds) | - | 0.220 [0.200, 0.240] | 5.5 [5.2, 6.0] |" in md
    )


def test_a_folder_without_the_crossovers_parts_has_no_section_and_a_damaged_curve_is_named(tmp_path):
    older = tmp_path / "older"  # an older sweep: the committed organism study's head-to-head alone
    shutil.copytree(REPO / "docs" / "organism" / "h2h" / "grpo-group-s1", older / "h2h" / "grpo-group-s1")
    runs, _ = report.load_runs(older)
    assert runs and crossover.section(older, report.summarize(runs), runs, None, tmp_path) == []
    out = tmp_path / "out"
    synthetic_sweep(out)
    md = report.write_report(out, out / "report").read_text()
    assert "## Where the crossover lies" in md and "curve.json is missing (the plan runs it first)" in md
    (out / "crossover" / "curve").mkdir()
    (out / "crossover" / "curve" / "curve.json").write_text('{"rows": [{"capacity": "small", "rollouts": -4}]}')
    md = report.write_report(out, out / "report").read_text()
    assert "curve.json is damaged: AssertionError rollouts -4" in md and "### Accuracy at matched compute" in md


@pytest.mark.parametrize(
    "args, message",
    [
        (["--groups", "1", "4"], "group size 1: G must be a whole number of at least 2"),
        (["--groups", "two"], "--groups"),
        ([], "curve.json is missing"),
    ],
)
def test_the_command_on_a_curve_alone_and_its_bad_input(tmp_path, args, message):
    folder = tmp_path / "curve"
    if args:
        write_curve(folder)
    proc = run_here("study.crossover", [str(folder), *args])
    assert message in check_one_error_line(proc)
    assert not (folder / crossover.FIGURE).exists()


def test_the_command_writes_the_tables_and_the_figure_beside_the_curve(tmp_path):
    write_curve(tmp_path, linear=True)
    proc = run_here("study.crossover", [str(tmp_path), "--groups", "4", "8"])
    check_ok(proc)
    assert "| critic | G = 4 | G = 8 |" in proc.stdout and "| large | 256 [256] | 4,096 [4,096] |" in proc.stdout
    assert (tmp_path / crossover.FIGURE).read_bytes()[:8] == PNG


# ======================================================================================================
# End to end: a small crossover plan on the tiny model (the slow lane)
# ======================================================================================================

SMALL_PLAN = """\
# crossover: a small one, on the tiny model
crossover  curve  study.pretrain_critic --critics small --rollouts 4 8 --measure --holdout 16 --mc-prompts 4 --mc-samples 2 --chunk 4 --epochs 1
crossover  grpo-group  grpo.py --batch-size 4 --group-size 2
crossover  grpo-group-g4  grpo.py --batch-size 2 --group-size 4
crossover  fit-lr3e-3-e2  study.pretrain_critic --critics small --rollouts 8 --measure --holdout 16 --mc-prompts 4 --mc-samples 2 --chunk 4 --epochs 2 --lr 3e-3 --pool-from {out}/crossover/curve
crossover  ppo-small-n8-amortised  ppo.py --critic small --critic-init {out}/crossover/curve/critic-small-n8.safetensors --token-budget {tokens} --total-steps {10*steps}
crossover  ppo-small-n4-paid  ppo.py --critic small --critic-init {out}/crossover/curve/critic-small-n4.safetensors --count-critic-init-tokens --token-budget {tokens} --total-steps {10*steps} --batch-size 4 --mc-every 0 --eval-every 0
crossover  ppo-small-n4-amortised  ppo.py --critic small --critic-init {out}/crossover/curve/critic-small-n4.safetensors --token-budget {tokens} --total-steps {10*steps} --batch-size 4 --mc-every 0 --eval-every 0
smoke  *  --total-steps 2 --max-new-tokens 8 --eval-every 1 --eval-size 8 --test-size 8 --eval-max-new-tokens 8
smoke  study.pretrain_critic  --max-new-tokens 8
smoke  ppo.py  --eval-batch-size 8 --batch-size 8 --micro-batch-size 8 --num-minibatches 2 --mc-every 1 --mc-prompts 2 --mc-samples 4
smoke  grpo.py  --eval-batch-size 8 --micro-batch-size 8 --num-minibatches 2 --mc-every 1 --mc-prompts 2 --mc-samples 4
"""


@pytest.mark.slow
def test_a_small_crossover_runs_its_curve_once_then_the_runs_and_reports_the_section(tmp_path):
    """The plan's step runs beside the runs without a budget, writes the critics the PPO lines load, is left out of
    plan.tsv; the PPO runs read the budget of their own experiment's G = 8 line, the paid one spends the
    pretraining's tokens from it; the report has the section; a second sweep skips the finished runs and runs the
    step again, which reuses every chunk and critic. One seed: the tiny model's weights are drawn from --seed, so a
    critic pretrained at seed 1 is refused by a run at seed 2 (another policy), as it should be; the organism's
    are fixed (that the step runs once for every seed: the plan's test above)."""
    out = tmp_path / "out"
    argv = ["--smoke", "--force", "--seeds", "1", "--out", str(out), "--default-experiments", "crossover",
            "--budget-from", "crossover/grpo-group"]  # fmt: skip

    def sweep() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-P", "-m", "study.sweep_runner", *argv], input=SMALL_PLAN, cwd=REPO,
                              env={**trainer_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                              timeout=900)  # fmt: skip

    proc = sweep()
    check_ok(proc)
    curve = out / "crossover" / "curve"
    assert proc.stdout.count("study.pretrain_critic --out") == 2 and (curve / "curve.json").is_file()
    assert "sweep: 7 of 7 runs finished" in proc.stdout  # the two steps and the 5 runs
    # the fit's step names {out}: it started after the curve had finished, and linked its pool (sampled nothing)
    fit_log = (out / "logs" / "crossover" / "fit-lr3e-3-e2.log").read_text()
    assert "linked from" in fit_log and "0 chunks made now" in fit_log
    assert (out / "crossover" / "fit-lr3e-3-e2" / "curve.json").is_file()
    assert "curve" not in (out / "plan.tsv").read_text() and len((out / "plan.tsv").read_text().splitlines()) == 5
    critics = sorted(curve.glob("critic-*.safetensors"))
    assert [p.name for p in critics] == ["critic-small-n4.safetensors", "critic-small-n8.safetensors"]
    stamps = [p.stat().st_mtime_ns for p in critics]
    for seed in (1,):
        budget = json.loads((out / "crossover" / f"grpo-group-s{seed}" / "results.json").read_text())
        paid = json.loads((out / "crossover" / f"ppo-small-n4-paid-s{seed}" / "results.json").read_text())
        init = paid["critic_init"]
        assert init["paid"] and init["rollouts"] == 4 and init["token_budget"] == budget["generated_tokens"]
        assert paid["args"]["token_budget"] == budget["generated_tokens"] - init["tokens"]
        # the amortised twin continued the paid run's checkpoint (--resume), its first steps the paid run's
        started = next(line for line in proc.stdout.splitlines() if f"ppo-small-n4-amortised-s{seed} (" in line)
        assert f"(continuing crossover/ppo-small-n4-paid-s{seed}'s {paid['steps']} steps)" in started, started
        assert started.endswith("--resume")
        amortised = out / "crossover" / f"ppo-small-n4-amortised-s{seed}"
        cont = json.loads((amortised / "results.json").read_text())
        assert not cont["critic_init"]["paid"] and cont["args"]["token_budget"] == budget["generated_tokens"]
        assert cont["steps"] > paid["steps"] and cont["generated_tokens"] >= budget["generated_tokens"]
        same = ("reward", "generated_tokens", "pg_loss", "vf_loss")
        rows = [
            [{k: r[k] for k in same} for r in step_rows(d)]
            for d in (amortised, amortised.with_name(f"ppo-small-n4-paid-s{seed}"))
        ]
        assert rows[0][: len(rows[1])] == rows[1] and len(rows[0]) == cont["steps"]
    md = (out / "report" / "report.md").read_text()
    assert (
        "## Where the crossover lies" in md and "| small | 8 |" in md and (out / "report" / crossover.FIGURE).is_file()
    )
    assert "### The fit's settings" in md and "| small | 8 | 0.003 | 2 | fit-lr3e-3-e2 |" in md
    assert "| ppo-small-n4-paid | small | paid | 1 |" in md and "| grpo-group-g4 | G = 4 | - | 1 |" in md
    again = sweep()
    check_ok(again)
    assert again.stdout.count("skip  ") == 5 and again.stdout.count("study.pretrain_critic --out") == 2
    assert [p.stat().st_mtime_ns for p in critics] == stamps  # reused, not fitted again
    log = (out / "logs" / "crossover" / "curve.log").read_text()
    assert log.count("=== ") == 2 and "0 chunks made now" in log
