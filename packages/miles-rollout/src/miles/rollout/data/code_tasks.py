"""Bundled programming problems for code-execution RL (``reward.type code``), generated offline from a seed.

Each problem is a short stdin -> stdout task from one of ``FAMILIES`` (sum two integers, reverse a string, FizzBuzz,
...). Its statement is fixed per family; its test cases (``[stdin, expected_stdout]`` pairs, the label format of
``miles.rollout.rewards.code``) are drawn per problem and answered by the family's reference solution, so every
label is correct by construction. Problem ``i`` of a source is a pure function of (seed, i): the shuffled,
resumable order of ``EpochShuffledSource`` is all a checkpoint needs.

Use it as the ``data.source_path`` factory ``miles.rollout.data.code_tasks:build_source`` (recipe
``smollm2_grpo_code``); ``data.task_kwargs.num_tests`` sets the cases per problem (default 3).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.core.sample import Sample
from miles.rollout.data.epoch import EpochShuffledSource, make_messages


@dataclass(frozen=True)
class CodeFamily:
    """One kind of problem: its statement, a random input, and the reference answer to an input."""

    name: str
    statement: str
    make_input: Callable[[random.Random], str]
    solve: Callable[[str], str]


def _ints(line: str) -> list[int]:
    return [int(x) for x in line.split()]


def _int_list(rng: random.Random) -> str:
    values = [rng.randint(-50, 50) for _ in range(rng.randint(1, 8))]
    return f"{len(values)}\n{' '.join(map(str, values))}\n"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeiloprstu") for _ in range(rng.randint(1, 10)))


def _maybe_palindrome(rng: random.Random) -> str:
    """A word, made a palindrome (of odd or even length) half of the time."""
    word = _word(rng)
    if rng.random() < 0.5:
        word += word[::-1][rng.randint(0, 1) :]
    return word + "\n"


def _fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _fizzbuzz(n: int) -> str:
    words = {0: "FizzBuzz", 3: "Fizz", 5: "Buzz", 6: "Fizz", 9: "Fizz", 10: "Buzz", 12: "Fizz"}
    return "\n".join(words.get(i % 15, str(i)) for i in range(1, n + 1))


FAMILIES: tuple[CodeFamily, ...] = (
    CodeFamily(
        "sum_two",
        "Read two integers a and b from one line of standard input and print a + b.",
        lambda rng: f"{rng.randint(-1000, 1000)} {rng.randint(-1000, 1000)}\n",
        lambda s: str(sum(_ints(s))),
    ),
    CodeFamily(
        "sum_list",
        "The first line of standard input holds n, the second n integers. Print their sum.",
        _int_list,
        lambda s: str(sum(_ints(s.splitlines()[1]))),
    ),
    CodeFamily(
        "max_list",
        "The first line of standard input holds n, the second n integers. Print the largest of them.",
        _int_list,
        lambda s: str(max(_ints(s.splitlines()[1]))),
    ),
    CodeFamily(
        "sort_list",
        "The first line of standard input holds n, the second n integers. Print them in increasing order on one "
        "line, separated by single spaces.",
        _int_list,
        lambda s: " ".join(map(str, sorted(_ints(s.splitlines()[1])))),
    ),
    CodeFamily(
        "reverse",
        "Read one word from standard input and print it reversed.",
        lambda rng: _word(rng) + "\n",
        lambda s: s.strip()[::-1],
    ),
    CodeFamily(
        "vowels",
        "Read one lowercase word from standard input and print how many of its letters are vowels (a, e, i, o, u).",
        lambda rng: _word(rng) + "\n",
        lambda s: str(sum(c in "aeiou" for c in s.strip())),
    ),
    CodeFamily(
        "palindrome",
        "Read one word from standard input. Print yes if it reads the same backwards, else no.",
        _maybe_palindrome,
        lambda s: "yes" if s.strip() == s.strip()[::-1] else "no",
    ),
    CodeFamily(
        "factorial",
        "Read an integer n (0 <= n <= 12) from standard input and print n! (the product 1 * 2 * ... * n; 0! = 1).",
        lambda rng: f"{rng.randint(0, 12)}\n",
        lambda s: str(math.factorial(int(s))),
    ),
    CodeFamily(
        "fibonacci",
        "Read an integer n (0 <= n <= 40) from standard input and print the n-th Fibonacci number (F0 = 0, F1 = 1, "
        "F(n) = F(n-1) + F(n-2)).",
        lambda rng: f"{rng.randint(0, 40)}\n",
        lambda s: str(_fibonacci(int(s))),
    ),
    CodeFamily(
        "fizzbuzz",
        "Read an integer n (1 <= n <= 30) from standard input. For i = 1 .. n print one line: FizzBuzz if i is a "
        "multiple of 15, Fizz if of 3, Buzz if of 5, else i.",
        lambda rng: f"{rng.randint(1, 30)}\n",
        lambda s: _fizzbuzz(int(s)),
    ),
)

INSTRUCTION = " Write a complete Python program. Reply with only the code, in a ```python block."


def make_problem(index: int, *, seed: int, num_tests: int = 3) -> tuple[CodeFamily, list[list[str]]]:
    """Problem ``index`` of ``seed``: its family (``index`` mod the number of families) and ``num_tests`` distinct
    ``[stdin, expected_stdout]`` cases (fewer when the family has fewer distinct inputs)."""
    family = FAMILIES[index % len(FAMILIES)]
    rng = random.Random(seed * 1_000_003 + index)
    inputs: list[str] = []
    for _ in range(50 * num_tests):  # distinct inputs; a family with few (factorial) may give fewer
        if len(inputs) == num_tests:
            break
        candidate = family.make_input(rng)
        if candidate not in inputs:
            inputs.append(candidate)
    return family, [[stdin, family.solve(stdin) + "\n"] for stdin in inputs]


class CodeTaskSource(EpochShuffledSource):
    """``DataSource`` over ``size`` bundled problems (``make_problem``), reshuffled every epoch.

    The label is the problem's test cases (``reward.type code``); metadata holds ``family`` and ``data_index``.
    """

    def __init__(
        self,
        *,
        size: int,
        seed: int,
        num_tests: int = 3,
        system_prompt: str | None = None,
        prompt_suffix: str = "",
    ) -> None:
        if num_tests < 1:
            raise ValueError(f"data.task_kwargs.num_tests is {num_tests}; it must be >= 1")
        self.size, self.seed, self.num_tests = size, seed, num_tests
        self.system_prompt, self.prompt_suffix = system_prompt, prompt_suffix
        self._start()

    def sample_at(self, index: int, group_index: int) -> Sample:
        family, cases = make_problem(index, seed=self.seed, num_tests=self.num_tests)
        return Sample(
            index=group_index,
            group_index=group_index,
            prompt=make_messages(
                family.statement + INSTRUCTION, system_prompt=self.system_prompt, prompt_suffix=self.prompt_suffix
            ),
            label=cases,
            metadata={"data_index": index, "family": family.name},
        )


def build_source(context: Any) -> CodeTaskSource:
    """``data.source_path`` factory (``miles.core.protocols.DataContext``): ``data.size`` problems of the split's
    seed; ``data.task_kwargs`` may set ``num_tests``.

    Raises: ValueError naming ``data.task_kwargs`` for another key.
    """
    data = context.data
    unknown = sorted(set(data.task_kwargs) - {"num_tests"})
    if unknown:
        raise ValueError(f"data.task_kwargs {unknown} are not options of the code tasks; only num_tests is")
    return CodeTaskSource(
        size=data.size,
        seed=context.seed,
        num_tests=int(data.task_kwargs.get("num_tests", 3)),
        system_prompt=data.system_prompt or None,
        prompt_suffix=data.prompt_suffix,
    )
