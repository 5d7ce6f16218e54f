"""rung.runtime.spec: speculative decoding proposers (n-gram, MTP)."""
