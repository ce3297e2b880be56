"""The bundled code problems: every family's reference program passes its generated cases in the real sandbox (so
every label is right), a wrong program fails, problems are a pure function of (seed, index), and the recipe that
uses them trains a step end to end on a tiny model."""

import json

import pytest
from miles.core.protocols import DataContext
from miles.core.sample import Sample
from miles.recipes.cli import resolve_config
from miles.recipes.run import run
from miles.rollout.data.code_tasks import FAMILIES, CodeTaskSource, build_source, make_problem
from miles.rollout.rewards.code import code_reward

# A correct program per family, as a model would write it.
SOLUTIONS = {
    "sum_two": "a, b = map(int, input().split())\nprint(a + b)",
    "sum_list": "input()\nprint(sum(map(int, input().split())))",
    "max_list": "input()\nprint(max(map(int, input().split())))",
    "sort_list": "input()\nprint(*sorted(map(int, input().split())))",
    "reverse": "print(input().strip()[::-1])",
    "vowels": "print(sum(c in 'aeiou' for c in input().strip()))",
    "palindrome": "w = input().strip()\nprint('yes' if w == w[::-1] else 'no')",
    "factorial": "import math\nprint(math.factorial(int(input())))",
    "fibonacci": "a, b = 0, 1\nfor _ in range(int(input())):\n    a, b = b, a + b\nprint(a)",
    "fizzbuzz": (
        "for i in range(1, int(input()) + 1):\n"
        "    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)"
    ),
}


def _sample(index, source, response):
    prompt = source.sample_at(index, index)
    return Sample(index=0, group_index=0, prompt=prompt.prompt, label=prompt.label, response_text=response)


def test_every_family_has_a_reference_program_that_passes_its_cases_in_the_sandbox():
    assert sorted(SOLUTIONS) == sorted(f.name for f in FAMILIES)
    source = CodeTaskSource(size=len(FAMILIES), seed=3, num_tests=3)
    for index, family in enumerate(FAMILIES):
        sample = _sample(index, source, f"Here it is:\n```python\n{SOLUTIONS[family.name]}\n```")
        assert code_reward(sample, time_limit_s=10.0) == 1.0, (family.name, sample.metadata)
        assert len(sample.label) == 3 and sample.metadata["reward_reason"] == "passed 3/3 tests"


def test_a_wrong_program_fails_and_the_cases_are_distinct_and_seeded():
    source = CodeTaskSource(size=10, seed=3)
    sample = _sample(0, source, "```python\na, b = map(int, input().split())\nprint(a - b)\n```")
    assert code_reward(sample) == 0.0 and sample.metadata["reward_outcome"] == "failed_tests"
    for index in range(len(FAMILIES)):
        family, cases = make_problem(index, seed=3)
        assert cases == make_problem(index, seed=3)[1] and len({stdin for stdin, _ in cases}) == len(cases)
    assert make_problem(0, seed=3)[1] != make_problem(0, seed=4)[1]
    assert make_problem(0, seed=3, num_tests=5)[1][:1] == make_problem(0, seed=3)[1][:1]  # same draws, more of them
    family, cases = make_problem(1, seed=0)
    assert family.name == "sum_list" and all(sum(map(int, i.split()[1:])) == int(o) for i, o in cases)


def test_the_source_resumes_and_refuses_unknown_options():
    first = CodeTaskSource(size=4, seed=1)
    first.next_prompts(6)  # into the second epoch
    state = json.loads(json.dumps(first.state_dict()))
    again = CodeTaskSource(size=4, seed=1)
    again.load_state_dict(state)
    assert [p.label for p in again.next_prompts(3)] == [p.label for p in first.next_prompts(3)]
    cfg = resolve_config("smollm2_grpo_code", ["--data.task-kwargs", "{num_test: 2}"])
    with pytest.raises(ValueError, match=r"data.task_kwargs \['num_test'\] are not options of the code tasks"):
        build_source(DataContext(data=cfg.data, split="train", seed=1))


def test_the_code_recipe_trains_a_step_on_a_tiny_model(tiny_smollm2_dir, tmp_path):
    cfg = resolve_config(
        "smollm2_grpo_code",
        [
            "--models.policy.path", str(tiny_smollm2_dir),
            "--loop.num-steps", "1",
            "--rollout.rollout-batch-size", "2",
            "--rollout.n-samples-per-prompt", "2",
            "--rollout.sampling.max-new-tokens", "8",
            "--eval.num-prompts", "0",
            "--train.micro-batch-size", "8",
            "--reward.workers", "1",
            "--run.progress", "false",
        ],
    )  # fmt: skip
    assert run(cfg, tmp_path / "run").steps_done == 1
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    # Random tokens are no program: each of the 4 samples scores 0 with a counted outcome, none fails.
    assert row["reward/mean"] == 0.0 and row["samples/failed"] == 0.0
    assert sum(v for k, v in row.items() if k.startswith("reward_outcome/")) == 4.0
