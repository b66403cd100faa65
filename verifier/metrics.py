"""The verifier's Prometheus metrics, read from its engines when scraped (nothing on the hot path).

``pardec_verifier_requests_total{method,status}`` and ``..._request_duration_seconds{method}``
come from the server interceptor (pardec.runtime.metrics). The collector adds, summed over the engines
of all devices: ``pardec_verifier_sessions`` (sessions holding KV cache), ``..._queue_depth``
(calls waiting for a forward), ``..._kv_cache_usage_perc`` (as vLLM's gpu_cache_usage_perc, 0..1),
``..._kv_pool_touched_bytes`` (blocks ever handed out: the pool's share of the process's memory),
``..._forwards_total``, ``..._forward_tokens_total`` (rows through the model), ``..._verify_steps_total``,
``..._prefill_chunks_total`` and ``..._forward_seconds_total`` (so rate(seconds)/rate(forwards)
is the mean step time and rate(tokens)/rate(forwards) the mean batch in tokens), and
``..._prompt_tokens_total`` with ``..._prefix_cache_hit_tokens_total`` (their ratio: the prefix
cache's hit rate).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pardec.runtime.metrics import RequestMetrics, RequestMetricsInterceptor, new_registry

if TYPE_CHECKING:
    from pardec.verifier.engine.interface import ServingEngine


class _EngineCollector(Collector):
    def __init__(self, engines: list):
        self._engines = engines

    def collect(self):
        engines = self._engines
        yield GaugeMetricFamily("pardec_verifier_sessions", "Sessions holding KV cache",
                                value=sum(e.sessions for e in engines))
        yield GaugeMetricFamily("pardec_verifier_queue_depth", "Calls waiting for a forward",
                                value=sum(e.queue_depth for e in engines))
        total = sum(e.pool.n_blocks * e.pool.block_tokens for e in engines)
        free = sum(e.pool.free_tokens for e in engines)
        yield GaugeMetricFamily("pardec_verifier_kv_cache_usage_perc", "Fraction of the KV pool in use (0..1)",
                                value=(total - free) / total if total else 0.0)
        yield GaugeMetricFamily("pardec_verifier_kv_pool_touched_bytes",
                                "Bytes of KV pool blocks ever handed out: the pool's committed pages, bounded by kv_pool_tokens",
                                value=sum(e.pool.touched_bytes for e in engines))
        for name, field, documentation in (
            ("forwards", "forwards", "Forward passes of the model"),
            ("forward_tokens", "rows", "Tokens through the model (all sessions, prefill and trees)"),
            ("verify_steps", "verify_steps", "Verify steps (one session's tree in one forward)"),
            ("prefill_chunks", "prefill_chunks", "Prefill chunks (a prompt may take several forwards)"),
            ("forward_seconds", "forward_seconds", "Wall time spent in forward passes"),
            ("prompt_tokens", "prompt_tokens", "Prompt tokens admitted (prefilled or found cached)"),
            ("prefix_cache_hit_tokens", "cached_prompt_tokens",
             "Prompt tokens whose keys and values came from the prefix cache, no forward"),
        ):
            yield CounterMetricFamily(f"pardec_verifier_{name}", documentation,
                                      value=sum(getattr(e.stats, field) for e in engines))


def verifier_metrics(engine: ServingEngine) -> tuple[CollectorRegistry, RequestMetricsInterceptor]:
    """A registry for ``engine`` (an Engine or Workers) and the interceptor that counts its RPCs."""
    registry = new_registry()
    registry.register(_EngineCollector(list(getattr(engine, "engines", [engine]))))
    return registry, RequestMetricsInterceptor(RequestMetrics(registry, "pardec_verifier"))
