"""Offline, fast and in one line: with the Hugging Face hub unreachable, a trainer without GSM8K,
a trainer, the preflight and the sweep given a hub model that is not cached each stop in one `error:` line naming
the way out, within seconds, without the libraries' retries on the terminal and without writing anything; a hub
model or GSM8K already in the caches still loads, as quickly and as quietly.

The hub is made unreachable for the process, not mocked: HF_ENDPOINT points at a closed port on this machine (no
proxy), HF_HOME at a folder of this test (an empty cache, or one this test fills), HF_HUB_OFFLINE unset. Before the
change the libraries retried for 25 s to 2 minutes (five retries per file, two lines of warning each) first.
Real processes: their stderr, exit codes and wall time are the point.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import check_one_error_line

from plumbing import models

REPO = Path(__file__).resolve().parents[1]
HUB_ID = "acme/tiny-cached"  # the tiny model, put in the test's hub cache under a hub id (cached_hub)
# Wall-time bounds on an idle machine: one interpreter importing torch, transformers and datasets spends 2-6 s of CPU
# here; the preflight starts a second (the trainer's --print-args) and the sweep runs the preflight. Before the change
# the libraries' five retries slept 23 s for each file not cached, on top. check_refusal stretches the bound with the
# machine's load (five engineers' tests on 2 cores took a refusal from 6 s to 27 s), never below these.
SECONDS = 20
CHAIN_SECONDS = 30


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released): a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unreachable_hub(hf_home: Path, gsm8k: bool = True) -> dict[str, str]:
    """The environment of a process for which the hub cannot be reached, its caches in hf_home."""
    dropped = {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
               "HF_DATASETS_CACHE", "HF_HUB_ETAG_TIMEOUT", "RANK"}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in dropped and not k.lower().endswith("_proxy")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}", HF_HOME=str(hf_home), TOKENIZERS_PARALLELISM="false")
    env["PYTHON"] = sys.executable  # sweep.sh's interpreter
    if not gsm8k:
        env.pop("GSM8K_DIR", None)
    return env


def run(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - t0


def check_refusal(proc: subprocess.CompletedProcess, seconds: float, limit: float, *way_out: str) -> str:
    """One `error:` line on stderr (nothing else there, no traceback), exit 2, saying the hub cannot be reached and
    naming the way out, within `limit` seconds (more on a loaded machine); no retry on stdout either."""
    line = check_one_error_line(proc)
    assert proc.returncode == 2, (proc.returncode, line)
    assert "Retry" not in proc.stdout and "thrown while requesting" not in proc.stdout, proc.stdout
    assert "the hub cannot be reached (ConnectError" in line and all(w in line for w in way_out), line
    assert len(line) <= 200, f"{len(line)} characters: {line}"
    load = os.getloadavg()[0] / (os.cpu_count() or 1)  # runnable processes a core, over the last minute
    limit *= max(1.0, load / 2)
    assert seconds < limit, f"{seconds:.1f} s, over {limit:.0f} s (the machine's load: {load:.1f} a core): {line}"
    return line


# ------------------------------------------------------------------------------------------------------
# Not cached: one line, at once, nothing written
# ------------------------------------------------------------------------------------------------------


def test_a_trainer_without_gsm8k_says_where_to_get_it_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "ppo.py", "--model", "tiny", "--total-steps", "1", "--run-dir", str(run_dir)]
    proc, seconds = run([*cmd, "--no-progress"], unreachable_hub(tmp_path / "hf", gsm8k=False))
    line = check_refusal(proc, seconds, SECONDS, "openai/gsm8k", "--data-dir DIR", "GSM8K_DIR=DIR", "train.jsonl")
    assert line.startswith("error: GSM8K: "), line
    assert not run_dir.exists()


def test_a_trainer_given_a_hub_model_not_cached_says_so_in_one_line(tmp_path, gsm8k_dir):
    run_dir = tmp_path / "run"
    proc, seconds = run([sys.executable, "dpo.py", "--model", "qwen2.5-0.5b", "--run-dir", str(run_dir)],
                        unreachable_hub(tmp_path / "hf"))  # fmt: skip
    check_refusal(proc, seconds, SECONDS, "Qwen/Qwen2.5-0.5B-Instruct", "--model smollm2", "local folder", ".gguf")
    assert not run_dir.exists()


def test_the_preflight_given_a_hub_model_not_cached_says_so_in_one_line(tmp_path, gsm8k_dir):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "study.preflight", "--out", str(out), "--", "grpo.py", "--model", "qwen2.5-0.5b"]
    proc, seconds = run(cmd, unreachable_hub(tmp_path / "hf"))
    check_refusal(proc, seconds, CHAIN_SECONDS, "Qwen/Qwen2.5-0.5B-Instruct", "--model smollm2", "local folder")
    assert not out.exists()


@pytest.mark.parametrize("preflight", [["--preflight"], []], ids=["preflight", "sweep"])
def test_the_sweep_given_a_hub_model_not_cached_says_so_in_one_line_and_leaves_no_folder(
    tmp_path, gsm8k_dir, preflight
):
    """./sweep.sh --preflight, and the sweep itself (its preflight first)."""
    out = tmp_path / "out"
    cmd = ["bash", "sweep.sh", *preflight, "--out", str(out), "--", "--model", "qwen2.5-0.5b"]
    proc, seconds = run(cmd, unreachable_hub(tmp_path / "hf"))
    check_refusal(proc, seconds, CHAIN_SECONDS, "Qwen/Qwen2.5-0.5B-Instruct", "--model smollm2", "local folder")
    assert not out.exists()  # the sweep's lock (OUT/.lock) goes with the folder it created


# ------------------------------------------------------------------------------------------------------
# Cached: loads offline, quietly, within seconds
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cached_hub(tmp_path_factory, gsm8k_dir, tiny_tokenizer) -> Path:
    """An HF_HOME whose caches hold, as the libraries leave them after a download, the tiny model under the hub id
    HUB_ID (huggingface_hub's layout: models--ORG--NAME/refs/main naming a snapshot) and the first 40 train and
    10 test problems of GSM8K as openai/gsm8k's "main" configuration (datasets' Arrow cache: openai___gsm8k/main/
    VERSION/HASH, built here by datasets' own json loader and renamed)."""
    import datasets

    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    models.load_model(models.TINY_MODEL, tiny_tokenizer).save_pretrained(snapshot)
    tiny_tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    small = home / "small"
    small.mkdir()
    for split, n in (("train", 40), ("test", 10)):
        lines = (gsm8k_dir / f"{split}.jsonl").read_text().splitlines()[:n]
        (small / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    build = home / "build"
    files = {split: str(small / f"{split}.jsonl") for split in ("train", "test")}
    datasets.load_dataset("json", data_files=files, cache_dir=str(build))
    (built,) = [p for p in build.glob("json/*/*/*") if p.is_dir()]
    dest = home / "datasets" / "openai___gsm8k" / "main" / built.parent.name / built.name
    dest.mkdir(parents=True)
    for f in built.iterdir():
        if f.name == "dataset_info.json":
            info = json.loads(f.read_text()) | {"config_name": "main", "dataset_name": "gsm8k"}
            (dest / f.name).write_text(json.dumps(info))
        elif f.suffix == ".arrow":
            shutil.copy(f, dest / f.name.replace("json-", "gsm8k-"))
    shutil.rmtree(build)
    shutil.rmtree(small)
    return home


def test_a_cached_hub_model_loads_offline_quietly(cached_hub):
    script = (
        "import torch\nfrom plumbing import models\n"
        f"models.check_generation_memory({HUB_ID!r}, torch.device('cpu'), {{'x': (2, 8)}})\n"
        f"tok = models.load_tokenizer({HUB_ID!r})\nmodel = models.load_model({HUB_ID!r}, tok)\n"
        "print(type(model).__name__, sum(p.numel() for p in model.parameters()))\n"
    )
    proc, seconds = run([sys.executable, "-c", script], unreachable_hub(cached_hub))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    tiny = models.load_model(models.TINY_MODEL, models.load_tokenizer(models.TINY_MODEL))
    assert proc.stdout.split() == ["LlamaForCausalLM", str(sum(p.numel() for p in tiny.parameters()))]
    assert seconds < SECONDS, seconds


def test_a_cached_gsm8k_loads_offline_quietly(cached_hub):
    script = (
        "import gsm8k\ns = gsm8k.load_gsm8k(None, val_size=5)\nprint(*(len(s[k]) for k in ('train', 'val', 'test')))"
    )
    proc, seconds = run([sys.executable, "-c", script], unreachable_hub(cached_hub, gsm8k=False))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert proc.stdout.split() == ["35", "5", "10"]
    assert seconds < SECONDS, seconds


# ------------------------------------------------------------------------------------------------------
# The probe: one request, bounded in time; any answer but a server error is a hub that can be reached
# ------------------------------------------------------------------------------------------------------


@pytest.fixture
def hub_online_mode(monkeypatch):
    """huggingface_hub's session refuses every request in its offline mode (HF_HUB_OFFLINE in pytest's own
    environment); the probe's tests send theirs to this machine."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


class _Answer(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_HEAD(self):
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.usefixtures("hub_online_mode")
@pytest.mark.parametrize("status, reachable", [(200, True), (404, True), (503, False)])
def test_the_probe_takes_an_answer_below_500_for_a_hub_that_answers(status, reachable):
    handler = type("Handler", (_Answer,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        why = models.probe_hub(f"http://127.0.0.1:{server.server_port}", timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    assert (why is None) == reachable and (reachable or why == "HTTP 503"), why


@pytest.mark.usefixtures("hub_online_mode")
def test_the_probe_gives_up_on_a_hub_that_never_answers_within_its_timeout():
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        t0 = time.monotonic()
        why = models.probe_hub(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=0.5)
        seconds = time.monotonic() - t0
    assert why is not None and seconds < 3, (why, seconds)


@pytest.mark.usefixtures("hub_online_mode")
def test_the_probe_on_a_closed_port_names_the_connection_error():
    t0 = time.monotonic()
    assert models.probe_hub(f"http://127.0.0.1:{closed_port()}", timeout=5) == "ConnectError"
    assert time.monotonic() - t0 < 3
