"""Task domains with verifiable rewards, and the character tokenizer one model shares across them.

    from rollbook.tasks import DOMAINS, TOKENIZER, make_tasks, score
    tasks = make_tasks(DOMAINS["arithmetic"], "train", num_tasks=256, seed=0)
    prompt_ids = TOKENIZER.encode(tasks[0].prompt, add_bos=True)      # "<bos>12+34="
    outcome = score(tasks[0], TOKENIZER.decode(output_token_ids))      # RewardOutcome(status="ok", reward=1.0)

Domains (the ``domain`` tag travels with every trajectory):
- ``arithmetic``: ``"12+34="`` -> ``"46"`` (two operands of up to ``num_digits`` digits).
- ``reverse``: ``"rev:abcd="`` -> ``"dcba"``.

Two domains that generalize, mirroring math and code (``rollbook run --config configs/demo.toml``):
- ``addition`` (math): ``"74+51="`` -> ``"260"`` (47 + 15 = 62): zero-padded ``num_digits``-digit
  operands and their sum all written least-significant digit first, the format small transformers
  learn as a procedure (digit by digit with a carry) rather than as a table of facts;
  held-out problems are operand pairs never trained on.
- ``program`` (code): ``"f1=15,f100=30705 f="`` -> ``"3*x*x+07*x+05"``, a program in a tiny
  expression language (integers, ``x``, ``+ - *``) that reproduces the examples; it is run by an
  in-process interpreter (``run_program``) on the examples and on hidden points, so every equivalent
  program (``"3*x*x+7*x+5"``, ``"x*x*3+5+7*x"``) is right. Held-out problems are coefficient combinations never trained on.

A model answers with the answer's characters followed by ``<eos>`` (pass ``TOKENIZER.eos_token_id``
as a stop token). Splits are disjoint by construction: a problem belongs to ``heldout`` or ``train``
by a stable hash of its prompt, whatever the seed, so no seed or size can leak an evaluation problem
into training. A verifier that raises is an ``error`` outcome, counted apart and never a 0.0 reward.
``CharTokenizer`` lives in ``rollbook/tokenizers.py`` (one implementation of the ``Tokenizer``
interface) and is re-exported here.
"""

from __future__ import annotations

import hashlib
import random
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from rollbook.tokenizers import BOS, EOS, PAD, CharTokenizer  # noqa: F401  (re-exported: existing imports keep working)

Split = Literal["train", "heldout"]
HELDOUT_BUCKETS = 10  # one problem in this many (by prompt hash) is held out

TOKENIZER = CharTokenizer(string.digits + string.ascii_lowercase + "+-*=:;,.?! ")


@dataclass(frozen=True)
class Task:
    """One problem. ``task_id`` is stable: the same prompt always has the same id."""

    task_id: str
    domain: str
    prompt: str
    answer: str


@dataclass(frozen=True)
class RewardOutcome:
    """``status="ok"``: ``reward`` is a float. ``status="error"``: the verifier raised, ``reward`` is None
    and ``error`` says why; such a sample has no reward and must not train as a 0.0."""

    status: Literal["ok", "error"]
    reward: float | None
    error: str = ""


class TaskDomain(Protocol):
    """A family of problems with a verifier."""

    @property
    def name(self) -> str:  # read-only, so frozen dataclasses satisfy it
        ...

    def sample(self, rng: random.Random) -> tuple[str, str]:
        """One random ``(prompt, answer)``."""
        ...

    def verify(self, task: Task, completion: str) -> float:
        """The reward of ``completion`` (decoded text, no special tokens): 1.0 correct, 0.0 wrong."""
        ...


@dataclass(frozen=True)
class ArithmeticDomain:
    """Addition of two non-negative integers below ``10**num_digits``."""

    num_digits: int = 2
    name: str = "arithmetic"

    def sample(self, rng: random.Random) -> tuple[str, str]:
        a, b = (rng.randrange(10**self.num_digits) for _ in range(2))
        return f"{a}+{b}=", str(a + b)

    def verify(self, task: Task, completion: str) -> float:
        return float(completion.strip() == task.answer)


