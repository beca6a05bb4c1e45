"""How the kit compares answers and shows messages.

* `normalise` maps a decoded message to its canonical form: what the
  contract calls equivalent becomes equal. An unset `MultimodalPayload` and
  one that is set but holds no tensor and no metadata are the same payload
  (unset is canonical), and fields unknown to the kit's protos are dropped.
* `first_difference` walks two decoded messages in field-declaration order
  and names the first field where they differ, with both values decoded
  (enum names, tensor elements), for example
  `answers[3].step.requests[1].client.tensors[0].tensor.shape: expected [4, 16], got [16, 4]`.
  Two messages are equal exactly when it returns None; the kit never
  compares serialized bytes.
* `render` prints a message for people, tensors abbreviated to their dtype,
  shape and first values (`--explain`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import grpc
import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from omni_serving.v1 import materializer_pb2, payload_pb2, tensor_pb2

_PAYLOAD = payload_pb2.MultimodalPayload.DESCRIPTOR.full_name
_TENSOR = tensor_pb2.TensorRef.DESCRIPTOR.full_name
_STEP_ERROR = materializer_pb2.StepError.DESCRIPTOR.full_name

# dtype value -> (name, numpy dtype of the stored bits, itemsize)
_DTYPES: dict[int, tuple[str, str, int]] = {
    tensor_pb2.D_TYPE_FLOAT32: ("float32", "<f4", 4),
    tensor_pb2.D_TYPE_FLOAT16: ("float16", "<f2", 2),
    tensor_pb2.D_TYPE_BFLOAT16: ("bfloat16", "<u2", 2),
    tensor_pb2.D_TYPE_FLOAT64: ("float64", "<f8", 8),
    tensor_pb2.D_TYPE_INT8: ("int8", "<i1", 1),
    tensor_pb2.D_TYPE_UINT8: ("uint8", "<u1", 1),
    tensor_pb2.D_TYPE_INT16: ("int16", "<i2", 2),
    tensor_pb2.D_TYPE_INT32: ("int32", "<i4", 4),
    tensor_pb2.D_TYPE_INT64: ("int64", "<i8", 8),
    tensor_pb2.D_TYPE_BOOL: ("bool", "<u1", 1),
}
_FLOATS = {
    tensor_pb2.D_TYPE_FLOAT32,
    tensor_pb2.D_TYPE_FLOAT16,
    tensor_pb2.D_TYPE_BFLOAT16,
    tensor_pb2.D_TYPE_FLOAT64,
}
MAX_VALUES = 8  # tensor elements shown by render
MAX_ITEMS = 16  # repeated scalars shown before "..."


# --------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------


def normalise(msg: Message) -> Message:
    """A copy of `msg` in canonical form (see the module docstring)."""
    out = type(msg)()
    out.CopyFrom(msg)
    out.DiscardUnknownFields()
    _clear_empty_payloads(out)
    return out


def _clear_empty_payloads(msg: Message) -> None:
    for f, value in msg.ListFields():
        if f.message_type is None:
            continue
        if _is_map(f):
            if f.message_type.fields_by_name["value"].message_type is not None:
                for v in value.values():
                    _clear_empty_payloads(v)
            continue
        if f.is_repeated:
            for v in value:
                _clear_empty_payloads(v)
            continue
        if f.message_type.full_name == _PAYLOAD and not value.tensors and not value.metadata:
            msg.ClearField(f.name)
            continue
        _clear_empty_payloads(value)


def code_name(code: int) -> str:
    """`INVALID_ARGUMENT` for 3; the number itself if no gRPC code has it."""
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c.name
    return str(code)


def equivalent(want: Message, got: Message) -> bool:
    return first_difference(want, got) is None


# --------------------------------------------------------------------------
# The first difference
# --------------------------------------------------------------------------


def first_difference(want: Message, got: Message, path: str = "") -> str | None:
    """`path: expected X, got Y` for the first field where the normalised
    messages differ, or None if they are equivalent."""
    return _diff_message(normalise(want), normalise(got), path)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _is_map(f: FieldDescriptor) -> bool:
    return f.is_repeated and f.message_type is not None and f.message_type.GetOptions().map_entry


def _diff_message(w: Message, g: Message, path: str) -> str | None:
    desc = w.DESCRIPTOR
    seen_oneofs: set[str] = set()
    for f in desc.fields:
        p = _join(path, f.name)
        oneof = f.containing_oneof
        if (
            oneof is not None
            and not getattr(oneof, "is_synthetic", lambda: False)()
            and len(oneof.fields) > 1
        ):
            if oneof.name not in seen_oneofs:
                seen_oneofs.add(oneof.name)
                wk, gk = w.WhichOneof(oneof.name), g.WhichOneof(oneof.name)
                if wk != gk:
                    return f"{path or desc.name}: expected {_which(w, wk)}, got {_which(g, gk)}"
            if w.WhichOneof(oneof.name) != f.name:
                continue
        if desc.full_name == _TENSOR and f.name == "inline_data":
            d = _diff_tensor_bytes(w, g, p)
            if d is not None:
                return d
            continue
        d = _diff_field(f, getattr(w, f.name), getattr(g, f.name), p, w, g)
        if d is not None:
            return d
    return None


def _which(msg: Message, name: str | None) -> str:
    if name is None:
        return "none of them set"
    value = getattr(msg, name)
    if isinstance(value, Message):
        return f"{name} {summary(value)}"
    return f"{name} = {_scalar_text(msg.DESCRIPTOR.fields_by_name[name], value)}"


def _diff_field(f: FieldDescriptor, wv, gv, p: str, w: Message, g: Message) -> str | None:
    if _is_map(f):
        wk, gk = sorted(wv.keys()), sorted(gv.keys())
        if wk != gk:
            return f"{p} keys: expected {wk}, got {gk}"
        value_field = f.message_type.fields_by_name["value"]
        for k in wk:
            d = _diff_field(value_field, wv[k], gv[k], f"{p}[{k!r}]", w, g)
            if d is not None:
                return d
        return None
    if f.is_repeated:
        if f.message_type is not None:
            for i, (a, b) in enumerate(zip(wv, gv, strict=False)):
                d = _diff_message(a, b, f"{p}[{i}]")
                if d is not None:
                    return d
            if len(wv) != len(gv):
                n = min(len(wv), len(gv))
                extra = wv[n] if len(wv) > n else gv[n]
                which = "missing" if len(wv) > n else "unexpected"
                return (
                    f"{p}: expected {len(wv)} entries, got {len(gv)} "
                    f"({which} {p}[{n}] {summary(extra)})"
                )
            return None
        a, b = list(wv), list(gv)
        if not all(_same_scalar(f, x, y) for x, y in zip(a, b, strict=False)) or len(a) != len(b):
            return f"{p}: expected {_list_text(f, a)}, got {_list_text(f, b)}"
        return None
    if f.message_type is not None:
        if f.has_presence:
            wh, gh = w.HasField(f.name), g.HasField(f.name)
            if wh != gh:
                return (
                    f"{p}: expected {summary(wv) if wh else 'unset'}, "
                    f"got {summary(gv) if gh else 'unset'}"
                )
            if not wh:
                return None
        return _diff_message(wv, gv, p)
    if not _same_scalar(f, wv, gv):
        return f"{p}: expected {_scalar_text(f, wv)}, got {_scalar_text(f, gv)}"
    return None


def _same_scalar(f: FieldDescriptor, a, b) -> bool:
    if f.type == FieldDescriptor.TYPE_DOUBLE:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if f.type == FieldDescriptor.TYPE_FLOAT:
        return struct.pack("<f", a) == struct.pack("<f", b)
    return a == b


def _scalar_text(f: FieldDescriptor, v) -> str:
    if f.type == FieldDescriptor.TYPE_ENUM:
        value = f.enum_type.values_by_number.get(v)
        return value.name if value is not None else f"{v} (no such {f.enum_type.name})"
    if f.type == FieldDescriptor.TYPE_STRING:
        return _quote(v)
    if f.type == FieldDescriptor.TYPE_BYTES:
        return f"<{len(v)} bytes>"
    if f.type == FieldDescriptor.TYPE_BOOL:
        return "true" if v else "false"
    if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return _float_text(v)
    return str(v)


def _list_text(f: FieldDescriptor, values: Sequence) -> str:
    shown = [_scalar_text(f, v) for v in values[:MAX_ITEMS]]
    if len(values) > MAX_ITEMS:
        shown.append(f"... ({len(values)} items)")
    return "[" + ", ".join(shown) + "]"


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _float_text(v) -> str:
    """Shortest text that reads back to the same value of its own width
    (numpy scalars keep float16/float32 short)."""
    if math.isnan(v):
        return "nan"
    if v == 0 and math.copysign(1.0, float(v)) < 0:
        return "-0.0"
    return str(v) if isinstance(v, np.floating) else repr(float(v))


# -- tensor bytes ---------------------------------------------------------------


def _elements(dtype: int, data: bytes) -> np.ndarray | None:
    spec = _DTYPES.get(dtype)
    if spec is None or len(data) % spec[2]:
        return None
    return np.frombuffer(data, dtype=spec[1])


def _element_text(dtype: int, array: np.ndarray, i: int) -> str:
    raw = array[i]
    if dtype == tensor_pb2.D_TYPE_BFLOAT16:
        bits = int(raw)
        value = struct.unpack("<f", struct.pack("<I", bits << 16))[0]
        return f"{_float_text(value)} (bits 0x{bits:04x})"
    if dtype in _FLOATS:
        bits = int.from_bytes(raw.tobytes(), "little")
        width = raw.itemsize * 2
        return f"{_float_text(raw)} (bits 0x{bits:0{width}x})"
    if dtype == tensor_pb2.D_TYPE_BOOL:
        return str(int(raw)) if int(raw) > 1 else ("true" if raw else "false")
    return str(int(raw))


def _diff_tensor_bytes(w: tensor_pb2.TensorRef, g: tensor_pb2.TensorRef, p: str) -> str | None:
    a, b = w.inline_data, g.inline_data
    if a == b:
        return None
    if len(a) != len(b):
        return f"{p}: expected {len(a)} bytes, got {len(b)}"
    ea, eb = _elements(w.dtype, a), _elements(w.dtype, b)
    if ea is None or eb is None:
        first = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        return f"{p}: byte {first}: expected 0x{a[first]:02x}, got 0x{b[first]:02x}"
    mism = np.flatnonzero(
        (ea.view(np.uint8).reshape(len(ea), -1) != eb.view(np.uint8).reshape(len(eb), -1)).any(
            axis=1
        )
    )
    i = int(mism[0])
    shape = [int(d) for d in w.shape]
    index = list(np.unravel_index(i, shape)) if shape and math.prod(shape) == len(ea) else [i]
    where = "[" + ", ".join(str(int(x)) for x in index) + "]"
    return (
        f"{p}: element {where}: expected {_element_text(w.dtype, ea, i)}, "
        f"got {_element_text(w.dtype, eb, i)} ({len(mism)} of {len(ea)} elements differ)"
    )


# --------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------


def tensor_text(ref: tensor_pb2.TensorRef) -> str:
    """`float32 [4, 4] inline [0.0, 1.0, ... (16 values)]` or the handle's fields."""
    spec = _DTYPES.get(ref.dtype)
    dtype_name = spec[0] if spec else f"dtype {ref.dtype}"
    shape = "[" + ", ".join(str(d) for d in ref.shape) + "]"
    which = ref.WhichOneof("data")
    if which == "shm":
        h = ref.shm
        return (
            f"{dtype_name} {shape} shm {{region: {_quote(h.region)}, offset: {h.offset}, "
            f"byte_size: {h.byte_size}, slot: {h.slot}, generation: {h.generation}}}"
        )
    if which is None:
        return f"{dtype_name} {shape} (no data: neither inline_data nor shm)"
    data = ref.inline_data
    values = _elements(ref.dtype, data)
    if values is None:
        return f"{dtype_name} {shape} inline <{len(data)} bytes>"
    shown = [
        _element_text(ref.dtype, values, i).split(" (bits")[0]
        for i in range(min(len(values), MAX_VALUES))
    ]
    if len(values) > MAX_VALUES:
        shown.append(f"... ({len(values)} values)")
    return f"{dtype_name} {shape} inline [{', '.join(shown)}]"


