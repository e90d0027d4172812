"""The CPU's threads (plumbing/threads.py): the count chosen for the organism and for a larger model, the user's
OMP_NUM_THREADS and wait policy first, the passive wait set before torch loads libgomp (and honoured by it), and the
thread count in a trainer's banner and in the preflight's line. Not timed: bench/busy_machine.py measures what the
choice buys (docs/throughput.md, "A busy machine").
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plumbing import threads

ROOT = Path(__file__).resolve().parents[1]
# organism.py is not among them: it computes on one thread already (torch.set_num_threads(1), so no OpenMP thread
# waits), and an edit of it means remaking the shipped build (docs/organism), so it stays byte for byte as it was
SCRIPTS = ("ppo.py", "grpo.py", "dpo.py", "study/preflight.py")
ORGANISM_PARAMS, SMOLLM2_PARAMS = 616_896, 134_515_008  # organism-seed0/organism.json's; SmolLM2-135M's


def test_the_organism_runs_on_one_thread_and_a_larger_model_on_every_core():
    """On 2 cores and on 16: the organism (and the tiny test model) one thread, SmolLM2-135M torch's count."""
    for cores in (2, 16):
        small = threads.choose(ORGANISM_PARAMS, cores, {})
        assert small.count == 1 and "616,896 parameters" in small.why
        assert threads.choose(3_219_776, cores, {}).count == 1  # the tiny model: nearly all of it the embedding
        large = threads.choose(SMOLLM2_PARAMS, cores, {})
        assert large.count == cores and large.why.startswith("every core")
    assert threads.choose(threads.ONE_THREAD_BELOW - 1, 8, {}).count == 1
    assert threads.choose(threads.ONE_THREAD_BELOW, 8, {}).count == 8


def test_an_explicit_omp_num_threads_wins_over_the_choice():
    """The user's OMP_NUM_THREADS (torchrun's one a process too) wins either way; a
    value libgomp would ignore (not a positive integer) is ignored here too."""
    assert threads.choose(ORGANISM_PARAMS, 2, {"OMP_NUM_THREADS": "2"}).count == 2
    assert threads.choose(SMOLLM2_PARAMS, 16, {"OMP_NUM_THREADS": "1"}).count == 1
    assert threads.choose(SMOLLM2_PARAMS, 16, {"OMP_NUM_THREADS": "4,2"}).count == 4  # nested: the outer level
    given = threads.choose(SMOLLM2_PARAMS, 16, {"OMP_NUM_THREADS": "3"})
    assert given.count == 3 and given.why == "OMP_NUM_THREADS"
    for bad in ("0", "-1", "two", ""):
        assert threads.choose(ORGANISM_PARAMS, 2, {"OMP_NUM_THREADS": bad}).count == 1, bad


def test_the_wait_is_passive_unless_the_user_says_how_openmp_waits():
    env: dict[str, str] = {}
    assert threads.wait_passively(env) and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert threads.wait_policy(env) == "passive"
    for given in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(given)
        assert not threads.wait_passively(env) and env == given  # the user's wins, untouched
    assert threads.wait_policy({"OMP_WAIT_POLICY": "active"}) == "active"
    assert "GOMP_SPINCOUNT" in threads.wait_policy({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"})
    assert "libgomp's default" in threads.wait_policy({})


def test_once_torch_is_loaded_the_wait_is_left_alone(monkeypatch):
    """libgomp has read the environment by then: a policy set now would only misreport the one in force."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert "torch" in sys.modules and not threads.wait_passively()
    assert "OMP_WAIT_POLICY" not in os.environ


def test_use_threads_sets_torchs_count_for_the_model(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        chosen = threads.use_threads(torch.nn.Linear(10, 10), None)
        assert chosen.count == torch.get_num_threads() == 1 and "110 parameters" in chosen.why
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert threads.use_threads(torch.nn.Linear(10, 10)).count == torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_sets_the_wait_before_anything_loads_torch(script):
    """At the top of the script, run and not imported (`if __name__ == "__main__":`), threads.wait_passively() comes
    before every import but the standard library's and plumbing.threads' own (any other may load torch)."""
    body = ast.parse((ROOT / script).read_text()).body
    calls = [
        i
        for i, node in enumerate(body)
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "threads.wait_passively()" in ast.unparse(node)
    ]  # fmt: skip
    assert calls, f"{script} does not call threads.wait_passively() at its top"
    for node in body[: calls[0]]:
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = (
                [node.module.split(".")[0]] if node.module != "plumbing" else [f"plumbing.{a.name}" for a in node.names]
            )
        else:
            continue
        late = [n for n in names if n not in sys.stdlib_module_names and n not in ("__future__", "plumbing.threads")]
        assert not late, f"{script} imports {late} before it sets OpenMP's wait"


def test_libgomp_reads_the_passive_wait_a_script_sets():
    """In a fresh process, `ppo.py --help` (torch imported, nothing run): libgomp's own report of its settings
    (OMP_DISPLAY_ENV=VERBOSE, printed as it loads) shows the passive wait and no spin; without the script's call it
    would show libgomp's default spin, 300000."""
    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_VARIABLES}
    env.update(OMP_DISPLAY_ENV="VERBOSE", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "ppo.py"), "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    if "OMP_WAIT_POLICY" not in proc.stderr:
        pytest.skip("this torch's OpenMP runtime prints no OMP_DISPLAY_ENV report (not libgomp)")
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in proc.stderr and "GOMP_SPINCOUNT = '0'" in proc.stderr, proc.stderr[-2000:]


def test_the_banner_and_the_results_show_the_thread_count(tmp_path):
    """A trainer's banner says its threads, why and the wait (here the tests' OMP_NUM_THREADS=1: helpers.trainer_env),
    and results.json's device the count torch ran on."""
    from helpers import check_ok, check_results, cli, run_here

    proc = run_here("grpo.py", cli(tmp_path / "run", total_steps=1, group_size=2, eval_size=0, test_size=4), threads=1)
    check_ok(proc)
    said = [line for line in proc.stdout.splitlines() if line.startswith("threads: ")]
    assert said and said[0].startswith("threads: 1 (OMP_NUM_THREADS); OpenMP wait: "), proc.stdout[:2000]
    assert check_results(tmp_path / "run", steps=1)["device"].endswith("1 thread)")
