"""Every algorithm family's shipped recipe runs 2 steps end to end on a tiny random Llama with the SmolLM2
tokenizer (hidden 32, 2 layers), and each config refuses a group baseline with one sample per prompt."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from miles.recipes.cli import resolve_config
from miles.recipes.run import run

# ~8 s each on 2 shared cores: the families with their own backend paths (critic, teacher, SFT data) run by
# default; the loss/estimator variants of the default path run in the slow CI step.
_SLOW = pytest.mark.slow
FAMILIES = [
    pytest.param("smollm2_grpo_arithmetic", marks=_SLOW),
    pytest.param("smollm2_dr_grpo_arithmetic", marks=_SLOW),
    pytest.param("smollm2_gspo_arithmetic", marks=_SLOW),
    "smollm2_dapo_arithmetic",
    "smollm2_ppo_arithmetic",
    pytest.param("smollm2_reinforce_pp_arithmetic", marks=_SLOW),
    "smollm2_opd_arithmetic",
    "smollm2_sft_arithmetic",
]


@pytest.fixture(scope="module")
def tiny_smollm2_dirs(tiny_smollm2_dir, make_tiny_smollm2):
    return tiny_smollm2_dir, make_tiny_smollm2(1)  # student, teacher


@pytest.mark.parametrize("recipe", FAMILIES)
def test_each_algorithm_recipe_trains_two_steps_on_a_tiny_model(recipe, tiny_smollm2_dirs, tmp_path):
    student, teacher = tiny_smollm2_dirs
    overrides = [
        "--models.policy.path", str(student),
        "--data.size", "64",
        "--loop.num-steps", "2",
        "--rollout.rollout-batch-size", "2",
        "--rollout.sampling.max-new-tokens", "6",
        "--eval.num-prompts", "2",
        "--eval.n-samples-per-prompt", "1",
        "--eval.sampling.max-new-tokens", "6",
        "--train.micro-batch-size", "8",
        "--run.progress", "false",
    ]  # fmt: skip
    if recipe != "smollm2_sft_arithmetic":
        overrides += ["--rollout.n-samples-per-prompt", "4"]
    if recipe == "smollm2_opd_arithmetic":
        overrides += ["--models.teacher.path", str(teacher)]
    if recipe == "smollm2_dapo_arithmetic":
        # A random model scores 0 on every group, so dynamic sampling would (correctly) give up; it is covered by
        # tests/core/test_loop_algorithms.py. The rest of DAPO runs here.
        overrides += ["--algorithm.dynamic-sampling", "null", "--algorithm.overlong.buffer-len", "3"]
    cfg = resolve_config(recipe, overrides)
    run(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    for row in train_rows:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]), row
    if recipe == "smollm2_ppo_arithmetic":
        assert all(math.isfinite(r["loss/value"]) and r["loss/value"] > 0 for r in train_rows)
    if recipe == "smollm2_opd_arithmetic":  # a different teacher: per-token advantages are not all 0
        assert any(r["grad_norm"] > 0 for r in train_rows)
    if recipe == "smollm2_sft_arithmetic":  # NLL of a random 49k-vocab model: about ln(49152) = 10.8
        assert all(r["loss"] > 5.0 for r in train_rows)
        # Eval generates (regression: it scored the reference answers, ~3 tokens, with the SFT rollout): the random
        # model runs to eval's max_new_tokens (a stop token is ~2 in 49k per token).
        assert [r["eval/response_length"] for r in rows if "eval/response_length" in r] == [6.0, 6.0]
    if recipe == "smollm2_dapo_arithmetic":
        for r in train_rows:
            assert "tis_clipfrac" in r and 0.0 < r.get("ess_ratio", -1) <= 1.0, r


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_a_group_baseline_with_one_sample_per_prompt_is_refused_before_training(estimator):
    overrides = ["--algorithm.advantage.estimator", estimator, "--rollout.n-samples-per-prompt", "1"]
    with pytest.raises(ValueError, match=f"rollout.n_samples_per_prompt is 1, but advantage '{estimator}' needs"):
        resolve_config("smollm2_grpo_arithmetic", overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        pytest.param(["--algorithm.advantage.estimator", "opd"], "models.teacher is off", id="opd_without_teacher"),
        pytest.param(
            ["--algorithm.advantage.estimator", "opd", "--models.teacher.path", "smollm2-135m-instruct"],
            "models.teacher.path is 'smollm2-135m-instruct', the policy itself",
            id="opd_teacher_is_the_policy",
        ),
        pytest.param(["--algorithm.loss.dual-clip-c", "0.5"], "needs c > 1", id="dual_clip_below_one"),
        pytest.param(["--rollout.mode", "sft"], "supervised fine-tuning needs both", id="sft_mode_with_ppo_loss"),
        pytest.param(["--algorithm.overlong.buffer-len", "100"], "penalty ramp must fit", id="buffer_too_long"),
        pytest.param(
            [
                "--algorithm.dynamic-sampling.max-rounds",
                "3",
                "--rollout.n-samples-per-prompt",
                "1",
                "--algorithm.advantage.estimator",
                "reinforce_plus_plus",
            ],
            "every group would be filtered",
            id="dynamic_sampling_with_groups_of_one",
        ),  # fmt: skip
        pytest.param(
            ["--rollout.mode", "sft", "--algorithm.loss.policy-loss", "sft"],
            r"rollout.n_samples_per_prompt is 8 with algorithm.loss.policy_loss 'sft': .* 8 identical copies",
            id="sft_with_groups_of_eight",
        ),
        pytest.param(
            ["--algorithm.loss.policy-loss", "sft"],
            r"8 identical copies .* Set --rollout.n-samples-per-prompt 1 --rollout.mode sft \(",
            id="sft_loss_alone_names_both_fixes",
        ),
        pytest.param(["--models.critic.path", "x"], "never reads critic values", id="critic_without_gae"),
        pytest.param(
            ["--algorithm.advantage.estimator", "gae"],
            "trains a critic, but models.critic is off",
            id="gae_without_critic",
        ),
    ],
)
def test_algorithm_combinations_that_would_do_nothing_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_config("smollm2_grpo_arithmetic", overrides)


TEACHER_FIX = (
    "Set --models.teacher.path to a stronger model with the policy's tokenizer (an HF model directory: a larger "
    "model of the policy's family, or the policy after RL training, e.g. runs/NAME/checkpoints/step_N/model).\n"
)


@pytest.mark.parametrize(
    "teacher, policy, reason",
    [
        pytest.param(
            None,
            None,
            "algorithm.advantage.estimator is 'opd' but models.teacher is off: on-policy distillation needs a "
            "teacher's log-probs.",
            id="as_shipped_without_teacher",
        ),
        pytest.param(
            "smollm2-135m-instruct",
            None,
            "models.teacher.path is 'smollm2-135m-instruct', the policy itself (models.policy.path "
            "'smollm2-135m-instruct'): on-policy distillation from the policy has advantage teacher_log_prob - "
            "log_prob = 0 at every token, so the loss, the gradient and the update are 0.",
            id="teacher_is_the_registered_policy",
        ),
        pytest.param(
            "/models/student/",
            "/models/../models/student",
            "models.teacher.path is '/models/student/', the policy itself (models.policy.path "
            "'/models/../models/student'): on-policy distillation from the policy has advantage teacher_log_prob - "
            "log_prob = 0 at every token, so the loss, the gradient and the update are 0.",
            id="teacher_is_the_policy_directory_spelled_otherwise",
        ),
    ],
)
def test_the_opd_recipe_refuses_to_start_without_a_teacher_other_than_the_policy(teacher, policy, reason, tmp_path):
    """`miles train --recipe smollm2_opd_arithmetic` as shipped learned nothing: its teacher was the policy."""
    flags = ["--models.teacher.path", teacher] if teacher else []
    flags += ["--models.policy.path", policy] if policy else []
    miles = Path(sys.executable).parent / "miles"  # the console script a user runs
    done = subprocess.run(
        [str(miles), "train", "--recipe", "smollm2_opd_arithmetic", *flags, "--run.dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr == f"miles: invalid configuration: {reason} {TEACHER_FIX}"
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
