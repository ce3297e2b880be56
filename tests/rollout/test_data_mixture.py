"""data.mixture: the weighted round-robin schedule (hand-computed), MixtureSource tags, renumbering, independent
epochs and exact resume, and the config's one-line errors."""

import json
import re

import pytest
import yaml
from miles.recipes.cli import resolve_config
from miles.recipes.config import MilesConfig
from miles.recipes.overrides import documented_yaml
from miles.recipes.run import build_data_sources
from miles.rollout.config import DataConfig
from miles.rollout.data import FileSource, MixtureSource, ReasoningGymSource, mixture_counts, next_component

TASK_KWARGS = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",))


def _jsonl(path, num_rows, word):
    path.write_text(
        "".join(json.dumps({"question": f"{word} {i}?", "answer": f"{word}{i}"}) + "\n" for i in range(num_rows))
    )
    return path


def _schedule(weights, num):
    counts, picks = [0] * len(weights), []
    for _ in range(num):
        picks.append(next_component(weights, counts))
        counts[picks[-1]] += 1
    return picks


def test_weights_3_and_1_serve_a_a_b_a_and_repeat():
    # Lags (n + 1) * w / W - c before each pick, A first:
    # n=0: A .75, B .25 -> A; n=1: A 1.5-1 = .5, B .5 -> tie, A; n=2: A 2.25-2 = .25, B .75 -> B;
    # n=3: A 3-2 = 1, B 1-1 = 0 -> A; then every lag is 0 again, so the period of 4 repeats.
    assert _schedule([3.0, 1.0], 8) == [0, 0, 1, 0, 0, 0, 1, 0]


def test_integer_weights_give_exact_proportions_over_400_prompts():
    # 400 is a multiple of W (4 and 10), where every lag is 0: counts are exactly n * w / W.
    assert mixture_counts([3, 1], 400) == [300, 100]
    assert mixture_counts([5, 3, 2], 400) == [200, 120, 80]


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.55, 0.3, 0.15], [1.0, 2.5, 0.25, 0.25]])
def test_every_prefix_of_400_prompts_is_within_the_proven_bound(weights):
    # mixture.py's proof: n * p - (k - 1) < c < n * p + 1; within 1 for two components.
    k, total, counts = len(weights), sum(weights), [0] * len(weights)
    for n in range(1, 401):
        counts[next_component(weights, counts)] += 1
        for weight, count in zip(weights, counts):
            assert n * weight / total - (k - 1) < count < n * weight / total + 1, (n, counts)
            if k == 2:
                assert abs(count - n * weight / total) < 1, (n, counts)


def _mixture(tmp_path, *, size_a=4, size_b=5, weights=(3, 1)):
    a = FileSource(_jsonl(tmp_path / "a.jsonl", size_a, "alpha"), seed=7)
    b = FileSource(_jsonl(tmp_path / "b.jsonl", size_b, "beta"), seed=7)
    return MixtureSource([("alpha", weights[0], a), ("beta", weights[1], b)])


def test_prompts_name_their_dataset_and_count_over_the_whole_mixture(tmp_path):
    prompts = _mixture(tmp_path).next_prompts(5)
    assert [p.metadata["dataset"] for p in prompts] == ["alpha", "alpha", "beta", "alpha", "alpha"]
    assert [p.group_index for p in prompts] == [p.index for p in prompts] == [0, 1, 2, 3, 4]
    assert all(p.label.startswith(p.metadata["dataset"]) for p in prompts)


def test_each_dataset_keeps_its_own_order_and_wraps_its_epochs_independently(tmp_path):
    mixture = _mixture(tmp_path, size_a=4, size_b=5)
    prompts = mixture.next_prompts(6) + mixture.next_prompts(10)  # two calls: the schedule spans them
    alpha = [p.label for p in prompts if p.metadata["dataset"] == "alpha"]
    beta = [p.label for p in prompts if p.metadata["dataset"] == "beta"]
    # 16 prompts at 3:1: alpha 12 = three epochs of its 4 rows, beta 4 of its 5 rows (still epoch 0).
    assert len(alpha) == 12 and len(beta) == 4
    # Exactly the prompts each file serves on its own: mixing changes neither order.
    alone_a = FileSource(tmp_path / "a.jsonl", seed=7).next_prompts(12)
    alone_b = FileSource(tmp_path / "b.jsonl", seed=7).next_prompts(4)
    assert alpha == [p.label for p in alone_a] and beta == [p.label for p in alone_b]
    assert [sorted(alpha[i : i + 4]) for i in (0, 4, 8)] == [[f"alpha{i}" for i in range(4)]] * 3
    a, b = mixture.sources
    assert (a.epoch, a.num_prompts, b.epoch, b.num_prompts) == (2, 12, 0, 4)


