"""Chat templates: find a model's Jinja template and render conversations with it."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from typing import Any

Conversation = list[dict[str, Any]]


def load_chat_template(folder: str) -> str | None:
    """An HF folder's template: `chat_template.jinja`, else `tokenizer_config.json`'s key."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):   # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def render_chat(template: str, messages: Conversation, add_generation_prompt: bool = True,
                bos_token: str | None = None, eos_token: str | None = None,
                tools: list[dict] | None = None) -> str:
    """One conversation -> the prompt text the model was trained on (``tools``: OpenAI
    tool definitions, for templates that render them; others ignore them)."""
    from jinja2 import TemplateError

    _check_messages(messages)
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token or "", eos_token=eos_token or "",
                                         tools=tools)
    except (_TemplateError, TemplateError) as e:
        raise ValueError(f"chat template failed: {e}") from None


def apply_chat_template(tokenizer, conversation: Conversation, chat_template: str | None,
                        add_generation_prompt: bool, model: str,
                        tools: list[dict] | None = None,
                        encode: Callable[[str], list[int]] | None = None) -> dict:
    """A conversation -> ``{"prompt", "prompt_token_ids"}`` for ``LLM.generate``;
    ``encode`` tokenizes the rendered text (default: the tokenizer, no special tokens
    added)."""
    if tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer to apply a chat template with")
    template = chat_template or tokenizer.chat_template
    if template is None:
        raise ValueError(f"model {model!r} has no chat template (GGUF metadata "
                         "tokenizer.chat_template, chat_template.jinja or tokenizer_config."
                         "json): pass one (LLM.chat(..., chat_template=...), or "
                         "`rung generate --chat --chat-template FILE`)")
    text = render_chat(template, conversation, add_generation_prompt,
                       bos_token=tokenizer.id_to_token(tokenizer.bos_token_id),
                       eos_token=tokenizer.id_to_token(tokenizer.eos_token_id), tools=tools)
    # NOTE: the template writes the special tokens it wants; encode adds none of its own.
    ids = (tokenizer.encode(text, add_special_tokens=False) if encode is None
           else encode(text))
    return {"prompt": text, "prompt_token_ids": ids}


def _check_messages(messages: Conversation) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("a conversation is a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} is {m!r}; a message is a dict with 'role' and "
                             "'content'")


class _TemplateError(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError("chat templates need jinja2: pip install jinja2") from None
    # NOTE: HF renders templates with trim_blocks / lstrip_blocks; templates rely on it.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent,
                                                                  ensure_ascii=False)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ValueError(f"chat template does not parse: {e}") from None
