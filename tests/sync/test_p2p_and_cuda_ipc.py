import threading

import pytest
import torch
import torch.multiprocessing as mp
from miles.sync import WeightReceiver, WeightSender
from miles.sync.transports.cuda_ipc import CudaIpcEndpoint, CudaIpcTransport
from miles.sync.transports.p2p import P2PEndpoint, P2PTransport, RemoteBuffer, mooncake_engine, nixl_engine


class LoopbackEngine:
    """A P2PEngine whose 'remote' memory is in this process: write copies into the registered buffer by address."""

    def __init__(self, session: str, registry: dict[int, torch.Tensor]) -> None:
        self.session = session
        self.registry = registry
        self.writes = 0

    def register(self, buffer: torch.Tensor) -> None:
        self.registry[buffer.data_ptr()] = buffer

    def write(self, local: torch.Tensor, remote: RemoteBuffer) -> None:
        self.registry[remote.address][: local.numel()].copy_(local)
        self.writes += 1


def test_p2p_transport_writes_buckets_into_receiver_slots_and_applies_on_commit():
    registry: dict[int, torch.Tensor] = {}
    sender_conn, engine_conn = mp.Pipe()
    applied = []
    receiver = WeightReceiver(apply_fn=lambda named: applied.append({n: t.clone() for n, t in named}))
    endpoint = P2PEndpoint(receiver, LoopbackEngine("engine", registry), engine_conn)
    server = threading.Thread(target=lambda: [None for _ in iter(endpoint.serve_update, False)])
    server.start()
    sender_engine = LoopbackEngine("trainer", registry)
    transport = P2PTransport(sender_engine, sender_conn, timeout_s=30)
    sender = WeightSender(transport, bucket_bytes=128)
    state = {"a": torch.arange(32.0), "b": torch.arange(8, dtype=torch.int64), "c": torch.ones(3, 3)}
    try:
        assert sender.push(state.items()) == 1
        assert sender.push(state.items()) == 2
    finally:
        transport.close()
        server.join(timeout=30)
    assert receiver.weight_version == 2 and len(applied) == 2
    for name, tensor in state.items():
        assert torch.equal(applied[1][name], tensor)
    assert sender_engine.writes == 2 * len(transport.slots)  # one one-sided write per bucket


def test_p2p_engine_factories_name_the_package_to_install_when_absent():
    try:
        import mooncake  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install mooncake-transfer-engine"):
            mooncake_engine()
    try:
        import nixl  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install nixl"):
            nixl_engine()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_cuda_ipc_transport_without_a_gpu_raises_a_clear_error():
    sender_conn, _ = mp.Pipe()
    with pytest.raises(RuntimeError, match="CudaIpcTransport needs a CUDA GPU"):
        CudaIpcTransport(sender_conn)


def _cuda_engine(conn, results) -> None:
    def load(named):
        results.put({n: t.cpu() for n, t in named})

    CudaIpcEndpoint(WeightReceiver(apply_fn=load), conn).serve()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_update_reaches_another_process_bit_for_bit():
    context = mp.get_context("spawn")
    sender_conn, engine_conn = context.Pipe()
    results = context.Queue()
    engine = context.Process(target=_cuda_engine, args=(engine_conn, results))
    engine.start()
    transport = CudaIpcTransport(sender_conn)
    state = {"w": torch.randn(64, 64, device="cuda"), "b": torch.randn(64, device="cuda").bfloat16()}
    try:
        assert WeightSender(transport).push(state.items()) == 1
        received = results.get(timeout=60)
    finally:
        transport.close()
        engine.join(timeout=60)
    for name, tensor in state.items():
        assert torch.equal(received[name], tensor.cpu())