def summary(msg: Message) -> str:
    """One line: the message type and its set fields, abbreviated."""
    if msg.DESCRIPTOR.full_name == _TENSOR:
        return tensor_text(msg)
    if msg.DESCRIPTOR.full_name == _STEP_ERROR:
        return (
            f"StepError {{step_id: {msg.step_id}, stage_id: {msg.stage_id}, "
            f"code: {code_name(msg.code)}, message: {_quote(msg.message)}}}"
        )
    parts = []
    for f, value in msg.ListFields():
        if _is_map(f):
            parts.append(f"{f.name}: {{{', '.join(_quote(k) for k in sorted(value))}}}")
        elif f.is_repeated and f.message_type is not None:
            parts.append(f"{f.name}: {len(value)} entries")
        elif f.is_repeated:
            parts.append(f"{f.name}: {_list_text(f, list(value))}")
        elif f.message_type is not None:
            parts.append(f"{f.name}: {summary(value)}")
        else:
            parts.append(f"{f.name}: {_scalar_text(f, value)}")
    text = f"{msg.DESCRIPTOR.name} {{{', '.join(parts)}}}"
    return text if len(text) <= 240 else text[:237] + "..."


def render(msg: Message, indent: int = 0) -> str:
    """Text-format-like lines for people; tensors on one line each."""
    return "\n".join(_render(msg, indent))


