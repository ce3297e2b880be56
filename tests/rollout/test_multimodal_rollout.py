"""Image prompts through the rollout: the VLM's processor renders token ids and pixel inputs once
(``miles.rollout.multimodal``), the embedded engine generates from exactly those, and nothing re-processes an image.
All on the tiny random Qwen3-VL twin (``tiny_vlm_dir``)."""

import asyncio
import base64

import pytest
import torch
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest
from miles.core.sample import SampleStatus
from miles.rollout.data.visual_tasks import VisualTaskSource, decode_images, encode_png, make_problem
from miles.rollout.engines import EmbeddedEngine
from miles.rollout.generate import generate_group
from miles.rollout.multimodal import VisionProcessor, load_image, load_tokenizer
from PIL import Image

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    return load_tokenizer(tiny_vlm_dir)


@pytest.fixture(scope="module")
def engine(tiny_vlm_dir):
    return EmbeddedEngine(tiny_vlm_dir, dtype="fp32")


def problems(n: int):
    source = VisualTaskSource(size=8, seed=0)
    return [source.sample_at(i, i) for i in range(n)]


def test_render_expands_each_image_to_its_merged_patches_and_keeps_the_processors_pixels(processor):
    assert isinstance(processor, VisionProcessor)
    sample = problems(1)[0]
    tokens, inputs = processor.render_sample(sample)
    ids = {t: processor.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")}
    # 64 x 64 px in 16 px patches: a 4 x 4 grid (t = 1, the frame doubled to temporal_patch_size 2); 2 x 2 merged
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]] and inputs["image_grid_thw"].dtype == torch.int64
    assert inputs["pixel_values"].shape == (16, 3 * 2 * 16 * 16) and inputs["pixel_values"].dtype == torch.float32
    start = tokens.index(ids["<|vision_start|>"])
    assert tokens[start + 1 : start + 6] == [ids["<|image_pad|>"]] * 4 + [ids["<|vision_end|>"]]
    assert tokens.count(ids["<|image_pad|>"]) == 4
    assert processor.decode(tokens) == (
        "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>How many circles are in the "
        "image? Answer with a single digit.<|im_end|>\n<|im_start|>assistant\n"
    )
    expected = processor.image_processor(images=decode_images(sample), return_tensors="pt")["pixel_values"]
    assert torch.equal(inputs["pixel_values"], expected.float())  # the model's own image processor, unchanged


def test_images_that_do_not_match_the_prompt_or_cannot_be_read_are_refused(processor):
    sample = problems(1)[0]
    sample.metadata["images"] = sample.metadata["images"] * 2
    with pytest.raises(ValueError, match="the prompt has 1 image parts but 2 images"):
        processor.render_sample(sample)
    with pytest.raises(ValueError, match="not a readable image"):
        load_image(base64.b64encode(b"not an image").decode())
    with pytest.raises(ValueError, match="of type int"):
        load_image(3)


def test_an_image_loads_from_base64_text_bytes_or_a_path(tmp_path):
    image = Image.new("RGB", (8, 8), (10, 20, 30))
    image.putpixel((3, 4), (200, 100, 0))
    text = encode_png(image)
    # base64 whose first "/" comes after 255 characters: as a file name it raises ENAMETOOLONG, which once made such
    # images unreadable (visual problem 9 of seed 0: 267 characters; 1 in ~10 of them)
    _, picture, _ = make_problem(9, seed=0)
    long_text = encode_png(picture)
    assert len(long_text.split("/")[0]) > 255
    assert list(load_image(long_text).getdata()) == list(picture.getdata())
    assert list(load_image("data:image/png;base64," + text).getdata()) == list(image.getdata())
    (tmp_path / "a.png").write_bytes(base64.b64decode(text))
    for entry in (text, base64.b64decode(text), str(tmp_path / "a.png"), tmp_path / "a.png", image):
        assert list(load_image(entry).getdata()) == list(image.getdata())


def test_the_engine_batches_image_prompts_as_it_runs_them_alone(engine, processor):
    rendered = [processor.render_sample(s) for s in problems(3)]
    requests = [GenerateRequest(t, SAMPLING, seed=i, multimodal_inputs=m) for i, (t, m) in enumerate(rendered)]
    together = engine.generate_batch(requests)
    for request, out in zip(requests, together):
        alone = engine.generate_batch([request])[0]
        assert alone.response_tokens == out.response_tokens
        assert max(abs(a - b) for a, b in zip(alone.log_probs, out.log_probs)) < 1e-5


