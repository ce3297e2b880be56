"""The embedded engine records MoE routing (R3): [prompt + response tokens, layers, top_k] int32 from the forward
that gave the returned log-probs, the dense layer's and last token's rows -1; a dense model is refused."""

import pytest
import torch
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest
from miles.core.routing_replay import RoutingRecorder, routing_layout
from miles.rollout.engines.embedded import EmbeddedEngine
from moe_models import EOS, make_moe_model, save_moe_model

SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0)
PROMPTS = [[5, 9, 11, 3], [7, 8, 20, 21, 4, 6, 30]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_moe_model("deepseek_v3", tmp_path_factory.mktemp("tiny_deepseek_v3"))


def _full_forward_routing(tokens: list[int]) -> torch.Tensor:
    """What the routers choose for ``tokens`` in one forward of the same model: [len(tokens), layers, top_k]."""
    model = make_moe_model("deepseek_v3")
    with torch.no_grad(), RoutingRecorder(routing_layout(model)) as recorder:
        model(input_ids=torch.tensor([tokens]))
    return recorder.take()[0]


@pytest.mark.parametrize("logprob_mode", ["prefill", "decode"])
def test_each_output_carries_the_routing_of_its_prompt_and_response(moe_dir, logprob_mode):
    engine = EmbeddedEngine(moe_dir, stop_token_ids=[EOS], routed_experts=True, logprob_mode=logprob_mode)
    assert not engine.continuous  # MoE models run through HF generate
    outputs = engine.generate_batch([GenerateRequest(p, SAMPLING, seed=i) for i, p in enumerate(PROMPTS)])
    engine.close()
    for prompt, output in zip(PROMPTS, outputs):
        tokens = prompt + output.response_tokens
        routed = torch.as_tensor(output.routed_experts)
        assert routed.shape == (len(tokens), 3, 2) and routed.dtype == torch.int32
        assert (routed[-1] == -1).all()  # the last token is never fed back
        assert (routed[:, 0] == -1).all()  # layer 0 is dense
        # the same experts a single unpadded forward of the sequence picks (left/right padding, KV-cached decode
        # steps and batching change the numbers by ~1e-6, far from any of these tokens' top-2 margins)
        assert torch.equal(routed[:-1], _full_forward_routing(tokens)[:-1])


def test_a_dense_model_is_refused_in_one_line(tiny_llama_dir):
    with pytest.raises(ValueError, match="engine.routed_experts is true but the model at .* has no MoE router"):
        EmbeddedEngine(tiny_llama_dir, stop_token_ids=[2], routed_experts=True)


def test_without_the_switch_nothing_is_recorded(moe_dir):
    engine = EmbeddedEngine(moe_dir, stop_token_ids=[EOS])
    (output,) = engine.generate_batch([GenerateRequest(PROMPTS[0], SAMPLING, seed=0)])
    engine.close()
    assert output.routed_experts is None


def test_a_request_aborted_before_it_ran_reports_unrecorded_routing(moe_dir):
    # Regression (review): its routing was None, which miles serve could not encode (a 500) and which turned replay
    # off for its whole batch
    import asyncio

    engine = EmbeddedEngine(moe_dir, stop_token_ids=[EOS], routed_experts=True)
    engine.pause_now("keep")

    async def run():
        request = GenerateRequest(PROMPTS[0], SAMPLING, seed=0, request_id="held")
        task = asyncio.ensure_future(engine.generate(request))
        await asyncio.sleep(0.05)
        assert engine.abort("held") == 1
        return await task

    output = asyncio.run(run())
    engine.close()
    assert output.finish_reason == "abort" and output.response_tokens == []
    assert output.routed_experts.shape == (len(PROMPTS[0]), 3, 2) and (output.routed_experts == -1).all()
