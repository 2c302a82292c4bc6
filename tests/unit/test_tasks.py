"""Task domains, the shared character tokenizer and reward outcomes (rollbook.tasks)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollbook.tasks import (
    DOMAINS,
    TOKENIZER,
    ArithmeticDomain,
    RewardOutcome,
    RewardTally,
    Task,
    make_tasks,
    score,
    split_of,
)


def test_tokenizer_special_ids_are_pad_bos_eos():
    assert (TOKENIZER.pad_token_id, TOKENIZER.bos_token_id, TOKENIZER.eos_token_id) == (0, 1, 2)
    assert TOKENIZER.tokens[:3] == ["<pad>", "<bos>", "<eos>"]


def test_tokenizer_round_trips_and_decode_stops_at_eos():
    ids = TOKENIZER.encode("rev:abc=", add_bos=True, add_eos=True)
    assert ids[0] == TOKENIZER.bos_token_id and ids[-1] == TOKENIZER.eos_token_id
    assert TOKENIZER.decode(ids) == "rev:abc="
    assert TOKENIZER.decode(TOKENIZER.encode("46") + [TOKENIZER.eos_token_id] + TOKENIZER.encode("99")) == "46"
    assert TOKENIZER.decode([TOKENIZER.pad_token_id, *TOKENIZER.encode("7")]) == "7"


def test_tokenizer_rejects_unknown_characters():
    with pytest.raises(ValueError, match="not in the vocabulary"):
        TOKENIZER.encode("12+34=ß")


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_one_vocabulary_serves_every_domain(name):
    for task in make_tasks(DOMAINS[name], "train", num_tasks=50, seed=0):
        assert task.domain == name
        assert max(TOKENIZER.encode(task.prompt + task.answer)) < TOKENIZER.vocab_size


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_train_and_heldout_are_disjoint_for_any_seeds(name):
    train = {t.prompt for seed in (0, 1) for t in make_tasks(DOMAINS[name], "train", num_tasks=300, seed=seed)}
    heldout = {t.prompt for seed in (0, 1) for t in make_tasks(DOMAINS[name], "heldout", num_tasks=100, seed=seed)}
    assert len(heldout) > 100  # the two seeds drew different problems
    assert not train & heldout
    assert all(split_of(p) == "heldout" for p in heldout)


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_make_tasks_is_seeded_and_distinct(name):
    first = make_tasks(DOMAINS[name], "train", num_tasks=40, seed=7)
    assert first == make_tasks(DOMAINS[name], "train", num_tasks=40, seed=7)
    assert first != make_tasks(DOMAINS[name], "train", num_tasks=40, seed=8)
    assert len({t.prompt for t in first}) == len({t.task_id for t in first}) == 40


def test_make_tasks_refuses_more_problems_than_exist():
    with pytest.raises(ValueError, match="fewer than"):
        make_tasks(ArithmeticDomain(num_digits=1), "train", num_tasks=200, seed=0)  # only 100 exist


def test_make_tasks_can_return_every_problem_of_a_small_domain():
    tasks = make_tasks(ArithmeticDomain(num_digits=1), "train", num_tasks=200, seed=0, allow_fewer=True)
    assert len(tasks) == sum(split_of(f"{a}+{b}=") == "train" for a in range(10) for b in range(10))


def test_arithmetic_answers_are_sums():
    for task in make_tasks(DOMAINS["arithmetic"], "heldout", num_tasks=30, seed=0):
        a, b = task.prompt.removesuffix("=").split("+")
        assert task.answer == str(int(a) + int(b))


def test_reverse_answers_are_reversals():
    for task in make_tasks(DOMAINS["reverse"], "train", num_tasks=30, seed=0):
        assert task.prompt.startswith("rev:") and task.answer == task.prompt[4:-1][::-1]


@given(st.integers(0, 99), st.integers(0, 99), st.integers(0, 300))
def test_arithmetic_reward_is_one_exactly_for_the_sum(a, b, guess):
    task = Task(task_id="t", domain="arithmetic", prompt=f"{a}+{b}=", answer=str(a + b))
    assert score(task, str(guess)) == RewardOutcome(status="ok", reward=float(guess == a + b))


def test_reward_decodes_from_generated_tokens():
    task = make_tasks(DOMAINS["reverse"], "train", num_tasks=1, seed=0)[0]
    output_ids = TOKENIZER.encode(task.answer, add_eos=True)
    assert score(task, TOKENIZER.decode(output_ids)).reward == 1.0
    assert score(task, TOKENIZER.decode(output_ids[::-1])).reward == 0.0


class _CrashingDomain:
    name = "crashing"

    def sample(self, rng: random.Random) -> tuple[str, str]:
        return "1+1=", "2"

    def verify(self, task: Task, completion: str) -> float:
        raise RuntimeError("verifier backend down")


def test_a_raising_verifier_is_an_error_outcome_not_a_zero_reward():
    task = Task(task_id="t", domain="crashing", prompt="1+1=", answer="2")
    outcome = score(task, "2", domains={"crashing": _CrashingDomain()})
    assert outcome.status == "error" and outcome.reward is None
    assert outcome.error == "RuntimeError: verifier backend down"


def test_unknown_domain_is_a_value_error():
    with pytest.raises(ValueError, match="unknown domain"):
        score(Task(task_id="t", domain="chess", prompt="", answer=""), "")


def test_tally_counts_errors_apart_from_rewards():
    tally = RewardTally()
    for outcome in [RewardOutcome("ok", 1.0), RewardOutcome("ok", 0.0), RewardOutcome("error", None, "boom")]:
        tally.add(outcome)
    assert tally.metrics() == {"reward/num_ok": 2, "reward/num_error": 1, "reward/mean": 0.5}


def test_addition_writes_every_number_least_significant_digit_first():
    import random

    from rollbook.tasks import AdditionDomain

    domain = AdditionDomain(num_digits=2)
    for _ in range(50):
        prompt, answer = domain.sample(random.Random(_))
        a, b = (int(x[::-1]) for x in prompt.rstrip("=").split("+"))
        assert len(prompt) == 6 and len(answer) == 3 and int(answer[::-1]) == a + b
    task = make_tasks(domain, "train", 1, seed=0)[0]
    assert score(task, task.answer, {"addition": domain}).reward == 1.0
    assert score(task, task.answer[::-1] + "9", {"addition": domain}).reward == 0.0


def test_run_program_follows_the_grammar_and_refuses_the_rest():
    from rollbook.tasks import ProgramError, run_program

    assert run_program("3*x*x+07*x+05", 100) == 30705
    assert run_program("x*x*3+5+7*x", 2) == 31
    assert run_program("2-x-3", 10) == -11
    assert run_program("12", 5) == 12
    for bad in ("", "3*", "x+", "3**x", "(x)", "x x", "y", "+3", "9" * 7, "x" + "+x" * 30):
        with pytest.raises(ProgramError):
            run_program(bad, 1)


def test_a_program_is_right_when_it_computes_the_function_whatever_its_spelling():
    from rollbook.tasks import ProgramDomain

    task = next(t for t in make_tasks(DOMAINS["program"], "train", 200, seed=0) if "+00*x" not in t.answer)
    a, b, c = (int(part.split("*")[0]) for part in task.answer.split("+"))
    right = [task.answer, f"{a}*x*x+{b}*x+{c}", f"{c}+x*{b}+x*x*{a}", f"{c}+x*{b}" + "+x*x" * a]
    wrong = [
        f"{a}*x*x+{b}*x+{c + 1}",
        f"{a}*x*x+{b + 1}*x+{c - 1 if c else 0}",
        # agrees at the two example points (1 and 100) only: the hidden points catch it
        f"{a}*x*x+{b}*x+{c}+x*x*x-101*x*x+100*x",
        "",
        "x*",
        "abc",
    ]
    for program in right:
        assert score(task, program).reward == 1.0, program
    for program in wrong:
        assert score(task, program).reward == 0.0, program
    assert task.prompt.startswith("f1=") and ",f100=" in task.prompt and task.prompt.endswith(" f=")
    assert isinstance(DOMAINS["program"], ProgramDomain)
