"""The code-execution reward: a correct program scores 1, a wrong one 0, and one that loops, forks, allocates or
opens a connection scores 0 with its reason, within the time limit, leaving no process and no directory behind."""

import json
import os
import tempfile
import time
from pathlib import Path

import pytest
from miles.core.rewards import outcome_counts, score_samples
from miles.core.sample import Sample, SampleStatus
from miles.recipes.run import build_reward
from miles.rollout.config import RewardConfig
from miles.rollout.rewards import code_reward, extract_code
from miles.rollout.rewards.code import outputs_match, parse_test_cases
from miles.rollout.rewards.sandbox import run_program

ADD = [["1 2\n", "3\n"], ["10 -4\n", "6\n"]]  # a + b
TIME_LIMIT_S = 2.0  # 1 s was too short for `import subprocess` to reach the blocked import while CI shared the cores


def _sample(response: str, label=ADD, index: int = 0) -> Sample:
    return Sample(index=index, group_index=0, prompt="", label=label, response_text=response)


def _fenced(program: str) -> str:
    return f"Here is my solution:\n```python\n{program}\n```\n"


def _children() -> set[int]:
    """Pids whose parent is this process, zombies included."""
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # exited meanwhile
                continue
            if int(stat.rpartition(")")[2].split()[1]) == os.getpid():
                children.add(int(entry.name))
    return children


def _processes_inside(path: Path) -> list[int]:
    """Pids whose working directory is under ``path`` (a removed one reads as '... (deleted)')."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                continue
            if cwd.startswith(str(path)):
                pids.append(int(entry.name))
    return pids


@pytest.fixture
def sandbox_root(tmp_path, monkeypatch):
    """The sandboxes' temporary directories go under tmp_path (tempfile.gettempdir() reads tempfile.tempdir)."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def test_extract_code_takes_the_last_python_fence_else_the_whole_response():
    two = "```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```"
    assert extract_code(two) == "print(2)\n"
    assert extract_code("cut at max length:\n```python\nprint(3)") == "print(3)"
    assert extract_code("print(4)") == "print(4)"


@pytest.mark.parametrize(
    "stdout, expected, match",
    [
        pytest.param("3\n", "3", True, id="trailing_newline"),
        pytest.param("1 2 \n3\n\n\n", "1 2\n3", True, id="trailing_spaces_and_blank_lines"),
        pytest.param(" 3\n", "3\n", False, id="leading_space_counts"),
        pytest.param("1\n\n2\n", "1\n2\n", False, id="inner_blank_line_counts"),
        pytest.param("", "0\n", False, id="no_output"),
    ],
)
def test_outputs_match_ignores_only_trailing_whitespace(stdout, expected, match):
    assert outputs_match(stdout, expected) is match


def test_test_cases_are_string_pairs_or_their_json_text():
    assert parse_test_cases(ADD, index=0) == [("1 2\n", "3\n"), ("10 -4\n", "6\n")]
    assert parse_test_cases(json.dumps(ADD), index=0) == [("1 2\n", "3\n"), ("10 -4\n", "6\n")]
    for bad in ([], "assert f(1) == 2", [["only stdin"]], [[1, 2]], None):
        with pytest.raises(ValueError, match="sample 7: code reward label"):
            parse_test_cases(bad, index=7)


def test_a_correct_program_scores_1_and_a_wrong_one_0_with_the_failing_test(sandbox_root):
    right = _sample(_fenced("a, b = map(int, input().split())\nprint(a + b)"))
    assert code_reward(right, time_limit_s=TIME_LIMIT_S) == 1.0
    assert right.metadata == {"reward_outcome": "passed", "reward_reason": "passed 2/2 tests"}
    # |a| + |b|: 1 + 2 = 3 passes test 1; 10 + 4 = 14 != 6 fails test 2.
    wrong = _sample(_fenced("a, b = map(int, input().split())\nprint(abs(a) + abs(b))"))
    assert code_reward(wrong, time_limit_s=TIME_LIMIT_S) == 0.0
    assert wrong.metadata == {"reward_outcome": "failed_tests", "reward_reason": "failed tests on test 2 of 2"}
    assert list(sandbox_root.iterdir()) == []


