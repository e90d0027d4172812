"""Qwen2 (the study's model family) everywhere the code reads a model, on the CPU with a tiny random Qwen2.

models.py's `tiny-qwen2`: q/k/v biases drawn non-zero (transformers starts them at zero, which would hide a broken
bias path), rope_theta 1e6, 6 query heads on 2 kv heads, tied or untied embeddings. The static engine against
transformers' generate() (greedy), the plain path (sampled) and the training forward (log-probs, hidden states);
what the engine still refuses, with its reason; the two-level CDF on Qwen's vocabulary (151,936, not a multiple
of 256) and on a prime one; Llama shaped like SmolLM2-360M and 1.7B; critics, checkpoints and the memory check;
the short names and the one line for a model that cannot be fetched.

    pytest tests/test_qwen2.py -q
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import REPO, check_ok, check_one_error_line, cli, command, run_here, trainer_env

from critics import HEAD_WIDTHS, build_critic
from plumbing import (
    checkpoint,
    distributed,
    errors,
    forward,
    generation,
    models,
    rollout,
    static_engine,
    static_kernels,
)
from study import estimate

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer(models.TINY_MODEL)


def tiny_qwen2(tok, tied: bool, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(models.tiny_config(tok, "qwen2", tied))
        models.randomise_biases(model)
    return model.eval()


def make_prompts(lengths=(3, 41, 17, 120, 1, 64)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 5000, (n,), generator=g).tolist() for n in lengths]


def responses(ro: rollout.Rollout) -> list[list[int]]:
    return [row[:n] for row, n in zip(ro.response_ids.tolist(), ro.lengths.tolist())]


def hf_greedy(lm, prompts, T: int, eos: int, pad: int) -> list[list[int]]:
    ids, mask = rollout.left_pad(prompts, pad)
    out = lm.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=T, do_sample=False, eos_token_id=eos, pad_token_id=pad
    )[:, ids.shape[1] :]
    return [row[: row.index(eos) + 1] if eos in row else row for row in out.tolist()]


def frequent_token(lm, prompts, T: int, pad: int) -> int:
    ro = generation.generate(lm, prompts, max_new_tokens=T, eos_id=-1, pad_id=pad, backend="hf")
    return int(ro.response_ids[0, T // 3])


# ------------------------------------------------------------------------------------------------------
# the static engine on Qwen2
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_the_engine_runs_qwen2_with_its_biases_greedy_as_transformers(tok, tied):
    lm = tiny_qwen2(tok, tied)
    assert lm.model.layers[0].self_attn.q_proj.bias.abs().min() > 0, "the biases must be non-zero"
    assert (lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()) == tied
    assert static_kernels.static_engine_unsupported(lm) is None
    prompts, T, pad = make_prompts(), 40, tok.pad_token_id
    eos = frequent_token(lm, prompts, T, pad)
    ours = generation.generate(lm, prompts, max_new_tokens=T, eos_id=eos, pad_id=pad, backend="static")
    assert static_engine.StaticEngine.of(lm).qkv_b is not None
    assert responses(ours) == hf_greedy(lm, prompts, T, eos, pad)
    assert len(set(ours.lengths.tolist())) > 1, "EOS should end rows at different steps"
    plain = generation.generate(lm, prompts, max_new_tokens=T, eos_id=eos, pad_id=pad, backend="hf")
    torch.testing.assert_close(ours.logprobs, plain.logprobs, atol=1e-4, rtol=0)
    # the biases matter: without them the engine (fresh, same weights) decodes other tokens
    with torch.no_grad():
        for layer in lm.model.layers:
            for p in (layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias, layer.self_attn.v_proj.bias):
                p.zero_()
    unbiased = generation.generate(lm, prompts, max_new_tokens=T, eos_id=eos, pad_id=pad, backend="static")
    assert responses(unbiased) != responses(ours)
    assert responses(unbiased) == hf_greedy(lm, prompts, T, eos, pad)


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_sampled_tokens_equal_the_plain_path_and_logprobs_the_training_forward(tok, tied):
    lm = tiny_qwen2(tok, tied, seed=1)
    prompts, T, pad = make_prompts((3, 41, 17, 64, 1)), 32, tok.pad_token_id
    eos = frequent_token(lm, prompts, T, pad)
    u = rollout.step_uniforms(3, 7, 0, len(prompts), T, CPU)
    kw = dict(max_new_tokens=T, eos_id=eos, pad_id=pad, uniforms=u, temperature=0.8, return_hidden=True)
    ours = generation.generate(lm, prompts, top_p=0.95, backend="static", **kw)
    plain = generation.generate(lm, prompts, top_p=0.95, backend="hf", **kw)
    assert torch.equal(ours.response_ids, plain.response_ids)
    assert torch.equal(ours.response_mask, plain.response_mask)

    ours = generation.generate(lm, prompts, backend="static", **kw)  # the full distribution
    P, m = ours.prompt_ids.shape[1], ours.response_mask
    with torch.no_grad():
        logp, _, _ = forward.PolicyForward(lm)(ours.input_ids, ours.attention_mask, P, temperature=0.8)
        pos = rollout.position_ids_from_mask(ours.attention_mask)
        hidden = lm.model(input_ids=ours.input_ids, attention_mask=ours.attention_mask, position_ids=pos)
        states = hidden.last_hidden_state[:, P - 1 : -1]
    assert m.sum() > 60
    torch.testing.assert_close(ours.logprobs * m, logp * m, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ours.hidden * m[..., None], states * m[..., None], atol=5e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tied", [True, False])
def test_cuda_qwen2_graph_logprobs_match_training_forward_in_bf16(tok, tied):
    """On a GPU (bf16, CUDA graphs, the fused bias in bf16): the engine's log-probs differ from the training
    forward's under autocast by rounding, no more than the plain path's; graph and eager step agree."""
    dev = torch.device("cuda")
    lm = tiny_qwen2(tok, tied).to(dev)
    prompts, T, pad = make_prompts(), 64, tok.pad_token_id
    u = rollout.step_uniforms(0, 0, 0, len(prompts), T, dev)

    def error(backend: str) -> float:
        ro = generation.generate(lm, prompts, max_new_tokens=T, eos_id=-1, pad_id=pad, uniforms=u, backend=backend)
        P, m = ro.prompt_ids.shape[1], ro.response_mask
        with torch.no_grad(), distributed.autocast_ctx(dev):
            logp, _, _ = forward.PolicyForward(lm)(ro.input_ids, ro.attention_mask, P)
        return (((ro.logprobs - logp).abs() * m).sum() / m.sum()).item()

    ours, plain = error("static"), error("hf")
    assert ours <= max(0.02, 1.5 * plain), f"mean |log-prob error|: engine {ours:.4f}, plain path {plain:.4f}"
    kw = dict(max_new_tokens=T, eos_id=-1, pad_id=pad, uniforms=u, temperature=0.9)
    graph = static_engine.StaticEngine(lm, cuda_graph=True, compile=False).generate(prompts, **kw)
    eager = static_engine.StaticEngine(lm, cuda_graph=False, compile=False).generate(prompts, **kw)
    assert torch.equal(graph.response_ids, eager.response_ids)


def test_the_engine_sees_new_qwen2_biases(tok):
    lm = tiny_qwen2(tok, tied=True, seed=2)
    prompts, kw = make_prompts((5, 30, 12)), dict(max_new_tokens=24, eos_id=-1, pad_id=tok.pad_token_id)
    before = generation.generate(lm, prompts, backend="static", **kw)
    with torch.no_grad():
        lm.model.layers[1].self_attn.v_proj.bias.mul_(-3.0)  # an optimiser step on a bias, in place
    after = generation.generate(lm, prompts, backend="static", **kw)
    assert not torch.equal(before.response_ids, after.response_ids)
    assert torch.equal(after.response_ids, generation.generate(lm, prompts, backend="hf", **kw).response_ids)


def _variant(tok, family: str, **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = models.tiny_config(tok, family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    if "use_sliding_window" in overrides:  # layer_types follow the sliding-window settings
        cfg.layer_types = [
            "sliding_attention" if overrides["use_sliding_window"] and i >= cfg.max_window_layers else "full_attention"
            for i in range(cfg.num_hidden_layers)
        ]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_what_the_engine_does_not_run_is_refused_with_its_reason(tok):
    cases = {
        "output-projection bias": _variant(tok, "llama", attention_bias=True),
        "MLP bias": _variant(tok, "llama", mlp_bias=True),
        "sliding-window": _variant(tok, "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1),
        "hidden_act": _variant(tok, "qwen2", hidden_act="gelu"),
    }
    for why, model in cases.items():
        reason = static_kernels.static_engine_unsupported(model)
        assert reason is not None and why in reason, (why, reason)
        with pytest.raises(ValueError, match="cannot run"):
            static_engine.StaticEngine(model)
    # the sliding window as Qwen2.5 ships it (use_sliding_window false): no layer slides, the engine runs it
    assert (
        static_kernels.static_engine_unsupported(_variant(tok, "qwen2", sliding_window=32768, max_window_layers=21))
        is None
    )


@pytest.mark.parametrize(
    "shape",
    [
        dict(hidden_size=120, num_attention_heads=15, num_key_value_heads=5, head_dim=8),  # SmolLM2-360M: 15 on 5
        dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=8, head_dim=8),  # SmolLM2-1.7B: 32 on 32
    ],
    ids=["smollm2-360m", "smollm2-1.7b"],
)
def test_llama_shaped_like_smollm2_360m_and_1_7b_still_runs(tok, shape):
    lm = _variant(tok, "llama", rope_theta=100000.0, **shape)
    assert static_kernels.static_engine_unsupported(lm) is None
    prompts, T, pad = make_prompts((3, 41, 17)), 24, tok.pad_token_id
    eos = frequent_token(lm, prompts, T, pad)
    ours = generation.generate(lm, prompts, max_new_tokens=T, eos_id=eos, pad_id=pad, backend="static")
    assert responses(ours) == hf_greedy(lm, prompts, T, eos, pad)


# ------------------------------------------------------------------------------------------------------
# the sampler's two-level CDF on Qwen's vocabulary and on a prime one
# ------------------------------------------------------------------------------------------------------


def test_cdf_blocks_divide_qwens_vocabulary():
    assert static_kernels.cdf_block(151936) == 128 and 151936 % static_kernels.cdf_block(151936) == 0
    assert static_kernels.cdf_block(49152) == 256
    assert static_kernels.cdf_block(1000) == 250 and static_kernels.cdf_block(100) == 100
    assert static_kernels.cdf_block(1009) == static_kernels.CDF_BLOCK  # prime: a padded, ragged last block


@pytest.mark.parametrize("V", [151936, 1009])
def test_fp32_sampler_on_a_vocabulary_256_does_not_divide(V):
    """The engine's sampler against sample_tokens (fp64 CDF, full sort) at Qwen's vocabulary and a prime one:
    the same token but for boundary cases, the same log-prob; the last tokens of the row can be drawn."""
    rows = 32
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(rows, V, generator=g) * 3
    logits[:4, -3:] += 40.0  # four rows whose mass sits in the ragged (or last) block
    u = rollout.step_uniforms(0, 0, 0, rows, 1, CPU)[:, 0]
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.9)):
        ref, ref_lp = rollout.sample_tokens(logits, u, temperature, top_p)
        got, lp, _ = static_kernels.sample_tokens_fp32(logits, u.float(), temperature, top_p)
        assert (got == ref).float().mean() >= 30 / 32, (V, temperature, top_p)
        torch.testing.assert_close(lp[got == ref], ref_lp[got == ref], atol=1e-5, rtol=0)
        assert (got[:4] >= V - 3).all() and (got < V).all()
    p = torch.zeros(2, V)
    p[0, V - 1], p[1, :] = 1.0, 1.0  # all mass on the very last token; a flat row
    for x in (0.0, 0.5, 1.0 - 1e-7):
        idx = static_kernels.inverse_cdf(p, torch.full((2,), x))
        assert idx[0] == V - 1 and 0 <= idx[1] < V
    flat = static_kernels.inverse_cdf(p[1:].expand(64, V), torch.linspace(0, 1 - 1e-6, 64))
    assert torch.equal(flat, torch.sort(flat).values) and flat[-1] >= V - V // 32  # monotone in u, reaches the end


# ------------------------------------------------------------------------------------------------------
# the rest of what reads the model: critics, checkpoints, the memory check, a trainer
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H", [896, 1536])
def test_critic_heads_at_qwen25_hidden_sizes(H):
    for name, width in HEAD_WIDTHS.items():
        head = build_critic(name, H)
        assert sum(p.numel() for p in head.parameters()) == H * width + width + width + 1
        assert head(torch.randn(2, 3, H)).shape == (2, 3) and (head(torch.randn(1, 1, H)) == 0).all()


def test_full_critic_copies_the_qwen2_trunk_with_its_biases(tok):
    lm = tiny_qwen2(tok, tied=True)
    critic = build_critic("full", lm.config.hidden_size, lm)
    assert torch.equal(critic.trunk.layers[0].self_attn.q_proj.bias, lm.model.layers[0].self_attn.q_proj.bias)
    assert (
        critic.trunk.layers[0].self_attn.q_proj.bias.data_ptr() != lm.model.layers[0].self_attn.q_proj.bias.data_ptr()
    )
    torch.nn.init.normal_(critic.head.weight)
    ids = torch.randint(3, 5000, (2, 9))
    mask = torch.ones_like(ids)
    _, _, values = forward.PolicyForward(lm, critic)(ids, mask, 4)
    assert values.shape == (2, 5) and values.abs().sum() > 0


# what a trainer's checkpoint holds, every field load_checkpoint checks (checkpoint._check_state)
FULL_STATE = {
    "counters": {"step": 1, "generated_tokens": 0, "mc_tokens": 0, "eval_tokens": 0, "wall_time": 0.0},
    "sampler": {"epoch": 0, "pos": 0},
}


@pytest.mark.parametrize("tied", [True, False])
def test_a_qwen2_checkpoint_round_trips_tied_or_untied(tok, tied, tmp_path):
    from transformers import AutoModelForCausalLM

    lm = tiny_qwen2(tok, tied, seed=3)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    lm(input_ids=torch.randint(3, 5000, (2, 7))).logits.sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    args = {"model": models.TINY_QWEN2, "run_dir": str(tmp_path)}
    kw = dict(optimizer=opt, scheduler=sched, args=args)
    checkpoint.save_checkpoint(tmp_path, policy=lm, tokenizer=tok, critic=None, state=FULL_STATE, **kw)
    fresh = tiny_qwen2(tok, tied, seed=4)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
    checkpoint.load_checkpoint(
        tmp_path, policy=fresh, critic=None, optimizer=opt2, scheduler=sched2, args=args, map_location=CPU
    )
    for (name, a), b in zip(lm.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert (fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()) == tied
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / checkpoint.CHECKPOINT / "policy")
    assert loaded.config.tie_word_embeddings == tied
    assert torch.equal(loaded.lm_head.weight, lm.lm_head.weight)
    assert torch.equal(loaded.model.layers[0].self_attn.k_proj.bias, lm.model.layers[0].self_attn.k_proj.bias)


def test_the_memory_check_reads_qwen2_and_refuses_a_batch_too_big(monkeypatch):
    monkeypatch.setattr(models, "device_memory_bytes", lambda device: 2**30)
    models.check_generation_memory(models.TINY_QWEN2, CPU, {"--batch-size": (64, 256)})
    with pytest.raises(errors.UserError, match="--batch-size"):
        models.check_generation_memory(models.TINY_QWEN2, CPU, {"--batch-size": (4096, 256)})


def test_ppo_with_a_full_critic_trains_tiny_qwen2_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    flags = dict(model=models.TINY_QWEN2, task="toy", critic="full", lr=1e-3, total_steps=1)
    check_ok(run_here("ppo.py", cli(run_dir, **flags)))
    ckpt = run_dir / checkpoint.CHECKPOINT
    checkpoint.verify_checkpoint(ckpt)
    check_ok(run_here("ppo.py", cli(run_dir, **{**flags, "total_steps": 2}, resume=True)))


# ------------------------------------------------------------------------------------------------------
# short names, the study's model, and a model that cannot be fetched
# ------------------------------------------------------------------------------------------------------


def test_short_names_are_their_hub_ids():
    assert models.resolve_model("qwen2.5-0.5b") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert models.resolve_model("qwen2.5-1.5b") == "Qwen/Qwen2.5-1.5B-Instruct"
    assert models.resolve_model("smollm2-360m") == "HuggingFaceTB/SmolLM2-360M-Instruct"
    assert models.resolve_model("smollm2-1.7b") == "HuggingFaceTB/SmolLM2-1.7B-Instruct"
    with pytest.raises(errors.UserError, match="qwen2.5-0.5b"):
        models.resolve_model("qwen-tiny")


# a hub id is owner/name: one /, neither part empty, no leading /, . or ~ (the hub's own rule for a repository id);
# anything else with a /, a leading . or ~, or a .gguf ending is a path on this machine
HUB_IDS = ["Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct", "openai-community/gpt2"]
MISSING_PATHS = {
    "/nonexistent/folder": "no such folder",
    "./no-such-folder": "no such folder",
    "../no-such-folder": "no such folder",
    "~/no-such-folder-here": "no such folder",
    "runs/ppo-small-s1/checkpoint": "no such folder",  # two /: never a hub id
    "no-such-owner/": "no such folder",  # an empty name
    "missing.gguf": "no such file",
    "/nonexistent/model.gguf": "no such file",
}


@pytest.mark.parametrize("name", HUB_IDS)
def test_a_hub_id_is_passed_to_the_hub(name):
    assert models.resolve_model(name) == name


@pytest.mark.parametrize("name", list(MISSING_PATHS))
def test_a_missing_path_is_named_as_missing_not_as_an_unknown_model(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the relative ones: under an empty folder
    with pytest.raises(errors.UserError) as e:
        models.resolve_model(name)
    said = str(e.value)
    assert said.startswith(f"--model {name}: {MISSING_PATHS[name]}") and "unknown" not in said, said
    if not name.startswith("/"):  # where it was looked for: relative to this folder, ~ expanded
        where = Path(name).expanduser()
        assert str(where if where.is_absolute() else tmp_path / where) in said, said


def test_a_path_that_is_not_a_model_is_named_for_what_it_is(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(errors.UserError, match="is a file, not a model folder or a .gguf file"):
        models.resolve_model(str(tmp_path / "notes.txt"))
    with pytest.raises(errors.UserError, match="without config.json"):
        models.resolve_model(str(tmp_path))
    with pytest.raises(errors.UserError, match="unknown model 'no-such-model'"):  # no /: a short name mistyped
        models.resolve_model("no-such-model")


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "dpo.py"])
def test_the_study_runs_qwen25_05b_and_the_cpu_preset_the_organism(script):
    """On a GPU the study's model; on the CPU the organism, with its own prompt (the question alone); any other
    model given takes the packaged model's preset, and the organism keeps its prompt at the study's scale too."""
    import importlib

    from plumbing import runtime

    module = importlib.import_module(script.removesuffix(".py"))
    assert module.Args().model == "qwen2.5-0.5b"
    cpu = runtime.cpu_preset(module.Args, module.CPU_SCALE)
    assert (cpu.model, cpu.prompt_format) == (models.ORGANISM, "question")
    tiny = runtime.cpu_preset(module.Args, module.CPU_SCALE, "tiny")
    assert (tiny.model, tiny.prompt_format) == ("tiny", "chat")
    assert tiny.max_new_tokens == module.CPU_SCALE[models.PACKAGED_MODEL]["max_new_tokens"]
    study, _ = runtime.cli(module.Args, module.CPU_SCALE, ["--scale", "study", "--model", "organism"])
    assert study.prompt_format == "question" and study.batch_size == module.Args().batch_size


def test_a_model_that_cannot_be_fetched_is_one_line_before_anything_is_written(tmp_path):
    """The study's default (--scale study: qwen2.5-0.5b) with no network and an empty hub cache, for real."""
    env = dict(trainer_env(), HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "empty-cache"))
    run_dir = tmp_path / "run"
    flags = cli(run_dir, base={"scale": "study"})
    proc = subprocess.run(command("grpo.py", flags), cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    line = check_one_error_line(proc)
    assert "Qwen/Qwen2.5-0.5B-Instruct" in line and "--model smollm2" in line and "local folder" in line, line
    assert not run_dir.exists()
    assert os.environ.get("HF_HUB_CACHE") != env["HF_HUB_CACHE"]


def test_the_sweep_leaves_the_model_to_the_scale(tmp_path):
    """A sweep without --model passes none, so that each trainer's scale picks it (study: qwen2.5-0.5b, cpu:
    smollm2); --model given is passed on; --smoke runs the tiny model. sweep_runner in process, on sweep.sh's plan."""
    from study import sweep_runner

    plan = (REPO / "sweep.sh").read_text().split("<<'PLAN'\n")[1].split("\nPLAN")[0]
    lines, smoke = sweep_runner.read_plan(plan)
    experiments = list(dict.fromkeys(e for e, *_ in lines))

    def commands(*argv: str) -> list[str]:
        given = ["--default-experiments", "h2h,critic,labels", "--budget-from", "h2h/grpo-group"]  # as sweep.sh
        o = sweep_runner.parse_args([*given, "--out", str(tmp_path / "out"), "--seeds", "1", *argv], experiments)
        return [" ".join(sweep_runner.command(o, run, smoke, None)) for run in sweep_runner.make_runs(o, lines)]

    study = commands("--scale", "study")
    assert len(study) == 18 and all("--model" not in c and "--scale study" in c for c in study)
    assert all("--model qwen2.5-1.5b " in c for c in commands("--model", "qwen2.5-1.5b"))
    assert all("--model tiny " in c for c in commands("--smoke"))
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------------
# report.py --estimate-model: the study's memory and time on one H200, by arithmetic
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2", "smollm2-360m", "smollm2-1.7b", "qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_the_estimates_shapes_count_the_parameters_transformers_builds(name):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    s = estimate.MODEL_SHAPES[name]
    kind = Qwen2Config if s.get("qkv_bias") else LlamaConfig
    cfg = kind(
        vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], intermediate_size=s["inter"],
        tie_word_embeddings=s["tied"],
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert estimate.model_params(s)["total"] == sum(p.numel() for p in model.parameters())
    known = {"smollm2": 134_515_008, "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304}
    assert estimate.model_params(s)["total"] == known.get(name, estimate.model_params(s)["total"])


def test_the_estimates_study_settings_are_the_trainers():
    import importlib

    for method, settings in estimate.STUDY.items():
        args = importlib.import_module(method).Args()
        assert {k: getattr(args, k) for k in settings} == settings, method


def test_the_activation_bytes_per_token_match_what_a_qwen2_layer_saves():
    """31 H + 8 I bytes per token per layer (estimate.ACT_BYTES_*) against the tensors a Qwen2 layer saves for its
    backward under bf16 autocast, at a third shape (not one it was fitted to): within 10%."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    H, inter = 256, 1408

    def saved(layers: int, S: int) -> int:
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=256, hidden_size=H, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        m = AutoModelForCausalLM.from_config(cfg)
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            m.model(input_ids=torch.randint(0, 256, (1, S)))
        return sum(seen.values())

    per_token_layer = ((saved(2, 128) - saved(1, 128)) - (saved(2, 64) - saved(1, 64))) / 64
    predicted = estimate.ACT_BYTES_H * H + estimate.ACT_BYTES_I * inter
    assert abs(per_token_layer - predicted) <= 0.1 * per_token_layer, (per_token_layer, predicted)


def test_qwen25_05b_fits_one_h200_at_the_study_settings_and_15b_says_what_to_change():

    small = estimate.model_estimate_markdown("qwen2.5-0.5b", 200, 3)
    rows = [line for line in small.splitlines() if line.startswith("| ppo-") or line.startswith("| grpo")]
    assert len(rows) == 6 and all("| yes |" in r for r in rows), small
    assert "18 runs x 3 seeds" in small
    big = estimate.model_estimate_markdown("qwen2.5-1.5b", 200, 3)
    full = next(line for line in big.splitlines() if line.startswith("| ppo-full"))
    assert "**no**: at --micro-batch-size" in full
    with pytest.raises(errors.UserError, match="qwen2.5-0.5b"):
        estimate.model_estimate_markdown("gpt2", 200, 3)
