"""Resident weight memory of a GGUF file's default load against the file's tensor bytes
(the header's per-tensor sizes): the model's parameters and buffers, each storage counted
once (a tied head and its embedding share one), split into block rows and float tensors.

    python -m rung.bench.gguf_memory --model smollm2-135m --model FILE.gguf
"""

from __future__ import annotations

import argparse

import torch

from rung.models import loader

MIB = 1 << 20


def file_tensor_bytes(path: str) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def resident_bytes(net: torch.nn.Module) -> tuple[int, int, int]:
    """(block rows, float tensors, largest float tensor) bytes, one count a storage."""
    storages: dict[int, tuple[int, bool]] = {}
    largest = 0
    for t in [*net.parameters(), *net.buffers()]:
        key = t.untyped_storage().data_ptr()
        storages[key] = (t.untyped_storage().nbytes(), t.is_floating_point())
        if t.is_floating_point():
            largest = max(largest, t.numel() * t.element_size())
    rows = sum(n for n, is_float in storages.values() if not is_float)
    floats = sum(n for n, is_float in storages.values() if is_float)
    return rows, floats, largest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", default=None)
    args = p.parse_args()
    for model in args.model or ["smollm2-135m"]:
        path = loader.resolve_model_path(model)
        net = loader.load_model(model, torch.float32, "cpu").model
        rows, floats, largest = resident_bytes(net)
        file_bytes = file_tensor_bytes(path)
        print(f"{model}: file tensors {file_bytes / MIB:.1f} MiB, block rows "
              f"{rows / MIB:.1f} MiB, float tensors {floats / MIB:.1f} MiB (largest "
              f"{largest / MIB:.2f}), resident / file {(rows + floats) / file_bytes:.3f}")


if __name__ == "__main__":
    main()
