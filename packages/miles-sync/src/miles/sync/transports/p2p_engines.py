"""``P2PEngine`` adapters on Mooncake's TransferEngine and NVIDIA NIXL, with a timeout and bounded retry per write.

Both adapters keep a table of the memory they registered and refuse to write from anything else (RDMA needs it;
an unregistered source would otherwise fail deep in the NIC driver or, worse, on the peer). A write is one attempt
bounded by ``timeout_s``; a failed or timed-out attempt is retried ``retries`` times, then the write raises
``TimeoutError`` (the last attempt timed out) or ``ConnectionError`` (it failed): the errors ``WeightSender``
retries a whole update on. A retried write carries the same bytes to the same place, so an attempt that lands late
is harmless within the update; the receiver reads a slot only after the ``BucketReady`` sent when the write
returned.

The engine APIs used here were checked against their sources (names, argument order, return codes):

- Mooncake: kvcache-ai/Mooncake ``mooncake-integration/transfer_engine/transfer_engine_py.cpp`` (pybind
  ``TransferEngine``: ``initialize(local_hostname, metadata_server, protocol, device_name)`` -> 0/-1,
  ``get_rpc_port()``, ``register_memory(buffer_addr, capacity, location="*")`` -> 0/-1,
  ``unregister_memory(buffer_addr)``, ``transfer_submit_write(target_hostname, buffer, peer_buffer_address,
  length)`` -> batch id (``uint64``; ``-1`` on failure arrives as ``2**64 - 1``), ``transfer_check_status(batch_id)``
  -> 1 done, 0 pending, -1 failed, -2 Mooncake's own timeout, ``transfer_sync_write(...)`` -> 0/-1) and
  ``docs/source/python-api-reference/transfer-engine.md``; session ``f"{hostname}:{get_rpc_port()}"`` and
  metadata server ``"P2PHANDSHAKE"`` as in sgl-project/sglang
  ``python/sglang/srt/disaggregation/mooncake/transfer_engine.py`` and radixark/miles
  ``miles/backends/megatron_utils/update_weight/update_weight_from_rdma.py``.
- NIXL: ai-dynamo/nixl ``src/api/python/_api.py`` (``nixl_agent(agent_name, nixl_conf)``,
  ``nixl_agent_config(backends=[...])``, ``register_memory(reg_list, mem_type)`` with 4-tuples
  ``(addr, len, dev_id, meta)``, ``get_xfer_descs(descs, mem_type)`` with 3-tuples ``(addr, len, dev_id)``,
  ``get_agent_metadata()``, ``add_remote_agent(metadata)`` -> remote name, ``initialize_xfer("WRITE", local_descs,
  remote_descs, remote_agent)``, ``transfer(handle)`` / ``check_xfer_state(handle)`` -> "DONE" | "PROC" | "ERR",
  ``release_xfer_handle(handle)``, ``deregister_memory(reg_descs)``) and ``examples/python/nixl_api_example.py``;
  reloading metadata of a known agent adds its new memory sections (``src/core/nixl_agent.cpp`` ``loadRemoteMD``,
  ``examples/python/partial_md_example.py``). Only positional arguments that every version since 0.x shares are
  passed (``is_sorted`` was dropped from ``register_memory``/``get_xfer_descs`` later).
"""

import logging
import os
import socket
import time
import uuid

import torch
from miles.sync.transports.p2p import RemoteBuffer
from torch import Tensor

logger = logging.getLogger(__name__)

_MOONCAKE_INVALID_BATCH = 2**64 - 1  # INVALID_BATCH (UINT64_MAX): transfer_submit_write's ``return -1`` as uint64