@dataclass(frozen=True)
class ReverseDomain:
    """Reverse a lowercase string of ``min_len`` to ``max_len`` letters from ``alphabet``."""

    min_len: int = 3
    max_len: int = 6
    alphabet: str = "abcdefghij"
    per_char: bool = False
    name: str = "reverse"

    def sample(self, rng: random.Random) -> tuple[str, str]:
        text = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))
        return f"rev:{text}=", text[::-1]

    def verify(self, task: Task, completion: str) -> float:
        """1.0 for the exact reversal; with ``per_char``, the fraction of positions right (over the
        longer of answer and completion, so extra or missing characters cost): a graded reward,
        like a fraction of tests passed."""
        got = completion.strip()
        if not self.per_char:
            return float(got == task.answer)
        width = max(len(got), len(task.answer))
        return sum(a == b for a, b in zip(got, task.answer)) / width if width else 1.0


@dataclass(frozen=True)
class AdditionDomain:
    """Math: ``a+b`` of two ``num_digits``-digit operands, answered with the ``num_digits + 1`` digits
    of the sum; every number zero-padded and written least-significant digit first (``"74+51="`` is
    47 + 15, answer ``"260"`` is 62). In the order the carry flows, digit i of the answer needs
    digits i (and the carry from i - 1) of the operands, at a fixed distance back in the sequence,
    so a small model learns the procedure and solves operand pairs it never saw."""

    num_digits: int = 2
    name: str = "addition"

    def sample(self, rng: random.Random) -> tuple[str, str]:
        a, b = (rng.randrange(10**self.num_digits) for _ in range(2))
        width = self.num_digits
        return f"{a:0{width}d}"[::-1] + "+" + f"{b:0{width}d}"[::-1] + "=", f"{a + b:0{width + 1}d}"[::-1]

    def verify(self, task: Task, completion: str) -> float:
        return float(completion.strip() == task.answer)


@dataclass(frozen=True)
class MultiplyDomain:
    """``what is 37 times 8?``: the product of two integers from 2 to ``max_operand``. Too hard for a
    tiny model to compute, trivial with a calculator: the problems of the online mode's ``calculator``
    game (docs/online.md), where the agent offers a ``mul`` tool and the model should call it."""

    max_operand: int = 99
    name: str = "multiply"

    def sample(self, rng: random.Random) -> tuple[str, str]:
        a, b = (rng.randint(2, self.max_operand) for _ in range(2))
        return f"what is {a} times {b}?", str(a * b)

    def verify(self, task: Task, completion: str) -> float:
        return float(completion.strip() == task.answer)


class ProgramError(ValueError):
    """A program that does not parse in the tiny expression language (or is too long)."""


MAX_PROGRAM_CHARS = 40
MAX_PROGRAM_NUMBER = 10**6


def run_program(program: str, x: int) -> int:
    """Evaluate ``program`` at ``x``: the grammar is ``expr := term (('+'|'-') term)*``,
    ``term := factor ('*' factor)*``, ``factor := INTEGER | 'x'`` (no spaces, no parentheses; integers
    below ``MAX_PROGRAM_NUMBER``). Raises ``ProgramError`` when it does not parse."""
    if not program or len(program) > MAX_PROGRAM_CHARS:
        raise ProgramError(f"program length {len(program)} outside 1..{MAX_PROGRAM_CHARS}")
    total, sign, pos = 0, 1, 0
    while True:
        product = 1
        while True:  # a term: factors joined by '*'
            if pos < len(program) and program[pos] == "x":
                factor, pos = x, pos + 1
            else:
                end = pos
                while end < len(program) and program[end].isdigit():
                    end += 1
                if end == pos:
                    raise ProgramError(f"expected a number or x at {pos} in {program!r}")
                factor = int(program[pos:end])
                if factor >= MAX_PROGRAM_NUMBER:
                    raise ProgramError(f"number {program[pos:end]} too large in {program!r}")
                pos = end
            product *= factor
            if pos < len(program) and program[pos] == "*":
                pos += 1
                continue
            break
        total += sign * product
        if pos == len(program):
            return total
        if program[pos] not in "+-":
            raise ProgramError(f"unexpected {program[pos]!r} at {pos} in {program!r}")
        sign = 1 if program[pos] == "+" else -1
        pos += 1


