"""miles.sync: versioned, bucketed weight transfer of named tensors with quantizing codecs (torch only).

Example::

    from miles.sync import InProcessTransport, WeightReceiver, WeightSender

    receiver = WeightReceiver(apply_fn=load)  # load(named_tensors) copies into the engine's model
    sender = WeightSender(InProcessTransport(receiver), bucket_bytes=512 * 2**20, codec="identity")
    version = sender.push(model.state_dict().items())
    assert receiver.weight_version == version
"""

from miles.sync.bucket import Bucket, BucketMeta, PartMeta, TensorMeta
from miles.sync.codecs import CODECS, Codec, get_codec, roundtrip
from miles.sync.disk import DiskWeightWriter, list_versions, read_hf_weights, read_manifest, read_weights
from miles.sync.errors import WeightUpdateError
from miles.sync.fanout import EnginePushStats, FanOutError, FanOutPushStats, MultiEngineSender
from miles.sync.receiver import WeightReceiver
from miles.sync.sender import DEFAULT_CODEC_EXCLUDE, WeightSender, uses_codec
from miles.sync.transports import Transport
from miles.sync.transports.cuda_ipc import CudaIpcEndpoint, CudaIpcTransport
from miles.sync.transports.distributed import DistributedEndpoint, DistributedTransport
from miles.sync.transports.inprocess import InProcessTransport
from miles.sync.transports.p2p import P2PEndpoint, P2PEngine, P2PTransport, RemoteBuffer
from miles.sync.transports.shared_memory import SharedMemoryEndpoint, SharedMemoryTransport
from miles.sync.versions import next_version, prune_versions

__all__ = [
    "CODECS",
    "DEFAULT_CODEC_EXCLUDE",
    "Bucket",
    "BucketMeta",
    "Codec",
    "CudaIpcEndpoint",
    "CudaIpcTransport",
    "DiskWeightWriter",
    "DistributedEndpoint",
    "DistributedTransport",
    "EnginePushStats",
    "FanOutError",
    "FanOutPushStats",
    "InProcessTransport",
    "MultiEngineSender",
    "P2PEndpoint",
    "P2PEngine",
    "P2PTransport",
    "RemoteBuffer",
    "SharedMemoryEndpoint",
    "SharedMemoryTransport",
    "PartMeta",
    "TensorMeta",
    "Transport",
    "WeightReceiver",
    "WeightSender",
    "WeightUpdateError",
    "get_codec",
    "list_versions",
    "next_version",
    "prune_versions",
    "read_hf_weights",
    "read_manifest",
    "read_weights",
    "roundtrip",
    "uses_codec",
]