def _render(msg: Message, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for f, value in msg.ListFields():
        if _is_map(f):
            for k in sorted(value):
                v = value[k]
                if isinstance(v, Message):
                    lines.append(f"{pad}{f.name}[{_quote(k)}] {{ {summary(v)} }}")
                else:
                    lines.append(f"{pad}{f.name}[{_quote(k)}]: {v!r}")
        elif f.is_repeated and f.message_type is not None:
            for i, v in enumerate(value):
                lines += _render_one(f"{f.name}[{i}]", v, indent)
        elif f.is_repeated:
            lines.append(f"{pad}{f.name}: {_list_text(f, list(value))}")
        elif f.message_type is not None:
            lines += _render_one(f.name, value, indent)
        else:
            lines.append(f"{pad}{f.name}: {_scalar_text(f, value)}")
    return lines


def _render_one(label: str, value: Message, indent: int) -> list[str]:
    pad = " " * indent
    if value.DESCRIPTOR.full_name == _TENSOR:
        return [f"{pad}{label}: {tensor_text(value)}"]
    inner = _render(value, indent + 2)
    if not inner:
        return [f"{pad}{label} {{}}"]
    if len(inner) == 1 and len(inner[0]) < 100:
        return [f"{pad}{label} {{ {inner[0].strip()} }}"]
    return [f"{pad}{label} {{", *inner, f"{pad}}}"]
