"""rung.runtime.engine: the step loop (`LLMEngine`) and what it calls per request."""

from rung.runtime.engine.llm_engine import LLMEngine
from rung.runtime.engine.processor import Prompt

__all__ = ["LLMEngine", "Prompt"]
