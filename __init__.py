"""rung: the package's top level, vLLM's: ``from rung import LLM, SamplingParams``.

Every name is `rung.runtime`'s, resolved lazily so ``import rung`` (and `rung --help`)
stays cheap until a name is used.
"""

import importlib

_RUNTIME_EXPORTS = ("LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput",
                    "CompletionOutput", "Logprob")

__all__ = list(_RUNTIME_EXPORTS)


def __getattr__(name: str):
    if name in _RUNTIME_EXPORTS:
        return getattr(importlib.import_module("rung.runtime"), name)
    raise AttributeError(f"module 'rung' has no attribute {name!r}")
