"""The ``math`` reward (math-verify) against a hand-labelled table, and the
``exact`` / ``regex`` / ``module:function`` kinds and the error convention (a verifier that cannot
judge is an ``error`` outcome, never 0.0)."""

from __future__ import annotations

import pytest

from rollbook.config import RewardConfig
from rollbook.errors import ConfigError
from rollbook.rewards import RewardPool, build_reward, score_row

# (reference answer, completion, expected reward); hand-labelled
MATH_TABLE = [
    # equivalent forms, plain
    ("1/2", "1/2", 1.0),
    ("1/2", "0.5", 1.0),
    ("0.5", "1/2", 1.0),
    ("\\frac{1}{2}", "0.5", 1.0),
    ("1/2", "\\frac{1}{2}", 1.0),
    ("1/2", "$\\frac{1}{2}$", 1.0),
    ("1/2", "\\frac12", 1.0),
    ("0.25", "1/4", 1.0),
    ("3", "3.0", 1.0),
    ("42", "42", 1.0),
    ("-7", "-7", 1.0),
    ("1000", "1000", 1.0),
    ("2\\sqrt{2}", "\\sqrt{8}", 1.0),
    ("\\pi", "\\pi", 1.0),
    ("x + 1", "$1 + x$", 1.0),  # algebra needs delimiters in a completion (plain text reads numbers only)
    # boxed, inside a worked answer
    ("1/2", "Half of one is \\boxed{\\frac{1}{2}}.", 1.0),
    ("1/2", "so the answer is \\boxed{0.5}", 1.0),
    ("12", "3 boxes of 4 apples: 3*4 = 12, so \\boxed{12}", 1.0),
    ("12", "First 3+4=7, then the answer is \\boxed{12}", 1.0),
    ("5", "We get $x = 5$.", 1.0),
    ("5", "The final answer is $\\boxed{5}$", 1.0),
    ("-3", "\\boxed{-3}", 1.0),
    ("2/3", "\\boxed{\\dfrac{2}{3}}", 1.0),
    ("100", "The answer is 100", 1.0),
    # wrong
    ("1/2", "1/3", 0.0),
    ("1/2", "0.6", 0.0),
    ("1/2", "\\boxed{2}", 0.0),
    ("12", "\\boxed{13}", 0.0),
    ("42", "24", 0.0),
    ("-7", "7", 0.0),
    ("3", "\\boxed{3.5}", 0.0),
    ("x + 1", "$x - 1$", 0.0),
    ("2\\sqrt{2}", "\\sqrt{2}", 0.0),
    ("12", "Since 12 apples fill a box, the answer is \\boxed{11}", 0.0),
    # missing answer
    ("1/2", "", 0.0),
    ("12", "I do not know.", 0.0),
    ("12", "\\boxed{}", 0.0),
    ("5", "   ", 0.0),
    # malformed LaTeX
    ("1/2", "\\frac{1}{", 0.0),
    ("1/2", "\\boxed{\\frac{1}{", 0.0),
    ("3", "$$$", 0.0),
    ("3", "\\sqrt{", 0.0),
    ("4", "\\left( 4", 1.0),  # unbalanced delimiter: math-verify still reads the 4
]


@pytest.fixture(scope="module")
def math_verifier():
    return build_reward(RewardConfig(kind="math"))


def test_the_table_is_big_enough():
    assert len(MATH_TABLE) >= 40
    assert {r for *_, r in MATH_TABLE} == {0.0, 1.0}


@pytest.mark.parametrize(("answer", "completion", "expected"), MATH_TABLE)
def test_math_reward_matches_the_hand_labels(math_verifier, answer, completion, expected):
    scored = score_row(math_verifier, completion, {"answer": answer})
    assert scored.outcome.status == "ok", scored.outcome
    assert scored.outcome.reward == expected, (answer, completion, scored.info)


def test_no_answer_is_a_wrong_answer_with_its_reason(math_verifier):
    scored = score_row(math_verifier, "nothing here", {"answer": "3"})
    assert (scored.outcome.reward, scored.info["reason"]) == (0.0, "no_answer")


@pytest.mark.parametrize("answer", [None, "", "\\frac{"])
def test_a_reference_that_cannot_be_judged_is_an_error_not_zero(math_verifier, answer):
    scored = score_row(math_verifier, "\\boxed{3}", {"answer": answer})
    assert scored.outcome.status == "error" and scored.outcome.reward is None
    assert scored.outcome.error


