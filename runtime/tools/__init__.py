"""rung.runtime.tools: verify and warmup, built on the engine's public hooks."""
