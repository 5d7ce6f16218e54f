"""rung.runtime.api: the embedded API a user calls (LLM, parallel sampling)."""