def _two_kinds(tmp_path):
    task = ReasoningGymSource("basic_arithmetic", size=3, seed=1, task_kwargs=TASK_KWARGS)
    file = FileSource(_jsonl(tmp_path / "b.jsonl", 5, "beta"), seed=2)
    return MixtureSource([("sums", 2.0, task), ("beta", 1.0, file)])


def _key(prompt):
    return prompt.group_index, prompt.metadata["dataset"], prompt.prompt, str(prompt.label)


def test_resume_mid_epoch_continues_with_exactly_the_next_prompts(tmp_path):
    straight = _two_kinds(tmp_path)
    straight.next_prompts(7)  # sums: 5 of 3 rows (epoch 1, mid-epoch), beta: 2 of 5 (mid-epoch)
    state = json.loads(json.dumps(straight.state_dict()))  # as a checkpoint stores it
    assert {name: entry["served"] for name, entry in state["datasets"].items()} == {"sums": 5, "beta": 2}
    expected = [_key(p) for p in straight.next_prompts(9)]
    resumed = _two_kinds(tmp_path)
    resumed.load_state_dict(state)
    assert [_key(p) for p in resumed.next_prompts(9)] == expected
    assert expected[0][0] == 7  # group_index continues the run's count


@pytest.mark.parametrize(
    "weights, names",
    [
        pytest.param((2.0, 2.0), ("sums", "beta"), id="other_weights"),
        pytest.param((2.0, 1.0), ("sums", "gamma"), id="other_names"),
    ],
)
def test_a_state_of_another_mixture_is_refused(tmp_path, weights, names):
    state = _two_kinds(tmp_path).state_dict()
    other = MixtureSource([(name, w, s) for name, w, s in zip(names, weights, _two_kinds(tmp_path).sources)])
    with pytest.raises(
        ValueError, match=r"data.mixture state has \(name, weight\) \[\('sums', 2.0\), \('beta', 1.0\)\]"
    ):
        other.load_state_dict(state)
    assert other.num_prompts == 0  # nothing was loaded


def test_the_state_of_a_single_source_is_refused_by_a_mixture(tmp_path):
    with pytest.raises(ValueError, match="not a data.mixture state"):
        _two_kinds(tmp_path).load_state_dict(FileSource(tmp_path / "b.jsonl").state_dict())


def test_eval_prompts_are_the_same_mix_from_held_out_rows(tmp_path):
    data = DataConfig(
        mixture=[
            {"name": "sums", "weight": 3, "task": "basic_arithmetic", "task_kwargs": TASK_KWARGS, "size": 20},
            {"name": "beta", "weight": 1, "source": "file", "path": str(_jsonl(tmp_path / "b.jsonl", 6, "beta"))},
        ]
    )
    train, heldout = build_data_sources(data, num_eval_prompts=4)
    eval_prompts = heldout.next_prompts(4)
    # 4 eval prompts at 3:1 are A A B A: beta holds exactly 1 row out of training.
    assert [p.metadata["dataset"] for p in eval_prompts] == ["sums", "sums", "beta", "sums"]
    beta_eval = {p.label for p in eval_prompts if p.metadata["dataset"] == "beta"}
    beta_train = {p.label for p in train.next_prompts(40) if p.metadata["dataset"] == "beta"}  # 10 = 2 epochs of 5
    assert len(beta_eval) == 1 and len(beta_train) == 5 and not beta_eval & beta_train


M = ["--data.task-kwargs", "{}", "--data.prompt-suffix", ""]  # the arithmetic recipe's own source keys, reset


