"""encode_prompt: the model's chat template with the fixed instruction; clear errors otherwise."""

import copy

import pytest

import gsm8k
from plumbing import errors, generation, models

QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def test_chat_prompt_is_the_chat_template(tiny_tokenizer):
    ids = gsm8k.encode_prompt(tiny_tokenizer, "  " + QUESTION + "\n")
    messages = [{"role": "user", "content": f"{QUESTION}\n\n{gsm8k.INSTRUCTION}"}]
    expected = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert ids == list(expected)
    assert all(isinstance(i, int) for i in ids)
    text = tiny_tokenizer.decode(ids)
    assert QUESTION in text and gsm8k.INSTRUCTION in text
    assert text.rstrip().endswith("<|im_start|>assistant")  # the model answers next
    assert text.index(QUESTION) < text.index(gsm8k.INSTRUCTION)


def test_no_chat_template_needs_plain(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = None
    with pytest.raises(errors.UserError, match="plain"):
        gsm8k.encode_prompt(tok, QUESTION)
    ids = gsm8k.encode_prompt(tok, QUESTION, prompt_format="plain")
    text = tok.decode(ids)
    assert QUESTION in text and gsm8k.INSTRUCTION in text
    assert "<|im_start|>" not in text
    assert text.rstrip().endswith("Answer:")


def test_unknown_prompt_format(tiny_tokenizer):
    with pytest.raises(errors.UserError, match="prompt-format"):
        gsm8k.encode_prompt(tiny_tokenizer, QUESTION, prompt_format="fewshot")


def test_the_cached_tokenizer_loads_as_its_tokenizer_json_alone_gives_it(tmp_path):
    """The tokenizer cache's tokenizer_config.json lists the added tokens (models.save_tokenizer: each load then
    skips parsing tokenizer.json in Python for them); the folder without that list, as transformers saves it, loads
    the same tokenizer: its tokens, special tokens, chat template, and what it saves again."""
    import json
    import shutil

    from transformers import AutoTokenizer

    cached = models.resolve_model(models.TINY_MODEL)
    config = json.loads((cached / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]
    plain = tmp_path / "plain"
    shutil.copytree(cached, plain)
    del config["added_tokens_decoder"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    a, b = AutoTokenizer.from_pretrained(cached), AutoTokenizer.from_pretrained(plain)
    assert repr(a).replace(str(cached), "") == repr(b).replace(str(plain), "")  # every special and added token
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    messages = [{"role": "user", "content": QUESTION + " <|im_end|>"}]
    assert a.apply_chat_template(messages, add_generation_prompt=True) == b.apply_chat_template(
        messages, add_generation_prompt=True
    )
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_pad_token_is_not_eos(tiny_tokenizer):
    assert tiny_tokenizer.pad_token_id is not None
    assert tiny_tokenizer.pad_token_id != tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.padding_side == "left"


def test_training_and_evaluation_feed_identical_token_ids(tmp_path, monkeypatch, gsm8k_dir):
    """The prompt a training rollout sees and the one evaluation sees, for the same problem, are the same ids."""
    from helpers import cli
    from test_ppo import run_ppo_in_process

    fed: list[list[list[int]]] = []
    real_generate = generation.generate

    def watched(model, prompts, **kw):
        fed.append([list(p) for p in prompts])
        return real_generate(model, prompts, **kw)

    monkeypatch.setattr(generation, "generate", watched)
    run_ppo_in_process(
        cli(tmp_path / "run", total_steps=1, batch_size=2, mc_every=0, eval_size=2, test_size=2, no_test_before=True),
        monkeypatch,
    )
    training_prompt = fed[0][0]  # the first rollout of the first step

    tok = models.load_tokenizer("tiny")
    train = gsm8k.load_gsm8k(str(gsm8k_dir))["train"]
    text = tok.decode(training_prompt)
    problem = next(p for p in train if p.question.strip() in text)
    fed.clear()
    model = models.load_model("tiny", tok)
    gsm8k.evaluate(model, tok, [problem], task="gsm8k", prompt_format="chat", max_new_tokens=2, batch_size=1)
    assert fed == [[training_prompt]]
    assert "<|im_start|>assistant" in text and gsm8k.INSTRUCTION in text
