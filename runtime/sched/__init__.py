"""rung.runtime.sched: scheduler, KV cache manager (block pools, prefix hashing), requests."""
