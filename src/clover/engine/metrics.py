"""Serving metrics: counters, gauges and histograms, written out in the Prometheus text format.

Hand-written (no prometheus_client dependency): a `Registry` holds named metric families, each
family holds one value per label set, and `Registry.render()` produces the text exposition format
(version 0.0.4). Every method is thread-safe: the engine thread and the server's event loop both
record. `EngineMetrics` names the metrics the engine and the server keep.
"""

from __future__ import annotations

import math
import threading

# Seconds: a tiny CPU model answers in milliseconds, a large GPU model in tens of seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATIO_BUCKETS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if float(x).is_integer():
        return str(int(x))
    return repr(float(x))


class _Family:
    kind = ""

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict | None) -> tuple[str, ...]:
        labels = labels or {}
        if set(labels) != set(self.label_names):
            raise ValueError(f"metric {self.name} takes labels {self.label_names}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Family):
    kind = "counter"

    def __init__(self, name, help, labels=()):
        super().__init__(name, help, labels)
        self._values: dict[tuple, float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (got {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in items]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Histogram(_Family):
    kind = "histogram"

    def __init__(self, name, help, buckets=LATENCY_BUCKETS, labels=()):
        super().__init__(name, help, labels)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._data: dict[tuple, list] = {}      # key -> [bucket counts..., sum, count]
        if not labels:
            self._data[()] = [0] * len(self.buckets) + [0.0, 0]

    def observe(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            row = self._data.setdefault(key, [0] * len(self.buckets) + [0.0, 0])
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    row[i] += 1        # cumulative counts, as the exposition format wants
            row[-2] += value
            row[-1] += 1

    def count(self, **labels) -> int:
        with self._lock:
            row = self._data.get(self._key(labels))
            return row[-1] if row else 0

    def sum(self, **labels) -> float:
        with self._lock:
            row = self._data.get(self._key(labels))
            return row[-2] if row else 0.0

    def lines(self) -> list[str]:
        out = []
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._data.items())
        for key, row in items:
            for bound, n in zip(self.buckets, row):
                le = 'le="' + _number(bound) + '"'
                out.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {n}")
            out.append(f"{self.name}_sum{_labels(self.label_names, key)} {_number(row[-2])}")
            out.append(f"{self.name}_count{_labels(self.label_names, key)} {row[-1]}")
        return out


class Registry:
    """An ordered set of metric families; `render()` is the body of GET /metrics."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self):
        self._families: dict[str, _Family] = {}

    def add(self, family: _Family) -> _Family:
        if family.name in self._families:
            raise ValueError(f"metric {family.name} is registered twice")
        self._families[family.name] = family
        return family

    def counter(self, name, help, labels=()) -> Counter:
        return self.add(Counter(name, help, labels))

    def gauge(self, name, help, labels=()) -> Gauge:
        return self.add(Gauge(name, help, labels))

    def histogram(self, name, help, buckets=LATENCY_BUCKETS, labels=()) -> Histogram:
        return self.add(Histogram(name, help, buckets, labels))

    def render(self) -> str:
        lines = []
        for family in self._families.values():
            lines += family.header() + family.lines()
        return "\n".join(lines) + "\n"


class EngineMetrics:
    """The metrics of one engine (and the server in front of it), all in one registry."""

    def __init__(self, prefix: str = "clover"):
        r = self.registry = Registry()
        p = prefix
        self.requests = r.counter(f"{p}_requests_total", "Requests that finished, by finish reason.", ("finish_reason",))
        self.rejected = r.counter(f"{p}_requests_rejected_total", "Requests refused before decoding, by reason.",
                                  ("reason",))
        self.prompt_tokens = r.counter(f"{p}_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = r.counter(f"{p}_generation_tokens_total", "Tokens generated.")
        self.sequence_forwards = r.counter(
            f"{p}_sequence_forwards_total",
            "Forwards summed over sequences (a batched forward counts once per row); prefills excluded.")
        self.steps = r.counter(f"{p}_engine_steps_total", "Decoder steps (each: prefills, one block forward, "
                               "one causal forward).")
        self.step_errors = r.counter(f"{p}_engine_step_errors_total", "Decoder steps that raised.")
        self.tokens_per_forward = r.gauge(
            f"{p}_tokens_per_forward", "Generated tokens / sequence forwards of the requests finished so far.")
        self.queue_depth = r.gauge(f"{p}_queue_depth", "Requests waiting for a slot in the running batch.")
        self.batch_size = r.gauge(f"{p}_batch_size", "Requests in the running batch.")
        self.cache_bytes = r.gauge(f"{p}_cache_reserved_bytes",
                                   "State-pool bytes in use or promised to running requests (prefix-cache entries included).")
        self.pool_free_pages = r.gauge(f"{p}_state_pool_free_pages", "K/V pages of the state pool not in use.")
        self.pool_pages = r.gauge(f"{p}_state_pool_pages", "K/V pages of the state pool (32 tokens each).")
        self.prefix_lookups = r.gauge(f"{p}_prefix_cache_lookups_total", "Prompts looked up in the prefix cache.")
        self.prefix_hits = r.gauge(f"{p}_prefix_cache_hits_total", "Prompts that started from a cached prefix.")
        self.prefix_reused_tokens = r.gauge(f"{p}_prefix_cache_reused_tokens_total",
                                            "Prompt tokens taken from the prefix cache instead of prefilled.")
        self.prefix_entries = r.gauge(f"{p}_prefix_cache_entries", "Prefixes held by the prefix cache.")
        self.step_batch = r.histogram(f"{p}_step_batch_size", "Running requests per decoder step.", BATCH_BUCKETS)
        self.step_seconds = r.histogram(f"{p}_step_seconds", "Duration of one decoder step.")
        self.queue_seconds = r.histogram(f"{p}_queue_wait_seconds", "Time from submission to admission.")
        self.ttft_seconds = r.histogram(f"{p}_time_to_first_token_seconds",
                                        "Time from submission to the first resolved tokens (first block).")
        self.latency_seconds = r.histogram(f"{p}_request_latency_seconds", "Time from submission to finish.")
        self.request_tpf = r.histogram(f"{p}_request_tokens_per_forward", "Tokens per forward of each request.",
                                       RATIO_BUCKETS)
        self.http_requests = r.counter(f"{p}_http_requests_total", "HTTP requests answered, by route and status.",
                                       ("route", "status"))

        self._finished = [0, 0]          # tokens, forwards of finished requests
        self._lock = threading.Lock()

    def request_finished(self, finish_reason: str, generated: int, forwards: int, latency: float) -> None:
        self.requests.inc(finish_reason=finish_reason)
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

    def render(self) -> str:
        return self.registry.render()