@dataclass(frozen=True)
class ProgramDomain:
    """Code: write ``f`` as a program, given its values at 1 and 100, where ``f(x) = a*x*x + b*x + c``
    with ``a`` in 1-9 and ``b``, ``c`` in 0-99 (90,000 programs; at x = 100 the coefficients stand
    side by side in the digits, so a model that learned to read them writes programs it never saw).
    A completion is run by ``run_program`` on the example points and on ``hidden_points``: 1.0 when
    it gives the right value at all of them, 0.0 when it does not (or does not parse). The reference
    answer writes ``b`` and ``c`` with two digits (``"3*x*x+07*x+05"``); any equivalent program is
    accepted."""

    hidden_points: tuple[int, ...] = (0, 2, 3, 5, 7, 11, 13)
    name: str = "program"

    def sample(self, rng: random.Random) -> tuple[str, str]:
        a, b, c = rng.randrange(1, 10), rng.randrange(100), rng.randrange(100)
        f = lambda x: a * x * x + b * x + c  # noqa: E731
        return f"f1={f(1)},f100={f(100)} f=", f"{a}*x*x+{b:02d}*x+{c:02d}"

    def verify(self, task: Task, completion: str) -> float:
        points = (1, 100, *self.hidden_points)
        try:
            got = [run_program(completion.strip(), x) for x in points]
        except ProgramError:
            return 0.0
        return float(got == [run_program(task.answer, x) for x in points])


DOMAINS: dict[str, TaskDomain] = {
    d.name: d for d in (ArithmeticDomain(), ReverseDomain(), AdditionDomain(), ProgramDomain(), MultiplyDomain())
}


def build_domains(config) -> dict[str, TaskDomain]:
    """The domains a ``RolloutConfig`` names (``domains``), shaped by its ``num_digits`` and
    ``reverse_max_len``; the rollout worker samples them, the trainer's warm start trains on them."""
    made: dict[str, TaskDomain] = {
        "arithmetic": ArithmeticDomain(num_digits=config.num_digits),
        "reverse": ReverseDomain(
            min_len=1, max_len=config.reverse_max_len, alphabet="abcde", per_char=getattr(config, "reverse_per_char", False)
        ),
    }
    unknown = sorted(set(config.domains) - made.keys() - DOMAINS.keys())
    if unknown:
        raise ValueError(f"unknown domains {unknown}; known: {sorted(made.keys() | DOMAINS.keys())}")
    return {name: made[name] if name in made else DOMAINS[name] for name in config.domains}


def split_of(prompt: str) -> Split:
    """The split a prompt belongs to, from a stable hash (independent of seeds and process)."""
    bucket = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big") % HELDOUT_BUCKETS
    return "heldout" if bucket == 0 else "train"


def make_tasks(domain: TaskDomain, split: Split, num_tasks: int, seed: int, *, allow_fewer: bool = False) -> list[Task]:
    """``num_tasks`` distinct problems of ``split``, drawn deterministically from ``seed``; with
    ``allow_fewer``, a small domain returns all the problems it found instead of raising."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"{domain.name}/{seed}")
    tasks: dict[str, Task] = {}
    for _ in range(100 * num_tasks + 1000):
        if len(tasks) == num_tasks:
            return list(tasks.values())
        prompt, answer = domain.sample(rng)
        if prompt not in tasks and split_of(prompt) == split:
            task_id = f"{domain.name}/{hashlib.blake2b(prompt.encode(), digest_size=6).hexdigest()}"
            tasks[prompt] = Task(task_id=task_id, domain=domain.name, prompt=prompt, answer=answer)
    if allow_fewer and tasks:
        return list(tasks.values())
    raise ValueError(f"domain {domain.name!r} has fewer than {num_tasks} distinct {split} problems; lower num_tasks")


def score(task: Task, completion: str, domains: Mapping[str, TaskDomain] = DOMAINS) -> RewardOutcome:
    """Run the task's verifier; a verifier that raises gives an ``error`` outcome, not a reward."""
    if task.domain not in domains:
        raise ValueError(f"unknown domain {task.domain!r}; known: {sorted(domains)}")
    try:
        reward = float(domains[task.domain].verify(task, completion))
    except Exception as exc:  # a crashed verifier is not a wrong answer
        return RewardOutcome(status="error", reward=None, error=f"{type(exc).__name__}: {exc}")
    return RewardOutcome(status="ok", reward=reward)


@dataclass
class RewardTally:
    """Counts outcomes; the mean reward is over ``ok`` outcomes only."""

    num_ok: int = 0
    num_error: int = 0
    reward_sum: float = 0.0

    def add(self, outcome: RewardOutcome) -> None:
        if outcome.status == "ok":
            self.num_ok += 1
            self.reward_sum += outcome.reward  # type: ignore[operator]
        else:
            self.num_error += 1

    def metrics(self) -> dict[str, float]:
        mean = self.reward_sum / self.num_ok if self.num_ok else float("nan")
        return {"reward/num_ok": self.num_ok, "reward/num_error": self.num_error, "reward/mean": mean}
