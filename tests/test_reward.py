"""The strict GSM8K reward: only a marked final answer ('#### N' or \\boxed{N}) counts, never the last number."""

import time

import pytest

import gsm8k
from plumbing import errors

# normalize_number: text -> canonical string, worked out by hand.
NORMALIZE = [
    ("72", "72"),
    ("1,000", "1000"),
    ("1,234,567", "1234567"),
    ("$1,000.50", "1000.5"),
    ("1000.5", "1000.5"),
    ("+7", "7"),
    ("50%", "50"),
    ("72.0", "72"),
    ("72.00", "72"),
    ("-5", "-5"),
    ("-$5", "-5"),
    ("$-5", "-5"),
    ("0.50", "0.5"),
    (".5", "0.5"),
    ("-0", "0"),
    ("007", "7"),
    ("\\$18", "18"),
    ("1{,}000", "1000"),
    # 31 significant digits: must not be rounded to 1 by Decimal's 28-digit context
    ("1.0000000000000000000000000000001", "1.0000000000000000000000000000001"),
    ("1,00", None),  # commas must group thousands
    ("12,34", None),
    (",000", None),
    ("1,0000", None),
    ("", None),
    ("$", None),
    ("-", None),
    ("abc", None),
    ("1e3", None),
    ("3/4", None),
    ("--5", None),  # one sign at most
    ("-+5", None),
    ("\u0667\u0662", None),  # Arabic-Indic 72
    ("\uff17\uff12", None),  # full-width 72
    ("2\u00b2", None),  # superscript two
    ("9" * 65, None),  # longer than any answer: rejected, no int() of a huge string
]


@pytest.mark.parametrize("text,expected", NORMALIZE)
def test_normalize_number(text, expected):
    assert gsm8k.normalize_number(text) == expected


# gsm8k_reward: (completion, gold, reward).
TRAP = "Tom has 3 + 4 = 7 apples.\n#### 12\nCheck: 12 - 5 = 7"  # the last number (7) is not the marked answer
REWARD = [
    (TRAP, "12", 1.0),
    (TRAP, "7", 0.0),
    ("3 + 4 = 7, so the answer is 72", "72", 0.0),  # no marker: the right last number scores nothing
    ("The answer is 72.", "72", 0.0),
    ("#### 72\n#### 73", "72", 0.0),  # two different final answers: hedging scores 0
    ("#### 72\n#### 73", "73", 0.0),
    ("#### 72\nAgain: #### 72", "72", 1.0),  # the same answer twice is fine
    ("#### 72\nSo the answer is \\boxed{72}.", "72", 1.0),  # the two markers agree
    ("#### 72\n\\boxed{73}", "72", 0.0),  # the two markers disagree
    ("#### 7 \\boxed{8}", "8", 0.0),  # disagree too: the backslash ends the number 7, it is not part of it
    ("#### 7 \\boxed{8}", "7", 0.0),
    ("#### 7\\boxed{7}", "7", 1.0),
    ("#### \\$18", "18", 1.0),  # an escape the number may hold
    ("#### 50\\%", "50", 1.0),
    ("\\boxed{72}", "72", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### 1000", "1,000", 1.0),  # the gold is normalised too
    ("#### $18", "18", 1.0),
    ("#### $18.00", "18", 1.0),
    ("#### 50%", "50", 1.0),
    ("#### +7", "7", 1.0),
    ("#### 72.0", "72", 1.0),
    ("#### 72.00", "72", 1.0),
    ("#### 1,000.50", "1000.5", 1.0),
    ("#### 0.5", ".5", 1.0),
    ("#### -3", "-3", 1.0),
    ("#### 3", "-3", 0.0),
    ("#### -3", "3", 0.0),
    ("#### 72.", "72", 1.0),  # a sentence's full stop
    ("#### 72. That is all.", "72", 1.0),
    ("#### 72, which is the total", "72", 1.0),
    ("#### 1,00", "100", 0.0),  # invalid grouping
    ("#### 12,34", "1234", 0.0),
    ("#### 72kg", "72", 0.0),  # a unit glued on: not a plain number
    ("#### 72 apples", "72", 1.0),  # a word after a space is not part of the number
    ("#### **72**", "72", 1.0),  # markdown bold
    ("**#### 72**", "72", 1.0),
    ("####: 42", "42", 1.0),
    ("####72", "72", 1.0),
    ("##### 72", "72", 1.0),
    ("####\n72", "72", 1.0),
    ("#### " + "9" * 100, "9" * 100, 0.0),  # huge numbers rejected
    ("\\boxed{" + "9" * 100 + "}", "9" * 100, 0.0),
    ("#### \u0667\u0662", "72", 0.0),  # unicode digits rejected
    ("#### \uff17\uff12", "72", 0.0),
    ("#### 3/4", "3", 0.0),  # a fraction is not its numerator
    ("#### 2^10", "2", 0.0),  # a power is not its base
    ("#### 1{,}000", "1", 0.0),  # LaTeX thousands separator after '####': not the number 1
    ("#### --5", "-5", 0.0),
    ("#### 1.0000000000000000000000000000001", "1", 0.0),  # not equal to 1
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("\\boxed{\\text{72}}", "72", 1.0),
    ("\\boxed{72 kg}", "72", 0.0),
    ("\\boxed{\\frac{3}{4}}", "3", 0.0),
    ("", "72", 0.0),
    ("#### ", "0", 0.0),
    ("#### the answer is 72", "72", 0.0),  # the marker must be followed by the number
    ("#### 72", "not a number", 0.0),
]


@pytest.mark.parametrize("completion,gold,expected", REWARD)
def test_gsm8k_reward(completion, gold, expected):
    assert gsm8k.gsm8k_reward(completion, gold) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        (TRAP, "12"),
        ("The answer is 72", None),
        ("#### 72\n#### 73", None),
        ("#### 72\n#### 72.0\n\\boxed{72}", "72"),
        ("#### abc\n#### 72", "72"),  # a marker without a number gives nothing; the other one counts
        ("#### 1,000.50", "1000.5"),
    ],
)
def test_extract_final_answer(text, expected):
    assert gsm8k.extract_final_answer(text) == expected


