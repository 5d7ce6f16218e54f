"""Calling an inductor artifact past its wrappers: the generated wrapper's own ``call``.

A per-layer replay calls one artifact per decoder layer. Between
``artifact(*args)`` and the generated ``call`` sit aot_autograd's runtime wrappers and
``CompiledFxGraph.__call__``, and the C++ wrapper's ``call`` turns every int into a 0-dim
tensor: Python work on every call. ``direct_call`` finds ``call`` and proves, with one
probe, that everything in between hands arguments and outputs through unchanged.

Under the C++ wrapper, ``call`` is a few lines around one function of a Python extension
module inductor compiled (``wrapper_library``). ``load_wrapper`` loads that library again
in a later process and calls it the same way, without importing inductor, which
otherwise dominates a warm start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

import torch


class SizeTensors(dict):
    """size -> the 0-dim int64 tensor ``direct_call``'s ``call`` takes for it (it only reads
    them, so one per value serves every call)."""

    def __missing__(self, size: int) -> torch.Tensor:
        t = self[size] = torch.tensor(size)
        return t


class PlainSizes(dict):
    """size -> size: what an artifact called through its wrappers (or a Python-wrapper
    ``call``) takes; kept once seen, so a replay's lookup calls no Python."""

    def __missing__(self, size: int) -> int:
        self[size] = size
        return size


@dataclasses.dataclass(frozen=True)
class DirectCall:
    call: Callable[[list], list]     # empties the list it is given: hand it a copy
    size_of: dict                    # a symbolic size -> what ``call`` takes for it
    # a wrapper library rung loaded itself (``load_wrapper``): its entry point, which a
    # replay may call as ``from_handles(entry(to_handles(args)))``, what ``call`` does,
    # without ``call``'s Python frame (one a layer, 31 a SmolLM2 step)
    entry: Callable[[list], list] | None = None


# NOTE: the C functions the generated call converts with (builtins: no Python frame):
# tensors -> the handles an entry point takes (and owns), the handles it returns -> tensors
_AOTI = getattr(torch._C, "_aoti", None)
to_handles = getattr(_AOTI, "unsafe_alloc_void_ptrs_from_tensors", None)
from_handles = getattr(_AOTI, "alloc_tensors_by_stealing_from_void_ptrs", None)


def direct_call(artifact: Callable[..., Any], args: list) -> DirectCall | None:
    """The generated wrapper's own ``call`` inside an inductor artifact (it takes the
    argument list and empties it), when every layer between the two hands arguments and
    outputs through unchanged; None otherwise. Checked by calling ``artifact(*args)`` once
    and recording what reaches ``call``.

    NOTE: those layers (aot_autograd's runtime wrappers, ``CompiledFxGraph.__call__``) and
    ``call``'s int -> tensor conversion cost Python work on every call, and a per-layer
    replay makes one call per decoder layer.
    """
    graphs = _compiled_fx_graphs(artifact)
    if len(graphs) != 1:
        return None
    graph = graphs[0]
    inner = graph.current_callable
    seen: dict[str, list] = {}

    def record(inputs: list) -> list:
        seen["inputs"] = list(inputs)
        seen["outputs"] = inner(inputs)
        return seen["outputs"]

    graph.current_callable = record
    try:
        outputs = artifact(*args)
    finally:
        graph.current_callable = inner
    same = (len(seen.get("inputs", ())) == len(args)
            and all(a is b for a, b in zip(seen["inputs"], args))
            and len(outputs) == len(seen["outputs"])
            and all(a is b for a, b in zip(outputs, seen["outputs"])))
    if not same:
        return None
    # NOTE: the C++ wrapper's ``call`` turns each int into a 0-dim tensor (torch.tensor, ~8
    # us); handed one, it passes it through. The Python wrapper's computes with the ints.
    return DirectCall(inner, SizeTensors() if graph.fx_kwargs.get("cpp_wrapper")
                      else PlainSizes())


# NOTE: the name of the entry point inductor's C++ wrapper library exports
# (``CppWrapperCodeCache.entry_function``), and the variable its module init reads
_WRAPPER_ENTRY = "inductor_entry_cpp"
_TENSOR_DATA_PTR_ENV = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


def wrapper_library(direct: DirectCall) -> str | None:
    """The file of the C++ wrapper library whose entry point ``direct.call`` wraps, when
    ``call`` is the generated ``g(args)`` around it (inductor's ``_wrap_func``); None for a
    Python wrapper or anything else."""
    for cell in getattr(direct.call, "__closure__", None) or ():
        with contextlib.suppress(ValueError):
            entry = cell.cell_contents
            module = getattr(entry, "__self__", None)
            path = getattr(module, "__file__", None) or ""
            if (getattr(entry, "__name__", None) == _WRAPPER_ENTRY and path.endswith(".so")
                    and isinstance(direct.size_of, SizeTensors)):
                return path
    return None


def load_wrapper(path: str, name: str) -> DirectCall:
    """A ``DirectCall`` of the C++ wrapper library at ``path`` (``wrapper_library``),
    loaded as the Python extension module ``<name>.inductor_entry_cpp`` (once a process):
    the generated ``call``'s own steps, tensors to handles, the entry, handles to tensors.

    NOTE: every argument must be a tensor (``SizeTensors`` hands sizes over as 0-dim
    tensors); the generated ``call`` would convert ints, this one does not."""
    if to_handles is None or from_handles is None:
        raise ImportError("this torch has no torch._C._aoti handle conversions")
    module_name = f"{name}.{_WRAPPER_ENTRY}"
    module = sys.modules.get(module_name)
    if module is None:
        # NOTE: the library's init reads this address (of a torch function) from the
        # environment, as when inductor loads it
        os.environ[_TENSOR_DATA_PTR_ENV] = str(
            torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load a compiled graph library from {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[module_name] = module
    entry = getattr(module, _WRAPPER_ENTRY)

    def call(args: list) -> list:
        handles = to_handles(args)
        args.clear()          # NOTE: as the generated call: the entry owns the inputs now
        return from_handles(entry(handles))
    return DirectCall(call, SizeTensors(), entry)


def _compiled_fx_graphs(fn: Any, depth: int = 0) -> list:
    """Every ``CompiledFxGraph`` reachable from ``fn`` through closures and the callable
    attributes of wrapper objects (what ``standalone_compile`` and ``CompiledArtifact.load``
    build around one)."""
    from torch._inductor.output_code import CompiledFxGraph

    if isinstance(fn, CompiledFxGraph):
        return [fn]
    if depth > 12:
        return []
    found = []
    values = [] if inspect.isfunction(fn) else list(getattr(fn, "__dict__", {}).values())
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):          # an empty cell
            values.append(cell.cell_contents)
    for value in values:
        if callable(value) and not isinstance(value, type):
            found += [g for g in _compiled_fx_graphs(value, depth + 1)
                      if all(g is not f for f in found)]
    return found
