"""The study's machinery: what runs the sweep and reads it, none of the method.

Holds: sweep_runner.py (runs sweep.sh's plan: the processes, the lock, SLURM; no torch) and sweep_help.py (its
--help), preflight.py (before a sweep: has the model the signal the study needs?), report.py (the sweep's report,
each run's curves) with what it uses: read_runs.py (reads the run folders), plots.py (draws), estimate.py (the
sweep's duration, a model's memory), crossover.py (where a pretrained critic equals GRPO's group: the report's
section and figure); pretrain_critic.py (critics pretrained on the frozen starting policy, for ppo.py --critic-init,
and their learning curve against Monte Carlo).
Does not hold: the trainers and the modules they import (the repository's root), the plumbing (plumbing/). The
study imports the method's modules, never the other way (tests/test_layout.py); the preflight alone imports the
trainers, to read their settings as they would. Run from the repository root: ./sweep.sh, python report.py,
python -m study.preflight, python -m study.pretrain_critic, python -m study.crossover.
"""
