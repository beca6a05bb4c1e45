"""TensorRef encode/decode: every dtype round-trips; every malformed ref is refused by field."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from omni_common.errors import grpc_code_for
from omni_common.tensor_wire import (
    SUPPORTED_DTYPES,
    TensorWireError,
    decode_inline,
    dtype_info,
    encode_array,
    encode_inline,
    expected_nbytes,
    proto_dtype_of,
    tensor_bytes,
    validate_ref,
)
from omni_serving.v1 import tensor_pb2

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 100).to(dtype)
        specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0]).to(dtype)
        n = min(t.numel(), len(specials))
        t.view(-1)[:n] = specials[:n]
        return t
    info = torch.iinfo(dtype)
    t = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)
    edges = torch.tensor([info.min, info.max], dtype=torch.int64).to(dtype)
    n = min(t.numel(), 2)
    t.view(-1)[:n] = edges[:n]
    return t


def test_supported_dtypes_cover_the_proto_enum():
    names = {v.name for v in tensor_pb2.DType.DESCRIPTOR.values if v.number != 0}
    assert len(names) == len(SUPPORTED_DTYPES) == len(DTYPES), f"{names=}, {SUPPORTED_DTYPES=}"


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize(
    "shape", [(3, 5), (0, 4), (), (2, 1, 3)], ids=["2d", "empty", "scalar", "3d"]
)
def test_inline_round_trip_is_bit_exact(name, shape):
    t = sample(DTYPES[name], shape)
    ref = encode_inline(t)
    assert ref.dtype == proto_dtype_of(t.dtype)
    assert list(ref.shape) == list(shape)
    assert len(ref.inline_data) == t.numel() * t.element_size()
    wire = tensor_pb2.TensorRef.FromString(ref.SerializeToString())
    back = decode_inline(wire)
    assert back.dtype == t.dtype and tuple(back.shape) == tuple(shape)
    got, want = tensor_bytes(back), tensor_bytes(t)
    assert got == want, f"{name}: bytes differ after a round trip"
    info, shp, nbytes = validate_ref(wire)
    assert (info.name, shp, nbytes) == (name, tuple(shape), len(want))


def test_encode_array_matches_encode_inline_for_bfloat16():
    t = sample(torch.bfloat16)
    ref = encode_array(t.view(torch.int16).numpy(), torch.bfloat16)
    assert ref.SerializeToString() == encode_inline(t).SerializeToString()


def test_non_contiguous_tensor_is_encoded_contiguously():
    t = sample(torch.float32, (4, 6))[:, ::2]
    assert not t.is_contiguous()
    assert tensor_bytes(decode_inline(encode_inline(t))) == t.contiguous().numpy().tobytes()


def _ref(dtype=tensor_pb2.D_TYPE_FLOAT32, shape=(2, 2), data=b"\0" * 16) -> tensor_pb2.TensorRef:
    return tensor_pb2.TensorRef(dtype=dtype, shape=list(shape), inline_data=data)


@pytest.mark.parametrize(
    ("ref", "field", "words"),
    [
        (_ref(dtype=99), "tensor.dtype", "unknown dtype value 99"),
        (_ref(dtype=0), "tensor.dtype", "unknown dtype value 0"),
        (
            _ref(data=b"\0" * 15),
            "tensor.inline_data",
            "has 15 bytes, shape [2, 2] of float32 needs 16",
        ),
        (_ref(data=b"\0" * 17), "tensor.inline_data", "has 17 bytes"),
        (_ref(shape=(2, -1)), "tensor.shape[1]", "must be >= 0, got -1"),
        (_ref(shape=(2**62, 16)), "tensor.shape", "overflows 64-bit byte size"),
        (_ref(shape=(2**31, 2**31, 2**31)), "tensor.shape", "overflows 64-bit byte size"),
        (tensor_pb2.TensorRef(dtype=1, shape=[1]), "tensor.data", "neither inline_data nor shm"),
        (
            tensor_pb2.TensorRef(
                dtype=1, shape=[4], shm=tensor_pb2.ShmHandle(region="r", byte_size=15)
            ),
            "tensor.shm.byte_size",
            "is 15, shape [4] of float32 needs 16",
        ),
    ],
    ids=[
        "unknown",
        "unspecified",
        "short",
        "long",
        "negative_dim",
        "overflow",
        "overflow_3d",
        "no_data",
        "shm_size",
    ],
)
def test_validation_errors_name_the_field(ref, field, words):
    with pytest.raises(TensorWireError) as info:
        validate_ref(ref)
    assert info.value.field == field, f"{info.value.field=}, want {field=}"
    assert words in str(info.value), f"{info.value!s} lacks {words!r}"
    assert grpc_code_for(info.value) == grpc.StatusCode.INVALID_ARGUMENT


def test_byte_size_exactly_at_the_64_bit_limit_is_accepted():
    # 65535 * 281479271743489 == 2**64 - 1: the largest representable size.
    assert expected_nbytes([65535, 281479271743489], 1) == 2**64 - 1
    with pytest.raises(TensorWireError):
        expected_nbytes([65535, 281479271743489], 2)


def test_decode_inline_refuses_a_handle():
    ref = tensor_pb2.TensorRef(
        dtype=1, shape=[1], shm=tensor_pb2.ShmHandle(region="r", byte_size=4)
    )
    with pytest.raises(TensorWireError, match="expected inline_data"):
        decode_inline(ref)


def test_unsupported_torch_dtype_is_refused():
    with pytest.raises(TensorWireError, match="no wire encoding"):
        encode_inline(torch.zeros(2, dtype=torch.complex64))


def test_dtype_info_names_the_given_field():
    with pytest.raises(TensorWireError) as info:
        dtype_info(42, "snapshot.hidden_states.dtype")
    assert info.value.field == "snapshot.hidden_states.dtype"


def test_decoded_tensor_views_the_message_bytes():
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    ref = encode_array(arr, torch.int32)
    t = decode_inline(ref)
    assert t.numpy().tolist() == arr.tolist()
