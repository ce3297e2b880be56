import pytest
import yaml
from miles.recipes.cli import main, resolve_config
from miles.recipes.config import MilesConfig
from miles.recipes.diffusion import DiffusionConfig
from miles.recipes.overrides import _section_members, apply_overrides, parse_overrides
from miles.recipes.registry import load_recipe, recipe_names
from pydantic import BaseModel


def test_overrides_parse_dashes_to_underscores_and_values_as_yaml():
    assert parse_overrides(["--rollout.n-samples-per-prompt", "8", "--run.name=x", "--data.task-kwargs", "{a: 1}"]) == {
        "rollout.n_samples_per_prompt": 8,
        "run.name": "x",
        "data.task_kwargs": {"a": 1},
    }
    assert apply_overrides({"a": {"b": 1}}, {"a.c": 2, "d.e": 3}) == {"a": {"b": 1, "c": 2}, "d": {"e": 3}}


@pytest.mark.parametrize(
    "schema, key, value, expected",
    [
        pytest.param(DiffusionConfig, "algorithm.lora.target_modules", "to_q,to_k", ["to_q", "to_k"], id="comma_list"),
        pytest.param(DiffusionConfig, "algorithm.lora.target_modules", "to_q", ["to_q"], id="one_item"),
        pytest.param(DiffusionConfig, "data.prompts", "a cat, a dog", ["a cat", "a dog"], id="items_stripped"),
        pytest.param(DiffusionConfig, "data.prompts", "yes,no", ["yes", "no"], id="string_items_stay_strings"),
        pytest.param(DiffusionConfig, "data.prompts", "'a cat, sitting'", ["a cat, sitting"], id="quoted_one_item"),
        pytest.param(DiffusionConfig, "data.prompts", "[a, 'b, c']", ["a", "b, c"], id="yaml_list_as_before"),
        pytest.param(MilesConfig, "eval.pass_k", "1,8", [1, 8], id="int_items_parsed"),
        pytest.param(MilesConfig, "eval.pass_k", "4", [4], id="one_int"),
        pytest.param(MilesConfig, "engine.extra_args", "--tp-size,2", ["--tp-size", "2"], id="union_section_member"),
        pytest.param(MilesConfig, "run.name", "a,b", "a,b", id="a_string_key_keeps_its_commas"),
        pytest.param(MilesConfig, "data.task_kwargs", "{a: 1}", {"a": 1}, id="a_dict_key_is_yaml"),
    ],
)
def test_a_list_key_takes_a_plain_comma_list_and_other_keys_keep_their_commas(schema, key, value, expected):
    assert parse_overrides([f"--{key.replace('_', '-')}={value}"], schema) == {key: expected}


def test_a_comma_list_override_validates_as_the_list():
    cfg = resolve_config("tiny_flow_grpo_compressibility", ["--algorithm.lora.target-modules", "to_q,to_k"])
    assert cfg.algorithm.lora.target_modules == ["to_q", "to_k"]
    assert resolve_config("smollm2_grpo_arithmetic", ["--eval.pass-k", "1,4"]).eval.pass_k == [1, 4]


def test_an_override_without_value_is_a_clear_error():
    with pytest.raises(ValueError, match="--loop.num-steps has no value"):
        parse_overrides(["--loop.num-steps"])


# What a recipe needs from its user: the OPD recipe ships no teacher (validation reads no file: any path will do).
REQUIRED = {"smollm2_opd_arithmetic": ["--models.teacher.path", "/models/stronger-teacher"]}


