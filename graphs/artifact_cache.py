"""On-disk cache of compiled CPU graphs, so a second start loads instead of compiling.

One entry per graph: ``<root>/<key>/artifact.bin`` (inductor's saved artifact) and
``meta.json`` (the names of its flat inputs, in order). The key hashes everything the
compiled code depends on: torch version, rung's traced source (core, kernels, models,
graphs), the model config and dtype, inductor options, the graph's size, the shapes,
strides and dtypes of every tensor it may read (weights, KV caches, input buffers), and
the metadata constants traced into it (block size, keys read).

NOTE: weight VALUES are not in the key: weights are inputs of the artifact, never baked
into it, so new weights of the same config reuse the same compiled code.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

KV_WIDTH = "kv_width"    # the one int input: blocks read per request, set at each replay
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


def tensor_signature(t: torch.Tensor) -> list:
    return [list(t.shape), list(t.stride()), str(t.dtype), str(t.device)]


def memory_identity(t: torch.Tensor) -> tuple:
    """What a view reads: two view objects of one buffer slice compare equal."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


class ArtifactCache:
    """Compiled graphs of one model configuration under ``root``."""

    def __init__(self, root: Path, model_key: dict[str, Any]) -> None:
        self.root = Path(root) / "compiled"
        self.model_key = {**model_key, "torch": torch.__version__, "rung_source": source_hash()}

    def key(self, graph_key: dict[str, Any], named: dict[str, torch.Tensor]) -> str:
        payload = {**self.model_key, **graph_key,
                   "tensors": {n: tensor_signature(t) for n, t in named.items()}}
        text = json.dumps(payload, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def load(self, key: str, named: dict[str, torch.Tensor]
             ) -> tuple[Any, list[torch.Tensor]] | None:
        """(artifact, its flat inputs) or None when absent; a corrupt entry is removed."""
        entry = self.root / key
        if not (entry / "meta.json").exists():
            return None
        try:
            meta = json.loads((entry / "meta.json").read_text())
            inputs = [named[name] if name != KV_WIDTH else 0 for name in meta["input_names"]]
            artifact = torch._inductor.CompiledArtifact.load(path=str(entry / "artifact.bin"),
                                                              format="binary")
        except Exception as e:  # noqa: BLE001 - any unreadable entry is rebuilt
            logger.warning("compiled graph cache entry %s is unreadable (%s: %s); rebuilding",
                           entry, type(e).__name__, e)
            self.discard(key)
            return None
        return artifact, inputs

    def save(self, key: str, artifact: Any, inputs: list[torch.Tensor],
             named: dict[str, torch.Tensor]) -> None:
        """Write the entry atomically (a rename), naming each flat input."""
        by_identity: dict[tuple, str] = {}
        for name, t in named.items():
            by_identity.setdefault(memory_identity(t), name)
        names = [by_identity.get(memory_identity(t)) if isinstance(t, torch.Tensor) else KV_WIDTH
                 for t in inputs]
        if None in names:
            logger.warning("compiled graph reads a tensor rung cannot name; not cached")
            return
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=".tmp-"))
        try:
            artifact.save(path=str(tmp / "artifact.bin"), format="binary")
            (tmp / "meta.json").write_text(json.dumps({"input_names": names,
                                                       "model": self.model_key}, default=str))
            self.discard(key)
            os.replace(tmp, self.root / key)
        except Exception as e:  # noqa: BLE001 - a cache that cannot be written is skipped
            logger.warning("could not cache a compiled graph under %s: %s", self.root, e)
            shutil.rmtree(tmp, ignore_errors=True)

    def discard(self, key: str) -> None:
        shutil.rmtree(self.root / key, ignore_errors=True)
