"""The CPU's threads: how many torch computes on, and how OpenMP's idle threads wait, so that a run slows gracefully
on a machine that is doing something else (docs/throughput.md, "A busy machine").

Holds: wait_passively (OMP_WAIT_POLICY=PASSIVE unless the environment says how OpenMP waits; a script calls it at its
top, before torch is imported, because libgomp reads the policy once, as torch loads it), choose (the thread count for
a model's size, an explicit OMP_NUM_THREADS first: a pure function), wait_policy (the policy an environment gives, in
words), use_threads (sets torch's count for a model; returns what the banner prints).
Does not hold: processes and devices (distributed.py). Imports nothing of the project, and torch only inside
use_threads, so that a script can import it before torch.

Why. torch's CPU wheel runs its parallel regions on GNU OpenMP (libgomp), and MKL's on the same threads. A region
splits its work evenly over the threads and ends when the last one ends; a thread that has finished spins
(GOMP_SPINCOUNT, 300,000 turns, about 3 ms by libgomp's own estimate) before it sleeps. Beside another process on the
same cores, one of the two threads is off its core for part of every region, and its partner spins meanwhile on
the core the other process wants: the main job (`python ppo.py --critic small`, tens of thousands of small regions)
went from about 2 minutes idle to over 10 beside one busy process on 2 cores. One thread has no partner to wait
for; a passive wait gives the core back at once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

# Below this many parameters a run computes on one thread. On 2 idle cores a second thread makes the organism's main
# job 1.7x faster (127 s against 215 s), and beside one busy process more than 3x slower (>= 600 s against 199 s);
# one thread's time does not depend on the machine's other work, nor does its summation order (docs/throughput.md,
# "A busy machine": every configuration measured). SmolLM2-135M and larger keep torch's count (every core), where a
# region holds enough work that the wait is a small part of it. The line between is not measured finely: any value
# between the tiny test model (3.2M, nearly all of it the embedding) and 135M gives the same choices for the models
# this project names.
ONE_THREAD_BELOW = 20_000_000

WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # how libgomp's idle threads wait: either set by the user wins


def wait_passively(env: MutableMapping[str, str] | None = None) -> bool:
    """OMP_WAIT_POLICY=PASSIVE in env (default: os.environ, the process's own, which libgomp reads), unless env
    already sets OMP_WAIT_POLICY or GOMP_SPINCOUNT (the user's wins) or torch is already loaded (libgomp has read
    the environment then, and a value set now would only misreport it). Returns whether it set the policy.

    Call it at the top of a script, before `import torch` (an `if __name__ == "__main__":` there: a module imported
    by another, or by the tests, changes no environment). libgomp reads OMP_WAIT_POLICY once, when torch loads it,
    and has no call to change it after; os.environ writes through to the C environment it reads."""
    if env is None:
        if "torch" in sys.modules:
            return False
        env = os.environ
    if any(name in env for name in WAIT_VARIABLES):
        return False
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


@dataclass(frozen=True)
class Threads:
    """A run's CPU threads: the count, why, and how idle threads wait (wait_policy's words)."""

    count: int
    why: str
    wait: str

    def __str__(self) -> str:
        return f"{self.count} ({self.why}); OpenMP wait: {self.wait}"

    def short(self) -> str:
        """'1 CPU thread, OpenMP wait passive': for a line that has no room for why."""
        return f"{self.count} CPU thread{'s' if self.count != 1 else ''}, OpenMP wait {self.wait.split(' (')[0]}"


def given_threads(env: Mapping[str, str]) -> int | None:
    """The thread count OMP_NUM_THREADS gives (its first entry: "4,2" nests), or None when it is unset or not a
    positive integer (libgomp ignores such a value too)."""
    first = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def wait_policy(env: Mapping[str, str]) -> str:
    """How libgomp's idle threads wait under env, in words: GOMP_SPINCOUNT first (libgomp reads it before the
    policy), then OMP_WAIT_POLICY, else libgomp's default (a spin of 300,000 turns, then sleep)."""
    if "GOMP_SPINCOUNT" in env:
        return f"spin {env['GOMP_SPINCOUNT']} turns, then sleep (GOMP_SPINCOUNT)"
    policy = env.get("OMP_WAIT_POLICY", "").strip().lower()
    if policy in ("passive", "active"):
        return policy
    return "spin ~3 ms, then sleep (libgomp's default)"


def choose(params: int, default: int, env: Mapping[str, str]) -> Threads:
    """The thread count for a model of `params` parameters where torch's own count is `default` (every core), under
    env: OMP_NUM_THREADS when it is given (the user's, or torchrun's one a process), else one thread below
    ONE_THREAD_BELOW parameters, else `default`. A pure function."""
    wait = wait_policy(env)
    given = given_threads(env)
    if given is not None:
        return Threads(given, "OMP_NUM_THREADS", wait)
    if params < ONE_THREAD_BELOW:
        return Threads(1, f"{params:,} parameters: a second thread hardly pays", wait)
    return Threads(default, f"every core: {params:,} parameters", wait)


def use_threads(*modules: Any) -> Threads:
    """Set torch's thread count for the model in modules (their parameters counted, None skipped), by choose on this
    process's environment; every rank calls it. Returns what the banner prints."""
    import torch

    params = sum(p.numel() for m in modules if m is not None for p in m.parameters())
    chosen = choose(params, torch.get_num_threads(), os.environ)
    torch.set_num_threads(chosen.count)
    return chosen