@pytest.mark.parametrize("name", recipe_names())
def test_every_shipped_recipe_validates(name, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    overrides = ["--data.path", str(data)] if load_recipe(name).get("data", {}).get("source") == "file" else []
    schema = DiffusionConfig if load_recipe(name).get("kind") == "diffusion" else MilesConfig
    assert isinstance(resolve_config(name, overrides + REQUIRED.get(name, [])), schema)


def test_default_recipe_is_grpo_on_basic_arithmetic_with_8x8_rollouts():
    cfg = resolve_config("smollm2_grpo_arithmetic", [])
    assert cfg.data.task == "basic_arithmetic" and cfg.algorithm.advantage.estimator == "grpo"
    assert (cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt) == (8, 8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        pytest.param(["--rollout.n-samples-per-prompt", "1"], "needs at least 2", id="group_of_one"),
        pytest.param(["--rollout.global-batch-size", "7"], "not a multiple", id="batch_arithmetic"),
        pytest.param(["--rollout.sampling.top-p", "0.9"], "rollout.sampling.top_p is 0.9", id="top_p_in_training"),
        pytest.param(["--rollout.sampling.top-k", "50"], "rollout.sampling.top_k is 50", id="top_k_in_training"),
        pytest.param(
            ["--train.lrr", "1"],
            r"train.lrr \[--train.lrr\]: unknown key; valid keys here: lr, warmup_steps",
            id="unknown_key",
        ),
        pytest.param(["--train.lr", "fast"], r"train.lr \[--train.lr\].*got 'fast'", id="wrong_type"),
        pytest.param(["--algorithm.loss.clip-high", "0.1"], "clip_high", id="clip_high_below_clip_low"),
        pytest.param(["--data.source", "file"], "data.path is empty", id="file_without_path"),
        pytest.param(
            ["--nosuch.key", "1"],
            r"nosuch \[--nosuch\]: unknown key; valid keys here: models, data",
            id="unknown_section",
        ),
        pytest.param(["--reward.type", "custom"], "--reward.path", id="custom_reward_without_path"),
        pytest.param(  # was ignored: the recipe's reward ran and the plugin (even a missing one) never loaded
            ["--reward.path", "no_such_module:fn"],
            "reward.path is 'no_such_module:fn' but reward.type is 'reasoning_gym'.*Set --reward.type custom too",
            id="reward_path_without_type_custom",
        ),
        pytest.param(
            ["--model.path", "x"],
            r"model \[--model\]: unknown key.*the flat layout of an older Miles; it is now models.policy",
            id="flat_layout_flag",
        ),
        pytest.param(
            ["--engine.type", "tgi"], "engine.type must be one of embedded, vllm, sglang", id="unknown_engine"
        ),
        pytest.param(
            ["--engine.type", "vllm", "--engine.max-batch-size", "8"],
            r"engine.max_batch_size \[--engine.max-batch-size\]: unknown key; valid keys here: dtype, num_servers",
            id="embedded_key_on_a_server_engine",
        ),
        pytest.param(
            ["--engine.dtyp", "bf16"],
            r"engine.dtyp \[--engine.dtyp\]: unknown key; valid keys here: type, dtype",
            id="unknown_engine_key",
        ),
        pytest.param(["--execution.mode", "ray"], "engine.type is 'embedded'", id="ray_with_the_embedded_engine"),
        pytest.param(
            ["--loop.max-weight-staleness", "2"],
            r"loop.max_weight_staleness is 2 but loop.mode is 'sync'; .*--loop.mode fully_async",
            id="staleness_without_async",
        ),
        pytest.param(
            ["--engine.pause-mode", "abort"],
            r"engine.pause_mode \[--engine.pause-mode\]: unknown key; valid keys here: .* \(it belongs to engine.type "
            r"vllm, sglang; this engine is 'embedded'\)",
            id="server_engine_key_on_the_embedded_engine",
        ),
        pytest.param(
            ["--engine.probe.tokens", "0", "--engine.probe.max-abs-diff", "0.5"],
            r"engine.probe.max_abs_diff is 0.5 but engine.probe.tokens is 0, which turns the probe off",
            id="probe_tolerance_with_the_probe_off",
        ),
        pytest.param(
            ["--engine.probe.max-abs-diff", "inf"], r"engine.probe.max_abs_diff", id="probe_tolerance_not_finite"
        ),
        pytest.param(
            ["--loop.mode", "fully_async", "--engine.type", "vllm", "--engine.pause-mode", "keep"],
            r"engine.pause_mode is 'keep' but loop.mode fully_async pauses the engines with 'abort' .*partial-rollout",
            id="engine_pause_mode_overridden_by_fully_async",
        ),
        pytest.param(
            ["--loop.mode", "one_step_off", "--algorithm.dynamic-sampling.max-rounds", "2"],
            r"loop.mode is 'one_step_off' but algorithm.dynamic_sampling is on",
            id="async_with_dynamic_sampling",
        ),
        pytest.param(
            ["--algorithm.kl.estimator", "k1"],
            r"algorithm.kl.coef \[--algorithm.kl.coef\]: Field required",
            id="kl_on_without_coef",
        ),
        pytest.param(["--data.bad-rows", "ignore"], r"data.bad_rows \[--data.bad-rows\]", id="bad_rows_choice"),
        pytest.param(["--reward.timeout-s", "-1"], r"reward.timeout_s", id="negative_reward_timeout"),
        pytest.param(["--loop.keep-checkpoints", "-1"], r"loop.keep_checkpoints", id="negative_keep"),
    ],
)
def test_bad_configs_fail_before_anything_loads_with_the_key_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_config("smollm2_grpo_arithmetic", overrides)


