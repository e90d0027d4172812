"""The report's "How the crossover moves" (study/moves.py) on known inputs: each organism's card, G* per capacity
with its interval from the curve's nmse, GRPO's measured line, the best head, the sentence and the figure; a folder
with only the crossover's own curve gets no section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plumbing import models
from study import moves


def row(capacity: str, rollouts: int | None, nmse: float, half: float = 0.05) -> dict:
    return {"capacity": capacity, "rollouts": rollouts,
            "prompt": {"nmse": nmse, "nmse_lo": nmse - half, "nmse_hi": nmse + half}}  # fmt: skip


def write_curve(out: Path, name: str, spread: float, heads: dict[str, float], parameters: int, ops=(2, 3)) -> None:
    rows = [row("constant", 1024, spread + 0.1), row("constant", 4096, spread), row("linear", None, spread * 0.8)]
    for cap, nmse in heads.items():
        rows += [row(cap, 1024, nmse + 0.2), row(cap, 4096, nmse), row(cap, 16384, nmse / 10)]  # 16384: not read
    curve = {
        "heldout": {
            "prompts": 512,
            "pass_rate": 0.3,
            "informative_share": 0.8,
            "mean_p_1_minus_p": 0.15,
            "mc_samples": 20,
        },  # fmt: skip
        "grpo_prompt_measured": {"2": {"nmse": 0.98}, "4": {"nmse": 0.34}, "8": {"nmse": 0.15}, "16": {"nmse": 0.07}},
        "organism": {
            "name": name,
            "settings": {"min_ops": ops[0], "max_ops": ops[1], "max_number": 40},
            "report": {"parameters": parameters, "seconds": 120.0, "test_greedy": 0.45},
        },  # fmt: skip
        "rows": rows,
    }
    path = out / moves.CURVES[name]
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(curve))


@pytest.fixture
def folder(tmp_path) -> Path:
    write_curve(tmp_path, models.ORGANISM, 0.25, {"small": 0.25, "large": 0.20}, 616_896)
    write_curve(tmp_path, "organism-small", 0.30, {"small": 0.30, "large": 0.28}, 280_192)
    write_curve(tmp_path, "organism-large", 0.25, {"small": 0.20, "large": 0.10}, 2_413_440)
    write_curve(tmp_path, "organism-wide", 0.60, {"small": 0.125, "large": 0.15}, 616_896, ops=(1, 5))
    return tmp_path


def test_the_tables_read_g_star_at_4096_rollouts_with_its_interval(folder):
    organisms = moves.read_organisms(folder)
    assert list(organisms) == list(moves.CURVES)  # the organism first, then the others, in the tables' order
    table = "\n".join(moves.g_star_table(organisms))
    # organism-large's large head: nmse 0.10 [0.05, 0.15] -> G* = 11.0 [7.7, 21.0]; the 16,384 row is not read
    (large,) = [line for line in table.splitlines() if line.startswith("| organism-large ")]
    cells = [c.strip() for c in large.strip("|").split("|")]
    assert cells[3] == "11.0 [7.7, 21.0]" and cells[1] == "5.0 [4.3, 6.0]"  # the large head; the constant 0.25
    assert cells[-1] == "0.980 / 0.340 / 0.150 / 0.070"
    cards = "\n".join(moves.card_table(organisms))
    assert "| organism-wide | 616,896 | 1-5, numbers 0-40 | 2.0 min | 0.450 |" in cards
    assert "0.600 [0.550, 0.650]" in cards  # the spread: the constant's nmse at the prompt at 4,096 rollouts


def test_the_best_head_and_the_sentence(folder):
    organisms = moves.read_organisms(folder)
    assert moves.best_head(organisms["organism-wide"]) == "small" and moves.best_head(organisms["organism"]) == "large"
    # the full critic (the crossover's curve has it, the others' do not) is no head: never the sentence's best
    organisms[models.ORGANISM]["rows"].append(row("full", 4096, 0.01))
    assert moves.best_head(organisms[models.ORGANISM]) == "large"
    assert "critic full" in "\n".join(moves.g_star_table(organisms))  # the table still shows it
    size, spread = moves.moves_sentence(organisms)
    assert size.index("0.28M (organism-small") < size.index("0.62M (organism,") < size.index("2.41M (organism-large")
    assert "G* 11.0 [7.7, 21.0] at 2.41M" in size
    assert "G* 9.0 [6.7, 14.3] on organism-wide (spread 0.600 [0.550, 0.650], critic small)" in spread


def test_how_far_it_carries_names_the_largest_organism_and_the_group_sizes_that_bracket_g_star(folder):
    organisms = moves.read_organisms(folder)
    # the best heads' nmse: 0.20, 0.28, 0.10, 0.125 -> G* 6.0, 4.57, 11.0, 9.0: bracketed by G = 4 and 16
    line = moves.carries_line(organisms)
    assert "up to 2.41M parameters" in line and "G* spans 4.6-11.0" in line and "at G = 4, 8, 16 " in line
    del organisms["organism-large"]  # G* 4.6-9.0: 4 to 16 still; without the wide one, 4.6-6.0: G = 4, 8
    del organisms["organism-wide"]
    assert "at G = 4, 8 " in moves.carries_line(organisms) and "up to 0.62M" in moves.carries_line(organisms)


def test_the_section_and_its_figure_and_none_without_the_other_organisms(folder, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = tmp_path / "report"
    report.mkdir()
    lines = moves.section(folder, plt, report)
    assert lines[1] == "## How the crossover moves" and (report / moves.FIGURE).stat().st_size > 10_000
    last = moves.section(folder, None, report)[-3:]
    assert last[0].startswith("**Against the task's spread**") and last[2].startswith("**How far it carries**")
    alone = tmp_path / "alone"
    write_curve(alone, models.ORGANISM, 0.25, {"small": 0.25}, 616_896)
    assert moves.section(alone, plt, report) == []  # the crossover's own curve: its section, not this one


def test_a_curve_without_a_card_of_its_own_reads_the_shipped_build(folder):
    curve = json.loads((folder / moves.CURVES[models.ORGANISM]).read_text())
    del curve["organism"]  # the crossover's curve, made before curves carried the card
    shipped = json.loads((models.SHIPPED_ORGANISMS[models.ORGANISM] / models.ORGANISM_RECORD).read_text())["report"]
    assert moves.card(models.ORGANISM, curve)["parameters"] == shipped["parameters"] == 616_896


def summary_row(experiment: str, run: str, method: str, acc: float, tokens: int) -> dict:
    nan = float("nan")
    return {"experiment": experiment, "run": run, "method": method, "variant": run.split("-", 1)[1], "seeds": 3,
            "test_accuracy": acc, "interval_low": acc - 0.01, "interval_high": acc + 0.01, "nmse_prompt": 0.3,
            "nmse_prompt_low": 0.25, "nmse_prompt_high": 0.35, "generated_tokens": tokens, "vs_grpo": nan}  # fmt: skip


def test_the_head_to_head_table_reads_each_run_against_both_group_sizes():
    """GRPO by G, then PPO amortised and paid; each row's paired difference from GRPO at the smaller and the larger G
    (report.paired_vs_grpo's tuple against each of H2H's references); the pretraining tokens only where a critic was
    pretrained; another experiment's runs and the size experiment's, not run, are not in it."""
    small_g, large_g = moves.H2H["spread"][1]
    assert (small_g, large_g) == ("grpo-group-g2", "grpo-group-g4")
    runs = [
        {"experiment": "spread", "run": large_g, "method": "grpo", "args": {"group_size": 4}},
        {"experiment": "spread", "run": small_g, "method": "grpo", "args": {"group_size": 2}},
        {
            "experiment": "spread",
            "run": "ppo-large-n4096-paid",
            "method": "ppo",
            "args": {},
            "critic_init": {"tokens": 150_000, "paid": True},
        },  # fmt: skip
        {
            "experiment": "spread",
            "run": "ppo-large-n4096-amortised",
            "method": "ppo",
            "args": {},
            "critic_init": {"tokens": 150_000, "paid": False},
        },  # fmt: skip
        {"experiment": "spread", "run": "ppo-none", "method": "ppo", "args": {}},
        {"experiment": "crossover", "run": "grpo-group", "method": "grpo", "args": {"group_size": 8}},
    ]
    summary = [
        summary_row("spread", "ppo-large-n4096-paid", "ppo", 0.50, 480_000),
        summary_row("spread", large_g, "grpo", 0.52, 480_000),
        summary_row("spread", "ppo-large-n4096-amortised", "ppo", 0.55, 480_000),
        summary_row("spread", small_g, "grpo", 0.48, 470_000),
        summary_row("spread", "ppo-none", "ppo", 0.53, 480_000),
        summary_row("crossover", "grpo-group", "grpo", 0.60, 480_000),
    ]
    paired = {
        small_g: {("spread", "ppo-large-n4096-amortised"): (0.07, 0.02, 0.12, 1000.0, 3.0)},
        large_g: {
            ("spread", "ppo-large-n4096-amortised"): (0.03, -0.01, 0.07, 1000.0, 3.0),
            ("spread", small_g): (-0.04, -0.08, 0.0, 1000.0, 3.0),
        },
        "ppo-none": {
            ("spread", "ppo-large-n4096-amortised"): (0.02, -0.02, 0.06, 1000.0, 3.0),
            ("spread", small_g): (-0.05, -0.09, -0.01, 1000.0, 3.0),
        },
    }
    lines = moves.accuracy_table(summary, runs, paired)
    body = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    order = [small_g, large_g, "ppo-none", "ppo-large-n4096-amortised", "ppo-large-n4096-paid"]
    assert [r[1] for r in body] == order  # GRPO by G, the control, the critics
    assert [r[2] for r in body] == ["G = 2", "G = 4", "no critic", "critic large", "critic large"]
    assert [r[3] for r in body] == ["-", "-", "-", "amortised", "paid"]
    amortised = body[3]
    assert amortised[0] == "organism-wide" and amortised[5] == "55.0 [54.0, 56.0]"
    # vs G = 2, vs G = 4, vs PPO without a critic
    assert amortised[6:9] == ["+7.0 [+2.0, +12.0]", "+3.0 [-1.0, +7.0]", "+2.0 [-2.0, +6.0]"]
    assert body[0][6:9] == ["-", "-4.0 [-8.0, +0.0]", "-"]  # GRPO against the control: not a critic's difference
    assert body[4][6:9] == ["-", "-", "-"]  # no pair: no difference
    assert [r[-1] for r in body] == ["-", "-", "-", "150k", "150k"] and body[0][-2] == "470k"
    assert moves.accuracy_table(summary, runs[-1:], paired) == []  # no run of the head-to-head: no table
