"""How many Triton kernel variants this process has compiled: a number that must not grow
once warm-up is over (a JIT compile mid-serving stalls every request for seconds).

On CUDA the count is read from Triton's own JIT caches. Under the interpreter nothing is
compiled, so each launch's specialization key is worked out here the way Triton would
(constexprs; integers by ==1 and %16 unless ``do_not_specialize``; tensors by dtype and
16-byte alignment) and distinct keys are counted.

NOTE: like Triton's cache it mirrors, the registry is process-wide: the kernels are
module-level objects shared by every engine in the process.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class KernelVariants:
    def __init__(self) -> None:
        self.kernels: dict[str, Any] = {}            # name -> JITFunction / InterpretedFunction
        self._keys: set[tuple] = set()               # modeled keys (interpreter only)

    def register(self, name: str, kernel: Any) -> None:
        self.kernels[name] = kernel

    def note_launch(self, name: str, args: tuple, constexprs: dict[str, Any]) -> None:
        """Record the variant of one launch (interpreter only: Triton counts on CUDA)."""
        kernel = self.kernels[name]
        key = (name, specialization_key(kernel, args, constexprs))
        if key not in self._keys:
            self._keys.add(key)
            logger.debug("new %s variant: %s", name, constexprs)

    def count(self) -> int:
        """Variants compiled so far: Triton's cache entries, or modeled keys."""
        cached = [_jit_cache_entries(k) for k in self.kernels.values()]
        if any(c is not None for c in cached):
            return sum(c or 0 for c in cached)
        return len(self._keys)


def specialization_key(kernel: Any, args: tuple, constexprs: dict[str, Any]) -> tuple:
    names = list(getattr(kernel, "arg_names", []))[:len(args)]
    no_spec = _do_not_specialize(kernel, names)
    parts = [tuple(sorted((k, str(v)) for k, v in constexprs.items()))]
    for name, value in zip(names, args):
        parts.append(_arg_key(value, name in no_spec))
    return tuple(parts)


def _arg_key(value: Any, no_spec: bool) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("ptr", str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        width = "i32" if -2**31 <= value < 2**31 else "i64"
        return (width,) if no_spec else (width, value == 1, value % 16 == 0)
    if isinstance(value, float):
        return ("fp32",)
    return ("other", type(value).__name__)


def _do_not_specialize(kernel: Any, names: list[str]) -> set[str]:
    raw = getattr(kernel, "do_not_specialize", None)
    if raw is None:                                   # InterpretedFunction keeps kwargs
        raw = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    return {names[i] if isinstance(i, int) else i for i in raw}


def _jit_cache_entries(kernel: Any) -> int | None:
    """Compiled variants in a JITFunction's per-device caches (None: not a JITFunction).

    NOTE: ``device_caches[device]`` is a tuple whose first item is the kernel cache dict
    (Triton 3.x; later items changed between releases).
    """
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return None
    return sum(len(entry[0]) for entry in caches.values())


KERNEL_VARIANTS = KernelVariants()
