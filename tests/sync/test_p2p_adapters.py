"""The Mooncake and NIXL ``P2PEngine`` adapters against in-process fakes of the engines' Python APIs.

Each fake implements exactly the calls the adapter makes, with the real names, argument order and return
conventions (see ``miles/sync/transports/p2p_engines.py`` for where each was checked), and moves bytes for real:
``ctypes.memmove`` between CPU tensors registered by address. Like the real engines, a fake refuses memory it was
not told about (Mooncake: unregistered on either side; NIXL: not in the peer metadata the writer loaded).
"""

import ctypes
import itertools
import json
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from miles.sync import WeightReceiver, WeightSender
from miles.sync.transports.p2p import P2PEndpoint, P2PTransport, RemoteBuffer, mooncake_engine, nixl_engine
from miles.sync.transports.p2p_engines import MooncakeEngine, NixlEngine

sys.path.insert(0, str(Path(__file__).parent))
from sync_processes import small_state  # noqa: E402


def _inside(regions, address: int, length: int) -> bool:
    return any(start <= address and address + length <= start + size for start, size in regions)


class Faults:
    """What the fake engines do to the next transfers: ``fail`` of them fail, or all of them ``hang``."""

    def __init__(self) -> None:
        self.fail, self.hang, self.attempts = 0, False, 0

    def outcome(self) -> str:
        self.attempts += 1
        if self.hang:
            return "hang"
        if self.fail > 0:
            self.fail -= 1
            return "fail"
        return "ok"


def fake_mooncake(faults: Faults) -> types.ModuleType:
    """A ``mooncake.engine`` module: ``TransferEngine`` as bound in mooncake-integration/transfer_engine."""
    module = types.ModuleType("mooncake.engine")
    segments: dict[str, object] = {}  # segment name "host:port" -> engine, what P2PHANDSHAKE resolves
    ports, batch_ids = itertools.count(17000), itertools.count(1)

    class TransferEngine:
        def __init__(self) -> None:
            self.regions: dict[int, int] = {}
            self.batches: dict[int, tuple] = {}

        def initialize(self, local_hostname, metadata_server, protocol, device_name) -> int:
            self.port = next(ports)
            segments[f"{local_hostname}:{self.port}"] = self
            return 0

        def get_rpc_port(self) -> int:
            return self.port

        def register_memory(self, buffer_addr, capacity, location="*") -> int:
            self.regions[buffer_addr] = capacity
            return 0

        def unregister_memory(self, buffer_addr) -> int:
            return 0 if self.regions.pop(buffer_addr, None) is not None else -1

        def _copy(self, target_hostname, buffer, peer_buffer_address, length) -> bool:
            peer = segments.get(target_hostname)
            if peer is None or not _inside(self.regions.items(), buffer, length):
                return False
            if not _inside(peer.regions.items(), peer_buffer_address, length):
                return False
            ctypes.memmove(peer_buffer_address, buffer, length)
            return True

        def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
            if target_hostname not in segments:
                return 2**64 - 1  # `return -1` from a batch_id_t (uint64) function
            batch = next(batch_ids)
            self.batches[batch] = (faults.outcome(), target_hostname, buffer, peer_buffer_address, length, [0])
            return batch

        def transfer_check_status(self, batch_id) -> int:
            outcome, *args, polls = self.batches[batch_id]
            polls[0] += 1
            if outcome == "hang" or polls[0] == 1:  # pending on the first poll: the adapter has to wait
                return 0
            del self.batches[batch_id]
            return 1 if outcome == "ok" and self._copy(*args) else -1

        def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
            outcome = faults.outcome()
            ok = outcome == "ok" and self._copy(target_hostname, buffer, peer_buffer_address, length)
            return 0 if ok else -1

    module.TransferEngine = TransferEngine
    return module


