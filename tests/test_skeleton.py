"""The skeleton the three trainers share: every `TRY NOT TO MODIFY` region of ppo.py, grpo.py and dpo.py identical
line for line, in the same order, so that the method is what `ALGO LOGIC` marks and `diff ppo.py grpo.py` is about
the method (docs/design.md). Read from the source; the checks themselves fail on a trainer written to fail them.

A region starts at a comment line that names its kind (`# TRY NOT TO MODIFY: ...` or `# ALGO LOGIC: ...`, also as a
numbered step, `# --- 2. ALGO LOGIC: ...`) and runs to the next such line; a banner's rules (`# ====`) are not
part of it. The last region runs to the end of the file.
"""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ("ppo.py", "grpo.py", "dpo.py")
TRY, ALGO = "TRY NOT TO MODIFY", "ALGO LOGIC"
MARKER = re.compile(rf"^\s*#\s*(?:-+\s*)?(?:\d+\.\s*)?({TRY}|{ALGO}):")
RULE = re.compile(r"^\s*# ?={20,}\s*$")
MAX_DIFF = 200  # `diff ppo.py grpo.py | grep -c '^[<>]'` at 200 or fewer, all of it the method (docs/design.md)


def regions(text: str) -> list[tuple[str, list[str]]]:
    """The marked regions of a trainer, in order: (kind, its lines, the marker line first)."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        m = MARKER.match(line)
        if m:
            out.append((m.group(1), []))
        if out and not RULE.match(line):
            out[-1][1].append(line)
    return out


def skeleton(text: str) -> list[list[str]]:
    return [lines for kind, lines in regions(text) if kind == TRY]


def skeleton_differences(texts: dict[str, str]) -> list[str]:
    """Where the skeletons differ: the first trainer's against each other one, region by region; [] when identical."""
    (first, a), *others = texts.items()
    out = []
    for name, b in others:
        sa, sb = skeleton(a), skeleton(b)
        if len(sa) != len(sb):
            out.append(f"{first} has {len(sa)} {TRY} regions, {name} {len(sb)}")
        for i, (ra, rb) in enumerate(zip(sa, sb)):
            if ra != rb:
                diff = difflib.unified_diff(
                    ra, rb, f"{first} region {i + 1}", f"{name} region {i + 1}", lineterm="", n=0
                )
                out.append("\n".join(list(diff)[:12]))
    return out


def read(name: str) -> str:
    return (ROOT / name).read_text()


def test_the_three_skeletons_are_identical_line_for_line():
    found = skeleton_differences({name: read(name) for name in TRAINERS})
    assert not found, "the skeletons differ; move the method under an ALGO LOGIC banner:\n" + "\n\n".join(found)


@pytest.mark.parametrize("name", TRAINERS)
def test_the_skeleton_holds_the_shared_life_of_a_run(name):
    """Not an empty agreement: the skeleton is most of main()'s shared life, in order, and the method is apart."""
    text = read(name)
    kinds = [kind for kind, _ in regions(text)]
    assert kinds.count(TRY) >= 4 and kinds.count(ALGO) >= 3, kinds
    shared = "\n".join(line for lines in skeleton(text) for line in lines)
    order = ["runtime.cli(Args, CPU_SCALE)", "checkpoint.prepare_run_dir(", "checkpoint.load_checkpoint(",
             "logs.describe_run(", "logs.MetricsLogger(", "def save()", "while counters", "logger.log(",
             "stopper.should_stop()", "logs.write_results("]  # fmt: skip
    places = [shared.find(s) for s in order]
    assert -1 not in places and places == sorted(places), dict(zip(order, places))
    method = "\n".join(line for kind, lines in regions(text) if kind == ALGO for line in lines)
    for own in ("models.load_model(", "optimizer = torch.optim.AdamW(", "loss.backward()"):
        assert own in method and own not in shared, own
    if name == "dpo.py":  # DPO's pair sampling and log-probs once stood under the skeleton's banner
        for f in ("def sample_pairs(", "def seq_logps(", "def reference_logps(", "def spread("):
            assert f in method and f not in shared, f


def test_a_line_changed_in_the_skeleton_is_caught_and_one_in_the_method_is_not():
    texts = {name: read(name) for name in TRAINERS}
    ppo = texts["ppo.py"]
    changed = ppo.replace("    validate(args)\n", "    validate(args)  # changed\n", 1)
    assert changed != ppo
    found = skeleton_differences({**texts, "ppo.py": changed})
    assert len(found) == 2 and all("validate(args)  # changed" in f for f in found), found
    # a line inside a method region may differ at will
    method_line = "    policy = models.load_model(args.model, tokenizer, args.seed).to(home)\n"
    assert method_line in ppo
    assert skeleton_differences({**texts, "ppo.py": ppo.replace(method_line, method_line + "    pass\n")}) == []
    # a region moved from the skeleton into the method is seen too: one TRY region fewer
    banner = ppo.index("# TRY NOT TO MODIFY: the end")
    demoted = ppo[:banner] + "# ALGO LOGIC: the end" + ppo[banner + len("# TRY NOT TO MODIFY: the end") :]
    assert any("regions" in f for f in skeleton_differences({**texts, "ppo.py": demoted}))


def test_ppo_and_grpo_differ_by_their_method_only():
    """`diff ppo.py grpo.py | grep -c '^[<>]'`: the lines that differ, at most MAX_DIFF (CleanRL's variants diff by
    about 80)."""
    if shutil.which("diff") is None:
        pytest.skip("no diff on this machine")
    out = subprocess.run(["diff", "ppo.py", "grpo.py"], cwd=ROOT, capture_output=True, text=True).stdout
    changed = sum(line[:1] in "<>" and line != "" for line in out.splitlines())
    assert 0 < changed <= MAX_DIFF, f"diff ppo.py grpo.py: {changed} lines differ (at most {MAX_DIFF})"