def test_decode_and_prefill_log_probs_agree_and_depend_on_the_image(tiny_vlm_dir, engine, processor):
    rendered = [processor.render_sample(s) for s in problems(2)]
    requests = [GenerateRequest(t, SAMPLING, seed=i, multimodal_inputs=m) for i, (t, m) in enumerate(rendered)]
    prefill = engine.generate_batch(requests)
    decode = EmbeddedEngine(tiny_vlm_dir, dtype="fp32", logprob_mode="decode").generate_batch(requests)
    for p, d in zip(prefill, decode):
        assert p.response_tokens == d.response_tokens
        assert max(abs(a - b) for a, b in zip(p.log_probs, d.log_probs)) < 1e-5
    # problem 1's picture under problem 0's prompt (both 16 patches): the same tokens score differently
    tokens, own = rendered[0]
    response = prefill[0].response_tokens
    scored = [engine.score([tokens], [response], temperature=1.0, multimodal=[m]) for m in (own, rendered[1][1])]
    assert torch.allclose(scored[0][0], torch.tensor(prefill[0].log_probs), atol=1e-6)
    assert (scored[0] - scored[1]).abs().max() > 1e-3


def test_placeholders_that_disagree_with_the_images_are_refused(engine, processor):
    tokens, inputs = processor.render_sample(problems(1)[0])
    image_id = processor.convert_tokens_to_ids("<|image_pad|>")
    dropped = list(tokens)
    dropped.remove(image_id)  # a prompt rendered for 3 merged patches, images processed into 4
    with pytest.raises(ValueError, match="row 0 has 3 image placeholder tokens but its images fill 4"):
        engine.generate_batch([GenerateRequest(dropped, SAMPLING, seed=0, multimodal_inputs=inputs)])
    bad = {**inputs, "image_grid_thw": torch.tensor([[1, 2, 4]])}
    with pytest.raises(ValueError, match="image_grid_thw covers 8 patches but pixel_values has 16"):
        engine.generate_batch([GenerateRequest(tokens, SAMPLING, seed=0, multimodal_inputs=bad)])


def test_text_only_engines_refuse_images_in_one_line(tiny_llama_dir, processor):
    from miles.rollout.engines.sglang_api import generate_payload
    from miles.rollout.engines.vllm import VLLMEngine

    _, inputs = processor.render_sample(problems(1)[0])
    request = GenerateRequest([1, 5], SAMPLING, seed=0, multimodal_inputs=inputs)
    text_engine = EmbeddedEngine(tiny_llama_dir, dtype="fp32", stop_token_ids=[2])
    with pytest.raises(ValueError, match=r"carries images but the engine's model \(LlamaForCausalLM\) is text-only"):
        text_engine.generate_batch([request])
    with pytest.raises(ValueError, match="the request has image inputs but no image_data"):
        generate_payload(request, stop_token_ids=None)  # SGLang-API servers process image files, not tensors
    with pytest.raises(ValueError, match="has images but this vLLM engine serves a text model"):
        VLLMEngine(["http://s0"], model="m").request_body(request)  # no image_token_id: no server needed


def test_a_group_renders_once_and_every_sample_carries_the_same_inputs(engine, processor):
    prompt = problems(1)[0]
    tokens, inputs = processor.render_sample(prompt)
    samples = asyncio.run(generate_group(engine, processor, prompt, n=3, sampling=SAMPLING, seeds=[0, 1, 2]))
    for sample in samples:
        assert sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        assert sample.tokens[: sample.prompt_length] == tokens and sample.response_length > 0
        assert sample.multimodal_inputs is samples[0].multimodal_inputs  # one render for the group
        assert torch.equal(sample.multimodal_inputs["pixel_values"], inputs["pixel_values"])
        assert sample.response_text is not None
    # the same prompt for a text-only policy (its plain tokenizer): the group fails, saying why
    failed = asyncio.run(generate_group(engine, processor.tokenizer, prompt, n=2, sampling=SAMPLING, seeds=[0, 1]))
    assert all(s.status == SampleStatus.FAILED for s in failed)
    failure = failed[0].metadata["failure"]
    assert "the prompt has images (metadata['images']) but the policy's tokenizer is not a vision-language" in failure


