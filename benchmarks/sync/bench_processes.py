"""Process entry points and model shapes for the miles-sync benchmarks (spawned children import this by name)."""

import datetime

import torch
import torch.distributed as dist
from miles.sync import WeightReceiver, WeightSender
from miles.sync.transports.distributed import DistributedEndpoint, DistributedTransport
from miles.sync.transports.shared_memory import SharedMemoryEndpoint

NUM_THREADS = 2  # the CI machine has 2 cores; every process pins this so runs compare


def llama_135m_state(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Synthetic tensors with SmolLM2-135M's shapes: hidden 576, MLP 1536, 30 layers, 9 query / 3 KV heads of 64,
    vocab 49152 (tied embeddings). 134.5M parameters, 513 MiB in float32."""
    hidden, mlp, kv, vocab, layers = 576, 1536, 3 * 64, 49152, 30
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    state = {"model.embed_tokens.weight": weight(vocab, hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        state |= {
            prefix + "self_attn.q_proj.weight": weight(hidden, hidden),
            prefix + "self_attn.k_proj.weight": weight(kv, hidden),
            prefix + "self_attn.v_proj.weight": weight(kv, hidden),
            prefix + "self_attn.o_proj.weight": weight(hidden, hidden),
            prefix + "mlp.gate_proj.weight": weight(mlp, hidden),
            prefix + "mlp.up_proj.weight": weight(mlp, hidden),
            prefix + "mlp.down_proj.weight": weight(hidden, mlp),
            prefix + "input_layernorm.weight": weight(hidden),
            prefix + "post_attention_layernorm.weight": weight(hidden),
        }
    state["model.norm.weight"] = weight(hidden)
    return state


def shared_memory_engine(conn, copy_into_model: bool) -> None:
    """Serve updates; ``copy_into_model`` copies each tensor into a preallocated model, else keeps only views."""
    torch.set_num_threads(NUM_THREADS)
    model = {name: torch.empty_like(t) for name, t in llama_135m_state().items()} if copy_into_model else {}

    def load(named_tensors):
        for name, tensor in named_tensors:
            if copy_into_model:
                model[name].copy_(tensor)

    SharedMemoryEndpoint(WeightReceiver(apply_fn=load), conn).serve()


def gloo_rank(rank: int, init_file: str, commands, done, payload_mib: int) -> None:
    """Rank 0 pushes a ``payload_mib`` MiB update on each command; rank 1 serves."""
    torch.set_num_threads(NUM_THREADS)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        if rank == 0:
            transport = DistributedTransport(src=0)
            sender = WeightSender(transport, bucket_bytes=128 * 2**20)
            state = {f"w{i}": torch.randn(2**20 // 4 * 16) for i in range(payload_mib // 16)}  # 16 MiB tensors
            while commands.get() == "push":
                sender.push(state.items())
                done.put("pushed")
            transport.close()
        else:
            DistributedEndpoint(WeightReceiver(apply_fn=lambda named_tensors: None), src=0).serve()
    finally:
        dist.destroy_process_group()