@pytest.mark.parametrize(
    "program, outcome, reason",
    [
        pytest.param("while True:\n    pass", "timeout", "timeout on test 1 of 2", id="infinite_loop"),
        pytest.param(
            "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass",
            "blocked_process",
            "blocked: process (os.fork) on test 1 of 2",
            id="fork_bomb",
        ),
        pytest.param("block = bytearray(2 * 2**30)", "memory", "memory on test 1 of 2", id="large_allocation"),
        pytest.param(
            "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 80), timeout=1)\nexcept OSError:\n"
            "    pass\nprint(3)",
            "blocked_network",
            "blocked: network (socket.getaddrinfo) on test 1 of 2",
            id="network_call",
        ),
        pytest.param(
            "import subprocess\nsubprocess.run(['sleep', '30'])",
            "blocked_process",
            "blocked: process (import _posixsubprocess) on test 1 of 2",
            id="subprocess",
        ),
        pytest.param(
            "open('/tmp/miles-sandbox-escape.txt', 'w').write('x')",
            "blocked_filesystem",
            "blocked: filesystem (open for writing '/tmp/miles-sandbox-escape.txt') on test 1 of 2",
            id="write_outside_its_directory",
        ),
        pytest.param("print(a + b)", "error", "error: NameError on test 1 of 2", id="exception"),
        pytest.param("def solve(:", "error", "error: SyntaxError on test 1 of 2", id="syntax_error"),
        pytest.param("import sys\nsys.exit(3)", "error", "error: exit code 3 on test 1 of 2", id="exit_code"),
    ],
)
def test_a_harmful_or_broken_program_scores_0_with_its_reason_in_time_and_leaves_nothing_behind(
    sandbox_root, program, outcome, reason
):
    children_before = _children()
    sample = _sample(_fenced(program))
    t0 = time.perf_counter()
    assert code_reward(sample, time_limit_s=TIME_LIMIT_S, memory_limit_mib=256) == 0.0
    assert time.perf_counter() - t0 < TIME_LIMIT_S + 1.0  # stops at the first case: one time limit at most
    assert sample.metadata == {"reward_outcome": outcome, "reward_reason": reason}
    assert list(sandbox_root.iterdir()) == []  # the temporary directory is gone
    assert _children() <= children_before  # no process left, not even a zombie
    assert _processes_inside(sandbox_root) == []
    assert not Path("/tmp/miles-sandbox-escape.txt").exists()


def test_a_program_may_write_in_its_own_directory_and_use_threads(sandbox_root):
    program = (
        "import threading\nopen('scratch.txt', 'w').write(input())\nresult = []\n"
        "worker = threading.Thread(target=lambda: result.append(sum(map(int, open('scratch.txt').read().split()))))\n"
        "worker.start()\nworker.join()\nprint(result[0])"
    )
    sample = _sample(_fenced(program))
    assert code_reward(sample, time_limit_s=TIME_LIMIT_S) == 1.0, sample.metadata
    assert list(sandbox_root.iterdir()) == []


def test_output_past_the_limit_ends_the_run(sandbox_root):
    run = run_program(
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", time_limit_s=5.0, memory_limit_mib=256
    )
    assert run.outcome == "output_limit" and run.seconds < 5.0


def test_a_label_that_is_not_test_cases_fails_the_sample_as_a_reward_error():
    samples = [_sample("print(3)", label="assert add(1, 2) == 3")]
    samples[0].status = SampleStatus.COMPLETED
    assert score_samples(samples, code_reward) == 1
    assert samples[0].metadata["failure_kind"] == "reward_error"
    assert "code reward label must be a non-empty list" in samples[0].metadata["failure"]


def test_reward_type_code_in_worker_processes_brings_the_outcomes_back_for_counting():
    reward_fn = build_reward(RewardConfig(type="code", workers=1, code={"time_limit_s": TIME_LIMIT_S}))
    try:
        programs = ["a, b = map(int, input().split())\nprint(a + b)", "print(3)", "import os\nos.fork()"]
        samples = [_sample(_fenced(p), index=i) for i, p in enumerate(programs)]
        for sample in samples:
            sample.status = SampleStatus.COMPLETED
        assert score_samples(samples, reward_fn) == 0
    finally:
        reward_fn.close()
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0]
    assert [s.metadata["reward_reason"] for s in samples] == [
        "passed 2/2 tests",
        "failed tests on test 2 of 2",  # prints 3 whatever the input: right for 1 2 only
        "blocked: process (os.fork) on test 1 of 2",
    ]
    assert outcome_counts(samples) == {
        "reward_outcome/passed": 1.0,
        "reward_outcome/failed_tests": 1.0,
        "reward_outcome/blocked_process": 1.0,
    }


def test_a_code_setting_with_another_reward_type_is_a_one_line_error_naming_the_key():
    with pytest.raises(
        ValueError, match=r"reward.code.time_limit_s is 2.0 but reward.type is 'math'.*--reward.type code"
    ):
        RewardConfig(type="math", code={"time_limit_s": 2.0})
    assert RewardConfig(type="code", code={"time_limit_s": 2.0}).code.time_limit_s == 2.0
