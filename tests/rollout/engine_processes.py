"""Engine-side code for the cross-process weight update test (imported by spawned processes)."""

import torch
from miles.core.config import SamplingConfig
from miles.core.protocols import GenerateRequest
from miles.rollout.engines import EmbeddedEngine
from miles.sync.transports.shared_memory import SharedMemoryEndpoint


def engine_worker(model_dir: str, conn, prompt: list[int], results) -> None:
    """Serve one weight update into an EmbeddedEngine, then report its greedy generation."""
    torch.set_num_threads(1)
    engine = EmbeddedEngine(model_dir, dtype="fp32", stop_token_ids=[2])
    before = engine.weight_version
    endpoint = SharedMemoryEndpoint(engine.receiver, conn)
    endpoint.serve_update()
    sampling = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=4)
    out = engine.generate_batch([GenerateRequest(prompt, sampling, seed=0)])[0]
    results.put((before, engine.weight_version, out.response_tokens, out.log_probs))
    endpoint.serve()  # until the trainer closes the transport
