"""Shared fixtures: the GSM8K sample and the whole GSM8K where the machine has it, the tiny model's tokenizer (SmolLM2's, from the packaged GGUF), a finished
one-step run, and the smoke sweep (run once per session).

Markers (pyproject.toml): `packaged` (the packaged SmolLM2 model), `slow` (the tests the fast lane,
`python -m pytest -q -m "not slow"`, leaves out: torchrun, the smoke sweep, learning tests, long subprocesses).

pytest-xdist runs the tests on every core (pyproject.toml: `-n auto --dist loadgroup`). A session fixture runs
once in each worker that uses it: the tests that read the smoke sweep run in one worker (ONE_WORKER, below)."""

import os
import sys
from pathlib import Path

import pytest

from plumbing import models

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # import common, engine, runtime, critics from the repository root

# The tests read GSM8K's files from the sample committed under tests/data/gsm8k (its README: the first 700 train and
# 200 test problems, MIT), whatever GSM8K_DIR says, so that they pass in full on a machine with this repository
# alone. GSM8K_DIR, where set, names the whole GSM8K for the few tests that check all of it (full_gsm8k_dir).
GSM8K_SAMPLE = ROOT / "tests" / "data" / "gsm8k"
# GSM8K_DIR as the session found it, kept for the xdist workers (they start with this process's environment)
FULL_GSM8K = os.environ.setdefault("TESTS_WHOLE_GSM8K_DIR", os.environ.get("GSM8K_DIR", ""))
os.environ["GSM8K_DIR"] = str(GSM8K_SAMPLE)  # what the trainers read in this process and in the tests' subprocesses


def pytest_sessionstart(session):
    """Each process that runs tests (an xdist worker, or pytest's own with -n 0), as helpers.trainer_env sets it for
    the tests' subprocesses: glibc's malloc keeps what torch frees for reuse, rather than mapping every large tensor
    (a step's logits) afresh and faulting its pages in (a tiny 3-step PPO run on one thread: 5.5-5.9 s of 17.5-19.9
    CPU seconds in the kernel without, 1.2 s of 12.5-13.0 with; 2026-12-03, 2 cores shared with other work), and
    torch on one thread: the workers, one a core, and the subprocesses they start share the cores (two threads spin
    while they wait)."""
    import ctypes

    import torch

    libc = ctypes.CDLL(None)
    libc.mallopt(-4, 0)  # M_MMAP_MAX: no mmap, so MALLOC_MMAP_MAX_=0 as trainer_env sets it
    libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: MALLOC_TRIM_THRESHOLD_
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """The committed sample of GSM8K: a folder in GSM8K's files and format."""
    return GSM8K_SAMPLE