def test_eval_sampling_may_use_top_p_and_top_k():
    cfg = resolve_config("smollm2_grpo_arithmetic", ["--eval.sampling.top-p", "0.95", "--eval.sampling.top-k", "20"])
    assert (cfg.eval.sampling.top_p, cfg.eval.sampling.top_k) == (0.95, 20)


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    assert main(["train", "--rollout.n-samples-per-prompt", "1"]) == 2
    assert "rollout.n_samples_per_prompt is 1" in capsys.readouterr().err


def test_cli_lists_recipes_and_shows_a_resolved_config(capsys):
    assert main(["recipes", "list"]) == 0
    assert "smollm2_grpo_arithmetic" in capsys.readouterr().out
    assert main(["config", "show", "smollm2_grpo_arithmetic", "--loop.num-steps", "3"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == resolve_config("smollm2_grpo_arithmetic", ["--loop.num-steps", "3"]).model_dump(mode="json")
    assert shown["loop"]["num_steps"] == 3


def test_unknown_recipe_lists_the_shipped_ones():
    with pytest.raises(ValueError, match="smollm2_grpo_arithmetic"):
        load_recipe("nope")


def _fields(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    """Every field of the tree, optional sections (``Section | None``) and union members included."""
    fields = {}
    for name, field in model.model_fields.items():
        fields[prefix + name] = field
        for section in _section_members(field.annotation):
            fields |= _fields(section, prefix + name + ".")
    return fields


def test_every_config_field_is_described():
    fields = _fields(MilesConfig)
    assert {
        "algorithm.kl.coef", "models.critic.value_clip", "models.teacher.path", "engine.dtype", "engine.max_model_len",
        "engine.router",
    } <= fields.keys()  # fmt: skip
    assert [key for key, field in fields.items() if not field.description] == []


def test_model_path_must_be_registered_or_a_model_directory(tmp_path):
    from miles.recipes.registry import resolve_model_path

    with pytest.raises(ValueError, match="models.policy.path"):
        resolve_model_path(str(tmp_path))


@pytest.mark.parametrize(
    "overrides, keys",
    [
        pytest.param(
            ["--algorithm.loss.policy-loss", "gspo", "--algorithm.loss.dual-clip-c", "3"],
            ("algorithm.loss.dual_clip_c is 3.0", "algorithm.loss.policy_loss 'gspo'", "read by: ppo"),
            id="dual_clip_with_a_loss_without_it",
        ),
        pytest.param(
            ["--rollout.mode", "sft", "--algorithm.loss.policy-loss", "sft", "--algorithm.loss.clip-high", "0.3"],
            ("algorithm.loss.clip_high is 0.3", "algorithm.loss.policy_loss 'sft'"),
            id="clip_with_sft",
        ),
        pytest.param(
            ["--algorithm.advantage.lam", "0.9"],
            ("algorithm.advantage.lam is 0.9", "algorithm.advantage.estimator 'grpo'", "read by: gae"),
            id="gae_lambda_with_grpo",
        ),
        pytest.param(
            ["--algorithm.advantage.estimator-path", "m:f", "--algorithm.advantage.estimator", "rloo"],
            ("algorithm.advantage.estimator is 'rloo'", "algorithm.advantage.estimator_path"),
            id="estimator_replaced_by_a_plugin",
        ),
        pytest.param(
            ["--algorithm.loss.reducer-path", "m:f", "--algorithm.loss.aggregation", "seq_mean_token_mean"],
            ("algorithm.loss.aggregation is 'seq_mean_token_mean'", "algorithm.loss.reducer_path"),
            id="aggregation_replaced_by_a_plugin",
        ),
        pytest.param(
            [
                "--algorithm.rollout-correction.importance-sampling",
                "none",
                "--algorithm.rollout-correction.opsm",
                "true",
                "--algorithm.rollout-correction.level",
                "sequence",
            ],
            ("algorithm.rollout_correction.level is 'sequence'", "algorithm.rollout_correction.importance_sampling"),
            id="importance_level_without_importance_sampling",
        ),  # fmt: skip
        pytest.param(
            [
                "--algorithm.rollout-correction.importance-sampling",
                "icepop",
                "--algorithm.rollout-correction.level",
                "geometric",
            ],
            ("algorithm.rollout_correction.level is 'geometric'", "importance_sampling is 'icepop'"),
            id="importance_level_with_icepop",
        ),  # fmt: skip
        pytest.param(
            ["--algorithm.rollout-correction.opsm-threshold", "0.1"],
            ("algorithm.rollout_correction.opsm_threshold is 0.1", "algorithm.rollout_correction.opsm is false"),
            id="opsm_threshold_without_opsm",
        ),
        pytest.param(
            ["--algorithm.rollout-correction.importance-sampling", "none"],
            (
                "algorithm.rollout_correction is on",
                "importance_sampling is 'none'",
                "--algorithm.rollout-correction null",
            ),
            id="rollout_correction_that_corrects_nothing",
        ),
        pytest.param(
            ["--algorithm.overlong.penalty-factor", "2"],
            ("algorithm.overlong.penalty_factor is 2.0", "algorithm.overlong.buffer_len is 0"),
            id="overlong_penalty_without_buffer",
        ),
        pytest.param(
            ["--models.teacher.path", "t"],
            ("models.teacher is set", "algorithm.advantage.estimator is 'grpo'", "--models.teacher null"),
            id="teacher_without_opd",
        ),
        pytest.param(
            ["--models.critic.lr", "1e-5"],
            ("models.critic is set", "algorithm.advantage.estimator is 'grpo'", "--models.critic null"),
            id="critic_without_gae",
        ),
        pytest.param(
            ["--algorithm.advantage.estimator", "gae"],
            ("algorithm.advantage.estimator is 'gae'", "models.critic is off", "--models.critic.lr"),
            id="gae_without_critic",
        ),
        pytest.param(
            ["--models.reference.path", "r"],
            ("models.reference.path is 'r'", "algorithm.kl is off", "--algorithm.kl.coef"),
            id="reference_without_kl",
        ),
        pytest.param(
            ["--eval.interval", "2", "--eval.num-prompts", "0"],
            ("eval.interval is 2", "eval.num_prompts is 0", "--eval.num-prompts"),
            id="eval_interval_with_eval_off",
        ),
    ],
)
def test_a_setting_of_a_feature_that_is_off_is_one_line_naming_both_keys_and_the_fix(overrides, keys):
    with pytest.raises(ValueError) as err:
        resolve_config("smollm2_grpo_arithmetic", overrides)
    message = str(err.value).removeprefix("invalid configuration:\n  ")
    assert "\n" not in message, message
    for key in keys:
        assert key in message, (key, message)


@pytest.mark.parametrize("name", recipe_names())
def test_a_full_dump_of_a_resolved_recipe_validates_to_the_same_config(name, tmp_path):
    """A run's config.yaml and `miles config show` list every field, including the defaults of features a recipe
    does not read (clip bounds of sft): they must validate again, unchanged (resume reads them)."""
    cfg = resolve_config(name, REQUIRED.get(name, []))
    assert type(cfg).model_validate(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))) == cfg


def test_a_key_of_an_off_section_turns_it_on_with_defaults_and_null_turns_it_off():
    from miles.core.config import CriticConfig, DynamicSamplingConfig, KLConfig

    grpo = "smollm2_grpo_arithmetic"
    assert resolve_config(grpo, []).algorithm.kl is None
    assert resolve_config(grpo, ["--algorithm.kl.coef", "0.1"]).algorithm.kl == KLConfig(coef=0.1)
    ppo = resolve_config("smollm2_ppo_arithmetic", ["--algorithm.kl.coef", "0.2"])
    assert ppo.algorithm.kl == KLConfig(coef=0.2, mode="reward", estimator="k1")  # merged with the recipe's
    for off in ("null", "none", "None", "false"):
        assert resolve_config("smollm2_ppo_arithmetic", ["--algorithm.kl", off]).algorithm.kl is None
    assert resolve_config(grpo, ["--algorithm.kl", "null", "--algorithm.kl.coef", "0.3"]).algorithm.kl.coef == 0.3
    on = resolve_config(grpo, ["--algorithm.dynamic-sampling", "true"]).algorithm.dynamic_sampling
    assert on == DynamicSamplingConfig()
    assert (
        resolve_config("smollm2_dapo_arithmetic", ["--algorithm.dynamic-sampling", "null"]).algorithm.dynamic_sampling
        is None
    )
    gae = resolve_config(grpo, ["--algorithm.advantage.estimator", "gae", "--models.critic.lr", "2e-5"])
    assert gae.models.critic == CriticConfig(lr=2e-5)
    # A Literal whose value is the word "none" stays a string: only optional sections read it as off.
    opsm = ["--algorithm.rollout-correction.importance-sampling", "none", "--algorithm.rollout-correction.opsm", "true"]
    assert resolve_config(grpo, opsm).algorithm.rollout_correction.importance_sampling == "none"


def test_config_show_prints_every_field_of_off_sections_as_comments_and_still_loads_as_the_config(capsys):
    assert main(["config", "show", "smollm2_ppo_arithmetic"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out) == resolve_config("smollm2_ppo_arithmetic", []).model_dump(mode="json")
    assert "  teacher: null  # off; --models.teacher.KEY VALUE turns it on" in out
    assert "    # path: <required>" in out and "    # temperature: 1.0" in out  # the teacher's fields
    assert "  dynamic_sampling: null  # off" in out and "    # over_sample: 1.0" in out
    assert "    # Weight from rho = pi_old / pi_rollout" in out  # descriptions of an off section's fields too
    assert "  critic:\n" in out and "    value_clip: 0.2" in out  # on


class _DiskAccess:
    """Records the files opened, stat'ed or listed and the modules imported while active (audit hook + os.stat)."""

    hook_installed = False
    active: list[list[str]] = []

    def __init__(self, monkeypatch):
        import os
        import sys

        if not _DiskAccess.hook_installed:  # audit hooks cannot be removed: one, idle unless a recorder is active
            sys.addaudithook(self._audit)
            _DiskAccess.hook_installed = True
        self.seen: list[str] = []
        for name in ("stat", "lstat"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, lambda path, *a, _real=real, **k: self._record("stat", path, _real, a, k))

    @staticmethod
    def _audit(event, args):
        if _DiskAccess.active and event in ("open", "import", "os.listdir", "os.scandir"):
            _DiskAccess.active[-1].append(f"{event} {args[0]}")

    def _record(self, what, path, real, args, kwargs):
        if _DiskAccess.active:
            _DiskAccess.active[-1].append(f"{what} {path}")
        return real(path, *args, **kwargs)

    def __enter__(self):
        _DiskAccess.active.append(self.seen)
        return self.seen

    def __exit__(self, *exc):
        _DiskAccess.active.pop()


CLUSTER_RECIPE = """\
base: smollm2_ppo_arithmetic
models:
  policy: {path: /cluster/models/qwen3-32b}
  reference: {path: /cluster/models/qwen3-32b-sft}
  critic: {path: /cluster/models/qwen3-32b-critic}
data: {source: file, path: /cluster/data/train.jsonl, eval_path: /cluster/data/test.jsonl}
reward: {type: custom, path: cluster_rewards:score}
algorithm:
  loss: {policy_loss_path: cluster_plugins:loss, reducer_path: cluster_plugins:reduce}
  dynamic_sampling: {filter_path: cluster_plugins:keep}
  reward_post_process_path: cluster_plugins:shape
"""


def test_validating_and_showing_a_cluster_recipe_touches_no_file_beyond_the_recipe_yamls(tmp_path, monkeypatch, capsys):
    """Nonexistent models, data files and plugin modules: validation is pure, so the recipe validates here."""
    from miles.recipes.overrides import apply_overrides, documented_yaml, parse_overrides  # imported before

    recipe = tmp_path / "cluster.yaml"
    recipe.write_text(CLUSTER_RECIPE)
    raw = load_recipe(str(recipe))
    with _DiskAccess(monkeypatch) as seen:
        cfg = MilesConfig.model_validate(apply_overrides(raw, parse_overrides(["--loop.num-steps", "3"])))
        documented_yaml(cfg)
    assert seen == [] and cfg.models.policy.path == "/cluster/models/qwen3-32b"
    with _DiskAccess(monkeypatch) as seen:
        assert main(["config", "show", str(recipe)]) == 0
    touched = [entry for entry in seen if not entry.endswith(".mo")]  # argparse looks up gettext catalogs
    assert touched and all(entry.endswith(".yaml") for entry in touched), touched  # the recipe and its base only
    assert "cluster_plugins:loss" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["smollm2_grpo_arithmetic", "smollm2_ppo_arithmetic", "smollm2_opd_arithmetic"])
def test_config_show_prints_the_description_of_every_field_on_or_off(name, capsys):
    assert main(["config", "show", name, *REQUIRED.get(name, [])]) == 0
    comments = [line.strip().removeprefix("# ") for line in capsys.readouterr().out.splitlines() if "# " in line]
    text = " ".join(comments)
    engine = type(resolve_config(name, REQUIRED.get(name, [])).engine)  # the other engine kinds are not shown
    fields = {k: f for k, f in _fields(MilesConfig).items() if not k.startswith("engine.")}
    fields |= {f"engine.{k}": f for k, f in engine.model_fields.items()}
    missing = [key for key, field in fields.items() if field.description not in text]
    assert missing == []


def test_config_show_takes_the_recipe_as_train_does(capsys):
    """RECIPE positional or --recipe (with overrides after it), defaulting to train's default recipe."""
    assert main(["config", "show", "--recipe", "smollm2_ppo_arithmetic", "--loop.num-steps", "3"]) == 0
    shown = capsys.readouterr().out
    assert "num_steps: 3" in shown and "estimator: gae" in shown
    assert main(["config", "show"]) == 0
    assert "estimator: grpo" in capsys.readouterr().out  # smollm2_grpo_arithmetic, train's default
    assert main(["config", "show", "smollm2_ppo_arithmetic", "--recipe", "smollm2_sft_arithmetic"]) == 2
    assert "give the recipe once" in capsys.readouterr().err


def test_changing_a_sections_type_drops_the_recipes_keys_for_the_old_type_in_any_order():
    recipe = {"engine": {"type": "embedded", "dtype": "bf16", "max_batch_size": 64, "logprob_mode": "decode"}}
    for overrides in (
        {"engine.num_servers": 2, "engine.type": "vllm"},
        {"engine.type": "vllm", "engine.num_servers": 2},
    ):
        assert apply_overrides(recipe, overrides) == {"engine": {"type": "vllm", "num_servers": 2}}
    # the same type keeps the recipe's keys
    assert apply_overrides(recipe, {"engine.type": "embedded"}) == recipe
    config = resolve_config("smollm2_grpo_arithmetic", ["--engine.num-servers", "2", "--engine.type", "vllm"])
    assert (config.engine.type, config.engine.num_servers, config.engine.host) == ("vllm", 2, "127.0.0.1")


def test_each_reward_call_is_limited_to_60_s_by_default_and_a_limit_no_call_can_meet_is_one_line(capsys):
    """A hanging reward hung the run (reward.timeout_s was 0, no limit); the limit must leave room for one code
    test case (reward.code.time_limit_s) or one remote attempt (reward.remote.timeout_s)."""
    from miles.core.rewards import TimeLimitedReward
    from miles.recipes.run import build_reward

    assert main(["config", "show", "smollm2_grpo_gsm8k"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["reward"]["timeout_s"] == 60.0
    reward_fn = build_reward(resolve_config("smollm2_grpo_gsm8k", []).reward)  # math-verify, in this process
    assert isinstance(reward_fn, TimeLimitedReward) and reward_fn.timeout_s == 60.0
    assert main(["train", "--reward.type", "code", "--reward.timeout-s", "5"]) == 2
    assert capsys.readouterr().err == (
        "miles: invalid configuration: reward.timeout_s is 5 but reward.code.time_limit_s is 5: a reward call is cut "
        "off after reward.timeout_s, so not even one test case could finish. Set --reward.timeout-s above 5 (e.g. "
        "20), or lower --reward.code.time-limit-s.\n"
    )
    remote = ["--reward.type", "remote", "--reward.remote.url", "http://rm:8000/score", "--reward.remote.timeout-s"]
    assert main(["train", *remote, "90"]) == 2
    assert capsys.readouterr().err.startswith(
        "miles: invalid configuration: reward.timeout_s is 60 but reward.remote.timeout_s is 90: a reward call is cut "
        "off after reward.timeout_s, so not even one attempt could finish."
    )
