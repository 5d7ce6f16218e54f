"""rung.runtime: the public API."""

from rung.runtime.engine import LLMEngine
from rung.runtime.llm import LLM
from rung.runtime.outputs import CompletionOutput, Logprob, RequestOutput
from rung.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "Logprob", "RequestOutput", "SamplingParams"]