@pytest.fixture(scope="session")
def full_gsm8k_dir() -> Path:
    """The whole GSM8K (7,473 train and 1,319 test problems), for a test that checks all of it: GSM8K_DIR as the
    session found it, or a skip that says why (CI sets it; a newcomer's machine need not have it)."""
    path = Path(FULL_GSM8K).resolve() if FULL_GSM8K else None
    if (
        path is None
        or path == GSM8K_SAMPLE
        or not (path / "train.jsonl").is_file()
        or not (path / "test.jsonl").is_file()
    ):
        pytest.skip(
            "checks the whole GSM8K (7,473 train and 1,319 test problems; the sample under tests/data/gsm8k has 700 and 200): "
            "set GSM8K_DIR to a folder with GSM8K's "
            f"train.jsonl and test.jsonl (GSM8K_DIR={FULL_GSM8K!r})"
        )
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer():

    return models.load_tokenizer(models.TINY_MODEL)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A finished one-step PPO run with a checkpoint (helpers.SMALL_RUN); tests copy it before changing anything.
    Once per worker, not per module: four files read it, and each worker runs tests of all four (a run each, ~1.3 s).
    """
    from helpers import SMALL_RUN, check_ok, cli, run_here

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    check_ok(run_here("ppo.py", cli(run_dir, **SMALL_RUN)))
    return run_dir


@pytest.fixture(scope="session")
def smoke_sweep(tmp_path_factory):
    """`./sweep.sh --smoke` once per session: (its OUT folder, the finished process, seconds). Tests read it, and
    copy what they change; a test that uses it is slow by nature, and is in tests/test_sweep.py, whose tests run
    in one xdist worker (ONE_WORKER)."""
    import time

    from helpers import check_ok, run_sweep

    out = tmp_path_factory.mktemp("sweep") / "smoke"
    t0 = time.time()
    proc = run_sweep("--smoke", "--out", out)
    seconds = time.time() - t0
    check_ok(proc)
    return out, proc, seconds


# Tests of 2.5 s or more (2 idle cores, 2026-12-02: the fast lane took 323 s with them) that the fast lane leaves
# out because another test in it covers the same path: one stop-signal place of five, one trainer of three, one
# critic of five in each kind of end-to-end test stays in. The full suite (CI) runs them all.
SLOW_TOO = {
    "test_organism.py::test_the_organism_is_built_once_into_the_cache_and_again_when_damaged": "2 builds, 10 s; "
    "test_organisms.py's organism-wide build through the cache stays",
    "test_organism.py::test_gsm8k_through_data_dir_is_outside_the_organisms_vocabulary": "5 s; the alphabet check stays",
    "test_sweep.py::test_a_budget_matched_runs_cosine_schedule_ends_with_its_budget[grpo.py]": "5 s; ppo's, dpo's stay",
    "test_threads.py::test_the_banner_and_the_results_show_the_thread_count": "4 s; the choice's own tests stay",
    "test_bench.py::test_busy_machine_runs_each_configuration_idle_and_beside_its_busy_processes": "4 s, the bench's",
    "test_bench.py::test_decode_floor_reads_the_row_groups_widths": "4 s, the bench's; the engine's row groups stay",
    "test_organisms.py::test_each_recipe_builds_the_same_files_twice[organism-small]": "4 s; -wide's stays",
    "test_organisms.py::test_each_recipe_builds_the_same_files_twice[organism-large]": "5 s",
    "test_organism.py::test_a_run_on_the_organism_reads_its_task_and_records_it": "6 s; test_organisms.py's stays",
    "test_faults.py::test_a_stop_signal_anywhere_stops_at_once_and_resume_redoes_only_what_is_missing[evaluate-4": "4 s; evaluate-3 stays",
    "test_faults.py::test_a_damaged_tokenizer_cache_is_named_moved_aside_and_rebuilt": "a tokenizer cache built twice, 7 s",
    "test_preflight.py::test_the_toy_task_passes_the_preflight_and_writes_its_json": "trainer subprocesses, 11 s",
    "test_generation.py::test_greedy_matches_transformers_generate_smollm2": "the packaged model dequantised on a fresh cache, 20-30 s",
    "test_preflight.py::test_gsm8k_on_the_tiny_model_is_refused_and_a_sweep_stops_before_any_run_folder_exists": "9 s",
    "test_preflight.py::test_a_model_that_cannot_be_fetched_is_one_error_line": "7 s; test_offline.py's trainer stays",
    "test_checkpoint.py::test_a_damaged_checkpoint_is_refused_and_left_in_place[garbled manifest]": "6 s",
    "test_faults.py::test_a_stop_signal_during_dpo_pair_sampling_stops_at_once_and_nothing_is_left": "5 s",
    "test_faults.py::test_a_stop_signal_anywhere_stops_at_once_and_resume_redoes_only_what_is_missing[evaluate-1": "5 s",
    "test_faults.py::test_a_stop_signal_anywhere_stops_at_once_and_resume_redoes_only_what_is_missing[evaluate-2": "4 s",
    "test_faults.py::test_a_stop_signal_anywhere_stops_at_once_and_resume_redoes_only_what_is_missing[monte_carlo": "5 s",
    "test_faults.py::test_a_stop_signal_anywhere_stops_at_once_and_resume_redoes_only_what_is_missing[save_check": "4 s",
    "test_sweep.py::test_critic_lambda_is_an_optional_arm_at_lambda_095": "5 s",
    "test_guards.py::test_one_nonfinite_step_is_skipped_and_counted[dpo.py]": "4 s; ppo and grpo stay",
    "test_guards.py::test_a_second_nonfinite_step_stops_the_run_with_exit_3[dpo.py]": "4 s; ppo and grpo stay",
    "test_preflight.py::test_the_dry_run_shows_the_preflight_as_the_sweep_builds_it": "4 s",
    "test_tracking.py::test_track_logs_every_row_to_wandb_offline[ppo.py]": "4 s; dpo.py's stays",
    "test_ppo.py::test_each_critic_runs_two_steps_with_the_mc_measurement[large]": "3 s; small and full stay",
    "test_ppo.py::test_each_critic_runs_two_steps_with_the_mc_measurement[medium]": "3 s",
    "test_ppo.py::test_each_critic_runs_two_steps_with_the_mc_measurement[none]": "3 s",
    "test_ppo.py::test_critic_warmup_steps_move_the_critic_and_not_the_policy": "4 s",
    "test_ppo.py::test_recompute_logprobs_takes_old_logprobs_and_full_critic_values_from_the_training_forward": "3 s",
    "test_validation.py::test_a_bad_value_in_a_fresh_process_is_one_error_line[dpo.py": "2 s a process; ppo's stays",
    "test_validation.py::test_a_bad_value_in_a_fresh_process_is_one_error_line[grpo.py": "2 s a process",
    "test_qwen2.py::test_the_engine_runs_qwen2_with_its_biases_greedy_as_transformers[True]": "3 s; [False] stays",
    "test_qwen2.py::test_qwen2_sampled_tokens_equal_the_plain_path_and_logprobs_the_training_forward[True]": "2 s",
    "test_tracking.py::test_track_logs_every_row_to_wandb_offline[grpo.py]": "4 s",
    "test_guards.py::test_one_nonfinite_step_is_skipped_and_counted[ppo.py]": "3 s; grpo's stays",
    "test_faults.py::test_a_write_failing_during_a_save_is_one_line_and_keeps_the_last_checkpoint[torch]": "2 s",
    "test_engine.py::test_buckets_and_extra_rows_change_nothing": "3 s; the row-group test has extra rows too",
    "test_grpo.py::test_each_mode_runs_two_steps[dr-grpo clip-higher]": "2 s; grpo and rloo stay",
    "test_dpo.py::test_each_mode_runs_two_steps[gold offline sigmoid]": "2 s; the other modes stay",
    "test_offline.py::test_the_preflight_given_a_hub_model_not_cached_says_so_in_one_line": "5 s; the sweep's stays",
    "test_offline.py::test_the_sweep_given_a_hub_model_not_cached_says_so_in_one_line_and_leaves_no_folder[sweep]": "4 s",
    "test_sweep.py::test_a_budget_matched_runs_cosine_schedule_ends_with_its_budget[ppo.py]": "3 s; grpo's stays",
    "test_sweep.py::test_a_budget_matched_runs_cosine_schedule_ends_with_its_budget[dpo.py]": "3 s",
    "test_qwen2.py::test_a_model_that_cannot_be_fetched_is_one_line_before_anything_is_written": "3 s; test_offline's",
    # a new interpreter that imports transformers is ~5 s before it does anything: test_offline.py keeps one in the
    # fast lane (a trainer given a hub model that is not cached), the others go
    "test_offline.py::test_a_cached_hub_model_loads_offline_quietly": "7 s, with the cached hub it builds",
    "test_offline.py::test_a_cached_gsm8k_loads_offline_quietly": "4 s",
    "test_offline.py::test_a_trainer_without_gsm8k_says_where_to_get_it_in_one_line": "6 s",
    "test_offline.py::test_the_sweep_given_a_hub_model_not_cached_says_so_in_one_line_and_leaves_no_folder[pre": "4 s",
    "test_tracking.py::test_track_logs_every_row_to_wandb_offline[dpo.py]": "4 s, wandb's import; TensorBoard's stays",
    "test_data_fingerprint.py::test_a_resume_with_one_test_answer_changed_is_refused_naming_test": "3 s; train's stays",
    "test_pretrain.py::test_a_folder_of_other_settings_is_refused": "5 s; the resume test's folder is checked too",
    # 2026-12-07 (the fast lane at 120-124 s in a fresh clone): each covered by its sibling that stays
    "test_dpo.py::test_each_mode_records_what_its_flops_need[gold offline sigmoid]": "4 s; self online's stays",
    "test_dpo.py::test_each_mode_runs_two_steps[gold online ipo]": "3 s; the other modes stay",
    "test_ppo.py::test_each_critic_runs_two_steps_with_the_mc_measurement[small]": "2 s; full's stays",
    "test_pretrain.py::test_paid_pretraining_is_spent_from_the_token_budget": "3 s; the resume test's pretraining stays",
    "test_report_cli.py::test_the_committed_organism_study_gives_its_committed_report": "3 s; the sections' known "
    "inputs stay",
    "test_qwen2.py::test_ppo_with_a_full_critic_trains_tiny_qwen2_and_resumes": "2 s; qwen2's engine tests stay",
    # simulations of thousands of studies: one case of each stays
    "test_preflight.py::test_the_default_smallest_effect_tells_apart_what_the_docs_say": "3 s",
    "test_preflight.py::test_the_preflight_predicts_the_standard_error_of_what_the_report_compares[0.3-": "3 s",
    "test_intervals.py::test_the_difference_of_two_nmse_covers_95_percent_paired_by_seed[0.25]": "1 s; [0.0] stays",
}


# The files whose tests run in one xdist worker, one after another in their order, and first: test_sweep.py's read
# the smoke sweep (smoke_sweep above), a session fixture, which would otherwise run once in every worker that reads
# it; test_distributed.py's share its module fixtures (the equal-length data, the one-process PPO run two tests
# compare with), and its torchruns then never run beside one another. An `xdist_group` mark would say this test by
# test, but with pytest 9.2 it no longer reaches xdist's scheduler (pytest-xdist issue #1386: the group travels in
# the node id, which pytest now builds from its parts), so the scheduler below groups by file. The others' module
# fixtures run a trainer (or organism.py, study.pretrain_critic) that several of their tests read: spread over two
# workers, each ran it (test_data_fingerprint.py's first_run and test_pretrain.py's pretrained twice in a
# two-worker run of those files, 2026-12-07).
ONE_WORKER = (
    "tests/test_sweep.py",
    "tests/test_distributed.py",
    "tests/test_faults.py",  # straight_run, 3.5 s
    "tests/test_data_fingerprint.py",  # first_run, 2 s
    "tests/test_pretrain.py",  # pretrained, 1.7 s
    "tests/test_organism.py",  # built and small_cache's build
)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: unknown, and unused, without it
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup (pyproject.toml's addopts), with each file in ONE_WORKER one unit of work. xdist hands out
    the units with the most tests first, so these start as the session does; every other test is its own unit."""
    if config.getvalue("dist") != "loadgroup":
        return None  # another --dist: xdist's own scheduler
    from xdist.scheduler import LoadGroupScheduling

    class Scheduler(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return file if file in ONE_WORKER else super()._split_scope(nodeid)

    return Scheduler(config, log)


def pytest_collection_modifyitems(config, items):
    """Slow: a test that reads the smoke sweep (the sweep is minutes), whichever file it is in, and SLOW_TOO."""
    for item in items:
        if "smoke_sweep" in getattr(item, "fixturenames", ()):  # directly or through another fixture
            item.add_marker(pytest.mark.slow)
        name = item.nodeid.split("/")[-1]
        if any(name.startswith(prefix) for prefix in SLOW_TOO):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def torch_threads_unchanged():
    """Every test leaves torch's thread count as it found it (one, pytest_sessionstart): a test that left two
    made the tests after it in the same worker spin a second thread beside the other worker's (PPO's learning test:
    45 CPU seconds instead of 21, 2026-12-03). Put back, then reported as the test's error."""
    import torch

    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    torch.set_num_threads(before)
    assert after == before, f"the test left torch on {after} threads, not the {before} it began with"


@pytest.fixture()
def one_thread():
    """torch on one CPU thread for the test, as a torchrun worker runs. With more, SDPA's CPU kernel splits a
    decode query's slots by the width it reads, so a row's last bits follow the width (one hidden value 1e-4
    apart at 2 threads between row groups and none, 2026-12-02); with one, they are bitwise equal."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
