"""WeightReceiver: the engine side of a weight update, small and engine-agnostic.

Call sequence, one update at a time (modeled on SGLang's ``/update_weights_from_distributed``: the request carries the
metadata, the payload follows, the engine loads and bumps ``weight_version`` when everything arrived)::

    receiver.begin_update(version)          # version > receiver.weight_version
    receiver.receive_bucket(bucket)         # buckets 0, 1, ..., n-1 in order
    receiver.commit_update(version, n)      # decode complete -> apply_fn(named_tensors) -> weight_version = version

``abort_update`` drops a partial update. Any failure leaves ``weight_version`` unchanged and raises
``WeightUpdateError`` naming the bucket and the reason (apply-on-complete). Delta buckets (a ``WeightSender`` with
``delta=True``) are rebuilt on top of the last applied version first (``miles.sync.delta``).
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from miles.sync.bucket import Bucket, unpack_parts
from miles.sync.codecs import get_codec
from miles.sync.errors import WeightUpdateError
from torch import Tensor

logger = logging.getLogger(__name__)

ApplyFn = Callable[[list[tuple[str, Tensor]]], None]


@dataclass(slots=True)
class _PendingUpdate:
    version: int
    next_index: int = 0
    nbytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    named_tensors: list[tuple[str, Tensor]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)


class WeightReceiver:
    """Decodes buckets of one update and applies them all at once.

    Args:
        apply_fn: ``apply_fn(named_tensors)`` loads a complete update, e.g. ``param.copy_(tensor)`` for each pair.
            Called once per update, after every bucket arrived and decoded. The tensors may be views into a
            transport's reusable buffer: they are valid only during the call, so copy what you keep.
        device: where decoded tensors are placed (e.g. ``"cuda:0"``); None keeps the payload's device.

    Attributes:
        weight_version: version of the weights last applied; 0 before any update.
    """

    def __init__(self, apply_fn: ApplyFn, *, device: torch.device | str | None = None) -> None:
        self.apply_fn = apply_fn
        self.device = None if device is None else torch.device(device)
        self.weight_version = 0
        self._pending: _PendingUpdate | None = None
        self._delta = None  # a DeltaDecoder once a delta bucket arrives

    def _drop_pending(self) -> None:
        self._pending = None
        if self._delta is not None:
            self._delta.discard()

    def begin_update(self, version: int) -> None:
        """Start receiving update ``version``; a pending partial update is dropped.

        Raises:
            WeightUpdateError: if ``version`` is not greater than ``weight_version``.
        """
        if self._pending is not None:
            logger.warning("update v%d was never committed; dropping it for v%d", self._pending.version, version)
            self._drop_pending()
        if version <= self.weight_version:
            raise WeightUpdateError(
                f"update v{version} is not newer than the applied weights v{self.weight_version}; versions must "
                "strictly increase, so a second sender or a restarted sender must continue from the receiver's version"
            )
        self._pending = _PendingUpdate(version)

    def receive_bucket(self, bucket: Bucket) -> None:
        """Decode one bucket of the pending update; the decoded tensors are held until commit.

        Raises:
            WeightUpdateError: if no update is pending, the bucket belongs to another version, arrives out of order,
                has a bad payload, repeats a name, or fails to decode; the pending update is dropped.
        """
        meta = bucket.meta
        pending = self._pending
        where = f"bucket {meta.index} of update v{meta.version}"
        try:
            if pending is None or pending.version != meta.version:
                expected = "no update" if pending is None else f"update v{pending.version}"
                raise ValueError(f"the receiver expects {expected}; call begin_update(version) first")
            if meta.index != pending.next_index:
                raise ValueError(f"expected bucket {pending.next_index} next: a bucket was lost or reordered")
            if meta.delta is not None:
                if self._delta is None:
                    from miles.sync.delta import DeltaDecoder

                    self._delta = DeltaDecoder()
                bucket = self._delta.decode(bucket)
                meta = bucket.meta
            for tensor_meta, parts in unpack_parts(bucket):
                if tensor_meta.name in pending.names:
                    raise ValueError(f"tensor {tensor_meta.name!r} was already received in this update")
                try:
                    tensor = get_codec(tensor_meta.codec).decode(
                        parts, shape=tensor_meta.shape, dtype=tensor_meta.dtype
                    )
                except Exception as err:
                    raise ValueError(
                        f"decoding {tensor_meta.name!r} with codec {tensor_meta.codec!r} failed: {err}"
                    ) from err
                if self.device is not None:
                    tensor = tensor.to(self.device, non_blocking=True)
                pending.named_tensors.append((tensor_meta.name, tensor))
                pending.names.add(tensor_meta.name)
        except (ValueError, ImportError) as err:
            self._drop_pending()
            raise WeightUpdateError(f"{where} rejected: {err}; the update is dropped") from err
        pending.next_index += 1
        pending.nbytes += meta.nbytes

    def commit_update(self, version: int, num_buckets: int) -> int:
        """Apply the pending update if all ``num_buckets`` buckets arrived, then publish ``version``.

        Returns:
            The new ``weight_version``.

        Raises:
            WeightUpdateError: if the update is not pending, buckets are missing, or ``apply_fn`` raised.
        """
        pending = self._pending
        self._pending = None
        if pending is None or pending.version != version:
            self._drop_pending()
            raise WeightUpdateError(f"commit of update v{version}, but no such update is pending")
        if pending.next_index != num_buckets:
            self._drop_pending()
            raise WeightUpdateError(
                f"update v{version} incomplete: bucket {pending.next_index} of {num_buckets} never arrived; "
                f"keeping weights v{self.weight_version}"
            )
        try:
            self.apply_fn(pending.named_tensors)
        except Exception as err:
            self._drop_pending()  # the bases stay the last applied version's, which the sender also still holds
            raise WeightUpdateError(
                f"apply_fn failed on update v{version} ({len(pending.named_tensors)} tensors): {err!r}; "
                f"weight_version stays v{self.weight_version}, but the model may be partially loaded"
            ) from err
        self.weight_version = version
        if self._delta is not None:
            self._delta.commit()
        logger.debug(  # per step
            "applied weights v%d: %d tensors, %d buckets, %.1f MiB in %.3fs",
            version,
            len(pending.named_tensors),
            num_buckets,
            pending.nbytes / 2**20,
            time.perf_counter() - pending.started,
        )
        return version

    def abort_update(self, version: int, reason: str) -> None:
        """Drop the pending update ``version`` (if it is the pending one), keeping the applied weights."""
        if self._pending is not None and self._pending.version == version:
            logger.warning("update v%d aborted by the sender: %s", version, reason)
            self._drop_pending()
