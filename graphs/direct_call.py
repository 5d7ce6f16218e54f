"""Calling an inductor artifact past its wrappers: the generated wrapper's own ``call``.

A per-layer replay calls one artifact per decoder layer (SmolLM2: 30 a step). Between
``artifact(*args)`` and the generated ``call`` sit aot_autograd's runtime wrappers and
``CompiledFxGraph.__call__``, and the C++ wrapper's ``call`` turns every int into a 0-dim
tensor: ~150 us of Python a call. ``direct_call`` finds ``call`` and proves, with one
probe, that everything in between hands arguments and outputs through unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
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


def direct_call(artifact: Callable[..., Any], args: list) -> DirectCall | None:
    """The generated wrapper's own ``call`` inside an inductor artifact (it takes the
    argument list and empties it), when every layer between the two hands arguments and
    outputs through unchanged; None otherwise. Checked by calling ``artifact(*args)`` once
    and recording what reaches ``call``.

    NOTE: those layers (aot_autograd's runtime wrappers, ``CompiledFxGraph.__call__``) and
    ``call``'s int -> tensor conversion cost ~150 us of Python a call; a per-layer replay
    makes one call per decoder layer (SmolLM2: 30 a step, ~10% of a decode step).
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
