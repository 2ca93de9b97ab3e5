"""``GET /metrics``: Prometheus metrics of one server, in a registry of its own (not prometheus_client's global one).

Read from the engine at scrape time: requests running and waiting, KV cache usage, prompt and generation tokens,
preemptions, and with speculative decoding the draft tokens verified and accepted and the acceptance rate. Kept by
the server as requests run: time to first token, requests by finish reason, and generation tokens per second over
the last ``window`` seconds.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    """One ``engine.stats()`` per scrape, as gauges and counters (the speculative ones where the engine has a
    ``speculator``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        yield GaugeMetricFamily("dtorch:num_requests_running", "Requests in the running batch.", value=s.running)
        yield GaugeMetricFamily("dtorch:num_requests_waiting", "Requests queued for a slot.", value=s.waiting)
        yield GaugeMetricFamily("dtorch:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                                value=s.kv_usage)
        yield CounterMetricFamily("dtorch:prompt_tokens", "Prompt tokens prefilled.", value=s.prompt_tokens)
        yield CounterMetricFamily("dtorch:generation_tokens", "Tokens generated.", value=s.generation_tokens)
        yield CounterMetricFamily("dtorch:num_preemptions", "Sequences preempted for cache space.",
                                  value=s.preemptions)
        if getattr(self.engine, "speculator", None) is not None:  # vLLM's spec_decode names
            yield CounterMetricFamily("dtorch:spec_decode_num_draft_tokens", "Speculative draft tokens verified.",
                                      value=s.spec_draft_tokens)
            yield CounterMetricFamily("dtorch:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                      value=s.spec_accepted_tokens)
            yield GaugeMetricFamily("dtorch:spec_decode_acceptance_rate", "Accepted over verified draft tokens (0..1).",
                                    value=s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0)


class ServerMetrics:
    """The registry behind ``/metrics`` and the hooks the request handlers call."""

    def __init__(self, engine: Any, window: float = 10.0) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.window = window
        # tokens per whole second of the last ``window`` seconds, as a ring: constant memory however many tokens
        # come between two scrapes (not an entry per token)
        self._seconds = [-1] * (math.ceil(window) + 1)  # which second each slot counts
        self._counts = [0] * len(self._seconds)
        self._lock = threading.Lock()
        Gauge("dtorch:generation_tokens_per_second", f"Tokens generated per second over the last {window:g} s.",
              registry=self.registry).set_function(self.tokens_per_second)
        self.ttft = Histogram("dtorch:time_to_first_token_seconds", "Seconds from request to its first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.finished = Counter("dtorch:request_success", "Finished choices by finish reason.",
                                ["finished_reason"], registry=self.registry)

    def tokens(self, count: int) -> None:
        """Record ``count`` new tokens now."""
        if count:
            second = int(time.monotonic())
            slot = second % len(self._seconds)
            with self._lock:
                if self._seconds[slot] != second:  # a second ago by the ring's length: start it again
                    self._seconds[slot], self._counts[slot] = second, 0
                self._counts[slot] += count

    def tokens_per_second(self) -> float:
        """Tokens over the last ``window`` whole seconds (the current one counted too), per second."""
        now = int(time.monotonic())
        with self._lock:
            return sum(n for sec, n in zip(self._seconds, self._counts, strict=True)
                       if now - sec < len(self._seconds)) / self.window

    def render(self) -> bytes:
        return generate_latest(self.registry)