def test_vision_tokens_are_never_sampled_and_placeholders_without_images_are_refused(engine, processor):
    """A response holding an image placeholder would not match its images (the trainer would refuse the row), so the
    engine never samples the vision tokens; a prompt rendered with placeholders but without its images is refused."""
    from miles.rollout.engines.embedded import RowSampler

    ids = [processor.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")]
    assert set(ids) <= set(engine.vision_token_ids) and len(engine.vision_token_ids) == 4
    logits = torch.zeros(2, len(processor))
    logits[:, ids] = 50.0  # nearly all the mass on the vision tokens
    sampler = RowSampler(SAMPLING, [torch.Generator().manual_seed(s) for s in (0, 1)], banned=engine.vision_token_ids)
    for _ in range(20):
        chosen = sampler(torch.zeros(2, 1, dtype=torch.int64), logits).argmax(dim=-1)
        assert not set(chosen.tolist()) & set(engine.vision_token_ids)
    tokens, _ = processor.render_sample(problems(1)[0])
    with pytest.raises(ValueError, match="row 0 has image placeholder tokens but no images"):
        engine.score([tokens], [[5, 6]], temperature=1.0)


def test_renders_from_many_threads_agree_and_the_processor_pickles(processor):
    """The rollout renders image prompts in worker threads; an HF fast tokenizer used by two threads at once can
    fail, so renders take turns. The processor still pickles and copies (its lock is recreated)."""
    import copy
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    prompts = problems(3)
    expected = [processor.render_sample(p)[0] for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: processor.render_sample(prompts[i % 3])[0], range(48)))
    assert got == [expected[i % 3] for i in range(48)]
    assert pickle.dumps(processor)  # it serializes (Ray, worker processes); copying runs the same state protocol
    again = copy.deepcopy(processor)
    assert again.render_sample(prompts[0])[0] == expected[0] and again.merge_size == processor.merge_size


def test_a_text_prompt_renders_as_the_text_path_does(processor):
    from miles.core.sample import Sample
    from miles.rollout.generate import render_prompt

    sample = Sample(index=0, group_index=0, prompt="What is 2 + 2?")
    tokens, inputs = processor.render_sample(sample)
    assert inputs is None and tokens and tokens == render_prompt(processor, "What is 2 + 2?")
    sample.prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    assert processor.render_sample(sample) == (render_prompt(processor, sample.prompt), None)
    sample.prompt = [5, 6, 7]
    assert processor.render_sample(sample) == ([5, 6, 7], None)
    sample.prompt = "What is 2 + 2?"
    sample.metadata["images"] = [encode_png(Image.new("RGB", (8, 8)))]
    with pytest.raises(ValueError, match="needs a chat-message prompt with image parts"):
        processor.render_sample(sample)


def test_image_data_is_each_images_file_as_base64_and_decodes_to_the_same_pixels(tmp_path):
    from miles.rollout.multimodal import image_data

    png = encode_png(Image.new("RGB", (40, 24), (200, 30, 60)))  # base64 text, as the visual task stores it
    path = tmp_path / "red.png"
    path.write_bytes(base64.b64decode(png))
    entries = [png, str(path), f"data:image/png;base64,{png}", base64.b64decode(png), load_image(png)]
    payloads = image_data(entries)
    assert payloads[:4] == [png, png, png, png]  # the file's own bytes: no re-encoding
    for entry, payload in zip(entries, payloads):
        assert list(load_image(payload).getdata()) == list(load_image(entry).getdata())
    with pytest.raises(ValueError, match="not a readable image"):
        image_data(["bm90IGFuIGltYWdl"])


def test_an_image_request_travels_as_input_ids_and_image_data_and_the_server_side_parses_it(processor):
    from miles.rollout.engines.sglang_api import generate_payload, parse_generate_request
    from miles.rollout.multimodal import image_data

    prompt = problems(1)[0]
    tokens, inputs = processor.render_sample(prompt)
    payload = image_data(prompt.metadata["images"])
    request = GenerateRequest(tokens, SAMPLING, seed=0, multimodal_inputs=inputs, image_data=payload)
    body = generate_payload(request, stop_token_ids=None)
    assert body["input_ids"] == tokens and body["image_data"] == payload  # placeholders expanded, files beside
    parsed, _ = parse_generate_request(body, vocab_size=len(processor), context_length=4096, stop_token_ids=[])
    assert parsed.prompt_tokens == tokens and parsed.image_data == payload and parsed.multimodal_inputs is None
    # the server's processor gives back exactly the trainer's pixels
    server = processor.image_inputs([load_image(entry) for entry in parsed.image_data])
    assert all(torch.equal(server[key], inputs[key]) for key in inputs)
    one, _ = parse_generate_request({**body, "image_data": payload[0]}, vocab_size=len(processor),
                                    context_length=4096, stop_token_ids=[])  # fmt: skip
    assert one.image_data == payload[:1]
    with pytest.raises(ValueError, match="image_data must be a base64 image"):
        parse_generate_request({**body, "image_data": [3]}, vocab_size=len(processor), context_length=4096,
                               stop_token_ids=[])  # fmt: skip
    assert generate_payload(GenerateRequest(tokens, SAMPLING), stop_token_ids=None).get("image_data") is None