def test_exact_and_regex():
    exact = build_reward(RewardConfig(kind="exact"))
    assert score_row(exact, " 46 ", {"answer": "46"}).outcome.reward == 1.0
    assert score_row(exact, "47", {"answer": "46"}).outcome.reward == 0.0
    assert (
        score_row(build_reward(RewardConfig(kind="exact", case_sensitive=False)), "Paris", {"answer": "paris"}).outcome.reward
        == 1.0
    )
    assert score_row(exact, "46", {}).outcome.status == "error"
    regex = build_reward(RewardConfig(kind="regex", pattern=r"<answer>(.*?)</answer>"))
    assert score_row(regex, "think... <answer> 7 </answer>", {"answer": "7"}).outcome.reward == 1.0
    assert score_row(regex, "<answer>8</answer>", {"answer": "7"}).outcome.reward == 0.0
    assert score_row(regex, "no tags", {"answer": "7"}).info["reason"] == "no_match"
    assert score_row(regex, "<answer>x</answer>", {}).outcome.reward == 1.0  # no reference: a match is enough
    with pytest.raises(ValueError, match="pattern"):
        build_reward(RewardConfig(kind="regex"))


def user_reward(completion: str, row: dict) -> float:  # used by the module:function tests below
    if "crash" in completion:
        raise RuntimeError("boom")
    if "nan" in completion:
        return float("nan")
    if "text" in completion:
        return "yes"  # type: ignore[return-value]
    return float(len(completion) == int(row["answer"]))


def test_a_users_function_and_its_failures_are_errors_with_reasons():
    fn = build_reward(RewardConfig(kind="tests.unit.test_rewards_math:user_reward"))
    assert score_row(fn, "abc", {"answer": "3"}).outcome.reward == 1.0
    assert score_row(fn, "ab", {"answer": "3"}).outcome.reward == 0.0
    crashed = score_row(fn, "crash", {"answer": "3"}).outcome
    assert (crashed.status, crashed.reward) == ("error", None) and "RuntimeError: boom" in crashed.error
    assert "non-finite" in score_row(fn, "nan", {"answer": "3"}).outcome.error
    assert "not a number" in score_row(fn, "text", {"answer": "3"}).outcome.error


def test_bad_kinds_are_refused_in_the_config_or_at_pool_start():
    with pytest.raises(ValueError, match="reward kind"):
        RewardConfig(kind="maths")
    with pytest.raises(ConfigError, match="rollout.rewards.x: ModuleNotFoundError"):
        RewardPool({"x": RewardConfig(kind="no_such_module_here:f")}, max_workers=0)
    with pytest.raises(ConfigError, match="no function 'missing'"):
        RewardPool({"x": RewardConfig(kind="tests.unit.test_rewards_math:missing")}, max_workers=0)
    with pytest.raises(ConfigError, match="rollout.rewards.r: error"):
        RewardPool({"r": RewardConfig(kind="regex", pattern="(unclosed")}, max_workers=0)


def test_the_pool_scores_math_in_its_processes_and_refuses_unknown_domains():
    with RewardPool({"math": RewardConfig(kind="math")}, max_workers=1) as pool:
        got = pool.score_many(
            [("math", "\\boxed{0.5}", {"answer": "1/2"}), ("math", "3", {"answer": "1/2"}), ("poetry", "x", {"answer": "1"})]
        )
    assert [s.outcome.reward for s in got[:2]] == [1.0, 0.0]
    assert got[2].outcome.status == "error" and "poetry" in got[2].outcome.error


def dying_reward(completion: str, row: dict) -> float:  # kills its pool process
    import os

    if completion == "die":
        os._exit(3)
    return 1.0


def test_a_pool_process_that_dies_gives_error_outcomes_and_the_pool_is_replaced():
    with RewardPool({"x": RewardConfig(kind="tests.unit.test_rewards_math:dying_reward")}, max_workers=1) as pool:
        died = pool.result(pool.submit("x", "die", {}))
        assert died.outcome.status == "error" and "died" in died.outcome.error
        assert [s.outcome.reward for s in pool.score_many([("x", "fine", {})] * 3)] == [1.0] * 3
