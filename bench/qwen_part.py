"""Part q of bench/run_gpu.sh: the study's model (Qwen2.5 0.5B, $QWEN_GGUF) on GSM8K inside one time limit, in
priority order, each result under OUT the moment it exists:

  a. preflight.json      python -m study.preflight at the study's GRPO settings, 256 train prompts x 8. Its exit 3
                         ("refused": too few prompts with 0 < p < 1) is a measurement: recorded, and the part goes on
  b. eval-before/        greedy accuracy on the whole test set before training (ppo.py --critic none --total-steps 0,
                         as the README's table measures the packaged model)
  c. grpo/, ppo-small/   GRPO, then PPO with the small critic, at one generated-token budget (--token-budget), the
                         Monte Carlo measurement on, as many steps as fit (size_budget: sized from one first step of
                         each, probe-grpo/ and probe-ppo-small/); each with metrics.jsonl, results.json and
                         curves.png (python report.py RUN_DIR)
  d. the greedy test accuracy after each run: its results.json (the whole test set), beside (b)'s in summary.json

summary.json is rewritten before and after every step: what finished, what is running, what did not start, the
budget and the numbers it was sized from, the accuracies before and after with their 95% intervals. A kill at any
point leaves what finished: on SIGTERM (run_gpu.sh's timeout; SIGKILL follows 10 s later) the running trainer is
killed at once, without the checkpoint a trainer saves on SIGTERM, and summary.json says what was killed and what
never started; after a SIGKILL it still says which step was running. No checkpoint is kept (--save-every 0, and the
final one removed once its run ends): the GGUF's 630M parameters in fp32 with AdamW's two moments are ~7.5 GB.

It drives the scripts through their command lines only (python -m study.preflight, grpo.py, ppo.py, report.py), never
importing them, but for intervals.py (plain numbers, no torch): the paired interval has one source.

    python bench/qwen_part.py --model "$QWEN_GGUF" --out OUT/q --limit-s 400    # the GPU (run_gpu.sh's part q)
    python bench/qwen_part.py --tiny --out /tmp/q --limit-s 300                  # tiny-qwen2 on the CPU, toy sizes
    python bench/qwen_part.py --show OUT/q/summary.json                          # its table again
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import intervals  # noqa: E402  (no torch, no project import: the one source of the intervals)

TINY_MODEL = "tiny-qwen2"  # --tiny: the tiny random Qwen2 (q/k/v biases) with the packaged tokenizer
ORDER = ("preflight", "eval_before", "probe_grpo", "probe_ppo_small", "grpo", "ppo_small")
FOLDERS = {  # each step's folder (or file) under OUT
    "preflight": "preflight.json",
    "eval_before": "eval-before",
    "probe_grpo": "probe-grpo",
    "probe_ppo_small": "probe-ppo-small",
    "grpo": "grpo",
    "ppo_small": "ppo-small",
}
TRAINERS = {"grpo": ("grpo.py", {}), "ppo_small": ("ppo.py", {"--critic": "small"})}

# The study's settings (--scale study) but for what a run of a few steps needs: validation only at the end, on
# EVAL_SIZE problems; the whole test set (--test-size 0); the Monte Carlo measurement every MC_EVERY steps (the
# study measures every 10 of 200 steps: here every other step, so that a run of ~6 steps pools ~2 measurements after
# the first, which report.py leaves out); no checkpoint but the final one (removed).
STUDY = {"preflight_prompts": 256, "eval_size": 128, "mc_every": 2, "max_steps": 200, "margin_s": 20.0}
# --tiny: toy sizes, every step exercised in seconds on 2 CPU cores (tiny-qwen2 never solves GSM8K, so the preflight
# refuses it: exit 3, recorded)
TINY = {"preflight_prompts": 4, "eval_size": 4, "mc_every": 2, "max_steps": 3, "margin_s": 5.0}
TINY_PREFLIGHT = {"--device": "cpu", "--group-size": 4, "--batch-size": 2, "--max-new-tokens": 8}
TINY_TRAINER = {
    "--device": "cpu",
    "--max-new-tokens": 8,
    "--micro-batch-size": 4,
    "--num-minibatches": 2,
    "--update-epochs": 1,
    "--mc-prompts": 1,
    "--mc-samples": 2,
    "--mc-states": 1,
    "--test-size": 8,
    "--eval-batch-size": 8,
    "--eval-max-new-tokens": 8,
}
TINY_SIZES = {"grpo": {"--batch-size": 2, "--group-size": 2}, "ppo_small": {"--batch-size": 4}}  # 4 completions each


class UserError(Exception):
    """Bad input: one `error:` line, exit 2."""


# ======================================================================================================
# The sizing: one token budget for both runs, from one first step of each
# ======================================================================================================


def step_cost(first_step_s: float, mc_s: float, mc_every: int) -> float:
    """A step's seconds from the first step's: the first step holds one Monte Carlo measurement (step 0 is always
    measured) and the warm-up (CUDA-graph capture, compilation), so a later step is cheaper by
    mc_s (1 - 1 / mc_every) on average, and by the warm-up, which is left in: an overestimate, so that the runs end
    early rather than get killed."""
    return max(first_step_s - mc_s * (1 - 1 / mc_every), 1e-3)


def size_budget(left_s: float, runs: dict[str, dict[str, float]], max_steps: int) -> dict[str, Any]:
    """The generated-token budget B that both runs reach inside left_s seconds.

    runs: per run, step_s (a step's seconds, step_cost), tokens (the completion tokens its first step generated)
    and fixed_s (what the run costs besides its steps: start-up, the final evaluations, the checkpoint).
    A run stops at the first step that takes its generated tokens to B or past it, so it takes ceil(B / tokens)
    steps, at most B / tokens + 1, and costs at most fixed_s + step_s (B / tokens + 1). Both runs in left_s:
        sum_r (fixed_s + step_s) + B sum_r step_s / tokens <= left_s
        B = floor((left_s - sum_r (fixed_s + step_s)) / sum_r (step_s / tokens))
    capped at max_steps steps of the run with the fewest tokens a step, and at least 1 (one step each, the least a
    run can do; "fits" then says False). --total-steps is set well past the budget's steps (4x + 4, in case later
    completions are shorter than the first step's), so that the budget, not the step count, stops both runs; the
    learning rate is constant (the study's), so it does not depend on --total-steps."""
    fixed = sum(r["fixed_s"] + r["step_s"] for r in runs.values())
    per_token = sum(r["step_s"] / r["tokens"] for r in runs.values())
    fewest = min(r["tokens"] for r in runs.values())
    free = left_s - fixed
    budget = math.floor(free / per_token) if free > 0 else 0
    capped = budget > max_steps * fewest
    budget = max(1, min(budget, int(max_steps * fewest)))
    steps = max(math.ceil(budget / r["tokens"]) for r in runs.values())
    predicted = {
        name: r["fixed_s"] + r["step_s"] * math.ceil(budget / r["tokens"]) for name, r in runs.items()
    }  # at the first step's tokens a step
    return {
        "token_budget": budget,
        "total_steps": 4 * steps + 4,
        "expected_steps": {name: math.ceil(budget / r["tokens"]) for name, r in runs.items()},
        "predicted_s": predicted,
        "left_s": left_s,
        "fits": free > 0 and sum(predicted.values()) <= left_s,
        "capped_by_max_steps": capped,
    }


def fixed_cost(startup_s: float, eval_before: dict[str, Any] | None, limit_s: float) -> float:
    """A run's seconds besides its steps: its start-up (its probe's: launch to the first step's start), the final
    evaluations (validation and the whole test set, as long as eval-before's), and its checkpoint. eval-before's
    wall time holds a start-up, the same evaluations and a save of the weights alone; a run's save adds AdamW's two
    moments (3x the bytes): save ~ eval-before's wall - its evaluations - a start-up, times 3. Without eval-before's
    numbers (it failed): 15% of the part's limit stands in for the evaluations and the save (a guess)."""
    if not eval_before:
        return startup_s + 0.15 * limit_s
    evals = eval_before["eval_s"]
    save = max(0.0, eval_before["wall_s"] - evals - startup_s)
    return startup_s + evals + 3 * save


def paired_vs_before(after: list[float], before: list[float]) -> dict[str, Any] | None:
    """after - before over the same test problems (results.json's test.correct, in the split's order), with the
    t interval of intervals.paired_difference; no interval when every problem agrees (a zero-width one would read
    as certain)."""
    if not after or len(after) != len(before):
        return None
    d, lo, hi = intervals.paired_difference(after, before)
    return {"difference": d, "ci95": [lo, hi] if math.isfinite(lo) else None, "n": len(after)}


# ======================================================================================================
# The part: its steps, each a process, summary.json rewritten around each
# ======================================================================================================


def flags(d: dict[str, Any]) -> list[str]:
    return [str(x) for kv in d.items() for x in kv]


def rows(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows (a half-written last line skipped)."""
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def write_json(path: Path, obj: Any) -> None:
    """Atomically (a temporary file beside it, then a rename): a kill never leaves half a summary."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class Part:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = Path(a.out)
        self.t0 = time.monotonic()
        self.sizes = dict(TINY if a.tiny else STUDY)
        for key in ("margin_s", "max_steps"):
            if getattr(a, key) is not None:
                self.sizes[key] = getattr(a, key)
        self.child: subprocess.Popen | None = None
        self.current: str | None = None
        self.summary: dict[str, Any] = {
            "part": "q",
            "model": a.model,
            "tiny": a.tiny,
            "limit_s": a.limit_s,
            "settings": self.sizes,
            "order": list(ORDER),
            "steps": {name: {"status": "not started"} for name in ORDER},
            "budget": None,
            "accuracy": {},
            "unfinished": list(ORDER),
            "killed": None,
            "finished": False,
        }

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def save(self) -> None:
        steps = self.summary["steps"]
        self.summary["unfinished"] = [n for n in ORDER if steps[n]["status"] not in ("done", "skipped")]
        self.summary["elapsed_s"] = round(self.elapsed(), 1)
        write_json(self.out / "summary.json", self.summary)

    def start(self, name: str) -> None:
        """On the record as running before its process starts: a SIGKILL leaves that said."""
        self.current = name
        self.summary["steps"][name].update(status="running", started_at_s=round(self.elapsed(), 1))
        self.save()
        print(f"-- q/{name} ({self.elapsed():.0f} s in)", flush=True)

    def end(self, name: str, status: str, **fields: Any) -> None:
        step = self.summary["steps"][name]
        step.update(status=status, seconds=round(self.elapsed() - step["started_at_s"], 1), **fields)
        self.current = None
        self.save()

    def skip(self, name: str, why: str) -> None:
        self.summary["steps"][name].update(status="skipped", why=why)
        self.save()
        print(f"-- q/{name}: skipped: {why}", flush=True)

    def run(self, cmd: list[str], until_row: Path | None = None) -> dict[str, Any]:
        """Run cmd from the repository root, its output passed on; -> rc, wall_s, tail (its last lines).
        until_row: stop it (SIGKILL) as soon as this metrics.jsonl holds a step's row (a probe's first step)."""
        cmd = [self.a.python, *cmd]
        print("$ " + " ".join(cmd), flush=True)
        tail: collections.deque[str] = collections.deque(maxlen=20)
        t = time.monotonic()
        self.child = proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )

        def copy() -> None:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                tail.append(line.rstrip("\n"))

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        row, row_at = None, None
        while proc.poll() is None:
            time.sleep(0.1)
            if until_row is not None:
                row = next((r for r in rows(until_row) if "time/step" in r), None)
                if row is not None:
                    row_at = time.monotonic() - t
                    proc.kill()  # its first step is all a probe is for: no evaluation, no checkpoint
                    break
        rc = proc.wait()
        reader.join(timeout=5)
        self.child = None
        if until_row is not None and row is None:  # it ended as the row was written
            row = next((r for r in rows(until_row) if "time/step" in r), None)
            row_at = time.monotonic() - t
        return {"rc": rc, "wall_s": time.monotonic() - t, "tail": list(tail), "row": row, "row_at_s": row_at}

    def drop_checkpoints(self, run_dir: Path) -> None:
        """The trainer's checkpoint (and a save's temporary or set-aside folder): ~7.5 GB here, never kept. Called
        once its process has ended; the lock a killed trainer left goes too."""
        if not run_dir.is_dir():
            return
        for path in [run_dir / "checkpoint", *run_dir.glob(".checkpoint*")]:
            shutil.rmtree(path, ignore_errors=True)
        (run_dir / ".lock").unlink(missing_ok=True)

    # --- the steps --------------------------------------------------------------------------------------

    def preflight(self) -> None:
        self.start("preflight")
        grpo = {"--model": self.a.model, "--scale": "study", **(TINY_PREFLIGHT if self.a.tiny else {})}
        cmd = ["-m", "study.preflight", "--out", str(self.out), "--prompts", str(self.sizes["preflight_prompts"])]
        res = self.run([*cmd, "--", "grpo.py", *flags(grpo)])
        path = self.out / "preflight.json"
        if res["rc"] in (0, 3) and path.is_file():  # 3: refused for want of signal, a verdict like 0
            pf = json.loads(path.read_text())
            verdict = "enough signal" if pf["passed"] else "refused"
            keep = ("pass_rate", "signal", "informative", "informative_prompts", "prompts", "samples_per_prompt")
            self.end("preflight", "done", rc=res["rc"], verdict=verdict, line=pf["verdict"], **{k: pf[k] for k in keep})
        else:
            self.end("preflight", "failed", rc=res["rc"], error="\n".join(res["tail"][-8:]))

    def trainer_flags(self, script: str, run_dir: Path, extra: dict[str, Any], name: str = "") -> list[str]:
        """script and its flags: those every run here shares (the study's, --scale study), then the run name's own
        (TRAINERS; TINY_SIZES with --tiny), then extra."""
        d: dict[str, Any] = {
            "--model": self.a.model,
            "--scale": "study",
            "--run-dir": run_dir,
            "--eval-every": 0,
            "--eval-size": self.sizes["eval_size"],
            "--test-size": 0,
            "--save-every": 0,
            "--mc-every": self.sizes["mc_every"],
        }
        if self.a.tiny:
            d |= TINY_TRAINER | TINY_SIZES.get(name, {})
        d |= TRAINERS[name][1] if name in TRAINERS else {}
        d |= extra
        return [script, *flags(d), "--no-progress"]

    def eval_before(self) -> dict[str, Any] | None:
        self.start("eval_before")
        run_dir = self.out / FOLDERS["eval_before"]
        # ppo.py without a critic or a reference, no step: its final evaluations are the untrained model's
        extra = {"--critic": "none", "--total-steps": 0, "--kl-coef": 0, "--mc-every": 0}
        res = self.run(self.trainer_flags("ppo.py", run_dir, extra))
        self.drop_checkpoints(run_dir)
        results = run_dir / "results.json"
        if res["rc"] != 0 or not results.is_file():
            self.end("eval_before", "failed", rc=res["rc"], error="\n".join(res["tail"][-8:]))
            return None
        r = json.loads(results.read_text())
        self.summary["accuracy"]["before"] = self.accuracy(r, "eval-before")
        timing = {"wall_s": res["wall_s"], "eval_s": r["test"]["seconds"] + r["val"]["seconds"]}
        self.end("eval_before", "done", rc=0, **{k: round(v, 2) for k, v in timing.items()})
        return timing

    def probe(self, name: str) -> dict[str, float] | None:
        """One first step of the run `name` at its own settings (the Monte Carlo measurement on: step 0 is
        measured), stopped as soon as its metrics row is written."""
        probe = f"probe_{name}"
        self.start(probe)
        run_dir = self.out / FOLDERS[probe]
        cmd = self.trainer_flags(TRAINERS[name][0], run_dir, {"--total-steps": 1}, name)
        res = self.run(cmd, until_row=run_dir / "metrics.jsonl")
        self.drop_checkpoints(run_dir)
        row = res["row"]
        if row is None:
            self.end(probe, "failed", rc=res["rc"], error="\n".join(res["tail"][-8:]))
            return None
        first, mc = float(row["time/step"]), float(row.get("mc/seconds") or 0.0)
        got = {
            "first_step_s": first,
            "mc_s": mc,
            "tokens": float(row["generated_tokens"]),
            "startup_s": max(0.0, res["row_at_s"] - first),  # launch to the first step's start (and the poll)
            "step_s": step_cost(first, mc, self.sizes["mc_every"]),
        }
        self.end(probe, "done", **{k: round(v, 3) for k, v in got.items()})
        return got

    def train(self, name: str, budget: dict[str, Any]) -> None:
        self.start(name)
        run_dir = self.out / FOLDERS[name]
        extra = {"--total-steps": budget["total_steps"], "--token-budget": budget["token_budget"]}
        res = self.run(self.trainer_flags(TRAINERS[name][0], run_dir, extra, name))
        self.drop_checkpoints(run_dir)
        results = run_dir / "results.json"
        if res["rc"] != 0 or not results.is_file():
            self.end(name, "failed", rc=res["rc"], error="\n".join(res["tail"][-8:]))
            return
        r = json.loads(results.read_text())
        steps = [x for x in rows(run_dir / "metrics.jsonl") if "time/step" in x]
        made, B = [x["generated_tokens"] for x in steps], budget["token_budget"]
        stopped = "token budget" if made and made[-1] >= B and (len(made) < 2 or made[-2] < B) else "step count"
        fields = {"rc": 0, "steps": r["steps"], "generated_tokens": r["generated_tokens"], "stopped_by": stopped}
        fields["mc_tokens"] = r["mc_tokens"]
        fields["median_step_s"] = statistics.median(x["time/step"] for x in steps) if steps else None
        self.summary["accuracy"][f"after_{name}"] = self.accuracy(r, FOLDERS[name])
        self.summary["steps"][name].update(fields)  # on the record before the curves are drawn
        self.save()
        curves = self.run(["report.py", str(run_dir)])
        drawn = (run_dir / "curves.png").is_file()
        note = "curves.png" if drawn else f"not drawn (exit {curves['rc']}): " + " ".join(curves["tail"][-2:])
        self.end(name, "done", curves=note)

    def accuracy(self, r: dict[str, Any], run: str) -> dict[str, Any]:
        t = r["test"]
        out = {"accuracy": t["accuracy"], "ci95": t["ci95"], "n": t["n"], "run": run, "steps": r["steps"]}
        out["val_accuracy"], out["val_ci95"], out["val_n"] = r["val"]["accuracy"], r["val"]["ci95"], r["val"]["n"]
        before = self.summary["accuracy"].get("before")
        if before is not None and run != "eval-before":
            base = json.loads((self.out / FOLDERS["eval_before"] / "results.json").read_text())["test"]["correct"]
            out["paired_vs_before"] = paired_vs_before(t["correct"], base)
        return out

    # --- the whole part -----------------------------------------------------------------------------------

    def on_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM (the part's limit) or SIGINT: kill the running step's process now (a trainer would finish its
        step and save ~7.5 GB first), drop its checkpoint, and say on the record what did not finish. The handler
        interrupts the main thread anywhere, inside Popen.poll's lock or a print among them: so no Popen.wait and no
        sys.stdout here (both would wait on a lock the interrupted frame holds), and it never returns."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal while this one is handled
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        child = self.child
        if child is not None:
            try:
                os.kill(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # reaped here (the main thread never resumes), at most 5 s
                try:
                    if os.waitpid(child.pid, os.WNOHANG)[0]:
                        break
                except ChildProcessError:  # reaped already
                    break
                time.sleep(0.05)
        name = signal.Signals(signum).name
        self.summary["killed"] = f"{name} after {self.elapsed():.1f} s (the part's time limit: {self.a.limit_s:g} s)"
        if self.current is not None:
            self.drop_checkpoints(self.out / FOLDERS[self.current])
            self.summary["steps"][self.current]["status"] = "killed"
        for tmp in self.out.glob(".summary.json.tmp-*"):  # a write the signal interrupted
            tmp.unlink(missing_ok=True)
        self.save()
        line = f"part q: {self.summary['killed']}; unfinished: {', '.join(self.summary['unfinished'])}\n"
        os.write(sys.stdout.fileno(), line.encode())
        os._exit(143)

    def main(self) -> int:
        for name in [*FOLDERS.values(), "summary.json"]:  # an earlier run's files (only part q's own)
            path = self.out / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        self.save()
        print(f"part q: {self.a.model}, limit {self.a.limit_s:g} s, results under {self.out}", flush=True)

        self.preflight()  # a. (its verdict is a measurement: the part goes on either way)
        before = self.eval_before()  # b.
        probes = {name: self.probe(name) for name in TRAINERS}  # c. one first step of each, for the sizing
        runs = {
            name: {**p, "fixed_s": fixed_cost(p["startup_s"], before, self.a.limit_s)}
            for name, p in probes.items()
            if p is not None
        }
        if runs:
            left = self.a.limit_s - self.elapsed() - self.sizes["margin_s"]
            budget = size_budget(left, runs, self.sizes["max_steps"])
            budget["sized_from"] = {n: {k: round(v, 3) for k, v in r.items()} for n, r in runs.items()}
            self.summary["budget"] = budget
            self.save()
            print(f"-- q/budget: {json.dumps(budget)}", flush=True)
        for name in TRAINERS:  # c. and d.: each run, its test accuracy after, its curves
            if probes[name] is None:
                self.skip(name, f"its first step failed (probe_{name})")
            else:
                self.train(name, self.summary["budget"])
        self.summary["finished"] = True
        self.save()
        print_table(self.summary)
        return 0 if not self.summary["unfinished"] else 1


# ======================================================================================================
# The table
# ======================================================================================================


def pct(acc: dict[str, Any] | None) -> str:
    if not acc or acc.get("accuracy") is None:
        return "-"
    lo, hi = acc["ci95"]
    return f"{100 * acc['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] on {acc['n']:,}"


def print_table(s: dict[str, Any]) -> None:
    print(f"\n== part q: {s['model']} (limit {s['limit_s']:g} s, {s.get('elapsed_s', 0):.0f} s used) ==")
    if s.get("skipped"):
        print(f"skipped: {s['skipped']}")
        return
    acc = s.get("accuracy", {})
    for name in s["order"]:
        st = s["steps"][name]
        what = ""
        if name == "preflight" and st["status"] == "done":
            what = st["line"].split("-> ")[-1]
        elif name == "eval_before":
            what = "test " + pct(acc.get("before"))
        elif name.startswith("probe_") and st["status"] == "done":
            what = f"first step {st['first_step_s']:.1f} s (MC {st['mc_s']:.1f} s), {st['tokens']:,.0f} tokens"
        elif name in TRAINERS and "steps" in st:
            what = f"{st['steps']} steps, {st['generated_tokens']:,} tokens; test {pct(acc.get(f'after_{name}'))}"
        if st.get("why") or st.get("error"):
            what = (st.get("why") or st["error"].splitlines()[-1])[:100]
        print(f"{name:<16} {st['status']:<12} {st.get('seconds', ''):>7}  {what}")
    if s.get("budget"):
        b = s["budget"]
        print(f"budget: {b['token_budget']:,} generated tokens each ({'fits' if b['fits'] else 'DOES NOT FIT'} by the "
              f"first steps: predicted {', '.join(f'{k} {v:.0f} s' for k, v in b['predicted_s'].items())})")  # fmt: skip
    if s.get("killed"):
        print(f"KILLED: {s['killed']}; unfinished: {', '.join(s['unfinished'])}")


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one `error:` line, not argparse's usage block
        raise UserError(message)


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="the .gguf (or any --model of the trainers); empty: skip the part")
    p.add_argument("--tiny", action="store_true", help=f"toy sizes on the CPU; --model defaults to {TINY_MODEL}")
    p.add_argument("--out", default="bench/out/q", help="the part's folder (default: bench/out/q)")
    p.add_argument("--limit-s", type=float, default=400.0, help="the part's time limit, as run_gpu.sh's timeout")
    p.add_argument("--margin-s", type=float, default=None, help="seconds kept free at the end (default 20; tiny 5)")
    p.add_argument("--max-steps", type=int, default=None, help="most steps the budget allows (default 200; tiny 3)")
    p.add_argument("--python", default=sys.executable, help="the interpreter of the steps (run_gpu.sh's PYTHON)")
    p.add_argument("--show", metavar="SUMMARY", help="only print the table of a summary.json")

    try:
        a = p.parse_args(argv)
        if a.show:
            path = Path(a.show)
            if not path.is_file():
                raise UserError(f"{path}: no such file")
            print_table(json.loads(path.read_text()))
            return 0
        if a.limit_s <= 0:
            raise UserError(f"--limit-s {a.limit_s:g} must be positive")
        if a.margin_s is not None and a.margin_s < 0:
            raise UserError(f"--margin-s {a.margin_s:g} must not be negative")
        if a.max_steps is not None and a.max_steps < 1:
            raise UserError(f"--max-steps {a.max_steps} must be at least 1")
        if a.tiny and not a.model:
            a.model = TINY_MODEL
        if not a.model:  # run_gpu.sh passes $QWEN_GGUF: unset, the part is skipped, on the record
            why = (
                "QWEN_GGUF is unset: stage Qwen2.5 0.5B first (QWEN=1 ../shared/device/prepare here; on the GPU "
                "machine bash /tmp/stage/stage.sh q once per part, then source /tmp/stage/stage.sh b)"
            )
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            write_json(out / "summary.json", {"part": "q", "skipped": why, "model": None, "finished": False})
            print(f"part q: skipped: {why}", flush=True)
            return 0
        if a.model.endswith(".gguf") and not Path(a.model).is_file():
            raise UserError(f"--model {a.model}: no such file")
        if not Path(a.python).exists() and shutil.which(a.python) is None:
            raise UserError(f"--python {a.python}: no such interpreter")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return Part(a).main()


if __name__ == "__main__":
    sys.exit(main())
