"""On-disk cache of compiled CPU graphs, so a second start loads instead of compiling.

One entry per graph: ``<root>/<key>/artifact.bin`` (inductor's saved artifact),
``meta.json`` (the names of its flat inputs, in order) and, for an artifact called past
inductor's wrappers (``direct_call``), ``wrapper-<hash>.so``: the C++ wrapper library it calls,
which a later start loads without importing inductor (``load_wrapper``), on a machine
with the same CPU flags and Python (``machine_signature``). The key hashes everything the
compiled code depends on: torch version, rung's traced source (core, kernels, models,
graphs), the model config and dtype, inductor options, the graph's size, the shapes,
strides and dtypes of every tensor it may read (weights, KV caches, input buffers), and
the metadata constants traced into it (block size).

NOTE: weight VALUES are not in the key: weights are inputs of the artifact, never baked
into it, so new weights of the same config reuse the same compiled code. Dimensions traced
symbolic are not in it either (each KV cache's block count, each block table's width), so
engines that differ only in max_num_seqs, max_model_len or KV cache size share entries.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from rung.graphs.capture import memory_identity
from rung.graphs.cpu_compiled.direct_call import DirectCall, load_wrapper

logger = logging.getLogger(__name__)

SIZE_OF = "size_of:"     # an int input: "size_of:<input index>:<dim>", set at each replay
_SOURCE_PACKAGES = ("rung.core", "rung.kernels", "rung.models", "rung.graphs")


def default_cache_dir() -> Path:
    """$RUNG_CACHE_DIR, else the user cache dir ($XDG_CACHE_HOME or ~/.cache)/rung."""
    if os.environ.get("RUNG_CACHE_DIR"):
        return Path(os.environ["RUNG_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rung"


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 of the Python source a traced forward can run."""
    import importlib

    digest = hashlib.sha256()
    for package in _SOURCE_PACKAGES:
        folder = Path(importlib.import_module(package).__file__).parent
        for path in sorted(folder.rglob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def prepare_inductor() -> threading.Event:
    """Import inductor and do what it does once per process before it loads an artifact
    (pick the CPU's vector ISA: a probe built per ISA in subprocesses; hash torch's own
    source, the key every artifact carries), in a thread started at the first call: seconds
    of Python that would otherwise stall the serving thread at its first bind (SmolLM2:
    4.9 s). Set when done."""
    done = threading.Event()
    threading.Thread(target=_prepare_inductor, args=(done,), daemon=True,
                     name="rung-prepare-inductor").start()
    return done


def _prepare_inductor(done: threading.Event) -> None:
    try:
        import torch._inductor.compile_fx  # noqa: F401 - what loading an artifact imports
        import torch._inductor.standalone_compile  # noqa: F401
        from torch._inductor.codecache import torch_key
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()
        torch_key()
    finally:
        done.set()       # NOTE: a failure shows at the bind, as without this


def holds_loadable_build(root: Path, origin: str) -> bool:
    """Whether the disk cache under ``root`` holds an entry of the model ``origin`` (as the
    user named it: preset, file or folder) that this torch and this rung source built, with
    a wrapper library this machine loads without inductor: a start that will most likely
    load its graphs rather than compile them. Read before the model is loaded, so by name:
    the key's model config is not known yet."""
    build = {"torch": torch.__version__, "rung_source": source_hash()}
    machine = machine_signature()
    for path in (Path(root) / "compiled").glob("*/meta.json"):
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        model, wrapper = meta.get("model") or {}, meta.get("wrapper") or {}
        if meta.get("origin") == origin and wrapper.get("machine") == machine and \
                all(model.get(k) == v for k, v in build.items()):
            return True
    return False


def machine_signature() -> str:
    """What a compiled wrapper library needs of the machine that loads it: the CPU's
    instruction-set flags (inductor picks the vector ISA it compiles for from them, and
    ``ATEN_CPU_CAPABILITY`` caps it), the architecture and the Python ABI."""
    flags = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    text = "|".join([platform.machine(), flags.strip(), sys.implementation.cache_tag or "",
                     os.environ.get("ATEN_CPU_CAPABILITY", "")])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tensor_signature(t: torch.Tensor, dynamic_dims: tuple[int, ...] = ()) -> list:
    """Shape (symbolic dims as "*"), layout, dtype and device: what compiled code assumes."""
    shape = ["*" if d in dynamic_dims else n for d, n in enumerate(t.shape)]
    # NOTE: a contiguous tensor's strides follow from its shape, symbolic dims included
    layout = "contiguous" if t.is_contiguous() else list(t.stride())
    return [shape, layout, str(t.dtype), str(t.device)]


def artifact_key(base: dict[str, Any], graph_key: dict[str, Any],
                 named: dict[str, torch.Tensor], dynamic: dict[str, tuple[int, ...]]) -> str:
    """``dynamic``: name -> the dimensions of that tensor traced symbolic."""
    payload = {**base, **graph_key,
               "tensors": {n: tensor_signature(t, dynamic.get(n, ())) for n, t in named.items()}}
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def input_names(inputs: list, sizes: dict[int, tuple[int, int]],
                named: dict[str, torch.Tensor]) -> list[str] | None:
    """A name for each flat input of a traced graph (None if one has no name): a tensor's
    name in ``named``, or "size_of:<input>:<dim>" for a symbolic size."""
    by_identity: dict[tuple, str] = {}
    for name, t in named.items():
        by_identity.setdefault(memory_identity(t), name)
    names = [by_identity.get(memory_identity(t)) if isinstance(t, torch.Tensor)
             else f"{SIZE_OF}{sizes[i][0]}:{sizes[i][1]}" if i in sizes else None
             for i, t in enumerate(inputs)]
    return None if None in names else names


def bind_inputs(names: list[str], named: dict[str, torch.Tensor]
                ) -> tuple[list, dict[int, tuple[int, int]]]:
    """(flat inputs, size inputs) of an artifact whose inputs are ``names``; KeyError if
    ``named`` lacks one."""
    inputs = [0 if name.startswith(SIZE_OF) else named[name] for name in names]
    sizes = {i: tuple(map(int, name.removeprefix(SIZE_OF).split(":")))
             for i, name in enumerate(names) if name.startswith(SIZE_OF)}
    return inputs, sizes


class ArtifactCache:
    """Compiled graphs of one model configuration under ``root``."""

    def __init__(self, root: Path, model_key: dict[str, Any], origin: str | None = None
                 ) -> None:
        self.root = Path(root) / "compiled"
        self.model_key = {**model_key, "torch": torch.__version__, "rung_source": source_hash()}
        self.origin = origin     # the model as the user named it: meta only, never the key

    def key(self, graph_key: dict[str, Any], named: dict[str, torch.Tensor],
            dynamic: dict[str, tuple[int, ...]]) -> str:
        return artifact_key(self.model_key, graph_key, named, dynamic)

    def has(self, key: str) -> bool:
        return (self.root / key / "meta.json").exists()

    def has_wrapper(self, key: str) -> bool:
        """Whether the entry holds a wrapper library built on a machine like this one."""
        return self._wrapper_meta(key) is not None

    def load_wrapper(self, key: str, named: dict[str, torch.Tensor]
                     ) -> tuple[DirectCall, list[str]] | None:
        """(the entry's wrapper library, called directly; the names of its flat inputs),
        loaded without inductor, or None when the entry has no wrapper library built on a
        machine like this one (then ``load`` goes through inductor, which rebuilds what
        this CPU needs)."""
        meta = self._wrapper_meta(key)
        if meta is None:
            return None
        entry, names = self.root / key, meta["input_names"]
        try:
            bind_inputs(names, named)
            file = meta["wrapper"]["file"]
            return load_wrapper(str(entry / file), f"rung_{Path(file).stem.replace('-', '_')}"
                                ), names
        except Exception as e:  # noqa: BLE001 - the artifact itself may still load
            logger.warning("compiled graph cache entry %s: its wrapper library does not load "
                           "(%s: %s); loading the artifact through inductor", entry,
                           type(e).__name__, e)
            return None

    def _wrapper_meta(self, key: str) -> dict | None:
        """The entry's meta.json when it names a wrapper library built on a machine like
        this one (``machine_signature``)."""
        try:
            meta = json.loads((self.root / key / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        wrapper = meta.get("wrapper")
        return meta if wrapper and wrapper.get("machine") == machine_signature() else None

    def load(self, key: str, named: dict[str, torch.Tensor]) -> tuple[Any, list[str]] | None:
        """(artifact, the names of its flat inputs) or None when absent; a corrupt entry
        is removed."""
        entry = self.root / key
        if not (entry / "meta.json").exists():
            return None
        try:
            meta = json.loads((entry / "meta.json").read_text())
            names = meta["input_names"]
            bind_inputs(names, named)
            artifact = torch._inductor.CompiledArtifact.load(path=str(entry / "artifact.bin"),
                                                              format="binary")
        except Exception as e:  # noqa: BLE001 - any unreadable entry is rebuilt
            logger.warning("compiled graph cache entry %s is unreadable (%s: %s); rebuilding",
                           entry, type(e).__name__, e)
            self.discard(key)
            return None
        return artifact, names

    def save(self, key: str, artifact: Any, names: list[str], wrapper: str | None = None
             ) -> None:
        """Write the entry atomically (a rename) with the names of its flat inputs and,
        when given, a copy of the wrapper library ``wrapper`` (``direct_call.wrapper_library``)
        the artifact is called through."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=".tmp-"))
        try:
            artifact.save(path=str(tmp / "artifact.bin"), format="binary")
            meta = {"input_names": names, "model": self.model_key, "origin": self.origin}
            if wrapper is not None:
                # NOTE: named after its content: a process that loaded one library never
                # gets it again for a rebuilt one (a loaded module and its path are cached)
                library = Path(wrapper).read_bytes()
                name = f"wrapper-{hashlib.sha256(library).hexdigest()[:16]}.so"
                (tmp / name).write_bytes(library)
                meta["wrapper"] = {"file": name, "machine": machine_signature()}
            (tmp / "meta.json").write_text(json.dumps(meta, default=str))
            self.discard(key)
            os.replace(tmp, self.root / key)
        except Exception as e:  # noqa: BLE001 - a cache that cannot be written is skipped
            logger.warning("could not cache a compiled graph under %s: %s", self.root, e)
            shutil.rmtree(tmp, ignore_errors=True)

    def discard(self, key: str) -> None:
        shutil.rmtree(self.root / key, ignore_errors=True)
