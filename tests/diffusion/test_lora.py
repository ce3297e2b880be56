"""LoRA on the flow transformer (``algorithm.lora``, Flow-GRPO's SD3.5 setting) on the tiny twin: only the adapters
train, the rollout copy gets the adapted layers' merged weights (and nothing else after the first push), the KL
reference is the transformer with its adapters off, and a resumed run equals an uninterrupted one."""

import pytest
import torch
from miles.diffusion.config import SD3_ATTENTION_LINEARS, FlowGRPOConfig, FlowLoraConfig
from miles.diffusion.models import tiny_flow_model
from miles.diffusion.sampler import step_transition
from miles.diffusion.trainer import FlowGRPOTrainer
from miles.train.fsdp2.lora import adapter_layers

PROMPTS = ["a red image", "a blue image"]
SMALL = dict(prompts_per_step=2, group_size=3, num_steps=3, micro_batch_size=4, lr=1e-2)
LORA = FlowLoraConfig(rank=4, alpha=8.0)


def brightness(prompts, images):
    return [float(image.mean()) / 255 for image in images]


def test_only_the_adapters_train_and_the_rollout_copy_gets_their_merged_weights():
    start = tiny_flow_model(seed=0).transformer.state_dict()
    trainer = FlowGRPOTrainer(tiny_flow_model(seed=0), FlowGRPOConfig(**SMALL, lora=LORA), brightness)
    layers = adapter_layers(trainer.policy)
    # every projection of every joint-attention block (the last block's text stream has no to_add_out)
    assert len(layers) > 8 and all(any(name.endswith(t) for t in SD3_ATTENTION_LINEARS) for name in layers)
    trained = {p for group in trainer.optimizer.param_groups for p in group["params"]}
    assert trained == {p for name, p in trainer.policy.named_parameters() if ".lora_" in name}
    assert len(trained) == 2 * len(layers)
    copy = trainer.rollout_transformer.state_dict()
    assert sorted(copy) == sorted(start) and all(torch.equal(copy[k], start[k]) for k in start)  # B = 0: the base

    pushed = []
    push = trainer.sender.push
    trainer.sender.push = lambda named, **kw: push([pushed.append(n) or (n, t) for n, t in named], **kw)
    metrics = trainer.step(PROMPTS)
    targeted = {f"{name}.weight" for name in layers} | {f"{name}.bias" for name in layers}
    assert set(pushed) == targeted & set(start)  # only the adapted layers, under their plain names
    assert metrics["weight_version"] == 2 and metrics["optimizer_steps"] == 1
    copy = trainer.rollout_transformer.state_dict()
    for name, layer in layers.items():
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        # the step moved every adapter but the last block's text queries (that block drops its text outputs)
        last_text_query = name == f"transformer_blocks.{len(trainer.policy.transformer_blocks) - 1}.attn.add_q_proj"
        assert bool(b.abs().sum() > 0) != last_text_query, name
        merged = start[f"{name}.weight"] + (b @ a) * (8.0 / 4)  # W + (alpha / r) B A, by hand
        torch.testing.assert_close(copy[f"{name}.weight"], merged, atol=1e-7, rtol=0)
        assert torch.equal(layer.base_layer.weight, start[f"{name}.weight"]), name  # the base never trains
    rest = [k for k in start if k not in targeted]
    assert rest and all(torch.equal(copy[k], start[k]) for k in rest)
    # the next rollout samples with the merged weights; the trainer recomputes them with base + adapters
    assert trainer.step(PROMPTS)["train_rollout_logprob_max_abs_diff"] < 1e-4


def test_the_kl_reference_is_the_transformer_with_its_adapters_off():
    trainer = FlowGRPOTrainer(tiny_flow_model(seed=0), FlowGRPOConfig(**SMALL, kl_coef=0.5, lora=LORA), brightness)
    assert trainer.reference is None  # no second copy
    assert trainer.step(PROMPTS)["kl"] == 0.0  # B = 0: the policy starts at the reference
    assert trainer.step(PROMPTS)["kl"] > 0
    rollout = trainer.rollout(PROMPTS, step=5)
    cond = trainer.model.encode(rollout.prompts)
    start = tiny_flow_model(seed=0).transformer
    with torch.no_grad(), trainer._reference() as reference:
        off = step_transition(reference, rollout.trajectories, cond, 1)
    with torch.no_grad():
        plain = step_transition(start, rollout.trajectories, cond, 1)
        on = step_transition(trainer.policy, rollout.trajectories, cond, 1)
    assert torch.equal(off.mean, plain.mean)  # exactly the starting model
    assert not torch.allclose(on.mean, plain.mean)  # and the adapters back on afterwards


def test_a_resume_loads_the_adapters_onto_the_base_and_equals_an_uninterrupted_run():
    config = FlowGRPOConfig(**SMALL, updates_per_rollout=2, lora=LORA)
    straight = FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    first = [straight.step(PROMPTS) for _ in range(2)]
    interrupted = FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    interrupted.step(PROMPTS)
    state = interrupted.state_dict()
    assert state["transformer"] and all(".lora_" in name for name in state["transformer"])  # the adapters alone
    resumed = FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    resumed.load_state_dict(state)
    assert resumed.receiver.weight_version == 2
    second = resumed.step(PROMPTS)
    for key in ("reward/mean", "loss", "grad_norm", "approx_kl"):
        assert second[key] == first[1][key], key
    a, b = straight.rollout_transformer.state_dict(), resumed.rollout_transformer.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = FlowGRPOTrainer(tiny_flow_model(seed=0), config.model_copy(update={"lora": FlowLoraConfig(rank=4,
                            target_modules=["attn.to_q"])}), brightness)  # fmt: skip
    with pytest.raises(ValueError, match="the saved LoRA adapters do not fit algorithm.lora"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["q_proj"], "'q_proj' matches no module, not a Linear layer"),
        (["to_q", "nonexistent"], "'nonexistent' matches no module"),  # peft would drop it without a word
        (["to_out"], r"'to_out' names a ModuleList \(transformer_blocks.0.attn.to_out\), not a Linear layer"),
    ],
)
def test_targets_that_name_no_linear_layer_name_the_field_and_the_valid_names(targets, message):
    config = FlowGRPOConfig(**SMALL, lora=FlowLoraConfig(target_modules=targets))
    with pytest.raises(ValueError, match=f"algorithm.lora.target_modules: {message}") as err:
        FlowGRPOTrainer(tiny_flow_model(seed=0), config, brightness)
    assert "'to_out.0'" in str(err.value) and "'0'" not in str(err.value)  # the names a target can use
