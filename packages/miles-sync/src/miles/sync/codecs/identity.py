"""Identity codec: the tensor is sent as is, bit for bit.

Layout: one part, the tensor itself (any dtype, original shape). Error bound: exact.
"""

from torch import Tensor


def encode(tensor: Tensor) -> tuple[Tensor, ...]:
    """Return the tensor unchanged as a single part.

    Args:
        tensor: any shape and dtype.

    Returns:
        ``(tensor,)``.
    """
    return (tensor,)


def decode(parts: tuple[Tensor, ...], *, shape: tuple[int, ...], dtype) -> Tensor:
    """Return the single part, which already has ``shape`` and ``dtype``.

    Raises:
        ValueError: if the part's shape or dtype differs from the recorded ones.
    """
    (data,) = parts
    if tuple(data.shape) != tuple(shape) or data.dtype != dtype:
        raise ValueError(
            f"identity part is {tuple(data.shape)} {data.dtype}, but the metadata says {tuple(shape)} {dtype}"
        )
    return data