def test_miles_serve_decodes_image_data_as_base64_only_and_names_the_bad_entry(processor):
    from types import SimpleNamespace

    from miles.rollout.serve import _image_inputs

    prompt = problems(1)[0]
    _, inputs = processor.render_sample(prompt)
    state = SimpleNamespace(processor=processor, model_path="m")
    [png] = prompt.metadata["images"]
    for entry in (png, f"data:image/png;base64,{png}"):
        got = _image_inputs(state, [entry])
        assert all(torch.equal(got[key], inputs[key]) for key in inputs)
    with pytest.raises(ValueError, match=r"^image_data\[1\] is not base64 text"):
        _image_inputs(state, [png, "/etc/passwd"])  # a path is never opened: the server reads no local files
    with pytest.raises(ValueError, match=r"^image_data\[0\] is base64 but not an image file PIL can read$"):
        _image_inputs(state, [base64.b64encode(b"not an image").decode()])
    with pytest.raises(ValueError, match="takes text only"):
        _image_inputs(SimpleNamespace(processor=None, model_path="m"), [png])


class _CallThenEngine:
    """Turn 1 of every sample: a scripted calculator call (log-prob -0.5 per token); later turns: the real engine.
    Records the requests."""

    def __init__(self, engine, processor):
        self.engine, self.requests, self.weight_version = engine, [], 0
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
        self.call = processor(call, add_special_tokens=False)["input_ids"] + [
            processor.convert_tokens_to_ids("<|im_end|>")
        ]

    async def generate(self, request):
        from miles.core.protocols import GenerateOutput

        self.requests.append(request)
        if len(request.prompt_tokens) == self.prompt_length:
            return GenerateOutput(list(self.call), [-0.5] * len(self.call), "stop", weight_versions=[0])
        return await self.engine.generate(request)


def test_a_multi_turn_rollout_with_an_image_prompt_sends_the_images_every_turn_and_the_trainer_scores_them(
    tiny_vlm_dir, engine, processor
):
    """rollout.mode multi_turn with an image prompt: the trajectory starts with the rendered prompt (placeholders
    expanded), every turn's request carries the same pixel inputs and image files, the sample keeps them, and the
    trainer's log-probs of the engine's second turn (after the tool result) equal the engine's."""
    from miles.core.batch import build_train_batch
    from miles.core.config import MultiTurnConfig
    from miles.rollout.calculator import calculator
    from miles.rollout.multiturn import MultiTurnRollout
    from miles.train import FSDP2Backend, TrainConfig

    prompt = problems(1)[0]
    tokens, inputs = processor.render_sample(prompt)
    hybrid = _CallThenEngine(engine, processor)
    hybrid.prompt_length = len(tokens)
    rollout = MultiTurnRollout(hybrid, processor, config=MultiTurnConfig(max_turns=2), tools={"calculator": calculator})
    samples = asyncio.run(rollout.generate_group(prompt, n=2, sampling=SAMPLING, seeds=[0, 1]))
    assert len(hybrid.requests) == 4  # 2 samples x 2 turns
    for request in hybrid.requests:
        assert torch.equal(request.multimodal_inputs["pixel_values"], inputs["pixel_values"])
        assert request.image_data and request.prompt_tokens[: len(tokens)] == tokens
    for sample in samples:
        assert sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), sample.metadata
        assert sample.metadata["num_tool_calls"] == 1 and sample.metadata["num_turns"] == 2
        assert sample.tokens[: sample.prompt_length] == tokens
        assert torch.equal(sample.multimodal_inputs["pixel_values"], inputs["pixel_values"])
    batch = build_train_batch(samples, torch.tensor([1.0, -1.0]), pad_token_id=processor.pad_token_id)
    trainer = FSDP2Backend(tiny_vlm_dir, train=TrainConfig(dtype="fp32", micro_batch_size=2), temperature=1.0)
    log_probs = trainer.forward(batch, outputs={"old_log_probs"}).old_log_probs
    suffix = processor("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
        "input_ids"
    ]
    second = len(hybrid.call) + len(suffix)  # the engine's turn starts here in the response
    for row, sample in enumerate(samples):
        assert sample.response_length > second and sample.loss_mask[len(hybrid.call) : second] == [0] * len(suffix)
        engine_lp = torch.tensor(sample.rollout_log_probs[second:])
        torch.testing.assert_close(log_probs[row, second : sample.response_length], engine_lp, atol=1e-5, rtol=0)
    # the same rows scored without their images are refused (placeholders, no pixels), not silently text-scored
    with pytest.raises(ValueError, match="image placeholder tokens but no images"):
        trainer.forward(batch.replace(multimodal_inputs=(None, None)), outputs={"old_log_probs"})
