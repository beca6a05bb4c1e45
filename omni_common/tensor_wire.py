"""Tensors on the wire: `TensorRef` encode/decode with loud validation.

A tensor is dtype + shape + bytes (inline or in the shared-memory arena).
Everything a receiver reads is checked first: an unknown dtype, a negative
dimension or a byte length that is not prod(shape) * itemsize is refused with
an error naming the field, because a wrong width silently yields plausible
wrong numbers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from omni_common.errors import InvalidArgumentError
from omni_serving.v1 import tensor_pb2

UINT64_MAX = 2**64 - 1


@dataclass(frozen=True)
class DTypeInfo:
    proto: int
    torch_dtype: torch.dtype
    itemsize: int
    name: str


_DTYPES: tuple[DTypeInfo, ...] = (
    DTypeInfo(tensor_pb2.D_TYPE_FLOAT32, torch.float32, 4, "float32"),
    DTypeInfo(tensor_pb2.D_TYPE_FLOAT16, torch.float16, 2, "float16"),
    DTypeInfo(tensor_pb2.D_TYPE_BFLOAT16, torch.bfloat16, 2, "bfloat16"),
    DTypeInfo(tensor_pb2.D_TYPE_FLOAT64, torch.float64, 8, "float64"),
    DTypeInfo(tensor_pb2.D_TYPE_INT8, torch.int8, 1, "int8"),
    DTypeInfo(tensor_pb2.D_TYPE_UINT8, torch.uint8, 1, "uint8"),
    DTypeInfo(tensor_pb2.D_TYPE_INT16, torch.int16, 2, "int16"),
    DTypeInfo(tensor_pb2.D_TYPE_INT32, torch.int32, 4, "int32"),
    DTypeInfo(tensor_pb2.D_TYPE_INT64, torch.int64, 8, "int64"),
    DTypeInfo(tensor_pb2.D_TYPE_BOOL, torch.bool, 1, "bool"),
)
_BY_PROTO = {d.proto: d for d in _DTYPES}
_BY_TORCH = {d.torch_dtype: d for d in _DTYPES}

SUPPORTED_DTYPES: tuple[str, ...] = tuple(d.name for d in _DTYPES)


class TensorWireError(InvalidArgumentError):
    """A TensorRef is malformed (INVALID_ARGUMENT, message names the field)."""


def dtype_info(proto_dtype: int, field: str = "dtype") -> DTypeInfo:
    """Look up a wire dtype; unknown or unset values are refused."""
    info = _BY_PROTO.get(proto_dtype)
    if info is None:
        raise TensorWireError(
            field,
            f"unknown dtype value {proto_dtype}; supported: {', '.join(SUPPORTED_DTYPES)}",
        )
    return info


def proto_dtype_of(dtype: torch.dtype) -> tensor_pb2.DType:
    """The wire dtype of a torch dtype (ValueError for unsupported ones)."""
    info = _BY_TORCH.get(dtype)
    if info is None:
        raise TensorWireError("dtype", f"torch dtype {dtype} has no wire encoding")
    return cast(tensor_pb2.DType, info.proto)


def expected_nbytes(shape: Sequence[int], itemsize: int, field: str = "shape") -> int:
    """prod(shape) * itemsize, refusing negative dims and sizes past 2**64."""
    for i, dim in enumerate(shape):
        if dim < 0:
            raise TensorWireError(f"{field}[{i}]", f"dimension must be >= 0, got {dim}")
    n = math.prod(shape) * itemsize
    if n > UINT64_MAX:
        raise TensorWireError(field, f"tensor of shape {list(shape)} overflows 64-bit byte size")
    return n


def validate_ref(ref: tensor_pb2.TensorRef, field: str = "tensor") -> tuple[DTypeInfo, tuple[int, ...], int]:
    """Check a TensorRef's dtype, shape and byte length; return (dtype, shape, nbytes).

    Shared-memory bounds are checked by the arena reader, which knows the
    region; this checks what can be checked from the message alone.
    """
    info = dtype_info(ref.dtype, f"{field}.dtype")
    shape = tuple(int(d) for d in ref.shape)
    nbytes = expected_nbytes(shape, info.itemsize, f"{field}.shape")
    which = ref.WhichOneof("data")
    if which == "inline_data":
        if len(ref.inline_data) != nbytes:
            raise TensorWireError(
                f"{field}.inline_data",
                f"has {len(ref.inline_data)} bytes, shape {list(shape)} of {info.name} needs {nbytes}",
            )
    elif which == "shm":
        if ref.shm.byte_size != nbytes:
            raise TensorWireError(
                f"{field}.shm.byte_size",
                f"is {ref.shm.byte_size}, shape {list(shape)} of {info.name} needs {nbytes}",
            )
    else:
        raise TensorWireError(f"{field}.data", "neither inline_data nor shm is set")
    return info, shape, nbytes


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The C-contiguous little-endian bytes of a CPU tensor."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def encode_inline(tensor: torch.Tensor) -> tensor_pb2.TensorRef:
    """A TensorRef holding the tensor's bytes inline."""
    return tensor_pb2.TensorRef(
        dtype=proto_dtype_of(tensor.dtype),
        shape=list(tensor.shape),
        inline_data=tensor_bytes(tensor),
    )


def encode_array(array: np.ndarray, dtype: torch.dtype) -> tensor_pb2.TensorRef:
    """A TensorRef from a numpy array whose bytes already have `dtype`'s layout."""
    data = np.ascontiguousarray(array)
    return tensor_pb2.TensorRef(dtype=proto_dtype_of(dtype), shape=list(data.shape), inline_data=data.tobytes())


def tensor_from_buffer(buffer: memoryview | bytes | bytearray, info: DTypeInfo, shape: Sequence[int]) -> torch.Tensor:
    """A tensor viewing `buffer` (no copy). Read-only buffers give tensors
    that must not be written to; call .clone() before mutating."""
    n = math.prod(shape)
    if n == 0:
        return torch.empty(tuple(shape), dtype=info.torch_dtype)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable; we never write to it.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=n * info.itemsize)
    return flat.view(info.torch_dtype).view(tuple(shape))


def decode_inline(ref: tensor_pb2.TensorRef, field: str = "tensor") -> torch.Tensor:
    """Decode an inline TensorRef (validated) into a tensor viewing its bytes."""
    info, shape, _ = validate_ref(ref, field)
    if ref.WhichOneof("data") != "inline_data":
        raise TensorWireError(f"{field}.data", "expected inline_data, got a shared-memory handle")
    return tensor_from_buffer(ref.inline_data, info, shape)