def test_score_dispatch():
    assert gsm8k.score("gsm8k", ["#### 5", "5"], [[1], [2]], ["5", "5"]) == [1.0, 0.0]
    assert gsm8k.score("toy", ["", ""], [[1, 2, 32], [1, 2, 3]], ["", ""]) == [1.0, 0.0]
    with pytest.raises(errors.UserError):
        gsm8k.score("chess", [""], [[1]], [""])


N = 100_000
ADVERSARIAL = [
    ("#### " * (N // 5), None),
    ("\\boxed{" * (N // 7), None),  # no closing brace anywhere
    ("\\boxed{" + "{" * N, None),
    ("#### " + "1" * N, None),  # a 100k-digit run
    ("\\boxed{" + "1" * N + "}", None),
    ("#### " + "1," * (N // 2), None),
    ("#" * N, None),
    ("#### 7 " * (N // 7), "7"),  # many agreeing markers
    ("#### 7\n" * (N // 7) + "#### 8", None),
    ("a" * N + "#### 42", "42"),
    (("#### " + "1" * 60 + "x") * (N // 66), None),
]


@pytest.mark.parametrize("text,expected", ADVERSARIAL, ids=[f"adv{i}" for i in range(len(ADVERSARIAL))])
def test_adversarial_inputs_return_promptly(text, expected):
    t0 = time.perf_counter()
    assert gsm8k.extract_final_answer(text) == expected
    # A hang guard against catastrophic backtracking or quadratic scans, not a speed target.
    assert time.perf_counter() - t0 < 2.0


class CountingStr(str):
    """A str that counts its indexing and slicing: the Python-level work a parser does on it."""

    ops = 0

    def __getitem__(self, key):
        CountingStr.ops += 1
        return str.__getitem__(self, key)


@pytest.mark.parametrize("unit", ["\\boxed{", "\\boxed{1", "\\boxed{\\boxed{}}"], ids=["open", "digit", "closed"])
def test_a_long_run_of_boxed_costs_a_constant_per_marker(unit):
    """Linear with a small constant: a few indexing steps per \\boxed{ whatever the run's length (each marker
    used to scan up to 256 characters: ~1 s per 100 KB), and 4x the text takes about 4x the time."""
    costs, times = {}, {}
    for n in (5_000, 20_000):
        text = unit * n
        CountingStr.ops = 0
        gsm8k.extract_final_answer(CountingStr(text))
        costs[n] = CountingStr.ops
        runs = []
        for _ in range(5):  # the fastest of five, in this process's CPU time: the other processes on a busy
            t0 = time.process_time()  # machine (the other xdist worker, its subprocesses) do not count
            gsm8k.extract_final_answer(text)
            runs.append(time.process_time() - t0)
        times[n] = min(runs)
    markers = 20_000 * unit.count("\\boxed{")
    assert costs[20_000] <= 4 * markers, costs
    assert costs[20_000] <= 4.5 * costs[5_000] + 100, costs
    assert times[20_000] < 10 * times[5_000] + 0.01, times  # linear, generously: 4x the text, under 10x the time