def fake_nixl(faults: Faults) -> types.ModuleType:
    """A ``nixl._api`` module: ``nixl_agent`` and ``nixl_agent_config`` as in ai-dynamo/nixl src/api/python."""
    module = types.ModuleType("nixl._api")
    handles = itertools.count(1)

    class nixlNotFoundError(Exception):  # the bindings raise this name
        pass

    class nixl_agent_config:
        def __init__(self, enable_prog_thread=True, enable_listen_thread=False, listen_port=0, backends=["UCX"]):  # noqa: B006
            self.backends = backends

    class nixl_agent:
        def __init__(self, agent_name, nixl_conf=None, instantiate_all=False):
            assert nixl_conf.backends == ["UCX"]
            self.name = agent_name
            self.regions: list[tuple] = []  # (mem_type, addr, len, dev_id)
            self.remote: dict[str, list[tuple]] = {}  # agent -> regions in the metadata last loaded for it
            self.xfers: dict[int, list] = {}

        def register_memory(self, reg_list, mem_type=None, backends=[]):  # noqa: B006
            assert mem_type in ("DRAM", "VRAM") and all(len(desc) == 4 for desc in reg_list)
            descs = [(mem_type, addr, length, dev) for addr, length, dev, _ in reg_list]
            self.regions += descs
            return descs

        def deregister_memory(self, dereg_list, backends=[]):  # noqa: B006
            for desc in dereg_list:
                self.regions.remove(desc)

        def get_agent_metadata(self) -> bytes:
            return json.dumps({"agent": self.name, "regions": self.regions}).encode()

        def add_remote_agent(self, metadata: bytes) -> bytes:
            loaded = json.loads(metadata)
            self.remote[loaded["agent"]] = [tuple(region) for region in loaded["regions"]]
            return loaded["agent"].encode()  # the binding returns py::bytes

        def get_xfer_descs(self, descs, mem_type=None):
            assert mem_type in ("DRAM", "VRAM") and all(len(desc) == 3 for desc in descs)
            return [(mem_type, *desc) for desc in descs]

        @staticmethod
        def _known(regions, descs) -> bool:
            return all(
                any(m == mem and d == dev and a <= addr and addr + n <= a + size for m, a, size, d in regions)
                for mem, addr, n, dev in descs
            )

        def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, notif_msg=b"", backends=[]):  # noqa: B006
            assert operation == "WRITE"
            if remote_agent not in self.remote:
                raise nixlNotFoundError("NIXL_ERR_NOT_FOUND")
            if not self._known(self.regions, local_descs) or not self._known(self.remote[remote_agent], remote_descs):
                raise nixlNotFoundError("NIXL_ERR_NOT_FOUND")
            handle = next(handles)
            self.xfers[handle] = [local_descs, remote_descs, None]
            return handle

        def transfer(self, handle, notif_msg=b"") -> str:
            outcome = faults.outcome()
            self.xfers[handle][2] = outcome
            return "ERR" if outcome == "fail" else "PROC"

        def check_xfer_state(self, handle) -> str:
            local, remote, outcome = self.xfers[handle]
            if outcome == "hang":
                return "PROC"
            for (_, src, n, _), (_, dst, _, _) in zip(local, remote):
                ctypes.memmove(dst, src, n)
            return "DONE"

        def release_xfer_handle(self, handle):
            del self.xfers[handle]

    module.nixl_agent, module.nixl_agent_config, module.nixlNotFoundError = (
        nixl_agent,
        nixl_agent_config,
        nixlNotFoundError,
    )
    return module


@pytest.fixture
def faults() -> Faults:
    return Faults()


@pytest.fixture
def mooncake(monkeypatch, faults):
    module = fake_mooncake(faults)
    monkeypatch.setitem(sys.modules, "mooncake", types.ModuleType("mooncake"))
    monkeypatch.setitem(sys.modules, "mooncake.engine", module)
    return module


@pytest.fixture
def nixl(monkeypatch, faults):
    module = fake_nixl(faults)
    monkeypatch.setitem(sys.modules, "nixl", types.ModuleType("nixl"))
    monkeypatch.setitem(sys.modules, "nixl._api", module)
    return module


def _engines(kind: str, **kwargs):
    if kind == "mooncake":
        return (mooncake_engine(hostname="10.0.0.1", **kwargs), mooncake_engine(hostname="10.0.0.2", **kwargs))
    return nixl_engine(name="trainer", **kwargs), nixl_engine(name="engine", **kwargs)


