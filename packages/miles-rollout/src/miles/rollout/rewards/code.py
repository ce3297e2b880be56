"""Code-execution reward: run the response's Python program on the sample's test cases in a sandbox.

For ``reward.type code``. The label holds the tests as standard input / expected standard output cases, the
format of competitive-programming sets (APPS, CodeContests, TACO, LiveCodeBench's stdin problems): a list of
``[stdin, expected_stdout]`` pairs, or that list as JSON text (how Parquet/HF datasets often store it)::

    [["1 2\\n", "3\\n"], ["10 -4\\n", "6\\n"]]

Output is compared here, in the trainer, never inside the program's process, so a program cannot fake a pass
(by exiting early, patching ``assert``, returning an object equal to everything): it must print the right text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from miles.core.sample import Sample
from miles.rollout.rewards.sandbox import ProgramRun, run_program

# The last ```python (or ```py, ```python3) fence; an unclosed one (a response cut at max length) runs to the end.
_PYTHON_FENCE = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)

# metadata["reward_outcome"] of a scored code sample: all tests passed, a test's output differed, or the run ended
# with one of the sandbox's outcomes (``miles.rollout.rewards.sandbox.ProgramRun``).
CODE_OUTCOMES = (
    "passed",
    "failed_tests",
    "timeout",
    "memory",
    "output_limit",
    "blocked_network",
    "blocked_process",
    "blocked_filesystem",
    "error",
)


def extract_code(text: str) -> str:
    """The content of the last ```python fenced block of ``text``, else the whole text.

    >>> extract_code("Try:\\n```python\\nprint(1)\\n```\\nor better:\\n```python\\nprint(2)\\n```")
    'print(2)\\n'
    >>> extract_code("print(3)")
    'print(3)'
    """
    blocks = _PYTHON_FENCE.findall(text)
    return blocks[-1] if blocks else text


def parse_test_cases(label: object, *, index: int) -> list[tuple[str, str]]:
    """The ``(stdin, expected_stdout)`` cases of a code sample's label (the module docstring has the format).

    Raises: ValueError naming sample ``index`` for a label that is not a non-empty list of string pairs.
    """
    cases = label
    if isinstance(cases, str):
        try:
            cases = json.loads(cases)
        except json.JSONDecodeError:
            cases = None  # e.g. assert statements: not this format
    ok = isinstance(cases, Sequence) and not isinstance(cases, str) and len(cases) > 0
    ok = ok and all(
        isinstance(case, Sequence) and len(case) == 2 and all(isinstance(x, str) for x in case) for case in cases
    )
    if not ok:
        raise ValueError(
            f"sample {index}: code reward label must be a non-empty list of [stdin, expected_stdout] string pairs "
            f"(or that list as JSON text), got {str(label)[:120]!r}"
        )
    return [(stdin, expected) for stdin, expected in cases]


def outputs_match(stdout: str, expected: str) -> bool:
    """Whether two outputs are equal after trailing whitespace is stripped from every line and trailing blank
    lines are dropped (leading whitespace and blank lines inside count).

    >>> outputs_match("3 \\n\\n", "3"), outputs_match(" 3", "3")
    (True, False)
    """
    return [line.rstrip() for line in stdout.rstrip().splitlines()] == [
        line.rstrip() for line in expected.rstrip().splitlines()
    ]


def code_reward(sample: Sample, *, time_limit_s: float = 5.0, memory_limit_mib: int = 1024) -> float:
    """1.0 if the program passes every test case of the label, else 0.0 (all or nothing).

    The program is ``extract_code(sample.response_text)``; each case runs it once in a fresh sandbox
    (``miles.rollout.rewards.sandbox.run_program``), in order, stopping at the first case that does not pass, so a
    call takes at most ``len(cases) * time_limit_s`` seconds plus ~20 ms per case (``reward.timeout_s``, 60 s by
    default, should stay above that: raise it for many slow cases). No partial credit: a fraction of cases passed
    would reward programs that handle only the easy cases, which is what RL then learns (DeepCoder, Agentica 2025,
    makes the same choice).

    The result is recorded for counting, also when it is 0.0 (a wrong program is a valid score, not a failed
    sample): ``sample.metadata["reward_outcome"]``, one of ``CODE_OUTCOMES``, and ``["reward_reason"]``, one line:
    ``passed 3/3 tests``, ``failed tests``, ``timeout``, ``memory``, ``output limit``,
    ``blocked: network (socket.connect)``, ``blocked: process (os.fork)``, ``blocked: filesystem (...)``,
    ``error: NameError`` (or ``error: exit code 3``, ``error: signal SIGSEGV``), each but the first followed by
    ``on test i of n``.

    Args:
        sample: ``response_text`` holds the program, ``label`` the test cases.
        time_limit_s: wall-clock seconds one case's run may take.
        memory_limit_mib: address space of the program's process (RLIMIT_AS), the interpreter's ~15 MiB included.
    Raises: ValueError for a label that is not test cases (the sample then fails, counted as reward_error);
        OSError if the sandbox cannot be set up.
    """
    cases = parse_test_cases(sample.label, index=sample.index)
    source = extract_code(sample.response_text or "")
    for i, (stdin, expected) in enumerate(cases, start=1):
        run = run_program(source, stdin=stdin, time_limit_s=time_limit_s, memory_limit_mib=memory_limit_mib)
        if run.outcome == "ok" and outputs_match(run.stdout, expected):
            continue
        outcome = "failed_tests" if run.outcome == "ok" else run.outcome
        sample.metadata["reward_outcome"] = outcome
        sample.metadata["reward_reason"] = f"{_reason(outcome, run)} on test {i} of {len(cases)}"
        return 0.0
    sample.metadata["reward_outcome"] = "passed"
    sample.metadata["reward_reason"] = f"passed {len(cases)}/{len(cases)} tests"
    return 1.0


def _reason(outcome: str, run: ProgramRun) -> str:
    if outcome.startswith("blocked_"):
        return f"blocked: {outcome.removeprefix('blocked_')} ({run.detail})"
    if outcome == "error":
        return f"error: {run.detail}"
    return outcome.replace("_", " ")  # failed tests, timeout, memory, output limit
