"""A fake accelerator for device bookkeeping checks on CPU-only hosts.

``FakeDeviceTensor`` is a test double for a tensor on an accelerator: it
reports ``device == meta`` (a device type that exists on every build) and
keeps its values in a CPU tensor. Inside :class:`FakeDeviceMode` every aten
op is checked the way a CUDA kernel launch would be: all tensor operands on
one device (a 0-dim host tensor is allowed beside device tensors, as CUDA
allows it). Cross-device copies (``.to(device)``, ``.cpu()``, ``copy_``) are
allowed and the device-to-host ones are counted, as are reads of device
values into Python (``item``, ``bool``, ``int``) and data-dependent shapes
(``nonzero``): each is a sync on a real device.

The check is stricter than CUDA in one place: a host index tensor used to
index a device tensor is refused (CUDA accepts it with a hidden copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")

# copies between devices (allowed)
_TRANSFERS = {
    torch.ops.aten._to_copy.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten.to.dtype_layout,
    torch.ops.aten._copy_from.default,
}
# ops whose result on a real device needs a sync
_SYNCS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.is_nonzero.default,
}


class FakeDeviceTensor(torch.Tensor):
    """A tensor "on the accelerator" (see the module docstring)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> FakeDeviceTensor:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=DEVICE,
            requires_grad=False,
        )
        out.elem = elem
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        raise RuntimeError(f"{func}: a FakeDeviceTensor is only usable inside FakeDeviceMode")

    def __repr__(self) -> str:  # noqa: D105
        return f"FakeDeviceTensor({self.elem!r})"


def to_device(t: torch.Tensor) -> FakeDeviceTensor:
    return FakeDeviceTensor(t.detach().clone())


def to_host(t: torch.Tensor) -> torch.Tensor:
    return t.elem.clone() if isinstance(t, FakeDeviceTensor) else t


def module_to_device(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter and buffer of ``module`` onto the fake device."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = to_device(p.data)  # type: ignore[assignment]
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = to_device(b)
    return module


@dataclass
class FakeDeviceMode(TorchDispatchMode):
    """Checks and runs ops on fake device tensors (module docstring)."""

    mixed: list[str] = field(default_factory=list)  # ops that mixed devices
    syncs: list[str] = field(default_factory=list)  # device -> host reads

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        on_dev = [t for t in tensors if isinstance(t, FakeDeviceTensor)]
        stray = [t for t in tensors if not isinstance(t, FakeDeviceTensor) and t.device.type == "meta"]
        if stray:
            self.mixed.append(f"{func}: a meta tensor without values (made outside the mode)")
        host = [t for t in tensors if not isinstance(t, FakeDeviceTensor) and t.dim() > 0]
        wanted = kwargs.get("device")
        to_dev = wanted is not None and torch.device(wanted).type == "meta"
        if func in _TRANSFERS:
            if func is torch.ops.aten.copy_.default:
                dst, src = args[0], args[1]
                if isinstance(src, FakeDeviceTensor) and not isinstance(dst, FakeDeviceTensor):
                    self.syncs.append(str(func))
            elif on_dev and not to_dev and wanted is not None:
                self.syncs.append(f"{func} to {wanted}")
        else:
            if on_dev and host:
                self.mixed.append(
                    f"{func}: device tensors {[tuple(t.shape) for t in on_dev]} with host tensors "
                    f"{[tuple(t.shape) for t in host]}"
                )
            if on_dev and func in _SYNCS:
                self.syncs.append(str(func))
        owners = {id(t.elem): t for t in on_dev}

        def unwrap(x: Any) -> Any:
            return x.elem if isinstance(x, FakeDeviceTensor) else x

        run_args = tree_map(unwrap, args)
        run_kwargs = tree_map(unwrap, kwargs)
        if wanted is not None:
            run_kwargs["device"] = torch.device("cpu")
        out = func(*run_args, **run_kwargs)
        result_on_dev = to_dev or (bool(on_dev) and func not in _TRANSFERS) or (
            func in _TRANSFERS and (to_dev or (wanted is None and bool(on_dev)))
        )
        if func is torch.ops.aten.copy_.default:
            return args[0]  # in place: the destination object itself
        if func in _SYNCS and on_dev and func is not torch.ops.aten.nonzero.default:
            return out  # a Python scalar / host value

        def wrap(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) in owners:  # an in-place op returns its (device) operand
                return owners[id(x)]
            return FakeDeviceTensor(x) if result_on_dev else x

        return tree_map(wrap, out)