def _round_trip(sender_engine, receiver_engine, states, device="cpu", **sender_kwargs):
    """Push ``states`` in order through P2PTransport -> P2PEndpoint (as tests/sync/test_p2p_and_cuda_ipc.py does),
    both sides' slots on ``device``; return the receiver and what it applied per update (cloned, on the CPU)."""
    sender_conn, engine_conn = mp.Pipe()
    applied = []
    receiver = WeightReceiver(apply_fn=lambda named: applied.append({n: t.cpu().clone() for n, t in named}))
    endpoint = P2PEndpoint(receiver, receiver_engine, engine_conn, device=device)
    server = threading.Thread(target=lambda: [None for _ in iter(endpoint.serve_update, False)])
    server.start()
    transport = P2PTransport(sender_engine, sender_conn, timeout_s=30, device=device)
    sender = WeightSender(transport, bucket_bytes=128, **sender_kwargs)
    try:
        for state in states:
            sender.push(list(state.items()))
    finally:
        transport.close()
        server.join(timeout=30)
    return receiver, applied


@pytest.mark.parametrize("kind", ["mooncake", "nixl"])
def test_adapter_delivers_updates_bit_for_bit_through_p2p(kind, request):
    request.getfixturevalue(kind)
    sender_engine, receiver_engine = _engines(kind, timeout_s=5)
    # Step 2's wider tensor needs a bigger slot: a new registration (for NIXL, newer metadata) mid-run.
    states = [small_state(1), small_state(2, wide=True)]
    receiver, applied = _round_trip(sender_engine, receiver_engine, states)
    assert receiver.weight_version == 2 and len(applied) == 2
    for state, got in zip(states, applied):
        for name, tensor in state.items():
            assert got[name].dtype == tensor.dtype and torch.equal(
                got[name].view(torch.uint8), tensor.view(torch.uint8)
            )


def test_mooncake_without_the_async_api_uses_transfer_sync_write(mooncake, monkeypatch):
    monkeypatch.delattr(mooncake.TransferEngine, "transfer_submit_write")
    sender_engine, receiver_engine = _engines("mooncake")
    assert not sender_engine._async
    receiver, applied = _round_trip(sender_engine, receiver_engine, [small_state(3)])
    assert torch.equal(applied[0]["q_proj.weight"], small_state(3)["q_proj.weight"])


def _slot_pair(sender_engine, receiver_engine, nbytes=256):
    """A registered source and a registered destination described the way P2PEndpoint describes it."""
    local, remote = torch.arange(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    sender_engine.register(local)
    receiver_engine.register(remote)
    metadata = getattr(receiver_engine, "metadata", b"")
    return local, remote, RemoteBuffer(receiver_engine.session, remote.data_ptr(), nbytes, "cpu", metadata)


@pytest.mark.parametrize("kind", ["mooncake", "nixl"])
def test_a_failed_write_is_retried_then_succeeds(kind, request, faults):
    request.getfixturevalue(kind)
    sender_engine, receiver_engine = _engines(kind, retries=2)
    local, remote, buffer = _slot_pair(sender_engine, receiver_engine)
    faults.fail = 2
    sender_engine.write(local, buffer)
    assert faults.attempts == 3 and torch.equal(remote, local)


@pytest.mark.parametrize("kind", ["mooncake", "nixl"])
def test_a_write_failing_every_attempt_raises_connection_error_naming_peer_bytes_and_attempts(kind, request, faults):
    request.getfixturevalue(kind)
    sender_engine, receiver_engine = _engines(kind, retries=1)
    local, _, buffer = _slot_pair(sender_engine, receiver_engine)
    faults.fail = 10
    with pytest.raises(ConnectionError, match=rf"256 bytes to peer {receiver_engine.session} .* after 2 attempt"):
        sender_engine.write(local, buffer)
    assert faults.attempts == 2


@pytest.mark.parametrize("kind", ["mooncake", "nixl"])
def test_a_hung_write_times_out_within_timeout_s_per_attempt(kind, request, faults):
    request.getfixturevalue(kind)
    sender_engine, receiver_engine = _engines(kind, timeout_s=0.2, retries=1)
    local, _, buffer = _slot_pair(sender_engine, receiver_engine)
    faults.hang = True
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"to peer {receiver_engine.session} .* after 2 attempt\(s\) of up to 0.2s"):
        sender_engine.write(local, buffer)
    assert 0.4 <= time.monotonic() - start < 2.0 and faults.attempts == 2


