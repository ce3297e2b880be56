"""`models.<model>.trust_remote_code` in a run: a checkpoint whose tokenizer is its own code (``remote_tokenizer_dir``,
as Kimi K2's) is refused in one `miles:` line naming the setting (exit 2, nothing written) unless it is on, and with
it on a run trains on it; the launch plan's servers carry --trust-remote-code from it."""

import json

import pytest
from miles.core.config import ModelsConfig
from miles.recipes.cli import main, resolve_config
from miles.recipes.plan import launch_plan
from miles.recipes.run import RunSetupError, algorithm_models, build_inputs, run
from tiny_runs import TINY_RUN_PATH, tiny_run

RECIPE = "smollm2_grpo_arithmetic"


def _args(model_dir, tmp_path, *extra):
    return ["--models.policy.path", str(model_dir), "--run.dir", str(tmp_path / "runs"), "--run.name", "r", *extra]


def test_an_untrusted_checkpoint_with_its_own_tokenizer_fails_at_build_naming_the_setting(
    remote_tokenizer_dir, tmp_path
):
    cfg = resolve_config(RECIPE, _args(remote_tokenizer_dir, tmp_path))  # validating reads no file
    with pytest.raises(RunSetupError) as err:
        build_inputs(cfg)
    assert str(err.value) == (
        f"models.policy.path {remote_tokenizer_dir} ships its own code (auto_map in tokenizer_config.json), which "
        "runs only when trusted: set models.policy.trust_remote_code: true (--models.policy.trust-remote-code true) "
        "if you trust that checkpoint's files (its Python runs with this run's permissions)"
    )
    trusted = resolve_config(RECIPE, _args(remote_tokenizer_dir, tmp_path, "--models.policy.trust-remote-code", "true"))
    build_inputs(trusted)  # passes


def test_a_reference_of_its_own_code_names_its_own_setting(remote_tokenizer_dir, tiny_smollm2_dir, tmp_path):
    extra = ["--algorithm.kl.coef", "0.01", "--models.reference.path", str(remote_tokenizer_dir)]
    cfg = resolve_config(RECIPE, _args(tiny_smollm2_dir, tmp_path, "--models.policy.trust-remote-code", "true", *extra))
    with pytest.raises(RunSetupError, match=r"^models\.reference\.path .* set models\.reference\.trust_remote_code"):
        build_inputs(cfg)


def test_miles_train_of_an_untrusted_checkpoint_is_one_line_exit_2_and_writes_nothing(
    remote_tokenizer_dir, tmp_path, capsys
):
    assert main(["train", "--recipe", RECIPE, *_args(remote_tokenizer_dir, tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"miles: models.policy.path {remote_tokenizer_dir} ships its own")
    assert "--models.policy.trust-remote-code true" in err
    assert not (tmp_path / "runs").exists()


def test_a_reference_or_critic_trusted_without_a_path_of_its_own_is_refused():
    # with an empty path the model is the policy, whose own setting decides
    with pytest.raises(ValueError, match="models.reference.trust_remote_code is true but models.reference.path is"):
        ModelsConfig.model_validate({"reference": {"trust_remote_code": True}})
    with pytest.raises(ValueError, match="--models.policy.trust-remote-code true instead, or give --models.critic"):
        ModelsConfig.model_validate({"critic": {"trust_remote_code": True}})


def test_the_policys_setting_reaches_every_model_that_is_the_policy(tiny_smollm2_dir, tmp_path):
    extra = ["--models.policy.trust-remote-code", "true", "--algorithm.kl.coef", "0.01"]
    cfg = resolve_config(RECIPE, _args(tiny_smollm2_dir, tmp_path, *extra))
    models = algorithm_models(cfg, tiny_smollm2_dir)
    assert models["trust_remote_code"] is True and models["reference_trust_remote_code"] is True  # empty path


def test_the_launch_plan_gives_the_servers_trust_remote_code_from_the_policys_setting(tiny_smollm2_dir, tmp_path):
    sglang = ["--engine.type", "sglang", "--engine.server", "sglang"]
    plain = launch_plan(resolve_config(RECIPE, _args(tiny_smollm2_dir, tmp_path, *sglang)))
    trusted = launch_plan(
        resolve_config(RECIPE, _args(tiny_smollm2_dir, tmp_path, *sglang, "--models.policy.trust-remote-code", "true"))
    )
    assert "--trust-remote-code" not in plain and trusted.count("--trust-remote-code") == 1


def test_a_run_trains_on_a_trusted_checkpoint_with_its_own_tokenizer(remote_tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(TINY_RUN_PATH)
    overrides = ["--models.policy.path", str(remote_tokenizer_dir), "--models.policy.trust-remote-code", "true"]
    run(resolve_config(RECIPE, [*overrides, *tiny_run(data_size=8, num_steps=1)]), tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1]
