"""Make a CPU-torch process import torchvision's Python part.

vLLM's Qwen3-Omni thinker imports transformers' Qwen2-VL image processor,
which imports ``torchvision``. The torchvision wheels on PyPI for x86_64 are
CUDA builds: their C extension does not load beside the CPU build of torch,
and ``import torchvision`` then fails with "operator torchvision::nms does
not exist" (its Python part registers fake kernels for ops it expects the
extension to define). We serve text prompts: no torchvision op ever runs.

:func:`install` adds an import hook that, the first time ``torchvision`` is
imported in the process, loads torchvision's C extension if it can and
otherwise declares the schemas of the two ops whose registration is not
guarded, so that the import succeeds. Calling a torchvision C op then fails
with a clear "no kernel" error instead. Where torchvision's extension loads
(a matching CPU or CUDA build), nothing is declared.

:func:`install_in_spawned_children` carries the hook into child processes
that ``multiprocessing`` starts with ``spawn`` (vLLM's worker processes for
tensor parallelism on CPU): a spawned child unpickles its process object,
whose target imports vLLM (and through it transformers' image code) before
any code of ours could run there. A marker in the process's
``multiprocessing`` config, which every child's process object carries and
unpickles before its target, installs the hook first.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__all__ = ["install", "install_in_spawned_children"]

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBS: list = []  # keeps the torch.library.Library alive


def _declare_missing_ops() -> None:
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    for loc in spec.submodule_search_locations:
        for so in sorted(Path(loc).glob("_C*.so")):
            try:
                torch.ops.load_library(str(so))
                return  # the real extension loaded: its ops are defined
            except OSError:
                pass
    missing = [name for name in _SCHEMAS if not _op_exists(name)]
    if not missing:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        lib.define(_SCHEMAS[name])
    _LIBS.append(lib)


def _op_exists(name: str) -> bool:
    import torch

    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if fullname == "torchvision":
            uninstall()
            _declare_missing_ops()
        return None  # the regular finders import it


_HOOK = _Hook()


def install() -> None:
    """Idempotent; cheap (imports nothing until torchvision is imported)."""
    if "torchvision" in sys.modules or _HOOK in sys.meta_path:
        return
    sys.meta_path.insert(0, _HOOK)


def uninstall() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


_CHILD_CONFIG_KEY = "omni_torchvision_compat"


def _installed_in_child() -> _ChildInstall:
    install()
    return _ChildInstall()


class _ChildInstall:
    """Unpickling it (in a spawned child, before the process's target) installs the hook."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_installed_in_child, ())


def install_in_spawned_children() -> None:
    """Install the hook in every child process this process starts with
    ``multiprocessing`` from now on (and in theirs); idempotent.

    Uses ``multiprocessing.process.current_process()._config``, the dict each
    ``Process`` copies at creation and a spawned child unpickles before the
    process's target (CPython 3.8-3.13 keep that order).
    """
    from multiprocessing import process

    config = getattr(process.current_process(), "_config")  # noqa: B009 -- private; see the docstring
    config.setdefault(_CHILD_CONFIG_KEY, _ChildInstall())
