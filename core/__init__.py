"""Contracts shared by every layer of rung: the batch descriptor, graph modes, KV cache specs,
attention metadata and the forward context. A leaf: it imports nothing else from rung, so
``kernels`` and ``graphs`` depend on it without depending on ``runtime``."""
