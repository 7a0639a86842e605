"""Prometheus metrics, named after vLLM's (`vllm:` -> `tandem:`), in a registry of the app's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "tandem:"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens", registry=r,
                             buckets=_LATENCY)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, end to end", registry=r,
                             buckets=_LATENCY)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(PREFIX + "request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.disconnects = Counter(PREFIX + "client_disconnects", "Requests whose client went away", registry=r)
        self.running = Gauge(PREFIX + "num_requests_in_flight", "Requests the gateway is serving", registry=r)
        self.engine_running = Gauge(PREFIX + "num_requests_running", "Sequences the engine is decoding", registry=r)
        self.engine_waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for KV cache", registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of KV cache blocks in use", registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Running requests paused to free KV blocks",
                                   registry=r)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.prefix_hit_rate = Gauge(PREFIX + "prefix_cache_hit_rate", "Prefix cache hits over queries, in tokens",
                                     registry=r)
        self._last: dict[tuple[str, str], int] = {}  # (address, name): a service's cumulative count at the last poll

    def engine(self, stats: dict) -> None:
        """The dense services' stats (address -> GetStatsResponse, the ones that answered), summed."""
        total = lambda name: sum(getattr(s, name) for s in stats.values())  # noqa: E731
        self.engine_running.set(total("running"))
        self.engine_waiting.set(total("waiting"))
        blocks = total("kv_blocks_total")
        self.kv_usage.set(total("kv_blocks_used") / blocks if blocks else 0.0)
        for address, s in stats.items():
            for counter, name in ((self.preemptions, "preemptions"), (self.prefix_queries, "prefix_cache_queries"),
                                  (self.prefix_hits, "prefix_cache_hits")):
                self._add(counter, (address, name), getattr(s, name))
        queries = total("prefix_cache_queries")
        self.prefix_hit_rate.set(total("prefix_cache_hits") / queries if queries else 0.0)

    def _add(self, counter: Counter, key: tuple[str, str], total: int) -> None:
        """Adds what a cumulative count of one service's grew by (all of it after a restart)."""
        last = self._last.get(key, 0)
        counter.inc(total - last if total >= last else total)
        self._last[key] = total
