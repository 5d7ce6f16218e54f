"""rung.runtime: the public API (`LLM`, `LLMEngine`, `SamplingParams`, outputs).

Names resolve lazily so importing `rung.runtime` stays cheap until a name is used.
"""

import importlib

_EXPORTS = {
    "LLM": "rung.runtime.api.llm",
    "LLMEngine": "rung.runtime.engine.llm_engine",
    "SamplingParams": "rung.runtime.sampling_params",
    "RequestOutputKind": "rung.runtime.sampling_params",
    "StructuredOutputsParams": "rung.runtime.structured",
    # checks a structured-output spec (the server's 400s, away from the engine)
    "GrammarCompiler": "rung.runtime.structured",
    # why max_tokens cannot follow a prompt within max_model_len (server and CLI refuse)
    "context_overflow": "rung.runtime.sampling_params",
    "RequestOutput": "rung.runtime.outputs",
    "CompletionOutput": "rung.runtime.outputs",
    "Logprob": "rung.runtime.outputs",
    # conversation -> {"prompt", "prompt_token_ids"} with a model's chat template
    "apply_chat_template": "rung.models.chat_template",
    # one conversation -> its prompt text (no tokenizer needed)
    "render_chat": "rung.models.chat_template",
    # a prompt's token ids, or TooManyTokens found without encoding all of a long one
    "encode_within": "rung.models.tokenizer",
    "TooManyTokens": "rung.models.tokenizer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rung.runtime' has no attribute {name!r}")