@pytest.mark.parametrize(
    "overrides, message",
    [
        pytest.param(
            ["--data.mixture", "[{name: sums}]"],
            "data.task_kwargs is {'min_terms': 2, .* but data.mixture is set, .* --data.task-kwargs '{}'",
            id="top_level_source_key_would_be_ignored",
        ),
        pytest.param(
            [*M, "--data.mixture", "[{name: sums}, {name: sums, task: chain_sum}]"],
            "data.mixture\\[1\\].name 'sums' is used twice",
            id="duplicate_name",
        ),
        pytest.param(
            [*M, "--data.mixture", "[{name: sums, weight: 0}]"],
            "data.mixture\\[0\\].weight \\(sums\\) is 0, but .* must be > 0",
            id="zero_weight",
        ),
        pytest.param(
            [*M, "--data.mixture", "[{name: sums, weight: -1}]"],
            "data.mixture\\[0\\].weight \\(sums\\) is -1",
            id="negative_weight",
        ),
        pytest.param(
            [*M, "--data.mixture", "[{name: my set}]"],
            "data.mixture\\[0\\].name is 'my set'; .* letters, digits and _.- only",
            id="name_not_a_metric_suffix",
        ),
        pytest.param(
            [*M, "--data.mixture", "[{name: gsm8k, source: file}]", "--reward.type", "math"],
            "data.mixture\\[0\\].source \\(gsm8k\\) is 'file' but its path is empty",
            id="file_without_path",
        ),
        pytest.param(
            [*M, "--data.mixture", "[{name: sums}, {name: gsm8k, source: file, path: t.jsonl}]"],
            "reward.type is 'reasoning_gym' but data.mixture\\[1\\].source \\(gsm8k\\) is 'file'",
            id="reasoning_gym_reward_on_a_file_dataset",
        ),
    ],
)
def test_a_bad_mixture_gives_one_line_naming_the_key_and_the_fix(overrides, message):
    with pytest.raises(ValueError) as err:
        resolve_config("smollm2_grpo_arithmetic", overrides)
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid configuration:" and len(lines) == 2, lines
    assert re.search(message, lines[1]), lines[1]


def test_a_mixture_reads_naturally_on_the_command_line():
    mixture = "[{name: sums, weight: 3, task: basic_arithmetic}, {name: gsm8k, weight: 1, source: file, path: t.jsonl}]"
    cfg = resolve_config("smollm2_grpo_arithmetic", [*M, "--data.mixture", mixture, "--reward.type", "math"])
    assert [(c.name, c.weight, c.source) for c in cfg.data.mixture] == [
        ("sums", 3.0, "reasoning_gym"),
        ("gsm8k", 1.0, "file"),
    ]
    assert MilesConfig.model_validate(yaml.safe_load(documented_yaml(cfg))) == cfg  # `miles config show` prints it


def test_an_eval_set_with_its_own_source_evaluates_on_it_not_on_the_mixture(tmp_path):
    from miles.recipes.config import eval_set_data

    eval_sets = "[{name: gsm8k, num_prompts: 2, data: {source: file, path: t.jsonl}}]"
    overrides = [*M, "--data.mixture", "[{name: sums}]", "--eval.sets", eval_sets]
    cfg = resolve_config("smollm2_grpo_arithmetic", overrides)
    assert eval_set_data(cfg, 0).mixture == [] and eval_set_data(cfg, 0).path == "t.jsonl"


def test_a_missing_file_of_a_dataset_names_its_entry(tmp_path):
    data = DataConfig(
        mixture=[{"name": "sums"}, {"name": "gsm8k", "source": "file", "path": str(tmp_path / "no.jsonl")}]
    )
    with pytest.raises(ValueError, match=r"data.mixture\[1\].path \(gsm8k\) is '.*no.jsonl', which does not exist"):
        build_data_sources(data, num_eval_prompts=0)


def test_a_bad_row_of_a_dataset_names_its_entry_and_the_line(tmp_path):
    path = _jsonl(tmp_path / "b.jsonl", 3, "beta")
    path.write_text(path.read_text() + "not json\n")
    data = DataConfig(mixture=[{"name": "beta", "source": "file", "path": str(path)}])
    with pytest.raises(
        ValueError, match=r"^data.mixture\[0\] \(beta\): data.path '.*b.jsonl' has 1 bad row .*b.jsonl:4"
    ):
        build_data_sources(data, num_eval_prompts=0)
