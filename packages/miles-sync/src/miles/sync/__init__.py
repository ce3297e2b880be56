"""miles.sync: versioned, bucketed weight transfer of named tensors with quantizing codecs (torch only).

Example::

    from miles.sync import InProcessTransport, WeightReceiver, WeightSender

    receiver = WeightReceiver(apply_fn=load)  # load(named_tensors) copies into the engine's model
    sender = WeightSender(InProcessTransport(receiver), bucket_bytes=512 * 2**20, codec="identity")
    version = sender.push(model.state_dict().items())
    assert receiver.weight_version == version
"""

from miles.sync.bucket import Bucket, BucketMeta, PartMeta, TensorMeta
from miles.sync.codecs import CODECS, Codec, get_codec
from miles.sync.errors import WeightUpdateError
from miles.sync.receiver import WeightReceiver
from miles.sync.sender import DEFAULT_CODEC_EXCLUDE, WeightSender
from miles.sync.transports import Transport
from miles.sync.transports.inprocess import InProcessTransport

__all__ = [
    "CODECS",
    "DEFAULT_CODEC_EXCLUDE",
    "Bucket",
    "BucketMeta",
    "Codec",
    "InProcessTransport",
    "PartMeta",
    "TensorMeta",
    "Transport",
    "WeightReceiver",
    "WeightSender",
    "WeightUpdateError",
    "get_codec",
]