def test_weight_sender_retries_the_update_after_the_engine_gives_up(mooncake, faults):
    # The adapter's ConnectionError is what WeightSender retries a whole update on.
    sender_engine, receiver_engine = _engines("mooncake", retries=0)
    faults.fail = 1
    receiver, applied = _round_trip(sender_engine, receiver_engine, [small_state(4)], retries=1)
    assert receiver.weight_version == 1 and torch.equal(applied[0]["steps"], small_state(4)["steps"])


@pytest.mark.parametrize("kind", ["mooncake", "nixl"])
def test_unregistered_memory_is_refused(kind, request, faults):
    request.getfixturevalue(kind)
    sender_engine, receiver_engine = _engines(kind, retries=0)
    local, _, buffer = _slot_pair(sender_engine, receiver_engine)
    with pytest.raises(ValueError, match="not inside memory registered"):
        sender_engine.write(torch.ones(16, dtype=torch.uint8), buffer)
    with pytest.raises(ValueError, match="not inside memory registered"):
        sender_engine.write(torch.cat([local, local]), buffer)  # a copy, elsewhere
    assert faults.attempts == 0
    with pytest.raises(ValueError, match="do not fit"):
        sender_engine.write(local, RemoteBuffer(buffer.session, buffer.address, 8, "cpu", buffer.metadata))
    # A destination the peer never registered: the engine refuses it (Mooncake -1, NIXL NOT_FOUND), no retry hides it.
    stray = torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(ConnectionError, match="after 1 attempt"):
        sender_engine.write(local, RemoteBuffer(buffer.session, stray.data_ptr(), 256, "cpu", buffer.metadata))
    assert not stray.any()


def test_nixl_writer_loads_peer_metadata_and_rejects_metadata_of_another_agent(nixl):
    sender_engine, receiver_engine = _engines("nixl")
    local, remote, buffer = _slot_pair(sender_engine, receiver_engine)
    sender_engine.write(local, buffer)
    assert torch.equal(remote, local) and sender_engine._peers["engine"] == buffer.metadata
    # Without metadata (an explicit add_peer over the caller's own connection instead), the peer must be known.
    stranger = nixl_engine(name="stranger")
    with pytest.raises(ConnectionError, match="NOT_FOUND"):
        sender_engine.write(local, RemoteBuffer("stranger", remote.data_ptr(), 256))
    with pytest.raises(ValueError, match="belongs to agent 'stranger'"):
        sender_engine.write(local, RemoteBuffer("engine", remote.data_ptr(), 256, "cpu", stranger.metadata))


def test_engines_validate_their_settings(mooncake):
    with pytest.raises(ValueError, match="retries"):
        MooncakeEngine(retries=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        MooncakeEngine(timeout_s=0)


def test_engines_unregister_on_close(mooncake, nixl):
    for engine in (MooncakeEngine(hostname="h"), NixlEngine(name="a")):
        buffer = torch.zeros(64, dtype=torch.uint8)
        engine.register(buffer)
        engine.close()
        assert engine._regions == {}
        with pytest.raises(ValueError, match="not inside memory registered"):
            engine.write(buffer, RemoteBuffer("peer", 0, 64))


def test_factories_name_the_package_when_it_is_absent(monkeypatch):
    for name in ("mooncake", "mooncake.engine", "nixl", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules makes the import raise ImportError
    with pytest.raises(ImportError, match="pip install mooncake-transfer-engine"):
        mooncake_engine()
    with pytest.raises(ImportError, match="pip install nixl"):
        nixl_engine()


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind", ["mooncake", "nixl"])
def test_real_engine_round_trip_in_one_process(kind, device):
    """The adapters on the real packages (skipped where they are not installed, as on the CPU CI machine):
    Mooncake over TCP with P2P handshake, NIXL over UCX, two engines in this process, loopback."""
    pytest.importorskip("mooncake.engine" if kind == "mooncake" else "nixl._api", reason=f"needs the real {kind}")
    if kind == "mooncake":
        sender_engine, receiver_engine = (MooncakeEngine(hostname="127.0.0.1", protocol="tcp") for _ in range(2))
    else:
        sender_engine, receiver_engine = NixlEngine(), NixlEngine()
    states = [small_state(1), small_state(2, wide=True)]
    try:
        receiver, applied = _round_trip(sender_engine, receiver_engine, states, device=device)
    finally:
        sender_engine.close()
        receiver_engine.close()
    assert receiver.weight_version == 2
    for state, got in zip(states, applied):
        for name, tensor in state.items():
            assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8))
