"""`/metrics`: Prometheus text format, vLLM's metric names under the `rung:` prefix.

Two sources: the handlers count requests, tokens and latencies as they stream (on the
event loop); the engine's own counters (`LLMEngine.stats()`: KV blocks, graph replays,
eager steps, prefix cache, speculative acceptance) are read from the engine owner at each
scrape.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# NOTE: no `_created` series: scrapers of a serving process do not need them
disable_created_metrics()

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.requests = Counter("rung:requests", "HTTP requests answered, by endpoint and "
                                "status code", labels + ["endpoint", "status_code"], registry=r)
        self.finished = Counter("rung:request_success", "Engine requests finished, by "
                                "finish reason", labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("rung:prompt_tokens", "Prompt tokens of admitted "
                                     "requests", labels, registry=r)
        self.generation_tokens = Counter("rung:generation_tokens", "Generated tokens "
                                         "streamed or returned", labels, registry=r)
        self.ttft = Histogram("rung:time_to_first_token_seconds", "From arrival to the "
                              "first generated token", labels, buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("rung:inter_token_latency_seconds", "Between two outputs of "
                             "one sequence", labels, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("rung:e2e_request_latency_seconds", "From arrival to the last "
                             "token", labels, buckets=_E2E_BUCKETS, registry=r)
        self._engine = _EngineCollector(model_name)
        r.register(self._engine)

    def render(self, stats: dict[str, Any]) -> bytes:
        self._engine.stats = stats
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's counters, from the stats snapshot taken for this scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def describe(self) -> list:
        return []

    def collect(self):
        s, m = self.stats, [self.model_name]
        if not s:
            return
        yield _gauge("rung:num_requests_running", "Requests in the running batch",
                     m, s["num_running"])
        yield _gauge("rung:num_requests_waiting", "Requests waiting for a slot",
                     m, s["num_waiting"])
        yield _gauge("rung:kv_cache_used_blocks", "KV blocks held by requests", m,
                     s["kv_used_blocks"])
        yield _gauge("rung:kv_cache_free_blocks", "KV blocks free (cached ones included)",
                     m, s["kv_free_blocks"])
        yield _gauge("rung:kv_cache_total_blocks", "KV blocks in the pool", m,
                     s["kv_total_blocks"])
        yield _gauge("rung:kv_cache_usage_perc", "Fraction of KV blocks held", m,
                     s["kv_used_blocks"] / max(s["kv_total_blocks"], 1))
        prefix = s["prefix_cache"]
        yield _gauge("rung:prefix_cache_hit_rate", "Prompt tokens served from the prefix "
                     "cache / prompt tokens queried", m, prefix["hit_rate"])
        yield _counter("rung:prefix_cache_queries", "Prompt tokens queried", m,
                       prefix["query_tokens"])
        yield _counter("rung:prefix_cache_hits", "Prompt tokens hit", m, prefix["hit_tokens"])
        yield _counter("rung:eager_steps", "Engine steps run eagerly (no graph)", m,
                       s["eager_steps"])
        replays = CounterMetricFamily("rung:graph_replays", "Graph replays, by mode and "
                                      "padded token count", labels=["model_name", "graph"])
        for graph, count in sorted(s["graph_replays"].items()):
            replays.add_metric(m + [graph], count)
        yield replays
        yield _gauge("rung:graphs_captured", "Graphs live in the graph table", m,
                     s["graphs_captured"])
        yield _counter("rung:num_preemptions", "Requests preempted", m, s["preemptions"])
        spec = s.get("spec")
        if spec is not None:
            yield _counter("rung:spec_decode_num_draft_tokens", "Draft tokens proposed", m,
                           spec["num_draft_tokens"])
            yield _counter("rung:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                           m, spec["num_accepted_tokens"])
            yield _gauge("rung:spec_decode_acceptance_rate", "Accepted / proposed draft "
                         "tokens", m, spec["acceptance_rate"])


def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["model_name"])
    g.add_metric(labels, value)
    return g


def _counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["model_name"])
    c.add_metric(labels, value)
    return c
