"""The embedded engine in another process takes miles-sync updates over shared memory and generates with them."""

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import engine_processes  # noqa: E402
from miles.sync import WeightSender  # noqa: E402
from miles.sync.transports.shared_memory import SharedMemoryTransport  # noqa: E402

PROMPT = [1, 5, 9]


@pytest.mark.integration
def test_engine_process_generates_with_the_pushed_weights(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    trainer_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).requires_grad_(False)
    with torch.no_grad():  # new weights the engine has never seen
        generator = torch.Generator().manual_seed(1)
        for param in trainer_model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    ctx = mp.get_context("spawn")
    sender_conn, engine_conn = ctx.Pipe()
    results = ctx.Queue()
    args = (str(tiny_llama_dir), engine_conn, PROMPT, results)
    engine = ctx.Process(target=engine_processes.engine_worker, args=args)
    engine.start()
    try:
        transport = SharedMemoryTransport(sender_conn, timeout_s=120)
        version = WeightSender(transport).push(trainer_model.state_dict().items())
        before, after, tokens, log_probs = results.get(timeout=120)
        transport.close()
    finally:
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    assert (before, after) == (0, version) == (0, 1)
    expected_tokens, context = [], list(PROMPT)
    for log_prob in log_probs:  # greedy under the trainer's weights
        logits = trainer_model(input_ids=torch.tensor([context])).logits[0, -1]
        token = int(logits.argmax())
        assert log_prob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-5)
        expected_tokens.append(token)
        context.append(token)
        if token == 2:
            break
    assert tokens == expected_tokens
