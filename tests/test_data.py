"""GSM8K loading (sizes, the fixed validation split, errors that name the file and line) and PromptSampler."""

import json
import random
from collections import Counter

import pytest

import gsm8k
from plumbing import errors


@pytest.fixture(scope="module")
def splits(gsm8k_dir):
    return gsm8k.load_gsm8k(str(gsm8k_dir))


def _key(p: gsm8k.Problem) -> tuple[str, str]:
    return (p.question, p.solution)


def _lines(path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_split_sizes(splits, gsm8k_dir):
    """Every train problem is in train or val (500 of them), every test problem in test: on the sample."""
    n_train, n_test = _lines(gsm8k_dir / "train.jsonl"), _lines(gsm8k_dir / "test.jsonl")
    assert (n_train, n_test) == (700, 200)  # tests/data/gsm8k/README.md
    assert {k: len(v) for k, v in splits.items()} == {"train": n_train - 500, "val": 500, "test": n_test}


def test_the_whole_gsm8k_splits_as_published(full_gsm8k_dir):
    """GSM8K's published sizes (7,473 train, 1,319 test), the study's val carved out of train."""
    splits = gsm8k.load_gsm8k(str(full_gsm8k_dir))
    assert {k: len(v) for k, v in splits.items()} == {"train": 6973, "val": 500, "test": 1319}


def test_the_sample_is_the_head_of_the_whole_gsm8k(gsm8k_dir, full_gsm8k_dir):
    """The committed sample is what its README says: the first lines of GSM8K's files, unchanged."""
    for split in ("train", "test"):
        sample = (gsm8k_dir / f"{split}.jsonl").read_bytes()
        assert (full_gsm8k_dir / f"{split}.jsonl").read_bytes().startswith(sample)


def test_val_is_carved_out_of_train(splits, gsm8k_dir):
    raw = [json.loads(line) for line in (gsm8k_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    raw_keys = Counter((r["question"], r["answer"]) for r in raw)
    train, val = Counter(map(_key, splits["train"])), Counter(map(_key, splits["val"]))
    assert not set(train) & set(val)
    assert train + val == raw_keys  # nothing lost, nothing duplicated


def test_gold_is_the_marked_answer(splits):
    for p in splits["train"][:50] + splits["test"][:50]:
        marked = p.solution.rsplit("####", 1)[1].strip().replace(",", "")
        assert p.gold == marked


def test_val_is_fixed_and_depends_only_on_val_seed(splits, gsm8k_dir, tmp_path):
    random.seed(12345)  # the global RNG must not matter
    again = gsm8k.load_gsm8k(str(gsm8k_dir))
    assert list(map(_key, again["val"])) == list(map(_key, splits["val"]))
    # another test split in the folder changes nothing in val
    (tmp_path / "train.jsonl").symlink_to((gsm8k_dir / "train.jsonl").resolve())
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    other_folder = gsm8k.load_gsm8k(str(tmp_path))
    assert list(map(_key, other_folder["val"])) == list(map(_key, splits["val"]))
    other_seed = gsm8k.load_gsm8k(str(tmp_path), val_seed=1)
    assert set(map(_key, other_seed["val"])) != set(map(_key, splits["val"]))
    assert len(other_seed["val"]) == 500


GOOD = json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"})


def _write(folder, train_lines, test_lines=(GOOD,)):
    (folder / "train.jsonl").write_text("\n".join(train_lines) + "\n")
    (folder / "test.jsonl").write_text("\n".join(test_lines) + "\n")


@pytest.mark.parametrize(
    "bad",
    [
        '{"question": "q", "answer": "#### 4"',  # bad JSON
        json.dumps({"question": "q"}),  # missing key
        json.dumps({"question": "q", "answer": "the answer is 4"}),  # no '#### N'
        json.dumps({"question": "q", "answer": "#### four"}),
        json.dumps({"question": 3, "answer": "#### 4"}),  # not a string
        json.dumps(["q", "#### 4"]),  # not an object
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad):
    # the bad row is on line 4 of the file (a blank line 3 is skipped but still counted)
    _write(tmp_path, [GOOD, GOOD, "", bad, GOOD])
    with pytest.raises(errors.UserError) as e:
        gsm8k.load_gsm8k(str(tmp_path), val_size=1)
    assert f"{tmp_path / 'train.jsonl'}:4:" in str(e.value)


def test_malformed_test_line(tmp_path):
    _write(tmp_path, [GOOD, GOOD], [GOOD, "not json"])
    with pytest.raises(errors.UserError, match=r"test\.jsonl:2:"):
        gsm8k.load_gsm8k(str(tmp_path), val_size=1)


def test_small_folder_loads(tmp_path):
    _write(tmp_path, [GOOD, GOOD, GOOD])
    out = gsm8k.load_gsm8k(str(tmp_path), val_size=1)
    assert (len(out["train"]), len(out["val"]), len(out["test"])) == (2, 1, 1)
    assert out["test"][0].gold == "4"


def test_a_file_is_parsed_once_per_version_and_a_changed_one_again(tmp_path, monkeypatch):
    calls = []
    parse = gsm8k._parse_jsonl
    monkeypatch.setattr(gsm8k, "_parse_jsonl", lambda path, f: calls.append(path.name) or parse(path, f))
    _write(tmp_path, [GOOD, GOOD, GOOD])
    first = gsm8k.load_gsm8k(str(tmp_path), val_size=1)
    first["train"].clear()  # a caller's list is its own
    again = gsm8k.load_gsm8k(str(tmp_path), val_size=1)
    assert sorted(calls) == ["test.jsonl", "train.jsonl"] and len(again["train"]) == 2
    other = json.dumps({"question": "What is 5 + 5?", "answer": "5 + 5 = 10\n#### 10"})
    (tmp_path / "test.jsonl").write_text(other + "\n" + other + "\n")  # another version: read again
    changed = gsm8k.load_gsm8k(str(tmp_path), val_size=1)
    assert [p.gold for p in changed["test"]] == ["10", "10"] and sorted(calls).count("test.jsonl") == 2


def test_missing_folder(tmp_path):
    with pytest.raises(errors.UserError, match="does not exist"):
        gsm8k.load_gsm8k(str(tmp_path / "nowhere"))


def test_missing_file(tmp_path):
    _write(tmp_path, [GOOD, GOOD])
    (tmp_path / "test.jsonl").unlink()
    with pytest.raises(errors.UserError, match="test.jsonl"):
        gsm8k.load_gsm8k(str(tmp_path), val_size=1)


@pytest.mark.parametrize("which", ["train", "test"])
def test_empty_split(tmp_path, which):
    _write(tmp_path, [GOOD, GOOD], [GOOD])
    (tmp_path / f"{which}.jsonl").write_text("\n\n")
    with pytest.raises(errors.UserError, match=which):
        gsm8k.load_gsm8k(str(tmp_path), val_size=0)


def test_val_size_too_large(tmp_path):
    _write(tmp_path, [GOOD, GOOD])
    with pytest.raises(errors.UserError, match="val-size"):
        gsm8k.load_gsm8k(str(tmp_path), val_size=2)


# ---------------------------------------------------------------------------------------------- PromptSampler


def _draw(sampler, total, k):
    out = []
    while len(out) < total:
        out += sampler.next(k)
    return out[:total]


@pytest.mark.parametrize("n,k", [(10, 3), (7, 7), (5, 12), (1, 2)])
def test_sampler_covers_every_index_once_per_epoch(n, k):
    seq = _draw(gsm8k.PromptSampler(n, seed=3), 4 * n, k)
    for e in range(4):
        assert sorted(seq[e * n : (e + 1) * n]) == list(range(n))


def test_sampler_batches_have_the_asked_size():
    s = gsm8k.PromptSampler(10, seed=0)
    assert [len(s.next(k)) for k in (3, 4, 10, 25)] == [3, 4, 10, 25]


def test_sampler_is_deterministic_and_seeded():
    a = _draw(gsm8k.PromptSampler(50, seed=1), 200, 7)
    b = _draw(gsm8k.PromptSampler(50, seed=1), 200, 7)
    c = _draw(gsm8k.PromptSampler(50, seed=2), 200, 7)
    assert a == b
    assert a != c
    assert a[:50] != a[50:100]  # each epoch is reshuffled


@pytest.mark.parametrize("steps", [0, 1, 7, 8, 23])
def test_sampler_state_round_trips(steps):
    a = gsm8k.PromptSampler(16, seed=5)
    for _ in range(steps):
        a.next(5)
    state = json.loads(json.dumps(a.state_dict()))  # the checkpoint stores it as JSON
    b = gsm8k.PromptSampler(16, seed=5)
    b.load_state_dict(state)
    assert _draw(b, 60, 5) == _draw(a, 60, 5)
