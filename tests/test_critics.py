"""Critic capacities: parameter counts from the shapes, zero-initialised values, a full copy that is its own."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from critics import HEAD_WIDTHS, build_critic
from plumbing import distributed, models, rollout

# The table in critics.py's docstring, copied as numbers; the tests below recompute each from the shapes.
DOCSTRING_TABLE = {
    896: {"none": 0, "small": 57_473, "medium": 459_777, "large": 919_553, "full": 494_033_665},
    576: {"none": 0, "small": 36_993, "medium": 295_937, "large": 591_873, "full": 134_515_585},
    64: {"none": 0, "small": 4_225, "medium": 33_793, "large": 67_585, "full": 3_219_841},
}


def mlp_params(H: int, width: int) -> int:
    return (H * width + width) + (width * 1 + 1)  # Linear(H, width) then Linear(width, 1), with biases


def llama_trunk_params(vocab: int, H: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> int:
    attn = H * heads * head_dim + 2 * H * kv_heads * head_dim + heads * head_dim * H  # q, k, v, o (no biases)
    mlp = 3 * H * inter  # gate, up, down
    return vocab * H + layers * (attn + mlp + 2 * H) + H  # embeddings, layers with two RMSNorms, the final norm


SMOLLM2_135M = dict(vocab=49152, H=576, inter=1536, layers=30, heads=9, kv_heads=3, head_dim=64)
TINY = dict(vocab=49152, H=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16)  # models.tiny_config


def _policy_on_meta(spec):
    """A Llama policy with these shapes, on the meta device: shapes and counts without allocating weights."""
    config = LlamaConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["H"],
        intermediate_size=spec["inter"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        head_dim=spec["head_dim"],
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("H", [64, 576, 896])
def test_head_parameter_counts(H):
    counts = {name: distributed.count_params(build_critic(name, H)) for name in ("none", "small", "medium", "large")}
    for name in ("small", "medium", "large"):
        assert counts[name] == mlp_params(H, HEAD_WIDTHS[name]) == DOCSTRING_TABLE[H][name]
    assert counts["none"] == 0 == DOCSTRING_TABLE[H]["none"]
    assert counts["none"] < counts["small"] < counts["medium"] < counts["large"]
    assert 1.8 <= counts["large"] / counts["medium"] <= 2.2
    assert counts["large"] == 2 * counts["medium"] - 1  # twice the width: (H + 2) n + 1 parameters at width n


def test_the_study_models_full_critic_parameter_count():
    """Qwen2.5-0.5B-Instruct's shapes (estimate.MODEL_SHAPES; tied embeddings, q/k/v biases), on the meta device:
    the full critic is its whole trunk, 494,032,768 parameters, and an H + 1 head, as critics.py's table says."""
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(config)
    assert distributed.count_params(policy) == 494_032_768
    assert distributed.count_params(build_critic("full", 896, policy)) == DOCSTRING_TABLE[896]["full"]


@pytest.mark.parametrize("spec", [SMOLLM2_135M, TINY], ids=["H576", "H64"])
def test_full_critic_parameter_count(spec):
    policy = _policy_on_meta(spec)
    critic = build_critic("full", spec["H"], policy)
    expected = llama_trunk_params(**spec) + spec["H"] + 1  # the trunk and a Linear(H, 1) head
    assert distributed.count_params(critic) == expected == DOCSTRING_TABLE[spec["H"]]["full"]
    assert distributed.count_params(critic) > distributed.count_params(build_critic("large", spec["H"]))


@pytest.mark.parametrize("name", ["small", "medium", "large"])
def test_heads_output_shape_and_start_at_zero(name):
    torch.manual_seed(0)
    head = build_critic(name, 64)
    values = head(torch.randn(3, 7, 64))
    assert values.shape == (3, 7)
    assert torch.all(values == 0)
    # zero output layer, but the gradient still reaches it
    values.sum().backward()
    assert head.out.weight.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def tiny_policy(tiny_tokenizer):
    return models.load_model(models.TINY_MODEL, tiny_tokenizer, seed=0)


def test_full_critic_is_a_separate_copy(tiny_policy):
    critic = build_critic("full", tiny_policy.config.hidden_size, tiny_policy)
    policy_params = {id(p) for p in tiny_policy.parameters()}
    assert not policy_params & {id(p) for p in critic.parameters()}
    assert all(p.requires_grad for p in critic.parameters())
    # same weights at the start
    w_policy = tiny_policy.model.layers[0].self_attn.q_proj.weight
    w_critic = critic.trunk.layers[0].self_attn.q_proj.weight
    assert torch.equal(w_policy, w_critic)
    before = w_policy.detach().clone()
    with torch.no_grad():
        w_critic.add_(1.0)  # changing the critic ...
    assert torch.equal(w_policy, before)  # ... leaves the policy alone
    with torch.no_grad():
        tiny_policy.model.embed_tokens.weight[0].add_(1.0)  # and the other way round
    assert not torch.equal(tiny_policy.model.embed_tokens.weight[0], critic.trunk.embed_tokens.weight[0])
    with torch.no_grad():
        tiny_policy.model.embed_tokens.weight[0].sub_(1.0)


def test_full_critic_output(tiny_policy):
    critic = build_critic("full", tiny_policy.config.hidden_size, tiny_policy)
    ids = torch.randint(0, 100, (2, 5))
    mask = torch.ones_like(ids)
    values = critic(input_ids=ids, attention_mask=mask, position_ids=rollout.position_ids_from_mask(mask))
    assert values.shape == (2, 5)
    assert torch.all(values == 0)


def test_full_needs_policy_and_unknown_name():
    with pytest.raises(ValueError, match="policy"):
        build_critic("full", 64)
    with pytest.raises(ValueError, match="unknown critic"):
        build_critic("huge", 64)
    assert build_critic("none", 64) is None
