"""Serving metrics: the engine's and the server's counters, gauges and histograms (prometheus_client).

Each `EngineMetrics` has a registry of its own (a process may hold several engines); `render()` is the
body of GET /metrics. prometheus_client is thread-safe: the engine thread and the server's event loop
both record.
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: a tiny CPU model answers in milliseconds, a large GPU model in tens of seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATIO_BUCKETS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0)


class EngineMetrics:
    """The metrics of one engine (and the server in front of it), all in one registry."""

    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("clover_requests_total", "Requests that finished, by finish reason.",
                                ("finish_reason",), registry=r)
        self.rejected = Counter("clover_requests_rejected_total", "Requests refused before decoding, by reason.",
                                ("reason",), registry=r)
        self.prompt_tokens = Counter("clover_prompt_tokens_total", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("clover_generation_tokens_total", "Tokens generated.", registry=r)
        self.sequence_forwards = Counter(
            "clover_sequence_forwards_total",
            "Forwards summed over sequences (a batched forward counts once per row); prefills excluded.", registry=r)
        self.steps = Counter("clover_engine_steps_total", "Decoder steps (each: prefills, one block forward, "
                             "one causal forward).", registry=r)
        self.step_errors = Counter("clover_engine_step_errors_total", "Decoder steps that raised.", registry=r)
        self.tokens_per_forward = Gauge(
            "clover_tokens_per_forward", "Generated tokens / sequence forwards of the requests finished so far.",
            registry=r)
        self.queue_depth = Gauge("clover_queue_depth", "Requests waiting for a slot in the running batch.", registry=r)
        self.batch_size = Gauge("clover_batch_size", "Requests in the running batch.", registry=r)
        self.cache_bytes = Gauge(
            "clover_cache_reserved_bytes",
            "State-pool bytes in use or promised to running requests (prefix-cache entries included).", registry=r)
        self.pool_free_pages = Gauge("clover_state_pool_free_pages", "K/V pages of the state pool not in use.",
                                     registry=r)
        self.pool_pages = Gauge("clover_state_pool_pages", "K/V pages of the state pool (32 tokens each).", registry=r)
        # the prefix cache's own running totals, copied (pool_updated): gauges, as a counter cannot be set
        self.prefix_lookups = Gauge("clover_prefix_cache_lookups_total", "Prompts looked up in the prefix cache.",
                                    registry=r)
        self.prefix_hits = Gauge("clover_prefix_cache_hits_total", "Prompts that started from a cached prefix.",
                                 registry=r)
        self.prefix_reused_tokens = Gauge("clover_prefix_cache_reused_tokens_total",
                                          "Prompt tokens taken from the prefix cache instead of prefilled.", registry=r)
        self.prefix_entries = Gauge("clover_prefix_cache_entries", "Prefixes held by the prefix cache.", registry=r)
        self.step_batch = Histogram("clover_step_batch_size", "Running requests per decoder step.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.step_seconds = Histogram("clover_step_seconds", "Duration of one decoder step.",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("clover_queue_wait_seconds", "Time from submission to admission.",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("clover_time_to_first_token_seconds",
                                      "Time from submission to the first resolved tokens (first block).",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.latency_seconds = Histogram("clover_request_latency_seconds", "Time from submission to finish.",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.request_tpf = Histogram("clover_request_tokens_per_forward", "Tokens per forward of each request.",
                                     buckets=RATIO_BUCKETS, registry=r)
        self.http_requests = Counter("clover_http_requests_total", "HTTP requests answered, by route and status.",
                                     ("route", "status"), registry=r)

        self._finished = [0, 0]          # tokens, forwards of finished requests
        self._lock = threading.Lock()

    def request_finished(self, finish_reason: str, generated: int, forwards: int, latency: float) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        self.sequence_forwards.inc(forwards)
        self.latency_seconds.observe(latency)
        if forwards:
            self.request_tpf.observe(generated / forwards)
        with self._lock:
            self._finished[0] += generated
            self._finished[1] += forwards
            if self._finished[1]:
                self.tokens_per_forward.set(self._finished[0] / self._finished[1])

    def pool_updated(self, stats: dict) -> None:
        """Copy the state pool's figures (StatePool.stats()) into the gauges."""
        self.pool_pages.set(stats["pages"])
        held_pages = stats["pages"] - stats["free_pages"] + stats["reserved_pages"]
        held_slots = stats["slots"] - 1 - stats["free_slots"] + stats["reserved_slots"]     # slot 0: the zero state
        self.cache_bytes.set(held_pages * stats["page_bytes"] + held_slots * stats["slot_bytes"])
        self.pool_free_pages.set(stats["free_pages"])
        self.prefix_lookups.set(stats["prefix_lookups"])
        self.prefix_hits.set(stats["prefix_hits"])
        self.prefix_reused_tokens.set(stats["prefix_reused_tokens"])
        self.prefix_entries.set(stats["prefix_entries"])

    def value(self, sample: str, **labels) -> float:
        """A sample's value as /metrics shows it (`clover_engine_steps_total`, `clover_step_seconds_sum`, …);
        0 for a label set never recorded."""
        return self.registry.get_sample_value(sample, labels) or 0.0

    def render(self) -> str:
        return generate_latest(self.registry).decode()
