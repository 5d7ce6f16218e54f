"""Dequantized GGUF weights on disk, memory-mapped at the next start.

A GGUF file's tensors are block-quantized; serving them in fp32 (or bf16) dequantizes
every tensor (numpy, seconds for SmolLM2) and re-lays the linear weights out for the CPU
GEMM at every start. The first start saves the model's final tensors (after dequantizing,
the dtype cast and the transposed layouts) to ``<root>/weights/<key>.pt``; later starts
map that file (``torch.load(mmap=True)``: pages come from the page cache on first touch,
as llama.cpp maps its own file) and hand the tensors to a freshly built model.

The key is the GGUF file's identity (real path, size, mtime, inode), the dtype and the
source of rung's models and kernels (which decide names, layouts and buffers). An entry
that does not fit the model it is handed to (names, shapes) is removed
and the weights load from the GGUF file again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

_SOURCE_DIRS = ("models", "kernels")


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for folder in _SOURCE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def entry_path(root: Path, gguf_path: str, dtype: torch.dtype) -> Path:
    """Where the weights of ``gguf_path`` in ``dtype`` are cached under ``root``."""
    real = os.path.realpath(gguf_path)
    stat = os.stat(real)
    identity = {"path": real, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                "inode": stat.st_ino, "dtype": str(dtype), "torch": torch.__version__,
                "rung_source": _source_hash()}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return Path(root) / "weights" / f"{key}.pt"


def save_header(entry: Path, header: dict) -> None:
    """Next to the weights: what the GGUF header gave (config, tokenizer, stop ids), so a
    start that maps the weights parses no header (seconds: one numpy view per vocabulary
    string). Skipped when it does not survive JSON unchanged."""
    try:
        text = json.dumps(header)
        if json.loads(text) != header:
            return
        _header_path(entry).write_text(text)
    except (TypeError, ValueError, OSError) as e:
        logger.info("GGUF header not cached (%s: %s)", type(e).__name__, e)


def load_header(entry: Path) -> dict | None:
    """What ``save_header`` wrote for ``entry``, when it and the weights are there."""
    path = _header_path(entry)
    if not (entry.exists() and path.exists()):
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        path.unlink(missing_ok=True)
        return None


def _header_path(entry: Path) -> Path:
    return entry.with_suffix(".header.json")


def _tensors(net: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, tied ones under each of their names."""
    named = dict(net.named_parameters(remove_duplicate=False))
    named.update(net.named_buffers(remove_duplicate=False))
    return named


def _buffers(net: nn.Module) -> dict[str, bool]:
    """Each buffer's name -> whether it is persistent (in the state dict)."""
    return {f"{path}.{leaf}" if path else leaf: leaf not in module._non_persistent_buffers_set
            for path, module in net.named_modules(remove_duplicate=False)
            for leaf in module._buffers if module._buffers[leaf] is not None}


def save(net: nn.Module, entry: Path) -> None:
    """Write ``net``'s tensors to ``entry`` atomically; a cache that cannot be written is
    skipped with a warning."""
    named = _tensors(net)
    first: dict[int, str] = {}
    tensors, aliases = {}, {}
    for name, t in named.items():
        if id(t) in first:
            aliases[name] = first[id(t)]          # a tied weight: one tensor, two names
        else:
            first[id(t)] = name
            tensors[name] = t.detach()
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: torch.save names the archive after the file: no leading dot
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix="tmp-", suffix=".pt.partial")
        os.close(fd)
        torch.save({"tensors": tensors, "aliases": aliases, "buffers": _buffers(net)}, tmp)
        os.replace(tmp, entry)
    except (OSError, RuntimeError) as e:
        logger.warning("could not cache dequantized weights under %s: %s", entry.parent, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def load(net: nn.Module, entry: Path) -> bool:
    """Give ``net`` (built, its weights not loaded) the tensors cached in ``entry``: True
    when it did; False when there is no entry or it does not fit (then it is removed)."""
    if not entry.exists():
        return False
    try:
        saved = torch.load(entry, mmap=True, weights_only=True)
        tensors, aliases, buffers = saved["tensors"], saved["aliases"], saved["buffers"]
        names = set(tensors) | set(aliases)
        named = _tensors(net)
        # NOTE: loading adds buffers (e.g. a tied head's transposed copy), never parameters
        missing = set(named) - names
        added = names - set(named)
        if missing or added - set(buffers):
            raise ValueError(f"names differ from the model's: {sorted(missing or added)[:3]}")
        bad = [n for n, t in named.items() if t.shape != tensors[aliases.get(n, n)].shape]
        if bad:
            raise ValueError(f"{bad[0]} has another shape")
    except Exception as e:  # noqa: BLE001 - any unusable entry is rebuilt
        logger.warning("cached weights %s are unusable (%s: %s); loading the GGUF file",
                       entry, type(e).__name__, e)
        entry.unlink(missing_ok=True)
        _header_path(entry).unlink(missing_ok=True)
        return False
    _assign(net, sorted(names), tensors, aliases, buffers)
    return True


def _assign(net: nn.Module, names: list[str], tensors: dict[str, torch.Tensor],
            aliases: dict[str, str], buffers: dict[str, bool]) -> None:
    """Set every cached parameter and buffer on ``net``; names tied in the cache get one
    shared object, as loading the file leaves them."""
    shared: dict[str, torch.Tensor] = {}
    for name in names:
        source = aliases.get(name, name)
        if source not in shared:
            t = tensors[source]
            shared[source] = t if name in buffers else nn.Parameter(t, requires_grad=False)
        path, _, leaf = name.rpartition(".")
        module = net.get_submodule(path)
        if name in buffers:
            module.register_buffer(leaf, shared[source], persistent=buffers[name])
        else:
            module._parameters[leaf] = shared[source]
