"""Tool calls on /v1/chat/completions: a request's ``tools`` and ``tool_choice`` -> the
constraint on the output, and the output -> OpenAI's ``tool_calls``.

``tool_choice`` "required" or a named function constrains the output to a JSON object
``{"name": ..., "arguments": {...}}`` whose arguments follow that tool's ``parameters``
schema (model-independent, as vLLM does); "auto" (the default with tools) leaves the
output free and reads the ``<tool_call>{...}</tool_call>`` blocks of Qwen / Hermes-style
templates out of it; "none" ignores the tools for the output (the template still sees
them).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from rung.server.protocol import BadRequest

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclasses.dataclass
class ToolPlan:
    mode: str                         # "none" | "auto" | "forced"
    tools: list[dict]                 # the request's tool definitions (for the template)
    schema: dict | None = None        # forced: what the output must follow


def plan(tools: Any, tool_choice: Any) -> ToolPlan | None:
    """None without tools; 400s name ``tools`` or ``tool_choice``."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise BadRequest(f"tool_choice={tool_choice!r} needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise BadRequest("tools must be a non-empty list of {'type': 'function', "
                         "'function': {'name', 'parameters'}}", "tools")
    params: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not fn["name"]):
            raise BadRequest(f"tools[{i}] is not {{'type': 'function', 'function': "
                             "{'name': ..., 'parameters': {...}}}", "tools")
        schema = fn.get("parameters", {"type": "object"})
        if not isinstance(schema, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object",
                             "tools")
        params[fn["name"]] = schema
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto"):
        return ToolPlan(choice, tools)
    if choice == "required":
        names = list(params)
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)
          and choice["function"].get("name") in params):
        names = [choice["function"]["name"]]
    else:
        raise BadRequest(f"tool_choice={choice!r} is invalid: must be 'none', 'auto', "
                         "'required' or {'type': 'function', 'function': {'name': <one of "
                         f"{list(params)}>}}}}", "tool_choice")
    calls = [{"type": "object", "properties": {"name": {"const": n},
                                               "arguments": params[n]},
              "required": ["name", "arguments"], "additionalProperties": False}
             for n in names]
    return ToolPlan("forced", tools, calls[0] if len(calls) == 1 else {"anyOf": calls})


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def parse(plan_: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished output."""
    if plan_.mode == "forced":
        try:
            call = json.loads(text)
        except json.JSONDecodeError:
            return text, []                # cut short (length): the text as it came
        return None, [_call(call["name"], call["arguments"])]
    if plan_.mode == "auto":
        calls = []
        for block in _TOOL_CALL.findall(text):
            try:
                call = json.loads(block)
            except json.JSONDecodeError:
                continue
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                calls.append(_call(call["name"], call.get("arguments", {})))
        if calls:
            rest = _TOOL_CALL.sub("", text).strip()
            return rest or None, calls
    return text, []