class _AttemptFailed(Exception):
    """One write attempt failed (``timed_out``: it ran past ``timeout_s`` or the engine's own limit)."""

    def __init__(self, reason: str, *, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.timed_out = timed_out


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _RetryingEngine:
    """Registration bookkeeping plus the timeout/retry loop shared by the adapters; subclasses do one attempt."""

    kind = "P2P"
    session: str

    def __init__(self, *, timeout_s: float, retries: int, poll_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s is {timeout_s}; it must be > 0")
        if retries < 0:
            raise ValueError(f"retries is {retries}; it must be >= 0 (0 tries each write once)")
        self.timeout_s, self.retries, self.poll_s = timeout_s, retries, poll_s
        self._regions: dict[int, int] = {}  # start address -> nbytes of every buffer this side registered

    def _registered(self, address: int, nbytes: int) -> bool:
        return any(start <= address and address + nbytes <= start + size for start, size in self._regions.items())

    def _check_buffer(self, buffer: Tensor) -> None:
        if not buffer.is_contiguous():
            raise ValueError("P2P buffers must be contiguous (one address range)")

    def write(self, local: Tensor, remote: RemoteBuffer) -> None:
        """Write contiguous ``local`` (any dtype, inside memory this engine registered) to the start of ``remote``.

        Returns once the bytes are in the peer's memory. Each attempt is bounded by ``timeout_s`` seconds; a failed
        or timed-out attempt is retried up to ``retries`` times, so a write takes at most about
        ``(retries + 1) * timeout_s`` seconds (a Mooncake wheel without the async API: see ``MooncakeEngine``).

        Raises:
            ValueError: ``local`` is not contiguous, not inside registered memory, or larger than ``remote``; NIXL
                metadata in ``remote`` that names another agent.
            TimeoutError: the last attempt ran past ``timeout_s`` (or the engine's own transfer timeout).
            ConnectionError: the last attempt failed (engine error code, "ERR" state, unknown peer or memory), or
                NIXL could not load the peer's metadata.
        """
        self._check_buffer(local)
        nbytes = _nbytes(local)
        if not self._registered(local.data_ptr(), nbytes):
            raise ValueError(
                f"{self.kind} write source 0x{local.data_ptr():x} ({nbytes} bytes) is not inside memory registered "
                "with this engine; register() the buffer first"
            )
        if nbytes > remote.nbytes:
            raise ValueError(f"{nbytes} bytes do not fit the {remote.nbytes}-byte remote buffer of {remote.session}")
        self._prepare(remote)
        if local.device.type == "cuda":  # the NIC reads the memory directly: finish the kernels that filled it
            torch.cuda.current_stream(local.device).synchronize()
        attempts = self.retries + 1
        failure: _AttemptFailed | None = None
        for attempt in range(1, attempts + 1):
            try:
                self._write_once(local, nbytes, remote, time.monotonic() + self.timeout_s)
                return
            except _AttemptFailed as err:
                failure = err
            except Exception as err:  # the bindings raise their own types (nixlNotFoundError, RuntimeError, ...)
                failure = _AttemptFailed(f"{type(err).__name__}: {err}")
                failure.__cause__ = err
            if attempt < attempts:
                logger.warning(
                    "%s write of %d bytes to %s failed (attempt %d of %d), retrying: %s",
                    self.kind,
                    nbytes,
                    remote.session,
                    attempt,
                    attempts,
                    failure,
                )
        error = TimeoutError if failure.timed_out else ConnectionError
        raise error(
            f"{self.kind} write of {nbytes} bytes to peer {remote.session} (address 0x{remote.address:x}) failed "
            f"after {attempts} attempt(s) of up to {self.timeout_s}s: {failure}"
        ) from failure.__cause__

    def _wait(self, poll, deadline: float, what: str):
        """Call ``poll()`` until it returns non-None; back off from 10 us to ``poll_s`` between calls."""
        delay = 1e-5
        while (result := poll()) is None:
            if time.monotonic() >= deadline:
                raise _AttemptFailed(f"{what} not done within {self.timeout_s}s", timed_out=True)
            time.sleep(delay)
            delay = min(2 * delay, self.poll_s)
        return result

    def _prepare(self, remote: RemoteBuffer) -> None:
        """Make ``remote`` reachable before the first attempt (NIXL loads the peer's metadata here)."""

    def _write_once(self, local: Tensor, nbytes: int, remote: RemoteBuffer, deadline: float) -> None:
        raise NotImplementedError


class MooncakeEngine(_RetryingEngine):
    """``P2PEngine`` on Mooncake's ``TransferEngine`` (``pip install mooncake-transfer-engine``).

    ``session`` is ``"{hostname}:{rpc_port}"``, Mooncake's segment name that peers write to; with the default
    ``metadata_server="P2PHANDSHAKE"`` peers find each other from that name alone, nothing else to exchange.

    What bounds a write's time: it is submitted with ``transfer_submit_write`` and polled with
    ``transfer_check_status`` until ``timeout_s`` (Mooncake may end it earlier with its own ``MC_TRANSFER_TIMEOUT``,
    default 30 s, reported as a timeout). A wheel without the async pair falls back to the blocking
    ``transfer_sync_write``, which only Mooncake's own timeout (``MC_TRANSFER_TIMEOUT`` + 1 s per GiB) bounds.
    A batch abandoned at ``timeout_s`` is not freed (the Python API has no cancel): rare, and bounded by retries.

    Args:
        hostname: the address peers reach this host at (default ``socket.gethostname()``).
        metadata_server: ``"P2PHANDSHAKE"`` or an etcd/redis/http metadata URL.
        protocol: ``"rdma"`` (GPUDirect when buffers are on the GPU), ``"tcp"``, ...
        device_name: comma-separated RDMA NICs to use, "" for all.
        timeout_s: seconds per write attempt.
        retries: extra attempts after a failed or timed-out write.
        poll_s: longest sleep between status polls.

    Raises:
        ImportError: if ``mooncake`` is not installed. RuntimeError: if ``initialize`` fails.
    """

    kind = "Mooncake"

    def __init__(
        self,
        *,
        hostname: str | None = None,
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "rdma",
        device_name: str = "",
        timeout_s: float = 60.0,
        retries: int = 2,
        poll_s: float = 1e-3,
    ) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as err:
            raise ImportError(
                "the Mooncake P2P transport needs Mooncake's TransferEngine: pip install mooncake-transfer-engine"
            ) from err
        super().__init__(timeout_s=timeout_s, retries=retries, poll_s=poll_s)
        hostname = hostname or socket.gethostname()
        self.engine = TransferEngine()
        ret = self.engine.initialize(hostname, metadata_server, protocol, device_name)
        if ret != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({hostname!r}, {metadata_server!r}, {protocol!r}, "
                f"{device_name!r}) returned {ret}"
            )
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self._async = hasattr(self.engine, "transfer_submit_write") and hasattr(self.engine, "transfer_check_status")

    def register(self, buffer: Tensor) -> None:
        """Register ``buffer`` (contiguous, CPU or CUDA) for RDMA. Raises: RuntimeError if Mooncake refuses it."""
        self._check_buffer(buffer)
        ret = self.engine.register_memory(buffer.data_ptr(), _nbytes(buffer))
        if ret != 0:
            raise RuntimeError(f"Mooncake register_memory of {_nbytes(buffer)} bytes on {buffer.device} returned {ret}")
        self._regions[buffer.data_ptr()] = _nbytes(buffer)

    def close(self) -> None:
        """Unregister every buffer this engine registered (before the buffers are freed)."""
        for address in list(self._regions):
            self.engine.unregister_memory(address)
            del self._regions[address]

    def _write_once(self, local: Tensor, nbytes: int, remote: RemoteBuffer, deadline: float) -> None:
        args = (remote.session, local.data_ptr(), remote.address, nbytes)
        if not self._async:
            ret = self.engine.transfer_sync_write(*args)
            if ret != 0:
                raise _AttemptFailed(f"transfer_sync_write returned {ret}")
            return
        batch = self.engine.transfer_submit_write(*args)
        if batch < 0 or batch == _MOONCAKE_INVALID_BATCH:
            raise _AttemptFailed(f"transfer_submit_write returned {batch} (peer unreachable or buffer unknown)")
        status = self._wait(lambda: self.engine.transfer_check_status(batch) or None, deadline, "the transfer")
        if status == -2:
            raise _AttemptFailed("Mooncake's transfer timeout (MC_TRANSFER_TIMEOUT) expired", timed_out=True)
        if status != 1:
            raise _AttemptFailed(f"transfer_check_status returned {status}")


class NixlEngine(_RetryingEngine):
    """``P2PEngine`` on an NVIDIA NIXL agent (``pip install nixl``).

    ``session`` is the agent's name (unique per process). NIXL writes only to agents whose metadata it loaded, and
    that metadata lists the registered memory, so it changes with every ``register``: ``metadata`` is this side's
    current metadata (bytes), and ``P2PEndpoint`` sends it in every ``RemoteBuffer`` it hands out; ``write`` loads a
    peer's metadata (``add_peer``) whenever a ``RemoteBuffer`` brings a version it has not loaded. Outside
    ``P2PEndpoint``, pass ``metadata`` over your own control connection and call ``add_peer`` on the writer.

    What bounds a write's time: ``transfer`` posts it, then ``check_xfer_state`` is polled until "DONE", "ERR" or
    ``timeout_s``; the handle is released either way (NIXL cancels a transfer still in flight, if the backend can).

    Args:
        name: agent name, the ``session`` peers address (default ``"miles-{host}-{pid}-{random}"``).
        backends: NIXL backend plugins to create (``["UCX"]``: RDMA, NVLink, TCP as UCX finds them).
        timeout_s: seconds per write attempt.
        retries: extra attempts after a failed or timed-out write.
        poll_s: longest sleep between state polls.

    Raises:
        ImportError: if ``nixl`` is not installed.
    """

    kind = "NIXL"

    def __init__(
        self,
        *,
        name: str | None = None,
        backends: tuple[str, ...] = ("UCX",),
        timeout_s: float = 60.0,
        retries: int = 2,
        poll_s: float = 1e-3,
    ) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as err:
            raise ImportError("the NIXL P2P transport needs NVIDIA NIXL: pip install nixl") from err
        super().__init__(timeout_s=timeout_s, retries=retries, poll_s=poll_s)
        self.session = name or f"miles-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl_agent(self.session, nixl_agent_config(backends=list(backends)))
        self._reg_descs: dict[int, object] = {}  # start address -> the nixlRegDList register_memory returned
        self._peers: dict[str, bytes] = {}  # remote agent name -> the metadata last loaded for it

    @staticmethod
    def _location(device: torch.device) -> tuple[str, int]:
        """NIXL memory type and device id: ("VRAM", GPU index) for CUDA, ("DRAM", 0) for host memory."""
        return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)

    @property
    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered memory); re-read it after every ``register``."""
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's ``metadata`` so writes to it can start; returns its agent name (its ``session``)."""
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self._peers[name] = metadata
        return name

    def register(self, buffer: Tensor) -> None:
        """Register ``buffer`` (contiguous, CPU or CUDA) with the agent's backends."""
        self._check_buffer(buffer)
        mem_type, device_id = self._location(buffer.device)
        address, nbytes = buffer.data_ptr(), _nbytes(buffer)
        descs = self.agent.register_memory([(address, nbytes, device_id, "")], mem_type)
        if descs is None:
            raise RuntimeError(f"NIXL register_memory of {nbytes} bytes on {buffer.device} failed")
        self._reg_descs[address], self._regions[address] = descs, nbytes

    def close(self) -> None:
        """Deregister every buffer this agent registered (before the buffers are freed)."""
        for address in list(self._reg_descs):
            self.agent.deregister_memory(self._reg_descs.pop(address))
            del self._regions[address]

    def _prepare(self, remote: RemoteBuffer) -> None:
        # A RemoteBuffer for a newly registered slot brings newer metadata; NIXL adds its memory to the known peer.
        if not remote.metadata or self._peers.get(remote.session) == remote.metadata:
            return
        try:
            loaded = self.add_peer(remote.metadata)
        except Exception as err:
            raise ConnectionError(f"NIXL could not load the metadata of peer {remote.session}: {err}") from err
        if loaded != remote.session:
            raise ValueError(f"the metadata sent for NIXL peer {remote.session!r} belongs to agent {loaded!r}")

    def _write_once(self, local: Tensor, nbytes: int, remote: RemoteBuffer, deadline: float) -> None:
        local_mem, local_id = self._location(local.device)
        remote_mem, remote_id = self._location(torch.device(remote.device))
        local_descs = self.agent.get_xfer_descs([(local.data_ptr(), nbytes, local_id)], local_mem)
        remote_descs = self.agent.get_xfer_descs([(remote.address, nbytes, remote_id)], remote_mem)
        handle = self.agent.initialize_xfer("WRITE", local_descs, remote_descs, remote.session)
        try:
            state = self.agent.transfer(handle)
            if state == "PROC":
                state = self._wait(
                    lambda: None if (s := self.agent.check_xfer_state(handle)) == "PROC" else s,
                    deadline,
                    "the transfer",
                )
            if state != "DONE":
                raise _AttemptFailed(f'transfer state "{state}"')
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as err:  # an in-flight transfer NIXL could not cancel keeps its handle
                logger.warning("NIXL could not release the transfer handle to %s: %s", remote.session, err)
