"""rung.server: `rung serve`, an OpenAI-compatible HTTP server on top of the public API.

It is a tool on top of ``rung.runtime`` (``LLMEngine``'s step API, ``SamplingParams``,
outputs), never a second engine: one owner, in a process of its own (`engine_process`)
or on a thread, runs the engine's step loop (`engine_loop`); the HTTP handlers (`app`)
hand requests to it and read their outputs from per-request streams. Nothing in rung
imports this package but the CLI, and it imports only ``rung.runtime`` itself
(tests/test_import_graph.py holds both rules). It needs the ``serve`` extra:
``pip install 'rung[serve]'``.
"""
